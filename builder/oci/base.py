"""Image transports: where `shoal convert` reads images from and writes them to.

Vocabulary:
- a *reference* names an image in a transport: `docker://HOST/REPO:TAG`,
  `docker://HOST/REPO@sha256:...`, `oci:DIR[:TAG]`, `docker-archive:FILE`.
- the *root* of a reference is the manifest or index it points at, as raw bytes plus
  media type. Raw bytes matter: a manifest's digest is the sha256 of exactly those bytes.
- a *descriptor* is the OCI JSON object `{"mediaType", "digest", "size", ...}`.

Contract shared by every implementation:
- Every blob and manifest read is verified against its digest before it is returned or
  fully streamed; a mismatch raises shoal.errors.DigestMismatch naming the digest.
- A blob or manifest the transport does not have raises shoal.errors.NotFound.
- Network and file problems raise shoal.errors.TransportError with a one-line message
  naming the reference and what went wrong (HTTP status, refused connection, ...).
- Writes are idempotent: putting a blob or manifest that is already there is a no-op.
- close() releases sockets and files; sources and destinations are context managers.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import BinaryIO, Self

from builder.oci.documents import MAX_DOCUMENT_BYTES
from shoal.errors import FormatError


@dataclass(frozen=True)
class Manifest:
    """Raw manifest or index bytes as served, with their media type and digest."""

    data: bytes
    media_type: str
    digest: str


class _Closing:
    """A transport end is a context manager: `with` closes it (close() is idempotent)."""

    def close(self) -> None:
        pass

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ImageSource(_Closing, abc.ABC):
    """Reads one image (a manifest or an index and everything it refers to)."""

    reference: str

    @abc.abstractmethod
    def get_root(self) -> Manifest:
        """The manifest or index the reference names."""

    @abc.abstractmethod
    def get_manifest(self, digest: str) -> Manifest:
        """A manifest referred to by digest from the root index."""

    @abc.abstractmethod
    def open_blob(self, digest: str, size: int | None = None) -> BinaryIO:
        """A stream of the blob's bytes.

        The stream raises DigestMismatch from read() at end of data if the bytes do not
        hash to `digest` (or their count differs from `size`), so a consumer that reads
        to EOF never accepts bad bytes silently.
        """

    def read_range(self, digest: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a blob, unverified (a range cannot be checked against the
        blob digest; callers check what they read against the TOC's digests).

        Raises FormatError if the blob ends before `end`. This default streams the blob
        from its start; transports that can seek override it.
        """
        with self.open_blob(digest) as stream:
            remaining = start
            while remaining:
                skipped = stream.read(min(remaining, 1 << 20))
                if not skipped:
                    break
                remaining -= len(skipped)
            data = stream.read(end - start) if not remaining else b""
        if len(data) != end - start:
            raise FormatError(f"{self.reference}: blob {digest} ends before byte {end}")
        return data

    def read_small_blob(self, digest: str, size: int, what: str, limit: int = MAX_DOCUMENT_BYTES) -> bytes:
        """A document-sized blob (an image config, a profile) read to its end, so that
        its digest is checked. FormatError if `size` is more than `limit`."""
        if not 0 <= size <= limit:
            raise FormatError(f"{what}: {size} bytes, more than {limit}")
        with self.open_blob(digest, size) as f:
            data = f.read(size + 1)
            while f.read(65536):
                pass
        return data


class ImageDestination(_Closing, abc.ABC):
    """Writes one image: blobs first, then manifests, then the root under its tag."""

    reference: str

    @abc.abstractmethod
    def has_blob(self, digest: str) -> bool:
        """True if the destination already holds the blob."""

    @abc.abstractmethod
    def put_blob(self, path: str, digest: str, size: int) -> None:
        """Store the file at `path` (whose sha256 is `digest`) as a blob.

        `source` blobs may also be mounted or copied; the file is not removed.
        """

    @abc.abstractmethod
    def put_manifest(self, manifest: Manifest) -> None:
        """Store a manifest by digest (not tagged): used for the children of an index."""

    @abc.abstractmethod
    def put_root(self, manifest: Manifest) -> None:
        """Store the root manifest or index and point the reference's tag at it."""
