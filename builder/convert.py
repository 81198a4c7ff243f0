"""`shoal convert`: rewrite an image's layers as zstd:chunked.

For each manifest (every platform of an index, or the ones --platform selects):
- the config blob is copied unchanged (its diff_ids stay valid: decompressing a
  converted layer gives the source tar byte for byte, which is checked);
- each tar layer (uncompressed, gzip or plain zstd) is converted; layers that already
  carry a zstd:chunked TOC and foreign layers (with `urls`) are passed through;
- the manifest is rewritten as an OCI manifest, keeping its annotations and subject.
A manifest with nothing to change keeps its exact bytes, so converting a converted image
gives the same digests.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from builder.format.footer import location_from_annotations
from builder.format.writer import LayerWriter, WriterOptions
from builder.oci.base import ImageDestination, ImageSource, Manifest
from builder.oci.documents import parse_config, parse_index, parse_manifest
from builder.oci.refs import (
    check_destination,
    open_destination,
    open_source,
    parse_reference,
)
from builder.oci.registry import RegistryDestination
from builder.pieces import Pieces, hash_file, push_pieces
from builder.tarstream import Decompressing, hash_tar
from shoal import mediatypes as mt
from shoal.digest import check_digest, sha256_digest
from shoal.errors import FormatError, ShoalError, UsageError

log = logging.getLogger("shoal.convert")

# Layer annotations that describe the old compressed blob and must not carry over.
_STALE_ANNOTATIONS = ("containerd.io/snapshot/stargz/toc.digest", "containerd.io/uncompressed")


@dataclass
class ConvertOptions:
    level: int = 3
    avg_chunk: int = 1 << 20
    threads: int = max(1, os.cpu_count() or 1)
    platforms: list[str] = field(default_factory=list)  # "os/arch[/variant]"; empty = all
    chunk_index: str | None = None  # sqlite file remembering chunks across runs
    workdir: str | None = None
    pieces: bool = True  # publish each lazy layer's piece hashes beside the image (builder/pieces.py)


@dataclass
class LayerReport:
    index: int
    source_digest: str
    digest: str
    media_type: str
    action: str  # "converted", "passed-through" (already zstd:chunked), "foreign"
    files: int = 0
    chunks: int = 0
    unique_chunks: int = 0
    bytes_in: int = 0  # uncompressed tar bytes
    source_bytes: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    chunk_sizes: dict[str, int] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "chunk_sizes"}


Progress = Callable[[str, int, int], None]  # (label, done bytes, total bytes or 0)


def platform_of(desc: dict) -> str:
    p = desc.get("platform") or {}
    text = f"{p.get('os', '?')}/{p.get('architecture', '?')}"
    if p.get("variant"):
        text += "/" + p["variant"]
    return text


def _platform_matches(desc: dict, wanted: list[str]) -> bool:
    if not wanted:
        return True
    have = platform_of(desc)
    return any(have == w or have.startswith(w + "/") for w in wanted)


def _dumps(obj: dict) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


class _ChunkIndex:
    """Remembers chunk digests across conversions (for cross-image dedup reports)."""

    def __init__(self, path: str):
        try:
            self._db = sqlite3.connect(path)
            self._db.execute(
                "CREATE TABLE IF NOT EXISTS chunks (digest TEXT PRIMARY KEY, size INTEGER, first_seen TEXT)"
            )
        except sqlite3.Error as e:
            raise ShoalError(f"chunk index {path}: {e}") from None

    def seen(self, digests: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for i in range(0, len(digests), 500):
            part = digests[i : i + 500]
            q = f"SELECT digest, first_seen FROM chunks WHERE digest IN ({','.join('?' * len(part))})"
            out.update(dict(self._db.execute(q, part).fetchall()))
        return out

    def add(self, sizes: dict[str, int], where: str) -> None:
        self._db.executemany(
            "INSERT OR IGNORE INTO chunks VALUES (?, ?, ?)", [(d, s, where) for d, s in sizes.items()]
        )
        self._db.commit()

    def close(self) -> None:
        self._db.close()


class Converter:
    def __init__(self, src: ImageSource, dst: ImageDestination, options: ConvertOptions, progress: Progress | None):
        self.src = src
        self.dst = dst
        self.opt = options
        self.progress = progress
        self.layers: list[LayerReport] = []
        self.manifests: list[dict] = []
        self._done_layers: dict[str, tuple[dict, LayerReport]] = {}
        self.pieces: dict[str, Pieces] = {}  # lazy layer digest -> its piece hashes (published after the image)
        self.published: list[dict] = []
        self._work = tempfile.mkdtemp(prefix="shoal-convert-", dir=options.workdir)

    def close(self) -> None:
        shutil.rmtree(self._work, ignore_errors=True)

    def run(self) -> Manifest:
        root = self.src.get_root()
        if root.media_type in mt.INDEX_TYPES:
            new_root = self._convert_index(root)
        elif root.media_type in mt.MANIFEST_TYPES:
            if self.opt.platforms:
                log.info("%s is a single-platform image; --platform ignored", self.src.reference)
            new_root = self._convert_manifest(root, platform=None)
        else:
            raise FormatError(f"{self.src.reference}: unsupported manifest type {root.media_type}")
        self.dst.put_root(new_root)
        self._publish_pieces()
        return new_root

    def _publish_pieces(self) -> None:
        """Push each lazy layer's piece hashes beside the image (a registry destination
        only: a region reads them there), after the image: a failure is logged, the image
        stands (a region then makes the layer's torrent only from the whole blob)."""
        if not isinstance(self.dst, RegistryDestination) or not self.pieces:
            return
        ref = self.dst.ref
        for digest, pieces in self.pieces.items():
            try:
                pushed = push_pieces(ref.host, ref.repository, pieces, self.dst.plain_http)
            except ShoalError as e:
                log.warning("%s: cannot publish the piece hashes of layer %s: %s", self.dst.reference, digest, e)
                continue
            self.published.append({"blob": digest, "reference": pushed, "piece_length": pieces.piece_length,
                                   "pieces": pieces.count})
        log.info("%s: piece hashes of %d lazy layers published", self.dst.reference, len(self.published))

    def _convert_index(self, root: Manifest) -> Manifest:
        index = parse_index(root.data, self.src.reference)
        descs = [d.raw for d in index.manifests]
        if not descs:
            raise FormatError(f"{self.src.reference}: index lists no manifests")
        selected = [d for d in descs if _platform_matches(d, self.opt.platforms)]
        if not selected:
            have = ", ".join(sorted({platform_of(d) for d in descs}))
            raise UsageError(f"{self.src.reference}: no manifest for {', '.join(self.opt.platforms)} (has {have})")
        new_descs = []
        changed = len(selected) != len(descs) or root.media_type != mt.OCI_INDEX
        for d in selected:
            digest = d["digest"]
            if d.get("mediaType") in mt.INDEX_TYPES:
                raise FormatError(f"{self.src.reference}: nested indexes are not supported ({digest})")
            child = self.src.get_manifest(digest)
            new_child = self._convert_manifest(child, platform=platform_of(d))
            self.dst.put_manifest(new_child)
            nd = dict(d)
            nd.update(mediaType=new_child.media_type, digest=new_child.digest, size=len(new_child.data))
            changed |= nd != d
            new_descs.append(nd)
        if not changed:
            return root
        new_index = dict(index.raw)
        new_index.update(schemaVersion=2, mediaType=mt.OCI_INDEX, manifests=new_descs)
        data = _dumps(new_index)
        return Manifest(data, mt.OCI_INDEX, sha256_digest(data))

    def _copy_blob(self, desc: dict, what: str, check: Callable[[str], None] | None = None) -> None:
        """Copy a blob to the destination (verified by its digest); `check(path)` may
        inspect the downloaded file first (and raise to stop the copy)."""
        digest = check_digest(desc.get("digest"), f"{what} digest")
        if check is None and self.dst.has_blob(digest):
            return
        path = os.path.join(self._work, digest.split(":")[1])
        size = desc.get("size") if isinstance(desc.get("size"), int) else None
        try:
            with self.src.open_blob(digest, size) as stream, open(path, "wb") as out:
                shutil.copyfileobj(stream, out, 4 << 20)
            if check is not None:
                check(path)
            if not self.dst.has_blob(digest):
                self.dst.put_blob(path, digest, os.path.getsize(path))
        finally:
            if os.path.exists(path):
                os.unlink(path)

    def _convert_manifest(self, m: Manifest, platform: str | None) -> Manifest:
        what = f"{self.src.reference}" + (f" [{platform}]" if platform else "")
        man = parse_manifest(m.data, what)
        doc, config, layers = man.raw, man.config.raw, [ly.raw for ly in man.layers]
        is_image = man.config.media_type in (mt.OCI_CONFIG, mt.DOCKER_CONFIG)
        if is_image:
            config_bytes = self.src.read_small_blob(man.config.digest, man.config.size, f"{what}: config")
            diff_ids = parse_config(config_bytes, what, len(layers)).diff_ids
        self._copy_blob(config, f"{what}: config")
        if not is_image:
            # Not a container image (an attestation, a signature, an artifact): copy as is.
            log.info("%s: manifest %s is not a container image; copied unchanged", what, m.digest)
            for ly in layers:
                self._copy_blob(ly, f"{what}: blob")
            self.manifests.append({"platform": platform, "source_digest": m.digest, "digest": m.digest})
            return m
        for i, ly in enumerate(layers):
            if ly["mediaType"] not in mt.LAYER_COMPRESSION:
                raise FormatError(f"{what}: layer {i + 1}/{len(layers)} {ly['digest']}: "
                                  f"unsupported layer media type {ly['mediaType'][:100]!r}")
        new_layers = []
        for i, ly in enumerate(layers):
            new_layers.append(self._convert_layer(ly, i, len(layers), diff_ids[i], what))
        changed = new_layers != layers or m.media_type != mt.OCI_MANIFEST
        if config.get("mediaType") == mt.DOCKER_CONFIG:
            config = dict(config, mediaType=mt.OCI_CONFIG)
            changed = True
        if not changed:
            new = m
        else:
            new_doc = dict(doc)
            new_doc.update(schemaVersion=2, mediaType=mt.OCI_MANIFEST, config=config, layers=new_layers)
            data = _dumps(new_doc)
            new = Manifest(data, mt.OCI_MANIFEST, sha256_digest(data))
        self.manifests.append({"platform": platform, "source_digest": m.digest, "digest": new.digest})
        return new

    def _convert_layer(self, desc: dict, i: int, n: int, diff_id: object, image: str) -> dict:
        src_digest = check_digest(desc.get("digest"), f"{image}: layer {i + 1} digest")
        what = f"{image}: layer {i + 1}/{n} {src_digest}"
        check_digest(diff_id, f"{what}: diff_id")
        if src_digest in self._done_layers:  # same layer in another platform's manifest
            new_desc, report = self._done_layers[src_digest]
            return new_desc
        media_type = desc["mediaType"]
        report = LayerReport(i, src_digest, src_digest, media_type, "passed-through")
        report.source_bytes = desc.get("size") or 0
        if desc.get("urls"):
            report.action = "foreign"
            log.info("%s: foreign layer, left as is", what)
            self.layers.append(report)
            return desc
        loc = location_from_annotations(desc.get("annotations"))
        if loc is not None and loc.tarsplit is not None and mt.LAYER_COMPRESSION[media_type] == "zstd":
            # Current zstd:chunked: keep it, once its content is known to match the diff_id.
            # (Old-variant layers, without tar-split, are rewritten below.)
            def check(path: str) -> None:
                with open(path, "rb") as f:
                    got, n = hash_tar(Decompressing(f, "zstd", what))
                if got != diff_id:
                    raise FormatError(f"{what}: uncompressed content has digest {got}, the config's diff_id is {diff_id}")
                report.bytes_in = n
                if self.opt.pieces:
                    self.pieces[src_digest] = hash_file(path, src_digest)

            self._copy_blob(desc, what, check)
            log.info("%s: already zstd:chunked, copied unchanged", what)
            report.bytes_out = report.source_bytes
            self.layers.append(report)
            self._done_layers[src_digest] = (desc, report)
            return desc
        start = time.monotonic()
        compression = mt.LAYER_COMPRESSION[media_type]
        size = desc.get("size") if isinstance(desc.get("size"), int) else None
        out_path = os.path.join(self._work, f"layer-{src_digest.split(':')[1]}")
        label = f"layer {i + 1}/{n} {src_digest[7:19]}"
        tell = self.progress
        progress = (lambda done: tell(label, done, 0)) if tell else None
        writer = LayerWriter(
            WriterOptions(level=self.opt.level, avg_chunk=self.opt.avg_chunk, threads=self.opt.threads), progress
        )
        try:
            with self.src.open_blob(src_digest, size) as blob, open(out_path, "wb") as out:
                stream = Decompressing(blob, compression, what)
                # An uncompressed blob is the tar: its digest, checked as it is read, is
                # the diff_id, so the writer need not hash the tar again.
                known = diff_id if compression == "none" and src_digest == diff_id else None
                result = writer.write(stream, out, diff_id=known)  # type: ignore[arg-type]
        except ShoalError as e:
            raise type(e)(f"{what}: {e}") from None
        if result.diff_id != diff_id:
            raise FormatError(
                f"{what}: uncompressed content has digest {result.diff_id}, the config's diff_id is {diff_id}"
            )
        try:
            self.dst.put_blob(out_path, result.digest, result.size)
            if self.opt.pieces:
                self.pieces[result.digest] = hash_file(out_path, result.digest)
        finally:
            os.unlink(out_path)
        annotations = {k: v for k, v in (desc.get("annotations") or {}).items() if k not in _STALE_ANNOTATIONS}
        annotations.update(result.annotations)
        new_desc = {"mediaType": mt.OCI_LAYER_ZSTD, "digest": result.digest, "size": result.size}
        new_desc["annotations"] = annotations
        report.digest = result.digest
        report.media_type = mt.OCI_LAYER_ZSTD
        report.action = "converted"
        report.files = result.files
        report.chunks = result.chunks
        report.unique_chunks = len(result.chunk_digests)
        report.bytes_in = result.tar_size
        report.bytes_out = result.size
        report.seconds = round(time.monotonic() - start, 3)
        report.chunk_sizes = result.chunk_digests
        self.layers.append(report)
        self._done_layers[src_digest] = (new_desc, report)
        log.info(
            "%s: converted to %s (%d files, %d chunks, %d -> %d bytes, %.1fs)",
            what, result.digest, result.files, result.chunks, result.tar_size, result.size, report.seconds,
        )
        return new_desc


def dedup_report(layers: list[LayerReport], index: _ChunkIndex | None, where: str) -> dict:
    """Chunks shared between layers of this run, and with images converted before."""
    owners: dict[str, list[str]] = {}
    sizes: dict[str, int] = {}
    for ly in layers:
        for d, s in ly.chunk_sizes.items():
            owners.setdefault(d, []).append(ly.digest)
            sizes[d] = s
    shared = {d: o for d, o in owners.items() if len(o) > 1}
    report: dict = {
        "unique_chunks": len(sizes),
        "unique_chunk_bytes": sum(sizes.values()),
        "shared_between_layers": [{"digest": d, "size": sizes[d], "layers": o} for d, o in sorted(shared.items())],
        "shared_between_layers_bytes": sum(sizes[d] * (len(o) - 1) for d, o in shared.items()),
    }
    if index is not None:
        before = index.seen(list(sizes))
        report["shared_with_earlier_images"] = [
            {"digest": d, "size": sizes[d], "first_seen": before[d]} for d in sorted(before)
        ]
        report["shared_with_earlier_images_bytes"] = sum(sizes[d] for d in before)
        index.add(sizes, where)
    return report


def convert(
    src_ref: str, dst_ref: str, plain_http: bool = False, options: ConvertOptions | None = None,
    progress: Progress | None = None,
) -> dict:
    """Convert src_ref into dst_ref; returns the summary `shoal convert --json` prints."""
    opt = options or ConvertOptions()
    parse_reference(src_ref)  # usage errors first, before any I/O
    check_destination(dst_ref)
    start = time.monotonic()
    index = _ChunkIndex(opt.chunk_index) if opt.chunk_index else None
    try:
        with open_source(src_ref, plain_http) as src, open_destination(dst_ref, plain_http) as dst:
            conv = Converter(src, dst, opt, progress)
            try:
                root = conv.run()
            finally:
                conv.close()
        summary = {
            "source": src_ref,
            "destination": dst_ref,
            "digest": root.digest,
            "media_type": root.media_type,
            "manifests": conv.manifests,
            "layers": [ly.to_json() for ly in conv.layers],
            "dedup": dedup_report(conv.layers, index, dst_ref),
            "bytes_in": sum(ly.bytes_in for ly in conv.layers),
            "bytes_out": sum(ly.bytes_out for ly in conv.layers),
            "pieces": conv.published,
            "seconds": round(time.monotonic() - start, 3),
        }
    finally:
        if index is not None:
            index.close()
    return summary
