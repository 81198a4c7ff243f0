"""`shoal node`: the node daemon that containerd talks to.

Node assembles the pieces: the snapshotter (local.py) with a RemoteLayers provider
plugged into it, and the gRPC server on the socket. Start-up order matters for restarts:
the root is locked, orphans are cleaned and remote layers restored *before* the socket
answers, so containerd never sees a snapshot whose mounts are not back yet.

What a restart keeps: every snapshot (metadata.db); containers keep running, because
containerd (not shoal) mounted their overlays. What it must restore: the remote layers'
mounts (RemoteLayers.restore).

Configuration: a TOML file, every key optional (see NodeConfig); unknown sections or keys
are an error, not silently ignored.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
import tomllib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

from shoal.errors import ShoalError
from snapshotter import DEFAULT_CONTAINERD_ADDRESS
from snapshotter.snapshotter import RemoteLayers

log = logging.getLogger("shoal.node")

DEFAULT_ROOT = "/var/lib/shoal"
DEFAULT_SOCKET = "/run/shoal/snapshotter.sock"


# --- configuration ---------------------------------------------------------------------


@dataclass
class SnapshotterConfig:
    """[snapshotter]"""

    grpc_threads: int = 16  # gRPC worker threads: concurrent snapshotter calls
    shutdown_grace: float = 5.0  # seconds running calls get to finish on SIGTERM


@dataclass
class FetchConfig:
    """[fetch]: where lazy layers' chunks come from, and the node's chunk store."""

    region_url: str = ""  # the region cache (`shoal region`), tried before the origin; "" = none
    plain_http_hosts: list[str] = field(default_factory=list)  # registries reached over HTTP (loopback always is)
    store_capacity: int = 0  # bytes for the chunk store under ROOT/chunks; 0 = 20% of the disk's free space
    memory_cache: int = 512 << 20  # bytes of decompressed chunks kept in memory, shared by all lazy layers
    readahead_kb: int = 1024  # the kernel's read-ahead on lazy layers' files (KiB; FUSE's own default is 128)
    prefetch_profiles: bool = True  # fetch the chunks of an image's published access profile (shoal profile save) at its first prepare
    prove_lazy: bool = True  # read each lazy layer's whole blob in the background and check its diff_id (chainproof.py); false: chain ids are trusted
    prove_after: float = 30.0  # seconds from a lazy layer's prepare to the start of its background proof
    prove_timeout: float = 600.0  # seconds a container's prepare waits for a proof it needs (a chain another image names with another blob)


@dataclass
class ContainerdConfig:
    """[containerd]: the containerd this node serves (the proofs ask it which images name a chain)."""

    address: str = DEFAULT_CONTAINERD_ADDRESS
    snapshotter: str = "shoal"  # this node's name in containerd's [proxy_plugins]


@dataclass
class MetricsConfig:
    """[metrics]: Prometheus text at http://ADDRESS/metrics (bytes by source, swarm peers,
    layers), from the same figures as `shoal status`."""

    address: str = ""  # "HOST:PORT" to serve on (e.g. "127.0.0.1:9464"); "" = off

    def host_port(self) -> tuple[str, int] | None:
        if not self.address:
            return None
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ShoalError(f"metrics.address {self.address!r}: want HOST:PORT, e.g. 127.0.0.1:9464")
        return host.strip("[]"), int(port)


@dataclass
class NodeConfig:
    """The whole `shoal node` configuration file. Each section is a dataclass; add a
    section by adding a field here (the loader below needs nothing more)."""

    snapshotter: SnapshotterConfig = field(default_factory=SnapshotterConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    # [swarm]: the libtorrent swarm (p2p.swarm.SwarmConfig documents and checks its keys
    # when the layer file system starts; `enabled = true` turns it on).
    swarm: dict = field(default_factory=dict)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    containerd: ContainerdConfig = field(default_factory=ContainerdConfig)

    def proofs(self):
        from snapshotter.chainproof import ProofConfig

        return ProofConfig(self.fetch.prove_lazy, self.fetch.prove_after, self.fetch.prove_timeout,
                           self.containerd.address, self.containerd.snapshotter)


def _typed(value: object, hint: object, where: str) -> object:
    if is_dataclass(hint):
        if not isinstance(value, dict):
            raise ShoalError(f"{where}: expected a table")
        return _build(hint, value, where)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in typing.get_args(hint):
            return None
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
        origin = typing.get_origin(hint)
    if origin is list:
        (item,) = typing.get_args(hint) or (object,)
        if not isinstance(value, list):
            raise ShoalError(f"{where}: expected a list")
        return [_typed(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ShoalError(f"{where}: expected a table")
        return dict(value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and (type(value) is not hint):
        raise ShoalError(f"{where}: expected {hint.__name__}, got {type(value).__name__} {value!r}")
    return value


def _build(cls: type, data: dict, where: str) -> object:
    hints = typing.get_type_hints(cls)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ShoalError(
            f"unknown configuration key {prefix}{unknown[0]} (known here: {', '.join(sorted(known))})"
        )
    kwargs = {k: _typed(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def load_config(path: str | Path | None) -> NodeConfig:
    """The configuration in `path` on top of the defaults (no path: the defaults)."""
    if path is None:
        return NodeConfig()
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ShoalError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ShoalError(f"{path}: cannot read the configuration: {e.strerror}") from None
    try:
        config = _build(NodeConfig, data, "")
    except ShoalError as e:
        raise ShoalError(f"{path}: {e}") from None
    if config.snapshotter.grpc_threads < 1:
        raise ShoalError(f"{path}: snapshotter.grpc_threads must be at least 1")
    if config.fetch.prove_after < 0 or config.fetch.prove_timeout <= 0:
        raise ShoalError(f"{path}: fetch.prove_after must be >= 0 and fetch.prove_timeout > 0")
    try:
        config.metrics.host_port()
    except ShoalError as e:
        raise ShoalError(f"{path}: {e}") from None
    return config


# --- the daemon ----------------------------------------------------------------------------


class Node:
    """One node daemon. `remote` is where lazy and pre-unpacked layers come from (the
    FUSE layer system); None serves ordinary overlay snapshots only.

        node = Node(root, socket, config, remote=...)
        node.start(); node.wait(stop_event); node.stop()
    """

    def __init__(
        self, root: str | Path, socket: str | Path, config: NodeConfig | None = None,
        remote: RemoteLayers | None = None,
    ) -> None:
        self.root = Path(os.path.abspath(root))
        self.socket = Path(os.path.abspath(socket))
        self.config = config or NodeConfig()
        self.remote = remote
        self.snapshotter = None
        self._server = None
        self._metrics = None
        self._lock_fd: int | None = None
        self._ready = False

    def start(self) -> None:
        # Imported here: they load gRPC and the protobuf stubs (convert.py sets the
        # protobuf implementation first).
        from snapshotter.grpc_server import SnapshotsServer
        from snapshotter.local import LocalSnapshotter

        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._lock_root()
            self.snapshotter = LocalSnapshotter(self.root, remote=self.remote, proofs=self.config.proofs())
            self.snapshotter.recover()
            if self.remote is not None and hasattr(self.remote, "start"):
                self.remote.start()
            self._server = SnapshotsServer(self.snapshotter, self.socket, self.config.snapshotter.grpc_threads)
            self._server.start()
            address = self.config.metrics.host_port()
            if address is not None:
                self._metrics = _serve_metrics(address, str(self.root))
        except BaseException:
            self.stop()
            raise
        self._ready = True
        log.info("shoal node ready: root %s, socket %s, remote layers %s",
                 self.root, self.socket, "on" if self.remote is not None else "off")

    def wait(self, stop: threading.Event) -> None:
        """Serve until `stop` is set (by a signal handler).

        Wakes up a few times a second: Python runs signal handlers only in the main
        thread, and a signal the kernel delivers to one of gRPC's threads does not
        interrupt the main thread's wait, so a long wait would sit on a SIGTERM."""
        while not stop.wait(0.25):
            pass

    def stop(self) -> None:
        """Stop serving (running calls get the grace period), close the metadata, unlock.
        Idempotent. Remote layers stay mounted: running containers use them (the layer
        file system server stops with the node only when it serves no layer)."""
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None
        if self._server is not None:
            self._server.stop(self.config.snapshotter.shutdown_grace)
            self._server = None
        if self.snapshotter is not None:
            self.snapshotter.close()
            self.snapshotter = None
        if self.remote is not None and hasattr(self.remote, "stop_if_idle"):
            self.remote.stop_if_idle()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._ready:
            self._ready = False
            log.info("shoal node stopped")

    def _lock_root(self) -> None:
        """One daemon per root: two would corrupt each other's directories."""
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ShoalError(f"{self.root} is in use by another shoal node") from None
        self._lock_fd = fd


def _serve_metrics(address: tuple[str, int], root: str):
    """GET /metrics on a thread of its own: the figures of `shoal status` for Prometheus."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from shoal.metrics import CONTENT_TYPE
    from snapshotter.client_cli import node_metrics, node_status

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] != "/metrics":
                self.send_error(404, "only /metrics here")
                return
            try:
                body = node_metrics(node_status(root)).encode()
            except (OSError, ShoalError, ValueError) as e:
                log.warning("metrics: %s", e)
                self.send_error(500, str(e))
                return
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("metrics: " + format, *args)

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        daemon_threads = True

    try:
        server = Server(address, Handler)
    except OSError as e:
        raise ShoalError(f"metrics: cannot listen on {address[0]}:{address[1]}: {e.strerror or e}") from None
    threading.Thread(target=server.serve_forever, name="shoal-metrics", daemon=True).start()
    log.info("metrics at http://%s:%d/metrics", *server.server_address[:2])
    return server
