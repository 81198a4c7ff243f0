"""The zstd:chunked layer format: writer and reader side by side.

A zstd:chunked layer (containers/storage `pkg/chunked`) is a valid `tar+zstd` OCI layer
whose zstd frames are laid out so that any file can be fetched and decompressed alone:

    [frame: tar headers][frame: file A chunk 0][frame: file A chunk 1][frame: padding+headers]...
    [frame: end-of-archive blocks]
    [skippable frame: zstd(TOC JSON)]
    [skippable frame: zstd(tar-split JSON lines)]
    [skippable frame: 64-byte footer]

- Each regular file's content starts a new zstd frame, and each content-defined chunk
  of a large file is its own frame. Everything that is not file content (headers,
  padding, end-of-archive blocks) goes in the frames between them. `zstd -d` of the
  whole blob therefore yields the source tar byte for byte (skippable frames are
  ignored by decoders).
- A skippable frame is magic `50 2A 4D 18` (0x184D2A50, LE), a u32 LE payload length,
  then the payload. Positions below point just past that 8-byte header.
- The footer (payload of the last skippable frame, FOOTER_SIZE = 64 bytes), all u64 LE:
      0  TOC offset              8  TOC compressed length    16  TOC uncompressed length
     24  manifest type (= 1)    32  tar-split offset         40  tar-split compressed length
     48  tar-split uncompressed length                       56  magic "GNUlInUx"
  The older variant (containers/storage 1.43, Debian's skopeo 1.9) has a 40-byte
  footer: TOC offset, compressed length, uncompressed length, type, magic "GnUlInUx";
  no tar-split, and its annotations are named io.containers.zstd-chunked.*.
- Readers locate the TOC from layer annotations (MANIFEST_POSITION: `off:len:ulen:1`)
  and verify it against MANIFEST_CHECKSUM (sha256 of the compressed TOC); the footer
  only makes a blob self-describing.
- TOC JSON: `{"version":1,"entries":[...],"tarSplitDigest":"sha256:..."}`. An entry of
  a regular file carries `digest` (sha256 of the content), `offset`/`endOffset` (the
  compressed range of its frames). A file cut into several chunks has its first chunk's
  `chunkSize`/`chunkDigest` on the `reg` entry, then one `chunk` entry per further
  chunk with `chunkOffset` (position in the file), `chunkSize`, `offset` (start of its
  frame) and `chunkDigest`; a chunk ends where the next begins, the last at `endOffset`.
"""

from __future__ import annotations

import base64
import bisect
import datetime as _dt
import hashlib
import io
import json
import os
import queue
import struct
import sys
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import IO, BinaryIO, Callable, Iterable, Protocol, Sequence

import pyfastcdc
import zstandard

from builder import tarsplit
from builder.tarstream import LayerEntries, TarEntry, TarReader, clean_name
from shoal.digest import check_digest, is_digest
from shoal.errors import DigestMismatch, FormatError

# --- constants --------------------------------------------------------------------

SKIPPABLE_MAGIC = b"\x50\x2a\x4d\x18"
SKIPPABLE_HEADER = 8
FOOTER_MAGIC = b"GNUlInUx"
FOOTER_SIZE = 64
OLD_FOOTER_SIZE = 40
OLD_FOOTER_MAGIC = b"GnUlInUx"  # sic: the magic changed case with the 64-byte footer
MANIFEST_TYPE_CRFS = 1
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

# Current annotations (containers/storage >= 1.46).
MANIFEST_CHECKSUM = "io.github.containers.zstd-chunked.manifest-checksum"
MANIFEST_POSITION = "io.github.containers.zstd-chunked.manifest-position"
TARSPLIT_POSITION = "io.github.containers.zstd-chunked.tarsplit-position"
# Older annotations (Debian's skopeo 1.9 / podman 4.3).
OLD_MANIFEST_CHECKSUM = "io.containers.zstd-chunked.manifest-checksum"
OLD_MANIFEST_POSITION = "io.containers.zstd-chunked.manifest-position"

