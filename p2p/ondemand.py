"""The swarm's on-demand path: the fetch source a FUSE read waits on (SwarmSource).

Per piece of the ranges asked (the plan is made on the owner thread, p2p/session.py):
  have it        -> read_piece() from local storage
  a peer has it  -> set_piece_deadline(p, 0, alert_when_available): requested at once
  nobody has it  -> fetched from the fallback chain (region, origin) right away, checked
                    against the piece's SHA-1 and add_piece()d, so neighbours take it
                    from this node from then on (p2p/fallback.py).
A patient read (cache.source.PATIENT: a preheat job's part another node fetches first)
first waits for pieces nobody has yet: until a peer has them all, or `peer_wait`
seconds pass without a peer getting one more of them, or PATIENT_MAX in all (an owner
that is down costs that once per read; counted as patient_timeouts); then it plans as
above.
A background read (a preheat's warm-up) of pieces nobody has, that its warm-up's whole
target (cache.source.TARGET) fills to less than SPARSE, is passed on (NotHere, counted as
sparse_reads_passed), before any patient wait (every node of the job passes such pieces
on, so no peer will have them): the chain's next source sends exactly the ranges asked. Fetched
whole, such pieces would cost the origin the bytes around the ranges that nobody will ask
(a profile preheat's region holds the blob to the ranges asked: the origin serves exactly
those); passed on, each node that needs them takes them from the region (coalesced there:
one origin copy). A full warm-up's target is the whole layer: nothing is passed on.
A piece asked of peers that has not come within `peer_wait` seconds is fetched from the
fallback too (libtorrent re-plans deadlines only about once a second, and a peer may be
slow or gone); so is one that no connected peer has any more, at once (the peer that had
it disconnected or was banned: the owner settles such waits with PeersGone). A complete
torrent's reads are pread()s of its file, with no call on the libtorrent session. The
first read of a new torrent waits (at most `settle_wait`) for it to meet its peers rather
than go to the region for pieces a neighbour has. Measured numbers behind this are in
docs/p2p.md.

Threads: read() runs on the caller's thread and blocks; it reaches torrent state only
through the owner (Session.use, one queued plan per read) and waits on the futures the
owner settles when libtorrent's read_piece and piece_finished alerts come in.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import libtorrent as lt

from cache.source import PATIENT, TARGET, BlobRef, Held, NotHere, Source
from p2p.config import SwarmConfig
from p2p.fallback import Fallback
from p2p.metainfo import slice_pieces
from p2p.session import PeersGone, Session, Torrent
from shoal.errors import ShoalError, TransportError

_RECENT = 512  # latency samples kept for statistics()
PATIENT_POLL = 0.05  # seconds between two looks of a patient read at what its peers have
PATIENT_MAX = 5.0  # seconds a patient read waits in all, at most (well within the chain's read deadline)
SPARSE = 0.9  # pieces nobody has that a warm-up's target fills less than this: the read is passed on (module doc)

Plan = tuple[dict[int, Future], dict[int, Future], list[int]]  # (read locally, asked of peers, from the fallback)


class OnDemand:
    """Reads of byte ranges of a blob through the session (see the module doc)."""

    def __init__(self, session: Session, fallback: Fallback, config: SwarmConfig) -> None:
        self.session = session
        self.fallback = fallback
        self.config = config
        self._lock = threading.Lock()  # _peer_waits, from any reading thread
        self._peer_waits: list[float] = []

    def read(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each range (Held: verified piece by piece on the way in). NotHere
        without metadata (or when the blob's swarm failed); TransportError from the
        fallback."""
        use = self.session.use(blob)
        if use is None:
            raise NotHere(f"{blob.digest}: no torrent metadata or peer certificate (yet)")
        t = use.torrent
        if use.failed:
            raise NotHere(f"{blob.digest}: swarm disabled for this blob ({use.failed})")
        ranges = list(ranges)
        pieces = t.meta.pieces_for(ranges)
        if use.complete:
            done = self._read_file(t, pieces)
            if done is not None:
                return [Held(d) for d in slice_pieces(t.meta, done, ranges)]
        if not t.settled.is_set():
            t.settled.wait(self.config.settle_wait)
        target = TARGET.get()
        if target is not None and target.get(blob.digest):  # (before a patient wait: no peer fetches such pieces)
            self._pass_sparse(t, pieces, target[blob.digest])
        if PATIENT.get():
            self._wait_for_peers(t, pieces)
        start = time.monotonic()
        local, asked, fetch = self.session.call(lambda: self._plan(t, pieces)).result(30)
        got: dict[int, bytes] = {}
        if fetch:
            got.update(self.fallback.fetch(t, fetch, keep_inflight=True))
        late, gone = [], []
        for p, fut in list(local.items()) + list(asked.items()):
            try:
                got[p] = fut.result(timeout=max(0.0, start + self.config.peer_wait - time.monotonic())
                                    if p in asked else 30)
            except PeersGone:  # the peers that had it left: no use waiting out peer_wait
                gone.append(p)
            except (FutureTimeout, ShoalError):
                late.append(p)
        if asked:
            self._sample(time.monotonic() - start)
        if late:
            self.session.count(peer_timeouts=len(late))
        if late or gone:
            got.update(self.fallback.fetch(t, late + gone))
        self.session.count(read_pieces_local=len(local), read_pieces_peers=len(asked) - len(late) - len(gone),
                           read_pieces_fallback=len(fetch) + len(late) + len(gone))
        self.session.touch(t)
        return [Held(d) for d in slice_pieces(t.meta, got, ranges)]

    def _wait_for_peers(self, t: Torrent, pieces: list[int]) -> None:
        """A patient read: wait while peers keep getting pieces of `pieces` that nobody
        had (here, in flight, or at a peer), until none is left, or `peer_wait` seconds
        pass without one more, or PATIENT_MAX in all (the module doc)."""
        fewest = len(pieces) + 1  # (it must fall for the wait to go on)
        since = first = time.monotonic()
        while True:
            left = len(self.session.call(lambda: self._nobody_has(t, pieces)).result(30))
            if not left:
                return
            now = time.monotonic()
            if left < fewest:
                fewest, since = left, now
            if now - since >= self.config.peer_wait or now - first >= PATIENT_MAX:
                self.session.count(patient_timeouts=1)
                return
            time.sleep(PATIENT_POLL)

    def _pass_sparse(self, t: Torrent, pieces: list[int], target: list[tuple[int, int]]) -> None:
        """NotHere for a read of pieces nobody has that the warm-up's `target` (sorted
        disjoint ranges of the blob) fills to less than SPARSE (the module doc)."""
        new = self.session.call(lambda: self._nobody_has(t, pieces)).result(30)
        if not new:
            return
        spans = [t.meta.piece_span(p) for p in new]
        total = sum(e - s for s, e in spans)
        wanted = sum(covered(target, s, e) for s, e in spans)
        if wanted < SPARSE * total:
            self.session.count(sparse_reads_passed=1)
            raise NotHere(f"{t.meta.digest}: {len(new)} pieces nobody has, {wanted} of their {total} bytes in the "
                          f"warm-up's target: passed on to be read as asked")

    def _nobody_has(self, t: Torrent, pieces: list[int]) -> list[int]:
        """Owner thread: those of `pieces` no one has (neither here, nor in flight, nor at a peer)."""
        availability = t.handle.piece_availability()
        return [p for p in pieces if not t.have[p] and p not in t.inflight and availability[p] <= 0]

    def _plan(self, t: Torrent, pieces: list[int]) -> Plan:
        """Owner thread: split pieces into: read locally, ask peers (deadline), fetch from
        the fallback (marked in flight: other reads and the bulk helper wait for these)."""
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

    def _read_file(self, t: Torrent, pieces: list[int]) -> dict[int, bytes] | None:
        """The pieces from a complete torrent's file, or None (the file is gone or short)."""
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
        self.session.count(read_pieces_local=len(out))
        return out

    def _sample(self, seconds: float) -> None:
        with self._lock:
            self._peer_waits.append(seconds)
            del self._peer_waits[:-_RECENT]

    def statistics(self) -> dict:
        """peer_wait_p50_ms, peer_wait_p99_ms: how long reads waited for peers (the last
        _RECENT reads that asked any), once there is a sample."""
        with self._lock:
            waits = sorted(self._peer_waits)
        if not waits:
            return {}
        return {"peer_wait_p50_ms": round(waits[len(waits) // 2] * 1000, 1),
                "peer_wait_p99_ms": round(waits[min(len(waits) - 1, int(len(waits) * 0.99))] * 1000, 1)}


def covered(ranges: list[tuple[int, int]], start: int, end: int) -> int:
    """How many bytes of [start, end) the sorted disjoint `ranges` cover."""
    i = max(0, bisect.bisect_right(ranges, (start, start)) - 1)
    n = 0
    while i < len(ranges) and ranges[i][0] < end:
        a, b = ranges[i]
        n += max(0, min(b, end) - max(a, start))
        i += 1
    return n


class SwarmReads(Protocol):
    """What SwarmSource needs of the swarm (p2p/swarm.py Swarm)."""

    def read(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]: ...

    def drop(self, blob: BlobRef, why: str) -> None: ...

    def close(self) -> None: ...


class SwarmSource(Source):
    """The swarm as a fetch source: ranges from local storage and peers, and what no peer
    has from the fallback chain (the bytes then join the swarm). NotHere when the blob has
    no torrent metadata (the chain goes on to the region and origin)."""

    name = "swarm"

    def __init__(self, swarm: SwarmReads) -> None:
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
