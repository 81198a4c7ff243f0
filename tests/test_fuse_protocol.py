"""The sans-I/O FUSE protocol module (snapshotter/fs/protocol.py).

The layouts are checked against <linux/fuse.h> through gcc (sizeof/offsetof of every
struct and field the module packs or parses, and the constants); requests are written
from one table and parsed back whole, truncated byte by byte and with trailing data;
replies are decoded field by field; the parser is fuzzed under h11's rule.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import select
import shutil
import struct
import subprocess
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapshotter.fs import protocol as p

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- the C header ------------------------------------------------------------------------

# (C name, value in the module, guard). Macros are compared when the installed header
# defines them (Debian's 7.38 header lacks some 7.38 flags, and everything newer); enum
# members (opcodes, notify codes) when its minor has them.
def _since(minor: int) -> str:
    return f"#if FUSE_KERNEL_MINOR_VERSION >= {minor}"


CONSTANTS = [
    *[(name, value, f"#ifdef {name}") for name, value in (
        ("FUSE_KERNEL_VERSION", p.KERNEL_VERSION), ("FUSE_ROOT_ID", p.ROOT_ID),
        ("FUSE_MIN_READ_BUFFER", p.MIN_READ_BUFFER), ("FUSE_NAME_OFFSET", p.DIRENT_NAME_OFFSET),
        ("FUSE_NAME_OFFSET_DIRENTPLUS", p.DIRENTPLUS_NAME_OFFSET), ("FUSE_GETATTR_FH", p.FUSE_GETATTR_FH),
        ("FUSE_EXPIRE_ONLY", p.FUSE_EXPIRE_ONLY), ("FUSE_UNIQUE_RESEND", p.FUSE_UNIQUE_RESEND),
        *[(name, getattr(p, name)) for name in dir(p) if name.startswith(("FOPEN_", "FUSE_"))
          and name not in ("FUSE_INT_REQ_BIT", "FUSE_GETATTR_FH", "FUSE_EXPIRE_ONLY", "FUSE_UNIQUE_RESEND")],
    )],
    *[(f"FUSE_{op.name}", op.value, _since(39 if op is p.Opcode.STATX else 1)) for op in p.Opcode],
    *[(f"FUSE_NOTIFY_{code.name}", code.value, _since(40 if code is p.NotifyCode.RESEND else 11))
      for code in p.NotifyCode],
]


def c_program() -> str:
    lines = ["#include <stddef.h>", "#include <stdio.h>", "#include <linux/fuse.h>", "int main(void) {"]
    for layout in p.LAYOUTS:
        s = f"struct {layout.c_name}"
        lines.append(f'printf("{layout.c_name} %zu\\n", sizeof({s}));')
        for name, _ in layout.fields:
            lines.append(f'printf("{layout.c_name}.{name} %zu %zu\\n", offsetof({s}, {name}), '
                         f'sizeof((({s} *)0)->{name}));')
    for name, _, guard in CONSTANTS:
        lines.append(guard)
        lines.append(f'printf("{name} %llu\\n", (unsigned long long)({name}));')
        lines.append("#endif")
    lines.append("return 0; }")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def c_header(tmp_path_factory) -> dict[str, list[int]]:
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed (scripts/install.sh installs it)")
    d = tmp_path_factory.mktemp("fusec")
    (d / "layout.c").write_text(c_program())
    subprocess.run([gcc, "-Wall", "-Werror", "-o", str(d / "layout"), str(d / "layout.c")], check=True)
    out = subprocess.run([str(d / "layout")], check=True, capture_output=True, text=True).stdout
    return {line.split()[0]: [int(x) for x in line.split()[1:]] for line in out.splitlines()}


def test_layouts_match_the_c_header(c_header):
    checked = 0
    for layout in p.LAYOUTS:
        assert c_header[layout.c_name] == [layout.size], layout.c_name
        for name, _ in layout.fields:
            key = f"{layout.c_name}.{name}"
            assert c_header[key] == [layout.offsets[name], layout.sizes[name]], key
            checked += 1
    assert checked > 150


def test_constants_match_the_c_header(c_header):
    seen = 0
    for name, value, _ in CONSTANTS:
        if name in c_header:
            assert c_header[name] == [value], name
            seen += 1
    assert seen > 80


# --- requests: one table, written and parsed back --------------------------------------------

EXT_INIT_FLAGS = p.FUSE_ASYNC_READ | p.FUSE_INIT_EXT | p.FUSE_MAX_PAGES | p.FUSE_HAS_RESEND | p.FUSE_SECURITY_CTX


def pack_fields(layout: p.Layout, **values: int) -> bytes:
    names = [name for name, code in layout.fields if not code.endswith("x")]
    return layout.pack(*(values[name] for name in names))


# (case id, opcode, body, class, fields the parsed request must have)
CASES = [
    ("init", p.Opcode.INIT,
     pack_fields(p.INIT_IN, major=7, minor=45, max_readahead=131072, flags=EXT_INIT_FLAGS & 0xFFFFFFFF,
                 flags2=EXT_INIT_FLAGS >> 32),
     p.Init, {"major": 7, "minor": 45, "max_readahead": 131072, "flags": EXT_INIT_FLAGS}),
    ("init-compat", p.Opcode.INIT, struct.pack("<4I", 7, 31, 65536, p.FUSE_ASYNC_READ),
     p.Init, {"major": 7, "minor": 31, "max_readahead": 65536, "flags": p.FUSE_ASYNC_READ}),
    ("lookup", p.Opcode.LOOKUP, b"lib\xffname.so\0", p.Lookup, {"name": b"lib\xffname.so"}),
    ("forget", p.Opcode.FORGET, struct.pack("<Q", 7), p.Forget, {"nlookup": 7}),
    ("batch-forget", p.Opcode.BATCH_FORGET, struct.pack("<II4Q", 2, 0, 11, 3, 12, 4), p.BatchForget,
     {"forgets": ((11, 3), (12, 4))}),
    ("batch-forget-empty", p.Opcode.BATCH_FORGET, struct.pack("<II", 0, 0), p.BatchForget, {"forgets": ()}),
    ("getattr", p.Opcode.GETATTR, pack_fields(p.GETATTR_IN, getattr_flags=1, fh=99), p.Getattr,
     {"getattr_flags": 1, "fh": 99}),
    ("open", p.Opcode.OPEN, pack_fields(p.OPEN_IN, flags=0o100000, open_flags=1), p.Open,
     {"flags": 0o100000, "open_flags": 1}),
    ("opendir", p.Opcode.OPENDIR, pack_fields(p.OPEN_IN, flags=0o200000, open_flags=0), p.Opendir,
     {"flags": 0o200000, "open_flags": 0}),
    ("read", p.Opcode.READ,
     pack_fields(p.READ_IN, fh=5, offset=1 << 40, size=131072, read_flags=2, lock_owner=77, flags=0o100002),
     p.Read, {"fh": 5, "offset": 1 << 40, "size": 131072, "read_flags": 2, "lock_owner": 77, "flags": 0o100002}),
    ("readdirplus", p.Opcode.READDIRPLUS,
     pack_fields(p.READ_IN, fh=6, offset=3, size=4096, read_flags=0, lock_owner=0, flags=0o200000),
     p.Readdirplus, {"fh": 6, "offset": 3, "size": 4096, "flags": 0o200000}),
    ("release", p.Opcode.RELEASE, pack_fields(p.RELEASE_IN, fh=5, flags=2, release_flags=1, lock_owner=9),
     p.Release, {"fh": 5, "flags": 2, "release_flags": 1, "lock_owner": 9}),
    ("releasedir", p.Opcode.RELEASEDIR, pack_fields(p.RELEASE_IN, fh=6, flags=3, release_flags=0, lock_owner=0),
     p.Releasedir, {"fh": 6, "flags": 3}),
    ("flush", p.Opcode.FLUSH, pack_fields(p.FLUSH_IN, fh=5, lock_owner=123), p.Flush, {"fh": 5, "lock_owner": 123}),
    ("statfs", p.Opcode.STATFS, b"", p.Statfs, {}),
    ("getxattr", p.Opcode.GETXATTR, pack_fields(p.GETXATTR_IN, size=0) + b"security.capability\0", p.Getxattr,
     {"size": 0, "name": b"security.capability"}),
    ("listxattr", p.Opcode.LISTXATTR, pack_fields(p.GETXATTR_IN, size=4096), p.Listxattr, {"size": 4096}),
    ("readlink", p.Opcode.READLINK, b"", p.Readlink, {}),
    ("access", p.Opcode.ACCESS, pack_fields(p.ACCESS_IN, mask=4), p.Access, {"mask": 4}),
    ("interrupt", p.Opcode.INTERRUPT, struct.pack("<Q", 42), p.Interrupt, {"target": 42}),
    ("destroy", p.Opcode.DESTROY, b"", p.Destroy, {}),
    ("write-is-generic", p.Opcode.WRITE, b"\1" * 45, p.Request, {"body": b"\1" * 45}),
    ("unknown-opcode", 9999, b"xyz", p.Request, {"body": b"xyz"}),
]
IDS = [case[0] for case in CASES]
# Bodies a truncation or an extension may leave acceptable: INIT takes 16 bytes or more,
# opcodes outside the subset take anything.
LENIENT = {"init", "init-compat", "write-is-generic", "unknown-opcode"}


def message(opcode: int, body: bytes, *, unique: int = 0x1122334455667788 & ~(1 << 63), nodeid: int = 0x42,
            extensions: bytes = b"", length: int | None = None) -> bytes:
    total = p.IN_HEADER_SIZE + len(body) + len(extensions)
    header = struct.pack("<IIQQIIIHH", total if length is None else length, opcode, unique, nodeid, 1000, 1001,
                         4242, len(extensions) // 8, 0)
    return header + body + extensions


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_request_parsed_back(case):
    _, opcode, body, cls, fields = case
    req = p.parse_request(message(opcode, body))
    assert type(req) is cls
    assert req.header == p.Header(p.IN_HEADER_SIZE + len(body), opcode, 0x1122334455667788 & ~(1 << 63), 0x42,
                                  1000, 1001, 4242, 0)
    assert not req.header.resent
    for name, value in fields.items():
        assert getattr(req, name) == value, name


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_request_truncated_byte_by_byte(case):
    """Every prefix of a message is refused as read (the header's length no longer
    matches) and, with the header's length set to the prefix, too (the body is short)."""
    name, opcode, body, cls, _ = case
    whole = message(opcode, body)
    for n in range(len(whole)):
        with pytest.raises(p.ProtocolError):
            p.parse_request(whole[:n])
        if n < p.IN_HEADER_SIZE:
            continue
        short = message(opcode, body[:n - p.IN_HEADER_SIZE])
        if name in LENIENT and (opcode != p.Opcode.INIT or n - p.IN_HEADER_SIZE >= p.INIT_IN_COMPAT_SIZE):
            assert type(p.parse_request(short)) is cls
        else:
            with pytest.raises(p.ProtocolError):
                p.parse_request(short)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_request_with_trailing_data(case):
    name, opcode, body, cls, _ = case
    whole = message(opcode, body)
    for extra in (b"\0", b"\0" * 8, b"junk" * 5):
        with pytest.raises(p.ProtocolError):  # more bytes than the header says
            p.parse_request(whole + extra)
        longer = message(opcode, body + extra)
        if name in LENIENT:
            assert type(p.parse_request(longer)) is cls
        else:
            with pytest.raises(p.ProtocolError):  # a body longer than the opcode's struct
                p.parse_request(longer)


