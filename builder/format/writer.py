"""The zstd:chunked writer: one tar stream in, one zstd:chunked blob out.

Each regular file's content starts a new zstd frame, and each content-defined chunk
(FastCDC) of a large file is its own frame; headers, padding and the end-of-archive
blocks go in the frames between them, so `zstd -d` of the blob gives the source tar
byte for byte. Then come the TOC, the tar-split and the footer (builder.format.footer),
each in a skippable frame.

Threads: write() parses on the calling thread, compresses on a pool of
WriterOptions.threads and hashes on one thread of its own; all are joined before it
returns. It changes no process-wide setting (see SWITCH_INTERVAL).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import queue
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, BinaryIO

import pyfastcdc
import zstandard

from builder import tarsplit
from builder.format.footer import (
    FOOTER_MAGIC,
    MANIFEST_CHECKSUM,
    MANIFEST_POSITION,
    MANIFEST_TYPE_CRFS,
    OLD_MANIFEST_CHECKSUM,
    OLD_MANIFEST_POSITION,
    SKIPPABLE_HEADER,
    TARSPLIT_POSITION,
    skippable_frame,
)
from builder.format.toc import CHUNK_TYPE, MAX_FILE_SIZE, format_timestamp
from builder.tarstream import LayerEntries, TarEntry, TarReader
from shoal.errors import FormatError

# The interpreter's switch interval that makes write() fastest, for a process that may
# set it (sys.setswitchinterval is process-wide, so the library never does: `shoal
# convert` sets it around the conversion). Compression threads release the GIL in C,
# and a short interval lets the parsing thread get it back quickly instead of waiting
# up to the default 5 ms each time.
SWITCH_INTERVAL = 0.0005


@dataclass
class WriterOptions:
    level: int = 3
    avg_chunk: int = 1 << 20  # FastCDC target; actual mean is about avg + min (see pyfastcdc)
    threads: int = max(1, os.cpu_count() or 1)
    # Files below this size are one chunk (a frame each); cutting them gains nothing.
    min_split: int = 2 << 20


@dataclass
class LayerResult:
    """What writing one layer produced; `annotations` go on the layer descriptor."""

    digest: str  # sha256 of the blob written
    size: int
    diff_id: str  # sha256 of the uncompressed tar
    tar_size: int
    annotations: dict[str, str]
    files: int
    chunks: int
    chunk_digests: dict[str, int]  # digest -> uncompressed size (unique chunks)


class _Piece:
    """A run of bytes compressed as one frame; data pieces are file chunks."""

    __slots__ = ("data", "digest", "end", "frame", "is_data", "start")

    def __init__(self, data: bytes, is_data: bool):
        self.data = data
        self.is_data = is_data
        self.frame = b""
        self.digest = ""
        self.start = 0
        self.end = 0


class _FileRecord:
    __slots__ = ("digest_sha", "entry", "pieces", "sizes")

    def __init__(self, entry: TarEntry):
        self.entry = entry
        self.pieces: list[_Piece] = []
        self.sizes: list[int] = []  # uncompressed size of each piece
        self.digest_sha: hashlib._Hash | None = None  # whole file, when cut into chunks

    @property
    def digest(self) -> str:
        if self.digest_sha is not None:
            return "sha256:" + self.digest_sha.hexdigest()
        return self.pieces[0].digest if self.pieces else ""


_tls = threading.local()


def _compress_batch(pieces: list[_Piece], level: int) -> None:
    cctx = getattr(_tls, "cctx", None)
    if cctx is None or _tls.level != level:
        cctx = _tls.cctx = zstandard.ZstdCompressor(level=level, write_content_size=True)
        _tls.level = level
    for p in pieces:
        p.frame = cctx.compress(p.data)
        if p.is_data:
            p.digest = "sha256:" + hashlib.sha256(p.data).hexdigest()


class _HashingWriter:
    def __init__(self, out: IO[bytes]):
        self.out = out
        self.count = 0
        self.sha = hashlib.sha256()

    def write(self, data: bytes) -> None:
        self.out.write(data)
        self.sha.update(data)
        self.count += len(data)


class _Hasher:
    """Feeds sha256 objects on a thread of their own, in submission order.

    hashlib releases the GIL on large buffers, so whole-file and whole-tar digests
    overlap with parsing and compression instead of adding to them.
    """

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue(maxsize=64)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="shoal-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            h, data = item
            h.update(data)

    def update(self, h: hashlib._Hash, data: bytes) -> None:
        self._q.put((h, data))

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()


class LayerWriter:
    """Converts one tar stream into a zstd:chunked blob.

    write(tar_stream, out) reads the whole stream, writes the blob to `out` and returns
    a LayerResult. Output is deterministic: the same tar and options give the same bytes.
    Raises FormatError for tars that cannot be represented (entries escaping the root,
    hard links to missing entries, duplicate entries, sparse files).
    """

    def __init__(self, options: WriterOptions | None = None, progress: Callable[[int], None] | None = None):
        self.opt = options or WriterOptions()
        avg = self.opt.avg_chunk
        self._cdc = pyfastcdc.FastCDC(avg, min_size=max(64, avg // 4), max_size=min(16 << 20, avg * 4))
        self._window = max(16 << 20, 4 * self._cdc.max_size)
        self._progress = progress

    def write(self, stream: BinaryIO, out: IO[bytes], diff_id: str | None = None) -> LayerResult:
        """`diff_id`: the tar's digest when the caller already verifies the stream against
        it (an uncompressed source blob), which saves hashing it twice."""
        opt = self.opt
        sink = _HashingWriter(out)
        hasher = _Hasher()
        tar_sha = hashlib.sha256()
        on_block = None if diff_id else (lambda block: hasher.update(tar_sha, block))
        reader = TarReader(stream, on_block=on_block)
        split = tarsplit.TarSplitWriter()
        records: list[_FileRecord] = []
        entries = LayerEntries()
        meta = bytearray()
        batch: list[_Piece] = []
        batch_bytes = 0
        inflight: deque[tuple[Future, list[_Piece]]] = deque()
        max_inflight = opt.threads * 2

        def drain(keep: int) -> None:
            while len(inflight) > keep:
                fut, pieces = inflight.popleft()
                fut.result()
                offset = sink.count
                for p in pieces:
                    p.start = offset
                    offset += len(p.frame)
                    p.end = offset
                sink.write(b"".join(p.frame for p in pieces))  # one write, one hash update
                for p in pieces:
                    p.frame = b""
                    p.data = b""

        def submit() -> None:
            nonlocal batch, batch_bytes
            if batch:
                inflight.append((pool.submit(_compress_batch, batch, opt.level), batch))
                batch, batch_bytes = [], 0
                drain(max_inflight)

        def add(piece: _Piece) -> None:
            nonlocal batch_bytes
            batch.append(piece)
            batch_bytes += len(piece.data)
            if batch_bytes >= (4 << 20) or len(batch) >= 256:
                submit()

        def flush_meta() -> None:
            if meta:
                add(_Piece(bytes(meta), False))
                meta.clear()

        pool = ThreadPoolExecutor(max_workers=opt.threads, thread_name_prefix="shoal-zstd")
        try:
            while True:
                item = reader.next()
                if item is None:
                    break
                raw, entry = item
                split.segment(raw)
                meta += raw
                self._check_entry(entry, entries)
                record = _FileRecord(entry)
                records.append(record)
                crc = None
                if entry.size:
                    flush_meta()
                    crc = self._add_payload(reader, record, add, hasher)
                split.file(entry.raw_name, entry.size, crc)
                if self._progress:
                    self._progress(reader.offset)
            trailer = reader.trailer()
            split.segment(trailer)
            meta += trailer
            flush_meta()
            submit()
            drain(0)
        finally:
            for fut, _ in inflight:
                fut.cancel()
            pool.shutdown(wait=True)
            hasher.close()

        split_data = split.getvalue()
        cctx = zstandard.ZstdCompressor(level=opt.level, write_content_size=True)
        split_compressed = cctx.compress(split_data)
        split_digest = "sha256:" + hashlib.sha256(split_compressed).hexdigest()
        toc_json = _toc_json(records, split_digest)
        toc_compressed = cctx.compress(toc_json)
        toc_off = sink.count + SKIPPABLE_HEADER
        sink.write(skippable_frame(toc_compressed))
        split_off = sink.count + SKIPPABLE_HEADER
        sink.write(skippable_frame(split_compressed))
        footer = struct.pack(
            "<7Q",
            toc_off,
            len(toc_compressed),
            len(toc_json),
            MANIFEST_TYPE_CRFS,
            split_off,
            len(split_compressed),
            len(split_data),
        )
        sink.write(skippable_frame(footer + FOOTER_MAGIC))
        toc_digest = "sha256:" + hashlib.sha256(toc_compressed).hexdigest()
        position = f"{toc_off}:{len(toc_compressed)}:{len(toc_json)}:{MANIFEST_TYPE_CRFS}"
        annotations = {
            MANIFEST_CHECKSUM: toc_digest,
            MANIFEST_POSITION: position,
            TARSPLIT_POSITION: f"{split_off}:{len(split_compressed)}:{len(split_data)}",
            # Older readers (containers/storage <= 1.43: podman 4.3, skopeo 1.9) look
            # only for these; the TOC they point at is the same.
            OLD_MANIFEST_CHECKSUM: toc_digest,
            OLD_MANIFEST_POSITION: position,
        }
        return LayerResult(
            digest="sha256:" + sink.sha.hexdigest(),
            size=sink.count,
            diff_id=diff_id or "sha256:" + tar_sha.hexdigest(),
            tar_size=reader.offset,
            annotations=annotations,
            files=sum(1 for r in records if r.entry.type == "reg"),
            chunks=sum(len(r.pieces) for r in records),
            chunk_digests={p.digest: size for r in records for p, size in zip(r.pieces, r.sizes)},
        )

    @staticmethod
    def _check_entry(entry: TarEntry, entries: LayerEntries) -> None:
        try:
            entries.admit(entry.name, entry.type, entry.linkname)
        except FormatError as e:
            raise FormatError(f"tar entry {entry.name[:200]!r}: {e}") from None
        if entry.size > MAX_FILE_SIZE:
            raise FormatError(f"tar entry {entry.name!r}: absurd size {entry.size}")

    def _add_payload(
        self, reader: TarReader, record: _FileRecord, add: Callable[[_Piece], None], hasher: _Hasher
    ) -> int:
        """Cut the current entry's payload into chunks; returns its CRC-64 for tar-split."""
        size = record.entry.size
        crc = tarsplit.CRC64_INIT
        if size < self.opt.min_split:
            data = reader.read_payload(size)
            if len(data) < size:
                data += b"".join(_read_all(reader, size - len(data)))
            crc = tarsplit.crc64_update(crc, data)
            self._emit(record, data, add)
            return crc
        file_sha = hashlib.sha256()
        window = b""
        left = size
        while left or window:
            parts = [window] if window else []
            have = len(window)
            while left and have < self._window:
                data = reader.read_payload(min(left, self._window - have))
                parts.append(data)
                have += len(data)
                left -= len(data)
            window = b"".join(parts) if len(parts) != 1 else parts[0]
            view = memoryview(window)
            cuts = list(self._cdc.cut_buf(view))
            if left:  # the last cut is the buffer's end, not a content boundary: carry it
                cuts = cuts[:-1]
            for c in cuts:
                data = bytes(view[c.offset : c.offset + c.length])
                crc = tarsplit.crc64_update(crc, data)
                hasher.update(file_sha, data)
                self._emit(record, data, add)
            consumed = cuts[-1].offset + cuts[-1].length if cuts else 0
            view.release()
            window = window[consumed:]
            if not left and not window:
                break
        record.digest_sha = file_sha  # read after the hasher is closed
        return crc

    @staticmethod
    def _emit(record: _FileRecord, data: bytes, add: Callable[[_Piece], None]) -> None:
        piece = _Piece(data, True)
        record.pieces.append(piece)
        record.sizes.append(len(data))
        add(piece)


