"""`shoal node`: the node daemon that containerd talks to.

Node assembles the pieces: the snapshotter (local.py) with a RemoteLayers provider
plugged into it, and the gRPC server on the socket. Start-up order matters for restarts:
the root is locked, orphans are cleaned and remote layers restored *before* the socket
answers, so containerd never sees a snapshot whose mounts are not back yet.

What a restart keeps: every snapshot (metadata.db); containers keep running, because
containerd (not shoal) mounted their overlays. What it must restore: the remote layers'
mounts (RemoteLayers.restore).

Configuration: a TOML file, every key optional (see NodeConfig), every value checked at
start (shoal/config.py); unknown keys are a warning.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from shoal.config import (
    host_port_check,
    limits,
    load,
    readable_file_check,
    split_host_port,
    url_check,
)
from shoal.errors import ShoalError
from snapshotter import DEFAULT_CONTAINERD_ADDRESS
from snapshotter.snapshotter import RemoteLayers

if TYPE_CHECKING:  # (imported when the node starts: gRPC is heavy)
    from snapshotter.criproxy import ImageServiceProxy
    from snapshotter.grpc_server import SnapshotsServer
    from snapshotter.local import LocalSnapshotter

log = logging.getLogger("shoal.node")

DEFAULT_SOCKET = "/run/shoal/snapshotter.sock"


# --- configuration ---------------------------------------------------------------------


@dataclass
class SnapshotterConfig:
    """[snapshotter]"""

    grpc_threads: int = field(default=16, metadata=limits(min=1, max=1024))  # concurrent snapshotter calls
    shutdown_grace: float = field(default=5.0, metadata=limits(min=0, max=3600))  # seconds calls get on SIGTERM


@dataclass
class FetchConfig:
    """[fetch]: where lazy layers' chunks come from, and the node's chunk store."""

    # the region cache (`shoal region`), tried before the origin; "" = none
    region_url: str = field(default="", metadata=limits(check=url_check()))
    # PEM CA the region's certificate must chain to (its <store>/tls/ca.pem); "" = system trust store
    region_ca: str = field(default="", metadata=limits(check=readable_file_check))
    # the region's node token (its <store>/tls/node-token), for the swarm's calls
    region_token_file: str = field(default="", metadata=limits(check=readable_file_check))
    region_plain_http_credentials: bool = False  # send registry credentials to an http:// region on loopback
    plain_http_hosts: list[str] = field(default_factory=list)  # registries reached over HTTP (loopback always is)
    # lazy layers: the layer file system runs, and one that cannot start stops the node;
    # false: no layer file system (containerd pulls and unpacks every layer itself)
    lazy: bool = True
    # bytes for the chunk store under ROOT/chunks; 0 = 20% of the disk's free space
    store_capacity: int = field(default=0, metadata=limits(min=0, size=True))
    # bytes of decompressed chunks kept in memory, shared by all lazy layers
    memory_cache: int = field(default=512 << 20, metadata=limits(min=0, size=True))
    # the kernel's read-ahead on lazy layers' files (KiB; FUSE's own default is 128)
    readahead_kb: int = field(default=1024, metadata=limits(min=0, max=1 << 20))
    passthrough: bool = True  # files of one stored chunk read by the kernel from the store (FUSE passthrough; docs/snapshotter.md)
    # a preheat (`shoal prefetch`) also reads the profile's file pages into the page cache (LayerFS.page_in)
    page_in: bool = True
    prefetch_profiles: bool = True  # fetch the chunks of an image's published access profile (shoal profile save) at its first prepare
    # compressed bytes one image's profile may make the node fetch (the first ones in its order)
    prefetch_max_bytes: int = field(default=8 << 30, metadata=limits(min=0, size=True))
    prove_lazy: bool = True  # read each lazy layer's whole blob in the background and check its diff_id (chainproof.py); false: chain ids are trusted
    # seconds from a lazy layer's prepare to the start of its background proof
    prove_after: float = field(default=30.0, metadata=limits(min=0, max=30 * 86400))
    # seconds a container's prepare waits for a proof it needs (a chain another image names with another blob)
    prove_timeout: float = field(default=600.0, metadata=limits(min=1, max=86400))
    # seconds a read that needs the network may wait for its bytes (all sources
    # together); then the reader gets EIO and the log names image, layer and file
    read_deadline: float = field(default=20.0, metadata=limits(min=0.5, max=3600))
    # seconds a source that hung (no answer in time) is skipped, doubled per hang in a row up to 3x
    source_backoff: float = field(default=10.0, metadata=limits(min=0.1, max=3600))


@dataclass
class ContainerdConfig:
    """[containerd]: the containerd this node serves (the proofs ask it which images name a chain)."""

    address: str = DEFAULT_CONTAINERD_ADDRESS
    snapshotter: str = "shoal"  # this node's name in containerd's [proxy_plugins]


def _socket_path_check(value: str) -> str | None:
    if value and not os.path.isabs(value):
        return "must be an absolute path (or empty: off)"
    if len(os.fsencode(value)) > 107:
        return "is longer than a unix socket path allows (107 bytes)"
    return None


@dataclass
class CRIConfig:
    """[cri]: the CRI image service the kubelet is pointed at (its --image-service-endpoint),
    forwarded to containerd's; it keeps PullImage's credentials for the lazy reads of that
    image's repository, in memory only (snapshotter/criproxy.py, docs/security.md)."""

    # the unix socket to serve it on (e.g. "/run/shoal/cri-image.sock"); "" = off
    image_service_socket: str = field(default="", metadata=limits(check=_socket_path_check))
    # seconds a repository's credentials serve after the last PullImage that carried them
    credential_ttl: float = field(default=86400.0, metadata=limits(min=60, max=30 * 86400))


