"""The FUSE wire protocol over /dev/fuse, read-only subset: parsing and building, no I/O.

This is the first brick of a FUSE request loop of shoal's own (pyfuse3 cannot resume a
session whose INIT already happened, so taking over a live /dev/fuse connection needs
one). Everything here is a pure function over bytes: the loop reads one request per
read(2), hands the bytes to `parse_request`, and writes what a `reply_*` or `notify_*`
function returns (or `reply_header` + the data, with writev). Malformed input raises
`ProtocolError` and nothing else (h11's fuzz rule); builders given values out of range
(a bug in the caller, not bad input) raise ValueError.

Every message starts with a header (all integers little-endian, the host order of the
x86-64/arm64 kernels shoal runs on; <linux/fuse.h> uses host order):

    request, fuse_in_header (IN_HEADER_SIZE = 40 bytes):
       0 u32 len           the whole message, header included
       4 u32 opcode        Opcode
       8 u64 unique        request id; a reply carries it back unchanged (with the
                           FUSE_UNIQUE_RESEND bit when the kernel resent the request,
                           with FUSE_INT_REQ_BIT on an INTERRUPT)
      16 u64 nodeid        the inode the request is about (FUSE_ROOT_ID = 1 is the root)
      24 u32 uid  28 u32 gid  32 u32 pid    of the calling process
      36 u16 total_extlen  length of extensions at the end of the message, in 8-byte units
      38 u16 padding
    then the opcode's argument struct (below), then the extensions.

    reply or notification, fuse_out_header (OUT_HEADER_SIZE = 16 bytes):
       0 u32 len           the whole message
       4 i32 error         0 or a negative errno in a reply (-ENOSYS: "not implemented",
                           the kernel stops sending that opcode); in a notification the
                           positive NotifyCode
       8 u64 unique        the request's unique; 0 for a notification

Negotiation (`negotiate`): the kernel sends INIT with its major/minor and the flags it
offers; we answer major 7 and minor min(kernel's, PROTOCOL_MINOR), and the flags we want
among those offered. After that the kernel sends the argument structs of the negotiated
minor, so every body below has one exact size (only INIT, which precedes negotiation, is
accepted at its pre-7.36 size of 16 bytes too). A server that takes over a connection
gets no INIT: it must be handed the `Negotiated` of the process it replaces (to_json/from_json).

The layouts are checked against the C header by tests/test_fuse_protocol.py (gcc,
sizeof/offsetof of every struct and field in LAYOUTS). The Debian header is 7.38 while
the running kernel (6.18) speaks 7.45; constants newer than 7.38 are defined here from
the kernel's uapi header, each marked with the minor that added it. The 7.40 changes to
structs we use keep their sizes (fuse_open_out.padding became backing_id,
fuse_init_out.unused[0] became max_stack_depth): OPEN_OUT_PASSTHROUGH and
INIT_OUT_PASSTHROUGH are those 7.40 layouts (outside LAYOUTS, which the 7.38 header
checks; a test checks that they keep the sizes and offsets of the old ones).

Passthrough (7.40): a server that negotiated FUSE_PASSTHROUGH registers a file of its own
with the connection (`backing_open`, an ioctl on /dev/fuse: CAP_SYS_ADMIN) and answers an
OPEN with FOPEN_PASSTHROUGH and the backing id; the kernel then reads and maps that file
for the opened one, and sends no READ. The kernel holds one backing file per inode while
it is open that way, and fails with EIO an open that mixes passthrough and cached opens
of one inode (fs/fuse/iomode.c).
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import fcntl
import json
import stat as statmod
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.errors import FormatError

# --- constants -------------------------------------------------------------------------

KERNEL_VERSION = 7  # FUSE_KERNEL_VERSION: the only major there is
# The minor we speak: 7.40 added FUSE_NOTIFY_RESEND and FUSE_HAS_RESEND, and no struct of
# the read-only subset changed size between 7.28 and 7.45.
PROTOCOL_MINOR = 40
MIN_KERNEL_MINOR = 28  # FUSE_MAX_PAGES and max_pages in fuse_init_out (Linux 4.20)
ROOT_ID = 1  # FUSE_ROOT_ID

FUSE_UNIQUE_RESEND = 1 << 63  # 7.40: set in the unique of a request the kernel resent
FUSE_INT_REQ_BIT = 1  # set in the unique of an INTERRUPT (fs/fuse/fuse_i.h)
MIN_READ_BUFFER = 8192  # FUSE_MIN_READ_BUFFER; the read buffer must also hold max_write + 4096
NAME_MAX = 1024  # FUSE_NAME_MAX (fs/fuse/fuse_i.h): longer dirent names are EIO in the kernel
MAX_ERRNO = 511  # the kernel refuses replies with error <= -512


class ProtocolError(FormatError):
    """A message from /dev/fuse that does not follow the FUSE wire protocol."""


class Opcode(enum.IntEnum):
    LOOKUP = 1
    FORGET = 2  # no reply
    GETATTR = 3
    SETATTR = 4
    READLINK = 5
    SYMLINK = 6
    MKNOD = 8
    MKDIR = 9
    UNLINK = 10
    RMDIR = 11
    RENAME = 12
    LINK = 13
    OPEN = 14
    READ = 15
    WRITE = 16
    STATFS = 17
    RELEASE = 18
    FSYNC = 20
    SETXATTR = 21
    GETXATTR = 22
    LISTXATTR = 23
    REMOVEXATTR = 24
    FLUSH = 25
    INIT = 26
    OPENDIR = 27
    READDIR = 28
    RELEASEDIR = 29
    FSYNCDIR = 30
    GETLK = 31
    SETLK = 32
    SETLKW = 33
    ACCESS = 34
    CREATE = 35
    INTERRUPT = 36
    BMAP = 37
    DESTROY = 38
    IOCTL = 39
    POLL = 40
    NOTIFY_REPLY = 41
    BATCH_FORGET = 42  # no reply
    FALLOCATE = 43
    READDIRPLUS = 44
    RENAME2 = 45
    LSEEK = 46
    COPY_FILE_RANGE = 47
    SETUPMAPPING = 48
    REMOVEMAPPING = 49
    SYNCFS = 50
    TMPFILE = 51
    STATX = 52  # 7.39


class NotifyCode(enum.IntEnum):
    POLL = 1
    INVAL_INODE = 2
    INVAL_ENTRY = 3
    STORE = 4
    RETRIEVE = 5
    DELETE = 6
    RESEND = 7  # 7.40: the kernel resends every request it sent and has no reply for


# INIT flags (fuse_init_in/out.flags; bits 32..63 travel in flags2 when FUSE_INIT_EXT is set).
FUSE_ASYNC_READ = 1 << 0
FUSE_POSIX_LOCKS = 1 << 1
FUSE_ATOMIC_O_TRUNC = 1 << 3
FUSE_EXPORT_SUPPORT = 1 << 4  # the fs answers LOOKUP of "." and ".." (NFS export)
FUSE_BIG_WRITES = 1 << 5
FUSE_DONT_MASK = 1 << 6
FUSE_SPLICE_WRITE = 1 << 7
FUSE_SPLICE_MOVE = 1 << 8
FUSE_SPLICE_READ = 1 << 9
FUSE_FLOCK_LOCKS = 1 << 10
FUSE_HAS_IOCTL_DIR = 1 << 11
FUSE_AUTO_INVAL_DATA = 1 << 12
FUSE_DO_READDIRPLUS = 1 << 13
FUSE_READDIRPLUS_AUTO = 1 << 14
FUSE_ASYNC_DIO = 1 << 15
FUSE_WRITEBACK_CACHE = 1 << 16
FUSE_NO_OPEN_SUPPORT = 1 << 17
FUSE_PARALLEL_DIROPS = 1 << 18
FUSE_HANDLE_KILLPRIV = 1 << 19
FUSE_POSIX_ACL = 1 << 20
FUSE_ABORT_ERROR = 1 << 21
FUSE_MAX_PAGES = 1 << 22
FUSE_CACHE_SYMLINKS = 1 << 23
FUSE_NO_OPENDIR_SUPPORT = 1 << 24
FUSE_EXPLICIT_INVAL_DATA = 1 << 25
FUSE_MAP_ALIGNMENT = 1 << 26
FUSE_SUBMOUNTS = 1 << 27
FUSE_HANDLE_KILLPRIV_V2 = 1 << 28
FUSE_SETXATTR_EXT = 1 << 29
FUSE_INIT_EXT = 1 << 30  # 7.36: fuse_init_in/out carry flags2
FUSE_SECURITY_CTX = 1 << 32
FUSE_HAS_INODE_DAX = 1 << 33
FUSE_CREATE_SUPP_GROUP = 1 << 34
FUSE_HAS_EXPIRE_ONLY = 1 << 35
FUSE_DIRECT_IO_ALLOW_MMAP = 1 << 36  # 7.39
FUSE_PASSTHROUGH = 1 << 37  # 7.40
FUSE_NO_EXPORT_SUPPORT = 1 << 38  # 7.40
FUSE_HAS_RESEND = 1 << 39  # 7.40: offered by a kernel that understands NOTIFY_RESEND
FUSE_ALLOW_IDMAP = 1 << 40  # 7.41

# What a read-only layer file system wants: parallel and asynchronous reads, READDIRPLUS
# always (so a listing also answers the lookups), requests of up to max_pages pages,
# symlink targets cached by the kernel. Not FUSE_EXPORT_SUPPORT (we do not answer ".."),
# nor anything about writes, locks or splice.
DEFAULT_FLAGS = (FUSE_ASYNC_READ | FUSE_DO_READDIRPLUS | FUSE_PARALLEL_DIROPS | FUSE_MAX_PAGES
                 | FUSE_CACHE_SYMLINKS)

# OPEN/OPENDIR reply flags (fuse_open_out.open_flags).
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1  # keep the page cache across opens: right for immutable layers
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3  # let the kernel cache the directory's READDIRPLUS results
FOPEN_STREAM = 1 << 4
FOPEN_NOFLUSH = 1 << 5  # no FLUSH on close
FOPEN_PARALLEL_DIRECT_WRITES = 1 << 6
FOPEN_PASSTHROUGH = 1 << 7  # 7.40: reads and mmap go to the backing file (open_out.backing_id)
# 7.40: the ioctls on /dev/fuse that register a backing file (struct fuse_backing_map
# {s32 fd; u32 flags; u64 padding}: _IOW(229, 1, 16 bytes)) and drop one (_IOW(229, 2, u32))
FUSE_DEV_IOC_BACKING_OPEN = 0x4010E501
FUSE_DEV_IOC_BACKING_CLOSE = 0x4004E502

FUSE_GETATTR_FH = 1 << 0  # fuse_getattr_in.getattr_flags: fh is valid
FUSE_EXPIRE_ONLY = 1 << 0  # fuse_notify_inval_entry_out.flags (needs FUSE_HAS_EXPIRE_ONLY)


# --- struct layouts (one table for reader, writer and the C check) --------------------------


class Layout:
    """One struct of <linux/fuse.h>: its fields in order, each with a `struct` code.

    Padding and reserved arrays use "Nx" codes: they are zero on pack and skipped on
    unpack, so pack() and unpack() take and give only the meaningful fields. A nested
    struct's fields are named "outer.inner" (what offsetof() accepts in C).
    """

    def __init__(self, c_name: str, *fields: tuple[str, str]):
        self.c_name = c_name
        self.fields = fields
        self.struct = struct.Struct("<" + "".join(code for _, code in fields))
        self.size = self.struct.size
        self.offsets: dict[str, int] = {}
        self.sizes: dict[str, int] = {}
        at = 0
        for name, code in fields:
            self.offsets[name] = at
            self.sizes[name] = struct.calcsize("<" + code)
            at += self.sizes[name]

    def pack(self, *values: int) -> bytes:
        try:
            return self.struct.pack(*values)
        except struct.error as e:
            raise ValueError(f"{self.c_name}: {e}") from None

    def unpack(self, data: bytes | memoryview, what: str) -> tuple:
        """Unpack exactly `size` bytes (anything else is a ProtocolError naming `what`)."""
        if len(data) != self.size:
            raise ProtocolError(f"FUSE {what}: {len(data)} bytes, want {self.size} ({self.c_name})")
        return self.struct.unpack(data)


def _nested(prefix: str, layout: Layout) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}.{name}", code) for name, code in layout.fields)


IN_HEADER = Layout("fuse_in_header", ("len", "I"), ("opcode", "I"), ("unique", "Q"), ("nodeid", "Q"),
                   ("uid", "I"), ("gid", "I"), ("pid", "I"), ("total_extlen", "H"), ("padding", "2x"))
OUT_HEADER = Layout("fuse_out_header", ("len", "I"), ("error", "i"), ("unique", "Q"))
IN_HEADER_SIZE = IN_HEADER.size  # 40
OUT_HEADER_SIZE = OUT_HEADER.size  # 16

INIT_IN = Layout("fuse_init_in", ("major", "I"), ("minor", "I"), ("max_readahead", "I"), ("flags", "I"),
                 ("flags2", "I"), ("unused", "44x"))
INIT_IN_COMPAT_SIZE = 16  # fuse_init_in before 7.36: major, minor, max_readahead, flags
INIT_OUT = Layout("fuse_init_out", ("major", "I"), ("minor", "I"), ("max_readahead", "I"), ("flags", "I"),
                  ("max_background", "H"), ("congestion_threshold", "H"), ("max_write", "I"),
                  ("time_gran", "I"), ("max_pages", "H"), ("map_alignment", "H"), ("flags2", "I"),
                  ("unused", "28x"))
INIT_OUT_PASSTHROUGH = Layout("fuse_init_out", *INIT_OUT.fields[:-1], ("max_stack_depth", "I"),
                              ("unused", "24x"))  # 7.40
# Times are uint64_t in the header; the kernel reads them as s64 (fuse_fillattr), so we
# pack them signed: a file dated before 1970 stays before 1970.
ATTR = Layout("fuse_attr", ("ino", "Q"), ("size", "Q"), ("blocks", "Q"), ("atime", "q"), ("mtime", "q"),
              ("ctime", "q"), ("atimensec", "I"), ("mtimensec", "I"), ("ctimensec", "I"), ("mode", "I"),
              ("nlink", "I"), ("uid", "I"), ("gid", "I"), ("rdev", "I"), ("blksize", "I"), ("flags", "I"))
ENTRY_OUT = Layout("fuse_entry_out", ("nodeid", "Q"), ("generation", "Q"), ("entry_valid", "Q"),
                   ("attr_valid", "Q"), ("entry_valid_nsec", "I"), ("attr_valid_nsec", "I"),
                   *_nested("attr", ATTR))
ATTR_OUT = Layout("fuse_attr_out", ("attr_valid", "Q"), ("attr_valid_nsec", "I"), ("dummy", "4x"),
                  *_nested("attr", ATTR))
FORGET_IN = Layout("fuse_forget_in", ("nlookup", "Q"))
FORGET_ONE = Layout("fuse_forget_one", ("nodeid", "Q"), ("nlookup", "Q"))
BATCH_FORGET_IN = Layout("fuse_batch_forget_in", ("count", "I"), ("dummy", "4x"))
GETATTR_IN = Layout("fuse_getattr_in", ("getattr_flags", "I"), ("dummy", "4x"), ("fh", "Q"))
OPEN_IN = Layout("fuse_open_in", ("flags", "I"), ("open_flags", "I"))
OPEN_OUT = Layout("fuse_open_out", ("fh", "Q"), ("open_flags", "I"), ("padding", "4x"))
OPEN_OUT_PASSTHROUGH = Layout("fuse_open_out", ("fh", "Q"), ("open_flags", "I"), ("backing_id", "i"))  # 7.40
READ_IN = Layout("fuse_read_in", ("fh", "Q"), ("offset", "Q"), ("size", "I"), ("read_flags", "I"),
                 ("lock_owner", "Q"), ("flags", "I"), ("padding", "4x"))
RELEASE_IN = Layout("fuse_release_in", ("fh", "Q"), ("flags", "I"), ("release_flags", "I"),
                    ("lock_owner", "Q"))
FLUSH_IN = Layout("fuse_flush_in", ("fh", "Q"), ("unused", "4x"), ("padding", "4x"), ("lock_owner", "Q"))
GETXATTR_IN = Layout("fuse_getxattr_in", ("size", "I"), ("padding", "4x"))
GETXATTR_OUT = Layout("fuse_getxattr_out", ("size", "I"), ("padding", "4x"))
ACCESS_IN = Layout("fuse_access_in", ("mask", "I"), ("padding", "4x"))
INTERRUPT_IN = Layout("fuse_interrupt_in", ("unique", "Q"))
KSTATFS = Layout("fuse_kstatfs", ("blocks", "Q"), ("bfree", "Q"), ("bavail", "Q"), ("files", "Q"),
                 ("ffree", "Q"), ("bsize", "I"), ("namelen", "I"), ("frsize", "I"), ("padding", "4x"),
                 ("spare", "24x"))
STATFS_OUT = Layout("fuse_statfs_out", *_nested("st", KSTATFS))
DIRENT = Layout("fuse_dirent", ("ino", "Q"), ("off", "Q"), ("namelen", "I"), ("type", "I"))
DIRENTPLUS = Layout("fuse_direntplus", *_nested("entry_out", ENTRY_OUT), *_nested("dirent", DIRENT))
NOTIFY_STORE_OUT = Layout("fuse_notify_store_out", ("nodeid", "Q"), ("offset", "Q"), ("size", "I"), ("padding", "4x"))
NOTIFY_INVAL_INODE_OUT = Layout("fuse_notify_inval_inode_out", ("ino", "Q"), ("off", "q"), ("len", "q"))
NOTIFY_INVAL_ENTRY_OUT = Layout("fuse_notify_inval_entry_out", ("parent", "Q"), ("namelen", "I"),
                                ("flags", "I"))

LAYOUTS = (IN_HEADER, OUT_HEADER, INIT_IN, INIT_OUT, ATTR, ENTRY_OUT, ATTR_OUT, FORGET_IN, FORGET_ONE,
           BATCH_FORGET_IN, GETATTR_IN, OPEN_IN, OPEN_OUT, READ_IN, RELEASE_IN, FLUSH_IN, GETXATTR_IN,
           GETXATTR_OUT, ACCESS_IN, INTERRUPT_IN, KSTATFS, STATFS_OUT, DIRENT, DIRENTPLUS,
           NOTIFY_INVAL_INODE_OUT, NOTIFY_INVAL_ENTRY_OUT, NOTIFY_STORE_OUT)

DIRENT_NAME_OFFSET = DIRENT.size  # FUSE_NAME_OFFSET: the name follows the 24-byte fuse_dirent
DIRENTPLUS_NAME_OFFSET = DIRENTPLUS.size  # FUSE_NAME_OFFSET_DIRENTPLUS (152)


def dirent_align(n: int) -> int:
    """FUSE_DIRENT_ALIGN: records in a READDIR(PLUS) reply start at multiples of 8 bytes."""
    return (n + 7) & ~7


# --- requests ------------------------------------------------------------------------------
#
# Requests, headers, attributes and entries are plain slotted dataclasses, to be treated as
# values (nothing here changes one after parsing). Not frozen: a frozen dataclass's
# __init__ sets each field through object.__setattr__, about 8x the cost, and a READ
# builds two of them on the hot path.


@dataclass(slots=True)
class Header:
    len: int
    opcode: int
    unique: int
    nodeid: int
    uid: int
    gid: int
    pid: int
    total_extlen: int

    @property
    def resent(self) -> bool:
        """The kernel sent this request before (FUSE_NOTIFY_RESEND); it may be a repeat."""
        return bool(self.unique & FUSE_UNIQUE_RESEND)


@dataclass(slots=True)
class Request:
    """A request the loop answers with ENOSYS: an opcode outside the read-only subset.

    Every request class below derives from this one; `header.unique` is what the reply
    must carry, `header.nodeid` the inode it is about.
    """

    header: Header
    body: bytes = b""


@dataclass(slots=True)
class Init(Request):
    major: int = 0
    minor: int = 0
    max_readahead: int = 0
    flags: int = 0  # 64 bits: flags2 already shifted in when the kernel set FUSE_INIT_EXT


@dataclass(slots=True)
class Lookup(Request):
    name: bytes = b""


@dataclass(slots=True)
class Forget(Request):
    """No reply. The kernel drops `nlookup` of the references LOOKUP/READDIRPLUS gave it."""

    nlookup: int = 0


@dataclass(slots=True)
class BatchForget(Request):
    """No reply. Several FORGETs at once: (nodeid, nlookup) pairs."""

    forgets: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class Getattr(Request):
    getattr_flags: int = 0
    fh: int = 0  # valid when getattr_flags has FUSE_GETATTR_FH


@dataclass(slots=True)
class _OpenIn(Request):
    """fuse_open_in: the arguments of OPEN and OPENDIR."""

    flags: int = 0  # open(2) flags
    open_flags: int = 0  # FUSE_OPEN_*


@dataclass(slots=True)
class Open(_OpenIn):
    pass


@dataclass(slots=True)
class Opendir(_OpenIn):
    pass


@dataclass(slots=True)
class _ReadIn(Request):
    """fuse_read_in: the arguments of READ and READDIRPLUS."""

    fh: int = 0
    offset: int = 0
    size: int = 0  # answer at most this many bytes
    read_flags: int = 0
    lock_owner: int = 0
    flags: int = 0


@dataclass(slots=True)
class Read(_ReadIn):
    pass


@dataclass(slots=True)
class Readdirplus(_ReadIn):
    """`offset` is 0 or the `off` of the last entry the kernel got."""


@dataclass(slots=True)
class _ReleaseIn(Request):
    """fuse_release_in: the arguments of RELEASE and RELEASEDIR."""

    fh: int = 0
    flags: int = 0
    release_flags: int = 0
    lock_owner: int = 0


@dataclass(slots=True)
class Release(_ReleaseIn):
    pass


@dataclass(slots=True)
class Releasedir(_ReleaseIn):
    pass


@dataclass(slots=True)
class Flush(Request):
    fh: int = 0
    lock_owner: int = 0


@dataclass(slots=True)
class Statfs(Request):
    pass


@dataclass(slots=True)
class Getxattr(Request):
    """`size` 0 asks for the value's size (`reply_xattr` answers both kinds)."""

    size: int = 0
    name: bytes = b""


