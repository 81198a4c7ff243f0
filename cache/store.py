"""The node's chunk store: verified chunk contents by digest, size-bounded, crash-safe.

Vocabulary: a *chunk* is the uncompressed content of one TOC chunk, named by its digest
"sha256:<hex>" (the TOC's chunk digest), so the same bytes in two layers or two images
are stored once, and the store can check what it holds.

Contract:
- get(digest) returns the chunk's bytes, verified against the digest, or None. A stored
  file whose bytes do not match (a disk error, a power loss without fsync) is deleted
  and counted as `corrupt` (and as a miss): nothing unverified leaves the store.
- put(digest, data) checks sha256(data) == digest first (DigestMismatch otherwise),
  then stores atomically (temp file, rename); idempotent. Returns False when the chunk
  cannot be stored without exceeding the capacity (larger than the capacity, or all
  else pinned or being read): the caller still has the bytes, only the caching is lost.
- The stored bytes never exceed `capacity` (bytes of chunk content, not disk blocks),
  with concurrent writers in threads or processes; LRU eviction makes room.
- The disk never fills: a capacity larger than the disk can hold is clamped, and a
  chunk is written only with the file system's reserve still free after eviction
  (cache/content.py: disk_reserve); put() returns False otherwise.
- pin(digests) keeps chunks (present or future) from eviction until unpinned; so do
  running get()s. Pins are per process.
- A kill -9 at any moment leaves no partly written chunk under its name; the next open
  repairs the index (see cache/content.py). The index survives restarts.
- statistics() counts since this object was opened (hits, misses, ...) and reads the
  current size from the index (all processes).

Thread-safe. Several processes may open the same root (see cache/content.py for what
that guarantees); a node runs one.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Self

from cache.content import ContentDir
from shoal.digest import check_digest
from shoal.errors import DigestMismatch


class Pin:
    """Returned by ChunkStore.pin(): already in effect; leaving a `with` block unpins."""

    def __init__(self, store: ChunkStore, digests: list[str]) -> None:
        self._store, self.digests, self._active = store, digests, True

    def release(self) -> None:
        if self._active:
            self._active = False
            self._store.unpin(self.digests)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class ChunkStore:
    """Node-local chunk store under `root` (see the module contract).

    capacity: bytes, or None for the recorded capacity (first start: 20% of the free
    space at `root`). fsync: also survive power loss without losing recent chunks
    (corrupt chunks are caught by verification either way).
    """

    def __init__(self, root: str | os.PathLike, capacity: int | None = None, *, fsync: bool = False) -> None:
        self._dir = ContentDir(root, capacity, fsync=fsync)
        self.root = self._dir.root
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0, "corrupt": 0}

    @property
    def capacity(self) -> int:
        return self._dir.capacity

    def set_capacity(self, capacity: int) -> None:
        self._dir.set_capacity(capacity)

    def _count(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self._counts[k] += v

    def get(self, digest: str) -> bytes | None:
        got = self._read_verified(digest, keep_open=False)
        return None if got is None else got[1]

    def open_verified(self, digest: str) -> int | None:
        """A read-only descriptor of the stored chunk, whose content was verified through
        that very descriptor (a stored file is never written again: a new one is renamed
        over it, and an eviction unlinks it, so the bytes behind the descriptor stay the
        verified ones); None as for get(). The caller closes it."""
        got = self._read_verified(digest, keep_open=True)
        return None if got is None else got[0]

    def _read_verified(self, digest: str, keep_open: bool) -> tuple[int, bytes] | None:
        """(descriptor, content) of the stored chunk, verified, or None (a miss; a corrupt
        file is removed and counted). The descriptor is -1 (closed) unless `keep_open`."""
        check_digest(digest)
        with self._dir.reading(digest):
            try:
                fd = os.open(self._dir.path(digest), os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            except FileNotFoundError:
                self._count(misses=1)
                return None
            good = False
            try:
                data = _read_all(fd)
                good = "sha256:" + hashlib.sha256(data).hexdigest() == digest
            finally:
                if not keep_open or not good:
                    os.close(fd)
            if not good:
                self._count(misses=1, corrupt=1)
                self._dir.remove(digest)
                return None
        self._dir.touch(digest)
        self._count(hits=1, bytes_read=len(data))
        return (fd if keep_open else -1), data

    def put(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        return self.put_many([(digest, data)])[0]

    def put_many(self, items: Sequence[tuple[str, bytes | bytearray | memoryview]], *,
                 verified: bool = False) -> list[bool]:
        """put() for several chunks, committed in one transaction. `verified`: the caller
        has just checked each chunk against its digest (the node's loader does, before it
        serves a byte), so it is not hashed again here."""
        results: dict[int, bool] = {}
        todo: list[tuple[int, str, int, Path]] = []
        try:
            for i, (digest, data) in enumerate(items):
                check_digest(digest)
                if not verified:
                    got = "sha256:" + hashlib.sha256(data).hexdigest()
                    if got != digest:
                        raise DigestMismatch(f"chunk {digest}: bytes hash to {got}; not stored")
                if self._dir.exists(digest):
                    self._dir.touch(digest)
                    results[i] = True
                elif not self._dir.make_room(len(data)):
                    results[i] = False
                else:
                    todo.append((i, digest, len(data), self._dir.write_temp(data)))
        except BaseException:
            for *_, temp in todo:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)
            raise
        if todo:
            stored = self._dir.commit_many([(digest, temp, size) for _, digest, size, temp in todo])
            for (i, _, size, _), ok in zip(todo, stored):
                results[i] = ok
                if ok:
                    self._count(bytes_written=size)
        return [results[i] for i in range(len(items))]

    def contains(self, digest: str) -> bool:
        """A file for `digest` is there (unverified: get() may still find it corrupt)."""
        return self._dir.exists(check_digest(digest))

    def pin(self, digests: Iterable[str]) -> Pin:
        digests = [check_digest(d) for d in digests]
        self._dir.pin(digests)
        return Pin(self, digests)

    def unpin(self, digests: Iterable[str]) -> None:
        self._dir.unpin(digests)

    def remove(self, digest: str) -> bool:
        return self._dir.remove(check_digest(digest))

    def statistics(self) -> dict:
        size, chunks = self._dir.usage()
        with self._lock:
            out = dict(self._counts)
        out.update(
            evictions=self._dir.counters["evictions"], rejected=self._dir.counters["rejected"],
            size_bytes=size, capacity_bytes=self._dir.capacity, chunks=chunks,
        )
        return out

    def check(self) -> dict:
        """Index against files (no bytes read); see ContentDir.check()."""
        return self._dir.check()

    def close(self) -> None:
        self._dir.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_all(fd: int) -> bytes:
    """What the file open at `fd` holds, from its start (one read of its size, as a
    stored file never changes; more only if it is longer than it said)."""
    size = os.fstat(fd).st_size
    data = os.pread(fd, size + 1, 0)  # (one byte more: a file that grew says so here)
    if len(data) <= size:
        return data
    parts, at = [data], len(data)
    while part := os.pread(fd, 1 << 20, at):
        parts.append(part)
        at += len(part)
    return b"".join(parts)
