"""The control sockets' JSON-lines calls (shoal/localrpc.py): a server slow to accept is
waited for, not taken for gone."""

from __future__ import annotations

import socket
import threading

import pytest

from shoal import localrpc


def test_a_call_waits_while_the_servers_backlog_is_full(tmp_path):
    """A unix socket whose listen backlog is full refuses a connection at once (EAGAIN),
    however long the caller would wait: on a loaded node the layer file system's accept
    thread can fall that far behind. The call waits for a place in the queue within its
    timeout (before: BlockingIOError at once, which the node's supervisor took for a dead
    server); past the timeout it fails with TimeoutError."""
    path = str(tmp_path / "s.sock")
    server = localrpc.Server(path, lambda request: {"echo": request["op"]})
    held = []
    try:
        while True:  # fill the backlog: nothing accepts yet
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect(path)
            except BlockingIOError:
                s.close()
                break
            held.append(s)
        with pytest.raises(TimeoutError, match="accepted no connection"):
            localrpc.call(path, {"op": "late"}, timeout=0.3)
        answers: list = []
        caller = threading.Thread(target=lambda: answers.append(localrpc.call(path, {"op": "ping"}, timeout=30)))
        caller.start()
        caller.join(0.5)
        assert caller.is_alive() and not answers  # waiting in line, not failed
        for s in held:  # the queue drains once the server accepts
            s.close()
        server.start()
        caller.join(30)
        assert answers == [{"ok": True, "echo": "ping"}]
    finally:
        for s in held:
            s.close()
        server.close()
