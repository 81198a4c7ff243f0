"""OCI image layout directories (`oci:DIR[:TAG]`) as image source and destination.

A layout is `DIR/oci-layout` (`{"imageLayoutVersion": "1.0.0"}`), `DIR/index.json` (an
OCI index whose entries carry the tag as the `org.opencontainers.image.ref.name`
annotation) and `DIR/blobs/sha256/<hex>`.

Also home of VerifyingReader, the digest-checking stream every transport returns.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from builder.oci.base import ImageDestination, ImageSource, Manifest
from builder.oci.documents import document_media_type, load_document
from shoal import mediatypes as mt
from shoal.digest import check_digest, hex_of, verify
from shoal.errors import (
    DigestMismatch,
    FormatError,
    NotFound,
    TransportError,
    UsageError,
)
from shoal.fsutil import fsync_dir as _fsync_dir

REF_NAME = "org.opencontainers.image.ref.name"
LAYOUT_VERSION = "1.0.0"
# Manifests and indexes are small; refuse to buffer anything larger (distribution: 4 MiB).
MAX_MANIFEST_SIZE = 8 << 20
_COPY_CHUNK = 1 << 20


class VerifyingReader(io.RawIOBase):
    """A read-only stream that checks sha256 and size when the data ends.

    `read_fn(n)` returns up to n bytes, b"" at end of data. Reading to EOF raises
    DigestMismatch (naming `what` and `digest`) if the bytes do not hash to `digest`
    or their count differs from `size`; reading more than `size` bytes raises at once.
    """

    def __init__(
        self,
        read_fn: Callable[[int], bytes],
        digest: str,
        size: int | None,
        what: str,
        close_fn: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        self._read_fn = read_fn
        self._close_fn = close_fn
        self._digest = check_digest(digest)
        self._size = size
        self._what = what
        self._hash = hashlib.sha256()
        self._count = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self._done:
            return 0
        view = memoryview(buffer).cast("B")
        want = len(view)
        if self._size is not None:
            # read one byte past the declared size so an overlong blob is noticed
            want = min(want, max(self._size - self._count, 0) + 1)
        data = self._read_fn(want) if want else b""
        if not data:
            self._finish()
            return 0
        self._count += len(data)
        if self._size is not None and self._count > self._size:
            self._done = True
            raise DigestMismatch(
                f"{self._what}: more than the declared {self._size} bytes (digest {self._digest})"
            )
        self._hash.update(data)
        view[: len(data)] = data
        return len(data)

    def _finish(self) -> None:
        self._done = True
        if self._size is not None and self._count != self._size:
            raise DigestMismatch(
                f"{self._what}: got {self._count} bytes, want {self._size} (digest {self._digest})"
            )
        got = "sha256:" + self._hash.hexdigest()
        if got != self._digest:
            raise DigestMismatch(f"{self._what}: digest mismatch (want {self._digest}, got {got})")

    def close(self) -> None:
        if not self.closed and self._close_fn is not None:
            self._close_fn()
        super().close()


def declared_media_type(data: bytes) -> str | None:
    """A manifest's own `mediaType` field (None if absent); FormatError if it is not a
    well-formed document (builder/oci/documents.py)."""
    declared = load_document(data, "manifest").get("mediaType")
    return declared if isinstance(declared, str) and declared else None


def detect_media_type(data: bytes) -> str:
    """Media type from a manifest's own `mediaType` field, else from its shape."""
    return document_media_type(load_document(data, "manifest"))


class _Layout:
    """Paths of one layout directory."""

    def __init__(self, path: str, tag: str | None) -> None:
        self.root = Path(path)
        self.tag = tag
        self.reference = f"oci:{path}" + (f":{tag}" if tag else "")

    def blob_path(self, digest: str) -> Path:
        # hex_of validates sha256:<64 lowercase hex>: the path cannot leave blobs/sha256
        return self.root / "blobs" / "sha256" / hex_of(digest)

    def read_index(self) -> dict:
        path = self.root / "index.json"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise TransportError(f"{self.reference}: not an OCI layout (no index.json)") from None
        except OSError as exc:
            raise TransportError(f"{self.reference}: cannot read index.json ({exc.strerror})") from None
        index = load_document(data, f"{self.reference}: index.json")
        if not isinstance(index.get("manifests", []), list):
            raise FormatError(f"{self.reference}: index.json is not an OCI index")
        return index

    def read_blob_bytes(self, digest: str, size: int | None, what: str) -> bytes:
        """A small blob (a manifest), verified; NotFound if absent."""
        if size is not None and size > MAX_MANIFEST_SIZE:
            raise FormatError(f"{what}: {size} bytes is too large for a manifest")
        path = self.blob_path(digest)
        try:
            with open(path, "rb") as fh:
                data = fh.read(MAX_MANIFEST_SIZE + 1)
        except FileNotFoundError:
            raise NotFound(f"{what}: not in the layout") from None
        except OSError as exc:
            raise TransportError(f"{what}: cannot read {path} ({exc.strerror})") from None
        if len(data) > MAX_MANIFEST_SIZE:
            raise FormatError(f"{what}: too large for a manifest")
        if size is not None and len(data) != size:
            raise DigestMismatch(f"{what}: got {len(data)} bytes, want {size} (digest {digest})")
        verify(data, digest, what)
        return data


