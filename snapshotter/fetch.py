"""How the node turns chunks into verified bytes: the chunk store, then the fetch chain.

- A chunk already in the node's chunk store is served from there (the store verifies
  what it returns).
- A chunk nobody is fetching is fetched through the FetchChain (swarm, region, origin),
  decompressed, verified against its sha256 and put in the store.
- A chunk another reader is already fetching is waited for: a chunk is fetched once
  however many readers want it (single flight, across layers too, since the key is the
  chunk digest).
Failures raise ShoalError naming the layer, file and chunk; the FUSE layer turns that
into EIO for the reader.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Protocol, Sequence

from builder.zstdchunked import Chunk, decode_chunk
from cache.source import BlobRef, FetchChain, Held
from shoal.errors import ShoalError

log = logging.getLogger("shoal.fetch")


class ChunkCache(Protocol):
    """What the loader needs of a chunk store (cache.store.ChunkStore fits)."""

    def get(self, digest: str) -> bytes | None: ...

    def put(self, digest: str, data: bytes) -> None: ...


class MemoryChunkCache:
    """A bounded in-memory chunk cache, for when the node has no chunk store."""

    def __init__(self, capacity: int = 256 << 20):
        from collections import OrderedDict

        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._size = 0
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, digest: str) -> bytes | None:
        with self._lock:
            data = self._data.get(digest)
            if data is not None:
                self._data.move_to_end(digest)
            return data

    def contains(self, digest: str) -> bool:
        with self._lock:
            return digest in self._data

    def put(self, digest: str, data: bytes) -> None:
        with self._lock:
            if digest in self._data:
                return
            self._data[digest] = data
            self._size += len(data)
            while self._size > self._capacity and self._data:
                _, old = self._data.popitem(last=False)
                self._size -= len(old)


class WriteBehind:
    """Puts chunks into a store from a thread of its own, so reads never wait on disk.

    Until a chunk is written it is served from memory (get/contains see it). Memory is
    bounded: past `limit` pending bytes, put() waits for the writer. A chunk that fails
    to be written (a full disk) is dropped with a log line: it is fetched again if needed.
    """

    def __init__(self, store, limit: int = 256 << 20):
        self.store = store
        self._pending: dict[str, bytes] = {}
        self._bytes = 0
        self._limit = limit
        self._cond = threading.Condition()
        self._queue: list[str] = []
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

    def put(self, digest: str, data: bytes) -> None:
        with self._cond:
            if digest in self._pending:
                return
            while self._bytes > self._limit:
                self._cond.wait()
            self._pending[digest] = data
            self._bytes += len(data)
            self._queue.append(digest)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                digest = self._queue.pop(0)
                data = self._pending[digest]
            try:
                self.store.put(digest, data)
            except Exception as e:  # noqa: BLE001 - a chunk not stored is fetched again later
                log.warning("cannot store chunk %s: %s", digest, e)
            with self._cond:
                del self._pending[digest]
                self._bytes -= len(data)
                self._cond.notify_all()

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Wait until everything put has been written (tests, shutdown)."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._pending, timeout)

    def statistics(self) -> dict:
        out = dict(self.store.statistics()) if hasattr(self.store, "statistics") else {}
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

    def resolve(self, digest: str, data: bytes | None = None, error: BaseException | None = None) -> None:
        with self._lock:
            fut = self._inflight.pop(digest, None)
        if fut is None:
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(data)


READAHEAD_BYTES = 256 << 10  # compressed bytes fetched ahead with one miss
READAHEAD_CHUNK = 64 << 10  # only small chunks (small files) are worth it: big ones are a request each
READAHEAD_GAP = 64 << 10


class NodeChunkLoader:
    """A builder.zstdchunked.ChunkLoader for one layer blob on a node.

    Read-ahead: a fetch also takes the chunks that follow the requested ones in the
    blob, up to READAHEAD_BYTES of compressed data in the same range request. Files are
    in tar order, so these are the next files of the same directory: a program that
    imports a package reads them next, and one request serves many small files.
    """

    def __init__(self, blob: BlobRef, chain: FetchChain, cache: ChunkCache, flight: SingleFlight, layer: str,
                 readahead: int = READAHEAD_BYTES):
        self.blob = blob
        self.chain = chain
        self.cache = cache
        self.flight = flight
        self.layer = layer
        self.readahead = readahead
        self.fetched_chunks = 0
        self.fetched_bytes = 0  # compressed bytes that came over the network
        self.readahead_chunks = 0
        self._order: list[Chunk] = []  # every chunk of the layer by blob offset
        self._position: dict[int, int] = {}

    def set_layout(self, chunks: Sequence[Chunk]) -> None:
        """The layer's chunks (from its TOC), so fetches can read ahead in blob order."""
        unique = {c.start: c for c in chunks if c.digest and not c.zeros}
        self._order = [unique[k] for k in sorted(unique)]
        self._position = {c.start: i for i, c in enumerate(self._order)}

    def _read_ahead(self, mine: list[tuple[int, Chunk]]) -> list[Chunk]:
        """Chunks after the requested ones worth fetching in the same request (claimed)."""
        if not self._order or self.readahead <= 0:
            return []
        last = max(mine, key=lambda ic: ic[1].start)[1]
        pos = self._position.get(last.start)
        if pos is None:
            return []
        budget, end, extras = self.readahead, last.end, []
        contains = getattr(self.cache, "contains", None)
        for c in self._order[pos + 1 : pos + 257]:
            size = c.end - c.start
            if c.start - end > READAHEAD_GAP or size > budget or size > READAHEAD_CHUNK:
                break
            end = c.end
            if contains is not None and contains(c.digest):
                continue
            fut, owner = self.flight.claim(c.digest)
            if not owner:
                continue
            extras.append(c)
            budget -= size
        return extras

    def load(self, chunks: Sequence[Chunk], what: str) -> list[bytes]:
        results: dict[int, bytes] = {}
        waiting: list[tuple[int, Future]] = []
        mine: list[tuple[int, Chunk]] = []
        for i, c in enumerate(chunks):
            data = self.cache.get(c.digest) if c.digest else None
            if data is not None and len(data) == c.size:
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
        for i, fut in waiting:
            try:
                results[i] = fut.result(timeout=600)
            except ShoalError:
                raise
            except Exception as e:  # noqa: BLE001 - a waiter reports the owner's failure
                raise ShoalError(f"{what}: chunk {chunks[i].digest}: {e}") from None
        return [results[i] for i in range(len(chunks))]

    def _fetch(self, mine: list[tuple[int, Chunk]], results: dict[int, bytes], what: str) -> None:
        ranges = [(c.start, c.end) for _, c in mine]
        try:
            raws = self.chain.read_ranges(self.blob, ranges)
        except ShoalError as e:
            err = ShoalError(f"{what}: {len(mine)} chunks from {self.blob}: {e}")
            for _, c in mine:
                self.flight.resolve(c.digest or f"{self.blob.digest}@{c.start}", error=err)
            log.error("%s", err)
            raise err from None
        first_error: ShoalError | None = None
        for (i, c), raw in zip(mine, raws):
            key = c.digest or f"{self.blob.digest}@{c.start}"
            try:
                data = decode_chunk(c, raw, f"{what} in {self.layer}" if i >= 0 else f"read-ahead in {self.layer}")
            except ShoalError as e:
                log.error("%s (fetched from %s)", e, self.blob)
                self.flight.resolve(key, error=e)
                if i >= 0:
                    first_error = first_error or e
                continue
            if c.digest and not isinstance(raw, Held):  # the swarm keeps its own copy
                try:
                    self.cache.put(c.digest, data)
                except OSError as e:  # a full disk must not fail the read
                    log.warning("%s: cannot store chunk %s: %s", self.layer, c.digest, e)
            self.fetched_chunks += 1
            self.fetched_bytes += len(raw)
            if i >= 0:
                results[i] = data
            else:
                self.readahead_chunks += 1
            self.flight.resolve(key, data=data)
        if first_error is not None:
            raise first_error


