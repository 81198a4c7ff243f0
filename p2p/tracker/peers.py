"""The tracker's peer table, pure (no I/O): who is in which swarm, and whom to tell.

Vocabulary: a *swarm* is the set of peers announcing one info hash; a *peer* is one
node's libtorrent session, keyed by the address others reach it at (ip, port), so a
restarted node replaces its old entry instead of adding a ghost.

Rules (HTTP announce, BEP 3):
- `started` or a regular announce adds or refreshes the peer; `stopped` removes it;
  `completed` counts a download. A peer is forgotten `peer_ttl` seconds after its last
  announce (default 2.5 announce intervals: one lost announce is not enough).
- The answer lists up to `numwant` (capped at `max_answer`) other peers, chosen at
  random so that a fan-out of many nodes spreads over the swarm instead of piling
  onto its first members; a seed (left == 0) is told only about peers still
  downloading, since seeds have nothing to exchange.
- Ranks (shoal's own addition, not BitTorrent): a node downloading a whole blob asks
  for its rank among the nodes doing the same (rank()), and repeats while it downloads;
  an entry not renewed within `rank_ttl` seconds is dropped. Ranks are 0..n-1 in
  order of arrival; a leaver's rank goes to the last arrival. With a consistent hash
  over ranks (p2p/extents.py: jump_hash), every node computes the same owner for each part of the blob
  that nobody has yet, so the region serves it once however many nodes there are and
  however few of them any one node is connected to; and a node arriving or leaving
  moves only about 1/n of the parts to another owner.
- Ranks belong to announced peers: rank() takes the address the request came from and
  accepts a port only if that (ip, port) has announced the swarm, so a host ranks at most
  the peers it announced. One address announces at most `max_ports_per_ip` ports per
  swarm (several nodes behind one address are rare; a host inventing downloaders is not).
- Bounded: at most `max_swarms` swarms (the least recently announced one is forgotten,
  with its ranks and download count, to make room; counted as `swarms_evicted`), at most
  `max_swarm` peers per swarm, `max_ports_per_ip` per address and swarm.
- The table is soft state. After a tracker restart it is empty until the peers'
  next announces (at most one interval): connected peers keep their connections
  meanwhile, and nodes read from the region for what no connected peer has.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

EVENTS = ("", "started", "stopped", "completed", "paused")


@dataclass
class Peer:
    ip: str
    port: int
    left: int
    seen: float


@dataclass
class Answer:
    peers: list[tuple[str, int]]
    complete: int
    incomplete: int


@dataclass
class PeerTable:
    interval: int = 60  # seconds between announces we ask of peers
    min_interval: int = 10  # the shortest we accept (forced reannounces)
    peer_ttl: float | None = None  # None: 2.5 announce intervals (ttl below)
    max_answer: int = 100
    max_swarm: int = 100_000
    max_swarms: int = 100_000
    max_ports_per_ip: int = 8
    rng: random.Random = field(default_factory=random.Random)

    rank_ttl: float = 10.0

    def __post_init__(self) -> None:
        self.ttl: float = 2.5 * self.interval if self.peer_ttl is None else self.peer_ttl  # seconds a peer is kept
        self.peer_ttl = self.ttl
        self._swarms: dict[bytes, dict[tuple[str, int], Peer]] = {}
        self._downloads: dict[bytes, int] = {}
        self._bulk: dict[bytes, dict[tuple[str, int], float]] = {}  # info hash -> {(ip, port): last ask}
        self._ranks: dict[bytes, list[tuple[str, int]]] = {}  # info hash -> downloaders by rank
        self.announces = 0
        self.rank_requests = 0
        self.refused = 0  # announces and rank requests refused by the bounds above
        self.swarms_evicted = 0

    def rank(self, info_hash: bytes, ip: str, port: int | None, now: float) -> tuple[int, int]:
        """(rank, number) of this downloader among those of the swarm (see the module doc).
        ValueError when (ip, port) has not announced the swarm; `port` may be None when
        the address announced one port only."""
        if len(info_hash) != 20:
            raise ValueError("info_hash must be 20 bytes")
        self.rank_requests += 1
        swarm = self._swarms.get(info_hash) or {}
        ports = [k[1] for k in swarm if k[0] == ip]
        if port is None and len(ports) == 1:
            port = ports[0]
        if port not in ports:
            self.refused += 1
            raise ValueError(f"{ip}:{port if port is not None else '?'} has not announced this torrent")
        key = (ip, port)
        if swarm[key].left == 0:  # a rank request that crossed its own completion announce
            self.refused += 1
            raise ValueError(f"{ip}:{port} announced the whole blob: a seed has no rank among the downloaders")
        bulk = self._bulk.setdefault(info_hash, {})
        ranks = self._ranks.setdefault(info_hash, [])
        limit = now - self.rank_ttl
        for k in [k for k, seen in bulk.items() if seen < limit and k != key]:
            self._drop(info_hash, k)
        if key not in bulk:
            ranks.append(key)
        bulk[key] = now
        return ranks.index(key), len(ranks)

    def _drop(self, info_hash: bytes, key: tuple[str, int]) -> None:
        bulk, ranks = self._bulk.get(info_hash), self._ranks.get(info_hash)
        if not bulk or bulk.pop(key, None) is None:
            return
        assert ranks is not None  # kept with bulk
        i = ranks.index(key)
        last = ranks.pop()
        if i < len(ranks):
            ranks[i] = last  # the last arrival takes the leaver's rank: only two nodes' ranks change
        if not ranks:
            del self._bulk[info_hash], self._ranks[info_hash]

    def done(self, info_hash: bytes, ip: str, port: int) -> None:
        """The node stopped downloading the blob (completed or stopped)."""
        self._drop(info_hash, (ip, port))

    def announce(self, info_hash: bytes, ip: str, port: int, left: int, event: str, numwant: int,
                 now: float) -> Answer:
        if len(info_hash) != 20:
            raise ValueError("info_hash must be 20 bytes")
        if not 0 < port < 65536:
            raise ValueError(f"port {port} out of range")
        if event not in EVENTS:
            raise ValueError(f"unknown event {event!r}")
        self.announces += 1
        key = (ip, port)
        swarm = self._swarms.get(info_hash)
        if event in ("stopped", "completed") or left == 0:
            self.done(info_hash, ip, port)
        if event == "stopped":
            if swarm is not None:
                swarm.pop(key, None)
                if not swarm:
                    del self._swarms[info_hash]
            return Answer([], *self._counts(swarm or {}))
        if swarm is None:
            if len(self._swarms) >= self.max_swarms:
                self._evict_swarm()
            swarm = self._swarms[info_hash] = {}
        else:  # most recently announced last: eviction takes the first
            self._swarms[info_hash] = self._swarms.pop(info_hash)
        if key not in swarm and sum(1 for k in swarm if k[0] == ip) >= self.max_ports_per_ip:
            self.refused += 1
            raise ValueError(f"{ip} announces more than {self.max_ports_per_ip} ports for this torrent")
        if key not in swarm and len(swarm) >= self.max_swarm:
            self._expire_swarm(swarm, now)
        if key in swarm or len(swarm) < self.max_swarm:
            swarm[key] = Peer(ip, port, max(left, 0), now)
        if event == "completed":
            self._downloads[info_hash] = self._downloads.pop(info_hash, 0) + 1
            while len(self._downloads) > self.max_swarms:
                del self._downloads[next(iter(self._downloads))]
        want = max(0, min(numwant, self.max_answer))
        limit = now - self.ttl
        others = [p for k, p in swarm.items() if k != key and p.seen >= limit and not (left == 0 and p.left == 0)]
        chosen = others if len(others) <= want else self.rng.sample(others, want)
        return Answer([(p.ip, p.port) for p in chosen], *self._counts(swarm))

    def _evict_swarm(self) -> None:
        """Forget the least recently announced swarm, with its ranks and download count."""
        info_hash = next(iter(self._swarms))
        del self._swarms[info_hash]
        self._bulk.pop(info_hash, None)
        self._ranks.pop(info_hash, None)
        self._downloads.pop(info_hash, None)
        self.swarms_evicted += 1

    @staticmethod
    def _counts(swarm: dict) -> tuple[int, int]:
        complete = sum(1 for p in swarm.values() if p.left == 0)
        return complete, len(swarm) - complete

    def _expire_swarm(self, swarm: dict, now: float) -> None:
        limit = now - self.ttl
        for k in [k for k, p in swarm.items() if p.seen < limit]:
            del swarm[k]

    def expire(self, now: float) -> int:
        """Forget peers that stopped announcing; returns how many."""
        gone = 0
        for info_hash in list(self._swarms):
            swarm = self._swarms[info_hash]
            before = len(swarm)
            self._expire_swarm(swarm, now)
            gone += before - len(swarm)
            if not swarm:
                del self._swarms[info_hash]
        for info_hash in list(self._bulk):
            if info_hash not in self._swarms:  # its peers are gone: so are its ranks
                self._bulk.pop(info_hash, None)
                self._ranks.pop(info_hash, None)
                continue
            for k in [k for k, seen in self._bulk[info_hash].items() if seen < now - self.rank_ttl]:
                self._drop(info_hash, k)
        return gone

    def scrape(self, info_hash: bytes) -> tuple[int, int, int]:
        """(complete, incomplete, downloaded) of one swarm."""
        complete, incomplete = self._counts(self._swarms.get(info_hash, {}))
        return complete, incomplete, self._downloads.get(info_hash, 0)

    def statistics(self) -> dict:
        return {
            "swarms": len(self._swarms),
            "peers": sum(len(s) for s in self._swarms.values()),
            "announces": self.announces,
            "downloading": sum(len(b) for b in self._bulk.values()),
            "rank_requests": self.rank_requests,
            "refused": self.refused,
            "swarms_evicted": self.swarms_evicted,
            "ranked_swarms": len(self._ranks),
            "download_counts": len(self._downloads),
        }