def _read_all(reader: TarReader, n: int) -> Iterable[bytes]:
    while n:
        data = reader.read_payload(n)
        n -= len(data)
        yield data


def _toc_json(records: Sequence[_FileRecord], tarsplit_digest: str) -> bytes:
    entries = []
    for r in records:
        e = r.entry
        base: dict = {"type": e.type, "name": e.name}
        if e.linkname:
            base["linkName"] = e.linkname
        for key, value in (("mode", e.mode), ("size", e.size), ("uid", e.uid), ("gid", e.gid)):
            if value:
                base[key] = value
        if e.mtime:
            base["modtime"] = format_timestamp(e.mtime)
        # containers/storage <= 1.46 (Debian's podman 4.3) matches these keys
        # case-sensitively as UID, GID and ModTime; newer readers fold case, and the
        # duplicates carry equal values, so both kinds read the same metadata.
        for key, old_key in (("uid", "UID"), ("gid", "GID"), ("modtime", "ModTime")):
            if key in base:
                base[old_key] = base[key]
        if e.atime:
            base["accesstime"] = format_timestamp(e.atime)
        if e.ctime:
            base["changetime"] = format_timestamp(e.ctime)
        if e.devmajor:
            base["devMajor"] = e.devmajor
        if e.devminor:
            base["devMinor"] = e.devminor
        if e.xattrs:
            base["xattrs"] = {k: base64.b64encode(v).decode() for k, v in e.xattrs.items()}
        pieces = r.pieces
        if pieces:
            base["digest"] = r.digest
            base["offset"] = pieces[0].start
            base["endOffset"] = pieces[-1].end
        entries.append(base)
        if len(pieces) > 1:
            sizes = r.sizes
            base["chunkSize"] = sizes[0]
            base["chunkDigest"] = pieces[0].digest
            offset = sizes[0]
            for p, size in zip(pieces[1:], sizes[1:]):
                entries.append(
                    {
                        "type": CHUNK_TYPE,
                        "name": e.name,
                        "offset": p.start,
                        "chunkSize": size,
                        "chunkOffset": offset,
                        "chunkDigest": p.digest,
                    }
                )
                offset += size
    doc = {"version": 1, "entries": entries, "tarSplitDigest": tarsplit_digest}
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode()
