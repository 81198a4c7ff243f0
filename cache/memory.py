"""The node's chunk memory: decompressed, verified chunks kept in RAM for every layer."""

from __future__ import annotations

import threading
from collections import OrderedDict

from cache.origin import merge_ranges


class ChunkMemory:
    """Decompressed, verified chunks in memory: a byte-bounded LRU, thread-safe.

    Keys are chunk digests (so one copy serves every layer that has the chunk) or, for
    chunks without one, a key private to their reader. The node gives every layer's
    LayerReader the same one (builder.format.reader.ChunkMemo is the seam it fills), and
    its NodeChunkLoader asks it first (contains/get) before fetching.

    A chunk all of whose bytes went to a client that keeps them (served: the layer file
    system's READ replies and page-ins, which the kernel keeps in its page cache) is
    forgotten then: the kernel answers those pages from now on, and the memory a chunk
    took goes to the next one decoded. (Holding every chunk a start read until the
    capacity pushed it out made each new chunk fresh memory, which the kernel must fault
    in and zero: a fifth of the read workers' CPU in a fleet start: docs/snapshotter.md.)
    A chunk read ahead of its reads (a prefetch) stays until they come. Only chunks keyed
    by digest are let go: the node can read those again without the network (its store,
    the store's write queue, the swarm's pieces). A chunk without a digest is never
    stored, so this memory is its only copy on the node and it stays.
    """

    def __init__(self, capacity: int = 64 << 20):
        self._data: OrderedDict[object, bytes] = OrderedDict()
        self._size = 0
        self.capacity = capacity
        self._served: dict[object, list[tuple[int, int]]] = {}  # key -> [start, end) spans served, merged
        self._lock = threading.Lock()
        self.hits = self.misses = self.released = 0

    def get(self, key: object) -> bytes | None:
        with self._lock:
            data = self._data.get(key)
            if data is None:
                self.misses += 1
                return None
            self._data.move_to_end(key)
            self.hits += 1
            return data

    def contains(self, key: object) -> bool:
        with self._lock:
            return key in self._data

    def put(self, key: object, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return
            self._data[key] = data
            self._size += len(data)
            while self._size > self.capacity:
                old_key, old = self._data.popitem(last=False)
                self._size -= len(old)
                self._served.pop(old_key, None)

    def served(self, key: object, start: int, end: int) -> None:
        """Bytes [start, end) of the chunk went to a client that keeps them (see the class
        docstring): once all of its bytes did, the chunk is forgotten."""
        if not isinstance(key, str):  # no digest: not stored anywhere else on the node
            return
        with self._lock:
            data = self._data.get(key)
            if data is None or start >= end:
                return
            spans = merge_ranges([*self._served.get(key, ()), (start, end)], gap=0)
            if spans[0][0] <= 0 and spans[0][1] >= len(data):
                del self._data[key]
                self._served.pop(key, None)
                self._size -= len(data)
                self.released += 1
            else:
                self._served[key] = spans

    def statistics(self) -> dict:
        with self._lock:
            return {"memory_bytes": self._size, "memory_chunks": len(self._data), "memory_capacity": self.capacity,
                    "memory_hits": self.hits, "memory_misses": self.misses, "memory_released": self.released}
