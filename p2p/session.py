"""The node's libtorrent session, its owner thread and its torrents' lifetime.

Vocabulary (p2p/swarm.py has the whole picture): a *torrent* is one layer blob's
torrent in the session (metadata from the region, p2p/metainfo.py); its *storage* is one
sparse file per blob under `<storage>/data/sha256-<hex>`; its *mode* is lazy, bulk or
complete. This module adds torrents (metadata and peer certificate first), evicts them
(least recently used, within `storage_capacity`), verifies a blob downloaded whole
against its sha256 before seeding it, and handles libtorrent's alerts.

One owner (kraken's scheduler: "while the event is applying, it is guaranteed to be the
only accessor of state"): a single thread, `shoal-swarm`, is the only one that reads or
writes
- the libtorrent session and every torrent handle;
- the torrent table (`_torrents` by digest, `_by_hash` by info hash);
- every mutable field of a Torrent (mode, have, complete, verifying, failed, waiters,
  done, inflight, read_when_done, rank, last_used, last_progress, tracker replies,
  the bulk helper's thread, certificate renewal);
- the housekeeping clock and the byte totals of removed torrents.
Other threads reach that state only by queueing a function to the owner: call(fn)
returns a Future of fn's result (NotHere once the swarm is stopping), post(fn) does not
wait. The thread sleeps in select() on a pipe that libtorrent writes to when alerts
arrive (set_alert_fd) and on a command pipe, so neither alerts nor commands wait for a
polling tick; each turn it drains alerts, then runs queued functions in order, then
housekeeping.

What other threads may read directly: a Torrent's identity fields, set before it is
first handed out and never changed (blob, meta, path, tracker, self_ip, added), and its
`settled` Event (set by the owner; readers wait on it); the session's listen ports (set
before start() returns); `stopping` (set once by close()). Not owner state: `counters`
(under `_lock`, any thread adds to them: count()), the region's refusals of peer
certificates (under `_cert_lock`), the metadata client (thread-safe itself).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlparse

import libtorrent as lt

from cache.source import BlobRef, NotHere
from p2p.config import SwarmConfig
from p2p.metainfo import TorrentMeta
from p2p.tracker.client import MetadataClient, TrackerRelay
from shoal.errors import ShoalError, TransportError

log = logging.getLogger("shoal.swarm")

T = TypeVar("T")

MiB = 1 << 20
_TICK = 0.25  # seconds between housekeeping passes of the owner thread
_SETTLE_TICK = 0.02  # ... while a new torrent is meeting its peers
_LONELY_FOR = 60.0  # a torrent this young with no peer asks the tracker again ...
_LONELY_REANNOUNCE = 1.0  # ... this often
MARKS = (".complete", ".partial")  # beside a blob's file: a BlobRef (JSON) of what it holds
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


def listen_interfaces(config: SwarmConfig) -> str:
    """libtorrent's listen_interfaces: the plain socket and the SSL one (suffix "s")."""
    ssl = config.ssl_listen
    if not ssl:
        host, _, port = config.listen.rpartition(":")
        ssl = f"{host}:{int(port) + 1 if port.isdigit() and int(port) else 0}"
    return f"{config.listen},{ssl}s"


