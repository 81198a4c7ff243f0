"""The node's chunk memory and its write-behind into the chunk store (snapshotter/fetch.py,
builder/zstdchunked.ChunkMemory), on a real ChunkStore."""

from __future__ import annotations

import hashlib
import random
import time

from builder.zstdchunked import ChunkMemory
from cache.store import ChunkStore
from snapshotter.fetch import WriteBehind


def chunk(i: int, size: int = 1000) -> tuple[str, bytes]:
    data = random.Random(i).randbytes(size)
    return "sha256:" + hashlib.sha256(data).hexdigest(), data


def test_chunk_memory_is_bounded_by_bytes_and_keeps_the_recently_used():
    memory = ChunkMemory(capacity=3000)
    for i in range(3):
        memory.put(*chunk(i))
    assert memory.get(chunk(0)[0]) is not None  # 0 is now the most recently used
    memory.put(*chunk(3))  # evicts 1, the least recently used
    assert memory.contains(chunk(0)[0]) and not memory.contains(chunk(1)[0])
    memory.put(*chunk(9, 5000))  # larger than the whole memory: not kept
    assert not memory.contains(chunk(9)[0])
    st = memory.statistics()
    assert st["memory_bytes"] <= 3000 and st["memory_chunks"] == 3


def test_write_behind_serves_pending_chunks_and_writes_them_after_a_pause(tmp_path):
    store = ChunkStore(tmp_path / "chunks")
    writer = WriteBehind(store, quiet=30.0)
    items = [chunk(i) for i in range(20)]
    for digest, data in items:
        writer.put(digest, data)
    # while chunks keep coming (a container starting), nothing is written yet...
    assert not any(store.contains(d) for d, _ in items)
    # ...but every pending chunk is served
    assert all(writer.get(d) == data and writer.contains(d) for d, data in items)
    assert writer.statistics()["pending_writes"] == 20
    assert writer.wait_idle(timeout=30)  # a flush (shutdown, tests) writes at once
    assert all(store.get(d) == data for d, data in items)
    assert writer.statistics()["pending_writes"] == 0


def test_write_behind_writes_when_half_its_memory_is_pending(tmp_path):
    store = ChunkStore(tmp_path / "chunks")
    writer = WriteBehind(store, limit=40_000, quiet=3600.0)
    items = [chunk(i) for i in range(40)]  # 40 kB pending: over half the limit
    for digest, data in items:
        writer.put(digest, data)
    # no pause will come (quiet is an hour): the writer starts because of the memory
    deadline = time.monotonic() + 60
    while not store.contains(items[0][0]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.contains(items[0][0])
    assert writer.wait_idle(timeout=30)
    assert all(store.contains(d) for d, _ in items)