def _ref_name(descriptor: object) -> str | None:
    if not isinstance(descriptor, dict):
        return None
    annotations = descriptor.get("annotations")
    if isinstance(annotations, dict) and isinstance(annotations.get(REF_NAME), str):
        return annotations[REF_NAME]
    return None


class LayoutSource(ImageSource):
    """Reads the image tagged `tag` (or the only image) of a layout directory."""

    def __init__(self, path: str, tag: str | None = None) -> None:
        self._layout = _Layout(path, tag)
        self.reference = self._layout.reference
        root = self._layout.root
        if not root.is_dir():
            raise TransportError(f"{self.reference}: no such directory")
        if not (root / "oci-layout").is_file():
            raise TransportError(f"{self.reference}: not an OCI layout (no oci-layout file)")

    def _root_descriptor(self) -> dict:
        entries = [d for d in self._layout.read_index().get("manifests", []) if isinstance(d, dict)]
        tag = self._layout.tag
        if tag is None:
            if len(entries) == 1:
                return entries[0]
            names = sorted({n for n in map(_ref_name, entries) if n})
            if not entries:
                raise NotFound(f"{self.reference}: the layout holds no image")
            raise UsageError(
                f"{self.reference}: the layout holds {len(entries)} images; name one with "
                f"oci:DIR:TAG (tags: {', '.join(names) or 'none'})"
            )
        matches = [d for d in entries if _ref_name(d) == tag]
        if not matches:
            names = sorted({n for n in map(_ref_name, entries) if n})
            raise NotFound(f"{self.reference}: no image tagged {tag!r} (tags: {', '.join(names) or 'none'})")
        if len(matches) > 1:
            raise FormatError(f"{self.reference}: index.json has {len(matches)} entries tagged {tag!r}")
        return matches[0]

    def get_root(self) -> Manifest:
        desc = self._root_descriptor()
        digest = check_digest(desc.get("digest"), f"{self.reference}: index.json digest")
        size = desc.get("size")
        size = size if isinstance(size, int) and not isinstance(size, bool) else None
        data = self._layout.read_blob_bytes(digest, size, f"{self.reference}: manifest {digest}")
        listed, declared = desc.get("mediaType"), declared_media_type(data)
        if listed and declared and listed != declared:
            raise FormatError(
                f"{self.reference}: index.json says {listed} but the manifest says {declared}"
            )
        media_type = listed if isinstance(listed, str) and listed else detect_media_type(data)
        return Manifest(data=data, media_type=media_type, digest=digest)

    def get_manifest(self, digest: str) -> Manifest:
        digest = check_digest(digest)
        data = self._layout.read_blob_bytes(digest, None, f"{self.reference}: manifest {digest}")
        return Manifest(data=data, media_type=detect_media_type(data), digest=digest)

    def open_blob(self, digest: str, size: int | None = None):
        path = self._layout.blob_path(digest)
        what = f"{self.reference}: blob {digest}"
        try:
            fh = open(path, "rb")  # noqa: SIM115 (the VerifyingReader returned closes it)
        except FileNotFoundError:
            raise NotFound(f"{what}: not in the layout") from None
        except OSError as exc:
            raise TransportError(f"{what}: cannot open ({exc.strerror})") from None
        return VerifyingReader(fh.read, digest, size, what, close_fn=fh.close)

    def read_range(self, digest: str, start: int, end: int) -> bytes:
        path = self._layout.blob_path(digest)
        what = f"{self.reference}: blob {digest}"
        try:
            with open(path, "rb") as fh:
                fh.seek(start)
                data = fh.read(end - start)
        except FileNotFoundError:
            raise NotFound(f"{what}: not in the layout") from None
        except OSError as exc:
            raise TransportError(f"{what}: cannot read ({exc.strerror})") from None
        if len(data) != end - start:
            raise FormatError(f"{what}: ends before byte {end}")
        return data