@dataclass(slots=True)
class Listxattr(Request):
    size: int = 0


@dataclass(slots=True)
class Readlink(Request):
    pass


@dataclass(slots=True)
class Access(Request):
    mask: int = 0


@dataclass(slots=True)
class Interrupt(Request):
    """No reply needed; `target` is the unique of the request to interrupt."""

    target: int = 0


@dataclass(slots=True)
class Destroy(Request):
    pass


def _name(body: bytes, what: str) -> bytes:
    """A NUL-terminated name filling the rest of the body: non-empty, no NUL inside."""
    if not body or body[-1] != 0:
        raise ProtocolError(f"FUSE {what}: name not NUL-terminated")
    name = body[:-1]
    if not name or 0 in name:
        raise ProtocolError(f"FUSE {what}: empty name or NUL inside the name")
    return name


def _parse_init(h: Header, body: bytes) -> Init:
    if len(body) < INIT_IN_COMPAT_SIZE:
        raise ProtocolError(f"FUSE INIT: {len(body)} bytes, want at least {INIT_IN_COMPAT_SIZE}")
    major, minor, readahead, flags = struct.unpack_from("<4I", body)
    if flags & FUSE_INIT_EXT and len(body) >= INIT_IN.offsets["flags2"] + 4:
        flags |= struct.unpack_from("<I", body, INIT_IN.offsets["flags2"])[0] << 32
    return Init(h, b"", major, minor, readahead, flags)