@dataclass
class MetricsConfig:
    """[metrics]: Prometheus text at http://ADDRESS/metrics (bytes by source, swarm peers,
    layers), from the same figures as `shoal status`."""

    # "HOST:PORT" to serve on (e.g. "127.0.0.1:9464"); "" = off
    address: str = field(default="", metadata=limits(check=host_port_check))

    def host_port(self) -> tuple[str, int] | None:
        return split_host_port(self.address) if self.address else None


@dataclass
class NodeSection:
    """[node]: who this node is to its region (the preheat service, docs/prefetch.md)."""

    # the node's name in preheat jobs (a Slurm node name); "" = the host name
    name: str = field(default="", metadata=limits(check=lambda v: None if v == "" or _node_name_ok(v)
                                                   else "want letters, digits, '.', '_', '-' (at most 255)"))
    # the address the region lists for it; "" = the one it reaches the region from
    address: str = field(default="", metadata=limits(check=lambda v: None if len(v) <= 255 else "at most 255 characters"))


def _node_name_ok(value: str) -> bool:
    import re

    return re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", value) is not None


@dataclass
class NodeConfig:
    """The whole `shoal node` configuration file. Each section is a dataclass; add a
    section by adding a field here (shoal.config checks every key and range)."""

    snapshotter: SnapshotterConfig = field(default_factory=SnapshotterConfig)
    fetch: FetchConfig = field(default_factory=FetchConfig)
    # [swarm]: the libtorrent swarm (p2p.config.SwarmConfig documents and checks its keys
    # when the node starts; `enabled = true` turns it on).
    swarm: dict = field(default_factory=dict)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    containerd: ContainerdConfig = field(default_factory=ContainerdConfig)
    cri: CRIConfig = field(default_factory=CRIConfig)
    node: NodeSection = field(default_factory=NodeSection)

    def proofs(self):
        from snapshotter.chainproof import ProofConfig

        return ProofConfig(self.fetch.prove_lazy, self.fetch.prove_after, self.fetch.prove_timeout,
                           self.containerd.address, self.containerd.snapshotter)


