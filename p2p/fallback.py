"""Pieces from the swarm's fallback chain (the region, then the origin): fetched as
whole pieces, each checked against its SHA-1 in the torrent and added to the torrent, so
that peers take it from this node from then on. Used by the on-demand path
(p2p/ondemand.py) and the bulk path (p2p/bulk.py).

Threads: fetch() blocks (HTTP) and runs on the caller's thread, never the owner's; what
it changes of a torrent (its pieces, `inflight`) it queues to the owner (p2p/session.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection

from cache.source import FetchChain, NotHere, RangesFailed
from p2p.session import Session, Torrent
from shoal.errors import TransportError


class Fallback:
    """session: the swarm's session; chain: the fallback FetchChain, or None (then
    every fetch is NotHere)."""

    def __init__(self, session: Session, chain: FetchChain | None) -> None:
        self.session = session
        self.chain = chain

    def fetch(self, t: Torrent, pieces: Collection[int], keep_inflight: bool = False) -> dict[int, bytes]:
        """Whole pieces from the fallback chain; each checked against its SHA-1 and added
        to the torrent (so peers can take it from here). Raises TransportError/NotHere
        (RangesFailed: the pieces that passed still join the torrent).
        keep_inflight: the caller marked the pieces in flight; they stay so until
        libtorrent reports them in (or are unmarked here if they cannot be added)."""
        try:
            return self._fetch(t, pieces)
        except BaseException:
            if keep_inflight:
                unmark = list(pieces)
                self.session.post(lambda: t.inflight.difference_update(unmark))
            raise

    def _fetch(self, t: Torrent, pieces: Collection[int]) -> dict[int, bytes]:
        if self.chain is None:
            raise NotHere(f"{t.blob.digest}: no peer has the pieces and there is no fallback")
        spans: list[list[int]] = []  # runs of consecutive pieces
        for p in sorted(set(pieces)):
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
                    self.session.count(fallback_hash_mismatches=1)
                    raise TransportError(f"{t.blob.digest}: piece {p} ([{s}, {e})) does not match the torrent's SHA-1")
            return pieces

        out: dict[int, bytes] = {}
        try:
            for span in self.chain.read_ranges(t.blob, ranges, check):
                out.update(span)
        except RangesFailed as exc:  # the spans that passed still join the torrent
            for span in exc.served.values():
                out.update(span)
            raise
        finally:
            if out:
                good = list(out.items())
                self.session.post(lambda: self._add_pieces(t, good))
                self.session.count(pieces_from_fallback=len(out), bytes_from_fallback=sum(map(len, out.values())))
        return out

    def _add_pieces(self, t: Torrent, pieces: list[tuple[int, bytes]]) -> None:
        """Owner thread."""
        if not self.session.is_current(t):
            return
        for p, data in pieces:
            if t.have[p]:
                t.inflight.discard(p)
            else:
                t.handle.add_piece(p, data, 0)