def test_extensions_are_stripped_from_the_body():
    req = p.parse_request(message(p.Opcode.LOOKUP, b"a\0", extensions=struct.pack("<II", 8, 32)))
    assert req.name == b"a" and req.header.total_extlen == 1
    with pytest.raises(p.ProtocolError):  # extensions longer than the message
        p.parse_request(message(p.Opcode.LOOKUP, b"a\0", extensions=b"\0" * 8)[:-8])


def test_names_must_be_proper():
    for body in (b"", b"\0", b"a", b"a\0b\0", b"\0a\0"):
        with pytest.raises(p.ProtocolError):
            p.parse_request(message(p.Opcode.LOOKUP, body))
    with pytest.raises(p.ProtocolError):
        p.parse_request(message(p.Opcode.GETXATTR, pack_fields(p.GETXATTR_IN, size=0) + b"user.x"))


def test_batch_forget_count_must_match():
    for count, pairs in ((3, 2), (1, 2), (2, 0)):
        body = struct.pack("<II", count, 0) + b"\1" * (16 * pairs)
        with pytest.raises(p.ProtocolError):
            p.parse_request(message(p.Opcode.BATCH_FORGET, body))


def test_resent_and_interrupt_uniques():
    req = p.parse_request(message(p.Opcode.GETATTR, b"\0" * 16, unique=p.FUSE_UNIQUE_RESEND | 10))
    assert req.header.resent and req.header.unique == p.FUSE_UNIQUE_RESEND | 10
    # the reply carries the unique back as received, resend bit included
    assert struct.unpack("<IiQ", p.reply_error(req.header.unique, errno.EIO)) == (16, -errno.EIO,
                                                                                  p.FUSE_UNIQUE_RESEND | 10)