# Bounds against hostile layers (containers/storage refuses TOCs over 150 MiB, too).
MAX_TOC_COMPRESSED = 50 << 20
MAX_TOC_UNCOMPRESSED = 150 << 20
MAX_TARSPLIT_UNCOMPRESSED = 1 << 30
MAX_FILE_SIZE = 1 << 44  # 16 TiB: anything larger in a layer is hostile
MAX_CHUNK_SIZE = 256 << 20  # a chunk is decompressed in memory

ENTRY_TYPES = {"reg", "hardlink", "symlink", "char", "block", "dir", "fifo"}
CHUNK_TYPE = "chunk"


def skippable_frame(payload: bytes) -> bytes:
    return SKIPPABLE_MAGIC + struct.pack("<I", len(payload)) + payload


# --- footer and annotations (pure) ---------------------------------------------------


@dataclass(frozen=True)
class Position:
    """Where a skippable frame's payload lies in the blob."""

    offset: int
    length: int
    uncompressed: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class TocLocation:
    """Everything a reader needs to fetch and trust a layer's TOC."""

    toc: Position
    toc_digest: str | None  # None when only the footer was available (trust nothing)
    tarsplit: Position | None
    variant: str  # "current" or "old"


def parse_footer(data: bytes) -> TocLocation:
    """Parse the footer at the end of a blob (pass at least the last 64 bytes)."""
    if len(data) >= FOOTER_SIZE and data[-8:] == FOOTER_MAGIC:
        tail = data[-FOOTER_SIZE:]
        off, length, ulen, mtype, ts_off, ts_len, ts_ulen = struct.unpack("<7Q", tail[:56])
        if mtype == MANIFEST_TYPE_CRFS and ts_off > off:
            return _location(off, length, ulen, None, (ts_off, ts_len, ts_ulen), "current")
        # A 64-byte tail of an old layer may still end in an old 40-byte footer.
    if len(data) >= OLD_FOOTER_SIZE and data[-8:] in (OLD_FOOTER_MAGIC, FOOTER_MAGIC):
        off, length, ulen, mtype = struct.unpack("<4Q", data[-OLD_FOOTER_SIZE:-8])
        if mtype != MANIFEST_TYPE_CRFS:
            raise FormatError(f"zstd:chunked footer: manifest type {mtype}, want {MANIFEST_TYPE_CRFS}")
        return _location(off, length, ulen, None, None, "old")
    raise FormatError("zstd:chunked footer: magic not found (not a zstd:chunked layer, or truncated)")


def _position_numbers(value: str, count: int, key: str) -> list[int]:
    parts = value.split(":")
    if len(parts) != count or not all(p.isdigit() and len(p) <= 20 for p in parts):
        raise FormatError(f"annotation {key}: malformed value {value[:80]!r}")
    return [int(p) for p in parts]


def _location(
    off: int, length: int, ulen: int, digest: str | None, tarsplit_pos: tuple | None, variant: str
) -> TocLocation:
    if length <= 0 or length > MAX_TOC_COMPRESSED:
        raise FormatError(f"TOC compressed length {length} out of range")
    if ulen <= 0 or ulen > MAX_TOC_UNCOMPRESSED:
        raise FormatError(f"TOC uncompressed length {ulen} out of range (max {MAX_TOC_UNCOMPRESSED})")
    ts = None
    if tarsplit_pos is not None:
        ts_off, ts_len, ts_ulen = tarsplit_pos
        if ts_len <= 0 or ts_ulen > MAX_TARSPLIT_UNCOMPRESSED:
            raise FormatError(f"tar-split length {ts_len}/{ts_ulen} out of range")
        ts = Position(ts_off, ts_len, ts_ulen)
    return TocLocation(Position(off, length, ulen), digest, ts, variant)


