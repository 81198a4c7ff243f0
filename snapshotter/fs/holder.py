"""The holder of the layer file system's /dev/fuse descriptor: a tiny process that does
nothing else, so that a crash (or kill -9, or an upgrade) of shoal-fs, of shoal node, or
of both, does not close the FUSE connection every lazy mount lives on.

    ROOT/fs-holder.sock   SOCK_SEQPACKET, 0600 in the 0700 ROOT, peers of our uid alone
                          (SO_PEERCRED): one JSON message per request, one per answer

    {"op": "ping"}                        -> {"pid", "holding": bool}
    {"op": "put", "state": {...}} + 1 fd  -> {}   keep this descriptor (a dup of the
                                                   server's) and state, replacing any held
    {"op": "get"}                         -> {"state": {...} | null} (+ 1 fd when held):
                                                   a new descriptor of the same open file
    {"op": "drop"}                        -> {}   close it and exit (the mount is gone
                                                   for good: a stop, not a restart)

`state` is what the next server needs to take over without an INIT: {"mnt": the mount
point, "negotiated": protocol.Negotiated.to_json() as text}. The holder never reads or
writes the descriptor; it polls it for POLLERR alone, which the kernel reports once the
connection is aborted (the mount is gone and nothing else uses it): it then closes it
and exits. It exits too on SIGTERM (the descriptor closes with it: if no server holds
one either, the kernel ends the connection and the mount's readers get ENOTCONN).

Client side (shoal-fs, any thread): `get`, `put`, `drop`; `put` starts the holder when
none answers. Errors: OSError when the holder cannot be reached (get: None instead),
ShoalError when it answers an error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

from shoal.errors import ShoalError
from shoal.fsutil import PRIVATE_UMASK, private_dir

log = logging.getLogger("shoal.fs.holder")

SOCKET_NAME = "fs-holder.sock"  # ROOT/fs-holder.sock
MAX_MESSAGE = 1 << 16


def socket_path(root: str) -> str:
    return os.path.join(root, SOCKET_NAME)


# --- client ------------------------------------------------------------------------------------


def _call(root: str, request: dict, fds: tuple[int, ...] = (), timeout: float = 10.0) -> tuple[dict, list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        sock.connect(socket_path(root))
        socket.send_fds(sock, [json.dumps(request).encode()], list(fds))
        data, got, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
    for fd in got:
        os.set_inheritable(fd, False)
    try:
        answer = json.loads(data) if data else {"ok": False, "error": "closed the connection"}
        if not isinstance(answer, dict) or not answer.get("ok"):
            raise ShoalError(f"descriptor holder: {request.get('op')}: {answer.get('error')}")
    except (ValueError, ShoalError):
        for fd in got:
            os.close(fd)
        raise
    return answer, got


def ping(root: str) -> dict | None:
    try:
        return _call(root, {"op": "ping"}, timeout=2.0)[0]
    except (OSError, ShoalError):
        return None


def get(root: str) -> tuple[int, dict] | None:
    """The held descriptor (a new one, ours to close) and its state, or None (no holder,
    or it holds nothing)."""
    try:
        answer, fds = _call(root, {"op": "get"})
    except (OSError, ShoalError) as e:
        if not isinstance(e, (FileNotFoundError, ConnectionRefusedError)):
            log.warning("descriptor holder: %s", e)
        return None
    if not fds or not isinstance(answer.get("state"), dict):
        for fd in fds:
            os.close(fd)
        return None
    return fds[0], answer["state"]


def put(root: str, fd: int, state: dict, log_path: str | None = None) -> int:
    """Have the holder keep `fd` (it gets its own copy) and `state`; starts it first when
    none answers. The holder's pid."""
    ensure(root, log_path)
    _call(root, {"op": "put", "state": state}, (fd,))
    return int((ping(root) or {}).get("pid", 0))


def ensure(root: str, log_path: str | None = None) -> None:
    """Have a holder for ROOT running (starting one when none answers)."""
    if ping(root) is None:
        start(root, log_path)