@FUZZ
@given(st.binary(max_size=200))
def test_fuzz_any_bytes(data):
    try:
        p.parse_request(data)
    except p.ProtocolError:
        pass


@FUZZ
@given(st.sampled_from([int(op) for op in p.Opcode] + [0, 9999, 2**32 - 1]), st.binary(max_size=120),
       st.integers(0, 2**16 - 1), st.integers(0, 2**64 - 1))
def test_fuzz_framed_bodies(opcode, body, extlen, unique):
    """Well-framed messages with any body: a request, or ProtocolError."""
    data = struct.pack("<IIQQIIIHH", p.IN_HEADER_SIZE + len(body), opcode, unique, 1, 0, 0, 0, extlen, 0) + body
    try:
        req = p.parse_request(data)
    except p.ProtocolError:
        return
    assert req.header.opcode == opcode and req.header.unique == unique


# --- negotiation ---------------------------------------------------------------------------


def init(minor: int, flags: int, *, major: int = 7, readahead: int = 131072) -> p.Init:
    body = pack_fields(p.INIT_IN, major=major, minor=minor, max_readahead=readahead, flags=flags & 0xFFFFFFFF,
                       flags2=flags >> 32)
    return p.parse_request(message(p.Opcode.INIT, body, unique=2))


def decode_init_out(data: bytes) -> dict[str, int]:
    length, error, unique = struct.unpack_from("<IiQ", data)
    assert (length, error, unique) == (len(data), 0, 2) and length == 16 + 64
    names = [name for name, code in p.INIT_OUT.fields if not code.endswith("x")]
    return dict(zip(names, p.INIT_OUT.struct.unpack_from(data, 16)))


