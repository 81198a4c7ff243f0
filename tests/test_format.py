"""The zstd:chunked format: writer and reader driven from one table of entries, the tar
reader fed whole, byte by byte and with trailing data, and bad layers."""

from __future__ import annotations

import base64
import hashlib
import io
import json
import struct
import subprocess
import tarfile

import pytest

from builder import tarsplit
from builder.format.footer import (
    FOOTER_MAGIC,
    MANIFEST_CHECKSUM,
    MANIFEST_POSITION,
    OLD_MANIFEST_POSITION,
    location_from_annotations,
    parse_footer,
    skippable_frame,
)
from builder.format.reader import LayerReader
from builder.format.toc import decompress_frames, decompress_toc, format_timestamp, parse_toc
from builder.format.writer import LayerWriter, WriterOptions
from builder.tarstream import TarReader, clean_name
from shoal.errors import DigestMismatch, FormatError

MTIME = 1_700_000_123.5


def _rand(n: int, seed: int) -> bytes:
    """Deterministic incompressible bytes."""
    out = bytearray()
    h = hashlib.sha256(str(seed).encode()).digest()
    while len(out) < n:
        h = hashlib.sha256(h).digest()
        out += h
    return bytes(out[:n])


# One table drives the writer and the reader: (name, type, attributes).
BIG = _rand(5 << 20, 1) + bytes(1 << 20) + _rand(3 << 20, 2)  # several chunks, a zero run
TABLE = [
    ("./", "dir", {"mode": 0o755}),
    ("./etc/", "dir", {"mode": 0o755}),
    ("./etc/motd", "reg", {"data": b"hello\n", "mode": 0o644, "uid": 12, "gid": 34}),
    ("./etc/empty", "reg", {"data": b"", "mode": 0o600}),
    ("./etc/link", "symlink", {"linkname": "motd"}),
    ("./etc/abs-link", "symlink", {"linkname": "/usr/bin/python3"}),
    ("./etc/hard", "hardlink", {"linkname": "./etc/motd"}),
    ("./etc/fifo", "fifo", {"mode": 0o644}),
    ("./etc/null", "char", {"devmajor": 1, "devminor": 3, "mode": 0o666}),
    ("./etc/sda", "block", {"devmajor": 8, "devminor": 0, "mode": 0o660}),
    ("./etc/suid", "reg", {"data": b"#!/bin/sh\n", "mode": 0o4755}),
    ("./etc/xattr", "reg", {"data": b"x", "xattrs": {"user.key": "välue", "security.capability": "\x01\x02"}}),
    ("./with space/ünï 名前.txt", "reg", {"data": "ünïcödé\n".encode()}),
    ("./" + "long/" * 40 + "name.txt", "reg", {"data": b"deep and long\n"}),
    ("./big.bin", "reg", {"data": BIG}),
    ("./.wh.deleted", "reg", {"data": b""}),
    ("./opaque/.wh..wh..opq", "reg", {"data": b""}),
]

_TYPES = {
    "dir": tarfile.DIRTYPE, "reg": tarfile.REGTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
    "fifo": tarfile.FIFOTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE,
}


def make_table_tar(fmt: int = tarfile.PAX_FORMAT, table=TABLE) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as t:
        for name, typ, attrs in table:
            info = tarfile.TarInfo(name)
            info.type = _TYPES[typ]
            info.mode = attrs.get("mode", 0o644)
            info.uid, info.gid = attrs.get("uid", 0), attrs.get("gid", 0)
            info.mtime = MTIME if fmt == tarfile.PAX_FORMAT else int(MTIME)
            info.linkname = attrs.get("linkname", "")
            info.devmajor, info.devminor = attrs.get("devmajor", 0), attrs.get("devminor", 0)
            if "xattrs" in attrs and fmt == tarfile.PAX_FORMAT:
                info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in attrs["xattrs"].items()}
            data = attrs.get("data")
            if data is not None:
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
            else:
                t.addfile(info)
    return buf.getvalue()


def write_layer(tar: bytes, **opts) -> tuple[bytes, object]:
    out = io.BytesIO()
    result = LayerWriter(WriterOptions(**opts)).write(io.BytesIO(tar), out)
    return out.getvalue(), result