class LayoutDestination(ImageDestination):
    """Writes into a layout directory, creating it if missing.

    Blobs and index.json are written atomically (temporary file in the same directory,
    fsync, rename). put_root replaces any index.json entry with the same ref name; without
    a tag it adds an untagged entry (replacing an untagged entry with the same digest).
    Concurrent writers to one layout are serialized by an flock on the directory.
    """

    def __init__(self, path: str, tag: str | None = None) -> None:
        self._layout = _Layout(path, tag)
        self.reference = self._layout.reference
        self._init_dir()

    def _init_dir(self) -> None:
        root = self._layout.root
        try:
            if root.exists() and not root.is_dir():
                raise TransportError(f"{self.reference}: exists and is not a directory")
            if root.is_dir() and any(root.iterdir()) and not (root / "oci-layout").is_file():
                raise TransportError(f"{self.reference}: directory is not empty and not an OCI layout")
            (root / "blobs" / "sha256").mkdir(parents=True, exist_ok=True)
            if not (root / "oci-layout").is_file():
                _atomic_write(root / "oci-layout", json.dumps({"imageLayoutVersion": LAYOUT_VERSION}).encode())
        except OSError as exc:
            raise TransportError(f"{self.reference}: cannot create layout ({exc.strerror or exc})") from None

    def has_blob(self, digest: str) -> bool:
        return self._layout.blob_path(digest).is_file()

    def put_blob(self, path: str, digest: str, size: int) -> None:
        """Copy the file in, verifying its size and sha256 on the way (DigestMismatch)."""
        target = self._layout.blob_path(digest)
        if target.is_file():
            return
        what = f"{self.reference}: blob {digest}"
        try:
            with open(path, "rb") as src, _AtomicFile(target) as out:
                reader = VerifyingReader(src.read, digest, size, f"{what} from {path}")
                while chunk := reader.read(_COPY_CHUNK):
                    out.write(chunk)
        except OSError as exc:
            raise TransportError(f"{what}: cannot copy {path} into the layout ({exc.strerror or exc})") from None

    def put_manifest(self, manifest: Manifest) -> None:
        verify(manifest.data, manifest.digest, f"{self.reference}: manifest {manifest.digest}")
        target = self._layout.blob_path(manifest.digest)
        if target.is_file():
            return
        try:
            _atomic_write(target, manifest.data)
        except OSError as exc:
            raise TransportError(f"{self.reference}: cannot write manifest ({exc.strerror or exc})") from None

    def put_root(self, manifest: Manifest) -> None:
        self.put_manifest(manifest)
        entry: dict = {
            "mediaType": manifest.media_type,
            "digest": manifest.digest,
            "size": len(manifest.data),
        }
        tag = self._layout.tag
        if tag:
            entry["annotations"] = {REF_NAME: tag}
        try:
            with _DirLock(self._layout.root):
                self._update_index(entry, tag)
        except OSError as exc:
            raise TransportError(f"{self.reference}: cannot write index.json ({exc.strerror or exc})") from None

    def _update_index(self, entry: dict, tag: str | None) -> None:
        if (self._layout.root / "index.json").exists():
            index = self._layout.read_index()
        else:
            index = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": []}
        kept = []
        for old in index.get("manifests", []):
            name = _ref_name(old)
            if tag and name == tag:
                continue
            if not tag and name is None and isinstance(old, dict) and old.get("digest") == entry["digest"]:
                continue
            kept.append(old)
        kept.append(entry)
        index["manifests"] = kept
        data = json.dumps(index, indent=2).encode() + b"\n"
        _atomic_write(self._layout.root / "index.json", data)


class _AtomicFile:
    """A temporary file next to `target`, fsynced and renamed onto it on success."""

    def __init__(self, target: Path) -> None:
        self._target = target

    def __enter__(self):
        fd, self._tmp = tempfile.mkstemp(dir=self._target.parent, prefix=".tmp-", suffix=".part")
        self._fh = os.fdopen(fd, "wb")
        return self._fh

    def __exit__(self, exc_type, *_: object) -> None:
        try:
            if exc_type is None:
                self._fh.flush()
                os.fsync(self._fh.fileno())
            self._fh.close()
            if exc_type is None:
                os.replace(self._tmp, self._target)
                _fsync_dir(self._target.parent)
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)


def _atomic_write(target: Path, data: bytes) -> None:
    with _AtomicFile(target) as fh:
        fh.write(data)


class _DirLock:
    """An exclusive flock on a directory (serializes index.json read-modify-write)."""

    def __init__(self, path: Path) -> None:
        self._path = path

    def __enter__(self) -> None:
        self._fd = os.open(self._path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)

