"""Small shoal artifacts beside an image: one JSON blob under a tag of the image's
repository (access profiles, prefetch/profile.py; piece hashes, builder/pieces.py).

    manifest: OCI image manifest, config {mediaType CONFIG, the JSON "{}"},
              one layer {mediaType KIND, the blob}, annotation {KEY: what it is bound to}

No registry feature beyond plain manifests and tags is needed. Anyone who can push to the
repository can publish one, so a reader checks the binding (`artifact_blob`) and bounds
what it reads.
"""

from __future__ import annotations

import json
import os
import tempfile

from builder.oci.base import Manifest
from builder.oci.documents import Descriptor, parse_manifest
from builder.oci.refs import DockerRef
from builder.oci.registry import RegistryDestination
from shoal import mediatypes as mt
from shoal.digest import sha256_digest
from shoal.errors import FormatError


def push_artifact(ref: DockerRef, config_type: str, blob_type: str, blob: bytes, annotations: dict[str, str],
                  plain_http: bool = False) -> str:
    """Push `blob` as the one layer of an artifact manifest tagged `ref`; returns the
    reference it was pushed as."""
    config = b"{}"
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": mt.OCI_MANIFEST,
        "config": {"mediaType": config_type, "digest": sha256_digest(config), "size": len(config)},
        "layers": [{"mediaType": blob_type, "digest": sha256_digest(blob), "size": len(blob)}],
        "annotations": annotations,
    }, separators=(",", ":")).encode()
    dest = RegistryDestination(ref, plain_http)
    try:
        with tempfile.TemporaryDirectory(prefix="shoal-artifact-") as tmp:
            for data in (config, blob):
                path = os.path.join(tmp, "blob")
                with open(path, "wb") as f:
                    f.write(data)
                dest.put_blob(path, sha256_digest(data), len(data))
        dest.put_root(Manifest(manifest, mt.OCI_MANIFEST, sha256_digest(manifest)))
    finally:
        dest.close()
    return str(ref)


def artifact_blob(data: bytes, what: str, blob_type: str, key: str, bound: str) -> Descriptor:
    """The descriptor of the one `blob_type` layer of the artifact manifest `data`, once
    its annotation `key` names `bound`; FormatError naming `what` otherwise."""
    doc = parse_manifest(data, what)
    blobs = [d for d in doc.layers if d.media_type == blob_type]
    if len(blobs) != 1:
        raise FormatError(f"{what}: not a {blob_type} artifact (no single layer of that type)")
    got = doc.annotations.get(key)
    if got != bound:
        raise FormatError(f"{what}: bound to {str(got)[:80]!r}, not {bound}")
    return blobs[0]
