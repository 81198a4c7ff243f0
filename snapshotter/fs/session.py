"""One FUSE session over /dev/fuse: mount it, read its requests on threads, write answers.

The I/O half of shoal's own FUSE request loop (snapshotter/fs/protocol.py is the other,
sans-I/O half). A `Session` owns one descriptor of a /dev/fuse connection:

- `Session.mount(mnt)` opens /dev/fuse and mounts it with mount(2) and `fd=N` (what
  fusermount does for libfuse, done here directly: shoal-fs runs as root);
- `Session(fd, negotiated)` takes over a connection whose INIT a previous process
  answered (the descriptor comes from the holder, snapshotter/fs/holder.py); `serve`
  then writes FUSE_NOTIFY_RESEND first, so the requests that process had read and not
  answered come again. On a kernel without it (before Linux 6.9), `serve` answers EIO
  to exactly those requests instead, found in the predecessor's `InFlight` table
  (below), so that no caller waits for an answer that would never come.

The in-flight table (`InFlight`, a small file under the node's root, 0600, mmap'd
MAP_SHARED): what this process has read from /dev/fuse and not answered, where a
kill -9 cannot lose it (the page cache keeps a dead process's stores). Each reader
thread's read buffer *is* its slot: the kernel's read(2) copies the request, header and
unique included, straight into the mapping (no window between the read and the record),
and the reader zeroes the unique once the reply is written (one store). A READ handed
to a worker thread takes a slot of a fixed table (`defer`: two stores) that the worker
frees after its reply (`reply(buffers, token)`). A stale unique (a crash between a
reply and the store that clears it) is harmless: uniques are never reused on a
connection, and the kernel answers a reply to one it no longer waits for with ENOENT.

Threads: `serve(handler)` starts `threads` reader threads, each doing blocking read(2)s
of /dev/fuse (the kernel hands each request to one reader) and calling
`handler(request)`, which returns the reply bytes (a list of buffers for writev), or
None when it answers later itself through `reply` (a READ that waits for the network
goes to a worker pool so the readers stay free). A message that does not parse is
logged and answered EIO when its header can be read. The readers end when the
connection ends (ENODEV: unmounted or aborted); `wait()` returns then.

Errors: `write`/`reply` return False when the kernel no longer wants the answer
(ENOENT: the request was interrupted or the connection aborted), raise nothing else but
OSError for a bug (a malformed reply is EINVAL). Notifications about inodes the kernel
does not hold (ENOENT) are not errors either.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence

from snapshotter.fs import protocol as p

log = logging.getLogger("shoal.fs")

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2
MAX_WRITE = 4096  # a read-only file system takes no WRITE: the smallest read buffer the kernel accepts
# One reader thread: the requests it answers itself (metadata, reads from memory) are all
# Python under the GIL, so more readers add no parallelism, only GIL handoffs between them
# (measured with 8: ~11 futex calls and ~1.5x the CPU per READ; bench/fs_read.py).
# Whatever waits (the store, the network) goes to the server's worker threads.
READER_THREADS = 1
DEFERRED_SLOTS = 4096  # requests waiting for a worker at once (READs, first OPENs) that the in-flight table records
# A test and diagnostic knob: "1" makes shoal-fs act as on a kernel without
# FUSE_NOTIFY_RESEND (INIT's FUSE_HAS_RESEND ignored; a takeover answers EIO instead).
NO_RESEND_ENV = "SHOAL_FUSE_NO_RESEND"
# Requests that take no reply: a record of one is never answered.
_NO_REPLY = frozenset({p.Opcode.FORGET, p.Opcode.BATCH_FORGET, p.Opcode.INTERRUPT})

Buffers = Sequence[bytes | memoryview]  # one message's parts, for writev
Reply = Buffers | None
Handler = Callable[[p.Request], Reply]

_libc = ctypes.CDLL(None, use_errno=True)


def mount_fd(fd: int, mnt: str, fsname: str = "shoal", subtype: str = "shoal") -> None:
    """mount(2) a FUSE file system served through `fd` at `mnt`: read-only, nosuid, nodev,
    for every user (allow_other) with the kernel checking permissions (default_permissions).
    OSError when the kernel refuses."""
    opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other,default_permissions"
    if _libc.mount(fsname.encode(), os.fsencode(mnt), f"fuse.{subtype}".encode(),
                   MS_RDONLY | MS_NOSUID | MS_NODEV, opts.encode()) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount: {os.strerror(e)}", mnt)


def no_resend() -> bool:
    """The NO_RESEND_ENV knob is set: act as on a kernel without FUSE_NOTIFY_RESEND."""
    return os.environ.get(NO_RESEND_ENV) == "1"


_RECORD_U64S = {1: 2, 2: 3}  # u64s per deferred record of an in-flight table, by version


class InFlight:
    """The requests a session's process has read and not answered (module docstring).

    Layout of the file (little-endian): a 32-byte header (magic, version, readers,
    buffer size, slots), then `readers` read buffers of `buffer_size` bytes (a request as
    the kernel wrote it: its fuse_in_header's unique at offset 8, 0 once answered), then
    `slots` records of (unique, nodeid, opcode) u64 triples for requests handed to workers
    (unique 0: free). Version 1 (a predecessor before OPENs were handed on) had (unique,
    nodeid) pairs, all READs: pending() reads both. `path` None: an anonymous table (nothing survives the process).

    Threads: reader `i` alone uses buffer `i`; `defer`/`done` from any thread (the free
    list's pop/append are atomic under the GIL). Nothing here raises on the hot path.
    """

    MAGIC = b"shoalinf"
    VERSION = 2
    HEADER = struct.Struct("<8sIIII8x")

    def __init__(self, path: str | None, readers: int, buffer_size: int, slots: int = DEFERRED_SLOTS):
        self.path, self.readers, self.buffer_size, self.slots = path, readers, buffer_size, slots
        self._slots_at = self.HEADER.size + readers * buffer_size
        size = self._slots_at + 24 * slots
        if path is None:
            self._map: mmap.mmap | bytearray = bytearray(size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            try:
                os.fchmod(fd, 0o600)
                os.ftruncate(fd, size)
                self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        view = memoryview(self._map)
        self.HEADER.pack_into(view, 0, self.MAGIC, self.VERSION, readers, buffer_size, slots)
        self._buffers = [view[self.HEADER.size + i * buffer_size:self.HEADER.size + (i + 1) * buffer_size]
                         for i in range(readers)]
        # each buffer's unique as one u64 (the reader's one store once it has answered)
        self._uniques = [b[8:16].cast("Q") for b in self._buffers]
        self._deferred = view[self._slots_at:].cast("Q")
        self._free = list(range(slots - 1, -1, -1))
        self.overflow = 0  # deferred READs not recorded: the table was full

    def buffer(self, reader: int) -> memoryview:
        return self._buffers[reader]

    def answered(self, reader: int) -> None:
        """Reader `reader`'s request is answered (or handed on with `defer`)."""
        self._uniques[reader][0] = 0

    def defer(self, unique: int, nodeid: int, opcode: int = p.Opcode.READ) -> int:
        """Record a request answered later by another thread: the token for `done` (-1
        when the table is full: that request is not recorded)."""
        try:
            slot = self._free.pop()
        except IndexError:
            self.overflow += 1
            return -1
        self._deferred[3 * slot + 1] = nodeid
        self._deferred[3 * slot + 2] = opcode
        self._deferred[3 * slot] = unique  # (last: a record with a unique is whole)
        return slot

    def done(self, token: int) -> None:
        if token >= 0:
            self._deferred[3 * token] = 0
            self._free.append(token)

    def busy(self) -> int:
        """How many requests are recorded now (read and not answered)."""
        return sum(1 for u in self._uniques if u[0]) + sum(
            1 for i in range(0, 3 * self.slots, 3) if self._deferred[i])

    @classmethod
    def pending(cls, path: str) -> list[tuple[int, int, int]]:
        """What the table at `path` (a dead predecessor's) records: (unique, opcode,
        nodeid) of every request read and not answered, each once; [] when there is no
        table or it is not one."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return []
        if len(data) < cls.HEADER.size:
            return []
        magic, version, readers, size, slots = cls.HEADER.unpack_from(data)
        record = _RECORD_U64S.get(version, 0) if magic == cls.MAGIC else 0
        if not record or size < p.IN_HEADER_SIZE or (
                len(data) < cls.HEADER.size + readers * size + 8 * record * slots):
            log.warning("%s is not an in-flight table: ignored", path)
            return []
        found: dict[int, tuple[int, int, int]] = {}
        for i in range(readers):
            h = p.IN_HEADER.struct.unpack_from(data, cls.HEADER.size + i * size)
            unique, opcode, nodeid = h[2], h[1], h[3]
            if unique and opcode not in _NO_REPLY:
                found.setdefault(unique, (unique, opcode, nodeid))
        at = cls.HEADER.size + readers * size
        for unique, nodeid, *opcode in struct.iter_unpack("<" + "Q" * record, data[at:at + 8 * record * slots]):
            if unique:
                found.setdefault(unique, (unique, opcode[0] if opcode else int(p.Opcode.READ), nodeid))
        return sorted(found.values())


def unmount(mnt: str) -> bool:
    """Detach the mount at `mnt` (lazily: files open on it keep working until closed).
    False when there was nothing to unmount or the kernel refused."""
    return _libc.umount2(os.fsencode(mnt), MNT_DETACH) == 0


class Session:
    """One /dev/fuse connection this process serves (see the module docstring).

    `inflight`: the path of this session's in-flight table (a takeover reads the
    predecessor's there first, then writes its own), None for an anonymous one.
    `describe(nodeid)`: what a log line calls an inode (its layer), for the EIO answers
    of a takeover without resend.
    """

    def __init__(self, fd: int, negotiated: p.Negotiated | None = None, inflight: str | None = None,
                 name: str = "", describe: Callable[[int], str] | None = None):
        self.fd = fd
        self.negotiated = negotiated
        self.took_over = negotiated is not None
        self.inflight_path = inflight
        self.name = name  # the mount point, for log lines
        self.describe = describe
        self.ready = threading.Event()  # INIT answered (set at once for a takeover)
        if negotiated is not None:
            self.ready.set()
        self.on_init: Callable[[p.Negotiated], None] | None = None
        self.threads: list[threading.Thread] = []
        self.resent = 0  # requests the kernel sent again after our NOTIFY_RESEND
        self.failed_at_takeover = 0  # requests in flight at the takeover answered EIO (no resend)
        self.table: InFlight | None = None  # set by serve
        self.stopping = False  # stop_reading: readers read no more requests
        self.want = p.DEFAULT_FLAGS  # the INIT flags this server asks for (a new mount's)
        self._done = threading.Event()

    @classmethod
    def mount(cls, mnt: str, inflight: str | None = None) -> Session:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        try:
            mount_fd(fd, mnt)
        except OSError:
            os.close(fd)
            raise
        return cls(fd, inflight=inflight, name=mnt)

    @property
    def has_resend(self) -> bool:
        """The session's kernel takes FUSE_NOTIFY_RESEND (and the NO_RESEND_ENV knob is off)."""
        return self.negotiated is not None and self.negotiated.has_resend and not no_resend()

    # --- writing

    def write(self, buffers: Buffers) -> bool:
        """Write one message (the buffers are its parts, for writev). False when the
        kernel no longer waits for it (ENOENT)."""
        try:
            if len(buffers) == 1:
                os.write(self.fd, buffers[0])
            else:
                os.writev(self.fd, buffers)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENODEV):
                return False
            raise
        return True

    def defer(self, unique: int, nodeid: int, opcode: int = p.Opcode.READ) -> int:
        """A handler answers this request (`opcode`) later from another thread: record it
        (the token goes to `reply`). Call before handing the request on."""
        table = self.table
        return table.defer(unique, nodeid, opcode) if table is not None else -1

    def reply(self, buffers: Buffers, token: int = -1) -> bool:
        """The reply to a request deferred with `defer` (its token), from any thread."""
        try:
            return self.write(buffers)
        finally:
            if self.table is not None:
                self.table.done(token)

    def notify(self, message: bytes | Buffers) -> bool:
        """A notification (protocol.notify_*: one message, or its parts); False when the
        kernel does not hold the inode or entry (ENOENT), or the connection is gone. Not
        from a request's handler for INVAL_ENTRY (the kernel may wait on a lock that
        request holds)."""
        try:
            return self.write([message] if isinstance(message, bytes) else message)
        except OSError as e:
            log.warning("FUSE notification refused: %s", e)
            return False

    # --- reading

    def serve(self, handler: Handler, threads: int = READER_THREADS) -> None:
        """Start the reader threads: after a takeover, first NOTIFY_RESEND, or on a
        kernel without it EIO to each request the predecessor's table records."""
        if self.took_over and self.negotiated is not None:
            if self.has_resend:
                self.notify(p.notify_resend())
            else:
                self.fail_inflight()
        size = self.negotiated.read_buffer_size if self.negotiated else max(p.MIN_READ_BUFFER, MAX_WRITE + 4096)
        self.table = InFlight(self.inflight_path, threads, size)
        for i in range(threads):
            t = threading.Thread(target=self._read_loop, args=(handler, i), name=f"shoal-fuse-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    def fail_inflight(self) -> int:
        """Answer EIO to every request the predecessor's in-flight table records (a
        takeover on a kernel without NOTIFY_RESEND: none of them would be sent again).
        Logs one line naming the mount, the layers and the count; returns the count
        the kernel took (a reply to a unique it no longer waits on is ENOENT: debug)."""
        if self.inflight_path is None:
            log.warning("this kernel has no FUSE_NOTIFY_RESEND and %s has no in-flight table: requests in "
                        "flight at the takeover stay unanswered", self.name or "the session")
            return 0
        answered: dict[str, int] = {}
        for unique, opcode, nodeid in InFlight.pending(self.inflight_path):
            try:
                took = self.write([p.reply_error(unique, errno.EIO)])
            except OSError as e:
                took = False
                log.debug("EIO to request %#x refused: %s", unique, e)
            if not took:
                log.debug("request %#x (opcode %d) was answered already", unique, opcode)
                continue
            what = self.describe(nodeid) if self.describe is not None else f"nodeid {nodeid:#x}"
            key = f"{_opname(opcode)} of {what}"
            answered[key] = answered.get(key, 0) + 1
        self.failed_at_takeover = sum(answered.values())
        log.warning("takeover of %s on a kernel without FUSE_NOTIFY_RESEND: %d requests in flight at the "
                    "takeover answered EIO%s", self.name or "the session", self.failed_at_takeover,
                    (": " + ", ".join(f"{k} x{n}" for k, n in sorted(answered.items()))) if answered else "")
        return self.failed_at_takeover

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the connection ends (every reader has seen ENODEV)."""
        return self._done.wait(timeout)

    def stop_reading(self, wake: Callable[[], object], deadline: float) -> bool:
        """Let each reader answer the request it has and read no other (a handover on a
        kernel without NOTIFY_RESEND: a request this process reads and cannot answer
        before it exits, the next server could only answer EIO; one it leaves unread,
        the next server reads and answers). A reader blocked in read(2) sees this only
        with its next request: `wake` sends one to the mount (a GETXATTR of its root),
        again until every reader has stopped. True when they all have by `deadline`."""
        self.stopping = True

        def poke() -> None:  # (daemon: a wake no reader takes is left to the next server)
            while any(t.is_alive() for t in self.threads) and time.monotonic() < deadline:
                wake()
                time.sleep(0.001)  # (a wake that fails at once must not spin)

        threading.Thread(target=poke, name="shoal-fuse-wake", daemon=True).start()
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return not any(t.is_alive() for t in self.threads)

    def _read_loop(self, handler: Handler, index: int) -> None:
        table = self.table
        assert table is not None
        buf = table.buffer(index)  # the kernel writes each request here: the record of it
        fd = self.fd
        while True:
            try:
                n = os.readv(fd, (buf,))
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):  # ENOENT: an interrupted request
                    continue
                if e.errno == errno.ENODEV:  # unmounted or aborted
                    self._done.set()
                    return
                log.error("reading /dev/fuse: %s", e)
                self._done.set()
                return
            data = buf[:n]
            try:
                out = self._handle(handler, data)
            except Exception:
                log.exception("FUSE request handler failed")
                out = None
                try:
                    out = [p.reply_error(p.parse_header(data).unique, errno.EIO)]
                except p.ProtocolError:
                    pass
            if out:
                try:
                    self.write(out)
                except OSError as e:
                    log.error("FUSE reply refused: %s", e)
            table.answered(index)
            if self.stopping:  # (stop_reading: what comes next is the next server's)
                return

    def _handle(self, handler: Handler, data: memoryview) -> Reply:
        try:
            req = p.parse_request(data)
        except p.ProtocolError as e:
            log.error("%s", e)
            h = p.parse_header(data)  # (parse_request read it: a ProtocolError here came later)
            return [p.reply_error(h.unique, errno.EIO)]
        if req.header.resent:
            self.resent += 1
        if isinstance(req, p.Init):
            if no_resend():  # the test knob: as if the kernel had not offered it
                req = dataclasses.replace(req, flags=req.flags & ~p.FUSE_HAS_RESEND)
            try:
                self.negotiated = p.negotiate(req, want=self.want, max_write=MAX_WRITE)
            except p.ProtocolError as e:
                log.error("%s", e)
                return [p.reply_error(req.header.unique, errno.EPROTO)]
            out = [p.reply_init(req.header.unique, self.negotiated)]
            self.write(out)
            self.ready.set()
            if self.on_init is not None:
                self.on_init(self.negotiated)
            return None
        return handler(req)


def _opname(opcode: int) -> str:
    try:
        return p.Opcode(opcode).name
    except ValueError:
        return f"opcode {opcode}"
