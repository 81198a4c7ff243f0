"""The TOC of a zstd:chunked layer: its model (Toc, Entry, Chunk) and its parser.

TOC JSON: `{"version":1,"entries":[...],"tarSplitDigest":"sha256:..."}`. An entry of
a regular file carries `digest` (sha256 of the content), `offset`/`endOffset` (the
compressed range of its frames). A file cut into several chunks has its first chunk's
`chunkSize`/`chunkDigest` on the `reg` entry, then one `chunk` entry per further
chunk with `chunkOffset` (position in the file), `chunkSize`, `offset` (start of its
frame) and `chunkDigest`; a chunk ends where the next begins, the last at `endOffset`.

parse_toc and decompress_toc are pure functions over bytes: bad input raises
shoal.errors.FormatError (DigestMismatch, a FormatError, for a TOC that is not the
one its annotation names) and nothing else (the fuzz rule, tests/test_fuzz.py).
"""

from __future__ import annotations

import base64
import datetime as _dt
import hashlib
import io
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field

import zstandard

from builder.format.footer import MAX_TOC_UNCOMPRESSED
from builder.tarstream import LayerEntries, clean_name
from shoal.digest import DIGEST_RE, check_digest
from shoal.errors import DigestMismatch, FormatError

MAX_FILE_SIZE = 1 << 44  # 16 TiB: anything larger in a layer is hostile
MAX_CHUNK_SIZE = 256 << 20  # a chunk is decompressed in memory

ENTRY_TYPES = {"reg", "hardlink", "symlink", "char", "block", "dir", "fifo"}
CHUNK_TYPE = "chunk"


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
    if type(value) is str:  # most entries of a layer share a few times: parsed once each
        seconds = _TIMES.get(value)
        if seconds is not None:
            return seconds
        seconds = _parse_timestamp(value, key, name)
        if len(_TIMES) < _TIMES_KEPT:
            _TIMES[value] = seconds
        return seconds
    return _parse_timestamp(value, key, name)


_TIMES: dict[str, float] = {}  # timestamp text -> seconds (pure function of the text; bounded)
_TIMES_KEPT = 4096


def _parse_timestamp(value: object, key: str, name: str) -> float:
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
        # every "Z", not only a trailing one, reads as +00:00 (which TOCs parse stays fixed)
        t = _dt.datetime.fromisoformat(text.replace("Z", "+00:00"))  # noqa: FURB162
        if t.tzinfo is None:
            t = t.replace(tzinfo=_dt.UTC)
        return t.timestamp() + frac
    except (ValueError, OverflowError):
        raise FormatError(f"TOC entry {name!r}: bad {key} {value[:40]!r}") from None


