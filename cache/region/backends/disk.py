"""The disk backend: blobs as files in a size-bounded, content-addressed directory.

The same machinery as the node chunk store (cache/content.py): LRU eviction under a
capacity in bytes, an sqlite index that survives restarts, atomic commits by rename,
recovery after a crash. Blobs are fsync'ed before they are committed by default: range
reads cannot verify a blob, so a power loss must not leave a damaged blob under its name.
"""

from __future__ import annotations

import os

from cache.content import ContentDir
from cache.region.backends import (
    Backend,
    BackendError,
    BlobNotFound,
    BlobStream,
    check_range,
    register,
)
from shoal.digest import check_digest


class _FileStream:
    """Iterator over [start, end) of an open file; releases the read guard when done."""

    def __init__(self, fd: int, start: int, end: int, block: int, release) -> None:
        self._fd, self._pos, self._end, self._block, self._release = fd, start, end, block, release

    def __iter__(self) -> _FileStream:
        return self

    def __next__(self) -> bytes:
        if self._fd < 0 or self._pos >= self._end:
            self.close()
            raise StopIteration
        data = os.pread(self._fd, min(self._block, self._end - self._pos), self._pos)
        if not data:
            self.close()
            raise BackendError(f"disk backend: blob file ended at {self._pos} bytes, before {self._end}")
        self._pos += len(data)
        return data

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
            self._release()

    def __del__(self) -> None:
        self.close()


@register("disk")
class DiskBackend(Backend):
    """Blobs under `root` (the region's --store), at most `capacity` bytes.

    capacity None: the recorded one, or on first start 20% of the free space at root.
    """

    def __init__(self, root: str | os.PathLike, capacity: int | None = None, fsync: bool = True) -> None:
        self._dir = ContentDir(root, capacity, fsync=fsync)
        self.root = self._dir.root

    def size(self, digest: str) -> int:
        try:
            return os.stat(self._dir.path(check_digest(digest))).st_size
        except FileNotFoundError:
            raise BlobNotFound(f"disk backend: blob {digest} not found") from None

    def stream(self, digest: str, start: int = 0, end: int | None = None, block: int = 1 << 20) -> BlobStream:
        check_digest(digest)
        guard = self._dir.reading(digest)
        guard.__enter__()
        try:
            fd = os.open(self._dir.path(digest), os.O_RDONLY)
        except FileNotFoundError:
            guard.__exit__(None, None, None)
            raise BlobNotFound(f"disk backend: blob {digest} not found") from None
        try:
            end = check_range(digest, os.fstat(fd).st_size, start, end)
        except BaseException:
            os.close(fd)
            guard.__exit__(None, None, None)
            raise
        self._dir.touch(digest)
        return _FileStream(fd, start, end, block, lambda: guard.__exit__(None, None, None))

    def local_path(self, digest: str) -> str | None:
        """The file holding the blob (for sendfile), or None if not there."""
        path = self._dir.path(check_digest(digest))
        return str(path) if path.exists() else None

    def put_file(self, digest: str, path: str | os.PathLike) -> bool:
        try:
            return self._dir.commit(check_digest(digest), path)
        except OSError as exc:
            raise BackendError(f"disk backend: cannot store blob {digest}: {exc.strerror or exc}") from None

    def contains(self, digest: str) -> bool:
        return self._dir.exists(check_digest(digest))

    def delete(self, digest: str) -> bool:
        return self._dir.remove(check_digest(digest))

    def temp_path(self) -> str:
        return str(self._dir.temp_path())

    def statistics(self) -> dict:
        size, count = self._dir.usage()
        return {
            "backend": "disk", "root": str(self.root), "size_bytes": size,
            "capacity_bytes": self._dir.capacity, "blobs": count,
            "evictions": self._dir.counters["evictions"], "rejected": self._dir.counters["rejected"],
        }

    def check(self) -> dict:
        return self._dir.check()

    def close(self) -> None:
        self._dir.close()