def test_negotiate_with_a_new_kernel():
    offered = (EXT_INIT_FLAGS | p.FUSE_DO_READDIRPLUS | p.FUSE_READDIRPLUS_AUTO | p.FUSE_PARALLEL_DIROPS
               | p.FUSE_CACHE_SYMLINKS | p.FUSE_WRITEBACK_CACHE | p.FUSE_EXPORT_SUPPORT)
    n = p.negotiate(init(45, offered), max_readahead=1 << 20, max_write=1 << 20, max_pages=256)
    assert n.minor == p.PROTOCOL_MINOR == 40 and n.has_resend and n.max_readahead == 131072
    want = (p.FUSE_ASYNC_READ | p.FUSE_DO_READDIRPLUS | p.FUSE_PARALLEL_DIROPS | p.FUSE_MAX_PAGES
            | p.FUSE_CACHE_SYMLINKS | p.FUSE_INIT_EXT)
    assert n.flags == want  # not the writeback cache, readdirplus-auto, export support, security ctx
    out = decode_init_out(p.reply_init(2, n, max_background=64, congestion_threshold=48))
    assert out == {"major": 7, "minor": 40, "max_readahead": 131072, "flags": want & 0xFFFFFFFF, "max_background": 64,
                       "congestion_threshold": 48, "max_write": 1 << 20, "time_gran": 1, "max_pages": 256, "map_alignment": 0,
                       "flags2": 0}
    assert n.read_buffer_size == (1 << 20) + 4096


def test_passthrough_layouts_and_replies():
    """The 7.40 layouts keep the 7.38 structs' sizes (what the header checks), with the
    new fields where the padding was; a passthrough session declares a stack depth of 1
    (the kernel takes FUSE_PASSTHROUGH only with one), any other declares none."""
    assert p.OPEN_OUT_PASSTHROUGH.size == p.OPEN_OUT.size
    assert p.OPEN_OUT_PASSTHROUGH.offsets["backing_id"] == p.OPEN_OUT.offsets["padding"]
    assert p.INIT_OUT_PASSTHROUGH.size == p.INIT_OUT.size
    assert p.INIT_OUT_PASSTHROUGH.offsets["max_stack_depth"] == p.INIT_OUT.offsets["unused"]
    n = p.negotiate(init(45, EXT_INIT_FLAGS | p.FUSE_PASSTHROUGH), want=p.DEFAULT_FLAGS | p.FUSE_PASSTHROUGH)
    assert n.passthrough and n.flags >> 32 == p.FUSE_PASSTHROUGH >> 32
    out = fields_of(p.INIT_OUT_PASSTHROUGH, p.reply_init(2, n), 16)
    assert out["max_stack_depth"] == p.PASSTHROUGH_STACK_DEPTH == 1 and out["flags2"] == p.FUSE_PASSTHROUGH >> 32
    plain = p.negotiate(init(45, EXT_INIT_FLAGS | p.FUSE_PASSTHROUGH))  # (not asked for)
    assert not plain.passthrough and fields_of(p.INIT_OUT_PASSTHROUGH, p.reply_init(2, plain), 16)[
        "max_stack_depth"] == 0
    opened = fields_of(p.OPEN_OUT_PASSTHROUGH, p.reply_open(3, 9, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, 42), 16)
    assert opened == {"fh": 9, "open_flags": p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, "backing_id": 42}