def location_from_annotations(annotations: dict | None) -> TocLocation | None:
    """The TOC location from a layer descriptor's annotations; None if not zstd:chunked."""
    if not annotations:
        return None
    for pos_key, sum_key, variant in (
        (MANIFEST_POSITION, MANIFEST_CHECKSUM, "current"),
        (OLD_MANIFEST_POSITION, OLD_MANIFEST_CHECKSUM, "old"),
    ):
        if pos_key not in annotations:
            continue
        off, length, ulen, mtype = _position_numbers(str(annotations[pos_key]), 4, pos_key)
        if mtype != MANIFEST_TYPE_CRFS:
            raise FormatError(f"annotation {pos_key}: manifest type {mtype}, want {MANIFEST_TYPE_CRFS}")
        digest = check_digest(annotations.get(sum_key), f"annotation {sum_key}")
        ts = None
        if variant == "current" and TARSPLIT_POSITION in annotations:
            ts = tuple(_position_numbers(str(annotations[TARSPLIT_POSITION]), 3, TARSPLIT_POSITION))
        return _location(off, length, ulen, digest, ts, variant)
    return None


# --- the TOC (pure) -------------------------------------------------------------------


@dataclass
class Chunk:
    """One independently compressed piece of a file's content."""

    file_offset: int  # where the chunk's bytes start in the file
    size: int  # uncompressed bytes
    start: int  # compressed range [start, end) in the blob
    end: int
    digest: str  # sha256 of the uncompressed bytes
    zeros: bool = False


@dataclass
class Entry:
    name: str  # cleaned: no leading "/" or "./", no trailing "/", "" for the root
    type: str
    mode: int = 0
    uid: int = 0
    gid: int = 0
    size: int = 0
    mtime: float = 0.0
    linkname: str = ""  # symlink target as written; hard link target cleaned
    devmajor: int = 0
    devminor: int = 0
    xattrs: dict[str, bytes] = field(default_factory=dict)
    digest: str = ""
    chunks: list[Chunk] = field(default_factory=list)


@dataclass
class Toc:
    entries: list[Entry]
    tarsplit_digest: str | None = None

    def files(self) -> Iterable[Entry]:
        return (e for e in self.entries if e.type == "reg")


def _timestamp(value: object, key: str, name: str) -> float:
    if value is None:
        return 0.0
    if not isinstance(value, str) or len(value) > 64:
        raise FormatError(f"TOC entry {name!r}: bad {key}")
    text = value
    # RFC 3339 with up to nanoseconds; Python parses microseconds, so trim the rest.
    try:
        main, _, rest = text.partition(".")
        frac = 0.0
        if rest:
            digits = "".join(c for c in rest[:9] if c.isdigit())
            tz = rest[len(digits) :]
            frac = float("0." + digits) if digits else 0.0
            text = main + tz
        t = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
        if t.tzinfo is None:
            t = t.replace(tzinfo=_dt.timezone.utc)
        return t.timestamp() + frac
    except (ValueError, OverflowError):
        raise FormatError(f"TOC entry {name!r}: bad {key} {value[:40]!r}") from None


