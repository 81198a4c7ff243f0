"""A tar reader that keeps every byte: headers are returned raw, payloads are streamed.

`shoal convert` must reproduce the source tar byte for byte (so the layer's diff_id does
not change), so this reader never re-encodes anything: `TarReader.next()` returns the
raw bytes that precede an entry's payload (the previous entry's padding, PAX and GNU
long-name blocks, the header block) along with the parsed entry, and the caller reads
the payload with `read_payload()`.

Supported: ustar, POSIX pax (`x` per-entry and `g` global records), GNU long names
(`L`, `K`) and GNU base-256 numbers. Refused with FormatError: sparse files, multi-volume
and unknown entry types, bad checksums, truncated streams.
"""

from __future__ import annotations

import gzip
import hashlib
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import BinaryIO

import zstandard

from shoal.errors import FormatError, ShoalError

BLOCK = 512
ZERO_BLOCK = bytes(BLOCK)

# Entry types as the zstd:chunked TOC names them.
TYPES = {
    b"0": "reg",
    b"\0": "reg",
    b"7": "reg",  # contiguous file: a regular file for every practical purpose
    b"1": "hardlink",
    b"2": "symlink",
    b"3": "char",
    b"4": "block",
    b"5": "dir",
    b"6": "fifo",
}
# Types whose size field does not announce a payload (Go's archive/tar does the same).
HEADER_ONLY = {b"1", b"2", b"3", b"4", b"5", b"6"}

# A bound for pax and GNU long-name records: real ones are tiny; a huge one is hostile.
MAX_META_RECORD = 16 << 20
MAX_NAME = 64 << 10


@dataclass
class TarEntry:
    name: str  # as written in the archive (pax path / GNU long name / ustar prefix+name)
    type: str  # reg, dir, symlink, hardlink, char, block, fifo
    mode: int
    uid: int
    gid: int
    size: int  # payload bytes that follow the header (0 for header-only types)
    mtime: float
    linkname: str = ""
    uname: str = ""
    gname: str = ""
    devmajor: int = 0
    devminor: int = 0
    atime: float | None = None
    ctime: float | None = None
    xattrs: dict[str, bytes] = field(default_factory=dict)
    raw_name: bytes = b""  # the name's exact bytes (not always UTF-8)


def _nul_terminated(b: bytes) -> bytes:
    i = b.find(b"\0")
    return b if i < 0 else b[:i]


def _number(field_bytes: bytes, what: str) -> int:
    """Parse an octal (NUL/space padded) or GNU base-256 numeric field."""
    if field_bytes and field_bytes[0] & 0x80:
        # base-256: big-endian two's complement with the top bit of byte 0 as the marker
        value = int.from_bytes(field_bytes, "big", signed=False)
        value &= ~(0x80 << (8 * (len(field_bytes) - 1)))
        if field_bytes[0] & 0x40:  # negative
            value -= 1 << (8 * len(field_bytes) - 1)
        return value
    text = _nul_terminated(field_bytes).strip(b" \0")
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        raise FormatError(f"tar header: bad numeric field {what}: {field_bytes!r}") from None


def _checksum_ok(block: bytes) -> bool:
    try:
        stored = _number(block[148:156], "chksum")
    except FormatError:
        return False
    unsigned = sum(block[:148]) + 8 * 32 + sum(block[156:])
    if stored == unsigned:
        return True
    signed = sum((c - 256 if c > 127 else c) for c in block[:148] + block[156:]) + 8 * 32
    return stored == signed


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "surrogateescape")


def parse_pax(data: bytes) -> dict[str, bytes]:
    """Parse pax extended header records: `"%d %s=%s\\n" % (len, key, value)`."""
    records: dict[str, bytes] = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:  # some writers pad with NULs
            break
        sp = data.find(b" ", pos, pos + 20)
        if sp < 0:
            raise FormatError("tar pax header: record without a length")
        try:
            length = int(data[pos:sp])
        except ValueError:
            raise FormatError("tar pax header: bad record length") from None
        end = pos + length
        if length <= sp - pos + 1 or end > len(data) or data[end - 1 : end] != b"\n":
            raise FormatError("tar pax header: record length out of range")
        record = data[sp + 1 : end - 1]
        eq = record.find(b"=")
        if eq <= 0:
            raise FormatError("tar pax header: record without a key")
        key = record[:eq].decode("utf-8", "surrogateescape")
        records[key] = record[eq + 1 :]
        pos = end
    return records


