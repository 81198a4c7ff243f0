"""One FUSE session over /dev/fuse: mount it, read its requests on threads, write answers.

The I/O half of shoal's own FUSE request loop (snapshotter/fs/protocol.py is the other,
sans-I/O half). A `Session` owns one descriptor of a /dev/fuse connection:

- `Session.mount(mnt)` opens /dev/fuse and mounts it with mount(2) and `fd=N` (what
  fusermount does for libfuse, done here directly: shoal-fs runs as root);
- `Session(fd, negotiated)` takes over a connection whose INIT a previous process
  answered (the descriptor comes from the holder, snapshotter/fs/holder.py); `serve`
  then writes FUSE_NOTIFY_RESEND first, so the requests that process had read and not
  answered come again (on a kernel without it, those requests stay unanswered: their
  callers wait until the connection ends; the requests after the takeover are served).

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
import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence

from snapshotter.fs import protocol as p

log = logging.getLogger("shoal.fs")

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2
MAX_WRITE = 4096  # a read-only file system takes no WRITE: the smallest read buffer the kernel accepts
READER_THREADS = 8

Reply = Sequence[bytes] | None
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


def unmount(mnt: str) -> bool:
    """Detach the mount at `mnt` (lazily: files open on it keep working until closed).
    False when there was nothing to unmount or the kernel refused."""
    return _libc.umount2(os.fsencode(mnt), MNT_DETACH) == 0


class Session:
    """One /dev/fuse connection this process serves (see the module docstring)."""

    def __init__(self, fd: int, negotiated: p.Negotiated | None = None):
        self.fd = fd
        self.negotiated = negotiated
        self.took_over = negotiated is not None
        self.ready = threading.Event()  # INIT answered (set at once for a takeover)
        if negotiated is not None:
            self.ready.set()
        self.on_init: Callable[[p.Negotiated], None] | None = None
        self.threads: list[threading.Thread] = []
        self.resent = 0  # requests the kernel sent again after our NOTIFY_RESEND
        self._done = threading.Event()

    @classmethod
    def mount(cls, mnt: str) -> Session:
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        try:
            mount_fd(fd, mnt)
        except OSError:
            os.close(fd)
            raise
        return cls(fd)

    # --- writing

    def write(self, buffers: Sequence[bytes]) -> bool:
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

    def reply(self, buffers: Sequence[bytes]) -> bool:
        return self.write(buffers)

    def notify(self, message: bytes) -> bool:
        """A notification (protocol.notify_*); False when the kernel does not hold the
        inode or entry (ENOENT), or the connection is gone. Not from a request's handler
        for INVAL_ENTRY (the kernel may wait on a lock that request holds)."""
        try:
            return self.write([message])
        except OSError as e:
            log.warning("FUSE notification refused: %s", e)
            return False

    # --- reading

    def serve(self, handler: Handler, threads: int = READER_THREADS) -> None:
        """Start the reader threads (NOTIFY_RESEND first after a takeover)."""
        if self.took_over and self.negotiated is not None:
            if self.negotiated.has_resend:
                self.notify(p.notify_resend())
            else:
                log.warning("this kernel has no FUSE_NOTIFY_RESEND: the requests in flight at the "
                            "takeover stay unanswered")
        for i in range(threads):
            t = threading.Thread(target=self._read_loop, args=(handler,), name=f"shoal-fuse-{i}", daemon=True)
            t.start()
            self.threads.append(t)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the connection ends (every reader has seen ENODEV)."""
        return self._done.wait(timeout)

    def _read_loop(self, handler: Handler) -> None:
        size = self.negotiated.read_buffer_size if self.negotiated else max(p.MIN_READ_BUFFER, MAX_WRITE + 4096)
        while True:
            try:
                data = os.read(self.fd, size)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR, errno.EAGAIN):  # ENOENT: an interrupted request
                    continue
                if e.errno == errno.ENODEV:  # unmounted or aborted
                    self._done.set()
                    return
                log.error("reading /dev/fuse: %s", e)
                self._done.set()
                return
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

    def _handle(self, handler: Handler, data: bytes) -> Reply:
        try:
            req = p.parse_request(data)
        except p.ProtocolError as e:
            log.error("%s", e)
            h = p.parse_header(data)  # (parse_request read it: a ProtocolError here came later)
            return [p.reply_error(h.unique, errno.EIO)]
        if req.header.resent:
            self.resent += 1
        if isinstance(req, p.Init):
            try:
                self.negotiated = p.negotiate(req, max_write=MAX_WRITE)
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