def format_timestamp(ts: float) -> str:
    """RFC 3339 in UTC, fraction without trailing zeros (Go's RFC3339Nano)."""
    sec = int(ts // 1)
    frac = ts - sec
    t = _dt.datetime.fromtimestamp(sec, _dt.timezone.utc)
    text = t.strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        digits = f"{frac:.9f}"[2:].rstrip("0")
        if digits:
            text += "." + digits
    return text + "Z"


def _int(obj: dict, key: str, name: str, limit: int = MAX_FILE_SIZE) -> int:
    value = obj.get(key, 0)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value > limit:
        raise FormatError(f"TOC entry {name!r}: {key} {str(value)[:30]} out of range")
    return value


def _str(obj: dict, key: str, name: str) -> str:
    value = obj.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FormatError(f"TOC entry {name!r}: {key} is not a string")
    return value


def decompress_toc(compressed: bytes, expected_digest: str | None, uncompressed_size: int | None = None) -> bytes:
    """Verify the compressed TOC against its digest and decompress it (bounded)."""
    if expected_digest is not None:
        got = "sha256:" + hashlib.sha256(compressed).hexdigest()
        if got != expected_digest:
            raise DigestMismatch(f"TOC digest mismatch (annotation says {expected_digest}, blob has {got})")
    limit = uncompressed_size if uncompressed_size else MAX_TOC_UNCOMPRESSED
    data = _decompress(compressed, limit, "TOC")
    if uncompressed_size is not None and len(data) != uncompressed_size:
        raise FormatError(f"TOC is {len(data)} bytes uncompressed, the position says {uncompressed_size}")
    return data


def _decompress(data: bytes | memoryview, limit: int, what: str) -> bytes:
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data), read_across_frames=True) as r:
            out = r.read(limit + 1)
            if len(out) <= limit:
                while len(out) <= limit:
                    more = r.read(limit + 1 - len(out))
                    if not more:
                        break
                    out += more
    except zstandard.ZstdError as e:
        raise FormatError(f"{what}: cannot decompress ({e})") from None
    if len(out) > limit:
        raise FormatError(f"{what}: decompresses to more than {limit} bytes")
    return out


def parse_toc(data: bytes, blob_size: int | None = None) -> Toc:
    """Parse and validate uncompressed TOC JSON.

    Raises FormatError for anything a reader could be misled by: names escaping the
    root, duplicate entries, chunks that do not tile the file, ranges outside the blob.
    """
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise FormatError("TOC is not valid JSON") from None
    if not isinstance(doc, dict):
        raise FormatError("TOC is not a JSON object")
    if doc.get("version") != 1:
        raise FormatError(f"TOC version {str(doc.get('version'))[:20]}, want 1")
    raw_entries = doc.get("entries")
    if not isinstance(raw_entries, list):
        raise FormatError("TOC has no entries list")
    ts_digest = doc.get("tarSplitDigest") or None
    if ts_digest is not None:
        check_digest(ts_digest, "TOC tarSplitDigest")

    entries: list[Entry] = []
    rules = LayerEntries()
    current: Entry | None = None  # the reg entry whose chunk entries may follow

    def close_file() -> None:
        nonlocal current
        if current is None:
            return
        _finish_chunks(current, blob_size)
        current = None

    for raw in raw_entries:
        if not isinstance(raw, dict):
            raise FormatError("TOC entry is not an object")
        typ = raw.get("type")
        raw_name = raw.get("name")
        if not isinstance(raw_name, str):
            raise FormatError("TOC entry without a name")
        name = clean_name(raw_name, untrusted=True)
        if typ == CHUNK_TYPE:
            if current is None or current.name != name:
                raise FormatError(f"TOC chunk entry {name!r} does not follow its file")
            current.chunks.append(_chunk(raw, name, file_offset=_int(raw, "chunkOffset", name)))
            continue
        close_file()
        if not isinstance(typ, str) or typ not in ENTRY_TYPES:
            raise FormatError(f"TOC entry {name!r}: unknown type {str(typ)[:20]!r}")
        e = Entry(
            name=name,
            type=typ,
            mode=_int(raw, "mode", name, 0o7777777),
            uid=_int(raw, "uid", name, 2**32 - 1),
            gid=_int(raw, "gid", name, 2**32 - 1),
            size=_int(raw, "size", name),
            mtime=_timestamp(raw.get("modtime"), "modtime", name),
            linkname=_str(raw, "linkName", name),
            devmajor=_int(raw, "devMajor", name, 2**32 - 1),
            devminor=_int(raw, "devMinor", name, 2**32 - 1),
            digest=_str(raw, "digest", name),
        )
        xattrs = raw.get("xattrs") or {}
        if not isinstance(xattrs, dict):
            raise FormatError(f"TOC entry {name!r}: xattrs is not an object")
        for k, v in xattrs.items():
            if not isinstance(v, str):
                raise FormatError(f"TOC entry {name!r}: xattr {k[:40]!r} is not a string")
            try:
                e.xattrs[k] = base64.b64decode(v, validate=True)
            except ValueError:
                raise FormatError(f"TOC entry {name!r}: xattr {k[:40]!r} is not base64") from None
        try:
            rules.admit(raw_name, e.type, e.linkname)
        except FormatError as err:
            raise FormatError(f"TOC entry {name!r}: {err}") from None
        if e.type == "hardlink":
            e.linkname = clean_name(e.linkname, untrusted=True)
        elif e.type == "symlink" and not e.linkname:
            raise FormatError(f"TOC entry {name!r}: symlink without a target")
        if e.type == "reg" and e.size:
            if e.digest:
                check_digest(e.digest, f"TOC entry {name!r} digest")
            e.chunks.append(_chunk(raw, name, file_offset=0))
            current = e
        elif e.type != "reg":
            e.size = 0
        entries.append(e)
    close_file()
    return Toc(entries, ts_digest)


