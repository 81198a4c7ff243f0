"""The node's local control sockets (the layer file system's ROOT/fs.sock, the swarm's
ROOT/swarm.sock): one JSON request per line on a unix socket, one JSON answer per line,
`{"ok": true, ...}` or `{"ok": false, "error": "..."}`. This is the client side."""

from __future__ import annotations

import json
import socket

from shoal.errors import ShoalError


def call(path: str, request: dict, timeout: float = 60.0, what: str = "") -> dict:
    """Send one request; the answer, or ShoalError naming `what` (default: the socket)."""
    what = what or path
    op = request.get("op")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
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