def open_layer(blob: bytes, annotations: dict) -> LayerReader:
    loc = location_from_annotations(annotations)
    toc = parse_toc(decompress_toc(blob[loc.toc.offset : loc.toc.end], loc.toc_digest, loc.toc.uncompressed), len(blob))
    return LayerReader(toc, lambda ranges: [blob[a:b] for a, b in ranges])


@pytest.fixture(scope="module", params=[tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT],
                ids=["pax", "gnu", "ustar"])
def layer(request):
    fmt = request.param
    table = TABLE if fmt != tarfile.USTAR_FORMAT else [r for r in TABLE if len(r[0]) < 100]
    tar = make_table_tar(fmt, table)
    blob, result = write_layer(tar, avg_chunk=256 << 10, min_split=1 << 20)
    return fmt, table, tar, blob, result


def test_zstd_cli_gives_back_the_tar_byte_for_byte(layer, tmp_path):
    _, _, tar, blob, result = layer
    (tmp_path / "l.zst").write_bytes(blob)
    out = subprocess.run(["zstd", "-dc", str(tmp_path / "l.zst")], capture_output=True, check=True).stdout
    assert out == tar
    assert result.diff_id == "sha256:" + hashlib.sha256(tar).hexdigest()
    assert result.digest == "sha256:" + hashlib.sha256(blob).hexdigest()
    assert result.size == len(blob)


def test_reader_answers_every_entry_of_the_table(layer):
    fmt, table, _, blob, result = layer
    r = open_layer(blob, result.annotations)
    for name, typ, attrs in table:
        path = clean_name(name)
        st = r.stat(path)
        if typ == "hardlink":
            target = r.stat(clean_name(attrs["linkname"]))
            assert (st.ino, st.type, st.nlink) == (target.ino, "reg", 2)
            assert r.read(path, 0, 100) == r.read(clean_name(attrs["linkname"]), 0, 100)
            continue
        assert st.type == typ, name
        assert st.mode == attrs.get("mode", 0o644) & 0o7777 or typ == "symlink", name
        assert (st.uid, st.gid) == (attrs.get("uid", 0), attrs.get("gid", 0))
        expect_mtime = MTIME if fmt == tarfile.PAX_FORMAT else int(MTIME)
        assert st.mtime == pytest.approx(expect_mtime, abs=1e-6)
        if typ == "reg":
            data = attrs["data"]
            assert st.size == len(data)
            assert r.read(path, 0, len(data) + 100) == data
            if len(data) > 10:
                assert r.read(path, 3, 7) == data[3:10]
                assert r.read(path, len(data) - 2, 50) == data[-2:]
            assert r.read(path, len(data), 10) == b""
        if typ == "symlink":
            assert r.readlink(path) == attrs["linkname"]
        if typ in ("char", "block"):
            assert (st.devmajor, st.devminor) == (attrs["devmajor"], attrs["devminor"])
        if "xattrs" in attrs and fmt == tarfile.PAX_FORMAT:
            assert sorted(r.listxattr(path)) == sorted(attrs["xattrs"])
            for k, v in attrs["xattrs"].items():
                assert r.getxattr(path, k) == v.encode("utf-8", "surrogateescape")
    assert sorted(r.readdir("")) == sorted({clean_name(n).split("/")[0] for n, _, _ in table if clean_name(n)})
    assert "motd" in r.readdir("/etc")
    with pytest.raises(FileNotFoundError):
        r.stat("etc/nope")
    with pytest.raises(NotADirectoryError):
        r.readdir("etc/motd")
    with pytest.raises(IsADirectoryError):
        r.read("etc", 0, 1)


def test_big_file_is_cut_into_verified_chunks(layer):
    _, _, _, blob, result = layer
    r = open_layer(blob, result.annotations)
    chunks = r.chunks_for("big.bin", 0, len(BIG))
    assert len(chunks) > 3
    assert sum(c.size for c in chunks) == len(BIG)
    for c in chunks:
        data = BIG[c.file_offset : c.file_offset + c.size]
        assert c.digest == "sha256:" + hashlib.sha256(data).hexdigest()
        # each chunk is a frame of its own: it decompresses alone
        assert zstd_decompress(blob[c.start : c.end]) == data
    mid = len(BIG) // 2
    assert r.read("big.bin", mid - 1000, 300_000) == BIG[mid - 1000 : mid + 299_000]


