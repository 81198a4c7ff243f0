"""The node's swarm: one libtorrent session, and the fetch source on top of it.

Vocabulary: a node's *torrent* is one layer blob's torrent in its session (metadata from
the region, see p2p/metainfo.py); a *piece* is a [piece*plen, ...) slice of the
compressed blob; the torrent's *storage* is one sparse file per blob under
`<storage>/data/sha256-<hex>`. A torrent is in one of three modes:

- lazy: added for an on-demand read; no piece is wanted (priority 0) except those a read
  asks for. It still uploads every piece it has.
- bulk: every piece wanted (prefetch, background completion, `download()`).
- complete: every piece present and the file checked against the blob's sha256; seeded
  until evicted. Reads are pread()s of the file, with no round trip to the session.

One owner (kraken's scheduler idea): a single thread, `shoal-swarm`, makes every call on
the libtorrent session and is the only reader and writer of the torrents' mutable state.
Other threads submit closures (_call) and wait on futures; the thread sleeps in select()
on a pipe that libtorrent writes to when alerts arrive (set_alert_fd) and on a command
pipe, so neither alerts nor commands wait for a polling tick.

The on-demand path (SwarmSource.read_ranges, a FUSE read waiting on it), per piece:
  have it        -> read_piece() from local storage
  a peer has it  -> set_piece_deadline(p, 0, alert_when_available): requested at once
  nobody has it  -> fetched from the fallback chain (region, origin) right away, checked
                    against the piece's SHA-1 and add_piece()d, so neighbours take it
                    from this node from then on.
A piece asked of peers that has not come within `peer_wait` seconds is fetched from the
fallback too (libtorrent re-plans deadlines only about once a second, and a peer may be
slow or gone). Measured numbers behind this are in docs/p2p.md.

The bulk path lets libtorrent download from peers (rarest first) while a helper thread
fetches from the fallback only pieces that no connected peer has and that this node
owns. Pieces are grouped in extents (`fallback_extent`, one region request each). With a
rank from the tracker (p2p/tracker/peers.py), extent e belongs to the downloader ranked
jump_hash(e, n): every downloader of the blob agrees, however few of them it sees, so
the region serves each extent once. Without ranks, the owner is the highest rendezvous
score among this node and the connected peers that download too (not seeds, not
upload-only). A new download waits for the group of downloaders to settle before its
first region fetch; after `stall_timeout` seconds without a piece, a few nodes at random
take extents nobody has, whoever owns them.

Statistics: statistics() (per node) -- bytes from peers and to peers, bytes from the
fallback, on-demand pieces by where they came from, peers connected, hash failures and
bans, tracker replies and errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import random
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from urllib.parse import urlencode, urlparse

import libtorrent as lt

from cache.source import BlobRef, FetchChain, Held, NotHere, RangesFailed, Source
from p2p.metainfo import TorrentMeta, slice_pieces
from p2p.tracker.client import MetadataClient, TrackerRelay
from p2p.tracker.peers import extent_key, jump_hash, rendezvous
from shoal.config import build, host_port_check, limits, url_check
from shoal.errors import ShoalError, TransportError

log = logging.getLogger("shoal.swarm")

MiB = 1 << 20
_TICK = 0.25  # seconds between housekeeping passes of the owner thread
_SETTLE_TICK = 0.02  # ... while a new torrent is meeting its peers
_RECENT = 512  # latency samples kept for statistics()
_LONELY_FOR = 60.0  # a torrent this young with no peer asks the tracker again ...
_LONELY_REANNOUNCE = 1.0  # ... this often
_RANK_EVERY = 2.0  # seconds between rank requests of a bulk download (tracker keeps them 10 s)
_RANK_FRESH = 6.0  # a rank older than this is not used
_RANK_TIMEOUT = 0.5
_HELPERS = 4
_GROUP_SETTLE = 0.3  # a new bulk download starts fetching once its rank held this long ...
_GROUP_SETTLE_MAX = 3.0  # ... or this long after it began
_HELPER_PERIOD = 0.25  # seconds between bulk helper scans when no fetch ended
_CERT_RETRY = 10.0  # seconds before the region is asked again for a peer certificate it refused
# libtorrent's set_ssl_certificate wants a DH parameters file (an empty name fails the
# torrent with ENOENT); the RFC 7919 group ffdhe2048, public and fixed
_DH_PARAMS = """\
-----BEGIN X9.42 DH PARAMETERS-----
MIICDAKCAQEA//////////+t+FRYortKmq/cViAnPTzx2LnFg84tNpWp4TZBFGQz
+8yTnc4kmz75fS/jY2MMddj2gbICrsRhetPfHtXV/WVhJDP1H18GbtCFY2VVPe0a
87VXE15/V8k1mE8McODmi3fipona8+/och3xWKE2rec1MKzKT0g6eXq8CrGCsyT7
YdEIqUuyyOP7uWrat2DX9GgdT0Kj3jlN9K5W7edjcrsZCwenyO4KbXCeAvzhzffi
7MA0BM0oNC9hkXL+nOmFg/+OTxIy7vKBg8P+OxtMb61zO7X8vC7CIAXFjvGDfRaD
ssbzSibBsu/6iGtCOGEoXJf//////////wIBAgKCAQB//////////9b8KixRXaVN
V+4rEBOennjsXOLB5xabStTwmyCKMhn95knO5xJNn3y+l/GxsYY67HtA2QFXYjC9
ae+Paur+srCSGfqPr4M3aEKxsqqe9o152quJrz+r5JrMJ4Y4cHNFu/FTRO159/Q5
DvisUJtW85qYVmUnpB08vV4FWMFZkn2w6IRUpdlkcf3ctW1bsGv6NA6noVHvHKb6
Vyt287G5XYyFg9PkdwU2uE8BfnDm+/F2YBoCZpQaF7DIuX9OdMLB/8cniRl3eUDB
4f8djaY31rmd2v5eF2EQAuLHeMG+i0HZY3mlE2DZd/1ENaEcMJQuS///////////
-----END X9.42 DH PARAMETERS-----
"""


@dataclass
class SwarmConfig:
    """[swarm] of the node configuration. Sizes in bytes, rates in bytes/s (0: no cap)."""

    enabled: bool = False  # the node turns the swarm on with swarm.enabled = true
    required: bool = True  # an enabled swarm that cannot start stops the node; false: it runs without (logged)
    storage: str = ""  # torrent storage folder (the node sets <root>/swarm)
    # libtorrent listen_interfaces (TCP); "" = advertise_ip (or the route to the region):6881
    listen: str = field(default="", metadata=limits(check=host_port_check))
    # where SSL torrents' peers connect (TLS); "" = the listen address, port + 1
    ssl_listen: str = field(default="", metadata=limits(check=host_port_check))
    advertise_ip: str = ""  # this node's address as peers see it; default: the route to the tracker
    metadata_url: str = field(default="", metadata=limits(check=url_check()))  # the region serving /p2p/v1/torrents; default: the node's region_url
    tracker_url: str = field(default="", metadata=limits(check=url_check()))  # announce here instead of the URL in the metadata
    upload_rate_limit: int = field(default=0, metadata=limits(min=0, size=True))  # applies to every peer, LAN included (peer class filter)
    download_rate_limit: int = field(default=0, metadata=limits(min=0, size=True))
    connections_limit: int = field(default=500, metadata=limits(min=2, max=65535))
    unchoke_slots: int = field(default=64, metadata=limits(min=1, max=65535))  # peers uploaded to at once
    peer_wait: float = field(default=1.0, metadata=limits(min=0, max=600))  # an on-demand read takes from the fallback what peers did not send by then
    settle_wait: float = field(default=0.5, metadata=limits(min=0, max=600))  # a first read of a blob waits this long at most to meet its peers
    stall_timeout: float = field(default=3.0, metadata=limits(min=0.1, max=600))  # bulk: without progress this long, fetch any piece nobody has
    fallback_extent: int = field(default=4 * MiB, metadata=limits(min=16 << 10, max=1 << 30, size=True))  # bulk: pieces fetched from the fallback per request
    fallback_threads: int = field(default=4, metadata=limits(min=1, max=256))
    storage_capacity: int = field(default=0, metadata=limits(min=0, size=True))  # bytes of torrent storage; 0: 25% of the free space at start
    verify_complete: bool = True  # check sha256 of a blob downloaded whole before seeding it
    ssrf_mitigation: bool = True  # libtorrent refuses loopback trackers not at /announce (tests turn it off)

    @classmethod
    def from_dict(cls, data: dict | None, warnings: list[str] | None = None) -> SwarmConfig:
        """Checked by shoal.config (ConfigError naming swarm.KEY); unknown keys go to
        `warnings`."""
        return build(cls, dict(data or {}), "swarm", warnings)


def listen_interfaces(config: SwarmConfig) -> str:
    """libtorrent's listen_interfaces: the plain socket and the SSL one (suffix "s")."""
    ssl = config.ssl_listen
    if not ssl:
        host, _, port = config.listen.rpartition(":")
        ssl = f"{host}:{int(port) + 1 if port.isdigit() and int(port) else 0}"
    return f"{config.listen},{ssl}s"