def test_negotiate_flags2_and_an_old_kernel():
    n = p.negotiate(init(45, EXT_INIT_FLAGS), want=p.FUSE_ASYNC_READ | p.FUSE_SECURITY_CTX)
    assert decode_init_out(p.reply_init(2, n))["flags2"] == p.FUSE_SECURITY_CTX >> 32
    old = p.negotiate(init(31, p.FUSE_ASYNC_READ | p.FUSE_DO_READDIRPLUS | p.FUSE_MAX_PAGES | p.FUSE_HAS_RESEND))
    assert old.minor == 31 and not old.has_resend and not old.flags & p.FUSE_INIT_EXT
    assert decode_init_out(p.reply_init(2, old))["flags2"] == 0
    no_pages = p.negotiate(init(31, p.FUSE_ASYNC_READ))
    assert no_pages.max_pages == 0
    for bad in (init(27, 0), init(45, 0, major=8), init(45, 0, major=6)):
        with pytest.raises(p.ProtocolError):
            p.negotiate(bad)


def test_negotiated_state_round_trip():
    n = p.negotiate(init(45, EXT_INIT_FLAGS))
    assert p.Negotiated.from_json(n.to_json()) == n
    good = json.loads(n.to_json())
    for bad in (b"", b"[]", b"{", b"[" * 100_000, json.dumps({**good, "minor": 41}).encode(),
                json.dumps({**good, "minor": 27}).encode(), json.dumps({**good, "flags": -1}).encode(),
                json.dumps({**good, "flags": 1.0}).encode(), json.dumps({**good, "flags": True}).encode(),
                json.dumps({**good, "extra": 1}).encode(), json.dumps({k: v for k, v in good.items()
                                                                      if k != "max_write"}).encode()):
        with pytest.raises(p.ProtocolError):
            p.Negotiated.from_json(bad)


@FUZZ
@given(st.binary(max_size=200) | st.dictionaries(st.sampled_from(["minor", "flags", "kernel_flags", "max_readahead",
                                                                  "max_write", "max_pages", "x"]),
                                                 st.integers(-5, 2**65) | st.none() | st.text(max_size=3))
       .map(lambda d: json.dumps(d).encode()))
def test_fuzz_negotiated_state(data):
    try:
        p.Negotiated.from_json(data)
    except p.ProtocolError:
        pass


# --- replies --------------------------------------------------------------------------------


def fields_of(layout: p.Layout, data: bytes, offset: int = 0) -> dict[str, int]:
    names = [name for name, code in layout.fields if not code.endswith("x")]
    return dict(zip(names, layout.struct.unpack_from(data, offset)))


ATTR = p.Attr(ino=77, mode=0o100644, size=5000, nlink=2, uid=1000, gid=1001, rdev=0, atime_ns=-1,
              mtime_ns=1_700_000_000_123_456_789, ctime_ns=5, blksize=4096)
ATTR_FIELDS = {"ino": 77, "size": 5000, "blocks": 10, "atime": -1, "mtime": 1_700_000_000, "ctime": 0,
               "atimensec": 999_999_999, "mtimensec": 123_456_789, "ctimensec": 5, "mode": 0o100644, "nlink": 2,
               "uid": 1000, "gid": 1001, "rdev": 0, "blksize": 4096, "flags": 0}


def test_error_and_empty_replies():
    assert p.reply_error(9, errno.ENOSYS) == struct.pack("<IiQ", 16, -errno.ENOSYS, 9)
    assert p.reply(9) == struct.pack("<IiQ", 16, 0, 9)
    assert p.reply_header(9, 4096) == struct.pack("<IiQ", 16 + 4096, 0, 9)
    assert p.reply(9, b"data") == struct.pack("<IiQ", 20, 0, 9) + b"data"
    for bad in (0, -5, 512):
        with pytest.raises(ValueError):
            p.reply_error(9, bad)