def zstd_decompress(frame: bytes) -> bytes:
    import zstandard

    return zstandard.ZstdDecompressor().decompress(frame)


def test_toc_follows_containers_storage_layout(layer):
    fmt, table, tar, blob, result = layer
    ann = result.annotations
    loc = location_from_annotations(ann)
    # the footer says the same as the annotations, and the old-variant keys agree
    assert parse_footer(blob[-64:]) .toc == loc.toc
    assert blob[-8:] == FOOTER_MAGIC
    assert ann[OLD_MANIFEST_POSITION] == ann[MANIFEST_POSITION]
    assert ann[MANIFEST_CHECKSUM] == "sha256:" + hashlib.sha256(blob[loc.toc.offset : loc.toc.end]).hexdigest()
    doc = json.loads(decompress_toc(blob[loc.toc.offset : loc.toc.end], None))
    assert doc["version"] == 1
    names = [e["name"] for e in doc["entries"] if e["type"] != "chunk"]
    assert names == [n for n, _, _ in table]  # exact tar names, tar order
    motd = next(e for e in doc["entries"] if e["name"] == "./etc/motd")
    assert motd["digest"] == "sha256:" + hashlib.sha256(b"hello\n").hexdigest()
    assert (motd["uid"], motd["UID"], motd["gid"], motd["GID"]) == (12, 12, 34, 34)
    assert motd["modtime"] == motd["ModTime"] == format_timestamp(MTIME if fmt == tarfile.PAX_FORMAT else int(MTIME))
    assert "chunkSize" not in motd  # one-chunk files carry no chunk fields
    # tar-split rebuilds the tar: segments verbatim, file contents from the table
    ts = loc.tarsplit
    split = decompress_toc(blob[ts.offset : ts.end], doc["tarSplitDigest"], ts.uncompressed)
    contents = {n: a.get("data", b"") for n, _, a in table}
    rebuilt = bytearray()
    for entry in tarsplit.parse(split):
        if entry["type"] == tarsplit.SEGMENT_TYPE:
            rebuilt += entry["payload"]
        elif entry["size"]:
            data = contents[entry["name"]]
            assert entry["payload"] == tarsplit.crc64_update(0, data).to_bytes(8, "big")
            rebuilt += data
        else:
            assert entry["payload"] is None
    assert bytes(rebuilt) == tar


def test_output_is_deterministic():
    tar = make_table_tar()
    assert write_layer(tar)[0] == write_layer(tar, threads=1)[0]


class _Dribble(io.RawIOBase):
    """A stream that returns one byte per read: parsers must not assume full reads."""

    def __init__(self, data: bytes):
        self._data = memoryview(data)
        self._pos = 0

    def readable(self):
        return True

    def read(self, n=-1):
        if self._pos >= len(self._data) or n == 0:
            return b""
        b = self._data[self._pos : self._pos + 1].tobytes()
        self._pos += 1
        return b


@pytest.mark.parametrize("feed", ["whole", "byte-by-byte", "trailing-data"])
def test_tar_reader_keeps_every_byte(feed):
    tar = make_table_tar(table=[r for r in TABLE if r[0] != "./big.bin"])
    if feed == "trailing-data":
        tar += b"trailing garbage after the archive" + bytes(3000)
    stream = _Dribble(tar) if feed == "byte-by-byte" else io.BytesIO(tar)
    reader = TarReader(stream, block_size=4096)
    out = bytearray()
    names = []
    while (item := reader.next()) is not None:
        raw, entry = item
        out += raw
        names.append(entry.name)
        while data := reader.read_payload(1000):
            out += data
    out += reader.trailer()
    assert bytes(out) == tar
    assert names[:3] == ["./", "./etc/", "./etc/motd"]


# --- bad layers ---------------------------------------------------------------------------