def drop(root: str) -> None:
    """Have the holder close what it holds and exit (nothing when none runs)."""
    try:
        _call(root, {"op": "drop"})
    except OSError:
        pass  # none runs, or it exited meanwhile (the connection ended: it had nothing to hold)


def start(root: str, log_path: str | None = None, timeout: float = 10.0) -> None:
    """Start a holder for ROOT in a session of its own (it outlives its starter)."""
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - handed to the child
    try:
        subprocess.Popen([sys.executable, "-m", "snapshotter.fs.holder", "--root", root],
                         stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                         close_fds=True)
    finally:
        if log_path:
            out.close()  # type: ignore[union-attr]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ping(root) is not None:
            return
        time.sleep(0.02)
    raise ShoalError(f"the descriptor holder did not start within {timeout:.0f}s")


# --- the holder ------------------------------------------------------------------------------------


class Holder:
    def __init__(self, root: str):
        self.root = root
        self.fd = -1
        self.state: dict | None = None
        path = socket_path(root)
        if os.path.exists(path):
            os.unlink(path)  # left by a holder that died
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.sock.bind(path)
        os.chmod(path, 0o600)
        self.sock.listen(16)

    def serve(self) -> None:
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN)
        while True:
            for fd, events in poller.poll():
                if fd == self.sock.fileno():
                    conn, _ = self.sock.accept()
                    with conn:
                        before = self.fd
                        done = self.answer(conn)
                    if before != self.fd:
                        if before >= 0:
                            poller.unregister(before)
                        if self.fd >= 0:
                            poller.register(self.fd, 0)  # POLLERR and POLLHUP alone: never read it
                    if done:
                        return
                elif fd == self.fd and events & (select.POLLERR | select.POLLHUP | select.POLLNVAL):
                    log.info("the FUSE connection of %s ended: nothing to hold", (self.state or {}).get("mnt"))
                    return

    def answer(self, conn: socket.socket) -> bool:
        """Answer one request; True when the holder is to exit."""
        conn.settimeout(5.0)
        try:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
        except OSError as e:
            log.warning("request: %s", e)
            return False
        try:
            if uid != os.getuid():
                raise ShoalError(f"uid {uid} may not use the holder")
            request = json.loads(data)
            if not isinstance(request, dict):
                raise ShoalError("a request is a JSON object")
            op = request.get("op")
            reply: dict = {"ok": True}
            send: list[int] = []
            done = False
            if op == "ping":
                reply.update(pid=os.getpid(), holding=self.fd >= 0)
            elif op == "put":
                state = request.get("state")
                if len(fds) != 1 or not isinstance(state, dict):
                    raise ShoalError("put needs one descriptor and a state object")
                self._close()
                self.fd, self.state = fds.pop(), state
                log.info("holding the FUSE connection of %s", state.get("mnt"))
            elif op == "get":
                reply["state"] = self.state if self.fd >= 0 else None
                send = [self.fd] if self.fd >= 0 else []
            elif op == "drop":
                log.info("dropping the FUSE connection of %s", (self.state or {}).get("mnt"))
                self._close()
                done = True
            else:
                raise ShoalError(f"unknown op {op!r}")
        except (ValueError, ShoalError) as e:
            reply, send, done = {"ok": False, "error": str(e)}, [], False
        finally:
            for fd in fds:
                os.close(fd)
        try:
            socket.send_fds(conn, [json.dumps(reply).encode()], send)
        except OSError as e:
            log.warning("answer: %s", e)
        return done

    def _close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
        self.fd, self.state = -1, None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shoal-fs-holder", description="holds the layer file system's FUSE connection")
    ap.add_argument("--root", required=True)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s shoal-fs-holder %(levelname)s %(message)s",
                        stream=sys.stderr)
    os.umask(PRIVATE_UMASK)
    root = os.path.abspath(args.root)
    private_dir(root)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        holder = Holder(root)
    except OSError as e:
        log.error("cannot listen on %s: %s", socket_path(root), e)
        return 1
    log.info("descriptor holder for %s (pid %d)", root, os.getpid())
    try:
        holder.serve()
    finally:
        holder.sock.close()
        if os.path.exists(socket_path(root)):
            os.unlink(socket_path(root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
