"""`shoal pieces push REF`: publish the piece hashes of an image converted before `shoal
convert` published them (or converted with --no-pieces), without converting it again.

Each lazy (zstd:chunked) layer of every platform of REF is read once from the registry, its
bytes checked against the layer digest as they come (builder/oci VerifyingReader) and
hashed in pieces (builder/pieces.py), and the hashes are pushed beside the image under
`sha256-<layer hex>.shoal-pieces`, exactly as `shoal convert` pushes them. A layer whose
tag is there already is left alone (--force: hashed and pushed again). A layer shared by
several platforms is read once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from builder.format.footer import location_from_annotations
from builder.inspect import image_manifests
from builder.oci.documents import parse_manifest
from builder.oci.refs import DockerRef, parse_reference
from builder.oci.registry import RegistrySource
from builder.pieces import hash_stream, pieces_tag, push_pieces
from shoal.errors import FormatError, NotFound, UsageError

log = logging.getLogger("shoal.pieces")

Progress = Callable[[str, int, int], None]


def push_image_pieces(ref: str, plain_http: bool = False, force: bool = False,
                      progress: Progress | None = None) -> dict:
    """Publish the piece hashes of REF's lazy layers; the summary `shoal pieces push
    --json` prints: {"reference", "digest", "layers": [{"blob", "size", "action":
    "pushed" | "present", "reference"?, "piece_length"?, "pieces"?}]}."""
    parsed = parse_reference(ref)
    if not isinstance(parsed, DockerRef):
        raise UsageError(f"{ref}: piece hashes are published in a registry: want docker://HOST/REPO:TAG")
    out: dict = {"reference": ref, "layers": []}
    with RegistrySource(parsed, plain_http) as src:
        out["digest"] = src.get_root().digest
        seen: set[str] = set()
        for platform, m in image_manifests(src):
            what = ref + (f" [{platform}]" if platform else "")
            for i, desc in enumerate(parse_manifest(m.data, what).layers):
                if desc.digest in seen or location_from_annotations(desc.annotations) is None:
                    continue
                seen.add(desc.digest)
                lwhat = f"{what}: layer {i + 1} {desc.digest}"
                out["layers"].append(_push_layer(src, parsed, desc.digest, desc.size, force, plain_http, lwhat,
                                                 progress))
    if not out["layers"]:
        raise FormatError(f"{ref}: no zstd:chunked layers (convert the image first: shoal convert)")
    return out


def _push_layer(src: RegistrySource, ref: DockerRef, digest: str, size: int, force: bool, plain_http: bool,
                what: str, progress: Progress | None) -> dict:
    entry: dict = {"blob": digest, "size": size}
    if not force and _published(ref, digest, plain_http):
        log.info("%s: piece hashes published already", what)
        return {**entry, "action": "present"}
    with src.open_blob(digest, size) as blob:  # checked against `digest` at its end
        pieces = hash_stream(blob, size, digest,
                             progress=(lambda done: progress(digest[:19], done, size)) if progress else None)
    pushed = push_pieces(ref.host, ref.repository, pieces, plain_http)
    log.info("%s: %d piece hashes of %d bytes published as %s", what, pieces.count, pieces.piece_length, pushed)
    return {**entry, "action": "pushed", "reference": pushed, "piece_length": pieces.piece_length,
            "pieces": pieces.count}


def _published(ref: DockerRef, digest: str, plain_http: bool) -> bool:
    with RegistrySource(DockerRef(ref.host, ref.repository, tag=pieces_tag(digest)), plain_http) as tag:
        try:
            tag.get_root()
        except NotFound:
            return False
    return True
