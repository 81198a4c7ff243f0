"""`shoal inspect`: layers and TOC statistics of an image; `--verify` checks every digest."""

from __future__ import annotations

import hashlib
import json
import logging
import tempfile
from typing import BinaryIO

from builder.convert import platform_of
from builder.format.footer import FOOTER_SIZE, TocLocation, location_from_annotations, parse_footer
from builder.format.reader import decode_chunk
from builder.format.toc import Toc, decompress_toc, parse_toc
from builder.oci.base import ImageSource, Manifest
from builder.oci.documents import parse_config, parse_index, parse_manifest
from builder.oci.refs import open_source
from builder.tarstream import Decompressing, hash_tar
from shoal import mediatypes as mt
from shoal.digest import check_digest
from shoal.errors import DigestMismatch, FormatError, ShoalError

log = logging.getLogger("shoal.inspect")


def read_toc(src: ImageSource, desc: dict, what: str) -> tuple[TocLocation, Toc]:
    """Fetch, verify and parse a layer's TOC through range reads (annotations, else footer)."""
    digest = check_digest(desc.get("digest"), f"{what} digest")
    size = desc.get("size")
    loc = location_from_annotations(desc.get("annotations"))
    if loc is None:
        if not isinstance(size, int) or size < FOOTER_SIZE:
            raise FormatError(f"{what}: no zstd:chunked annotations and no usable size for the footer")
        loc = parse_footer(src.read_range(digest, size - FOOTER_SIZE, size))
    if isinstance(size, int) and loc.toc.end > size:
        raise FormatError(f"{what}: TOC position {loc.toc.offset}+{loc.toc.length} beyond the blob's {size} bytes")
    compressed = src.read_range(digest, loc.toc.offset, loc.toc.end)
    try:
        toc = parse_toc(decompress_toc(compressed, loc.toc_digest, loc.toc.uncompressed), size)
    except ShoalError as e:
        raise type(e)(f"{what}: {e}") from None
    return loc, toc


def toc_stats(loc: TocLocation, toc: Toc) -> dict:
    counts: dict[str, int] = {}
    for e in toc.entries:
        counts[e.type] = counts.get(e.type, 0) + 1
    files = list(toc.files())
    digests = {c.digest for e in files for c in e.chunks}
    return {
        "variant": loc.variant,
        "entries": len(toc.entries),
        "types": counts,
        "files": len(files),
        "file_bytes": sum(e.size for e in files),
        "chunks": sum(len(e.chunks) for e in files),
        "unique_chunks": len(digests),
        "toc_bytes": loc.toc.length,
        "toc_uncompressed_bytes": loc.toc.uncompressed,
        "tar_split": loc.tarsplit is not None,
    }


def verify_layer(src: ImageSource, desc: dict, diff_id: str | None, toc: Toc | None, loc: TocLocation | None,
                 what: str) -> None:
    """Check blob digest, diff_id and (for zstd:chunked) every chunk and file digest."""
    digest = desc["digest"]
    compression = mt.LAYER_COMPRESSION.get(desc.get("mediaType", ""), "")
    if not compression:
        raise FormatError(f"{what}: unknown layer media type {desc.get('mediaType')}")
    with tempfile.TemporaryFile(prefix="shoal-verify-") as tmp:
        with src.open_blob(digest, desc.get("size")) as blob:  # digest checked at EOF
            while True:
                data = blob.read(4 << 20)
                if not data:
                    break
                tmp.write(data)
        tmp.flush()
        tmp.seek(0)
        got, _ = hash_tar(Decompressing(tmp, compression, what))
        if diff_id is not None and got != diff_id:
            raise DigestMismatch(f"{what}: uncompressed digest {got}, config diff_id {diff_id}")
        if toc is not None and loc is not None:
            _verify_chunks(tmp, toc, loc, what)


def _read_at(f: BinaryIO, start: int, end: int) -> bytes:
    f.seek(start)
    return f.read(end - start)


