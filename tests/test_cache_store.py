"""One store suite for every store of content by digest: the node's ChunkStore and each
region backend (disk, s3 against moto's S3 server on loopback through boto3). Then what
only the ChunkStore promises: verification on read, pins, crash safety under kill -9 of
writer processes, several writer processes on one store.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from cache.region.backends import BlobNotFound, InvalidRange, create
from cache.store import ChunkStore
from shoal.errors import DigestMismatch

REPO = Path(__file__).resolve().parent.parent


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob(i: int, size: int = 4096) -> tuple[str, bytes]:
    data = random.Random(i).randbytes(size)
    return digest_of(data), data


# --- an S3-protocol server on loopback -----------------------------------------------------


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server in a thread on 127.0.0.1 (one per test session)."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is needed for the S3 backend tests")
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per S3 request otherwise
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch, tmp_path) -> dict:
    """A fresh bucket; AWS credentials from the environment, as in production."""
    boto3 = pytest.importorskip("boto3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "shoal-test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "shoal-test-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    bucket = f"shoal-{uuid.uuid4().hex[:12]}"
    s3 = boto3.client("s3", endpoint_url=s3_server)
    s3.create_bucket(Bucket=bucket)
    yield {"endpoint_url": s3_server, "bucket": bucket, "client": s3}
    s3.close()


# --- one interface over every store --------------------------------------------------------


class Subject:
    """A store under test: put/get/contains/delete/size_bytes, ranges for blob stores."""

    ranges = True

    def __init__(self, make):
        self._make = make
        self.store = make()

    def reopen(self) -> None:
        self.store.close()
        self.store = self._make()

    def close(self) -> None:
        self.store.close()


class ChunkSubject(Subject):
    ranges = False

    def put(self, d, data):
        return self.store.put(d, data)

    def get(self, d):
        return self.store.get(d)

    def contains(self, d):
        return self.store.contains(d)

    def delete(self, d):
        return self.store.remove(d)

    def size_bytes(self):
        return self.store.statistics()["size_bytes"]


class BackendSubject(Subject):
    def put(self, d, data):
        return self.store.put(d, data)

    def get(self, d):
        try:
            return self.store.read(d)
        except BlobNotFound:
            return None

    def get_range(self, d, start, end):
        return self.store.read(d, start, end)

    def contains(self, d):
        return self.store.contains(d)

    def delete(self, d):
        return self.store.delete(d)

    def size_bytes(self):
        return self.store.statistics()["size_bytes"]


STORES = ["chunkstore", "disk", "s3"]


@pytest.fixture(params=STORES)
def make_subject(request, tmp_path):
    """make_subject(capacity) -> a Subject of the parametrized kind, closed afterwards."""
    made = []

    def make(capacity: int = 1 << 30) -> Subject:
        root, prefix = tmp_path / f"store-{len(made)}", f"p{len(made)}/"
        if request.param == "chunkstore":
            subject = ChunkSubject(lambda: ChunkStore(root, capacity))
        elif request.param == "disk":
            subject = BackendSubject(lambda: create("disk", root=root, capacity=capacity))
        else:
            s3 = request.getfixturevalue("s3_bucket")
            subject = BackendSubject(lambda: create(
                "s3", bucket=s3["bucket"], endpoint_url=s3["endpoint_url"], prefix=prefix,
                capacity=capacity, staging=root / "staging"))
        made.append(subject)
        return subject

    yield make
    for subject in made:
        subject.close()


# --- the suite ---------------------------------------------------------------------------


def test_put_get_roundtrip_and_idempotent(make_subject):
    s = make_subject()
    d, data = blob(1, 100_000)
    assert not s.contains(d)
    assert s.put(d, data) is True
    assert s.contains(d)
    assert s.get(d) == data
    assert s.put(d, data) is True  # again: no change
    assert s.size_bytes() == len(data)
    empty_d, empty = digest_of(b""), b""
    assert s.put(empty_d, empty) is True
    assert s.get(empty_d) == b""


def test_missing(make_subject):
    s = make_subject()
    d, _ = blob(2)
    assert s.get(d) is None
    assert not s.contains(d)
    assert s.delete(d) is False
    if s.ranges:
        with pytest.raises(BlobNotFound):
            s.get_range(d, 0, 1)


def test_put_checks_the_digest(make_subject):
    s = make_subject()
    d, data = blob(3)
    with pytest.raises(DigestMismatch):
        s.put(d, data + b"x")
    assert not s.contains(d)
    assert s.size_bytes() == 0


@pytest.mark.parametrize("make_subject", ["disk", "s3"], indirect=True)  # chunks are read whole
def test_ranges(make_subject):
    s = make_subject()
    d, data = blob(4, 3 << 20)
    s.put(d, data)
    for start, end in [(0, 1), (0, len(data)), (1 << 20, (1 << 20) + 7), (len(data) - 1, len(data)),
                       (5, 5), (len(data), len(data))]:
        assert s.get_range(d, start, end) == data[start:end], (start, end)
    assert b"".join(s.store.stream(d, 10, 3 << 20, block=100_000)) == data[10:]
    for start, end in [(-1, 2), (0, len(data) + 1), (10, 5), (len(data) + 1, len(data) + 2)]:
        with pytest.raises(InvalidRange):
            s.get_range(d, start, end)


def test_delete(make_subject):
    s = make_subject()
    d, data = blob(5)
    s.put(d, data)
    assert s.delete(d) is True
    assert s.get(d) is None
    assert s.size_bytes() == 0


def test_capacity_and_lru_eviction(make_subject):
    size = 10_000
    s = make_subject(capacity=10 * size)
    items = [blob(100 + i, size) for i in range(10)]
    for d, data in items:
        assert s.put(d, data)
    assert s.size_bytes() == 10 * size
    assert s.get(items[0][0]) == items[0][1]  # now the most recently used
    for i in range(10, 25):
        d, data = blob(100 + i, size)
        assert s.put(d, data)
        assert s.size_bytes() <= 10 * size
    # the last ten written are there; the first (read, then outlived) and second are gone
    for i in range(15, 25):
        assert s.contains(blob(100 + i, size)[0]), i
    assert not s.contains(items[1][0])
    assert s.size_bytes() <= 10 * size


def test_recently_read_survives_eviction(make_subject):
    size = 10_000
    s = make_subject(capacity=4 * size)
    items = [blob(200 + i, size) for i in range(4)]
    for d, data in items:
        s.put(d, data)
    time.sleep(0.01)
    assert s.get(items[0][0]) == items[0][1]
    s.put(*blob(299, size))  # evicts one: the least recently used is items[1], not items[0]
    assert s.contains(items[0][0])
    assert not s.contains(items[1][0])


def test_larger_than_capacity_is_refused(make_subject):
    s = make_subject(capacity=1000)
    d, data = blob(6, 1001)
    assert s.put(d, data) is False
    assert not s.contains(d)
    assert s.size_bytes() == 0


def test_index_survives_restart(make_subject):
    s = make_subject(capacity=5 * 1000)
    items = [blob(300 + i, 1000) for i in range(5)]
    for d, data in items:
        s.put(d, data)
    s.reopen()
    assert s.size_bytes() == 5000
    for d, data in items:
        assert s.get(d) == data
    s.put(*blob(399, 1000))  # full: the restarted store still evicts to stay in bounds
    assert s.size_bytes() <= 5000


def test_concurrent_writers_stay_within_capacity(make_subject):
    size, capacity = 8_000, 20 * 8_000
    s = make_subject(capacity=capacity)
    seen_sizes: list[int] = []
    stop = threading.Event()
    errors: list[BaseException] = []

    def watch():
        while not stop.is_set():
            seen_sizes.append(s.size_bytes())
            time.sleep(0.002)

    def write(worker: int):
        try:
            for i in range(30):
                # overlapping keys across workers: the same blob written concurrently
                d, data = blob(1000 + (worker * 17 + i) % 60, size)
                assert s.put(d, data)
                got = s.get(d)
                assert got is None or got == data
        except Exception as exc:  # noqa: BLE001  (reported by the main thread below)
            errors.append(exc)

    watcher = threading.Thread(target=watch)
    watcher.start()
    workers = [threading.Thread(target=write, args=(w,)) for w in range(6)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    watcher.join()
    assert not errors, errors[0]
    assert seen_sizes and max(seen_sizes) <= capacity
    assert s.size_bytes() <= capacity
    if hasattr(s.store, "check"):
        report = s.store.check()
        assert report["bytes"] == report["counted_bytes"] == s.size_bytes()
        assert not report["files_without_entry"] and not report["entries_without_file"]


def test_concurrent_writers_unbounded(make_subject):
    s = make_subject()
    items = [blob(2000 + i, 5000) for i in range(40)]

    def write(k: int):
        for d, data in items[k::4] + items[: 10]:
            assert s.put(d, data)

    threads = [threading.Thread(target=write, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for d, data in items:
        assert s.get(d) == data
    assert s.size_bytes() == 40 * 5000


# --- the ChunkStore's own promises ----------------------------------------------------------


def test_corrupt_chunk_is_never_served(tmp_path):
    with ChunkStore(tmp_path / "s", capacity=1 << 20) as store:
        d, data = blob(7)
        store.put(d, data)
        path = tmp_path / "s" / "data" / d[7:9] / d[7:]
        path.write_bytes(b"\0" * len(data))  # a power loss without fsync can leave this
        assert store.get(d) is None
        stats = store.statistics()
        assert stats["corrupt"] == 1 and stats["misses"] == 1
        assert not path.exists() and stats["size_bytes"] == 0
        assert store.put(d, data) and store.get(d) == data


def test_statistics(tmp_path):
    with ChunkStore(tmp_path / "s", capacity=3 * 4096) as store:
        items = [blob(10 + i) for i in range(4)]
        for d, data in items:
            store.put(d, data)
        store.get(items[3][0])
        store.get(items[0][0])  # evicted
        stats = store.statistics()
        assert stats == {
            "hits": 1, "misses": 1, "bytes_read": 4096, "bytes_written": 4 * 4096, "corrupt": 0,
            "evictions": 1, "rejected": 0, "size_bytes": 3 * 4096, "capacity_bytes": 3 * 4096, "chunks": 3,
        }


def test_pins_hold_chunks_and_refuse_when_all_pinned(tmp_path):
    with ChunkStore(tmp_path / "s", capacity=3 * 4096) as store:
        items = [blob(20 + i) for i in range(5)]
        with store.pin([d for d, _ in items[:2]]):
            for d, data in items[:3]:
                store.put(d, data)
            assert store.put(*items[3])  # evicts items[2], the only unpinned one
            assert store.contains(items[0][0]) and store.contains(items[1][0])
            assert not store.contains(items[2][0])
            pin = store.pin([items[3][0]])
            assert store.put(*items[4]) is False  # everything is pinned: refused, not overfilled
            assert store.statistics()["rejected"] == 1
            pin.release()
        assert store.put(*items[4])
        assert store.statistics()["size_bytes"] <= 3 * 4096


def test_default_capacity_is_a_fraction_of_free_disk_and_recorded(tmp_path):
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    with ChunkStore(tmp_path / "s") as store:
        assert 0.15 * free < store.capacity <= 0.2 * free
        first = store.capacity
    with ChunkStore(tmp_path / "s") as store:
        assert store.capacity == first  # not recomputed from the (now different) free space
    with ChunkStore(tmp_path / "s", capacity=12345) as store:
        assert store.capacity == 12345


def test_smaller_capacity_at_restart_evicts(tmp_path):
    with ChunkStore(tmp_path / "s", capacity=10 * 4096) as store:
        for i in range(10):
            store.put(*blob(40 + i))
    with ChunkStore(tmp_path / "s", capacity=4 * 4096) as store:
        assert store.statistics()["size_bytes"] <= 4 * 4096
        assert store.contains(blob(49)[0])


def test_lost_index_is_rebuilt_from_the_files(tmp_path):
    with ChunkStore(tmp_path / "s", capacity=1 << 20) as store:
        items = [blob(60 + i) for i in range(5)]
        for d, data in items:
            store.put(d, data)
    for name in ("index.db", "index.db-wal", "index.db-shm"):
        (tmp_path / "s" / name).unlink(missing_ok=True)
    (tmp_path / "s" / "index.db").write_bytes(b"not a database")
    with ChunkStore(tmp_path / "s", capacity=1 << 20) as store:
        assert store.statistics()["chunks"] == 5
        for d, data in items:
            assert store.get(d) == data


# --- crash safety and several processes -----------------------------------------------------

WRITER = r"""
import hashlib, os, random, sys
sys.path.insert(0, sys.argv[1])
from cache.store import ChunkStore
root, seed, capacity = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = ChunkStore(root, capacity)
print("ready", flush=True)
rnd = random.Random(seed)
written = []
while True:
    data = rnd.randbytes(rnd.randint(1, 96 << 10))
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    store.put(digest, data)
    written.append(digest)
    if rnd.random() < 0.3:
        store.get(rnd.choice(written))
    if rnd.random() < 0.02:
        store.remove(rnd.choice(written))
