"""The warm-up: a node fetches the chunks an image's access profile names, in its order,
before the container's reads ask for them.

    profile = published_profile(registry, repository, manifest, plain_http, layers, limit, image)
    warmup = Warmup(loaded)           # loaded() -> {layer digest: WarmLoader} of the loaded layers
    warmup.prefetch(profile entries)  # queued now; a layer not loaded yet waits for it
    warmup.layer_loaded(digest)       # at each load: its waiting entries are queued
    warmup.warmth(entries)            # how much of them is in the chunk store

Entries are profile rows, [layer digest, start, end] (prefetch/profile.py); an entry that
is not a chunk of its layer is skipped. The layer file system (snapshotter/fs/server.py)
owns one Warmup and calls it from its event loop alone; the fetches run on the warm-up's
own PREFETCH_THREADS threads, through each layer's chunk loader, so what they fetch lands
in the node's memory and chunk store and a read of a chunk on its way waits for it
(the loader's single flight) instead of fetching it again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from builder.format.toc import Chunk
from prefetch.profile import Profile, ReadBlob, fetch_profile
from shoal.errors import ShoalError

log = logging.getLogger("shoal.fs")  # (the warm-up runs in the layer file system process)
log_image = logging.getLogger("shoal.remote")  # (published_profile: the node's RemoteLayers asks)

PREFETCH_THREADS = 2
PREFETCH_FIRST = 1 << 20  # compressed bytes of the first prefetch job
PREFETCH_BATCH = 16 << 20  # and of the later ones (each doubles the one before)


class WarmLoader(Protocol):
    """What the warm-up needs of one layer's chunk loader (cache.loader.NodeChunkLoader
    fits). Called from the warm-up's threads and the caller's; never raises for a chunk
    it cannot fetch (prefetch logs it and leaves it to the reads)."""

    layer: str  # names the layer in log lines

    def chunks_at(self, ranges: Sequence[Sequence[int]]) -> list[Chunk]:
        """The layer's chunks at these compressed [start, end) ranges, in that order (others left out)."""
        ...

    def layout(self) -> list[Chunk]:
        """Every chunk of the layer with content, once, in blob order."""
        ...

    def stored(self, digest: str) -> bool:
        """The chunk is in the node's chunk store (written, not only queued): what "warm" means."""
        ...

    def prefetch(self, chunks: Sequence[Chunk]) -> int:
        """Fetch those not here nor on their way; how many it fetched."""
        ...


def _entry_ok(entry: object) -> bool:
    return isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str)