def test_entry_and_attr_replies():
    data = p.reply_entry(3, ATTR, entry_valid_ns=1_500_000_000, attr_valid_ns=2_000_000_001, generation=4)
    assert len(data) == 16 + 128 and struct.unpack_from("<IiQ", data) == (144, 0, 3)
    got = fields_of(p.ENTRY_OUT, data, 16)
    assert {k: got[k] for k in ("nodeid", "generation", "entry_valid", "entry_valid_nsec", "attr_valid",
                                "attr_valid_nsec")} == {"nodeid": 77, "generation": 4, "entry_valid": 1,
                                                            "entry_valid_nsec": 500_000_000, "attr_valid": 2,
                                                            "attr_valid_nsec": 1}
    assert {k[5:]: v for k, v in got.items() if k.startswith("attr.")} == ATTR_FIELDS
    negative = fields_of(p.ENTRY_OUT, p.reply_negative_entry(3, entry_valid_ns=10**9), 16)
    assert negative["nodeid"] == 0 and negative["entry_valid"] == 1
    data = p.reply_attr(3, ATTR, attr_valid_ns=3 * 10**9)
    got = fields_of(p.ATTR_OUT, data, 16)
    assert got["attr_valid"] == 3 and {k[5:]: v for k, v in got.items() if k.startswith("attr.")} == ATTR_FIELDS
    with pytest.raises(ValueError):
        p.reply_attr(3, ATTR, attr_valid_ns=-1)


def test_open_statfs_and_xattr_replies():
    assert fields_of(p.OPEN_OUT, p.reply_open(3, 12345), 16) == {"fh": 12345, "open_flags": p.FOPEN_KEEP_CACHE}
    st_ = fields_of(p.STATFS_OUT, p.reply_statfs(3, blocks=10, bfree=0, bavail=0, files=20, ffree=0), 16)
    assert st_ == {"st.blocks": 10, "st.bfree": 0, "st.bavail": 0, "st.files": 20, "st.ffree": 0,
                   "st.bsize": 4096, "st.namelen": 255, "st.frsize": 4096}
    value = b"\x01\x00\x00\x02"
    assert p.reply_xattr(3, 0, value) == struct.pack("<IiQII", 24, 0, 3, 4, 0)  # size == 0: the size
    assert p.reply_xattr(3, 3, value) == struct.pack("<IiQ", 16, -errno.ERANGE, 3)
    assert p.reply_xattr(3, 4, value) == struct.pack("<IiQ", 20, 0, 3) + value
    assert p.reply_xattr(3, 100, b"") == struct.pack("<IiQ", 16, 0, 3)


def read_direntplus(body: bytes) -> list[tuple[dict, bytes]]:
    out, at = [], 0
    while at < len(body):
        fields = fields_of(p.DIRENTPLUS, body, at)
        start = at + p.DIRENTPLUS_NAME_OFFSET
        name = body[start:start + fields["dirent.namelen"]]
        assert body[start + len(name):at + p.dirent_align(p.DIRENTPLUS_NAME_OFFSET + len(name))].strip(b"\0") == b""
        out.append((fields, name))
        at += p.dirent_align(p.DIRENTPLUS_NAME_OFFSET + len(name))
    assert at == len(body)
    return out


def test_direntplus_packing():
    entries = [p.DirEntry(b".", 1, p.Attr(ino=5, mode=0o040755)),
               p.DirEntry(b"..", 2, p.Attr(ino=1, mode=0o040755)),
               p.DirEntry(b"a", 3, ATTR),
               p.DirEntry(b"exactly8", 4, p.Attr(ino=78, mode=0o120777, size=3)),
               p.DirEntry(b"x" * 255, 5, p.Attr(ino=79, mode=0o040700))]
    body, count = p.pack_direntplus(entries, 1 << 16, entry_valid_ns=10**9, attr_valid_ns=2 * 10**9)
    assert count == 5 and len(body) % 8 == 0
    got = read_direntplus(body)
    assert [name for _, name in got] == [e.name for e in entries]
    assert [f["entry_out.nodeid"] for f, _ in got] == [0, 0, 77, 78, 79]  # "." and "..": no reference
    assert [f["dirent.ino"] for f, _ in got] == [5, 1, 77, 78, 79]
    assert [f["dirent.off"] for f, _ in got] == [1, 2, 3, 4, 5]
    assert [f["dirent.type"] for f, _ in got] == [4, 4, 8, 10, 4]  # DT_DIR, DT_REG, DT_LNK
    assert got[2][0]["entry_out.attr.mtimensec"] == 123_456_789 and got[2][0]["entry_out.entry_valid"] == 1
    assert len(p.pack_direntplus(entries[2:3], 1 << 16, entry_valid_ns=0, attr_valid_ns=0)[0]) == 160
    # a size that holds the first three records only (152 + 8 each)
    body, count = p.pack_direntplus(entries, 3 * 160 + 159, entry_valid_ns=0, attr_valid_ns=0)
    assert count == 3 and len(body) == 480
    assert p.pack_direntplus(entries, 100, entry_valid_ns=0, attr_valid_ns=0) == (b"", 0)
    for bad in (b"", b"a/b", b"a\0", b"y" * 1025):
        with pytest.raises(ValueError):
            p.pack_direntplus([p.DirEntry(bad, 1, ATTR)], 1 << 16, entry_valid_ns=0, attr_valid_ns=0)


