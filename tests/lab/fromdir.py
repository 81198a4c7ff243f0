"""Build an ordinary (gzip or uncompressed) OCI image from root file system folders.

Used by the demo, the tests and the benchmarks to make real images from real trees;
each folder becomes one layer, packed by GNU tar (pax format, numeric owners, sorted
names, xattrs kept) as a container build would.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field

from builder.oci.base import Manifest
from builder.oci.refs import open_destination
from shoal import mediatypes as mt
from shoal.errors import ShoalError

FIXED_TIME = "2024-01-01T00:00:00Z"


@dataclass
class ImageConfig:
    cmd: list[str] = field(default_factory=lambda: ["/bin/sh"])
    entrypoint: list[str] | None = None
    env: list[str] = field(default_factory=lambda: ["PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"])
    labels: dict[str, str] = field(default_factory=dict)
    working_dir: str = "/"
    architecture: str = "amd64"


def tar_folder(folder: str, out_path: str) -> None:
    """Pack `folder` as a layer tar at out_path (GNU tar, reproducible options)."""
    cmd = [
        "tar", "--format=pax", "--sort=name", "--numeric-owner", "--xattrs", "--xattrs-include=*",
        "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
        "--mtime=@1704067200", "--clamp-mtime", "-C", folder, "-cf", out_path, ".",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ShoalError(f"tar of {folder} failed: {proc.stderr.strip().splitlines()[-1:]}")


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(4 << 20):
            h.update(data)
    return "sha256:" + h.hexdigest()


def build_image(
    folders: list[str], dest: str, config: ImageConfig | None = None, compression: str = "gzip",
    plain_http: bool = False, workdir: str | None = None,
) -> Manifest:
    """Write an image with one layer per folder to `dest` (any destination reference)."""
    cfg = config or ImageConfig()
    work = tempfile.mkdtemp(prefix="shoal-build-", dir=workdir)
    try:
        layers, diff_ids, blobs = [], [], []
        for i, folder in enumerate(folders):
            tar_path = os.path.join(work, f"layer{i}.tar")
            tar_folder(folder, tar_path)
            diff_ids.append(_sha256_file(tar_path))
            blob_path = tar_path
            media_type = mt.OCI_LAYER_TAR
            if compression == "gzip":
                blob_path = tar_path + ".gz"
                with open(tar_path, "rb") as src, gzip.GzipFile(blob_path, "wb", compresslevel=6, mtime=0) as gz:
                    shutil.copyfileobj(src, gz, 4 << 20)
                os.unlink(tar_path)
                media_type = mt.OCI_LAYER_GZIP
            digest = _sha256_file(blob_path)
            size = os.path.getsize(blob_path)
            layers.append({"mediaType": media_type, "digest": digest, "size": size})
            blobs.append((blob_path, digest, size))
        config_doc = {
            "created": FIXED_TIME,
            "architecture": cfg.architecture,
            "os": "linux",
            "config": {
                "Env": cfg.env,
                "Cmd": cfg.cmd,
                "WorkingDir": cfg.working_dir,
                "Labels": cfg.labels or None,
                **({"Entrypoint": cfg.entrypoint} if cfg.entrypoint else {}),
            },
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
            "history": [{"created": FIXED_TIME, "created_by": f"shoal build layer {i}"} for i in range(len(folders))],
        }
        config_bytes = json.dumps(config_doc, sort_keys=True).encode()
        config_path = os.path.join(work, "config.json")
        with open(config_path, "wb") as f:
            f.write(config_bytes)
        config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
        manifest_doc = {
            "schemaVersion": 2,
            "mediaType": mt.OCI_MANIFEST,
            "config": {"mediaType": mt.OCI_CONFIG, "digest": config_digest, "size": len(config_bytes)},
            "layers": layers,
        }
        data = json.dumps(manifest_doc, sort_keys=True).encode()
        manifest = Manifest(data, mt.OCI_MANIFEST, "sha256:" + hashlib.sha256(data).hexdigest())
        with open_destination(dest, plain_http) as dst:
            for path, digest, size in blobs + [(config_path, config_digest, len(config_bytes))]:
                if not dst.has_blob(digest):
                    dst.put_blob(path, digest, size)
            dst.put_root(manifest)
        return manifest
    finally:
        shutil.rmtree(work, ignore_errors=True)