class Warmup:
    """Profile-ordered prefetch over the loaded layers (`loaded()`, by layer digest)."""

    def __init__(self, loaded: Callable[[], dict[str, WarmLoader]]) -> None:
        self._loaded = loaded
        self._lock = threading.Lock()  # the jobs' figures (jobs end on the pool's threads)
        self._pool: ThreadPoolExecutor | None = None
        self._waiting: dict[str, list] = {}  # layer digest -> profile entries
        self.queued = 0
        self._jobs = 0  # queued or running
        self._since = 0.0
        self._done = 0

    def prefetch(self, entries: Iterable) -> int:
        """Fetch the chunks of `entries` in that order, in jobs of one layer's chunks
        (PREFETCH_FIRST compressed bytes, then twice as many each, up to PREFETCH_BATCH),
        on PREFETCH_THREADS threads. Entries of a layer not loaded yet wait for it (the
        node sends the profile while containerd still prepares the image's layers).
        Returns the number of chunks queued now."""
        loaded = self._loaded()
        jobs: list[list] = []
        queued = 0
        waiting: dict[str, list] = {}
        for entry in entries:
            if not _entry_ok(entry):
                continue
            loader = loaded.get(entry[0])
            if loader is None:  # its turn comes when it is loaded
                waiting.setdefault(entry[0], []).append(entry)
                continue
            chunks = loader.chunks_at([entry[1:]])
            if not chunks:
                continue
            c = chunks[0]
            # jobs grow from PREFETCH_FIRST to PREFETCH_BATCH: the first chunks come soon,
            # the rest in few requests (a job's chunks are fetched in blob order)
            budget = min(PREFETCH_BATCH, PREFETCH_FIRST << max(len(jobs) - 1, 0))
            if jobs and jobs[-1][0] is loader and jobs[-1][2] + c.end - c.start <= budget:
                jobs[-1][1].append(c)
                jobs[-1][2] += c.end - c.start
            else:
                jobs.append([loader, [c], c.end - c.start])
            queued += 1
        self._waiting.update(waiting)  # a newer profile of a layer replaces an older one
        if not jobs:
            return 0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="shoal-prefetch")
        with self._lock:
            if not self._jobs:
                self._since, self._done = time.monotonic(), 0
            self._jobs += len(jobs)
        for loader, chunks, _ in jobs:
            self._pool.submit(self._job, loader, chunks)
        self.queued += queued
        return queued

    def layer_loaded(self, digest: str) -> int:
        """The layer `digest` is loaded now: queue the entries waiting for it (logged)."""
        waiting = self._waiting.pop(digest, None)
        if not waiting:
            return 0
        queued = self.prefetch(waiting)
        log.info("prefetching %d chunks of layer %s", queued, digest)
        return queued

    def _job(self, loader: WarmLoader, chunks: list[Chunk]) -> None:
        done = 0
        try:
            done = loader.prefetch(chunks)
        except Exception:
            log.exception("prefetch of %d chunks of %s failed", len(chunks), loader.layer)
        with self._lock:
            self._jobs -= 1
            self._done += done
            if self._jobs:
                return
            seconds, fetched = time.monotonic() - self._since, self._done
        log.info("prefetch done: %d chunks fetched in %.2fs (the others were here or on their way)", fetched, seconds)

    def whole_layers(self, digests: Iterable) -> list[list]:
        """Every chunk of the loaded layers among `digests`, as profile entries (a layer
        not loaded has none yet)."""
        loaded = self._loaded()
        return [[d, c.start, c.end] for d in digests if d in loaded for c in loaded[d].layout()]

    def warmth(self, entries: Iterable) -> list[dict]:
        """How much of `entries` (profile entries, or whole_layers) is in the chunk store,
        per layer named: {digest, loaded, target_chunks, target_bytes, warm_chunks,
        warm_bytes} (compressed bytes). Entries that are not chunks of their layer do not
        count (prefetch skips them too); a layer not loaded is not warm."""
        loaded = self._loaded()
        out: dict[str, dict] = {}
        for entry in entries:
            if not _entry_ok(entry):
                continue
            row = out.setdefault(entry[0], {"digest": entry[0], "loaded": entry[0] in loaded, "target_chunks": 0,
                                            "target_bytes": 0, "warm_chunks": 0, "warm_bytes": 0})
            loader = loaded.get(entry[0])
            if loader is None:
                continue
            for c in loader.chunks_at([entry[1:]]):
                row["target_chunks"] += 1
                row["target_bytes"] += c.end - c.start
                if loader.stored(c.digest):
                    row["warm_chunks"] += 1
                    row["warm_bytes"] += c.end - c.start
        return list(out.values())

    def statistics(self) -> dict:
        """{queued_chunks, jobs_pending, layers_waiting} (`shoal status` shows them)."""
        return {"queued_chunks": self.queued, "jobs_pending": self._jobs, "layers_waiting": len(self._waiting)}


@dataclass
class Warmth:
    """What the node's layer file system measured for one image (Warmup.warmth's rows)."""

    layers: list[dict]  # the warmth op's rows, one per lazy layer
    jobs_pending: int = 0

    @property
    def target_bytes(self) -> int:
        return sum(r["target_bytes"] for r in self.layers)

    @property
    def warm_bytes(self) -> int:
        return sum(r["warm_bytes"] for r in self.layers)

    @property
    def not_loaded(self) -> list[str]:
        return [r["digest"] for r in self.layers if not r["loaded"]]

    @property
    def warm(self) -> bool:
        return not self.not_loaded and self.warm_bytes == self.target_bytes


def published_profile(registry: str, repository: str, manifest_digest: str, plain_http: bool, layers: list,
                      limit: int, image: str, read_blob: ReadBlob | None = None) -> Profile | None:
    """The access profile published for the image (prefetch/profile.py), bounded to its
    first `limit` compressed bytes (logged); None if there is none or it cannot be read
    (logged: a warm-up is an optimisation). `layers`: the manifest's layer digests;
    `read_blob`: how the profile's blob is read (the node's fetch chain), else from the registry."""
    try:
        profile = fetch_profile(registry, repository, manifest_digest, plain_http, layers, read_blob)
    except (ShoalError, OSError, ValueError) as e:
        log_image.warning("%s: access profile of %s not used: %s", image, manifest_digest, e)
        return None
    if profile is None:
        log_image.info("%s: no access profile for %s", image, manifest_digest)
        return None
    bounded = profile.bounded(limit)
    if bounded is not profile:
        log_image.warning("%s: access profile of %s names %.1f MB, more than prefetch_max_bytes (%.1f MB): "
                    "prefetching its first %d of %d chunks", image, manifest_digest, profile.compressed_bytes / 1e6,
                    limit / 1e6, len(bounded.chunks), len(profile.chunks))
    return bounded
