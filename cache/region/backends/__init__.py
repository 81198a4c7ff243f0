"""Region cache backends: where the region keeps whole blobs, by digest.

One interface, implementations registered by name ("disk", "s3"); the region server
picks one with `backend = NAME` in its configuration (create(name, **options)).

Vocabulary: a *blob* is a whole registry blob named by its digest ("sha256:<hex>"); a
*range* is [start, end) of its bytes.

Contract for every Backend:
- The backend never checks bytes against digests: its caller (the region server)
  verifies a whole blob before put_file(), so a backend only ever holds verified blobs.
  put() (bytes, for tests and small blobs) does check, and raises DigestMismatch.
- put_file(digest, path) takes ownership of the complete file at `path` (it is moved or
  uploaded, then gone). Idempotent. Returns False when the backend cannot keep the blob
  within its capacity (the blob is then not stored; nothing else changes).
- size(), read(), stream() raise BlobNotFound when the blob is not there (never another
  error for "missing"); a range outside [0, size] raises InvalidRange.
- A backend with a capacity never holds more than `capacity` bytes of blobs; it evicts
  the least recently used blobs to make room, but never a blob being streamed by this
  process.
- Every method is blocking and thread-safe: async code calls them in worker threads.
- Failures of the storage itself (disk full, S3 unreachable, access denied) raise
  BackendError with one line naming the backend, the blob and the reason.
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Callable, Iterator
from typing import Protocol

from shoal.errors import DigestMismatch, NotFound, ShoalError


class BackendError(ShoalError):
    """The backend's storage failed (not: the blob is missing)."""


class BlobNotFound(NotFound):
    """The backend does not hold this blob."""


class InvalidRange(BackendError):
    """A range that is not inside the blob."""


class BlobStream(Protocol):
    """What Backend.stream() returns: the range's bytes in pieces; close() releases the
    blob for eviction (idempotent; exhausting the stream releases it too)."""

    def __iter__(self) -> Iterator[bytes]: ...

    def __next__(self) -> bytes: ...

    def close(self) -> None: ...


class Backend(abc.ABC):
    """Whole blobs by digest, with range reads (see the module contract)."""

    name: str = "backend"

    @abc.abstractmethod
    def size(self, digest: str) -> int:
        """The blob's size in bytes; BlobNotFound if missing."""

    @abc.abstractmethod
    def stream(self, digest: str, start: int = 0, end: int | None = None, block: int = 1 << 20) -> BlobStream:
        """Bytes [start, end) (end None: to the end) in pieces of at most `block` bytes.

        BlobNotFound and InvalidRange are raised by this call, before iteration; the
        iterator yields exactly end - start bytes or raises BackendError. Close it (or
        exhaust it) to release the blob for eviction.
        """

    @abc.abstractmethod
    def put_file(self, digest: str, path: str | os.PathLike) -> bool:
        """Store the verified file at `path` as `digest`, taking ownership of the file."""

    @abc.abstractmethod
    def contains(self, digest: str) -> bool:
        """True if the blob is there (cheap)."""

    @abc.abstractmethod
    def delete(self, digest: str) -> bool:
        """Remove the blob; False if it was not there."""

    @abc.abstractmethod
    def temp_path(self) -> str:
        """A fresh path where a caller may write a file to hand to put_file (the same
        file system as the store, where that makes put_file a rename)."""

    @abc.abstractmethod
    def statistics(self) -> dict:
        """At least size_bytes, capacity_bytes (None: unbounded), blobs, evictions."""

    def read(self, digest: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes [start, end) as one bytes object."""
        return b"".join(self.stream(digest, start, end))

    def put(self, digest: str, data: bytes) -> bool:
        """Store `data` after checking it against `digest` (DigestMismatch otherwise)."""
        got = "sha256:" + hashlib.sha256(data).hexdigest()
        if got != digest:
            raise DigestMismatch(f"{self.name} backend: blob {digest}: bytes hash to {got}; not stored")
        path = self.temp_path()
        with open(path, "wb") as fh:
            fh.write(data)
        return self.put_file(digest, path)

    def close(self) -> None:
        pass


def check_range(digest: str, size: int, start: int, end: int | None) -> int:
    """The checked end of [start, end) in a blob of `size` bytes (InvalidRange otherwise)."""
    end = size if end is None else end
    if not 0 <= start <= end <= size:
        raise InvalidRange(f"blob {digest}: range [{start}, {end}) is outside its {size} bytes")
    return end


_REGISTRY: dict[str, Callable[..., Backend]] = {}


def register(name: str) -> Callable:
    """Class decorator: make a Backend available to create() under `name`."""

    def deco(cls):
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def create(name: str, **options) -> Backend:
    """A backend by registered name with its options (ValueError for an unknown name)."""
    if name not in _REGISTRY:
        _load_builtin(name)
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r} (known: {', '.join(sorted(names()))})") from None
    return factory(**options)


def names() -> list[str]:
    return sorted(set(_REGISTRY) | {"disk", "s3"})


def _load_builtin(name: str) -> None:
    # imported on demand: boto3 is needed only by a region that uses S3
    if name == "disk":
        from cache.region.backends import disk  # noqa: F401
    elif name == "s3":
        from cache.region.backends import s3  # noqa: F401
