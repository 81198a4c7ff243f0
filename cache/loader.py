"""How the node turns chunks into verified bytes: the chunk store, then the fetch chain.

- A chunk already in the node's chunk store is served from there (the store verifies
  what it returns).
- A chunk nobody is fetching is fetched through the FetchChain (swarm, region, origin),
  decompressed, verified against its sha256 and put in the store.
- A chunk another reader is already fetching is waited for: a chunk is fetched once
  however many readers want it (single flight, across layers too, since the key is the
  chunk digest).
- A chunk fetched ahead of any read (read-ahead: the small files after the one read) is
  kept as its source sent it and decompressed and verified only when a read asks for it:
  most are never read (a torch start read 1,202 of the 4,572 chunks it fetched).
Failures raise ShoalError naming the layer, file and chunk; the FUSE layer turns that
into EIO for the reader.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from builder.format.reader import decode_chunk
from builder.format.toc import Chunk
from cache.memory import ChunkMemory
from cache.origin import MERGE_GAP
from cache.source import BlobRef, FetchChain, Held, RangesFailed
from shoal.errors import ShoalError

log = logging.getLogger("shoal.fetch")


class ChunkCache(Protocol):
    """What NodeChunkLoader needs of the node's chunk cache (WriteBehind over the chunk
    store, or a ChunkMemory when the node has no store). Thread-safe: readers call it
    from the file system's worker threads.

    - get(digest): the chunk's verified bytes, or None (missing, or dropped as corrupt);
    - contains(digest): the chunk is there, or on its way there (what "warm" means);
    - put(digest, data): keep the chunk, which the caller has verified; a chunk that
      cannot be kept is dropped, or an OSError raised (the read goes on without it).
    """

    def get(self, digest: str) -> bytes | None: ...

    def contains(self, digest: str) -> bool: ...

    def put(self, digest: str, data: bytes) -> object: ...


class ChunkBacking(Protocol):
    """What WriteBehind needs of the store it writes into (cache.store.ChunkStore fits).
    Called from the writer's thread and the readers' threads at once.

    - get(digest) / contains(digest): as ChunkCache;
    - put_many(items, verified=True): store (digest, bytes) pairs in one transaction,
      without hashing them again; one result per item (False: not kept, no room);
      OSError (a full disk) drops the batch, logged;
    - statistics(): the store's figures for `shoal status` (a dict of numbers).
    """

    def get(self, digest: str) -> bytes | None: ...

    def contains(self, digest: str) -> bool: ...

    def put_many(self, items: Sequence[tuple[str, bytes]], *, verified: bool = False) -> list[bool]: ...

    def statistics(self) -> dict: ...


WRITE_BATCH_CHUNKS = 64
WRITE_BATCH_BYTES = 16 << 20


class WriteBehind:
    """Puts chunks into a store from a thread of its own, so reads never wait on disk.

    Until a chunk is written it is served from memory (get/contains see it). Writing
    waits for a pause: while chunks keep arriving (a container is starting and reading),
    the writer stays out of the way (file creation and the store's index cost CPU that
    the start needs) until `quiet` seconds pass without a new chunk or half of `limit`
    is pending. Memory is bounded: past `limit` pending bytes, put() waits for the
    writer. A chunk that fails to be written (a full disk) is dropped with a log line:
    it is fetched again if needed. A crash loses only chunks not yet written: a cache.
    """

    def __init__(self, store: ChunkBacking, limit: int = 1 << 30, quiet: float = 1.0) -> None:
        self.store = store
        self._pending: dict[str, bytes] = {}
        self._bytes = 0
        self._limit = limit
        self._quiet = quiet
        self._last_put = 0.0
        self._flush = 0  # callers of wait_idle: write without waiting for a pause
        self._now = False  # write_now(): the same until the queue is empty
        self._cond = threading.Condition()
        self._queue: deque[str] = deque()
        self._thread = threading.Thread(target=self._run, name="shoal-store-writer", daemon=True)
        self._thread.start()

    def get(self, digest: str) -> bytes | None:
        with self._cond:
            data = self._pending.get(digest)
        return data if data is not None else self.store.get(digest)

    def contains(self, digest: str) -> bool:
        with self._cond:
            if digest in self._pending:
                return True
        return self.store.contains(digest)

    def pending(self, digest: str) -> bool:
        """The chunk is queued for the store, not written yet."""
        with self._cond:
            return digest in self._pending

    def write_now(self) -> None:
        """Write what is queued now, without waiting for a pause (someone waits for it: a
        preheat's measure of warmth); returns at once."""
        with self._cond:
            if self._queue and not self._now:
                self._now = True
                self._cond.notify_all()

    def put(self, digest: str, data: bytes) -> None:
        with self._cond:
            if digest in self._pending:
                return
            while self._bytes > self._limit:
                self._cond.wait()
            self._pending[digest] = data
            self._bytes += len(data)
            self._queue.append(digest)
            self._last_put = time.monotonic()
            self._cond.notify_all()

    def _run(self) -> None:
        # Storing is for later; the reads of a starting container come first: this thread
        # runs at a lower CPU priority (Linux threads have their own nice value), and it
        # writes in batches, one store transaction each.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        while True:
            with self._cond:
                while True:
                    if not self._queue:
                        self._now = False
                        self._cond.wait()
                        continue
                    wait = self._last_put + self._quiet - time.monotonic()
                    if wait <= 0 or self._bytes > self._limit // 2 or self._flush or self._now:
                        break
                    self._cond.wait(wait)
                batch: list[tuple[str, bytes]] = []
                size = 0
                while self._queue and len(batch) < WRITE_BATCH_CHUNKS and size < WRITE_BATCH_BYTES:
                    digest = self._queue.popleft()
                    batch.append((digest, self._pending[digest]))
                    size += len(batch[-1][1])
            try:
                self.store.put_many(batch, verified=True)  # the loader verified every chunk it queued
            except Exception as e:  # noqa: BLE001 - a chunk not stored is fetched again later
                log.warning("cannot store %d chunks (%s...): %s", len(batch), batch[0][0], e)
            with self._cond:
                for digest, data in batch:
                    del self._pending[digest]
                    self._bytes -= len(data)
                self._cond.notify_all()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Write everything pending now and wait until it is written (tests, shutdown)."""
        with self._cond:
            self._flush += 1
            self._cond.notify_all()
            try:
                return self._cond.wait_for(lambda: not self._queue and not self._pending, timeout)
            finally:
                self._flush -= 1

    def statistics(self) -> dict:
        out = dict(self.store.statistics())
        with self._cond:
            out["pending_writes"] = len(self._pending)
        return out


class SingleFlight:
    """Shared by every layer of a node: which chunk digests are being fetched now."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight: dict[str, Future] = {}
        self.waits = 0  # reads that found their chunk already on its way

    def claim(self, digest: str) -> tuple[Future, bool]:
        """(future, owner): the owner fetches and resolves it; others wait on it."""
        with self._lock:
            fut = self._inflight.get(digest)
            if fut is not None:
                self.waits += 1
                return fut, False
            fut = self._inflight[digest] = Future()
            return fut, True

    def resolve(self, digest: str, data: object = None, error: BaseException | None = None) -> None:
        with self._lock:
            fut = self._inflight.pop(digest, None)
        if fut is None:
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(data)


class Unfetched(ShoalError):
    """A chunk that a read-ahead or a prefetch claimed could not be fetched: a read
    waiting for it fetches it itself (and fails only if that fails too)."""


class Ahead:
    """A chunk fetched ahead of any read, as its source sent it (compressed, unchecked):
    what a read-ahead's single flight resolves to. Whoever reads it decodes it, which
    verifies it (NodeChunkLoader._decode_ahead)."""

    __slots__ = ("chunk", "held", "raw")

    def __init__(self, chunk: Chunk, raw: bytes, held: bool) -> None:
        self.chunk, self.raw, self.held = chunk, raw, held


READAHEAD_BYTES = 256 << 10  # compressed bytes fetched ahead with one miss
AHEAD_KEPT = 16 << 20  # compressed bytes of read-ahead chunks a layer keeps until read (least recent dropped)
READAHEAD_CHUNK = 64 << 10  # only small chunks (small files) are worth it: big ones are a request each
READAHEAD_GAP = 64 << 10
# compressed bytes one prefetch request asks for at most: each is a chain read within the
# read deadline (4 MiB in 10-20 s wants 0.2-0.4 MB/s), and a read waiting on a prefetched
# chunk waits for its span only
PREFETCH_SPAN = 4 << 20


class NodeChunkLoader:
    """A builder.format.reader.ChunkLoader for one layer blob on a node.

    Read-ahead (see _read_ahead): a fetch also takes the small chunks that follow the
    requested ones in the blob, in the same range request. Files are in tar order, so
    these are the next files of the same directory: a program that imports a package
    reads them next, and one request serves many small files. They are kept compressed
    (up to AHEAD_KEPT bytes a layer) and decoded by the read that asks for one; bytes
    that do not verify then are dropped with a log line and the chunk fetched again,
    through the chain (which checks every answer and asks the next source).
    """

    def __init__(self, blob: BlobRef, chain: FetchChain, cache: ChunkCache, flight: SingleFlight, layer: str,
                 readahead: int = READAHEAD_BYTES, memory: ChunkMemory | None = None):
        self.blob = blob
        self.chain = chain
        self.cache = cache
        self.memory = memory  # the node's decompressed chunks in memory (shared with the readers)
        self.flight = flight
        self.layer = layer
        self.readahead = readahead
        self.fetched_chunks = 0
        self.fetched_bytes = 0  # compressed bytes that came over the network
        self.readahead_chunks = 0
        self.readahead_used = 0  # of those, read (decoded) since
        self.prefetched_chunks = 0  # fetched by prefetch() before any read asked for them
        self._ahead: OrderedDict[str, Ahead] = OrderedDict()  # read-ahead chunks not read yet
        self._ahead_bytes = 0
        self._ahead_lock = threading.Lock()
        # chunks whose bytes a source keeps on the node (Held: the swarm's torrent storage),
        # so not stored a second time: warm all the same (stored())
        self._held: set[str] = set()
        self.fetch_seconds = 0.0  # waiting for the sources
        self.decode_seconds = 0.0  # decompressing and verifying what they sent
        self._order: list[Chunk] = []  # every chunk of the layer by blob offset
        self._position: dict[int, int] = {}

    def set_layout(self, chunks: Sequence[Chunk]) -> None:
        """The layer's chunks (from its TOC), so fetches can read ahead in blob order."""
        unique = {c.start: c for c in chunks if c.digest and not c.zeros}
        self._order = [unique[k] for k in sorted(unique)]
        self._position = {c.start: i for i, c in enumerate(self._order)}

    def statistics(self) -> dict:
        """This layer's figures (`shoal status` shows them per layer)."""
        return {"fetched_chunks": self.fetched_chunks, "fetched_bytes": self.fetched_bytes,
                "readahead_chunks": self.readahead_chunks, "readahead_used": self.readahead_used,
                "prefetched_chunks": self.prefetched_chunks,
                "fetch_seconds": self.fetch_seconds, "decode_seconds": self.decode_seconds}

    def layout(self) -> list[Chunk]:
        """Every chunk of the layer with content, once, in blob order (set_layout)."""
        return list(self._order)

    def stored(self, digest: str) -> bool:
        """The chunk is in the node's chunk store (written, not only queued for it), or its
        bytes came from a source that keeps them on the node (the swarm's storage, which a
        later read takes them from): what "warm" means. (A blob the swarm drops afterwards
        is not noticed here: its chunks count as warm as of their fetch.) A chunk still
        queued is written now (WriteBehind.write_now: someone is waiting for the warmth, and
        the start it waits for should not pay for the writes)."""
        if digest in self._held:
            return True
        pending = getattr(self.cache, "pending", None)
        if pending is not None and pending(digest):
            self.cache.write_now()  # type: ignore[attr-defined]  # a WriteBehind (it has pending)
            return False
        return self.cache.contains(digest)

    def here(self, digest: str) -> bool:
        """The chunk is on the node (memory, store or its write queue, the swarm's
        storage): a read of it fetches nothing."""
        return digest in self._held or self._present(digest)

    def _present(self, digest: str) -> bool:
        if self.memory is not None and self.memory.contains(digest):
            return True
        return digest in self._ahead or self.cache.contains(digest)

    def _claim_extra(self, c: Chunk) -> bool:
        """Claim a chunk to fetch ahead: False if it is here or on its way already."""
        if self._present(c.digest):
            return False
        _, owner = self.flight.claim(c.digest)
        return owner

    def _read_ahead(self, mine: list[tuple[int, Chunk]]) -> list[Chunk]:
        """Small chunks after the requested ones (the next small files in tar order), up
        to `readahead` compressed bytes, to fetch in the same request (claimed).

        (Large files get nothing more: reading ahead whole chunks of a file read in
        order, measured on the torch image, saved 15% of the requests for 8% more
        bytes and no time; the kernel's read-ahead already asks for neighbouring pages.)
        """
        if not self._order or self.readahead <= 0:
            return []
        last = max(mine, key=lambda ic: ic[1].start)[1]
        pos = self._position.get(last.start)
        if pos is None:
            return []
        extras: list[Chunk] = []
        budget, end = self.readahead, last.end
        for c in self._order[pos + 1 : pos + 257]:
            size = c.end - c.start
            if c.start - end > READAHEAD_GAP or size > budget or size > READAHEAD_CHUNK:
                break
            end = c.end
            if self._claim_extra(c):
                extras.append(c)
                budget -= size
        return extras

    def chunks_at(self, ranges: Sequence[Sequence[int]]) -> list[Chunk]:
        """The layer's chunks whose compressed ranges are `ranges` ([start, end) pairs, as
        an access profile lists them), in that order; ranges that are not a chunk of this
        layer are left out."""
        out = []
        for r in ranges:
            try:
                start, end = int(r[0]), int(r[1])
            except (TypeError, ValueError, IndexError):
                continue
            pos = self._position.get(start)
            if pos is not None and self._order[pos].end == end:
                out.append(self._order[pos])
        return out

    def prefetch(self, chunks: Sequence[Chunk]) -> int:
        """Fetch those of `chunks` that are neither here nor on their way, into memory and
        the store, by the same path as a read's fetch (so a read of a chunk being
        prefetched waits for it instead of fetching it again). They go in blob order,
        one range request per span of neighbours, each span's chunks served as it
        arrives. Returns how many it fetched; failures are logged and left to the reads."""
        mine = sorted(((-1, c) for c in chunks if c.digest and not c.zeros and self._claim_extra(c)),
                      key=lambda ic: ic[1].start)
        spans: list[list[tuple[int, Chunk]]] = []
        for ic in mine:
            if (spans and ic[1].start - spans[-1][-1][1].end <= MERGE_GAP
                    and ic[1].end - spans[-1][0][1].start <= PREFETCH_SPAN):
                spans[-1].append(ic)
            else:
                spans.append([ic])
        done = 0
        for span in spans:
            try:
                done += self._fetch(span, {}, f"prefetch of {self.layer}", "prefetch")
            except ShoalError:
                pass  # logged by _fetch; the reads will ask again
        self.prefetched_chunks += done
        return done

    def load(self, chunks: Sequence[Chunk], what: str, retry: bool = True) -> list[bytes]:
        results: dict[int, bytes] = {}
        waiting: list[tuple[int, Future]] = []
        mine: list[tuple[int, Chunk]] = []
        for i, c in enumerate(chunks):
            data = self._known(c)
            if data is not None:
                results[i] = data
                continue
            fut, owner = self.flight.claim(c.digest or f"{self.blob.digest}@{c.start}")
            if owner:
                mine.append((i, c))
            else:
                waiting.append((i, fut))
        if mine:
            extras = self._read_ahead(mine)
            self._fetch(mine + [(-1, c) for c in extras], results, what)
        again: list[int] = []
        late: list[int] = []
        bad: list[int] = []  # read ahead, and its bytes did not verify
        # Another read's fetch ends within the chain's deadline; a chunk a prefetch
        # claimed may wait behind the prefetch's earlier spans. A reader waits a little
        # longer than the deadline, then fetches what it still lacks itself (within the
        # deadline again): it never waits on someone else's fetch without bound.
        wait = 600.0 if self.chain.deadline is None else self.chain.deadline + 5.0
        end = time.monotonic() + wait
        for i, fut in waiting:
            try:
                got = fut.result(timeout=max(0.0, end - time.monotonic()))
                if isinstance(got, Ahead):  # a read-ahead brought it: this read decodes it
                    got = self._decode_ahead(got)
                    if got is None:  # (logged): fetched again below
                        bad.append(i)
                        continue
                results[i] = got
            except TimeoutError:
                late.append(i)
            except Unfetched:
                if not retry:
                    raise
                again.append(i)  # a read-ahead or prefetch failed: this read tries itself
            except ShoalError:
                raise
            except Exception as e:  # noqa: BLE001 - a waiter reports the owner's failure
                raise ShoalError(f"{what}: chunk {chunks[i].digest}: {e}") from None
        if late:
            log.warning("%s: %d chunks another fetch claimed did not come within %gs; fetching them", what,
                        len(late), wait)
        if late or bad:
            self._fetch([(i, chunks[i]) for i in late + bad], results, what)
        if again:
            for i, data in zip(again, self.load([chunks[i] for i in again], what, retry=False)):
                results[i] = data
        return [results[i] for i in range(len(chunks))]

    def _known(self, c: Chunk) -> bytes | None:
        """The chunk from memory or the chunk store (which verifies), or None."""
        if not c.digest:
            return None
        if self.memory is not None:
            data = self.memory.get(c.digest)
            if data is not None:
                return data
        with self._ahead_lock:
            ahead = self._ahead.pop(c.digest, None)
            if ahead is not None:
                self._ahead_bytes -= len(ahead.raw)
        if ahead is not None:
            data = self._decode_ahead(ahead)
            if data is not None:
                return data
        data = self.cache.get(c.digest)
        if data is None or len(data) != c.size:
            return None
        if self.memory is not None:
            self.memory.put(c.digest, data)
        return data

    def _keep(self, digest: str, data: bytes, held: bool) -> None:
        """A verified chunk: into memory, and into the store unless its source keeps it."""
        if self.memory is not None:
            self.memory.put(digest, data)
        if held:
            self._held.add(digest)
            return
        try:
            self.cache.put(digest, data)
        except OSError as e:  # a full disk must not fail the read
            log.warning("%s: cannot store chunk %s: %s", self.layer, digest, e)

    def _keep_ahead(self, ahead: Ahead) -> None:
        """A read-ahead chunk until a read asks for it (the least recent go past AHEAD_KEPT)."""
        with self._ahead_lock:
            old = self._ahead.pop(ahead.chunk.digest, None)
            if old is not None:
                self._ahead_bytes -= len(old.raw)
            self._ahead[ahead.chunk.digest] = ahead
            self._ahead_bytes += len(ahead.raw)
            while self._ahead_bytes > AHEAD_KEPT and self._ahead:
                _, dropped = self._ahead.popitem(last=False)
                self._ahead_bytes -= len(dropped.raw)

    def _decode_ahead(self, ahead: Ahead) -> bytes | None:
        """A read-ahead chunk a read asks for, decoded and verified (and kept as any fetched
        chunk is); None, with a log line, when its bytes do not verify."""
        c = ahead.chunk
        t = time.perf_counter()
        try:
            data = decode_chunk(c, ahead.raw, f"read-ahead in {self.layer}")
        except ShoalError as e:
            log.warning("%s: chunk %s read ahead does not verify, fetching it again: %s", self.layer, c.digest, e)
            return None
        finally:
            self.decode_seconds += time.perf_counter() - t
        self._keep(c.digest, data, ahead.held)
        self.readahead_used += 1
        return data

    def _fetch(self, mine: list[tuple[int, Chunk]], results: dict[int, bytes], what: str,
               extra: str = "read-ahead") -> int:
        """Fetch, decode and verify `mine` ((index in the read, chunk); index -1 for a
        chunk no read asked for: `extra` says why it is fetched, read-ahead or prefetch).

        Each chunk is decoded and verified once, by the chain's check on the answer of
        the source that sent it: a source whose bytes fail is counted and the next one
        asked for those chunks (cache/source.py); a read-ahead chunk by the read that
        asks for it (_decode_ahead). Returns how many chunks it served;
        raises when a chunk a read asked for (or every chunk) could not be fetched."""
        ranges = [(c.start, c.end) for _, c in mine]
        decoding = [0.0]

        def check(k: int, raw: bytes) -> tuple[bytes | Ahead, bool]:
            i, c = mine[k]
            if i < 0 and extra == "read-ahead":  # decoded (and verified) by the read that wants it
                return Ahead(c, raw, isinstance(raw, Held)), False
            t = time.perf_counter()
            try:
                # (a read's `what` names the layer and file already)
                return decode_chunk(c, raw, what if i >= 0 else f"{extra} in {self.layer}"), \
                    isinstance(raw, Held)  # the swarm keeps its own copy
            finally:
                decoding[0] += time.perf_counter() - t

        t0 = time.perf_counter()
        failed: ShoalError | None = None
        try:
            outs = dict(enumerate(self.chain.read_ranges(self.blob, ranges, check)))
        except RangesFailed as e:
            outs, failed = e.served, e
        except ShoalError as e:
            outs, failed = {}, e
        self.fetch_seconds += time.perf_counter() - t0 - decoding[0]
        self.decode_seconds += decoding[0]
        first_error: ShoalError | None = None
        if failed is not None:
            err = ShoalError(f"{what}: {len(mine) - len(outs)} chunks: {failed}")
            log.error("%s", err)
        for k, (i, c) in enumerate(mine):
            key = c.digest or f"{self.blob.digest}@{c.start}"
            if k not in outs:
                self.flight.resolve(key, error=err if i >= 0 else Unfetched(str(err)))
                if i >= 0:
                    first_error = first_error or err
                continue
            data, held = outs[k]
            self.fetched_chunks += 1
            self.fetched_bytes += c.end - c.start
            if isinstance(data, Ahead):
                self._keep_ahead(data)
                self.readahead_chunks += 1
            else:
                if c.digest:
                    self._keep(c.digest, data, held)
                if i >= 0:
                    results[i] = data
            self.flight.resolve(key, data=data)
        if first_error is None and failed is not None and not outs:
            first_error = err
        if first_error is not None:
            raise first_error from None
        return len(outs)
