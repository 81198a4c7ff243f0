"""The warm-up: a node fetches the chunks an image's access profile names, in its order,
before the container's reads ask for them.

    profile = published_profile(registry, repository, manifest, plain_http, layers, limit, image)
    warmup = Warmup(loaded)           # loaded() -> {layer digest: WarmLoader} of the loaded layers
    warmup.prefetch(profile entries)  # queued now; a layer not loaded yet waits for it
    warmup.prefetch(entries, part=(i, n))  # node i of a job of n: its own part first (below)
    warmup.layer_loaded(digest)       # at each load: its waiting entries are queued
    warmup.warmth(entries)            # how much of them is in the chunk store

Entries are profile rows, [layer digest, start, end] (prefetch/profile.py); an entry that
is not a chunk of its layer is skipped. The layer file system (snapshotter/fs/server.py)
owns one Warmup and calls it from its event loop alone; the fetches run on the warm-up's
own PREFETCH_THREADS threads, through each layer's chunk loader, so what they fetch lands
in the node's memory and chunk store and a read of a chunk on its way waits for it
(the loader's single flight) instead of fetching it again.

Parts: a region preheat job warms n nodes at once, each through its swarm (the pieces a
peer has come from peers, those nobody has from the region at once). Were all nodes to
fetch the same chunks in the same order, nobody would have anything when it is asked and
the region would send the target once per node. So node i of n (`part=(i, n)`, handed
by the region with the job) splits the entries into n contiguous parts of about equal
compressed bytes (rotation) and fetches them from part i on: i, i+1, ..., n-1, 0, ...,
i-1. At first every node fetches a part of its own from the region; when node i reaches
part i+1, node i+1 has it (or most of it) and the swarm takes it from there. The other
parts go from their end backwards, in jobs of PREFETCH_FIRST (a late owner and this
node meet in the part's middle, at most a job's bytes fetched twice), each part once
the one before it is done, and their reads are patient (cache.source.PATIENT: the swarm
waits a little for the owner to have pieces nobody has yet, rather than ask the region
for them too). Without a part (0 of 1), entries go in their order, as a
node's own start asks.
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
from cache.origin import merge_ranges
from cache.source import BACKGROUND, PATIENT, TARGET, Target
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

    def here(self, digest: str) -> bool:
        """The chunk is on the node (memory, store, its write queue or the swarm's storage):
        a read of it fetches nothing."""
        ...

    def prefetch(self, chunks: Sequence[Chunk]) -> int:
        """Fetch those not here nor on their way; how many it fetched."""
        ...


def _entry_ok(entry: object) -> bool:
    return (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[0], str)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in entry[1:]))


def check_part(part: object) -> tuple[int, int]:
    """A job part as the wire carries it, [rank, of] with 0 <= rank < of (None: 0 of 1);
    ValueError naming it otherwise."""
    if part is None:
        return 0, 1
    if (not isinstance(part, (list, tuple)) or len(part) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in part)
            or not 0 <= part[0] < part[1] <= 1_000_000):
        raise ValueError(f"part {part!r}: want [rank, of] with 0 <= rank < of")
    return int(part[0]), int(part[1])


def rotation(entries: Iterable, part: tuple[int, int]) -> list[tuple[int, list]]:
    """The valid `entries` as (part number, entry), in the order node `part[0]` of
    `part[1]` fetches them: split in that many contiguous parts of about equal compressed
    bytes (an entry's end - start), its own part first, then the next ones, wrapping
    around, each of those from its end backwards (its owner fetches it from its start:
    were the owner late, the two meet in its middle instead of racing over the same
    chunks, each asking the region for what the other has not yet). With one part, the
    entries in their order (all part 0)."""
    valid = [list(e) for e in entries if _entry_ok(e)]
    rank, of = part
    if of <= 1 or not valid:
        return [(0, e) for e in valid]
    total = sum(max(0, e[2] - e[1]) for e in valid) or 1
    parts: list[list[list]] = [[] for _ in range(of)]
    before = 0
    for e in valid:
        parts[min(of - 1, before * of // total)].append(e)
        before += max(0, e[2] - e[1])
    own = [(rank, e) for e in parts[rank]]
    return own + [(k % of, e) for k in range(rank + 1, rank + of) for e in reversed(parts[k % of])]


def target_of(entries: Iterable) -> Target:
    """The valid profile entries as {layer digest: sorted disjoint (start, end) ranges}."""
    by_layer: dict[str, list[tuple[int, int]]] = {}
    for e in entries:
        if _entry_ok(e) and e[2] > e[1]:
            by_layer.setdefault(e[0], []).append((e[1], e[2]))
    return {digest: merge_ranges(ranges, gap=0) for digest, ranges in by_layer.items()}


class Warmup:
    """Profile-ordered prefetch over the loaded layers (`loaded()`, by layer digest)."""

    def __init__(self, loaded: Callable[[], dict[str, WarmLoader]],
                 page_in: Callable[[WarmLoader, list[Chunk]], None] | None = None) -> None:
        self._loaded = loaded
        self._page_in = page_in  # (loader, chunks it holds): bring their files' pages into the page cache
        self._lock = threading.Lock()  # the jobs' figures (jobs end on the pool's threads)
        self._pool: ThreadPoolExecutor | None = None
        self._waiting: dict[str, tuple[list[tuple[int, list]], Target | None, bool]] = {}  # layer digest ->
        # ([(part, profile entry)], the warm-up's target or None: not a background one, page in?)
        self.queued = 0
        self._jobs = 0  # queued or running
        self._since = 0.0
        self._done = 0

    def prefetch(self, entries: Iterable, part: tuple[int, int] = (0, 1), background: bool = False,
                 sparse: Iterable[str] = (), page_in: bool = False) -> int:
        """Fetch the chunks of `entries` in that order (node part[0] of a job's part[1]:
        rotated, see the module doc), in jobs of one layer's chunks of one part
        (PREFETCH_FIRST compressed bytes, then twice as many each, up to PREFETCH_BATCH),
        on PREFETCH_THREADS threads. Entries of a layer not loaded yet wait for it (the
        node sends the profile while containerd still prepares the image's layers).
        `background`: nobody waits on these chunks now (a preheat's warm-up, not a start's
        profile): their reads are cache.source.BACKGROUND, with the entries of the `sparse`
        layers (those the region holds to the ranges asked) as their cache.source.TARGET.
        `page_in`: once a job's chunks are here, the `page_in` hook brings the pages of
        their files into the kernel's page cache (a preheat of the chunks a start reads:
        the start's reads then find them there, as a start with the image local does).
        Returns the number of chunks queued now."""
        entries = list(entries)
        held = set(sparse)
        target = target_of(e for e in entries if _entry_ok(e) and e[0] in held) if background else None
        return self._queue(rotation(entries, part), target, page_in and self._page_in is not None)

    def _queue(self, entries: list[tuple[int, list]], target: Target | None, page_in: bool = False) -> int:
        loaded = self._loaded()
        jobs: list[list] = []
        queued = 0
        waiting: dict[str, list[tuple[int, list]]] = {}
        last_part = own = entries[0][0] if entries else 0  # (rotation's first part is the node's own)
        for number, entry in entries:
            loader = loaded.get(entry[0])
            if loader is None:  # its turn comes when it is loaded
                waiting.setdefault(entry[0], []).append((number, entry))
                continue
            chunks = loader.chunks_at([entry[1:]])
            if not chunks:
                continue
            c = chunks[0]
            # jobs grow from PREFETCH_FIRST to PREFETCH_BATCH: the first chunks come soon,
            # the rest in few requests (a job's chunks are fetched in blob order)
            budget = min(PREFETCH_BATCH, PREFETCH_FIRST << max(len(jobs) - 1, 0))
            if number != own:  # another node's part: small jobs, each asks peers what they have by then
                budget = PREFETCH_FIRST
            # (a job ends with its part: the next part is another node's first)
            if jobs and jobs[-1][0] is loader and number == last_part and jobs[-1][2] + c.end - c.start <= budget:
                jobs[-1][1].append(c)
                jobs[-1][2] += c.end - c.start
            else:
                jobs.append([loader, [c], c.end - c.start, number])
            last_part = number
            queued += 1
        # a newer profile of a layer replaces an older one
        self._waiting.update({d: (w, target, page_in) for d, w in waiting.items()})
        if not jobs:
            return 0
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="shoal-prefetch")
        with self._lock:
            if not self._jobs:
                self._since, self._done = time.monotonic(), 0
            self._jobs += len(jobs)
        stages: list[list[list]] = []
        for job in jobs:
            if stages and stages[-1][0][3] == job[3]:
                stages[-1].append(job)
            else:
                stages.append([job])
        if len(stages) == 1:
            for loader, chunks, _, _ in jobs:
                self._pool.submit(self._job, loader, chunks, False, target, page_in)
        else:  # a job's parts one after the other (module doc): a thread of its own waits for each
            threading.Thread(target=self._stages, args=(stages, own, target, page_in), name="shoal-prefetch-parts",
                             daemon=True).start()
        self.queued += queued
        return queued

    def _stages(self, stages: list[list[list]], own: int, target: Target | None, page_in: bool) -> None:
        """The jobs of each part on the pool, a part's once the part before it is done:
        its next part is another node's own, which that node fetches meanwhile (were the
        pool's threads to start it while this node's own part is half done, the peer
        would not have it yet and the region would send it twice). Never raises."""
        pool = self._pool
        assert pool is not None
        for stage in stages:
            try:
                futures = [pool.submit(self._job, loader, chunks, number != own, target, page_in)
                           for loader, chunks, _, number in stage]
            except RuntimeError:  # the pool was shut down: the process is ending
                return
            for f in futures:
                f.exception()  # (_job logs its own failures)

    def layer_loaded(self, digest: str) -> int:
        """The layer `digest` is loaded now: queue the entries waiting for it (logged)."""
        waiting, target, page_in = self._waiting.pop(digest, ([], None, False))
        if not waiting:
            return 0
        queued = self._queue(waiting, target, page_in)
        log.info("prefetching %d chunks of layer %s", queued, digest)
        return queued

    def _job(self, loader: WarmLoader, chunks: list[Chunk], patient: bool = False,
             target: Target | None = None, page_in: bool = False) -> None:
        """One job, on a pool thread; `patient`: of another node's part (its reads may wait
        a little for the peer that fetches it first: cache.source.PATIENT); `target`: of a
        background warm-up, its whole target (cache.source.BACKGROUND and TARGET);
        `page_in`: then the hook pages in those of its chunks that are here (a job counts
        as pending until it did)."""
        done = 0
        tokens = PATIENT.set(patient), BACKGROUND.set(target is not None), TARGET.set(target)
        try:
            done = loader.prefetch(chunks)
            if page_in and self._page_in is not None:
                self._page_in(loader, [c for c in chunks if loader.here(c.digest)])
        except Exception:
            log.exception("prefetch of %d chunks of %s failed", len(chunks), loader.layer)
        finally:
            TARGET.reset(tokens[2])
            BACKGROUND.reset(tokens[1])
            PATIENT.reset(tokens[0])
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
