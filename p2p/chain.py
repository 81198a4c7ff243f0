"""The swarm in a node's fetch chain (called from snapshotter/assemble.py).

    chain = swarm_chain([region, origin], config)   # config["swarm"] enables it

gives a FetchChain whose sources are [swarm, region, origin]. The swarm's own fallback
for pieces that no peer has is a chain of the same region and origin sources, fetched
piece-aligned so that what comes from the region joins the swarm (add_piece). When the
swarm has no metadata for a blob it says NotHere and the outer chain reads the region
and origin directly, as without a swarm.

statistics() of the returned chain keeps FetchChain's shape ({source: counters}) with
bytes of both paths added up per source, plus a "swarm" entry carrying the swarm's
figures (bytes from peers, local storage and fallback, uploads, peers connected).

The chain exposes its swarm's control ops (`control`, p2p/control.py: the bulk path,
download a layer's whole blob through the swarm, for prefetch hooks and tests, and the
figures), which the node's control socket serves (snapshotter/fs/control.py), in the
process that owns the swarm.
`resolve_layer` (from the snapshotter side, p2p.control.ResolveLayer) names the blobs
of the node's layers for `download`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from cache.region.client import RegionLink
from cache.source import FetchChain, Source
from p2p.config import SwarmConfig
from p2p.control import Control, ResolveLayer
from p2p.ondemand import SwarmSource
from p2p.swarm import Swarm
from p2p.tracker.client import MetadataClient
from shoal.config import DEFAULT_ROOT
from shoal.errors import ShoalError

log = logging.getLogger("shoal.swarm")

DEFAULT_STORAGE = os.path.join(DEFAULT_ROOT, "swarm")


@dataclass
class SwarmChain(FetchChain):
    """A FetchChain with the swarm first; `fallback` is the swarm's own region/origin chain."""

    swarm: Swarm | None = None
    fallback: FetchChain | None = None
    control: Control | None = None
    _closed: bool = field(default=False, repr=False)

    def statistics(self) -> dict[str, dict]:
        out = super().statistics()
        if self.fallback is not None:
            for name, counts in self.fallback.statistics().items():
                mine = out.setdefault(name, dict.fromkeys(counts, 0))
                for k, v in counts.items():
                    mine[k] = mine.get(k, 0) + v
        if self.swarm is not None:
            out.setdefault("swarm", {}).update(self.swarm.statistics())
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        super().close()  # closes the swarm source (and so the session) and the others


def make_swarm(config: dict, fallback: FetchChain | None) -> Swarm:
    """A started Swarm from the node configuration (`swarm` table; `region_url`)."""
    sc = SwarmConfig.from_dict(config.get("swarm"))
    if not sc.storage:
        sc.storage = os.path.join(config["root"], "swarm") if config.get("root") else DEFAULT_STORAGE
    url = sc.metadata_url or config.get("region_url") or ""
    if not url:
        raise ShoalError("swarm: no metadata service (set swarm.metadata_url or region_url)")
    metadata = MetadataClient(RegionLink.from_config(config, url, with_token=True), os.path.join(sc.storage, "meta"))
    return Swarm(sc, metadata, fallback).start()


def swarm_chain(sources: list[Source], config: dict, resolve_layer: ResolveLayer | None = None) -> FetchChain:
    """[swarm, *sources] if the swarm can start; else the sources alone (logged)."""
    fallback = FetchChain(list(sources))
    try:
        swarm = make_swarm(config, fallback)
    except (ShoalError, OSError) as exc:
        if (config.get("swarm") or {}).get("required", True):
            raise ShoalError(f"swarm cannot start: {exc} (with [swarm] required = false the node runs "
                             "without it)") from None
        log.error("swarm disabled: %s", exc)
        return FetchChain(list(sources))
    chain = SwarmChain([SwarmSource(swarm), *sources], swarm=swarm, fallback=fallback)
    chain.control = Control(chain, swarm, resolve_layer)
    return chain