def tcp_sockets(seen: dict[str, str] | None = None) -> Iterator[socket.socket]:
    """This process's TCP sockets, each as a duplicate of its descriptor (one socket, two
    descriptors: closing the duplicate leaves the connection alone), found in
    /proc/self/fd. With `seen` (fd -> "socket:[inode]", updated): only those not seen."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    if seen is not None:
        for name in set(seen) - set(names):
            del seen[name]
    for name in names:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if not link.startswith("socket:") or (seen is not None and seen.get(name) == link):
            continue
        if seen is not None:
            seen[name] = link
        try:
            dup = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            sock = socket.socket(fileno=dup)
        except OSError:
            os.close(dup)  # not a socket any more
            continue
        with sock:
            if sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6):
                yield sock


def set_nodelay(seen: dict[str, str]) -> int:
    """TCP_NODELAY on every TCP socket of this process not in `seen` (tcp_sockets); how
    many were set. libtorrent sets no TCP_NODELAY on its peer connections, and has no
    setting for it: with Nagle's algorithm on, the last small segment of a piece (and a
    peer's small requests) waits for the other side's delayed ACK, up to 40 ms here, on
    every on-demand read a peer answers. Harmless on the process's other TCP sockets
    (its HTTP clients set it anyway)."""
    done = 0
    for sock in tcp_sockets(seen):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            done += 1
    return done


# libtorrent 2.1's default disk back end (pread_disk_io) can crash its hasher thread when the
# session is destroyed while a piece is being hashed (a use after free in
# disk_cache::kick_hasher: one test run in eight under load on this machine). The mmap back
# end, libtorrent 2.0's default, has no such cache and no such race.
DISK_IO = "mmap_disk_io_constructor"


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
        # ms: with a rate limit, quota goes out in small, smooth steps; without one the
        # 50 wakeups a second of every node's network thread cost its start CPU (docs/p2p.md)
        "tick_interval": 20 if config.upload_rate_limit or config.download_rate_limit else 500,
        "request_queue_time": 10,  # s of requests in flight per peer (default 3): deep pipelines
        "allow_multiple_connections_per_ip": False,
        "anonymous_mode": False,
        "peer_fingerprint": "-SH0100-",
        "ssrf_mitigation": config.ssrf_mitigation,
    }



def route_address(url: str) -> str:
    """The local address this host would use to reach `url`'s host (no packet is sent)."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "127.0.0.1", parsed.port or 80
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        return sock.getsockname()[0]




class PeersGone(TransportError):
    """Pieces a read asked of peers that no connected peer has any more (one left or was
    banned): the read takes them from the fallback at once."""


@dataclass
class Torrent:
    """One blob's torrent. blob, meta, path, tracker, self_ip, added and settled are set
    before the torrent is handed out and never change (any thread may read them); every
    other field belongs to the owner thread (see the module doc)."""

    blob: BlobRef
    meta: TorrentMeta
    path: str
    handle: Any = None  # libtorrent's torrent_handle
    mode: str = "lazy"
    have: bytearray = field(default_factory=bytearray)
    have_count: int = 0
    complete: bool = False  # all pieces present and the file verified
    verifying: bool = False
    hashing: bool = False
    checking: bool = False  # libtorrent checks an earlier run's file (torrent_checked_alert ends it)
    failed: str = ""  # set when the blob did not hash to its digest: the torrent is gone
    waiters: dict = field(default_factory=dict)  # piece -> [Future of bytes] (on-demand reads)
    done: list = field(default_factory=list)  # Futures of download() (bulk)
    inflight: set = field(default_factory=set)  # pieces being fetched from the fallback
    read_when_done: set = field(default_factory=set)  # pieces a read waits for from the fallback
    tracker: str = ""
    rank: tuple = ()  # (rank, of, when) among the blob's downloaders, from the tracker (bulk)
    rank_changed: float = 0.0
    reannounced: float = 0.0
    added: float = 0.0
    tracker_reply: float = 0.0
    tracker_peers: int = -1
    settled: threading.Event = field(default_factory=threading.Event)
    last_progress: float = 0.0  # when this node last got a piece, or its peers more of them (bulk)
    peer_pieces: int = 0  # the connected peers' pieces, summed, at the bulk helper's last look
    last_used: float = 0.0
    self_ip: str = ""
    helper: threading.Thread | None = None  # the bulk helper (p2p/bulk.py)
    cert_renew: float = 0.0  # when to ask for a new peer certificate (SSL torrents); 0: none held
    cert_renewing: bool = False