def session_settings(config: SwarmConfig) -> dict:
    """libtorrent settings for a data-centre LAN (reasons in docs/p2p.md)."""
    return {
        "listen_interfaces": listen_interfaces(config),
        "enable_dht": False, "enable_lsd": False, "enable_upnp": False, "enable_natpmp": False,
        "enable_outgoing_utp": False, "enable_incoming_utp": False,  # TCP only on a LAN
        "alert_mask": (lt.alert_category.status | lt.alert_category.error | lt.alert_category.storage
                       | lt.alert_category.piece_progress | lt.alert_category.tracker | lt.alert_category.peer),
        "alert_queue_size": 100_000,
        "connections_limit": config.connections_limit,
        "unchoke_slots_limit": config.unchoke_slots,
        "choking_algorithm": 0,  # fixed_slots: cooperative nodes, no tit-for-tat needed
        "seed_choking_algorithm": 0,  # round_robin: seeds spread uploads over all downloaders
        "active_downloads": -1, "active_seeds": -1, "active_limit": -1, "active_tracker_limit": -1,
        "close_redundant_connections": False,  # lazy torrents are upload-only; keep their peers
        "upload_rate_limit": config.upload_rate_limit,
        "download_rate_limit": config.download_rate_limit,
        "min_announce_interval": 5,  # obey the region tracker's interval (default floor: 300 s)
        "tracker_backoff": 50,  # retry an unreachable tracker sooner (percent of the default curve)
        "stop_tracker_timeout": 1,
        "peer_connect_timeout": 3, "request_timeout": 10, "piece_timeout": 5, "handshake_timeout": 5,
        "connection_speed": 500, "smooth_connects": False, "torrent_connect_boost": 100,
        "num_want": 100,
        "max_out_request_queue": 1500, "max_allowed_in_request_queue": 4000,
        "send_buffer_watermark": 1 * MiB, "send_buffer_low_watermark": 256 << 10,
        "send_buffer_watermark_factor": 150,
        "aio_threads": 4, "hashing_threads": 2,
        "tick_interval": 20,  # ms: rate limits hand out quota in small, smooth steps
        "request_queue_time": 10,  # s of requests in flight per peer (default 3): deep pipelines
        "allow_multiple_connections_per_ip": False,
        "anonymous_mode": False,
        "peer_fingerprint": "-SH0100-",
        "ssrf_mitigation": config.ssrf_mitigation,
    }


def rank_url(tracker: str) -> str | None:
    """The rank route beside a tracker's announce route (.../announce[?query]), or None."""
    path, sep, query = tracker.partition("?")
    if not path.endswith("/announce"):
        return None
    return path[: -len("/announce")] + "/rank" + sep + query


def route_address(url: str) -> str:
    """The local address this host would use to reach `url`'s host (no packet is sent)."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return sock.getsockname()[0]


@dataclass
class _Torrent:
    """One blob's torrent. Mutable fields are owned by the swarm thread."""

    blob: BlobRef
    meta: TorrentMeta
    path: str
    handle: object = None
    mode: str = "lazy"
    have: bytearray = field(default_factory=bytearray)
    have_count: int = 0
    complete: bool = False  # all pieces present and the file verified
    verifying: bool = False
    hashing: bool = False
    failed: str = ""  # set when the blob did not hash to its digest: the torrent is gone
    waiters: dict = field(default_factory=dict)  # piece -> [Future of bytes]
    done: list = field(default_factory=list)  # Futures of download()
    inflight: set = field(default_factory=set)  # pieces being fetched from the fallback
    read_when_done: set = field(default_factory=set)  # pieces a read waits for from the fallback
    tracker: str = ""
    rank: tuple = ()  # (rank, of, when) among the blob's downloaders, from the tracker
    rank_changed: float = 0.0
    reannounced: float = 0.0
    added: float = 0.0
    tracker_reply: float = 0.0
    tracker_peers: int = -1
    settled: threading.Event = field(default_factory=threading.Event)
    last_progress: float = 0.0
    last_used: float = 0.0
    self_ip: str = ""
    helper: threading.Thread | None = None
    cert_renew: float = 0.0  # when to ask for a new peer certificate (SSL torrents); 0: none held
    cert_renewing: bool = False