def _parse_batch_forget(h: Header, body: bytes) -> BatchForget:
    (count,) = BATCH_FORGET_IN.unpack(body[:BATCH_FORGET_IN.size], "BATCH_FORGET")
    rest = body[BATCH_FORGET_IN.size:]
    if len(rest) != count * FORGET_ONE.size:
        raise ProtocolError(f"FUSE BATCH_FORGET: count {count} but {len(rest)} bytes of entries")
    pairs = tuple(FORGET_ONE.struct.iter_unpack(rest))
    return BatchForget(h, b"", pairs)


def _parse_getxattr(h: Header, body: bytes) -> Getxattr:
    (size,) = GETXATTR_IN.unpack(body[:GETXATTR_IN.size], "GETXATTR")
    return Getxattr(h, b"", size, _name(body[GETXATTR_IN.size:], "GETXATTR"))


def _fixed(cls: type, layout: Layout, what: str):
    def parse(h: Header, body: bytes) -> Request:
        return cls(h, b"", *layout.unpack(body, what))
    return parse


def _empty(cls: type, what: str):
    def parse(h: Header, body: bytes) -> Request:
        if body:
            raise ProtocolError(f"FUSE {what}: {len(body)} bytes of arguments, want none")
        return cls(h)
    return parse


_PARSERS = {
    Opcode.INIT: _parse_init,
    Opcode.LOOKUP: lambda h, body: Lookup(h, b"", _name(body, "LOOKUP")),
    Opcode.FORGET: _fixed(Forget, FORGET_IN, "FORGET"),
    Opcode.BATCH_FORGET: _parse_batch_forget,
    Opcode.GETATTR: _fixed(Getattr, GETATTR_IN, "GETATTR"),
    Opcode.OPEN: _fixed(Open, OPEN_IN, "OPEN"),
    Opcode.OPENDIR: _fixed(Opendir, OPEN_IN, "OPENDIR"),
    Opcode.READ: _fixed(Read, READ_IN, "READ"),
    Opcode.READDIRPLUS: _fixed(Readdirplus, READ_IN, "READDIRPLUS"),
    Opcode.RELEASE: _fixed(Release, RELEASE_IN, "RELEASE"),
    Opcode.RELEASEDIR: _fixed(Releasedir, RELEASE_IN, "RELEASEDIR"),
    Opcode.FLUSH: _fixed(Flush, FLUSH_IN, "FLUSH"),
    Opcode.STATFS: _empty(Statfs, "STATFS"),
    Opcode.GETXATTR: _parse_getxattr,
    Opcode.LISTXATTR: _fixed(Listxattr, GETXATTR_IN, "LISTXATTR"),
    Opcode.READLINK: _empty(Readlink, "READLINK"),
    Opcode.ACCESS: _fixed(Access, ACCESS_IN, "ACCESS"),
    Opcode.INTERRUPT: _fixed(Interrupt, INTERRUPT_IN, "INTERRUPT"),
    Opcode.DESTROY: _empty(Destroy, "DESTROY"),
}