def load_config(path: str | Path | None) -> NodeConfig:
    """The configuration in `path` on top of the defaults (no path: the defaults).
    ConfigError (one line naming the file, key, value and what is allowed) for a bad
    value; unknown keys are logged as warnings."""
    return load(NodeConfig, path, logger=log)


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
        self.snapshotter: LocalSnapshotter | None = None
        self._server: SnapshotsServer | None = None
        self._metrics = None
        self._cri: ImageServiceProxy | None = None
        self._lock_fd: int | None = None
        self._ready = False

    def start(self) -> None:
        # Imported here: they load gRPC and the protobuf stubs (wire.py sets the
        # protobuf implementation first).
        from snapshotter.grpc_server import SnapshotsServer
        from snapshotter.local import LocalSnapshotter

        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            # Layers of every tenant's images live here: root alone may read them,
            # whoever made the directory first (the layer fs, an installer, an admin).
            os.chmod(self.root, 0o700)
            self._lock_root()
            self.snapshotter = LocalSnapshotter(self.root, remote=self.remote, proofs=self.config.proofs())
            self.snapshotter.recover()
            if self.remote is not None:
                self.remote.start()
            self._server = SnapshotsServer(self.snapshotter, self.socket, self.config.snapshotter.grpc_threads)
            self._server.start()
            if self.config.cri.image_service_socket:
                self._cri = self._cri_proxy()
                self._cri.start()
            address = self.config.metrics.host_port()
            if address is not None:
                self._metrics = _serve_metrics(address, str(self.root), str(self.socket))
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
        if self._cri is not None:
            self._cri.stop(self.config.snapshotter.shutdown_grace)
            self._cri = None
        if self._server is not None:
            self._server.stop(self.config.snapshotter.shutdown_grace)
            self._server = None
        if self.snapshotter is not None:
            self.snapshotter.close()
            self.snapshotter = None
        if self.remote is not None:
            self.remote.stop_if_idle()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if self._ready:
            self._ready = False
            log.info("shoal node stopped")

    def _cri_proxy(self) -> ImageServiceProxy:
        """The CRI image service proxy, whose captured credentials go to this process's
        registry clients and to the layer file system's fetch chain (which reads lazy
        layers; it outlives this process, and keeps them across its restarts)."""
        from builder.oci.auth import provide
        from snapshotter.criproxy import ImageServiceProxy

        remote = self.remote

        def keychain(registry: str, repository: str, creds, ttl: float) -> None:
            provide(registry, repository, creds, ttl)
            if remote is not None:
                remote.provide_credentials(registry, repository, creds, ttl)

        return ImageServiceProxy(self.config.cri.image_service_socket, self.config.containerd.address, keychain,
                                 self.config.cri.credential_ttl)

    def _lock_root(self) -> None:
        """One daemon per root: two would corrupt each other's directories."""
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ShoalError(f"{self.root} is in use by another shoal node") from None
        self._lock_fd = fd


def _serve_metrics(address: tuple[str, int], root: str, grpc_socket: str):
    """The node's HTTP endpoint, on a thread of its own: GET /metrics (the figures of
    `shoal status` for Prometheus), /healthz (200 while the node process serves) and
    /readyz (200 when the snapshotter socket answers gRPC and the layer file system
    answers on ROOT/fs.sock; 503 naming what does not)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from shoal.metrics import CONTENT_TYPE
    from snapshotter.fs.client import FSClient
    from snapshotter.grpc_server import socket_answers
    from snapshotter.status import node_metrics, node_status

    def readiness() -> str:
        if not socket_answers(grpc_socket, timeout=2):
            return f"snapshotter socket {grpc_socket} does not answer"
        if not FSClient(root).running():
            return f"layer file system ({root}/fs.sock) does not answer"
        return ""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            content_type = "text/plain; charset=utf-8"
            if path == "/healthz":
                body = b"ok\n"
            elif path == "/readyz":
                problem = readiness()
                if problem:
                    self.send_error(503, problem)
                    return
                body = b"ok\n"
            elif path == "/metrics":
                try:
                    body = node_metrics(node_status(root)).encode()
                except (OSError, ShoalError, ValueError) as e:
                    log.warning("metrics: %s", e)
                    self.send_error(500, str(e))
                    return
                content_type = CONTENT_TYPE
            else:
                self.send_error(404, "here: /metrics, /healthz, /readyz")
                return
            self.send_response(200)
            self.send_header("Content-Type", content_type)
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