"""


def _start_writer(root: Path, seed: int, capacity: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, str(REPO), str(root), str(seed), str(capacity)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )


def _wait_ready(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else b""
    assert line.strip() == b"ready", (line, proc.stderr.read1(4000) if proc.poll() is not None else b"")


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def _assert_consistent(root: Path, capacity: int) -> int:
    """Every chunk file matches its name; index and files agree; capacity holds."""
    with ChunkStore(root) as store:
        assert store.capacity == capacity
        report = store.check()
        assert report["temp_files"] == 0
        assert not report["files_without_entry"], report
        assert not report["entries_without_file"], report
        assert not report["size_mismatch"], report
        assert report["bytes"] == report["counted_bytes"] <= capacity
        assert report["entries"] == report["counted_entries"]
        for sub in (root / "data").iterdir():
            for f in sub.iterdir():
                assert digest_of(f.read_bytes()) == "sha256:" + f.name, f
                got = store.get("sha256:" + f.name)
                assert got is not None and digest_of(got) == "sha256:" + f.name
        assert store.statistics()["corrupt"] == 0
        return report["entries"]


def test_kill_9_writers_at_random_moments(tmp_path):
    root, capacity = tmp_path / "store", 2 << 20
    rnd = random.Random(int(time.time()))
    procs: list[subprocess.Popen] = []
    try:
        for round_ in range(8):
            # some rounds run two writer processes on the same store; some kill a writer
            # before it is ready (in the middle of opening and recovering the store)
            procs = [_start_writer(root, rnd.randrange(1 << 30), capacity) for _ in range(1 + round_ % 2)]
            if round_ % 3 != 2:
                for proc in procs:
                    _wait_ready(proc)
                time.sleep(rnd.uniform(0.05, 0.6))
            else:
                time.sleep(rnd.uniform(0.0, 0.4))
            _kill(procs)
        chunks = _assert_consistent(root, capacity)
        assert chunks > 0
    finally:
        _kill(procs)


def test_writer_processes_share_the_capacity(tmp_path):
    root, capacity = tmp_path / "store", 1 << 20
    ChunkStore(root, capacity).close()
    script = WRITER.replace("while True:", "for _ in range(150):") + "\nstore.close()\n"
    procs = [subprocess.Popen([sys.executable, "-c", script, str(REPO), str(root), str(seed), str(capacity)],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for seed in (1, 2, 3)]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=60)
            assert proc.returncode == 0, err.decode()[-2000:]
    finally:
        _kill(procs)
    _assert_consistent(root, capacity)


# --- batches -----------------------------------------------------------------------------------


def test_put_many_stores_a_batch_and_refuses_bad_bytes_whole(tmp_path):
    store = ChunkStore(tmp_path / "chunks", capacity=1 << 20)
    items = [blob(i) for i in range(10)]
    assert store.put_many(items) == [True] * 10
    assert all(store.get(d) == data for d, data in items)
    again = [blob(i) for i in range(5, 15)]
    assert store.put_many(again, verified=True) == [True] * 10  # present ones are only touched
    assert store.statistics()["chunks"] == 15
    bad = [blob(20), (blob(21)[0], b"not these bytes")]
    with pytest.raises(DigestMismatch):
        store.put_many(bad)
    assert not store.contains(bad[0][0])
    assert os.listdir(tmp_path / "chunks" / "tmp") == []  # no temp file left behind
    # over capacity: the batch is stored as far as room can be made (LRU eviction)
    big = [blob(100 + i, 300 << 10) for i in range(5)]
    results = store.put_many(big, verified=True)
    assert all(results) and store.statistics()["size_bytes"] <= 1 << 20