def parse_header(data: bytes | memoryview) -> Header:
    if len(data) < IN_HEADER_SIZE:
        raise ProtocolError(f"FUSE request: {len(data)} bytes, shorter than the {IN_HEADER_SIZE}-byte header")
    return Header(*IN_HEADER.struct.unpack_from(data))


def parse_request(data: bytes | memoryview) -> Request:
    """Parse one request as one read(2) of /dev/fuse returns it: exactly `header.len` bytes.

    Opcodes outside the read-only subset come back as a plain `Request` (answer ENOSYS).
    """
    h = parse_header(data)
    if h.len != len(data):
        raise ProtocolError(f"FUSE request: header says {h.len} bytes, message has {len(data)}")
    end = h.len - 8 * h.total_extlen
    if end < IN_HEADER_SIZE:
        raise ProtocolError(f"FUSE request: {8 * h.total_extlen} bytes of extensions in a {h.len}-byte message")
    body = bytes(data[IN_HEADER_SIZE:end])
    parser = _PARSERS.get(h.opcode)  # type: ignore[call-overload]
    if parser is None:
        return Request(h, body)
    return parser(h, body)


# --- negotiation -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Negotiated:
    """What INIT settled for the session; a process taking over the session needs it."""

    minor: int
    flags: int  # the flags we replied with (FUSE_INIT_EXT included when flags2 was used)
    kernel_flags: int  # what the kernel offered
    max_readahead: int
    max_write: int
    max_pages: int

    @property
    def has_resend(self) -> bool:
        """The kernel understands FUSE_NOTIFY_RESEND (Linux 6.9+, FUSE 7.40)."""
        return bool(self.kernel_flags & FUSE_HAS_RESEND)

    @property
    def passthrough(self) -> bool:
        """FUSE_PASSTHROUGH was offered and taken: opens may name backing files."""
        return bool(self.flags & FUSE_PASSTHROUGH)

    @property
    def read_buffer_size(self) -> int:
        """The size of a /dev/fuse read buffer that any request fits (the kernel's minimum)."""
        return max(MIN_READ_BUFFER, self.max_write + 4096)

    def to_json(self) -> bytes:
        """What the holder of the session's descriptor keeps for the next server."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Negotiated:
        try:
            value = json.loads(data)
        except (ValueError, RecursionError):
            raise ProtocolError("FUSE session state: not JSON") from None
        names = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(value, dict) or sorted(value) != sorted(names):
            raise ProtocolError(f"FUSE session state: want exactly the keys {', '.join(names)}")
        for name in names:
            v = value[name]
            if type(v) is not int or not 0 <= v < 1 << 64:
                raise ProtocolError(f"FUSE session state: {name} = {v!r}, want an integer in 0..2^64-1")
        if not MIN_KERNEL_MINOR <= value["minor"] <= PROTOCOL_MINOR:
            raise ProtocolError(f"FUSE session state: minor {value['minor']}, want "
                                f"{MIN_KERNEL_MINOR}..{PROTOCOL_MINOR}")
        return cls(**value)


def negotiate(init: Init, *, want: int = DEFAULT_FLAGS, max_readahead: int = 1 << 20,
              max_write: int = 1 << 20, max_pages: int = 256) -> Negotiated:
    """Settle the session from the kernel's INIT: minor min(kernel's, ours), flags `want` ∩ offered.

    A kernel whose major is not 7 or whose minor is older than MIN_KERNEL_MINOR is a
    ProtocolError (answer INIT with -EPROTO). `max_pages` pages of 4 KiB bound a request
    (the kernel clamps it to its own limit, 256 by default).
    """
    if init.major != KERNEL_VERSION or init.minor < MIN_KERNEL_MINOR:
        raise ProtocolError(f"FUSE INIT: kernel protocol {init.major}.{init.minor}, "
                            f"want {KERNEL_VERSION}.{MIN_KERNEL_MINOR} or newer")
    minor = min(init.minor, PROTOCOL_MINOR)
    flags = want & init.flags
    if init.flags & FUSE_INIT_EXT:
        flags |= FUSE_INIT_EXT
    else:
        flags &= 0xFFFFFFFF
    return Negotiated(minor=minor, flags=flags, kernel_flags=init.flags,
                      max_readahead=min(max_readahead, init.max_readahead), max_write=max_write,
                      max_pages=max_pages if flags & FUSE_MAX_PAGES else 0)


def reply_init(unique: int, n: Negotiated, *, max_background: int = 0, congestion_threshold: int = 0,
               time_gran: int = 1) -> bytes:
    """fuse_init_out; max_background/congestion_threshold 0 keep the kernel's defaults.
    With passthrough, max_stack_depth is PASSTHROUGH_STACK_DEPTH (the kernel takes the
    flag only with a depth of 1 or 2)."""
    body = INIT_OUT_PASSTHROUGH.pack(KERNEL_VERSION, n.minor, n.max_readahead, n.flags & 0xFFFFFFFF,
                                     max_background, congestion_threshold, n.max_write, time_gran, n.max_pages,
                                     0, n.flags >> 32, PASSTHROUGH_STACK_DEPTH if n.passthrough else 0)
    return reply(unique, body)


# The stack depth a passthrough session declares: its backing files must be on a file
# system of depth 0 (ext4, xfs, tmpfs: not overlayfs), and the mount itself counts as
# depth 1, so overlayfs over it still fits (depth 2, the kernel's most) but an overlayfs
# over that one (an overlay made inside a container) does not.
PASSTHROUGH_STACK_DEPTH = 1


def backing_open(dev_fd: int, fd: int) -> int:
    """Register open file `fd` with the FUSE connection of `dev_fd`: its backing id (> 0),
    good until backing_close or the connection's end (the kernel keeps its own reference
    to the file: `fd` may be closed). OSError: EPERM (no CAP_SYS_ADMIN, or no passthrough
    on this connection), ELOOP (the file's file system is stacked too deep), ..."""
    arg = bytearray(struct.pack("<iIQ", fd, 0, 0))
    return int(fcntl.ioctl(dev_fd, FUSE_DEV_IOC_BACKING_OPEN, arg, True))


def backing_close(dev_fd: int, backing_id: int) -> None:
    """Drop a backing id (files open with it keep their backing file)."""
    fcntl.ioctl(dev_fd, FUSE_DEV_IOC_BACKING_CLOSE, bytearray(struct.pack("<I", backing_id)), True)


# --- replies -------------------------------------------------------------------------------


def reply_header(unique: int, size: int) -> bytes:
    """The header of a successful reply carrying `size` bytes after it (for writev)."""
    return OUT_HEADER.pack(OUT_HEADER_SIZE + size, 0, unique)


def reply(unique: int, body: bytes = b"") -> bytes:
    """A successful reply; an empty body answers RELEASE, RELEASEDIR, FLUSH, ACCESS, DESTROY."""
    return reply_header(unique, len(body)) + body


def reply_error(unique: int, err: int) -> bytes:
    """A failed request; `err` is a positive errno (ENOENT, EIO, ENOSYS, ...)."""
    if not 0 < err <= MAX_ERRNO:
        raise ValueError(f"FUSE reply: errno {err} out of range 1..{MAX_ERRNO}")
    return OUT_HEADER.pack(OUT_HEADER_SIZE, -err, unique)


@dataclass(slots=True)
class Attr:
    """What stat(2) shows of an inode. Times in nanoseconds since the epoch (may be negative)."""

    ino: int
    mode: int
    size: int = 0
    nlink: int = 1
    uid: int = 0
    gid: int = 0
    rdev: int = 0
    atime_ns: int = 0
    mtime_ns: int = 0
    ctime_ns: int = 0
    blocks: int = -1  # 512-byte blocks; -1: derived from size
    blksize: int = 4096

    def values(self) -> tuple[int, ...]:
        blocks = (self.size + 511) // 512 if self.blocks < 0 else self.blocks
        (a, an), (m, mn), (c, cn) = (divmod(t, 10**9) for t in (self.atime_ns, self.mtime_ns, self.ctime_ns))
        return (self.ino, self.size, blocks, a, m, c, an, mn, cn, self.mode, self.nlink, self.uid, self.gid,
                self.rdev, self.blksize, 0)


def _valid(ns: int) -> tuple[int, int]:
    if ns < 0:
        raise ValueError(f"FUSE reply: negative cache timeout {ns} ns")
    return divmod(ns, 10**9)


def _entry_values(nodeid: int, attr: Attr | None, entry_valid_ns: int, attr_valid_ns: int,
                  generation: int) -> tuple[int, ...]:
    e, en = _valid(entry_valid_ns)
    a, an = _valid(attr_valid_ns)
    attr_values = attr.values() if attr is not None else (0,) * 16
    return (nodeid, generation, e, a, en, an, *attr_values)


def reply_entry(unique: int, attr: Attr, *, entry_valid_ns: int, attr_valid_ns: int, generation: int = 0) -> bytes:
    """A successful LOOKUP: the kernel now holds one more reference to inode `attr.ino`."""
    return reply(unique, ENTRY_OUT.pack(*_entry_values(attr.ino, attr, entry_valid_ns, attr_valid_ns, generation)))


def reply_negative_entry(unique: int, *, entry_valid_ns: int) -> bytes:
    """LOOKUP of a name that does not exist, cached for `entry_valid_ns` (nodeid 0, no reference)."""
    return reply(unique, ENTRY_OUT.pack(*_entry_values(0, None, entry_valid_ns, 0, 0)))


def reply_attr(unique: int, attr: Attr, *, attr_valid_ns: int) -> bytes:
    a, an = _valid(attr_valid_ns)
    return reply(unique, ATTR_OUT.pack(a, an, *attr.values()))


def reply_open(unique: int, fh: int, open_flags: int = FOPEN_KEEP_CACHE, backing_id: int = 0) -> bytes:
    """OPEN/OPENDIR: `fh` comes back in READ/READDIRPLUS/RELEASE of this open file;
    `backing_id` (with FOPEN_PASSTHROUGH) names the file the kernel reads instead."""
    return reply(unique, OPEN_OUT_PASSTHROUGH.pack(fh, open_flags, backing_id))


def reply_statfs(unique: int, *, blocks: int, bfree: int, bavail: int, files: int, ffree: int,
                 bsize: int = 4096, namelen: int = 255, frsize: int = 4096) -> bytes:
    return reply(unique, STATFS_OUT.pack(blocks, bfree, bavail, files, ffree, bsize, namelen, frsize))


def reply_xattr(unique: int, requested: int, value: bytes) -> bytes:
    """GETXATTR or LISTXATTR (value: the NUL-terminated names, concatenated).

    `requested` 0 asks for the size alone (a fuse_getxattr_out); a value longer than
    `requested` is ERANGE; otherwise the value itself is the reply.
    """
    if requested == 0:
        return reply(unique, GETXATTR_OUT.pack(len(value)))
    if len(value) > requested:
        return reply_error(unique, errno.ERANGE)
    return reply(unique, value)


@dataclass(slots=True)
class DirEntry:
    """One READDIRPLUS entry. `off` is the cookie the kernel passes back to continue after it.

    Every entry but "." and ".." counts as a LOOKUP of `attr.ino` (the kernel takes a
    reference it will FORGET); those two go out with nodeid 0, which takes none.
    """

    name: bytes
    off: int
    attr: Attr


def pack_direntplus(entries, size: int, *, entry_valid_ns: int, attr_valid_ns: int) -> tuple[bytes, int]:
    """Pack entries into one READDIRPLUS reply body of at most `size` bytes.

    Returns the body and how many entries it holds; the entries that did not fit took no
    reference and are the next request's. A name with "/" or NUL, or longer than
    NAME_MAX, is a ValueError (the kernel would fail the whole listing with EIO).
    """
    out = bytearray()
    count = 0
    for entry in entries:
        name, attr = entry.name, entry.attr
        if not name or len(name) > NAME_MAX or b"/" in name or b"\0" in name:
            raise ValueError(f"FUSE dirent: bad name {name!r}")
        record = dirent_align(DIRENTPLUS_NAME_OFFSET + len(name))
        if len(out) + record > size:
            break
        if name in (b".", b".."):
            entry_out = _entry_values(0, None, 0, 0, 0)
        else:
            entry_out = _entry_values(attr.ino, attr, entry_valid_ns, attr_valid_ns, 0)
        out += DIRENTPLUS.pack(*entry_out, attr.ino, entry.off, len(name), statmod.S_IFMT(attr.mode) >> 12)
        out += name
        out += bytes(record - DIRENTPLUS_NAME_OFFSET - len(name))
        count += 1
    return bytes(out), count


# --- notifications (unique 0, error = the notify code) --------------------------------------------


def _notify(code: NotifyCode, body: bytes = b"") -> bytes:
    return OUT_HEADER.pack(OUT_HEADER_SIZE + len(body), int(code), 0) + body


def notify_inval_inode(ino: int, off: int = -1, length: int = 0) -> bytes:
    """Drop the kernel's cached attributes of `ino`, and its cached pages from `off` on
    (`length` 0: to the end) unless `off` is negative (attributes only)."""
    return _notify(NotifyCode.INVAL_INODE, NOTIFY_INVAL_INODE_OUT.pack(ino, off, length))


def notify_inval_entry(parent: int, name: bytes, flags: int = 0) -> bytes:
    """Drop the kernel's cached lookup of `name` in directory `parent` (the name with its NUL)."""
    if not name or len(name) > NAME_MAX or b"\0" in name:
        raise ValueError(f"FUSE notify: bad name {name!r}")
    return _notify(NotifyCode.INVAL_ENTRY, NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), flags) + name + b"\0")


def notify_store(ino: int, off: int, parts: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """Put these bytes (the parts, in order) into the kernel's page cache of `ino` at
    `off`, as if a READ had brought them: the message's parts, for one writev. The
    kernel holds only whole pages: a part page at either end is kept only when it ends
    at the file's end, and bytes past the end would grow the file (the caller's to
    avoid). ENOENT when the kernel does not hold the inode (nothing looked it up)."""
    n = sum(len(part) for part in parts)
    head = OUT_HEADER.pack(OUT_HEADER_SIZE + NOTIFY_STORE_OUT.size + n, int(NotifyCode.STORE), 0)
    return [head + NOTIFY_STORE_OUT.pack(ino, off, n), *parts]


def notify_resend() -> bytes:
    """Ask the kernel to send again every request it sent and has no reply for.

    What a server that takes over a session writes first: the requests its predecessor
    read and never answered come again, with FUSE_UNIQUE_RESEND in their unique. Only for
    `Negotiated.has_resend`; older kernels refuse the write with EINVAL.
    """
    return _notify(NotifyCode.RESEND)