def _tar_with(name: str, typ=tarfile.REGTYPE, linkname: str = "", data: bytes = b"x") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        if typ == tarfile.LNKTYPE:
            ok = tarfile.TarInfo("ok")
            ok.size = 1
            t.addfile(ok, io.BytesIO(b"x"))
        info = tarfile.TarInfo(name)
        info.type = typ
        info.linkname = linkname
        info.size = len(data) if typ == tarfile.REGTYPE else 0
        t.addfile(info, io.BytesIO(data) if typ == tarfile.REGTYPE else None)
    return buf.getvalue()


@pytest.mark.parametrize(
    "tar, message",
    [
        (_tar_with("../escape"), "escapes the layer root"),
        (_tar_with("a/../../escape"), "escapes the layer root"),
        (_tar_with("/etc/absolute"), "is absolute"),
        (_tar_with("link", tarfile.LNKTYPE, "../../etc/shadow"), "escapes the layer root"),
        (_tar_with("link", tarfile.LNKTYPE, "/etc/shadow"), "is absolute"),
        (_tar_with("link", tarfile.LNKTYPE, "missing"), "not an earlier entry"),
        (make_table_tar(table=[("a", "reg", {"data": b"1"}), ("./a", "reg", {"data": b"2"})]), "duplicate entry"),
        (make_table_tar(table=[("a", "dir", {}), ("a", "reg", {"data": b"2"})]), "duplicate entry"),
        (make_table_tar(table=[("esc", "symlink", {"linkname": "/tmp"}), ("esc/file", "reg", {"data": b"x"})]),
         "path goes through 'esc', which this layer makes a symlink"),
        (make_table_tar(table=[("d", "dir", {}), ("d/f", "reg", {"data": b"1"}), ("d/f/g", "reg", {"data": b"2"})]),
         "path goes through 'd/f', which this layer makes a file"),
        (make_table_tar()[:700], "truncated"),
        (make_table_tar()[:512 * 3 + 100], "truncated"),
        (b"\x01" * 512, "checksum mismatch"),
    ],
    ids=["dotdot", "dotdot-inner", "absolute", "hardlink-dotdot", "hardlink-absolute", "hardlink-missing",
         "duplicate", "duplicate-dir-then-file", "symlinked-parent", "file-parent", "truncated-header", "truncated-content", "garbage"],
)
def test_hostile_tars_are_refused(tar, message):
    with pytest.raises(FormatError, match=message):
        write_layer(tar)


def test_absurd_size_is_refused():
    header = bytearray(_tar_with("huge")[:512])
    # the pax header comes first in PAX_FORMAT; build a plain ustar header instead
    info = tarfile.TarInfo("huge")
    info.size = 0
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[124:136] = b"\x80" + (1 << 60).to_bytes(11, "big")  # base-256 size: 1 EiB
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    with pytest.raises(FormatError, match="absurd size"):
        write_layer(bytes(header) + bytes(1024))


@pytest.fixture(scope="module")
def good():
    tar = make_table_tar()
    blob, result = write_layer(tar, avg_chunk=256 << 10, min_split=1 << 20)
    return blob, result.annotations


def test_toc_digest_mismatch(good):
    blob, ann = good
    loc = location_from_annotations(ann)
    toc = bytearray(blob[loc.toc.offset : loc.toc.end])
    toc[10] ^= 1
    with pytest.raises(DigestMismatch, match="TOC digest mismatch"):
        decompress_toc(bytes(toc), loc.toc_digest, loc.toc.uncompressed)


