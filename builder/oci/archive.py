"""`docker-archive:FILE[:REPO:TAG|:@N]`: a `docker save` tar file as an image source.

`docker save` writes `manifest.json` (a list of `{"Config", "RepoTags", "Layers"}`) and
the files it names: `<id>.json` and `<id>/layer.tar` in the classic format, or
`blobs/sha256/<hex>` since Docker 25. The archive itself may be gzip-compressed (it is
then decompressed once into an anonymous temporary file).

The image is presented as a Docker v2 schema 2 manifest synthesized from the archive:
config = the config file (DOCKER_CONFIG), layers = the layer files, typed by their first
bytes: gzip -> DOCKER_LAYER_GZIP, zstd -> OCI_LAYER_ZSTD, otherwise OCI_LAYER_TAR.
Digests are the sha256 of the files, computed once by streaming when the source is
opened (files already named `blobs/sha256/<hex>` are taken at their name and verified
when streamed). Reads use pread on one file descriptor, so several blob streams may be
open at once.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import posixpath
import shutil
import tarfile
import tempfile
import zlib
from dataclasses import dataclass

from builder.oci.base import ImageSource, Manifest
from builder.oci.layout import VerifyingReader
from shoal import mediatypes as mt
from shoal.digest import check_digest, is_digest, sha256_digest
from shoal.errors import FormatError, NotFound, TransportError

MAX_JSON_SIZE = 64 << 20
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_CHUNK = 1 << 20
_MAX_LINK_DEPTH = 16


@dataclass(frozen=True)
class _Extent:
    """Where a file's bytes sit in the (uncompressed) archive."""

    offset: int
    size: int