class Swarm:
    """A node's libtorrent session and its torrents (see the module doc).

    fallback: where pieces nobody has come from (a FetchChain of region and origin).
    metadata: the region's metadata client. Thread-safe; close() stops everything.
    """

    def __init__(self, config: SwarmConfig, metadata: MetadataClient, fallback: FetchChain | None) -> None:
        if not config.storage:
            raise ShoalError("swarm.storage: the torrent storage folder is not set")
        self.config = config
        self.metadata = metadata
        self.fallback = fallback
        if not config.listen:  # this node's address only: never every interface
            ip = config.advertise_ip or route_address(metadata.url)
            config.listen = f"[{ip}]:6881" if ":" in ip else f"{ip}:6881"
        self.data_dir = os.path.join(config.storage, "data")
        os.makedirs(self.data_dir, exist_ok=True)
        self._cert_dir = os.path.join(config.storage, "certs")
        self._dh = ""
        self._peer_key, self._peer_public = self._make_peer_key()
        self._cert_refused: dict[str, float] = {}  # digest -> until when the region is not asked again
        self._clean_partial()
        self.capacity = config.storage_capacity or self._default_capacity()
        self._torrents: dict[str, _Torrent] = {}  # digest -> torrent (owner thread writes)
        self._by_hash: dict[bytes, _Torrent] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._alert_r, self._alert_w = os.pipe()
        self._cmd_r, self._cmd_w = os.pipe()
        for fd in (self._alert_r, self._alert_w, self._cmd_r, self._cmd_w):
            os.set_blocking(fd, False)
        self._ses = None
        self._stopping = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._next_tick = 0.0
        self._add_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=config.fallback_threads, thread_name_prefix="swarm-fetch")
        self._lock = threading.Lock()  # counters below, written from any thread
        self.counters = dict.fromkeys((
            "bytes_from_fallback", "pieces_from_fallback", "read_pieces_local", "read_pieces_peers",
            "read_pieces_fallback", "peer_timeouts", "fallback_hash_mismatches", "hash_failures",
            "peers_banned", "tracker_replies", "tracker_errors", "torrents_added", "torrents_completed",
            "torrents_evicted", "blobs_failed", "alerts_dropped"), 0)
        self._uploaded_gone = 0  # payload bytes uploaded by torrents since removed
        self._downloaded_gone = 0
        self._peer_waits: list[float] = []
        self.listen_port = 0
        self.ssl_listen_port = 0
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the tracker is on the LAN
        self._thread = threading.Thread(target=self._run, name="shoal-swarm", daemon=True)
        # libtorrent announces through the relay (HTTPS, node token), on its own listen address
        listen_host = config.listen.rpartition(":")[0].strip("[]")
        self.relay = TrackerRelay(metadata.link, source_ip=config.advertise_ip,
                                  bind_ip="127.0.0.1" if listen_host in ("0.0.0.0", "::", "") else listen_host)

    # --- life cycle ---------------------------------------------------------------------

    def start(self) -> Swarm:
        self._thread.start()
        self._ready.wait(30)
        if self._start_error is not None:
            raise ShoalError(f"swarm: cannot start libtorrent: {self._start_error}")
        self._restore_complete()
        return self

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._wake()
        self._thread.join(timeout=10)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.relay.close()
        for fd in (self._alert_r, self._alert_w, self._cmd_r, self._cmd_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _make_peer_key(self) -> tuple[str, bytes]:
        """This session's peer key (a new one each start; 0600 in a 0700 folder), for the
        certificates the region issues per SSL torrent. ("", b"") without cryptography."""
        try:
            from cache.region.tls import peer_key
        except ImportError:
            return "", b""
        try:
            private, public = peer_key()
        except ImportError:
            log.warning("swarm: the cryptography package is missing: SSL torrents (every torrent of a "
                        "region with a swarm CA) are read from the region instead")
            return "", b""
        os.makedirs(self._cert_dir, mode=0o700, exist_ok=True)
        os.chmod(self._cert_dir, 0o700)
        path = os.path.join(self._cert_dir, "peer.key")
        _write_private(path, private)
        self._dh = os.path.join(self._cert_dir, "dh.pem")
        _write_private(self._dh, _DH_PARAMS.encode())
        return path, public

    def _peer_cert(self, blob: BlobRef) -> tuple[str, float] | None:
        """(path of a peer certificate for the blob's SSL torrent, seconds valid) from the
        region, or None: refused (remembered for a while) or no key."""
        if not self._peer_key or self._cert_refused.get(blob.digest, 0.0) > time.monotonic():
            return None
        got = self.metadata.certificate(blob, self._peer_public)
        if got is None:
            self._cert_refused[blob.digest] = time.monotonic() + _CERT_RETRY
            return None
        self._cert_refused.pop(blob.digest, None)
        cert, ttl = got
        path = os.path.join(self._cert_dir, f"sha256-{blob.digest[7:]}.pem")
        _write_private(path, cert)
        return path, ttl

    def _renew_cert(self, t: _Torrent) -> None:
        got = self._peer_cert(t.blob)

        def apply() -> None:
            t.cert_renewing = False
            if got is None:
                t.cert_renew = time.monotonic() + _CERT_RETRY  # keeps the one it has until it expires
                return
            t.handle.set_ssl_certificate(got[0], self._peer_key, self._dh, "")
            t.cert_renew = time.monotonic() + got[1] / 2

        self._call(apply)

    def _default_capacity(self) -> int:
        st = os.statvfs(self.data_dir)
        return int(st.f_bavail * st.f_frsize * 0.25)

    def _clean_partial(self) -> None:
        """Partial files of an earlier run are dropped (their pieces are unverified by
        this run); complete ones (a `.complete` mark) are seeded again."""
        for name in os.listdir(self.data_dir):
            if name.endswith(".complete"):
                continue
            if not os.path.exists(os.path.join(self.data_dir, name + ".complete")):
                os.unlink(os.path.join(self.data_dir, name))

    def _restore_complete(self) -> None:
        for name in sorted(os.listdir(self.data_dir)):
            if not name.endswith(".complete") or not name.startswith("sha256-"):
                continue
            digest = "sha256:" + name[len("sha256-"):-len(".complete")]
            blob_ref = _blob_from_mark(os.path.join(self.data_dir, name), digest)
            if blob_ref is None:
                continue
            try:
                self.ensure(blob_ref)
            except ShoalError as exc:
                log.warning("%s: cannot seed again: %s", digest, exc)

    # --- the owner thread -----------------------------------------------------------------

    def _call(self, fn: Callable[[], object]) -> Future:
        """Run fn on the swarm thread; its result or exception comes back in the future."""
        fut: Future = Future()
        if self._stopping:
            fut.set_exception(NotHere("the swarm is stopping"))
            return fut
        self._commands.put((fn, fut))
        self._wake()
        return fut

    def _wake(self) -> None:
        try:
            os.write(self._cmd_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the thread is awake anyway

    def _run(self) -> None:
        try:
            self._ses = lt.session(session_settings(self.config))
            self._apply_peer_classes()
            self._ses.set_alert_fd(self._alert_w)
            self.listen_port = self._ses.listen_port()
            self.ssl_listen_port = self._ses.ssl_listen_port()
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._start_error = exc
            self._ready.set()
            return
        self._ready.set()
        self._next_tick = time.monotonic()
        while not self._stopping:
            timeout = max(0.0, self._next_tick - time.monotonic())
            try:
                select.select([self._alert_r, self._cmd_r], [], [], timeout)
            except InterruptedError:
                pass
            for fd in (self._alert_r, self._cmd_r):
                try:
                    while os.read(fd, 4096):
                        pass
                except (BlockingIOError, OSError):
                    pass
            self._drain_alerts()
            while True:
                try:
                    fn, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                if not fut.set_running_or_notify_cancel():
                    continue
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)
            now = time.monotonic()
            if now >= self._next_tick:
                self._tick(now)
                unsettled = any(not t.settled.is_set() for t in self._torrents.values())
                self._next_tick = now + (_SETTLE_TICK if unsettled else _TICK)
        self._shutdown()

    def _apply_peer_classes(self) -> None:
        """Rate limits are set on the global peer class; libtorrent puts LAN peers in a
        class of their own that no limit applies to. Put every address in the global
        class, so the caps bind for the data-centre peers they exist for."""
        everyone = lt.ip_filter()
        mask = 1 << self._ses.global_peer_class_id
        everyone.add_rule("0.0.0.0", "255.255.255.255", mask)
        everyone.add_rule("::", "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", mask)
        self._ses.set_peer_class_filter(everyone)

    def _shutdown(self) -> None:
        for t in list(self._torrents.values()):
            self._fail_waiters(t, NotHere("the swarm stopped"))
        with contextlib.suppress(Exception):  # a session failing to pause is going anyway
            self._ses.pause()
        self._ses = None

    # --- alerts (owner thread) ------------------------------------------------------------

    def _drain_alerts(self) -> None:
        if self._ses is None:
            return
        for a in self._ses.pop_alerts():
            try:
                self._on_alert(a)
            except Exception:
                log.exception("swarm: handling %s", type(a).__name__)

    def _torrent_of(self, a) -> _Torrent | None:
        try:
            return self._by_hash.get(a.handle.info_hash().to_bytes())
        except Exception:  # noqa: BLE001 - a handle of a removed torrent
            return None

    def _on_alert(self, a) -> None:
        if isinstance(a, lt.read_piece_alert):
            t = self._torrent_of(a)
            if t is None:
                return
            waiters = t.waiters.pop(a.piece, [])
            if a.error.value():
                err = TransportError(f"{t.blob.digest}: piece {a.piece}: {a.error.message()}")
                for fut in waiters:
                    _settle(fut, error=err)
            else:
                data = bytes(a.buffer)
                for fut in waiters:
                    _settle(fut, data)
        elif isinstance(a, lt.piece_finished_alert):
            t = self._torrent_of(a)
            if t is None:
                return
            p = a.piece_index
            t.inflight.discard(p)
            if p in t.read_when_done:
                t.read_when_done.discard(p)
                t.handle.read_piece(p)
            if not t.have[p]:
                t.have[p] = 1
                t.have_count += 1
            t.last_progress = time.monotonic()
            if t.have_count == t.meta.num_pieces and not t.complete and not t.verifying:
                self._finish(t)
        elif isinstance(a, lt.cache_flushed_alert):
            t = self._torrent_of(a)
            if t is not None and t.verifying and not t.hashing and not t.complete:
                t.hashing = True
                self._pool.submit(self._check_file, t)
        elif isinstance(a, lt.hash_failed_alert):
            self._count(hash_failures=1)
            t = self._torrent_of(a)
            if t is not None:
                t.inflight.discard(a.piece_index)
            log.warning("%s: piece %d failed its hash check", t.blob.digest if t else "?", a.piece_index)
        elif isinstance(a, lt.peer_ban_alert):
            self._count(peers_banned=1)
            log.warning("swarm: banned peer %s (sent bad data)", a.endpoint)
        elif isinstance(a, lt.tracker_reply_alert):
            self._count(tracker_replies=1)
            t = self._torrent_of(a)
            if t is not None:
                t.tracker_reply, t.tracker_peers = time.monotonic(), a.num_peers
                self._check_settled(t, t.tracker_reply)
        elif isinstance(a, lt.tracker_error_alert):
            self._count(tracker_errors=1)
            log.info("swarm: tracker: %s", a.message())
        elif isinstance(a, (lt.peer_error_alert, lt.peer_disconnected_alert)):
            log.debug("swarm: %s", a.message())
        elif isinstance(a, lt.alerts_dropped_alert):
            self._count(alerts_dropped=1)
            log.error("swarm: libtorrent dropped alerts (queue full)")
        elif isinstance(a, (lt.torrent_error_alert, lt.file_error_alert)):
            t = self._torrent_of(a)
            log.error("swarm: %s", a.message())
            if t is not None:
                self._remove(t, f"storage error: {a.message()}")

    # --- torrents (owner thread) ------------------------------------------------------------

    def _add(self, blob: BlobRef, meta: TorrentMeta, announce: str | None, complete: bool, bulk: bool,
             cert: tuple[str, float] | None = None) -> _Torrent:
        existing = self._torrents.get(blob.digest)
        if existing is not None:
            return existing
        self._evict_for(meta.length)
        upstream = self.config.tracker_url or announce
        tracker = self.relay.url_for(upstream) if upstream else None
        path = os.path.join(self.data_dir, meta.name)
        t = _Torrent(blob=blob, meta=meta, path=path, have=bytearray(meta.num_pieces))
        atp = lt.add_torrent_params()
        atp.ti = lt.torrent_info(meta.torrent(tracker))
        atp.save_path = self.data_dir
        if tracker:
            atp.trackers = [tracker]
        flags = atp.flags & ~(lt.torrent_flags.auto_managed | lt.torrent_flags.paused)
        flags |= lt.torrent_flags.disable_dht | lt.torrent_flags.disable_lsd | lt.torrent_flags.disable_pex
        if complete:
            flags |= lt.torrent_flags.seed_mode  # verified against the blob digest already
        elif bulk:
            t.mode = "bulk"  # every piece wanted from the start: peers never see us upload-only
        else:
            # no piece wanted until a read or download() asks. (Not default_dont_download:
            # that zeroes the file priority, and libtorrent then keeps pieces in a part file.)
            atp.piece_priorities = [0] * meta.num_pieces
        atp.flags = flags
        t.handle = self._ses.add_torrent(atp)
        now = time.monotonic()
        if cert is not None:  # an SSL torrent: peers must show a certificate of the region's swarm CA
            t.handle.set_ssl_certificate(cert[0], self._peer_key, self._dh, "")
            t.cert_renew = now + cert[1] / 2
        t.added = t.last_progress = t.last_used = now
        t.self_ip = self.config.advertise_ip or (route_address(upstream) if upstream else "")
        t.tracker = tracker or ""
        if complete:
            t.complete, t.mode = True, "complete"
            t.have = bytearray(b"\1" * meta.num_pieces)
            t.have_count = meta.num_pieces
            t.settled.set()
        if not tracker:
            t.settled.set()
        self._torrents[blob.digest] = t
        self._by_hash[meta.info_hash] = t
        self._count(torrents_added=1)
        self._next_tick = now  # watch it settle from now on
        return t

    def _remove(self, t: _Torrent, why: str, delete: bool = True) -> None:
        if self._torrents.get(t.blob.digest) is not t:
            return
        del self._torrents[t.blob.digest]
        self._by_hash.pop(t.meta.info_hash, None)
        try:
            st = t.handle.status()
            with self._lock:
                self._uploaded_gone += st.total_payload_upload
                self._downloaded_gone += st.total_payload_download
            self._ses.remove_torrent(t.handle, lt.session.delete_files if delete else 0)
        except Exception as exc:  # noqa: BLE001 - a handle gone already
            log.debug("%s: removing the torrent: %s", t.blob.digest, exc)
        for suffix in (".complete",):
            try:
                os.unlink(t.path + suffix)
            except FileNotFoundError:
                pass
        self._fail_waiters(t, NotHere(f"{t.blob.digest}: torrent removed ({why})"))
        log.info("%s: torrent removed: %s", t.blob.digest, why)

    def _fail_waiters(self, t: _Torrent, err: BaseException) -> None:
        for waiters in t.waiters.values():
            for fut in waiters:
                _settle(fut, error=err)
        t.waiters.clear()
        for fut in t.done:
            _settle(fut, error=err)
        t.done.clear()

    def _evict_for(self, size: int) -> None:
        """Make room for a torrent of `size` bytes: least recently used first, never one
        that a download or a read is waiting on."""
        used = sum(t.meta.length for t in self._torrents.values())
        if used + size <= self.capacity:
            return
        for t in sorted(self._torrents.values(), key=lambda t: t.last_used):
            if used + size <= self.capacity:
                break
            if t.done or t.waiters or t.verifying:
                continue
            used -= t.meta.length
            self._count(torrents_evicted=1)
            self._remove(t, "evicted (storage capacity)")

    def _finish(self, t: _Torrent) -> None:
        """Every piece is in: once libtorrent has written them (cache_flushed_alert), check
        the file against the blob digest, then seed it."""
        t.verifying = True
        if not self.config.verify_complete:
            self._completed(t, True)
            return
        t.handle.flush_cache()

    def _check_file(self, t: _Torrent) -> None:
        try:
            ok = _file_digest(t.path, t.meta.length) == t.blob.digest
        except OSError as exc:
            log.error("%s: cannot read the downloaded blob: %s", t.blob.digest, exc)
            ok = False
        self._call(lambda: self._completed(t, ok))

    def _completed(self, t: _Torrent, ok: bool) -> None:
        t.verifying = t.hashing = False
        if self._torrents.get(t.blob.digest) is not t or t.complete:
            return
        if not ok:
            self._count(blobs_failed=1)
            log.error("%s: all pieces passed their SHA-1 but the blob does not hash to its digest: "
                      "dropping the torrent and its metadata", t.blob.digest)
            t.failed = "blob digest mismatch"
            self.metadata.forget(t.blob.digest)
            self._remove(t, "blob digest mismatch")
            return
        t.complete, t.mode = True, "complete"
        _write_mark(t.path + ".complete", t.blob)
        self._count(torrents_completed=1)
        for fut in t.done:
            _settle(fut, t.path)
        t.done.clear()
        log.info("%s: complete and verified; seeding", t.blob.digest)

    def _tick(self, now: float) -> None:
        for t in list(self._torrents.values()):
            if t.cert_renew and now >= t.cert_renew and not t.cert_renewing:
                t.cert_renewing = True
                self._pool.submit(self._renew_cert, t)
            if not t.settled.is_set():
                self._check_settled(t, now)
            if t.tracker_reply and not t.complete and now - t.added < _LONELY_FOR and \
                    now - t.reannounced >= _LONELY_REANNOUNCE and not t.handle.get_peer_info():
                # alone in a young swarm: nodes that start together may all have been told
                # of nobody; ask again soon instead of after the tracker's interval
                t.reannounced = now
                t.handle.force_reannounce(0, -1, lt.reannounce_flags_t.ignore_min_interval)

    def _check_settled(self, t: _Torrent, now: float) -> None:
        """A new torrent has met its peers when the tracker answered and it is connected
        to the peers named (or to a seed, or to one of them for a while, or settle_wait has
        passed).
        Until then an on-demand read waits (at most settle_wait) rather than go to the
        region for pieces a neighbour has."""
        if t.settled.is_set():
            return
        if now - t.added >= 2 * self.config.settle_wait + 1.0:
            t.settled.set()  # the tracker is slow or down: go on without it
        elif t.tracker_reply:
            since = now - t.tracker_reply
            ready = seeds = 0
            if t.tracker_peers > 0:
                for p in t.handle.get_peer_info():
                    if not p.flags & (lt.peer_info.connecting | lt.peer_info.handshake):
                        ready += 1
                        seeds += bool(p.flags & lt.peer_info.seed)
            # met: every peer named, or a seed (it has every piece), or some peers for a
            # while; SSL torrents' handshakes take longer, and settling on the first
            # non-seed to answer sends the pieces only the seed has to the region
            if t.tracker_peers <= 0 or ready >= t.tracker_peers or seeds or (ready and since >= 0.25) \
                    or since >= self.config.settle_wait:
                t.settled.set()

    # --- public API (any thread) ------------------------------------------------------------

    def ensure(self, blob: BlobRef, bulk: bool = False) -> _Torrent | None:
        """The blob's torrent, added on first use (lazy, or with every piece wanted if
        `bulk`); None when no metadata is to be had."""
        t = self._torrents.get(blob.digest)
        if t is not None:
            t.last_used = time.monotonic()
            return t
        with self._add_lock:  # one metadata fetch and add per blob
            t = self._torrents.get(blob.digest)
            if t is not None:
                return t
            got = self.metadata.get(blob)
            if got is None:
                return None
            meta, announce = got
            cert = None
            if meta.ssl_cert:  # peers take only nodes the region checked with the origin
                cert = self._peer_cert(blob)
                if cert is None:
                    return None
            complete = os.path.exists(os.path.join(self.data_dir, meta.name + ".complete")) and \
                os.path.getsize(os.path.join(self.data_dir, meta.name)) == meta.length
            return self._call(lambda: self._add(blob, meta, announce, complete, bulk, cert)).result(30)

    def read(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The on-demand path (see the module doc). NotHere without metadata."""
        t = self.ensure(blob)
        if t is None:
            raise NotHere(f"{blob.digest}: no torrent metadata or peer certificate (yet)")
        if t.failed:
            raise NotHere(f"{blob.digest}: swarm disabled for this blob ({t.failed})")
        ranges = list(ranges)
        pieces = t.meta.pieces_for(ranges)
        if t.complete:
            got = self._read_file(t, pieces)
            if got is not None:
                return [Held(d) for d in slice_pieces(t.meta, got, ranges)]
        if not t.settled.is_set():
            t.settled.wait(self.config.settle_wait)
        start = time.monotonic()
        local, asked, fetch = self._call(lambda: self._plan(t, pieces)).result(30)
        got: dict[int, bytes] = {}
        if fetch:
            got.update(self._fetch(t, fetch, keep_inflight=True))
        late = []
        for p, fut in list(local.items()) + list(asked.items()):
            try:
                got[p] = fut.result(timeout=max(0.0, start + self.config.peer_wait - time.monotonic())
                                    if p in asked else 30)
            except (FutureTimeout, ShoalError):
                late.append(p)
        if asked:
            self._sample(time.monotonic() - start)
        if late:
            self._count(peer_timeouts=len(late))
            got.update(self._fetch(t, late))
        self._count(read_pieces_local=len(local), read_pieces_peers=len(asked) - len(late),
                    read_pieces_fallback=len(fetch) + len(late))
        t.last_used = time.monotonic()
        return [Held(d) for d in slice_pieces(t.meta, got, ranges)]

    def download(self, blob: BlobRef, timeout: float | None = None) -> str:
        """Bulk: the whole blob through the swarm (fallback for what no peer has);
        returns the path of the complete, verified file. NotHere without metadata."""
        return self.start_download(blob).result(timeout)

    def start_download(self, blob: BlobRef) -> Future:
        t = self.ensure(blob, bulk=True)
        if t is None:
            raise NotHere(f"{blob.digest}: no torrent metadata or peer certificate (yet)")
        fut = self._call(lambda: self._start_bulk(t)).result(30)
        if self.fallback is not None:
            self._call(lambda: self._start_helper(t)).result(30)
        return fut

    def has(self, blob: BlobRef) -> str:
        """"complete", "partial" or "" (not in the swarm)."""
        t = self._torrents.get(blob.digest)
        return "" if t is None else ("complete" if t.complete else "partial")

    def drop(self, blob: BlobRef, why: str) -> None:
        """Remove the blob's torrent and its storage (not waited for): bytes read from it
        failed their check, so its file is damaged; a later read adds it again."""
        def remove() -> None:
            t = self._torrents.get(blob.digest)
            if t is not None:
                log.error("%s: %s; dropping the torrent and its storage", blob.digest, why)
                self._remove(t, why)

        self._call(remove)

    # --- the on-demand plan (owner thread) ------------------------------------------------

    def _plan(self, t: _Torrent, pieces: list[int]):
        """Split pieces into: read locally, ask peers (deadline), fetch from the fallback."""
        local: dict[int, Future] = {}
        asked: dict[int, Future] = {}
        fetch: list[int] = []
        availability = None
        for p in pieces:
            fut: Future = Future()
            if t.have[p]:
                t.waiters.setdefault(p, []).append(fut)
                t.handle.read_piece(p)
                local[p] = fut
                continue
            if availability is None:
                availability = t.handle.piece_availability()
            if p in t.inflight:  # the bulk helper is fetching it: read it when it lands
                t.waiters.setdefault(p, []).append(fut)
                t.read_when_done.add(p)
                asked[p] = fut
            elif availability[p] > 0:
                t.waiters.setdefault(p, []).append(fut)
                t.handle.set_piece_deadline(p, 0, lt.deadline_flags_t.alert_when_available)
                asked[p] = fut
            else:
                fetch.append(p)
        t.inflight.update(fetch)  # single flight: other reads and the bulk helper wait for these
        return local, asked, fetch

    # --- the fallback ------------------------------------------------------------------------

    def _fetch(self, t: _Torrent, pieces: list[int], keep_inflight: bool = False) -> dict[int, bytes]:
        """Whole pieces from the fallback chain; each checked against its SHA-1 and added
        to the torrent (so peers can take it from here). Raises TransportError/NotHere.
        keep_inflight: the caller marked the pieces in flight; they stay so until
        libtorrent reports them in (or are unmarked here if they cannot be added)."""
        try:
            return self._fetch_pieces(t, pieces, keep_inflight)
        except BaseException:
            if keep_inflight:
                self._call(lambda: t.inflight.difference_update(pieces))
            raise

    def _fetch_pieces(self, t: _Torrent, pieces: list[int], keep_inflight: bool) -> dict[int, bytes]:
        if self.fallback is None:
            raise NotHere(f"{t.blob.digest}: no peer has the pieces and there is no fallback")
        pieces = sorted(set(pieces))
        spans: list[list[int]] = []  # runs of consecutive pieces
        for p in pieces:
            if spans and spans[-1][1] == p:
                spans[-1][1] = p + 1
            else:
                spans.append([p, p + 1])
        ranges = [(t.meta.piece_span(a)[0], t.meta.piece_span(b - 1)[1]) for a, b in spans]

        def check(k: int, data: bytes) -> dict[int, bytes]:
            """The span's pieces, each matching its SHA-1 in the torrent (else ShoalError:
            the chain asks the next source for the span)."""
            a, b = spans[k]
            base = t.meta.piece_span(a)[0]
            pieces = {}
            for p in range(a, b):
                s, e = t.meta.piece_span(p)
                pieces[p] = piece = data[s - base:e - base]
                if hashlib.sha1(piece).digest() != t.meta.piece_hash(p):
                    self._count(fallback_hash_mismatches=1)
                    raise TransportError(f"{t.blob.digest}: piece {p} ([{s}, {e})) does not match the torrent's SHA-1")
            return pieces

        out: dict[int, bytes] = {}
        try:
            for span in self.fallback.read_ranges(t.blob, ranges, check):
                out.update(span)
        except RangesFailed as exc:  # the spans that passed still join the torrent
            for span in exc.served.values():
                out.update(span)
            raise
        finally:
            if out:
                good = list(out.items())
                self._call(lambda: self._add_pieces(t, good))
                self._count(pieces_from_fallback=len(out), bytes_from_fallback=sum(map(len, out.values())))
        return out

    def _add_pieces(self, t: _Torrent, pieces: list[tuple[int, bytes]]) -> None:
        if self._torrents.get(t.blob.digest) is not t:
            return
        for p, data in pieces:
            if t.have[p]:
                t.inflight.discard(p)
            else:
                t.handle.add_piece(p, data, 0)

    # --- bulk ------------------------------------------------------------------------------

    def _start_bulk(self, t: _Torrent) -> Future:
        fut: Future = Future()
        if t.complete:
            fut.set_result(t.path)
            return fut
        t.done.append(fut)
        if t.mode != "bulk":  # a lazy torrent: want every piece from now on
            t.mode = "bulk"
            t.last_progress = time.monotonic()
            t.handle.prioritize_pieces([4] * t.meta.num_pieces)
        return fut

    def _start_helper(self, t: _Torrent) -> None:
        if t.helper is None or not t.helper.is_alive():
            t.helper = threading.Thread(target=self._helper, args=(t,), name="swarm-bulk", daemon=True)
            t.helper.start()

    def _helper(self, t: _Torrent) -> None:
        """Feeds a bulk torrent from the fallback with the extents this node owns. Looks
        again when a fetch ends, else every _HELPER_PERIOD (peers come and go, pieces
        arrive): the scan is O(pieces) in Python, so not in a tight loop."""
        running: dict[int, Future] = {}
        errors = 0
        asked = 0.0
        wake = threading.Event()
        while not self._stopping and self._torrents.get(t.blob.digest) is t and not t.complete \
                and not t.verifying and t.mode == "bulk":
            now = time.monotonic()
            if now - asked >= (_RANK_EVERY if now - t.added > 3 else 0.1):
                asked = now
                self._ask_rank(t)
            for e in [e for e, f in running.items() if f.done()]:
                if running.pop(e).exception() is not None:
                    errors += 1
            free = self.config.fallback_threads - len(running)
            if free > 0:
                try:
                    todo = self._call(lambda free=free: self._assign(t, free, set(running))).result(30)
                except ShoalError:
                    break
                for extent, pieces in todo:
                    running[extent] = fut = self._pool.submit(self._fetch_extent, t, pieces)
                    fut.add_done_callback(lambda _: wake.set())
            wake.wait(_HELPER_PERIOD if errors < 3 else 1.0)
            wake.clear()

    def _ask_rank(self, t: _Torrent) -> None:
        """This node's rank among the blob's downloaders (p2p/tracker/peers.py); left
        unset when the tracker cannot say (then the local view decides)."""
        url = rank_url(t.tracker)
        if url is None:
            return
        port = self.ssl_listen_port if t.meta.ssl_cert else self.listen_port  # the port libtorrent announced
        query = urlencode({"info_hash": t.meta.info_hash, "port": port})
        try:
            with self._opener.open(f"{url}{'&' if '?' in url else '?'}{query}", timeout=_RANK_TIMEOUT) as resp:
                answer = json.loads(resp.read())
            rank = (int(answer["rank"]), int(answer["of"]), time.monotonic())
            if not t.rank or t.rank[:2] != rank[:2]:
                t.rank_changed = rank[2]
            t.rank = rank
        except (OSError, ValueError, KeyError) as exc:
            log.debug("%s: no rank from %s: %s", t.blob.digest, url, exc)

    def _fetch_extent(self, t: _Torrent, pieces: list[int]) -> None:
        """Pieces stay in `inflight` until libtorrent reports them (piece_finished or
        hash_failed), so that no helper round fetches them again meanwhile."""
        try:
            self._fetch(t, pieces, keep_inflight=True)
        except ShoalError as exc:
            log.warning("%s: fallback fetch of %d pieces failed: %s", t.blob.digest, len(pieces), exc)
            raise

    def _assign(self, t: _Torrent, limit: int, running: set[int]) -> list[tuple[int, list[int]]]:
        """Extents (with their missing pieces) this node should fetch from the fallback now."""
        if not t.settled.is_set():
            return []
        peers = t.handle.get_peer_info()
        now = time.monotonic()
        if not peers and now - t.added < self.config.settle_wait:
            return []  # alone so far: nodes that start with us may connect in a moment
        if t.tracker_reply and now - t.tracker_reply < self.config.settle_wait:
            # bulk waits to know the swarm: every peer the tracker named connected and
            # past its handshake (so its bitfield is in), or settle_wait gone by.
            ready = [p for p in peers if not p.flags & (lt.peer_info.connecting | lt.peer_info.handshake)]
            if len(ready) < min(t.tracker_peers, self.config.connections_limit) or len(ready) < len(peers):
                return []
        per = max(1, self.config.fallback_extent // t.meta.piece_length)
        n = t.meta.num_pieces
        availability = t.handle.piece_availability()
        me = t.self_ip or "self"
        candidates = {me} | {p.ip[0] for p in peers
                             if not p.flags & (lt.peer_info.seed | lt.peer_info.upload_only
                                               | lt.peer_info.connecting | lt.peer_info.handshake)}
        # owners: with a rank from the tracker, extent e belongs to the downloader whose
        # rank is jump_hash(e, n) (every downloader of the blob agrees; one arriving or
        # leaving moves ~1/n of the extents); without one, to the candidate this node sees
        # with the highest rendezvous score (nodes with the same view agree).
        ih = t.meta.info_hash
        young = now - t.added < _GROUP_SETTLE_MAX
        if t.rank and now - t.rank[2] < _RANK_FRESH:
            my_rank, group = t.rank[0], t.rank[1]
            if young and (now - t.rank_changed < _GROUP_SETTLE or group < len(candidates)):
                return []  # downloaders are still arriving: let the group settle first

            def owned(extent: int) -> bool:
                return jump_hash(extent_key(ih, extent), group) == my_rank
        elif young and rank_url(t.tracker) and not t.rank:
            return []  # the first rank is on its way
        else:  # the tracker gives no ranks (or no longer answers): this node's own view
            my_rank, group = -1, len(candidates)

            def owned(extent: int) -> bool:
                return max(candidates, key=lambda ip: rendezvous(ih, extent, ip)) == me
        mine, others = [], []
        for extent in range(-(-n // per)):
            pieces = range(extent * per, min(n, (extent + 1) * per))
            if extent in running:
                continue
            missing = [p for p in pieces if not t.have[p] and p not in t.inflight and availability[p] == 0]
            if missing:
                (mine if owned(extent) else others).append((extent, missing))
        # a stalled swarm (no piece for stall_timeout: an owner gone or failing): a few
        # nodes at random (about _HELPERS per stall period, however big the swarm) take
        # extents nobody has, whoever owns them
        stalled = now - t.last_progress > self.config.stall_timeout and random.random() < _HELPERS / group
        why = "owner"
        if not mine and others and stalled:
            mine, why = others, "stalled"
        random.shuffle(mine)
        todo = mine[:limit]
        for extent, missing in todo:
            t.inflight.update(missing)
            log.debug("%s: extent %d (%d pieces) from the fallback (%s; rank %d of %d)",
                      t.blob.digest, extent, len(missing), why, my_rank, group)
        if why != "owner" and todo:
            t.last_progress = now  # one round of help per stall period
        return todo

    # --- local reads and statistics ----------------------------------------------------------

    def _read_file(self, t: _Torrent, pieces: list[int]) -> dict[int, bytes] | None:
        try:
            fd = os.open(t.path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            out = {}
            for p in pieces:
                s, e = t.meta.piece_span(p)
                data = os.pread(fd, e - s, s)
                if len(data) != e - s:
                    return None
                out[p] = data
        finally:
            os.close(fd)
        self._count(read_pieces_local=len(out))
        return out

    def _count(self, **delta: int) -> None:
        with self._lock:
            for k, v in delta.items():
                self.counters[k] += v

    def _sample(self, seconds: float) -> None:
        with self._lock:
            self._peer_waits.append(seconds)
            del self._peer_waits[:-_RECENT]

    def _snapshot(self) -> dict:
        torrents = []
        peers: set = set()
        uploaded, downloaded = self._uploaded_gone, self._downloaded_gone
        for t in self._torrents.values():
            st = t.handle.status()
            uploaded += st.total_payload_upload
            downloaded += st.total_payload_download
            sending = 0
            for p in t.handle.get_peer_info():
                peers.add(p.ip)
                sending += p.payload_down_speed > 0
            torrents.append({"digest": t.blob.digest, "mode": t.mode, "pieces": t.have_count,
                             "num_pieces": t.meta.num_pieces, "peers": st.num_peers, "seeds": st.num_seeds,
                             "peers_sending": sending, "down_rate": st.download_payload_rate,
                             "up_rate": st.upload_payload_rate})
        return {"torrents": torrents, "peers_connected": len(peers), "bytes_to_peers": uploaded,
                "bytes_from_peers": downloaded}

    def statistics(self) -> dict:
        try:
            snap = self._call(self._snapshot).result(5)
        except (FutureTimeout, ShoalError):
            snap = {}
        with self._lock:
            out = dict(self.counters)
            waits = sorted(self._peer_waits)
        if waits:
            out["peer_wait_p50_ms"] = round(waits[len(waits) // 2] * 1000, 1)
            out["peer_wait_p99_ms"] = round(waits[min(len(waits) - 1, int(len(waits) * 0.99))] * 1000, 1)
        out.update(snap)
        out["listen_port"] = self.listen_port
        out["ssl_listen_port"] = self.ssl_listen_port
        out["metadata"] = self.metadata.statistics()
        return out


class SwarmSource(Source):
    """The swarm as a fetch source: ranges from local storage and peers, and what no peer
    has from the fallback chain (the bytes then join the swarm). NotHere when the blob has
    no torrent metadata (the chain goes on to the region and origin)."""

    name = "swarm"

    def __init__(self, swarm: Swarm) -> None:
        self.swarm = swarm

    def read_ranges(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if not ranges:
            return []
        try:
            return self.swarm.read(blob, ranges)
        except ShoalError:
            raise
        except (FutureTimeout, RuntimeError, OSError, ValueError) as exc:  # libtorrent failing, a bad range
            raise TransportError(f"swarm: {blob.digest}: {type(exc).__name__}: {exc}") from None

    def report_bad(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> None:
        # every piece it returns passed a SHA-1 check when it came in: its storage rotted
        self.swarm.drop(blob, f"bytes read from its storage failed their check ({len(ranges)} ranges)")

    def close(self) -> None:
        self.swarm.close()


# --- helpers -----------------------------------------------------------------------------------


def _settle(fut: Future, result: object = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    with contextlib.suppress(InvalidStateError):  # raced with another settle
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


def _file_digest(path: str, size: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        left = size
        while left:
            data = fh.read(min(8 * MiB, left))
            if not data:
                break
            h.update(data)
            left -= len(data)
        if left:
            return "short"
    return "sha256:" + h.hexdigest()


def _write_private(path: str, data: bytes) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


def _write_mark(path: str, blob: BlobRef) -> None:
    import json

    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(blob.to_dict(), fh)
    os.replace(tmp, path)


def _blob_from_mark(path: str, digest: str) -> BlobRef | None:
    import json

    try:
        with open(path) as fh:
            d = json.load(fh)
        if d.get("digest") != digest:
            return None
        return BlobRef.from_dict(d)
    except (OSError, ValueError, ShoalError):
        return None