def _chunk(raw: dict, name: str, file_offset: int) -> Chunk:
    start = _int(raw, "offset", name)
    digest = raw.get("chunkDigest") or ""
    if digest:
        check_digest(digest, f"TOC entry {name!r} chunkDigest")
    ctype = raw.get("chunkType") or ""
    if ctype not in ("", "data", "zeros"):
        raise FormatError(f"TOC entry {name!r}: unknown chunkType {str(ctype)[:20]!r}")
    c = Chunk(file_offset, _int(raw, "chunkSize", name, MAX_CHUNK_SIZE), start, 0, digest, ctype == "zeros")
    c.end = _int(raw, "endOffset", name)  # only meaningful on the reg entry; fixed up later
    return c


def _finish_chunks(e: Entry, blob_size: int | None) -> None:
    """Fill in chunk ends and sizes, then check that the chunks tile the file."""
    chunks = e.chunks
    end_offset = chunks[0].end
    if len(chunks) == 1:
        c = chunks[0]
        c.size = e.size
        c.end = end_offset
        if not c.digest:
            c.digest = e.digest
    else:
        for i, c in enumerate(chunks):
            c.end = chunks[i + 1].start if i + 1 < len(chunks) else end_offset
    expect = 0
    for c in chunks:
        if c.file_offset != expect:
            raise FormatError(f"TOC entry {e.name!r}: chunk at file offset {c.file_offset}, want {expect}")
        if c.size <= 0:
            raise FormatError(f"TOC entry {e.name!r}: chunk of size {c.size}")
        if c.size > MAX_CHUNK_SIZE and not c.zeros:
            raise FormatError(f"TOC entry {e.name!r}: chunk of {c.size} bytes is too large")
        if not (0 < c.start < c.end) or (blob_size is not None and c.end > blob_size):
            raise FormatError(f"TOC entry {e.name!r}: compressed range {c.start}-{c.end} out of bounds")
        if not is_digest(c.digest) and not c.zeros:
            raise FormatError(f"TOC entry {e.name!r}: chunk without a sha256 digest")
        expect += c.size
    if expect != e.size:
        raise FormatError(f"TOC entry {e.name!r}: chunks cover {expect} bytes of {e.size}")


# --- writer ----------------------------------------------------------------------------


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

    __slots__ = ("data", "is_data", "frame", "digest", "start", "end")

    def __init__(self, data: bytes, is_data: bool):
        self.data = data
        self.is_data = is_data
        self.frame = b""
        self.digest = ""
        self.start = 0
        self.end = 0


class _FileRecord:
    __slots__ = ("entry", "pieces", "sizes", "digest_sha")

    def __init__(self, entry: TarEntry):
        self.entry = entry
        self.pieces: list[_Piece] = []
        self.sizes: list[int] = []  # uncompressed size of each piece
        self.digest_sha: "hashlib._Hash | None" = None  # whole file, when cut into chunks

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

    def update(self, h: "hashlib._Hash", data: bytes) -> None:
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
        # Compression threads release the GIL in C; a short switch interval lets the
        # parsing thread get it back quickly instead of waiting up to 5 ms each time.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, 0.0005))
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
            sys.setswitchinterval(switch)

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


