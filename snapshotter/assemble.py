"""Assembly of a node's data path from its configuration: chunks in memory, chunk store,
fetch chain (swarm, region, origin: whichever are configured, in that order), single
flight."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cache.loader import NodeChunkLoader, SingleFlight, WriteBehind
from cache.memory import ChunkMemory
from cache.origin import OriginSource
from cache.source import BlobRef, Check, FetchChain, Source

if TYPE_CHECKING:
    from cache.store import ChunkStore

log = logging.getLogger("shoal.node")


DEFAULT_READ_DEADLINE = 20.0
DEFAULT_SOURCE_BACKOFF = 10.0


ControlOps = Callable[[dict], dict]  # a control request -> its answer (shoal/localrpc.py)


def make_chain(config: dict) -> FetchChain:
    """The chain, every read of it bounded by `read_deadline` seconds; a source that
    hangs is skipped for `source_backoff` seconds (up to 3 times that after hangs in a
    row; cache/source.py)."""
    return make_chain_and_swarm_ops(config)[0]


def make_chain_and_swarm_ops(config: dict) -> tuple[FetchChain, ControlOps | None]:
    """make_chain's chain and, when it has a swarm, the swarm's control ops
    (p2p/control.py Control.handle: ping, stats, download, fetch_blob, forget_blob),
    which the node's control socket serves beside the layer file system's."""
    deadline = float(config.get("read_deadline", DEFAULT_READ_DEADLINE))
    backoff = float(config.get("source_backoff", DEFAULT_SOURCE_BACKOFF))
    sources: list[Source] = []
    region = config.get("region_url")
    if region:
        from cache.region.client import RegionLink, RegionSource

        # with the node token, if the node has one: the region takes bad-bytes reports only from its nodes
        sources.append(RegionSource(RegionLink.from_config(config, with_token=True), read_timeout=deadline))
    sources.append(OriginSource(plain_http_hosts=config.get("plain_http_hosts", []), read_timeout=deadline))
    swarm_ops: ControlOps | None = None
    if config.get("swarm", {}).get("enabled", False):  # the swarm first (p2p/chain.py, docs/p2p.md)
        from p2p.chain import SwarmChain, swarm_chain

        chain = swarm_chain(sources, config, layer_blobs(config["root"]) if config.get("root") else None)
        if isinstance(chain, SwarmChain) and chain.control is not None:
            swarm_ops = chain.control.handle
    else:
        chain = FetchChain(sources)
    chain.deadline, chain.backoff, chain.backoff_max = deadline, backoff, 3 * backoff
    return chain, swarm_ops


def layer_blobs(root: str) -> Callable[[str], BlobRef | None]:
    """The swarm control socket's resolve_layer (p2p.control.ResolveLayer): the blob of a
    layer this node provides, from ROOT/layers/<hex>/blob.json (snapshotter/remote.py
    writes it), or None."""

    def resolve(layer: str) -> BlobRef | None:
        try:
            with open(os.path.join(root, "layers", layer, "blob.json")) as fh:
                return BlobRef.from_dict(json.load(fh))
        except FileNotFoundError:
            return None

    return resolve


def make_store(root: str, config: dict):
    try:
        from cache.store import ChunkStore
    except ImportError:
        log.warning("no chunk store available; chunks are cached in memory only")
        return None
    capacity = config.get("store_capacity")
    return ChunkStore(os.path.join(root, "chunks"), capacity=capacity) if capacity else ChunkStore(
        os.path.join(root, "chunks"))


class ReadRanges(Protocol):
    """FetchChain.read_ranges: (blob, ranges, check?) -> one result per range, each the
    check's answer on the first source's bytes that pass it (the raw bytes without one);
    TransportError when no source served (cache/source.py)."""

    def __call__(self, blob: BlobRef, ranges: Sequence[tuple[int, int]], check: Check | None = None) -> list: ...


@dataclass
class DataPath:
    """A node's data path: loaders for layer blobs, its figures, and a clean stop."""

    loader: Callable[[BlobRef, str], NodeChunkLoader]  # (blob, layer name) -> loader
    statistics: Callable[[], dict]
    # (blob, ranges, check?) -> their bytes through the whole fetch chain: a layer's proof
    # reads the whole blob this way, unchecked, and checks its digest itself; a TOC is read
    # with a check (each source's bytes verified against the TOC digest)
    read_ranges: ReadRanges
    close: Callable[[float], None]  # write pending chunks (up to a timeout), stop the chain
    swarm_ops: ControlOps | None = None  # the swarm's control ops, when the chain has a swarm
    store: ChunkStore | None = None  # the node's chunk store, when it has one (passthrough opens its files)


MEMORY_FRACTION = 0.25  # of the machine's memory, at most, for decompressed chunks


def memory_capacity(wanted: int) -> int:
    """`wanted` bytes of chunk memory, or a quarter of the machine's memory if that is
    less (logged): the containers the node serves need the rest."""
    try:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return wanted
    most = int(physical * MEMORY_FRACTION)
    if wanted > most:
        log.warning("[fetch] memory_cache = %d bytes is more than a quarter of this machine's memory "
                    "(%d bytes): using %d", wanted, physical, most)
        return most
    return wanted


def make_data_path(root: str, config: dict) -> DataPath:
    chain, swarm_ops = make_chain_and_swarm_ops(config)
    memory = ChunkMemory(memory_capacity(int(config.get("memory_cache", 512 << 20))))
    store = make_store(root, config)
    writer = WriteBehind(store) if store is not None else None
    flight = SingleFlight()

    def loader(blob: BlobRef, name: str) -> NodeChunkLoader:
        return NodeChunkLoader(blob, chain, writer or ChunkMemory(0), flight, name, memory=memory)

    def statistics() -> dict:
        out = {"sources": chain.statistics(), "single_flight_waits": flight.waits, "memory": memory.statistics()}
        if writer is not None:
            out["store"] = writer.statistics()
        return out

    def close(timeout: float = 10.0) -> None:
        if writer is not None and not writer.wait_idle(timeout):
            log.warning("stopping with chunks not yet in the chunk store (they will be fetched again)")
        chain.close()

    return DataPath(loader, statistics, chain.read_ranges, close, swarm_ops, store)
