"""The control-socket protocol: one JSON request per line on a unix socket, one JSON
answer per line, `{"ok": true, ...}` or `{"ok": false, "error": "..."}`. Both sides:
`call` (client) and `Server` (a thread per connection; the socket is 0600, so only its
owner reaches it). The node's one control socket, ROOT/fs.sock, speaks it
(snapshotter/fs/control.py lists its ops, the layer file system's and the swarm's);
so does the lab's agent (tests/lab/agent.py)."""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable

from shoal.errors import ShoalError

log = logging.getLogger("shoal.control")


def call(path: str, request: dict, timeout: float = 60.0, what: str = "") -> dict:
    """Send one request; the answer, or ShoalError naming `what` (default: the socket)
    when the server fails it or closes the connection; OSError when the socket cannot be
    reached (TimeoutError when it accepts no connection, or does not answer, in `timeout`)."""
    what = what or path
    op = request.get("op")
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        while True:
            try:
                sock.connect(path)
                break
            except BlockingIOError:  # its backlog is full: the server accepts late, it is not gone
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{what}: {op}: the socket accepted no connection within {timeout:g}s") from None
                time.sleep(0.01)
        sock.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            data = sock.recv(65536)
            if not data:
                raise ShoalError(f"{what} closed the connection during {op}")
            buf += data
    reply = json.loads(buf)
    if not reply.get("ok"):
        raise ShoalError(f"{what}: {op} failed: {reply.get('error')}")
    return reply


class Server:
    """JSON lines on a unix socket, a thread per connection; `handle(request) -> answer`.

    `handle` runs on the connection's thread (requests of one connection one after the
    other). What it raises is answered {"ok": false, "error"}: a ShoalError by its
    message (a one-line message for users), anything else as "Type: message"; an
    exception other than the expected ones (a bug) is logged with its traceback too."""

    def __init__(self, path: str, handle: Callable[[dict], dict]) -> None:
        self.path, self.handle = path, handle
        if os.path.exists(path):
            os.unlink(path)  # left by a process that died
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        os.chmod(path, 0o600)
        self._sock.listen(64)

    def start(self) -> Server:
        threading.Thread(target=self.serve_forever, name="shoal-control", daemon=True).start()
        return self

    def serve_forever(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def close(self) -> None:
        self._sock.close()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as fh:
            for line in fh:
                try:
                    out = {"ok": True, **self.handle(json.loads(line))}
                except ShoalError as exc:
                    out = {"ok": False, "error": str(exc) or type(exc).__name__}
                except (OSError, ValueError, KeyError, StopIteration, TimeoutError) as exc:
                    out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                except Exception as exc:  # answered, and logged: a bug must not kill the socket
                    # (the op's name only: a request may carry a secret, never logged)
                    op = re.search(rb'"op":\s*"(\w{1,40})"', line)
                    log.exception("control: op %s failed unexpectedly", op.group(1).decode() if op else "?")
                    out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                fh.write(json.dumps(out).encode() + b"\n")
                fh.flush()
