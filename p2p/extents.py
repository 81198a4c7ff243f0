"""Who fetches which part of a blob from the region first: extent assignment for the
bulk path (p2p/bulk.py), pure, beside the hashes it rests on.

Vocabulary: an *extent* is a run of `per` consecutive pieces (the bulk path's
`fallback_extent` bytes: one region request); a *downloader* is a node fetching the
blob whole; an extent is *missing* for a node when some piece of it is neither here,
nor in flight, nor had by any connected peer.

Owners:
- With a rank from the tracker (p2p/tracker/peers.py: rank r of n downloaders), extent
  e belongs to the downloader ranked jump_hash(extent_key(info_hash, e), n). Every
  downloader of the blob agrees, however few of them it sees, so the region serves each
  extent once; one arriving or leaving moves ~1/n of the extents.
- Without one (the tracker gives no ranks, or no longer answers), to the candidate
  (this node and the connected peers that download too) with the highest rendezvous
  score: nodes with the same view agree.
- While the group is settling (young download; the rank changed within GROUP_SETTLE,
  or the tracker counts fewer downloaders than this node sees; or the first rank is on
  its way), nobody fetches.
- A stalled swarm (no piece for stall_timeout: an owner gone or failing): a few nodes
  at random (about HELPERS per stall period, however big the swarm) take extents nobody
  has, whoever owns them. "No piece" means none for this node and none more for its
  peers (progress()): a node that gets nothing for a while (a busy machine, links full)
  while its peers' owners bring their extents in is not stalled, and helping then
  would fetch from the region extents their owners are fetching.

assign() takes everything it needs as arguments (randomness too) and raises nothing.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass

HELPERS = 4  # nodes that help a stalled swarm per stall period, about
GROUP_SETTLE = 0.3  # a new bulk download starts fetching once its rank held this long ...
GROUP_SETTLE_MAX = 3.0  # ... or this long after it began
RANK_FRESH = 6.0  # a rank older than this is not used


def jump_hash(key: int, buckets: int) -> int:
    """Lamping and Veach's jump consistent hash: key -> 0..buckets-1, uniform, and
    growing buckets by one moves only 1/buckets of the keys (all to the new bucket)."""
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & 0xFFFFFFFFFFFFFFFF
        j = int((b + 1) * ((1 << 31) / ((key >> 33) + 1)))
    return b


def extent_key(info_hash: bytes, extent: int) -> int:
    return int.from_bytes(hashlib.blake2b(info_hash + extent.to_bytes(8, "big"), digest_size=8).digest(), "big")


def rendezvous(info_hash: bytes, extent: int, ip: str) -> bytes:
    """Highest-random-weight score of a node for an extent (a node's own view, when
    the tracker gives no rank: few candidates, so the O(candidates) cost is fine)."""
    return hashlib.blake2b(info_hash + extent.to_bytes(8, "big") + ip.encode(), digest_size=8).digest()


@dataclass(frozen=True)
class Assignment:
    """What assign() hands this node: (extent, its missing pieces) to fetch now, why
    ("owner" or "stalled"), and the rank it decided by (-1 without one) of `group`."""

    todo: list[tuple[int, list[int]]]
    why: str
    rank: int
    group: int


NOTHING = Assignment([], "owner", -1, 0)


def progress(last_progress: float, seen: int, availability: Sequence[int], now: float) -> tuple[float, int]:
    """(last_progress, seen) after a look at the connected peers' pieces: `seen` is
    their sum at the last look; when it has grown, the swarm moved (now). A peer that
    leaves takes its pieces out of the sum: that is no progress, and the sum goes on
    from there."""
    total = sum(availability)
    return (now if total > seen else last_progress), total


def assign(*, info_hash: bytes, num_pieces: int, per: int, have: Sequence[int], inflight: Collection[int],
           availability: Sequence[int], running: Collection[int], me: str, candidates: Collection[str],
           rank: tuple[int, int, float] | tuple[()], rank_changed: float, ranks_expected: bool, now: float,
           added: float, last_progress: float, stall_timeout: float, limit: int,
           rng: random.Random | None = None) -> Assignment:
    """The extents (at most `limit`) this node should fetch from the fallback now.

    have/availability: per piece, this node has it / how many connected peers have it;
    inflight: pieces being fetched already; running: extents this node is fetching;
    candidates: `me` and the connected downloaders (not seeds, not upload-only); rank:
    (rank, of, when) from the tracker, or (); rank_changed: when it last changed;
    ranks_expected: the tracker gives ranks (so a young download waits for its first);
    times in time.monotonic() seconds. rng: the stall roll and the order extents are
    taken in (default: the random module's)."""
    roll, shuffle = (rng.random, rng.shuffle) if rng is not None else (random.random, random.shuffle)
    young = now - added < GROUP_SETTLE_MAX
    if rank and now - rank[2] < RANK_FRESH:
        my_rank, group = rank[0], rank[1]
        if young and (now - rank_changed < GROUP_SETTLE or group < len(candidates)):
            return NOTHING  # downloaders are still arriving: let the group settle first

        def owned(extent: int) -> bool:
            return jump_hash(extent_key(info_hash, extent), group) == my_rank
    elif young and ranks_expected and not rank:
        return NOTHING  # the first rank is on its way
    else:  # the tracker gives no ranks (or no longer answers): this node's own view
        my_rank, group = -1, len(candidates)

        def owned(extent: int) -> bool:
            return max(candidates, key=lambda ip: rendezvous(info_hash, extent, ip)) == me
    mine: list[tuple[int, list[int]]] = []
    others: list[tuple[int, list[int]]] = []
    for extent in range(-(-num_pieces // per)):
        pieces = range(extent * per, min(num_pieces, (extent + 1) * per))
        if extent in running:
            continue
        missing = [p for p in pieces if not have[p] and p not in inflight and availability[p] == 0]
        if missing:
            (mine if owned(extent) else others).append((extent, missing))
    stalled = now - last_progress > stall_timeout and roll() < HELPERS / group
    why = "owner"
    if not mine and others and stalled:
        mine, why = others, "stalled"
    shuffle(mine)
    return Assignment(mine[:limit], why, my_rank, group)