def test_notifications():
    assert p.notify_resend() == struct.pack("<IiQ", 16, 7, 0)
    data = p.notify_inval_inode(77, 0, 4096)
    assert data == struct.pack("<IiQ", 40, 2, 0) + struct.pack("<Qqq", 77, 0, 4096)
    assert p.notify_inval_inode(77)[16:] == struct.pack("<Qqq", 77, -1, 0)  # attributes only
    data = p.notify_inval_entry(1, b"name")
    assert data == struct.pack("<IiQ", 16 + 16 + 5, 3, 0) + struct.pack("<QII", 1, 4, 0) + b"name\0"
    with pytest.raises(ValueError):
        p.notify_inval_entry(1, b"a\0b")


# --- the real kernel ------------------------------------------------------------------------

MS_RDONLY, MS_NOSUID, MS_NODEV, MNT_DETACH = 1, 2, 4, 2
CONTENT = bytes(range(256)) * 64 + b"tail"  # 16 KiB and a bit: more than one page
FILE_ATTR = p.Attr(ino=2, mode=0o100444, size=len(CONTENT), mtime_ns=1_700_000_000_000_000_000)
ROOT_ATTR = p.Attr(ino=p.ROOT_ID, mode=0o040555, nlink=2)


class OneFileServer:
    """A request loop over /dev/fuse made of the protocol module alone: one file, "hello".

    `die_on_read`: the loop stops at its first READ without answering it, as a process
    killed while it holds a request. `negotiated`: the loop takes over a session whose INIT
    its predecessor answered; it writes NOTIFY_RESEND first, so what that one held comes again.
    """

    def __init__(self, fd: int, *, negotiated: p.Negotiated | None = None, die_on_read: bool = False):
        self.fd = fd
        self.negotiated = negotiated
        self.takes_over = negotiated is not None
        self.die_on_read = die_on_read
        self.dropped: p.Read | None = None
        self.resent: list[p.Request] = []
        self.seen: set[str] = set()
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        """Serve until unmounted or `stop` is set (the fd is non-blocking: a loop that
        waits in read(2) would keep the connection alive past the close of the fd)."""
        try:
            if self.takes_over:
                os.write(self.fd, p.notify_resend())
            while not self.stop.is_set():
                if not select.select([self.fd], [], [], 0.1)[0]:
                    continue
                try:
                    data = os.read(self.fd, self.negotiated.read_buffer_size if self.negotiated else 1 << 21)
                except OSError as e:
                    if e.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):  # ENOENT: interrupted request
                        continue
                    if e.errno == errno.ENODEV:  # unmounted
                        return
                    raise
                req = p.parse_request(data)
                self.seen.add(type(req).__name__)
                if req.header.resent:
                    self.resent.append(req)
                for out in self.answer(req):
                    os.write(self.fd, out)
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def answer(self, req: p.Request) -> list[bytes]:
        u, node = req.header.unique, req.header.nodeid
        attr = ROOT_ATTR if node == p.ROOT_ID else FILE_ATTR
        match req:
            case p.Init():
                self.negotiated = p.negotiate(req, max_write=1 << 20)
                return [p.reply_init(u, self.negotiated)]
            case p.Lookup(name=b"hello") if node == p.ROOT_ID:
                return [p.reply_entry(u, FILE_ATTR, entry_valid_ns=10**9, attr_valid_ns=10**9)]
            case p.Lookup():
                return [p.reply_error(u, errno.ENOENT)]
            case p.Getattr():
                return [p.reply_attr(u, attr, attr_valid_ns=10**9)]
            case p.Open() | p.Opendir():
                return [p.reply_open(u, 7)]
            case p.Read() if self.die_on_read:
                self.dropped = req
                self.stop.set()
                return []
            case p.Read():
                return [p.reply(u, CONTENT[req.offset:req.offset + req.size])]
            case p.Readdirplus():
                entries = [p.DirEntry(b".", 1, ROOT_ATTR), p.DirEntry(b"..", 2, ROOT_ATTR),
                           p.DirEntry(b"hello", 3, FILE_ATTR)]
                body, _ = p.pack_direntplus([e for e in entries if e.off > req.offset], req.size,
                                            entry_valid_ns=10**9, attr_valid_ns=10**9)
                return [p.reply(u, body)]
            case p.Statfs():
                return [p.reply_statfs(u, blocks=5, bfree=0, bavail=0, files=2, ffree=0)]
            case p.Getxattr():
                return [p.reply_error(u, errno.ENODATA)]
            case p.Listxattr():
                return [p.reply_xattr(u, req.size, b"")]
            case p.Release() | p.Releasedir() | p.Access() | p.Destroy():
                return [p.reply(u)]
            case p.Forget() | p.BatchForget() | p.Interrupt():
                return []
            case _:
                return [p.reply_error(u, errno.ENOSYS)]


