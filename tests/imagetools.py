"""Build small container images in Python for tests: layers, configs, manifests, OCI
layouts, `docker save` archives, and a plain image copy between transports.

Everything is deterministic (fixed mtimes, sorted entries) so digests are stable.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from builder.oci.base import ImageDestination, ImageSource, Manifest
from shoal import mediatypes as mt

MTIME = 1_700_000_000


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def make_tar(files: dict[str, bytes | str | None]) -> bytes:
    """A tar stream: `bytes` -> regular file, `None` -> directory, `"->target"` -> symlink.

    Parent directories are not added implicitly; names are stored in sorted order.
    """
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(files):
            content = files[name]
            info = tarfile.TarInfo(name)
            info.mtime = MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            if content is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif isinstance(content, str) and content.startswith("->"):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, content[2:], 0o777
                tar.addfile(info)
            else:
                data = content.encode() if isinstance(content, str) else content
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def gzip_bytes(data: bytes) -> bytes:
    return gzip.compress(data, mtime=0)


@dataclass
class Image:
    """One single-platform image: blobs by digest plus the manifest."""

    manifest: Manifest
    config: bytes
    layers: list[bytes]
    blobs: dict[str, bytes] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        return self.manifest.digest


def make_image(
    layers: list[dict[str, bytes | str | None]],
    compress: bool = True,
    arch: str = "amd64",
    docker: bool = False,
) -> Image:
    """An image whose layers hold `layers` (one dict of files each)."""
    tars = [make_tar(files) for files in layers]
    blobs_list = [gzip_bytes(t) if compress else t for t in tars]
    config = json.dumps(
        {
            "architecture": arch,
            "os": "linux",
            "created": "2023-11-14T22:13:20Z",
            "config": {"Cmd": ["/bin/sh"]},
            "rootfs": {"type": "layers", "diff_ids": [sha256(t) for t in tars]},
        },
        sort_keys=True,
    ).encode()
    if docker:
        manifest_type, config_type = mt.DOCKER_MANIFEST, mt.DOCKER_CONFIG
        layer_type = mt.DOCKER_LAYER_GZIP if compress else mt.OCI_LAYER_TAR
    else:
        manifest_type, config_type = mt.OCI_MANIFEST, mt.OCI_CONFIG
        layer_type = mt.OCI_LAYER_GZIP if compress else mt.OCI_LAYER_TAR
    doc = {
        "schemaVersion": 2,
        "mediaType": manifest_type,
        "config": {"mediaType": config_type, "digest": sha256(config), "size": len(config)},
        "layers": [{"mediaType": layer_type, "digest": sha256(b), "size": len(b)} for b in blobs_list],
    }
    data = json.dumps(doc, indent=2).encode()
    blobs = {sha256(config): config, **{sha256(b): b for b in blobs_list}}
    return Image(Manifest(data, manifest_type, sha256(data)), config, blobs_list, blobs)


def make_index(images: dict[str, Image]) -> Manifest:
    """An OCI index over `images`, keyed by architecture."""
    doc = {
        "schemaVersion": 2,
        "mediaType": mt.OCI_INDEX,
        "manifests": [
            {
                "mediaType": img.manifest.media_type,
                "digest": img.digest,
                "size": len(img.manifest.data),
                "platform": {"architecture": arch, "os": "linux"},
            }
            for arch, img in images.items()
        ],
    }
    data = json.dumps(doc, indent=2).encode()
    return Manifest(data, mt.OCI_INDEX, sha256(data))


def write_layout(
    root: Path,
    tagged: dict[str | None, Manifest],
    images: list[Image],
) -> Path:
    """Write an OCI layout: every image's blobs and manifest, index.json listing `tagged`."""
    blobs_dir = root / "blobs" / "sha256"
    blobs_dir.mkdir(parents=True, exist_ok=True)
    (root / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    for image in images:
        for digest, data in {**image.blobs, image.digest: image.manifest.data}.items():
            (blobs_dir / digest.split(":")[1]).write_bytes(data)
    entries = []
    for tag, manifest in tagged.items():
        (blobs_dir / manifest.digest.split(":")[1]).write_bytes(manifest.data)
        entry = {"mediaType": manifest.media_type, "digest": manifest.digest, "size": len(manifest.data)}
        if tag:
            entry["annotations"] = {"org.opencontainers.image.ref.name": tag}
        entries.append(entry)
    index = {"schemaVersion": 2, "mediaType": mt.OCI_INDEX, "manifests": entries}
    (root / "index.json").write_text(json.dumps(index, indent=2))
    return root


def make_docker_archive(
    path: Path,
    images: list[tuple[list[str], list[dict[str, bytes | str | None]]]],
    style: str = "legacy",
    gzip_layers: bool = False,
) -> list[Image]:
    """Write what `docker save` writes for `images` ([(repo_tags, layers), ...]).

    style "legacy": `<id>.json` and `<id>/layer.tar`; "blobs": Docker 25's
    `blobs/sha256/<hex>`. Returns the images (with uncompressed or gzip layers).
    """
    built, entries, members = [], [], {}
    for repo_tags, layers in images:
        image = make_image(layers, compress=gzip_layers, docker=True)
        built.append(image)
        config_hex = sha256(image.config).split(":")[1]
        if style == "legacy":
            config_name = f"{config_hex}.json"
            layer_names = []
            for blob in image.layers:
                layer_id = hashlib.sha256(config_hex.encode() + blob[:64]).hexdigest()
                layer_names.append(f"{layer_id}/layer.tar")
                members[f"{layer_id}/VERSION"] = b"1.0"
                members[f"{layer_id}/layer.tar"] = blob
        else:
            config_name = f"blobs/sha256/{config_hex}"
            layer_names = [f"blobs/sha256/{sha256(b).split(':')[1]}" for b in image.layers]
            members.update({name: blob for name, blob in zip(layer_names, image.layers)})
        members[config_name] = image.config
        entries.append({"Config": config_name, "RepoTags": repo_tags, "Layers": layer_names})
    members["manifest.json"] = json.dumps(entries).encode()
    path.write_bytes(make_tar(members))
    return built


def copy_image(src: ImageSource, dst: ImageDestination, workdir: Path) -> Manifest:
    """Copy the root and everything it refers to from src to dst, unchanged."""
    root = src.get_root()
    doc = json.loads(root.data)
    if root.media_type in mt.INDEX_TYPES:
        for child in doc["manifests"]:
            manifest = src.get_manifest(child["digest"])
            _copy_manifest_blobs(src, dst, json.loads(manifest.data), workdir)
            dst.put_manifest(manifest)
    else:
        _copy_manifest_blobs(src, dst, doc, workdir)
    dst.put_root(root)
    return root


def _copy_manifest_blobs(src: ImageSource, dst: ImageDestination, doc: dict, workdir: Path) -> None:
    for desc in [doc["config"], *doc["layers"]]:
        if dst.has_blob(desc["digest"]):
            continue
        fd, tmp = tempfile.mkstemp(dir=workdir)
        try:
            with os.fdopen(fd, "wb") as out, src.open_blob(desc["digest"], desc["size"]) as stream:
                while chunk := stream.read(1 << 16):
                    out.write(chunk)
            dst.put_blob(tmp, desc["digest"], desc["size"])
        finally:
            os.unlink(tmp)


def read_blob(src: ImageSource, digest: str, size: int | None = None) -> bytes:
    with src.open_blob(digest, size) as stream:
        return stream.read()
