"""Assembly of a node's data path from its configuration: chunk store, fetch chain
(swarm, region, origin: whichever are configured, in that order), single flight."""

from __future__ import annotations

import logging
import os
from typing import Callable

from cache.origin import OriginSource
from cache.source import BlobRef, FetchChain, Source
from snapshotter.fetch import MemoryChunkCache, NodeChunkLoader, SingleFlight, WriteBehind

log = logging.getLogger("shoal.node")


def make_chain(config: dict) -> FetchChain:
    sources: list[Source] = []
    region = config.get("region_url")
    if region:
        from cache.region.client import RegionSource

        sources.append(RegionSource(region))
    sources.append(OriginSource(plain_http_hosts=config.get("plain_http_hosts", [])))
    if config.get("swarm", {}).get("enabled", False):  # the swarm first (p2p/node.py, docs/p2p.md)
        from p2p.node import swarm_chain

        return swarm_chain(sources, config)
    return FetchChain(sources)


def make_store(root: str, config: dict):
    try:
        from cache.store import ChunkStore
    except ImportError:
        log.warning("no chunk store available; chunks are cached in memory only")
        return MemoryChunkCache()
    capacity = config.get("store_capacity")
    return ChunkStore(os.path.join(root, "chunks"), capacity=capacity) if capacity else ChunkStore(
        os.path.join(root, "chunks"))


def make_loader_factory(root: str, config: dict) -> tuple[Callable[[BlobRef, str], NodeChunkLoader], Callable[[], dict]]:
    chain = make_chain(config)
    store = make_store(root, config)
    if not isinstance(store, MemoryChunkCache):
        store = WriteBehind(store)
    flight = SingleFlight()

    def factory(blob: BlobRef, name: str) -> NodeChunkLoader:
        return NodeChunkLoader(blob, chain, store, flight, name)

    def stats() -> dict:
        out = {"sources": chain.statistics(), "single_flight_waits": flight.waits}
        if hasattr(store, "statistics"):
            out["store"] = store.statistics()
        return out

    return factory, stats