class ArchiveSource(ImageSource):
    """One image of a `docker save` archive; see the module docstring."""

    def __init__(self, path: str, image: str | None = None) -> None:
        self.reference = f"docker-archive:{path}" + (f":{image}" if image else "")
        self._path = path
        self._fd = -1
        self._blobs: dict[str, _Extent] = {}
        try:
            self._fd = self._open_fd(path)
            members = self._scan()
            entry = self._select(self._read_manifest_json(members), image)
            self._root = self._synthesize(entry, members)
        except BaseException:
            self.close()
            raise

    # --- opening -------------------------------------------------------------------

    def _open_fd(self, path: str) -> int:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise TransportError(f"{self.reference}: no such file") from None
        except OSError as exc:
            raise TransportError(f"{self.reference}: cannot open ({exc.strerror})") from None
        if os.pread(fd, 2, 0) != _GZIP_MAGIC:
            return fd
        try:
            return self._gunzip_to_temp(fd)
        finally:
            os.close(fd)

    def _gunzip_to_temp(self, fd: int) -> int:
        with tempfile.TemporaryFile(prefix="shoal-archive-") as tmp:
            try:
                with open(fd, "rb", closefd=False) as raw, gzip.GzipFile(fileobj=raw) as src:
                    shutil.copyfileobj(src, tmp, _CHUNK)
                tmp.flush()
                return os.dup(tmp.fileno())
            except (OSError, EOFError, zlib.error) as exc:
                raise FormatError(f"{self.reference}: corrupt gzip archive ({exc})") from None

    def _scan(self) -> dict[str, tarfile.TarInfo]:
        """All members by normalized name (later members win, as on extraction)."""
        try:
            os.lseek(self._fd, 0, os.SEEK_SET)
            with open(self._fd, "rb", closefd=False) as fh, tarfile.open(fileobj=fh, mode="r:") as tar:
                return {_normalize(m.name): m for m in tar.getmembers()}
        except tarfile.TarError as exc:
            raise FormatError(f"{self.reference}: not a tar archive ({exc})") from None
        except OSError as exc:
            raise TransportError(f"{self.reference}: cannot read ({exc.strerror or exc})") from None

    def _read_manifest_json(self, members: dict[str, tarfile.TarInfo]) -> list:
        extent = self._extent(members, "manifest.json")
        if extent.size > MAX_JSON_SIZE:
            raise FormatError(f"{self.reference}: manifest.json is too large")
        try:
            doc = json.loads(self._pread_all(extent))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise FormatError(f"{self.reference}: manifest.json is not valid JSON ({exc})") from None
        if not isinstance(doc, list) or not doc or not all(isinstance(e, dict) for e in doc):
            raise FormatError(f"{self.reference}: manifest.json is not a list of images")
        return doc

    def _select(self, images: list[dict], image: str | None) -> dict:
        """The image named by `REPO:TAG` or `@N`; the first one by default."""
        if image is None:
            return images[0]
        if image.startswith("@"):
            index = int(image[1:])
            if index >= len(images):
                raise NotFound(f"{self.reference}: the archive holds {len(images)} image(s)")
            return images[index]
        want = _familiar(image)
        for entry in images:
            tags = entry.get("RepoTags") or []
            if any(isinstance(t, str) and _familiar(t) == want for t in tags):
                return entry
        known = [t for e in images for t in (e.get("RepoTags") or []) if isinstance(t, str)]
        raise NotFound(f"{self.reference}: no image {image} in the archive (has: {', '.join(known) or 'untagged images'})")

    def _synthesize(self, entry: dict, members: dict[str, tarfile.TarInfo]) -> Manifest:
        config_name, layer_names = entry.get("Config"), entry.get("Layers")
        if not isinstance(config_name, str) or not isinstance(layer_names, list):
            raise FormatError(f"{self.reference}: manifest.json entry lacks Config or Layers")
        config_extent = self._extent(members, config_name)
        if config_extent.size > MAX_JSON_SIZE:
            raise FormatError(f"{self.reference}: config {config_name} is too large")
        config_digest = sha256_digest(self._pread_all(config_extent))
        self._blobs[config_digest] = config_extent
        layers = [self._layer_descriptor(members, name) for name in layer_names]
        manifest = {
            "schemaVersion": 2,
            "mediaType": mt.DOCKER_MANIFEST,
            "config": {"mediaType": mt.DOCKER_CONFIG, "size": config_extent.size, "digest": config_digest},
            "layers": layers,
        }
        data = json.dumps(manifest, indent=3).encode()
        return Manifest(data=data, media_type=mt.DOCKER_MANIFEST, digest=sha256_digest(data))

    def _layer_descriptor(self, members: dict[str, tarfile.TarInfo], name: object) -> dict:
        if not isinstance(name, str):
            raise FormatError(f"{self.reference}: manifest.json has a non-string layer name")
        extent = self._extent(members, name)
        digest = _digest_from_name(name) or self._hash_extent(extent)
        self._blobs[digest] = extent
        magic = os.pread(self._fd, 4, extent.offset) if extent.size else b""
        if magic.startswith(_GZIP_MAGIC):
            media_type = mt.DOCKER_LAYER_GZIP
        elif magic == _ZSTD_MAGIC:
            media_type = mt.OCI_LAYER_ZSTD
        else:
            media_type = mt.OCI_LAYER_TAR
        return {"mediaType": media_type, "size": extent.size, "digest": digest}

    def _extent(self, members: dict[str, tarfile.TarInfo], name: str) -> _Extent:
        """Where member `name` (following links inside the archive) keeps its bytes."""
        current = _safe_name(name, self.reference)
        for _ in range(_MAX_LINK_DEPTH):
            info = members.get(current)
            if info is None:
                raise FormatError(f"{self.reference}: {name} is missing from the archive")
            if info.issym():
                if info.linkname.startswith("/"):
                    raise FormatError(f"{self.reference}: unsafe member name {info.linkname!r}")
                target = posixpath.normpath(posixpath.join(posixpath.dirname(current), info.linkname))
                current = _safe_name(target, self.reference)
            elif info.islnk():
                current = _safe_name(info.linkname, self.reference)
            elif info.isreg() and not info.issparse():
                return _Extent(info.offset_data, info.size)
            else:
                raise FormatError(f"{self.reference}: {name} is not a regular file")
        raise FormatError(f"{self.reference}: {name}: too many levels of links")

    def _pread_all(self, extent: _Extent) -> bytes:
        data = os.pread(self._fd, extent.size, extent.offset)
        if len(data) != extent.size:
            raise FormatError(f"{self.reference}: archive is truncated")
        return data

    def _hash_extent(self, extent: _Extent) -> str:
        digest = hashlib.sha256()
        read = self._reader(extent)
        while chunk := read(_CHUNK):
            digest.update(chunk)
        return "sha256:" + digest.hexdigest()

    def _reader(self, extent: _Extent):
        """read(n) over the extent; raises FormatError if the archive ends early."""
        position, end, fd = extent.offset, extent.offset + extent.size, self._fd

        def read(n: int) -> bytes:
            nonlocal position
            n = min(n, end - position)
            if n <= 0:
                return b""
            data = os.pread(fd, n, position)
            if not data:
                raise FormatError(f"{self.reference}: archive is truncated")
            position += len(data)
            return data

        return read

    # --- ImageSource ---------------------------------------------------------------

    def get_root(self) -> Manifest:
        return self._root

    def get_manifest(self, digest: str) -> Manifest:
        if check_digest(digest) != self._root.digest:
            raise NotFound(f"{self.reference}: manifest {digest} not in the archive")
        return self._root

    def open_blob(self, digest: str, size: int | None = None):
        extent = self._blobs.get(check_digest(digest))
        if extent is None:
            raise NotFound(f"{self.reference}: blob {digest} not in the image")
        return VerifyingReader(self._reader(extent), digest, size, f"{self.reference}: blob {digest}")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _normalize(name: str) -> str:
    while name.startswith("./"):
        name = name[2:]
    return name


def _safe_name(name: str, reference: str) -> str:
    """A member path that stays inside the archive root, normalized; else FormatError."""
    if not name or name.startswith("/") or "\\" in name or "\0" in name:
        raise FormatError(f"{reference}: unsafe member name {name!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or ".." in parts:
        raise FormatError(f"{reference}: unsafe member name {name!r}")
    return "/".join(parts)


def _digest_from_name(name: str) -> str | None:
    """`blobs/sha256/<hex>` (Docker 25+) names its own digest; verified when streamed."""
    parts = name.split("/")
    if len(parts) == 3 and parts[0] == "blobs" and parts[1] == "sha256":
        candidate = "sha256:" + parts[2]
        return candidate if is_digest(candidate) else None
    return None


def _familiar(name: str) -> str:
    """`docker.io/library/foo:latest`, `foo` -> `foo:latest` (docker's short form)."""
    last = name.rsplit("/", 1)[-1]
    if ":" not in last and "@" not in last:
        name += ":latest"
    for prefix in ("docker.io/library/", "docker.io/"):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name