# --- reader (sans I/O) --------------------------------------------------------------------

# fetch(ranges) -> one bytes object per [start, end) range, in order.
FetchRanges = Callable[[Sequence[tuple[int, int]]], Sequence[bytes]]


class ChunkLoader(Protocol):
    """Turns chunks into their verified, decompressed bytes (fetching as it must)."""

    def load(self, chunks: Sequence[Chunk], what: str) -> list[bytes]: ...


class RangeLoader:
    """The plain loader: fetch the compressed ranges at once, decode and verify each."""

    def __init__(self, fetch: FetchRanges):
        self._fetch = fetch

    def load(self, chunks: Sequence[Chunk], what: str) -> list[bytes]:
        raws = self._fetch([(c.start, c.end) for c in chunks])
        if len(raws) != len(chunks):
            raise FormatError(f"{what}: fetch returned {len(raws)} ranges for {len(chunks)}")
        return [decode_chunk(c, raw, what) for c, raw in zip(chunks, raws)]


class ChunkMemory:
    """Decompressed, verified chunks in memory: a byte-bounded LRU, thread-safe.

    Keys are chunk digests (so one copy serves every layer that has the chunk) or, for
    chunks without one, a key private to their reader. A LayerReader keeps its own small
    one unless it is given one to share (the node gives every layer the same one).
    """

    def __init__(self, capacity: int = 64 << 20):
        self._data: OrderedDict[object, bytes] = OrderedDict()
        self._size = 0
        self.capacity = capacity
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: object) -> bytes | None:
        with self._lock:
            data = self._data.get(key)
            if data is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return data

    def contains(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def put(self, key: object, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return
            self._data[key] = data
            self._size += len(data)
            while self._size > self.capacity:
                _, old = self._data.popitem(last=False)
                self._size -= len(old)

    def statistics(self) -> dict:
        with self._lock:
            return {"memory_bytes": self._size, "memory_chunks": len(self._data), "memory_capacity": self.capacity,
                    "memory_hits": self.hits, "memory_misses": self.misses}


@dataclass
class Stat:
    name: str
    type: str
    mode: int  # permission bits (and setuid/setgid/sticky)
    uid: int
    gid: int
    size: int
    mtime: float
    nlink: int
    devmajor: int
    devminor: int
    ino: int


class LayerReader:
    """Answers file-system questions about one layer from its TOC.

    Paths are root-relative ("" is the root; leading "/" is accepted). Reads load only
    the chunks they need through `loader` (or a RangeLoader over `fetch`), which verifies
    every chunk against its sha256 before a byte of it is returned. Decompressed chunks
    are kept in `memory` (a ChunkMemory; by default a small one of the reader's own), so
    sequential small reads decode each chunk once.
    Errors: FileNotFoundError / NotADirectoryError / IsADirectoryError / OSError for
    path problems (errno set, so FUSE can pass them on); DigestMismatch and FormatError
    when the layer's bytes are bad.
    """

    def __init__(
        self, toc: Toc, fetch: FetchRanges | None = None, layer: str = "layer",
        loader: ChunkLoader | None = None, memory: ChunkMemory | None = None,
    ):
        if loader is None:
            if fetch is None:
                raise TypeError("LayerReader needs fetch or loader")
            loader = RangeLoader(fetch)
        self._loader = loader
        self._layer = layer
        self._offsets: dict[str, list[int]] = {}  # file -> its chunks' file offsets
        self.memory = memory if memory is not None else ChunkMemory()
        self.on_read: Callable[[Sequence[Chunk]], None] | None = None  # told the chunks of every read
        self.entries: dict[str, Entry] = {}
        self.children: dict[str, dict[str, None]] = {"": {}}
        self.nlink: dict[str, int] = {}
        self.ino: dict[str, int] = {"": 1}
        root = Entry(name="", type="dir", mode=0o755)
        self.entries[""] = root
        for e in toc.entries:
            self._add(e)

    def _add(self, e: Entry) -> None:
        name = e.name
        if name in self.entries and name != "":
            # only dir-over-dir reaches here (parse_toc refuses other duplicates)
            self.entries[name] = e
            return
        if name == "":
            self.entries[""] = e
            return
        parent, _, base = name.rpartition("/")
        self._ensure_dir(parent)
        if self.entries[parent].type != "dir":
            raise FormatError(f"{self._layer}: entry {name!r} lies under non-directory {parent!r}")
        self.children[parent][base] = None
        self.entries[name] = e
        self.ino[name] = len(self.ino) + 1
        if e.type == "dir":
            self.children.setdefault(name, {})
        if e.type == "hardlink":
            target = self._resolve_link_target(e)
            self.nlink[target.name] = self.nlink.get(target.name, 1) + 1
            self.ino[name] = self.ino[target.name]

    def _ensure_dir(self, path: str) -> None:
        if path in self.entries:
            return
        parent, _, base = path.rpartition("/")
        self._ensure_dir(parent)
        self.entries[path] = Entry(name=path, type="dir", mode=0o755)
        self.children[parent][base] = None
        self.children[path] = {}
        self.ino[path] = len(self.ino) + 1

    def _resolve_link_target(self, e: Entry) -> Entry:
        target = self.entries.get(e.linkname)
        if target is None or target.type in ("dir", "hardlink"):
            raise FormatError(f"{self._layer}: hard link {e.name!r} to {e.linkname!r} cannot be resolved")
        return target

    def _lookup(self, path: str) -> Entry:
        try:
            name = clean_name(path)
        except FormatError:
            raise FileNotFoundError(2, "No such file or directory", path) from None
        e = self.entries.get(name)
        if e is None:
            raise FileNotFoundError(2, "No such file or directory", path)
        return e

    def _content(self, path: str) -> Entry:
        e = self._lookup(path)
        if e.type == "hardlink":
            e = self._resolve_link_target(e)
        return e

    def stat(self, path: str) -> Stat:
        e = self._content(path)
        name = clean_name(path)
        return Stat(
            name=name,
            type=e.type,
            mode=e.mode & 0o7777,
            uid=e.uid,
            gid=e.gid,
            size=e.size if e.type == "reg" else len(e.linkname.encode()) if e.type == "symlink" else 0,
            mtime=e.mtime,
            nlink=self.nlink.get(e.name, 1) if e.type != "dir" else 2 + sum(
                1 for c in self.children.get(name, {}) if self.entries[_join(name, c)].type == "dir"
            ),
            devmajor=e.devmajor,
            devminor=e.devminor,
            ino=self.ino.get(name, 0),
        )

    def readdir(self, path: str) -> list[str]:
        e = self._lookup(path)
        if e.type != "dir":
            raise NotADirectoryError(20, "Not a directory", path)
        return list(self.children.get(clean_name(path), {}))

    def readlink(self, path: str) -> str:
        e = self._lookup(path)
        if e.type != "symlink":
            raise OSError(22, "Invalid argument", path)
        return e.linkname

    def listxattr(self, path: str) -> list[str]:
        return list(self._content(path).xattrs)

    def getxattr(self, path: str, key: str) -> bytes:
        x = self._content(path).xattrs
        if key not in x:
            raise OSError(61, "No data available", path)  # ENODATA
        return x[key]

    def chunks_for(self, path: str, offset: int, size: int) -> list[Chunk]:
        """The chunks holding bytes [offset, offset+size) of a regular file."""
        e = self._content(path)
        if e.type == "dir":
            raise IsADirectoryError(21, "Is a directory", path)
        if e.type != "reg":
            raise OSError(22, "Invalid argument", path)
        end = min(e.size, offset + size)
        if offset >= end:
            return []
        # Chunks tile the file in order (parse_toc checks it): find the first by bisection,
        # so a read of a file with hundreds of chunks does not scan them all.
        offsets = self._offsets.get(e.name)
        if offsets is None:
            offsets = self._offsets[e.name] = [c.file_offset for c in e.chunks]
        i = bisect.bisect_right(offsets, offset) - 1
        out = []
        for c in e.chunks[max(i, 0):]:
            if c.file_offset >= end:
                break
            out.append(c)
        return out

    def read(self, path: str, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0:
            raise OSError(22, "Invalid argument", path)
        chunks = self.chunks_for(path, offset, size)
        if not chunks:
            return b""
        data = _slice_chunks(chunks, self.load_chunks(chunks, path), offset, size)
        if self.on_read is not None:
            self.on_read(chunks)
        return data

    def memory_key(self, c: Chunk) -> object:
        """The chunk's key in `memory`: its digest, or a key only this reader uses."""
        return c.digest or (id(self), c.start, c.end)

    def read_cached(self, path: str, offset: int, size: int) -> bytes | None:
        """Like read(), but only from chunks already decompressed in memory; None if any
        chunk would have to be loaded (lets an event loop answer without a thread)."""
        if offset < 0 or size < 0:
            raise OSError(22, "Invalid argument", path)
        chunks = self.chunks_for(path, offset, size)
        datas = []
        for c in chunks:
            data = bytes(c.size) if c.zeros else self.memory.get(self.memory_key(c))
            if data is None:
                return None
            datas.append(data)
        if self.on_read is not None and chunks:
            self.on_read(chunks)
        return _slice_chunks(chunks, datas, offset, size)

    def load_chunks(self, chunks: Sequence[Chunk], path: str = "") -> list[bytes]:
        """Decompressed, verified bytes of each chunk (fetching the missing ones at once)."""
        result: dict[int, bytes] = {}
        missing: list[tuple[int, Chunk]] = []
        for i, c in enumerate(chunks):
            data = bytes(c.size) if c.zeros else self.memory.get(self.memory_key(c))
            if data is None:
                missing.append((i, c))
            else:
                result[i] = data
        if missing:
            datas = self._loader.load([c for _, c in missing], f"{self._layer} {path!r}")
            for (i, c), data in zip(missing, datas):
                result[i] = data
                self.memory.put(self.memory_key(c), data)
        return [result[i] for i in range(len(chunks))]


def _slice_chunks(chunks: Sequence[Chunk], datas: Sequence[bytes], offset: int, size: int) -> bytes:
    """Bytes [offset, offset+size) of a file from the contents of the chunks covering it."""
    end = offset + size
    if len(chunks) == 1:
        c = chunks[0]
        return datas[0][max(offset, c.file_offset) - c.file_offset : min(end, c.file_offset + c.size) - c.file_offset]
    out = bytearray()
    for c, data in zip(chunks, datas):
        out += data[max(offset, c.file_offset) - c.file_offset : min(end, c.file_offset + c.size) - c.file_offset]
    return bytes(out)


def decode_chunk(c: Chunk, raw: bytes, what: str) -> bytes:
    """Decompress one chunk's frames and verify them; raises DigestMismatch/FormatError."""
    if len(raw) != c.end - c.start:
        raise FormatError(f"{what}: got {len(raw)} bytes for chunk at {c.start}, want {c.end - c.start}")
    data = _decompress(raw, c.size, f"{what} chunk at {c.start}")
    if len(data) != c.size:
        raise FormatError(f"{what}: chunk at {c.start} is {len(data)} bytes, TOC says {c.size}")
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    if c.digest and got != c.digest:
        raise DigestMismatch(f"{what}: chunk at {c.start} digest mismatch (want {c.digest}, got {got})")
    return data


def _join(parent: str, child: str) -> str:
    return f"{parent}/{child}" if parent else child