def format_timestamp(ts: float) -> str:
    """RFC 3339 in UTC, fraction without trailing zeros (Go's RFC3339Nano)."""
    sec = int(ts // 1)
    frac = ts - sec
    t = _dt.datetime.fromtimestamp(sec, _dt.UTC)
    text = t.strftime("%Y-%m-%dT%H:%M:%S")
    if frac:
        digits = f"{frac:.9f}"[2:].rstrip("0")
        if digits:
            text += "." + digits
    return text + "Z"


def _int(obj: dict, key: str, name: str, limit: int = MAX_FILE_SIZE) -> int:
    value = obj.get(key, 0)
    if type(value) is int and 0 <= value <= limit:  # the common case first (bool is not int here)
        return value
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
    data = decompress_frames(compressed, limit, "TOC")
    if uncompressed_size is not None and len(data) != uncompressed_size:
        raise FormatError(f"TOC is {len(data)} bytes uncompressed, the position says {uncompressed_size}")
    return data


_DCTX = threading.local()  # one decompression context per thread: making one costs more than a small chunk


def decompress_frames(data: bytes | memoryview, limit: int, what: str) -> bytes:
    """The zstd frames in `data`, decompressed, at most `limit` bytes; FormatError otherwise.

    The common case, one frame whose header declares at most `limit` bytes (every chunk
    `shoal convert` writes), is one call on this thread's context; anything else (several
    frames, no declared size, a declared size beyond `limit`, an error) takes the stream
    path, which bounds what it produces whatever the headers claim."""
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError:
        declared = -1
    if 0 <= declared <= limit:
        dctx = getattr(_DCTX, "dctx", None)
        if dctx is None:
            dctx = _DCTX.dctx = zstandard.ZstdDecompressor()
        try:
            return dctx.decompress(data, max_output_size=limit, allow_extra_data=False)
        except zstandard.ZstdError:
            pass  # (the stream path names the error, or reads the frames that follow)
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
    admit = LayerEntries().admit
    current: Entry | None = None  # the reg entry whose chunk entries may follow
    # The checks of _int, _str and check_digest, inlined for the common case (a TOC of a
    # large image has 10^5 entries: the layer's load waits for this loop); whatever
    # fails them goes to those functions in the same order, for the same error.
    for raw in raw_entries:
        if not isinstance(raw, dict):
            raise FormatError("TOC entry is not an object")
        get = raw.get
        typ = get("type")
        raw_name = get("name")
        if not isinstance(raw_name, str):
            raise FormatError("TOC entry without a name")
        name = clean_name(raw_name, untrusted=True)
        if typ == CHUNK_TYPE:
            if current is None or current.name != name:
                raise FormatError(f"TOC chunk entry {name!r} does not follow its file")
            at = get("chunkOffset", 0)
            if type(at) is not int or not 0 <= at <= MAX_FILE_SIZE:
                at = _int(raw, "chunkOffset", name)
            current.chunks.append(_chunk(raw, name, at))
            continue
        if current is not None:
            _finish_chunks(current, blob_size)
            current = None
        if not isinstance(typ, str) or typ not in ENTRY_TYPES:
            raise FormatError(f"TOC entry {name!r}: unknown type {str(typ)[:20]!r}")
        mode, uid, gid, size = get("mode", 0), get("uid", 0), get("gid", 0), get("size", 0)
        if not (type(mode) is int and 0 <= mode <= 0o7777777 and type(uid) is int and 0 <= uid <= _U32
                and type(gid) is int and 0 <= gid <= _U32 and type(size) is int and 0 <= size <= MAX_FILE_SIZE):
            mode, uid, gid = _int(raw, "mode", name, 0o7777777), _int(raw, "uid", name, _U32), _int(raw, "gid", name, _U32)
            size = _int(raw, "size", name)
        modtime = get("modtime")
        mtime = _TIMES.get(modtime) if type(modtime) is str else None  # (_timestamp's cache, looked up here)
        if mtime is None:
            mtime = _timestamp(modtime, "modtime", name)
        linkname = get("linkName", "")
        if type(linkname) is not str:
            linkname = _str(raw, "linkName", name)
        major, minor = get("devMajor", 0), get("devMinor", 0)
        if not (type(major) is int and 0 <= major <= _U32 and type(minor) is int and 0 <= minor <= _U32):
            major, minor = _int(raw, "devMajor", name, _U32), _int(raw, "devMinor", name, _U32)
        digest = get("digest", "")
        if type(digest) is not str:
            digest = _str(raw, "digest", name)
        e = Entry(name, typ, mode, uid, gid, size, mtime, linkname, major, minor, {}, digest)
        xattrs = get("xattrs")
        if xattrs:
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
            admit(raw_name, typ, linkname, clean=name)
        except FormatError as err:
            raise FormatError(f"TOC entry {name!r}: {err}") from None
        if typ == "reg":
            if size:
                if digest and not DIGEST_RE.match(digest):
                    check_digest(digest, f"TOC entry {name!r} digest")
                e.chunks.append(_chunk(raw, name, 0))
                current = e
        elif typ == "hardlink":
            e.linkname = clean_name(linkname, untrusted=True)
            e.size = 0
        else:
            if typ == "symlink" and not linkname:
                raise FormatError(f"TOC entry {name!r}: symlink without a target")
            e.size = 0
        entries.append(e)
    if current is not None:
        _finish_chunks(current, blob_size)
    return Toc(entries, ts_digest)


_U32 = 2**32 - 1


def _chunk(raw: dict, name: str, file_offset: int) -> Chunk:
    get = raw.get
    start, size, end = get("offset", 0), get("chunkSize", 0), get("endOffset", 0)
    if not (type(start) is int and 0 <= start <= MAX_FILE_SIZE and type(size) is int and 0 <= size <= MAX_CHUNK_SIZE
            and type(end) is int and 0 <= end <= MAX_FILE_SIZE):
        start = _int(raw, "offset", name)
    digest = get("chunkDigest") or ""
    if digest and (type(digest) is not str or not DIGEST_RE.match(digest)):
        check_digest(digest, f"TOC entry {name!r} chunkDigest")
    ctype = get("chunkType") or ""
    if ctype not in ("", "data", "zeros"):
        raise FormatError(f"TOC entry {name!r}: unknown chunkType {str(ctype)[:20]!r}")
    if not (type(size) is int and 0 <= size <= MAX_CHUNK_SIZE):
        size = _int(raw, "chunkSize", name, MAX_CHUNK_SIZE)
    if not (type(end) is int and 0 <= end <= MAX_FILE_SIZE):
        end = _int(raw, "endOffset", name)  # only meaningful on the reg entry; fixed up later
    return Chunk(file_offset, size, start, end, digest, ctype == "zeros")


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
        if not c.digest and not c.zeros:  # (a digest given is checked where it is read: _chunk, parse_toc)
            raise FormatError(f"TOC entry {e.name!r}: chunk without a sha256 digest")
        expect += c.size
    if expect != e.size:
        raise FormatError(f"TOC entry {e.name!r}: chunks cover {expect} bytes of {e.size}")
