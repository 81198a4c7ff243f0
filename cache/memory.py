"""The node's chunk memory: decompressed, verified chunks kept in RAM for every layer."""

from __future__ import annotations

import threading
from collections import OrderedDict


class ChunkMemory:
    """Decompressed, verified chunks in memory: a byte-bounded LRU, thread-safe.

    Keys are chunk digests (so one copy serves every layer that has the chunk) or, for
    chunks without one, a key private to their reader. The node gives every layer's
    LayerReader the same one (builder.format.reader.ChunkMemo is the seam it fills), and
    its NodeChunkLoader asks it first (contains/get) before fetching.
    """

    def __init__(self, capacity: int = 64 << 20):
        self._data: OrderedDict[object, bytes] = OrderedDict()
        self._size = 0
        self.capacity = capacity
        self._lock = threading.Lock()
        self.hits = self.misses = 0

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
                _, old = self._data.popitem(last=False)
                self._size -= len(old)

    def statistics(self) -> dict:
        with self._lock:
            return {"memory_bytes": self._size, "memory_chunks": len(self._data), "memory_capacity": self.capacity,
                    "memory_hits": self.hits, "memory_misses": self.misses}
