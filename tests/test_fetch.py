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
from shoal.errors import ShoalError, TransportError


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


def test_chunk_memory_lets_go_of_a_chunk_served_whole_unless_it_has_no_digest():
    """A chunk keyed by digest leaves the memory once every byte of it was served (in any
    order, overlapping); a chunk without a digest (a reader's private key) is never
    stored elsewhere on the node, so it stays however it was served."""
    memory = ChunkMemory(capacity=10_000)
    digest, data = chunk(1)
    private = (12345, 0, 1000)
    memory.put(digest, data)
    memory.put(private, data)
    memory.served(digest, 500, 1000)
    memory.served(digest, 100, 600)
    assert memory.contains(digest)  # [0, 100) not served yet
    memory.served(digest, 0, 100)
    assert not memory.contains(digest)
    memory.served(private, 0, 1000)
    assert memory.contains(private)
    st = memory.statistics()
    assert st["memory_released"] == 1 and st["memory_bytes"] == 1000


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


@pytest.mark.registry
def test_the_node_processs_fetch_figures_go_on_across_its_restarts(registry, tmp_path):
    """NodeFetch (the node process's fetches: snapshotter/nodefetch.py) against a real
    registry: a small blob is checked against its digest, whole blobs are read through a
    BlobReader, and the figures in ROOT/node-fetch.json (0600) go on from what the
    previous node process counted; a file that is not JSON is started over, not fatal."""
    import json
    import os
    import stat

    from snapshotter.nodefetch import STATS_FILE, NodeFetch, read_statistics
    from tests.test_region import push_blob

    small = random.Random(30).randbytes(3000)
    big = random.Random(31).randbytes(20 << 20)  # three 8 MiB pieces
    blobs = {name: BlobRef(registry.host, "lib/nodefetch", push_blob(registry, "lib/nodefetch", data, tmp_path),
                           len(data), plain_http=True) for name, data in (("small", small), ("big", big))}
    root = tmp_path / "root"
    root.mkdir()
    config = {"plain_http_hosts": [registry.host], "read_deadline": 20.0}

    def run_once() -> dict:
        fetch = NodeFetch(str(root), config)
        try:
            assert fetch.small_blob(blobs["small"], "a config", 1 << 20) == small
            reader = fetch.open_blob(blobs["big"], "a layer")
            got = hashlib.sha256()
            while piece := reader.read(1 << 20):
                got.update(piece)
            assert got.hexdigest() == hashlib.sha256(big).hexdigest()
            with pytest.raises(ShoalError, match="size"):
                fetch.small_blob(BlobRef(registry.host, "lib/nodefetch", blobs["small"].digest, 10 << 20), "x",
                                 1 << 20)
        finally:
            fetch.close()
        return read_statistics(str(root))

    first = run_once()
    assert first["blobs"]["small"] == 1 and first["blobs"]["whole"] == 1
    assert first["blobs"]["whole_bytes"] == len(big) and first["blobs"]["digest_mismatches"] == 0
    assert stat.S_IMODE(os.stat(root / STATS_FILE).st_mode) == 0o600
    second = run_once()  # a new node process on the same root
    assert second["blobs"] == {k: 2 * v for k, v in first["blobs"].items()}
    assert json.dumps(second["sources"], sort_keys=True) != json.dumps(first["sources"], sort_keys=True)
    (root / STATS_FILE).write_text("not json")
    assert read_statistics(str(root)) == {}
    third = run_once()
    assert third["blobs"] == first["blobs"]
