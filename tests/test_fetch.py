"""The node's chunk memory and its write-behind into the chunk store (cache/loader.py,
cache/memory.py), on a real ChunkStore; the fetch chain's deadline and
source health (cache/source.py)."""

from __future__ import annotations

import hashlib
import random
import time

import pytest

from cache.loader import WriteBehind
from cache.memory import ChunkMemory
from cache.source import BlobRef, FetchChain, Source
from cache.store import ChunkStore
from shoal.errors import TransportError


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


class _Gate(Source):
    """A source that answers (bytes of the range's length) only while its gate is open,
    and otherwise hangs like a stopped registry (blocks until opened)."""

    def __init__(self, name: str, open_: bool = True) -> None:
        import threading

        self.name = name
        self.gate = threading.Event()
        if open_:
            self.gate.set()
        self.calls = 0

    def read_ranges(self, blob, ranges):
        self.calls += 1
        self.gate.wait(30)
        return [b"x" * (b - a) for a, b in ranges]


BLOB = BlobRef("127.0.0.1:1", "repo", "sha256:" + "0" * 64)


def test_a_hung_source_costs_one_read_then_is_skipped_until_a_probe_answers():
    """The chain's deadline and health (cache/source.py): a hung first source leaves
    the next one half the deadline, so the read succeeds; the hung source is skipped
    at once by the next reads, probed by one read after the back-off, healthy again
    once it answers. A hung last source fails the read within the deadline."""
    from concurrent.futures import ThreadPoolExecutor

    region, origin = _Gate("region", open_=False), _Gate("origin")
    chain = FetchChain([region, origin], deadline=1.0, backoff=0.5, backoff_max=1.0)
    try:
        start = time.monotonic()
        assert chain.read_ranges(BLOB, [(0, 10)]) == [b"x" * 10]
        assert 0.4 < time.monotonic() - start < 5  # the region had half the deadline; no hang
        assert chain.statistics()["region"]["hangs"] == 1
        calls = region.calls
        assert chain.read_ranges(BLOB, [(0, 5)]) == [b"x" * 5]
        assert region.calls == calls and chain.statistics()["region"]["skipped"] == 1
        time.sleep(0.6)  # the back-off ends: the reads that come together send one probe
        with ThreadPoolExecutor(4) as pool:
            assert all(r == [b"x" * 3] for r in pool.map(lambda _: chain.read_ranges(BLOB, [(0, 3)]), range(4)))
        assert region.calls == calls + 1 and chain.statistics()["region"]["hangs"] == 2
        region.gate.set()  # it answers again; the next probe (after a doubled back-off) finds it
        time.sleep(1.1)
        chain.read_ranges(BLOB, [(0, 3)])
        assert chain.statistics()["region"]["ranges"] == 1
        assert chain.read_ranges(BLOB, [(0, 3)]) and region.calls == calls + 3
        # a hung last source: the read fails within the deadline
        origin.gate.clear()
        alone = FetchChain([origin], deadline=0.5)
        start = time.monotonic()
        with pytest.raises(TransportError, match="no answer within"):
            alone.read_ranges(BLOB, [(0, 1)])
        assert time.monotonic() - start < 5
        with pytest.raises(TransportError, match="unhealthy"):
            alone.read_ranges(BLOB, [(0, 1)])
    finally:
        region.gate.set()
        origin.gate.set()
        chain.close()


def test_blob_ref_round_trips_through_its_dict_and_refuses_bad_ones():
    from shoal.errors import FormatError

    digest = "sha256:" + "a" * 64
    blob = BlobRef("127.0.0.1:5000", "lib/app", digest, 1234, True)
    assert BlobRef.from_dict(blob.to_dict()) == blob
    assert BlobRef.from_dict({**blob.to_dict(), "image": "x"}) == blob  # other keys (blob.json's image) ignored
    assert BlobRef.from_dict({"registry": "r", "repository": "p", "digest": digest}) == BlobRef("r", "p", digest)
    good = blob.to_dict()
    for bad in ([], {**good, "digest": "sha256:abc"}, {**good, "size": -1}, {**good, "size": True},
                {**good, "size": "12"}, {**good, "plain_http": "yes"}, {**good, "registry": ""},
                {k: v for k, v in good.items() if k != "repository"}):
        with pytest.raises(FormatError):
            BlobRef.from_dict(bad)