def _pax_time(value: bytes, key: str) -> float:
    try:
        return float(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise FormatError(f"tar pax header: bad {key} {value[:40]!r}") from None


def _pax_int(value: bytes, key: str) -> int:
    try:
        n = int(value.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise FormatError(f"tar pax header: bad {key} {value[:40]!r}") from None
    if n < 0:
        raise FormatError(f"tar pax header: negative {key}")
    return n


class TarReader:
    """Reads a tar stream entry by entry, keeping the raw bytes between payloads.

    Lifecycle: call next() until it returns None; after each entry read exactly
    entry.size payload bytes with read_payload(); after None, trailer() returns the
    end-of-archive blocks and anything after them, verbatim.

    The stream is read in large blocks; `on_block` (if given) sees every block in
    order, which lets a caller hash the whole stream without a second pass.
    """

    def __init__(self, stream: BinaryIO, block_size: int = 4 << 20, on_block: Callable[[bytes], None] | None = None):
        self._stream = stream
        self._block_size = block_size
        self._on_block = on_block
        self._buf = b""
        self._pos = 0
        self._eof = False
        self._remaining = 0  # payload bytes of the current entry not yet read
        self._padding = 0  # padding after the current payload
        self._global: dict[str, bytes] = {}
        self._trailer = b""
        self._done = False
        self.offset = 0  # uncompressed bytes consumed so far

    def _fill(self) -> bool:
        """Make sure unread bytes are buffered; False at end of stream."""
        if self._pos < len(self._buf):
            return True
        if self._eof:
            return False
        data = self._stream.read(self._block_size)
        if not data:
            self._eof = True
            return False
        if self._on_block is not None:
            self._on_block(data)
        self._buf, self._pos = data, 0
        return True

    def _read_upto(self, n: int) -> bytes:
        """Up to n bytes from the current block (fewer at a block boundary or EOF)."""
        if not self._fill():
            return b""
        data = self._buf[self._pos : self._pos + n]
        self._pos += len(data)
        self.offset += len(data)
        return data

    def _read_exact(self, n: int, what: str) -> bytes:
        data = self._read_upto(n)
        if len(data) == n:
            return data
        parts = [data]
        got = len(data)
        while got < n:
            more = self._read_upto(n - got)
            if not more:
                raise FormatError(f"tar stream truncated in {what} at byte {self.offset}")
            parts.append(more)
            got += len(more)
        return b"".join(parts)

    def _read_rest(self) -> bytes:
        parts: list[bytes] = []
        while True:
            data = self._read_upto(1 << 30)
            if not data:
                return b"".join(parts)
            parts.append(data)

    def read_payload(self, n: int) -> bytes:
        """Up to n bytes of the current entry's payload (fewer at block boundaries);
        b"" when it is all read. Raises FormatError if the stream ends early."""
        n = min(n, self._remaining)
        if n <= 0:
            return b""
        data = self._read_upto(n)
        if not data:
            raise FormatError(f"tar stream truncated in file content at byte {self.offset}")
        self._remaining -= len(data)
        return data

    def readinto(self, buf: memoryview) -> int:
        """Payload reader for chunkers: fills buf from the current entry's payload."""
        data = self.read_payload(len(buf))
        buf[: len(data)] = data
        return len(data)

    def next(self) -> tuple[bytes, TarEntry] | None:
        """The raw bytes before the next entry's payload, and the entry; None at the end."""
        if self._remaining:
            raise FormatError("tar reader: payload not fully read before next()")
        if self._done:
            return None
        raw = bytearray(self._read_exact(self._padding, "padding")) if self._padding else bytearray()
        self._padding = 0
        pax: dict[str, bytes] = {}
        long_name: bytes | None = None
        long_link: bytes | None = None
        while True:
            start = self.offset
            block = self._read_upto(BLOCK)
            while 0 < len(block) < BLOCK:  # a block can straddle two reads
                more = self._read_upto(BLOCK - len(block))
                if not more:
                    break
                block += more
            if len(block) < BLOCK:
                if block == b"" and not raw.strip(b"\0") and start > 0:
                    # Archive ended without end-of-archive blocks (some writers do).
                    self._trailer = bytes(raw)
                    self._done = True
                    return None
                raise FormatError(f"tar stream truncated in a header at byte {start}")
            if block == ZERO_BLOCK:
                # End of archive: keep this block, the rest of the stream, verbatim.
                rest = self._read_rest()
                self._trailer = bytes(raw) + block + rest
                self._done = True
                return None
            if not _checksum_ok(block):
                raise FormatError(f"tar header checksum mismatch at byte {start} (not a tar stream, or corrupted)")
            raw += block
            typeflag = block[156:157]
            size = _number(block[124:136], "size")
            if size < 0:
                raise FormatError(f"tar header at byte {start}: negative size")
            if typeflag in (b"x", b"g", b"L", b"K"):
                if size > MAX_META_RECORD:
                    raise FormatError(f"tar header at byte {start}: {size}-byte metadata record")
                body = self._read_exact(size, "a pax/long-name record")
                pad = -size % BLOCK
                raw += body + self._read_exact(pad, "padding")
                if typeflag == b"x":
                    pax.update(parse_pax(body))
                elif typeflag == b"g":
                    self._global.update(parse_pax(body))
                elif typeflag == b"L":
                    long_name = _nul_terminated(body)
                else:
                    long_link = _nul_terminated(body)
                continue
            entry = self._entry(block, typeflag, size, {**self._global, **pax}, long_name, long_link, start)
            self._remaining = entry.size
            self._padding = -entry.size % BLOCK
            return bytes(raw), entry

    def _entry(
        self,
        block: bytes,
        typeflag: bytes,
        size: int,
        pax: dict[str, bytes],
        long_name: bytes | None,
        long_link: bytes | None,
        start: int,
    ) -> TarEntry:
        kind = TYPES.get(typeflag)
        if kind is None:
            what = {b"S": "GNU sparse file", b"M": "multi-volume entry", b"V": "volume label"}.get(
                typeflag, f"entry type {typeflag!r}"
            )
            raise FormatError(f"tar entry at byte {start}: unsupported {what}")
        if any(k.startswith("GNU.sparse.") for k in pax):
            raise FormatError(f"tar entry at byte {start}: unsupported pax sparse file")
        magic = block[257:265]
        name = _nul_terminated(block[0:100])
        if magic[:6] == b"ustar\0":
            prefix = _nul_terminated(block[345:500])
            if prefix:
                name = prefix + b"/" + name
        if long_name is not None:
            name = long_name
        if "path" in pax:
            name = pax["path"]
        link = long_link if long_link is not None else _nul_terminated(block[157:257])
        if "linkpath" in pax:
            link = pax["linkpath"]
        if len(name) > MAX_NAME or len(link) > MAX_NAME:
            raise FormatError(f"tar entry at byte {start}: name longer than {MAX_NAME} bytes")
        if not name:
            raise FormatError(f"tar entry at byte {start}: empty name")
        if "size" in pax:
            size = _pax_int(pax["size"], "size")
        uid = _pax_int(pax["uid"], "uid") if "uid" in pax else _number(block[108:116], "uid")
        gid = _pax_int(pax["gid"], "gid") if "gid" in pax else _number(block[116:124], "gid")
        mtime = _pax_time(pax["mtime"], "mtime") if "mtime" in pax else float(_number(block[136:148], "mtime"))
        atime = ctime = None
        if "atime" in pax:
            atime = _pax_time(pax["atime"], "atime")
        if "ctime" in pax:
            ctime = _pax_time(pax["ctime"], "ctime")
        if magic == b"ustar  \0" and atime is None:  # old GNU format keeps atime/ctime here
            a, c = _number(block[345:357], "atime"), _number(block[357:369], "ctime")
            atime = float(a) if a else None
            ctime = float(c) if c else None
        xattrs: dict[str, bytes] = {}
        for key, value in pax.items():
            if key.startswith("SCHILY.xattr."):
                xattrs[key[len("SCHILY.xattr.") :]] = value
        return TarEntry(
            name=_decode(name),
            raw_name=name,
            type=kind,
            mode=_number(block[100:108], "mode"),
            uid=uid,
            gid=gid,
            size=0 if typeflag in HEADER_ONLY else size,
            mtime=mtime,
            linkname=_decode(link),
            uname=_decode(pax.get("uname", _nul_terminated(block[265:297]))),
            gname=_decode(pax.get("gname", _nul_terminated(block[297:329]))),
            devmajor=_number(block[329:337], "devmajor") if typeflag in (b"3", b"4") else 0,
            devminor=_number(block[337:345], "devminor") if typeflag in (b"3", b"4") else 0,
            atime=atime,
            ctime=ctime,
            xattrs=xattrs,
        )

    def trailer(self) -> bytes:
        """End-of-archive blocks and any bytes after them (valid after next() -> None)."""
        return self._trailer


def clean_name(name: str, untrusted: bool = False) -> str:
    """The path an entry lands on inside the root, without leading `./` or `/`.

    "" stands for the root itself. Raises FormatError for names with `..` components
    (they escape the root) and, when `untrusted` (names read from a layer), for
    absolute names and for `.` or empty components inside the name too (`a/./b`,
    `a//b`): tar writers put `./` only in front and `/` only at the end of a name, so a
    layer with anything else is hostile or broken.
    """
    # The common case, a plain relative name after at most one leading "./" and one
    # trailing "/" (no NUL, no leading "/" or ".", no empty or dot-led component), is its
    # own clean form: the loop below would split it into the same parts, none of them "",
    # "." or "..".
    body = name.removeprefix("./")
    body = body.removesuffix("/")
    if (body and body[0] not in "/." and "//" not in body and "/." not in body and "\0" not in body
            and not body.endswith("/")):
        return body
    if "\0" in name:
        raise FormatError(f"path {name[:80]!r} contains a NUL byte")
    if untrusted and name.startswith("/"):
        raise FormatError(f"path {name[:200]!r} is absolute")
    body = name.rstrip("/")
    while body.startswith("./"):
        body = body[2:]
    parts = []
    for part in body.split("/"):
        if part in ("", "."):
            if untrusted and body not in ("", "."):
                raise FormatError(f"path {name[:200]!r} has an empty or '.' component")
            continue
        if part == "..":
            raise FormatError(f"path {name[:200]!r} escapes the layer root")
        parts.append(part)
    return "/".join(parts)


# OCI whiteouts (image-spec layer.md): `.wh.NAME` deletes NAME from the layers below;
# `.wh..wh..opq` in a directory hides everything the layers below have in it.
WHITEOUT_PREFIX = ".wh."
OPAQUE_WHITEOUT = ".wh..wh..opq"
# Types a hard link may point to (an earlier entry of the same layer).
LINKABLE = ("reg", "symlink", "char", "block", "fifo")


def whiteout_target(name: str) -> str | None:
    """The name a whiteout entry `name` (a clean path) deletes, in the same directory;
    "" for an opaque marker; None when `name` is no whiteout. Raises FormatError when the
    whited-out name is not a single component of its own directory (`.wh.`, `.wh..`,
    `.wh...`: they would name the directory itself or its parent)."""
    parent, _, base = name.rpartition("/")
    if not base.startswith(WHITEOUT_PREFIX):
        return None
    if base == OPAQUE_WHITEOUT:
        return ""
    target = base[len(WHITEOUT_PREFIX):]
    if target in ("", ".", ".."):
        raise FormatError(f"whiteout {base!r} names no file of its directory")
    return f"{parent}/{target}" if parent else target


class LayerEntries:
    """The rules every entry of an untrusted layer obeys, wherever shoal reads one
    (`shoal convert`, the node's unpack): feed the entries in order to admit(), which
    returns the entry's clean name or raises FormatError.

    - names: clean_name(untrusted=True) (no `..`, no absolute names, no `.` or empty
      components); the root ("") only as a directory;
    - no name twice, except a directory again (its metadata is applied once more);
    - whiteouts only of a valid name in their own directory (whiteout_target), never a
      directory themselves, and no entry below a whiteout name;
    - hard links only to an earlier entry of this layer that is not a directory, a hard
      link or a whiteout;
    - no entry below a name this layer itself makes a symlink (or any non-directory):
      `esc -> /tmp` then `esc/file` is refused here, as the node's unpack refuses it.
    The checker never touches a file system; what a name resolves to on disk (symlinks
    in its parents) is the writer's business (snapshotter/unpack.py opens every parent
    without following links).
    """

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}  # clean name -> entry type ("whiteout" for whiteouts)
        # paths the parent walk found clear (each unseen or a directory), closed under
        # ancestors; forgotten whenever one of them is given a non-directory entry
        self._clear: set[str] = set()

    def admit(self, name: str, type: str, linkname: str = "", clean: str | None = None) -> str:
        """`clean`: clean_name(name, untrusted=True), when the caller has it already."""
        if clean is None:
            clean = clean_name(name, untrusted=True)
        if not clean and type != "dir":
            raise FormatError("the layer root must be a directory")
        parent = clean.rpartition("/")[0]
        whiteouts = WHITEOUT_PREFIX in clean  # (most layers have none: the checks below are skipped)
        if whiteouts and WHITEOUT_PREFIX in parent and any(part.startswith(WHITEOUT_PREFIX)
                                                           for part in parent.split("/")):
            raise FormatError("a whiteout name cannot hold entries")
        at = parent
        walked = []
        while at and at not in self._clear:  # every parent this layer itself made must be a directory
            made = self.seen.get(at)          # (no path through its own links)
            if made is not None and made != "dir":
                what = {"reg": "file", "hardlink": "hard link", "char": "device", "block": "device"}.get(made, made)
                raise FormatError(f"path goes through {at[:200]!r}, which this layer makes a {what}, not a directory")
            walked.append(at)
            at = at.rpartition("/")[0]
        self._clear.update(walked)
        kind = type
        if whiteouts and whiteout_target(clean) is not None:
            if type == "dir":
                raise FormatError("a whiteout cannot be a directory")
            kind = "whiteout"
        if type == "hardlink":
            target = clean_name(linkname, untrusted=True)
            if self.seen.get(target) not in LINKABLE:
                raise FormatError(f"hard link to {linkname[:200]!r}, which is not an earlier entry of the layer "
                                  "(a file, symlink, fifo or device)")
        previous = self.seen.get(clean)
        if previous is not None and not (previous == "dir" and type == "dir"):
            raise FormatError("duplicate entry: the layer has this name twice")
        self.seen[clean] = kind
        if kind != "dir" and clean in self._clear:
            self._clear.clear()  # a path walked before is no directory now: walk again
        return clean


class Decompressing:
    """A read(n) stream of a layer's tar, whatever the blob's compression."""

    def __init__(self, blob: BinaryIO, compression: str, what: str):
        self.what = what
        self._blob = blob
        if compression == "gzip":
            self._stream: BinaryIO = gzip.GzipFile(fileobj=blob, mode="rb")  # type: ignore[assignment]
        elif compression == "zstd":
            self._stream = zstandard.ZstdDecompressor().stream_reader(blob, read_across_frames=True)
        else:
            self._stream = blob

    def read(self, n: int = -1) -> bytes:
        try:
            return self._stream.read(n)
        except (OSError, EOFError, zlib.error, zstandard.ZstdError) as e:
            if isinstance(e, ShoalError):
                raise
            raise FormatError(f"{self.what}: cannot decompress ({e})") from None


def hash_tar(stream) -> tuple[str, int]:
    """(sha256 digest, size) of everything `stream` (read(n)) gives: a layer's diff_id."""
    sha = hashlib.sha256()
    n = 0
    while data := stream.read(4 << 20):
        sha.update(data)
        n += len(data)
    return "sha256:" + sha.hexdigest(), n
