"""containerd.services.snapshots.v1.Snapshots on a unix socket: the proxy-plugin edge.

containerd connects as a client (`[proxy_plugins.NAME] type = "snapshot"`), sends the
plugin's NAME in every request's `snapshotter` field (ignored: one node serves one
snapshotter, whatever the operator calls it) and reconnects by itself when the socket
comes back after a restart. Every RPC becomes one Snapshotter call on a worker thread;
wire types and error codes are wire.py's business.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from shoal.errors import ShoalError
from snapshotter import wire
from snapshotter.snapshotter import Snapshotter

log = logging.getLogger("shoal.snapshotter.grpc")

# containerd's default maximum message sizes (defaults.DefaultMaxRecvMsgSize/SendMsgSize)
MAX_MESSAGE = 16 << 20


def _behaviour(sn: Snapshotter, method: wire.Method):
    def abort(context: grpc.ServicerContext, exc: BaseException, started: float):
        code, message = wire.error_status(exc)
        if code != grpc.StatusCode.UNKNOWN:  # the protocol's own answers (AlreadyExists for remote layers)
            log.debug("%s -> %s: %s (%.1f ms)", method.name, code.name, message, (time.monotonic() - started) * 1e3)
        elif isinstance(exc, (ShoalError, OSError)):
            log.warning("%s failed: %s", method.name, message)
        else:
            log.exception("%s failed unexpectedly", method.name)
        context.abort(code, message)

    if method.streaming:
        def stream(request, context):
            started = time.monotonic()
            try:
                responses = list(method.encode(method.call(sn, request)))
            except Exception as e:  # noqa: BLE001 (every failure becomes a gRPC status)
                abort(context, e, started)
            log.debug("%s ok (%.1f ms)", method.name, (time.monotonic() - started) * 1e3)
            yield from responses
        return grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=method.request.FromString,
            response_serializer=method.response.SerializeToString,
        )

    def unary(request, context):
        started = time.monotonic()
        try:
            response = method.encode(method.call(sn, request))
        except Exception as e:  # noqa: BLE001 (every failure becomes a gRPC status)
            abort(context, e, started)
        log.debug("%s ok (%.1f ms)", method.name, (time.monotonic() - started) * 1e3)
        return response
    return grpc.unary_unary_rpc_method_handler(
        unary, request_deserializer=method.request.FromString,
        response_serializer=method.response.SerializeToString,
    )


def service_handler(sn: Snapshotter) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        wire.SERVICE, {m.name: _behaviour(sn, m) for m in wire.METHODS},
    )


def remove_stale_socket(path: Path) -> None:
    """Remove a socket left by a daemon that died; refuse if one still answers on it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ShoalError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1)
        probe.connect(str(path))
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ShoalError(f"{path}: cannot tell whether the socket is in use: {e.strerror}") from None
    else:
        raise ShoalError(f"{path}: another process is serving on this socket (another shoal node?)")
    finally:
        probe.close()
    os.unlink(path)
    log.info("removed stale socket %s", path)


def listen_private(server: grpc.Server, path: Path) -> None:
    """`server` to listen on the unix socket `path`, mode 0600 from its creation (its
    clients, containerd and the kubelet, run as root); its directory is made 0700 if
    missing, a stale socket is removed (remove_stale_socket). ShoalError if it cannot."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True)
    remove_stale_socket(path)
    old = os.umask(0o177)
    try:
        port = server.add_insecure_port(f"unix:{path}")
    except RuntimeError as e:
        raise ShoalError(f"cannot listen on {path}: {e}") from None
    finally:
        os.umask(old)
    if port == 0:
        raise ShoalError(f"cannot listen on {path}")
    os.chmod(path, 0o600)


class PrivateServer:
    """A gRPC server with `handlers` on one unix socket, mode 0600 (listen_private).
    start() / stop(grace); `what` names it in the log."""

    def __init__(self, socket_path: str | Path, handlers: list, what: str, threads: int = 16,
                 thread_prefix: str = "grpc") -> None:
        self.socket_path = Path(os.path.abspath(socket_path))
        if len(os.fsencode(self.socket_path)) > 107:
            raise ShoalError(f"socket path {self.socket_path} is longer than a unix socket allows (107 bytes)")
        self.what = what
        self._server = grpc.server(
            ThreadPoolExecutor(max_workers=threads, thread_name_prefix=thread_prefix),
            handlers=handlers,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE),
                ("grpc.max_send_message_length", MAX_MESSAGE),
                ("grpc.so_reuseport", 0),
            ],
        )
        self._started = False

    def start(self) -> None:
        listen_private(self._server, self.socket_path)
        self._server.start()
        self._started = True
        log.info("serving %s on %s", self.what, self.socket_path)

    def stop(self, grace: float = 5.0) -> None:
        """Stop accepting calls, let running ones finish for `grace` seconds, remove the
        socket file."""
        if not self._started:
            return
        self._started = False
        self._server.stop(grace).wait()
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass


class SnapshotsServer(PrivateServer):
    """The gRPC server for one Snapshotter on one unix socket (mode 0600)."""

    def __init__(self, sn: Snapshotter, socket_path: str | Path, threads: int = 16) -> None:
        super().__init__(socket_path, [service_handler(sn)], "containerd snapshots API", threads, "snapshots")


def socket_answers(path: str, timeout: float) -> bool:
    """Whether a gRPC server answers on the unix socket `path` within `timeout` seconds
    (an HTTP/2 handshake, not only a connect: a socket file left by a dead node refuses)."""
    if not os.path.exists(path):
        return False
    channel = grpc.insecure_channel(f"unix:{path}")
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout)
        return True
    except grpc.FutureTimeoutError:
        return False
    finally:
        channel.close()
