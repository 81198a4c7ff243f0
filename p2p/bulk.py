"""The swarm's bulk path: a whole blob through the swarm (prefetch, background
completion, `download()`), and what this node fetches of it from the region.

libtorrent downloads from peers (rarest first) with every piece wanted, while a helper
thread per torrent fetches from the fallback only pieces that no connected peer has and
that this node owns: pieces are grouped in extents (`fallback_extent`, one region
request each) and p2p/extents.py decides whose each extent is (a rank from the tracker,
else this node's own view; a group that is still settling fetches nothing yet; a
stalled swarm gets help). The download completes when the file is whole and verified
against the blob's sha256 (p2p/session.py); then it is seeded.

Threads: the helper (`swarm-bulk`, one per bulk torrent) asks the tracker for its rank
(p2p/tracker/client.py RankClient) and starts fallback fetches on the session's pool;
it reads and writes torrent state only through functions it queues to the owner
(_active, _set_rank, _assign, run there in the order queued).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from functools import partial

import libtorrent as lt

from cache.source import BlobRef, NotHere
from p2p import extents
from p2p.config import SwarmConfig
from p2p.fallback import Fallback
from p2p.session import Session, Torrent
from p2p.tracker.client import RankClient, rank_url
from shoal.errors import ShoalError

log = logging.getLogger("shoal.swarm")

_RANK_EVERY = 2.0  # seconds between rank requests of a bulk download (tracker keeps them 10 s)
_RANK_TIMEOUT = 0.5
_HELPER_PERIOD = 0.25  # seconds between bulk helper scans when no fetch ended


class Bulk:
    """Whole-blob downloads through the session. fallback: where pieces nobody has come
    from, or None (peers only: no helper)."""

    def __init__(self, session: Session, fallback: Fallback | None, config: SwarmConfig) -> None:
        self.session = session
        self.fallback = fallback
        self.config = config
        self.ranks = RankClient(timeout=_RANK_TIMEOUT)

    def download(self, blob: BlobRef, timeout: float | None = None) -> str:
        """The whole blob through the swarm (fallback for what no peer has); returns the
        path of the complete, verified file. NotHere without metadata."""
        return self.start_download(blob).result(timeout)

    def start_download(self, blob: BlobRef) -> Future:
        """download() without waiting: the Future of the file's path."""
        t = self.session.ensure(blob, bulk=True)
        if t is None:
            raise NotHere(f"{blob.digest}: no torrent metadata or peer certificate (yet)")
        fut = self.session.call(lambda: self._start_bulk(t)).result(30)
        if self.fallback is not None:
            self.session.call(lambda: self._start_helper(t)).result(30)
        return fut

    # --- owner thread ------------------------------------------------------------------------

    def _start_bulk(self, t: Torrent) -> Future:
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

    def _start_helper(self, t: Torrent) -> None:
        if t.helper is None or not t.helper.is_alive():
            t.helper = threading.Thread(target=self._helper, args=(t,), name="swarm-bulk", daemon=True)
            t.helper.start()

    def _active(self, t: Torrent) -> bool:
        """The helper goes on: the torrent is still there, in bulk mode, not complete."""
        return self.session.is_current(t) and not t.complete and not t.verifying and t.mode == "bulk"

    def _set_rank(self, t: Torrent, rank: tuple[int, int, float]) -> None:
        if not t.rank or t.rank[:2] != rank[:2]:
            t.rank_changed = rank[2]
            # (a change moves extents between owners: one the last owner is fetching may
            # then come from the region twice)
            log.info("%s: rank %d of %d among the blob's downloaders (was %s; %d of %d pieces here)",
                     t.blob.digest, rank[0], rank[1], f"{t.rank[0]} of {t.rank[1]}" if t.rank else "none",
                     t.have_count, t.meta.num_pieces)
        t.rank = rank

    def _assign(self, t: Torrent, limit: int, running: set[int]) -> list[tuple[int, list[int]]]:
        """Extents (with their missing pieces) this node should fetch from the fallback now:
        once the torrent knows its swarm, whatever p2p/extents.py gives it (marked in flight)."""
        if not t.settled.is_set():
            return []
        peers = t.handle.get_peer_info()
        now = time.monotonic()
        availability = t.handle.piece_availability()
        t.last_progress, t.peer_pieces = extents.progress(t.last_progress, t.peer_pieces, availability, now)
        if not peers and now - t.added < self.config.settle_wait:
            return []  # alone so far: nodes that start with us may connect in a moment
        if t.tracker_reply and now - t.tracker_reply < self.config.settle_wait \
                and now - t.last_progress <= self.config.stall_timeout:
            # bulk waits to know the swarm: every peer the tracker named connected and
            # past its handshake (so its bitfield is in), or settle_wait gone by. Not
            # when stalled: a peer the tracker goes on naming may never connect (banned
            # for bad pieces, or unreachable), and a lonely torrent's re-announces
            # every second would keep the wait going for good.
            ready = [p for p in peers if not p.flags & (lt.peer_info.connecting | lt.peer_info.handshake)]
            if len(ready) < min(t.tracker_peers, self.config.connections_limit) or len(ready) < len(peers):
                return []
        me = t.self_ip or "self"
        candidates = {me} | {p.ip[0] for p in peers
                             if not p.flags & (lt.peer_info.seed | lt.peer_info.upload_only
                                               | lt.peer_info.connecting | lt.peer_info.handshake)}
        got = extents.assign(
            info_hash=t.meta.info_hash, num_pieces=t.meta.num_pieces,
            per=max(1, self.config.fallback_extent // t.meta.piece_length), have=t.have, inflight=t.inflight,
            availability=availability, running=running, me=me, candidates=candidates,
            rank=t.rank, rank_changed=t.rank_changed, ranks_expected=rank_url(t.tracker) is not None, now=now,
            added=t.added, last_progress=t.last_progress, stall_timeout=self.config.stall_timeout, limit=limit)
        for extent, missing in got.todo:
            t.inflight.update(missing)
            log.debug("%s: extent %d (%d pieces) from the fallback (%s; rank %d of %d)",
                      t.blob.digest, extent, len(missing), got.why, got.rank, got.group)
        if got.why != "owner" and got.todo:
            # (a stalled swarm: no piece for stall_timeout; an owner is gone, failing, or
            # slow enough to look gone, so the region may serve these pieces twice)
            log.info("%s: no piece for %.1fs: fetching %d extents this node does not own from the fallback "
                     "(%d pieces; rank %d of %d)", t.blob.digest, now - t.last_progress, len(got.todo),
                     sum(len(m) for _, m in got.todo), got.rank, got.group)
            self.session.count(stall_help_extents=len(got.todo))
            t.last_progress = now  # one round of help per stall period
        return got.todo

    # --- the helper thread ---------------------------------------------------------------------

    def _helper(self, t: Torrent) -> None:
        """Feeds a bulk torrent from the fallback with the extents this node owns. Looks
        again when a fetch ends, else every _HELPER_PERIOD (peers come and go, pieces
        arrive): the scan is O(pieces) in Python, so not in a tight loop."""
        assert self.fallback is not None
        running: dict[int, Future] = {}
        errors = 0
        asked = 0.0
        wake = threading.Event()
        while not self.session.stopping:
            try:
                if not self.session.call(lambda: self._active(t)).result(30):
                    break
            except ShoalError:
                break
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
                    todo = self.session.call(partial(self._assign, t, free, set(running))).result(30)
                except ShoalError:
                    break
                for extent, pieces in todo:
                    running[extent] = fut = self.session.pool.submit(self._fetch_extent, t, pieces)
                    fut.add_done_callback(lambda _: wake.set())
            wake.wait(_HELPER_PERIOD if errors < 3 else 1.0)
            wake.clear()

    def _ask_rank(self, t: Torrent) -> None:
        """This node's rank among the blob's downloaders (p2p/tracker/peers.py), handed to
        the owner; left unset when the tracker cannot say (then the local view decides)."""
        port = self.session.ssl_listen_port if t.meta.ssl_cert else self.session.listen_port  # the one announced
        got = self.ranks.rank(t.tracker, t.meta.info_hash, port, t.blob.digest)
        if got is not None:
            rank = (got[0], got[1], time.monotonic())
            self.session.post(lambda: self._set_rank(t, rank))

    def _fetch_extent(self, t: Torrent, pieces: list[int]) -> None:
        """Pieces stay in `inflight` until libtorrent reports them (piece_finished or
        hash_failed), so that no helper round fetches them again meanwhile."""
        assert self.fallback is not None
        try:
            self.fallback.fetch(t, pieces, keep_inflight=True)
        except ShoalError as exc:
            log.warning("%s: fallback fetch of %d pieces failed: %s", t.blob.digest, len(pieces), exc)
            raise