class Use(NamedTuple):
    """A torrent as a reader finds it (Session.use): its handle for other owner calls,
    and the owner's state of it at that moment."""

    torrent: Torrent
    complete: bool
    failed: str


class Session:
    """A node's libtorrent session and its torrents (see the module doc). Thread-safe:
    every method may be called from any thread unless it says "owner thread";
    close() stops everything."""

    def __init__(self, config: SwarmConfig, metadata: MetadataClient) -> None:
        if not config.storage:
            raise ShoalError("swarm.storage: the torrent storage folder is not set")
        self.config = config
        self.metadata = metadata
        if not config.listen:  # this node's address only: never every interface
            ip = config.advertise_ip or route_address(metadata.url)
            config.listen = f"[{ip}]:6881" if ":" in ip else f"{ip}:6881"
        self.data_dir = os.path.join(config.storage, "data")
        os.makedirs(self.data_dir, exist_ok=True)
        self._cert_dir = os.path.join(config.storage, "certs")
        self._dh = ""
        self._peer_key, self._peer_public = self._make_peer_key()
        self._cert_lock = threading.Lock()
        self._cert_refused: dict[str, float] = {}  # digest -> until when the region is not asked again
        self._clean_partial()
        self.capacity = config.storage_capacity or self._default_capacity()
        self._sockets_seen: dict[str, str] = {}  # fd -> its socket, given TCP_NODELAY (set_nodelay)
        self._torrents: dict[str, Torrent] = {}  # digest -> torrent (owner thread)
        self._by_hash: dict[bytes, Torrent] = {}  # info hash -> torrent (owner thread)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._alert_r, self._alert_w = os.pipe()
        self._cmd_r, self._cmd_w = os.pipe()
        for fd in (self._alert_r, self._alert_w, self._cmd_r, self._cmd_w):
            os.set_blocking(fd, False)
        self._ses: Any = None  # the libtorrent session (owner thread)
        self.stopping = False
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._next_tick = 0.0
        self._add_lock = threading.Lock()  # one metadata fetch and add per blob
        # the swarm's worker threads: fallback fetches (bulk), file checks, certificate renewals
        self.pool = ThreadPoolExecutor(max_workers=config.fallback_threads, thread_name_prefix="swarm-fetch")
        self._lock = threading.Lock()  # counters below, written from any thread
        self.counters = dict.fromkeys((
            "bytes_from_fallback", "pieces_from_fallback", "read_pieces_local", "read_pieces_peers",
            "read_pieces_fallback", "peer_timeouts", "patient_timeouts", "fallback_hash_mismatches", "hash_failures",
            "peers_banned", "tracker_replies", "tracker_errors", "torrents_added", "torrents_completed",
            "torrents_evicted", "blobs_failed", "alerts_dropped", "pieces_resumed", "sparse_reads_passed",
            "stall_help_extents", "peer_gone_pieces"), 0)
        self._uploaded_gone = 0  # payload bytes uploaded by torrents since removed (owner thread)
        self._downloaded_gone = 0
        self.listen_port = 0
        self.ssl_listen_port = 0
        self._thread = threading.Thread(target=self._run, name="shoal-swarm", daemon=True)
        # libtorrent announces through the relay (HTTPS, node token), on its own listen address
        listen_host = config.listen.rpartition(":")[0].strip("[]")
        self.relay = TrackerRelay(metadata.link, source_ip=config.advertise_ip,
                                  bind_ip="127.0.0.1" if listen_host in ("0.0.0.0", "::", "") else listen_host)

    # --- life cycle ---------------------------------------------------------------------

    def start(self) -> Session:
        self._thread.start()
        self._ready.wait(30)
        if self._start_error is not None:
            raise ShoalError(f"swarm: cannot start libtorrent: {self._start_error}")
        self._restore()
        return self

    def close(self) -> None:
        if self.stopping:
            return
        self.stopping = True
        self._wake()
        self._thread.join(timeout=10)
        self.pool.shutdown(wait=False, cancel_futures=True)
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
        with self._cert_lock:
            if not self._peer_key or self._cert_refused.get(blob.digest, 0.0) > time.monotonic():
                return None
        got = self.metadata.certificate(blob, self._peer_public)
        with self._cert_lock:
            if got is None:
                self._cert_refused[blob.digest] = time.monotonic() + _CERT_RETRY
                return None
            self._cert_refused.pop(blob.digest, None)
        cert, ttl = got
        path = os.path.join(self._cert_dir, f"sha256-{blob.digest[7:]}.pem")
        _write_private(path, cert)
        return path, ttl

    def _renew_cert(self, t: Torrent) -> None:
        got = self._peer_cert(t.blob)

        def apply() -> None:
            t.cert_renewing = False
            if got is None:
                t.cert_renew = time.monotonic() + _CERT_RETRY  # keeps the one it has until it expires
                return
            t.handle.set_ssl_certificate(got[0], self._peer_key, self._dh, "")
            t.cert_renew = time.monotonic() + got[1] / 2

        self.call(apply)

    def _default_capacity(self) -> int:
        st = os.statvfs(self.data_dir)
        return int(st.f_bavail * st.f_frsize * 0.25)

    def _clean_partial(self) -> None:
        """Files of an earlier run without a mark are dropped; complete ones (a
        `.complete` mark) are seeded again, partial ones (a `.partial` mark: the blob it
        holds pieces of) are added again, and libtorrent checks every piece of the file
        against the torrent's SHA-1 before it counts (_restore)."""
        for name in os.listdir(self.data_dir):
            if name.endswith(MARKS):
                continue
            if not any(os.path.exists(os.path.join(self.data_dir, name + m)) for m in MARKS):
                os.unlink(os.path.join(self.data_dir, name))

    def _restore(self) -> None:
        """At start: the torrents of an earlier run's files (see _clean_partial)."""
        for name in sorted(os.listdir(self.data_dir)):
            mark = next((m for m in MARKS if name.endswith(m)), None)
            if mark is None or not name.startswith("sha256-"):
                continue
            digest = "sha256:" + name[len("sha256-"):-len(mark)]
            blob_ref = _blob_from_mark(os.path.join(self.data_dir, name), digest)
            if blob_ref is None:
                continue
            try:
                self.ensure(blob_ref)
            except ShoalError as exc:
                log.warning("%s: cannot %s again: %s", digest, "seed" if mark == ".complete" else "resume", exc)

    # --- the owner thread -----------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run fn on the owner thread, after the functions queued before it; its result
        or exception comes back in the future (NotHere once the swarm is stopping)."""
        fut: Future[T] = Future()
        if self.stopping:
            fut.set_exception(NotHere("the swarm is stopping"))
            return fut
        self._commands.put((fn, fut))
        self._wake()
        return fut

    def post(self, fn: Callable[[], object]) -> None:
        """Run fn on the owner thread, not waited for (an exception in it is dropped)."""
        self.call(fn)

    def _wake(self) -> None:
        try:
            os.write(self._cmd_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the thread is awake anyway

    def _run(self) -> None:
        try:
            params = lt.session_params()
            params.settings = session_settings(self.config)  # type: ignore[assignment]  # a settings dict: the stubs know only settings_pack
            params.disk_io_constructor = DISK_IO
            self._ses = lt.session(params)
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
        while not self.stopping:
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

    def _torrent_of(self, a) -> Torrent | None:
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
        elif isinstance(a, lt.torrent_checked_alert):
            t = self._torrent_of(a)
            if t is not None and t.checking:  # an earlier run's file: the pieces that passed their SHA-1
                t.checking = False
                pieces = t.handle.status().pieces
                for p, had in enumerate(pieces):
                    if had and not t.have[p]:
                        t.have[p] = 1
                        t.have_count += 1
                self.count(pieces_resumed=sum(map(bool, pieces)))
                log.info("%s: %d of %d pieces kept from an earlier run", t.blob.digest, t.have_count,
                         t.meta.num_pieces)
                if t.have_count == t.meta.num_pieces and not t.complete and not t.verifying:
                    self._finish(t)
        elif isinstance(a, lt.cache_flushed_alert):
            t = self._torrent_of(a)
            if t is not None and t.verifying and not t.hashing and not t.complete:
                t.hashing = True
                self.pool.submit(self._check_file, t)
        elif isinstance(a, lt.hash_failed_alert):
            self.count(hash_failures=1)
            t = self._torrent_of(a)
            if t is not None:
                t.inflight.discard(a.piece_index)
            log.warning("%s: piece %d failed its hash check", t.blob.digest if t else "?", a.piece_index)
        elif isinstance(a, lt.peer_ban_alert):
            self.count(peers_banned=1)
            log.warning("swarm: banned peer %s (sent bad data)", a.endpoint)
            t = self._torrent_of(a)
            if t is not None:
                self._release_orphans(t)
        elif isinstance(a, lt.tracker_reply_alert):
            self.count(tracker_replies=1)
            t = self._torrent_of(a)
            if t is not None:
                t.tracker_reply, t.tracker_peers = time.monotonic(), a.num_peers
                self._check_settled(t, t.tracker_reply)
        elif isinstance(a, lt.tracker_error_alert):
            self.count(tracker_errors=1)
            log.info("swarm: tracker: %s", a.message())
        elif isinstance(a, (lt.peer_error_alert, lt.peer_disconnected_alert)):
            log.debug("swarm: %s", a.message())
        elif isinstance(a, lt.alerts_dropped_alert):
            self.count(alerts_dropped=1)
            log.error("swarm: libtorrent dropped alerts (queue full)")
        elif isinstance(a, (lt.torrent_error_alert, lt.file_error_alert)):
            t = self._torrent_of(a)
            log.error("swarm: %s", a.message())
            if t is not None:
                self._remove(t, f"storage error: {a.message()}")

    # --- torrents (owner thread) ------------------------------------------------------------

    def _add(self, blob: BlobRef, meta: TorrentMeta, announce: str | None, complete: bool, bulk: bool,
             cert: tuple[str, float] | None = None) -> Torrent:
        existing = self._torrents.get(blob.digest)
        if existing is not None:
            return existing
        self._evict_for(meta.length)
        upstream = self.config.tracker_url or announce
        tracker = self.relay.url_for(upstream) if upstream else None
        path = os.path.join(self.data_dir, meta.name)
        t = Torrent(blob=blob, meta=meta, path=path, have=bytearray(meta.num_pieces))
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
        if not complete:  # what it holds survives a restart (_clean_partial), checked again then
            t.checking = os.path.exists(path)
            _write_mark(path + ".partial", blob)
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
        self.count(torrents_added=1)
        self._next_tick = now  # watch it settle from now on
        return t

    def _remove(self, t: Torrent, why: str, delete: bool = True) -> None:
        if self._torrents.get(t.blob.digest) is not t:
            return
        del self._torrents[t.blob.digest]
        self._by_hash.pop(t.meta.info_hash, None)
        try:
            st = t.handle.status()
            self._uploaded_gone += st.total_payload_upload
            self._downloaded_gone += st.total_payload_download
            self._ses.remove_torrent(t.handle, lt.session.delete_files if delete else 0)
        except Exception as exc:  # noqa: BLE001 - a handle gone already
            log.debug("%s: removing the torrent: %s", t.blob.digest, exc)
        for suffix in MARKS:
            try:
                os.unlink(t.path + suffix)
            except FileNotFoundError:
                pass
        self._fail_waiters(t, NotHere(f"{t.blob.digest}: torrent removed ({why})"))
        log.info("%s: torrent removed: %s", t.blob.digest, why)

    def _release_orphans(self, t: Torrent) -> None:
        """Reads waiting on pieces asked of peers that no connected peer has any more (a
        peer was banned, or left: looked at every tick) get PeersGone now (the on-demand
        read then takes them from the fallback) instead of waiting out `peer_wait` for a
        peer that is gone. Pieces here, in flight from the fallback or still at another
        peer are left alone (a read that waits on a fallback fetch whose piece then failed
        its hash is released too)."""
        if not t.waiters:
            return
        availability = t.handle.piece_availability()
        gone = [p for p in t.waiters if not t.have[p] and p not in t.inflight and availability[p] <= 0]
        if not gone:
            return
        err = PeersGone(f"{t.blob.digest}: no connected peer has piece(s) {', '.join(map(str, gone[:8]))}"
                        f"{' ...' if len(gone) > 8 else ''} any more")
        for p in gone:
            for fut in t.waiters.pop(p):
                _settle(fut, error=err)
        self.count(peer_gone_pieces=len(gone))
        log.info("%s: a peer left: %d pieces asked of peers go to the fallback now", t.blob.digest, len(gone))

    def _fail_waiters(self, t: Torrent, err: BaseException) -> None:
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
            self.count(torrents_evicted=1)
            self._remove(t, "evicted (storage capacity)")

    def _finish(self, t: Torrent) -> None:
        """Every piece is in: once libtorrent has written them (cache_flushed_alert), check
        the file against the blob digest, then seed it."""
        t.verifying = True
        if not self.config.verify_complete:
            self._completed(t, True)
            return
        t.handle.flush_cache()

    def _check_file(self, t: Torrent) -> None:
        try:
            ok = _file_digest(t.path, t.meta.length) == t.blob.digest
        except OSError as exc:
            log.error("%s: cannot read the downloaded blob: %s", t.blob.digest, exc)
            ok = False
        self.call(lambda: self._completed(t, ok))

    def _completed(self, t: Torrent, ok: bool) -> None:
        t.verifying = t.hashing = False
        if self._torrents.get(t.blob.digest) is not t or t.complete:
            return
        if not ok:
            self.count(blobs_failed=1)
            log.error("%s: all pieces passed their SHA-1 but the blob does not hash to its digest: "
                      "dropping the torrent and its metadata", t.blob.digest)
            t.failed = "blob digest mismatch"
            self.metadata.forget(t.blob.digest)
            self._remove(t, "blob digest mismatch")
            return
        t.complete, t.mode = True, "complete"
        _write_mark(t.path + ".complete", t.blob)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(t.path + ".partial")
        self.count(torrents_completed=1)
        for fut in t.done:
            _settle(fut, t.path)
        t.done.clear()
        log.info("%s: complete and verified; seeding", t.blob.digest)

    def _tick(self, now: float) -> None:
        set_nodelay(self._sockets_seen)
        for t in list(self._torrents.values()):
            if t.cert_renew and now >= t.cert_renew and not t.cert_renewing:
                t.cert_renewing = True
                self.pool.submit(self._renew_cert, t)
            if not t.settled.is_set():
                self._check_settled(t, now)
            if not t.complete:  # (a peer that left: libtorrent's disconnect alerts are not in the mask asked for)
                self._release_orphans(t)
            if t.tracker_reply and not t.complete and now - t.added < _LONELY_FOR and \
                    now - t.reannounced >= _LONELY_REANNOUNCE and not t.handle.get_peer_info():
                # alone in a young swarm: nodes that start together may all have been told
                # of nobody; ask again soon instead of after the tracker's interval
                t.reannounced = now
                t.handle.force_reannounce(0, -1, lt.reannounce_flags_t.ignore_min_interval)

    def _check_settled(self, t: Torrent, now: float) -> None:
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

    # --- any thread ---------------------------------------------------------------------------

    def use(self, blob: BlobRef, bulk: bool = False) -> Use | None:
        """The blob's torrent as the owner has it now, added on first use (lazy, or with
        every piece wanted if `bulk`); marks it used (eviction is least recently used
        first). None when no metadata or peer certificate is to be had."""
        got = self.call(lambda: self._use(blob.digest)).result(30)
        if got is not None:
            return got
        with self._add_lock:  # one metadata fetch and add per blob
            got = self.call(lambda: self._use(blob.digest, touch=False)).result(30)
            if got is not None:
                return got
            found = self.metadata.get(blob)
            if found is None:
                return None
            meta, announce = found
            cert = None
            if meta.ssl_cert:  # peers take only nodes the region checked with the origin
                cert = self._peer_cert(blob)
                if cert is None:
                    return None
            complete = os.path.exists(os.path.join(self.data_dir, meta.name + ".complete")) and \
                os.path.getsize(os.path.join(self.data_dir, meta.name)) == meta.length

            def add() -> Use:
                t = self._add(blob, meta, announce, complete, bulk, cert)
                return Use(t, t.complete, t.failed)

            return self.call(add).result(30)

    def ensure(self, blob: BlobRef, bulk: bool = False) -> Torrent | None:
        """The blob's torrent (see use()), or None."""
        got = self.use(blob, bulk)
        return None if got is None else got.torrent

    def touch(self, t: Torrent) -> None:
        """Mark the torrent used now (not waited for)."""
        now = time.monotonic()

        def touch() -> None:
            t.last_used = now

        self.post(touch)

    def has(self, blob: BlobRef) -> str:
        """"complete", "partial" or "" (not in the swarm)."""
        def state() -> str:
            t = self._torrents.get(blob.digest)
            return "" if t is None else ("complete" if t.complete else "partial")

        return self.call(state).result(30)

    def pieces_held(self, blob: BlobRef) -> tuple[int, int]:
        """(pieces of the blob this node holds now, pieces in all); (-1, 0) when the blob
        is not in the swarm: how a waiter on a bulk download sees it move."""
        def held() -> tuple[int, int]:
            t = self._torrents.get(blob.digest)
            return (-1, 0) if t is None else (t.have_count, t.meta.num_pieces)

        return self.call(held).result(30)

    def drop(self, blob: BlobRef, why: str) -> None:
        """Remove the blob's torrent and its storage (not waited for): bytes read from it
        failed their check, so its file is damaged; a later read adds it again."""
        def remove() -> None:
            t = self._torrents.get(blob.digest)
            if t is not None:
                log.error("%s: %s; dropping the torrent and its storage", blob.digest, why)
                self._remove(t, why)

        self.post(remove)

    def count(self, **delta: int) -> None:
        """Add to the counters (statistics())."""
        with self._lock:
            for k, v in delta.items():
                self.counters[k] += v

    def counts(self) -> dict[str, int]:
        """A copy of the counters."""
        with self._lock:
            return dict(self.counters)

    def snapshot(self) -> dict:
        """The owner's view of the torrents and peers now (empty if the owner does not
        answer within 5 s)."""
        try:
            return self.call(self._snapshot).result(5)
        except (FutureTimeout, ShoalError):
            return {}

    # --- owner thread ----------------------------------------------------------------------------

    def _use(self, digest: str, touch: bool = True) -> Use | None:
        t = self._torrents.get(digest)
        if t is None:
            return None
        if touch:
            t.last_used = time.monotonic()
        return Use(t, t.complete, t.failed)

    def is_current(self, t: Torrent) -> bool:
        """Owner thread: `t` is still the blob's torrent (not removed, not replaced)."""
        return self._torrents.get(t.blob.digest) is t

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
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(blob.to_dict(), fh)
    os.replace(tmp, path)


def _blob_from_mark(path: str, digest: str) -> BlobRef | None:
    try:
        with open(path) as fh:
            d = json.load(fh)
        if d.get("digest") != digest:
            return None
        return BlobRef.from_dict(d)
    except (OSError, ValueError, ShoalError):
        return None