def test_serves_the_real_kernel_and_hands_over(tmp_path):
    """Mount through /dev/fuse with this module answering; the first server dies holding a
    READ, a second one takes the session over from a held descriptor without an INIT,
    writes NOTIFY_RESEND, gets that READ again and answers it: the client never fails."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse")
    libc = ctypes.CDLL(None, use_errno=True)
    mnt = tmp_path / "mnt with space"
    mnt.mkdir()
    held = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK)  # the holder's descriptor
    mounted = False
    first = OneFileServer(os.dup(held), die_on_read=True)
    second: OneFileServer | None = None
    try:
        opts = f"fd={held},rootmode=40000,user_id=0,group_id=0,default_permissions".encode()
        if libc.mount(b"shoaltest", bytes(mnt), b"fuse.shoaltest", MS_RDONLY | MS_NOSUID | MS_NODEV, opts) != 0:
            pytest.fail(f"mount: {os.strerror(ctypes.get_errno())}")
        mounted = True
        first.thread.start()
        result: dict[str, object] = {}

        def client() -> None:
            try:
                result["list"] = sorted(os.listdir(mnt))
                result["stat"] = os.stat(mnt / "hello")
                result["statvfs"] = os.statvfs(mnt)
                result["missing"] = os.path.exists(mnt / "nope")
                result["data"] = (mnt / "hello").read_bytes()
            except BaseException as e:  # noqa: BLE001 - reported below
                result["error"] = e

        reader = threading.Thread(target=client, daemon=True)
        reader.start()
        first.thread.join(30)
        assert not first.thread.is_alive() and first.error is None, (sorted(first.seen), first.error)
        assert first.dropped is not None and reader.is_alive()  # the client waits for its READ
        os.close(first.fd)  # the dead process's descriptor goes; the holder's keeps the session
        first.fd = -1
        assert first.negotiated is not None and first.negotiated.has_resend  # the kernel offered it
        second = OneFileServer(os.dup(held), negotiated=first.negotiated)
        second.thread.start()
        reader.join(30)
        assert not reader.is_alive(), f"the client hangs; the second server saw {sorted(second.seen)}"
        assert second.error is None, repr(second.error)
        assert "error" not in result, repr(result.get("error"))
        assert result["list"] == ["hello"] and result["missing"] is False
        assert result["stat"].st_size == len(CONTENT) and result["stat"].st_mode == 0o100444
        assert result["stat"].st_mtime_ns == FILE_ATTR.mtime_ns and result["stat"].st_ino == 2
        assert result["statvfs"].f_blocks == 5
        assert result["data"] == CONTENT
        assert "Init" not in second.seen
        again = [r for r in second.resent if isinstance(r, p.Read)]
        assert again and again[0].header.unique == first.dropped.header.unique | p.FUSE_UNIQUE_RESEND
        assert (again[0].offset, again[0].size) == (first.dropped.offset, first.dropped.size)
        # the kernel takes the invalidations (a wrong code or layout is EINVAL or ENOENT)
        assert os.write(held, p.notify_inval_inode(2, 0, 0)) == 40
        assert os.write(held, p.notify_inval_entry(p.ROOT_ID, b"hello")) == 16 + 16 + 6
        assert (mnt / "hello").read_bytes() == CONTENT  # looked up and read again after them
    finally:
        for server in (first, second):
            if server is not None:
                server.stop.set()
                if server.thread.is_alive():
                    server.thread.join(10)
                if server.fd >= 0:
                    os.close(server.fd)
        umounted = not mounted or libc.umount2(bytes(mnt), MNT_DETACH) == 0
        os.close(held)  # the last reference: aborts the connection, a client still waiting gets ENOTCONN
    assert umounted and not first.thread.is_alive() and not (second and second.thread.is_alive())