def test_corrupted_chunk_never_reaches_the_reader(good):
    blob, ann = good
    r = open_layer(blob, ann)
    c = r.chunks_for("big.bin", 0, 1)[0]
    bad = bytearray(blob)
    # change content, keep a valid frame: replace the chunk's frame by another frame
    # of the same length is hard; flipping a byte breaks either the frame or the digest
    bad[c.start + (c.end - c.start) // 2] ^= 0xFF
    r2 = LayerReader(r_toc(blob, ann), lambda ranges: [bytes(bad[a:b]) for a, b in ranges])
    with pytest.raises(FormatError):  # DigestMismatch is a FormatError
        r2.read("big.bin", 0, 10)


def test_chunk_with_wrong_digest_in_toc_is_refused_on_read(good):
    blob, ann = good
    toc = r_toc(blob, ann)
    motd = next(e for e in toc.entries if e.name == "etc/motd")
    motd.chunks[0].digest = "sha256:" + "0" * 64
    r = LayerReader(toc, lambda ranges: [blob[a:b] for a, b in ranges])
    with pytest.raises(DigestMismatch, match="digest mismatch"):
        r.read("etc/motd", 0, 10)


def r_toc(blob, ann):
    loc = location_from_annotations(ann)
    return parse_toc(decompress_toc(blob[loc.toc.offset : loc.toc.end], loc.toc_digest, loc.toc.uncompressed), len(blob))


def _toc_bytes(entries) -> bytes:
    return json.dumps({"version": 1, "entries": entries}).encode()


D = "sha256:" + "a" * 64


@pytest.mark.parametrize(
    "entries, message",
    [
        ([{"type": "reg", "name": "../x", "size": 1, "offset": 1, "endOffset": 2, "digest": D}], "escapes"),
        ([{"type": "reg", "name": "/x", "size": 1, "offset": 1, "endOffset": 2, "digest": D}], "absolute"),
        ([{"type": "dir", "name": "a"}, {"type": "reg", "name": "a"}], "duplicate"),
        ([{"type": "reg", "name": "a"}, {"type": "reg", "name": "./a"}], "duplicate"),
        ([{"type": "reg", "name": "x", "size": 1 << 50, "offset": 1, "endOffset": 2, "digest": D}], "out of range"),
        ([{"type": "reg", "name": "x", "size": 10, "offset": 5, "endOffset": 2, "digest": D}], "out of bounds"),
        ([{"type": "reg", "name": "x", "size": 10, "offset": 5, "endOffset": 9 << 30, "digest": D}], "out of bounds"),
        ([{"type": "reg", "name": "x", "size": 10, "offset": 5, "endOffset": 9}], "without a sha256"),
        ([{"type": "reg", "name": "x", "size": 10, "offset": 5, "endOffset": 9, "digest": "md5:1"}], "malformed"),
        ([{"type": "chunk", "name": "x", "chunkOffset": 5}], "does not follow"),
        ([{"type": "reg", "name": "x", "size": 10, "offset": 5, "endOffset": 9, "digest": D, "chunkSize": 4,
           "chunkDigest": D}, {"type": "chunk", "name": "x", "offset": 7, "chunkOffset": 5, "chunkSize": 6,
                               "chunkDigest": D}], "chunk at file offset"),
        ([{"type": "hardlink", "name": "h", "linkName": "nope"}], "not an earlier entry"),
        ([{"type": "hardlink", "name": "h", "linkName": "../../etc/shadow"}], "escapes"),
        ([{"type": "reg", "name": "a/.wh..."}], "names no file"),
        ([{"type": "reg", "name": ".wh.."}], "names no file"),
        ([{"type": "dir", "name": ".wh.x"}, {"type": "reg", "name": ".wh.x/y"}], "whiteout cannot be a directory"),
        ([{"type": "reg", "name": "a//b"}], "empty or '.' component"),
        ([{"type": "socket", "name": "s"}], "unknown type"),
        ([{"type": "reg", "name": 5}], "without a name"),
        ([{"type": "reg", "name": "x", "mode": "0755"}], "out of range"),
        ([{"type": "reg", "name": "x", "modtime": "yesterday"}], "bad modtime"),
        ([{"type": "reg", "name": "x", "xattrs": {"user.a": "!!notbase64"}}], "not base64"),
        ([{"type": "symlink", "name": "s"}], "without a target"),
    ],
)
def test_bad_tocs_are_refused(entries, message):
    with pytest.raises(FormatError, match=message):
        parse_toc(_toc_bytes(entries), blob_size=1 << 30)


@pytest.mark.parametrize(
    "data, message",
    [(b"not json", "not valid JSON"), (b"[]", "not a JSON object"), (b'{"version": 2, "entries": []}', "version"),
     (b'{"version": 1}', "no entries"), (b'{"version":1,"entries":[],"tarSplitDigest":"x"}', "malformed")],
)
def test_malformed_toc_json(data, message):
    with pytest.raises(FormatError, match=message):
        parse_toc(data)


def test_bad_footers_and_annotations():
    with pytest.raises(FormatError, match="magic not found"):
        parse_footer(bytes(64))
    bad_type = struct.pack("<7Q", 100, 50, 60, 7, 200, 10, 10) + FOOTER_MAGIC
    with pytest.raises(FormatError, match="manifest type"):
        parse_footer(bad_type)
    huge = struct.pack("<7Q", 100, 1 << 40, 60, 1, 200, 10, 10) + FOOTER_MAGIC
    with pytest.raises(FormatError, match="out of range"):
        parse_footer(huge)
    with pytest.raises(FormatError, match="malformed value"):
        location_from_annotations({MANIFEST_POSITION: "1:2:3", MANIFEST_CHECKSUM: D})
    with pytest.raises(FormatError, match="malformed"):
        location_from_annotations({MANIFEST_POSITION: "1:2:3:1", MANIFEST_CHECKSUM: "sha256:xyz"})
    with pytest.raises(FormatError, match="out of range"):
        location_from_annotations({MANIFEST_POSITION: f"1:2:{1 << 40}:1", MANIFEST_CHECKSUM: D})
    assert location_from_annotations({"other": "x"}) is None


def test_truncated_toc_is_refused(good):
    blob, ann = good
    loc = location_from_annotations(ann)
    with pytest.raises(FormatError):
        decompress_toc(blob[loc.toc.offset : loc.toc.end - 10], None, loc.toc.uncompressed)


def test_skippable_frame_layout():
    frame = skippable_frame(b"abc")
    assert frame == b"\x50\x2a\x4d\x18\x03\x00\x00\x00abc"


def test_tarsplit_names_that_are_not_utf8_round_trip():
    w = tarsplit.TarSplitWriter()
    w.segment(b"\0" * 512)
    w.file(b"caf\xe9", 3, tarsplit.crc64_update(0, b"abc"))
    w.file(b"empty", 0, None)
    entries = list(tarsplit.parse(w.getvalue()))
    assert [e["type"] for e in entries] == [2, 1, 1]
    assert entries[1]["name"].encode("utf-8", "surrogateescape") == b"caf\xe9"
    assert base64.b64encode(entries[1]["payload"]) and entries[2]["payload"] is None
    assert [json.loads(line)["position"] for line in w.getvalue().splitlines()] == [0, 1, 2]


def test_decompress_frames_bounds_what_frame_headers_claim():
    """One frame declaring its size takes the fast path; several frames, a frame without
    a declared size and one declaring more than the limit all give what the stream path
    gives: the bytes, or FormatError past the limit (never a buffer of the declared size:
    a header claiming 1 TiB is FormatError, not MemoryError)."""
    import zstandard

    data = bytes(range(256)) * 400
    one = zstandard.ZstdCompressor().compress(data)
    assert decompress_frames(one, len(data), "x") == data
    assert decompress_frames(one + one, 2 * len(data), "x") == data + data
    bare = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    assert decompress_frames(bare, len(data), "x") == data
    with pytest.raises(FormatError, match="more than 1000 bytes"):
        decompress_frames(one, 1000, "x")
    # the same frame, its header made to declare 1 TiB: decoding it as declared would ask
    # for a 1 TiB buffer (MemoryError); the bound holds instead
    fhd = one[4]
    assert fhd >> 6 == 2 and fhd & 0x20  # single segment, a 4-byte content size
    bomb = one[:4] + bytes([fhd | 0xC0]) + (1 << 40).to_bytes(8, "little") + one[9:]
    assert zstandard.frame_content_size(bomb) == 1 << 40
    with pytest.raises(FormatError):
        decompress_frames(bomb, 1 << 20, "x")
    empty = zstandard.ZstdCompressor(write_content_size=True).compress(b"")
    assert decompress_frames(empty, 10, "x") == b""
    with pytest.raises(FormatError):
        decompress_frames(b"not zstd at all", 10, "x")