def _verify_chunks(f: BinaryIO, toc: Toc, loc: TocLocation, what: str) -> None:
    for e in toc.files():
        file_sha = hashlib.sha256()
        for c in e.chunks:
            data = decode_chunk(c, _read_at(f, c.start, c.end), f"{what} {e.name!r}")
            if len(e.chunks) > 1:
                file_sha.update(data)
        if e.digest and len(e.chunks) > 1 and "sha256:" + file_sha.hexdigest() != e.digest:
            raise DigestMismatch(f"{what}: file {e.name!r} digest mismatch")
        if e.digest and len(e.chunks) == 1 and e.chunks[0].digest != e.digest:
            raise DigestMismatch(f"{what}: file {e.name!r} digest differs from its chunk's")
    if toc.tarsplit_digest and loc.tarsplit is not None:
        raw = _read_at(f, loc.tarsplit.offset, loc.tarsplit.end)
        got = "sha256:" + hashlib.sha256(raw).hexdigest()
        if got != toc.tarsplit_digest:
            raise DigestMismatch(f"{what}: tar-split digest mismatch (TOC says {toc.tarsplit_digest}, got {got})")


def image_manifests(src: ImageSource) -> list[tuple[str | None, Manifest]]:
    """(platform or None, manifest) of each image manifest of `src` (its root, or the
    manifests its index lists)."""
    root = src.get_root()
    if root.media_type in mt.MANIFEST_TYPES:
        return [(None, root)]
    if root.media_type not in mt.INDEX_TYPES:
        raise FormatError(f"{src.reference}: unsupported manifest type {root.media_type}")
    out: list[tuple[str | None, Manifest]] = []
    for d in parse_index(root.data, src.reference).manifests:
        if d.media_type in mt.MANIFEST_TYPES:
            out.append((platform_of(d.raw), src.get_manifest(d.digest)))
    return out


def inspect(ref: str, plain_http: bool = False, verify: bool = False) -> dict:
    """The report `shoal inspect --json` prints; "ok" is False if any check failed."""
    report: dict = {"reference": ref, "manifests": [], "ok": True}
    with open_source(ref, plain_http) as src:
        root = src.get_root()
        report["digest"] = root.digest
        report["media_type"] = root.media_type
        for platform, m in image_manifests(src):
            what = ref + (f" [{platform}]" if platform else "")
            man = parse_manifest(m.data, what)
            layers = [ly.raw for ly in man.layers]
            diff_ids: list = []
            if man.config.media_type in (mt.OCI_CONFIG, mt.DOCKER_CONFIG):
                config = src.read_small_blob(man.config.digest, man.config.size, f"{what}: config")
                diff_ids = parse_config(config, what, len(layers)).diff_ids
            mrep: dict = {"platform": platform, "digest": m.digest, "layers": []}
            for i, desc in enumerate(layers):
                lwhat = f"{what}: layer {i + 1}/{len(layers)} {desc.get('digest')}"
                lrep = {"digest": desc.get("digest"), "size": desc.get("size"), "media_type": desc.get("mediaType")}
                toc = loc = None
                try:
                    if location_from_annotations(desc.get("annotations")) is not None:
                        loc, toc = read_toc(src, desc, lwhat)
                        lrep["zstd_chunked"] = toc_stats(loc, toc)
                    else:
                        lrep["zstd_chunked"] = None
                    if verify:
                        diff_id = diff_ids[i] if i < len(diff_ids) else None
                        verify_layer(src, desc, diff_id, toc, loc, lwhat)
                        lrep["verified"] = True
                except ShoalError as e:
                    lrep["error"] = str(e)
                    lrep["verified"] = False
                    report["ok"] = False
                    log.error("%s", e)
                mrep["layers"].append(lrep)
            report["manifests"].append(mrep)
    return report


def format_report(report: dict) -> str:
    lines = [f"{report['reference']}  {report['digest']}"]
    for m in report["manifests"]:
        lines.append(f"  manifest {m['digest']}" + (f"  [{m['platform']}]" if m["platform"] else ""))
        for i, ly in enumerate(m["layers"], 1):
            z = ly.get("zstd_chunked")
            kind = "zstd:chunked" if z else (ly.get("media_type") or "?").rsplit(".", 1)[-1]
            line = f"    {i:>3}  {ly['digest']}  {ly['size'] or 0:>12,} B  {kind}"
            if z:
                line += (
                    f"  {z['files']} files, {z['chunks']} chunks ({z['unique_chunks']} unique),"
                    f" {z['file_bytes']:,} B content, TOC {z['toc_bytes']:,} B ({z['variant']})"
                )
            if "verified" in ly:
                line += "  verified" if ly["verified"] else "  FAILED"
            lines.append(line)
            if "error" in ly:
                lines.append(f"         error: {ly['error']}")
    return "\n".join(lines)


def dumps(report: dict) -> str:
    return json.dumps(report, sort_keys=False)


