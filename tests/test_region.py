"""The region cache against real components: the aiohttp server on 127.0.0.1:0, Debian's
docker-registry as the origin (anonymous, htpasswd, token auth), moto's S3 server for
the S3 backend, and `shoal region` as a real process.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cache.origin import merge_ranges

aiohttp = pytest.importorskip("aiohttp", reason="aiohttp is needed for the region cache (shoal[node])")
import requests

from builder.oci.refs import DockerRef
from builder.oci.registry import RegistryDestination
from cache.region import backends
from cache.region.client import RegionLink, RegionSource
from cache.region.config import AuthConfig, RegionConfig
from cache.region.server import parse_range
from cache.region.tls import BACKGROUND_HEADER, ensure_region_tls
from cache.source import BlobRef, FetchChain, NotHere
from region.service import start_region
from shoal.errors import TransportError
from tests.services import free_port, stop_process
from tests.test_cache_store import s3_bucket, s3_server  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parent.parent


def digest_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def push_blob(registry, repository: str, data: bytes, tmp_path: Path, docker_config=None) -> str:
    """Upload `data` as a blob of `repository` at the registry; returns its digest."""
    if registry.username and docker_config is not None:
        docker_config.login(registry.host, registry.username, registry.password)
    digest = digest_of(data)
    path = tmp_path / f"blob-{digest[7:19]}"
    path.write_bytes(data)
    dest = RegistryDestination(DockerRef(registry.host, repository, tag="x"), plain_http=True)
    try:
        dest.put_blob(str(path), digest, len(data))
    finally:
        dest.close()
    path.unlink()
    return digest


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def origin_gets(registry, digest: str, want_at_least: int = 0) -> int:
    """Blob GETs the origin logged (waits briefly for the log line of a finished request)."""
    deadline = time.monotonic() + 3
    while True:
        n, _ = registry.count("GET", f"/blobs/{digest}")
        if n >= want_at_least or time.monotonic() > deadline:
            return n
        time.sleep(0.05)


def origin_reads(registry, digest: str, want_bytes: int = 0) -> tuple[int, int, int, int]:
    """(whole-blob GETs, range GETs, bytes of those ranges, bytes of every GET) the origin
    logged for the blob (waits briefly until its answers' bytes reach `want_bytes`: a
    GET's log line comes only after its last byte)."""
    deadline = time.monotonic() + 3
    while True:
        reads = [r for r in registry.requests() if r.method == "GET" and f"/blobs/{digest}" in r.uri]
        written = sum(r.written for r in reads)
        if written >= want_bytes or time.monotonic() > deadline:
            ranges = [r for r in reads if r.status == 206]
            return sum(r.status == 200 for r in reads), len(ranges), sum(r.written for r in ranges), written
        time.sleep(0.05)


def union_size(spans) -> int:
    """Bytes in the union of [a, b) spans."""
    return sum(b - a for a, b in merge_ranges(list(spans), gap=0))


class RunningRegion:
    """The region cache server on 127.0.0.1:0, its event loop in a thread of this process."""

    # a callback that holds the event loop this long is blocking I/O on the loop: a bug.
    # (On 2 cores, 100 client threads in this same process once starved a plain socket
    # accept for 0.53 s, so not less than a second.)
    SLOW_CALLBACK = 1.0

    def __init__(self, config: RegionConfig, backend, tls=None) -> None:
        self.tls = tls
        self.ca = tls.ca if tls else ""
        self.loop = asyncio.new_event_loop()
        self.loop.set_debug(True)
        self.loop.slow_callback_duration = self.SLOW_CALLBACK
        self.slow_callbacks = _SlowCallbacks(self.loop)
        logging.getLogger("asyncio").addHandler(self.slow_callbacks)
        self.thread = threading.Thread(target=self.loop.run_forever, name="region-loop", daemon=True)
        self.thread.start()
        try:
            fut = asyncio.run_coroutine_threadsafe(start_region(config, backend, "127.0.0.1", 0, tls=tls), self.loop)
            self.server = fut.result(timeout=20)
        except BaseException:
            self._stop_loop()
            backend.close()
            raise
        self.port, self.cache = self.server.port, self.server.cache
        self.backend = backend
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"

    def stats(self) -> dict:
        return requests.get(self.url + "/-/status", timeout=5, verify=self.ca or True).json()

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """The statistics once no fill is running (fills finish after their first responses)."""
        deadline = time.monotonic() + timeout
        while (stats := self.stats())["fills_running"] and time.monotonic() < deadline:
            time.sleep(0.02)
        return stats

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=20)
        self.loop.close()

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout=30)
        finally:
            self._stop_loop()
            logging.getLogger("asyncio").removeHandler(self.slow_callbacks)
        assert not self.slow_callbacks.seen, f"the region blocked its event loop: {self.slow_callbacks.seen}"


class _SlowCallbacks(logging.Handler):
    """Collects asyncio debug mode's "Executing <callback> took N seconds" warnings."""

    def __init__(self, loop) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith("Executing "):
            self.seen.append(message[:300])


@pytest.fixture
def region_factory(tmp_path):
    """start(origin_registry, **config) -> RunningRegion (disk backend unless given one)."""
    started: list[RunningRegion] = []

    def start(origin, backend=None, tls: bool = False, **options) -> RunningRegion:
        """tls: serve HTTPS with a CA and certificate of the region's own (as `shoal region`)."""
        auth = options.pop("auth", AuthConfig())
        config = RegionConfig(origin=origin.url, store=str(tmp_path / f"region-{len(started)}"),
                              auth=auth, **options)
        if backend is None:
            backend = backends.create("disk", root=config.store, capacity=1 << 30, fsync=False)
        own = ensure_region_tls(config.state_dir, "127.0.0.1") if tls else None
        region = RunningRegion(config, backend, own)
        started.append(region)
        return region

    yield start
    for region in started:
        region.stop()


def get(region: RunningRegion, name: str, digest: str, headers: dict | None = None, method: str = "GET"):
    return requests.request(method, f"{region.url}/v2/{name}/blobs/{digest}", headers=headers or {}, timeout=30)


# --- ranges, hits and misses ------------------------------------------------------------------


def test_parse_range_table():
    size = 1000
    cases = {
        None: None, "": None, "bytes=0-0": (0, 1), "bytes=0-999": (0, 1000), "bytes=10-": (10, 1000),
        "bytes=-10": (990, 1000), "bytes=-5000": (0, 1000), "bytes=990-5000": (990, 1000),
        "bytes=5-2": None, "bytes=0-1,5-6": None, "items=0-1": None, "bytes=-": None, "bytes=x-1": None,
    }
    for header, want in cases.items():
        assert parse_range(header, size) == want, header
    for header in ("bytes=1000-", "bytes=1000-1001", "bytes=-0"):
        with pytest.raises(Exception) as info:
            parse_range(header, size)
        assert info.value.status == 416 and info.value.headers["Content-Range"] == "bytes */1000"


def test_fill_ranges_table():
    """What a fill's staging file can serve, and what range reads ahead of it still have
    to bring (cache/region/server.py Fill: pure bookkeeping, no I/O)."""
    from cache.region.server import Fill, HTTPFailure, RangeRead

    fill = Fill("sha256:" + "0" * 64, "lib/a", "/nonexistent", size=1000, written=100)
    running = RangeRead(400, 600, got=50)  # has brought 400-450, will bring up to 600
    failed = RangeRead(700, 800, got=30, done=True, error=HTTPFailure(502, "ORIGIN_ERROR", "cut"))
    finished = RangeRead(900, 1000, got=100, done=True)
    fill.ranges = [running, failed, finished]
    # readable: the fill's bytes, then (ahead) what range reads brought
    assert fill.readable(0, 1000, ahead=True) == 100
    assert fill.readable(50, 80, ahead=True) == 30
    assert fill.readable(100, 1000, ahead=True) == 0
    assert fill.readable(420, 1000, ahead=True) == 30
    assert fill.readable(420, 1000, ahead=False) == 0
    assert fill.readable(700, 1000, ahead=True) == 30  # what the failed read brought
    assert fill.readable(950, 1000, ahead=True) == 50
    # the blob's last byte: served by the fill only once verified
    fill.written = 1000
    assert fill.readable(990, 1000, ahead=False) == 9
    fill.verified = True
    assert fill.readable(990, 1000, ahead=False) == 10
    fill.written, fill.verified = 100, False
    # bringing: the read that brings a byte (a failed read brings nothing more)
    assert fill.bringing(550) is running and fill.bringing(420) is running
    assert fill.bringing(720) is failed and fill.bringing(760) is None and fill.bringing(650) is None
    # gaps: what no read brings, so each byte is asked of the origin once
    assert fill.gaps(300, 1000) == [(300, 400), (600, 700), (730, 900)]
    assert fill.gaps(450, 600) == [] and fill.gaps(950, 1000) == []
    assert fill.gaps(590, 610) == [(600, 610)]
    # held: the run of range read bytes in the file from a byte; coming: what they bring
    adjacent = RangeRead(450, 500, got=50, done=True)
    fill.ranges.append(adjacent)
    assert fill.held(400) == 500 and fill.held(420) == 500 and fill.held(300) == 300
    assert fill.held(700) == 730 and fill.held(950) == 1000
    assert fill.coming(420) == 600 and fill.coming(700) == 730 and fill.coming(650) == 650
    fill.ranges.remove(adjacent)
    # the fill passing a finished read forgets it; a running one stays
    fill.written = 1000
    fill.passed()
    assert fill.ranges == [running]
    assert fill.reading_ahead()
    running.done = True
    assert not fill.reading_ahead()
    # a running read's bytes in its memory and not yet in the file (being written): a
    # range answer may take them from memory, nothing may read them from the file
    fill.written = 100
    receiving = RangeRead(400, 600, got=50, mem=bytearray(range(120)))
    fill.ranges = [receiving]
    assert receiving.ready() == 520
    assert fill.readable(420, 1000, ahead=True) == 100
    assert fill.readable(420, 1000, ahead=True, memory=False) == 30
    assert fill.readable(420, 1000, ahead=False) == 0
    assert fill.from_memory(500, 100) == bytes(range(100, 120))
    assert fill.held(400) == 450  # (what the fill may take: in the file only)
    receiving.mem += bytes(10)  # (the memory still grows after it was served from)


def test_whole_blob_ranges_and_head(registry, region_factory, tmp_path):
    data = random.Random(1).randbytes(3 << 20)
    digest = push_blob(registry, "lib/odd_name-1", data, tmp_path)
    region = region_factory(registry)
    name = "lib/odd_name-1"

    r = get(region, name, digest, method="HEAD")  # answered from the origin's HEAD: no fill
    assert r.status_code == 200 and int(r.headers["Content-Length"]) == len(data)
    assert r.headers["Docker-Content-Digest"] == digest and region.stats()["fills"] == 0

    r = get(region, name, digest, {"Range": "bytes=100-199"})  # a miss: served while it fills
    assert r.status_code == 206 and r.content == data[100:200]
    assert r.headers["Content-Range"] == f"bytes 100-199/{len(data)}"
    assert r.headers["Docker-Content-Digest"] == digest

    r = get(region, name, digest)
    assert r.status_code == 200 and r.content == data
    # (the answer's last byte goes out once the blob is verified, its commit comes after:
    # the ranges below are to be hits of the committed copy, not joins of the fill)
    assert region.wait_idle()["fills_committed"] == 1
    for header, want in [("bytes=-7", data[-7:]), (f"bytes={len(data) - 10}-", data[-10:]),
                         ("bytes=0-0", data[:1]), (f"bytes=1048570-{3 << 21}", data[1048570:])]:
        r = get(region, name, digest, {"Range": header})
        assert r.status_code == 206 and r.content == want, header

    r = get(region, name, digest, method="HEAD")
    assert r.status_code == 200 and int(r.headers["Content-Length"]) == len(data) and not r.content
    stats = region.stats()
    assert stats["fills"] == 1 and stats["fills_committed"] == 1 and stats["hits"] >= 5
    assert stats["backend"]["blobs"] == 1 and stats["backend"]["size_bytes"] == len(data)
    assert origin_gets(registry, digest, 1) == 1


def test_fill_goes_on_when_its_clients_leave(registry, region_factory, tmp_path):
    data = random.Random(11).randbytes(16 << 20)
    digest = push_blob(registry, "lib/leave", data, tmp_path)
    region = region_factory(registry)
    with requests.get(f"{region.url}/v2/lib/leave/blobs/{digest}", stream=True, timeout=30) as r:
        assert r.status_code == 200
        assert r.raw.read(1000) == data[:1000]
    # the client hung up after 1000 bytes; the blob is still fetched, verified and cached
    assert region.wait_idle()["fills_committed"] == 1
    assert region.backend.contains(digest)
    r = get(region, "lib/leave", digest, {"Range": "bytes=-5"})
    assert r.status_code == 206 and r.content == data[-5:]
    assert origin_gets(registry, digest, 1) == 1


def test_bad_requests(registry, region_factory, tmp_path):
    data = b"shoal region test blob\n" * 100
    digest = push_blob(registry, "lib/a", data, tmp_path)
    region = region_factory(registry)
    r = get(region, "lib/a", digest, {"Range": f"bytes={len(data)}-"})
    assert r.status_code == 416
    assert r.headers["Content-Range"] == f"bytes */{len(data)}"
    assert r.json()["errors"][0]["code"] == "RANGE_INVALID"
    r = get(region, "lib/a", digest, {"Range": f"bytes={len(data) + 100}-{len(data) + 200}"})  # cached now
    assert r.status_code == 416

    for bad in ("sha256:abc", "sha256:" + "G" * 64, "md5:" + "0" * 32, "sha256:" + "0" * 65):
        r = get(region, "lib/a", bad)
        assert r.status_code == 400, bad
        assert r.json()["errors"][0]["code"] == "DIGEST_INVALID"
        assert "invalid digest" in r.json()["errors"][0]["message"]
    r = get(region, "Lib/UPPER", digest)
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == "NAME_INVALID"

    unknown = digest_of(b"never pushed")
    r = get(region, "lib/a", unknown)
    assert r.status_code == 404 and r.json()["errors"][0]["code"] == "BLOB_UNKNOWN"
    r = requests.post(f"{region.url}/v2/lib/a/blobs/uploads/", timeout=10)
    assert r.status_code == 405
    r = requests.get(f"{region.url}/v2/lib/a/blobs/{digest}?ns=other.example:5000", timeout=10)
    assert r.status_code == 404  # containerd's mirror parameter names another registry
    r = requests.get(f"{region.url}/v2/lib/a/blobs/{digest}?ns={registry.host}", timeout=10)
    assert r.status_code == 200 and r.content == data
    r = requests.get(f"{region.url}/v2/", timeout=10)  # passed through to the origin
    assert r.status_code == 200
    r = requests.get(f"{region.url}/v2/lib/a/manifests/latest?ns=other.example:5000", timeout=10)
    assert r.status_code == 404


def test_100_concurrent_requests_cause_one_origin_get(registry, region_factory, tmp_path):
    data = random.Random(2).randbytes(8 << 20)
    digest = push_blob(registry, "train/image", data, tmp_path)
    region = region_factory(registry)
    url = f"{region.url}/v2/train/image/blobs/{digest}"
    rnd = random.Random(3)
    spans = [None if i % 10 == 0 else sorted(rnd.sample(range(len(data)), 2)) for i in range(100)]

    async def fetch_all():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            async def one(span):
                headers = {"Range": f"bytes={span[0]}-{span[1]}"} if span else {}
                async with session.get(url, headers=headers) as resp:
                    return resp.status, await resp.read()

            return await asyncio.gather(*(one(s) for s in spans))

    results = asyncio.run(fetch_all())
    for span, (status, body) in zip(spans, results):
        if span is None:
            assert status == 200 and body == data
        else:
            assert status == 206 and body == data[span[0]:span[1] + 1]
    stats = region.stats()
    assert stats["fills"] == 1
    assert stats["misses"] + stats["hits"] == 100
    assert stats["coalesced"] == stats["misses"] - 1
    assert stats["coalesced"] > 0
    # one copy of the whole blob (the fill's answers: one whole GET, or ranges around the
    # runs of range read bytes it takes instead); ranges ahead of the fill read from the
    # origin at most once; and the origin's log says so too (an answer the fill cut may
    # have had more in flight than the fill read of it)
    assert stats["origin_bytes"] + stats["fill_reused_bytes"] == len(data)
    assert stats["origin_range_bytes"] <= union_size((s[0], s[1] + 1) for s in spans if s)
    counted = stats["origin_bytes"] + stats["origin_range_bytes"]
    logged = origin_reads(registry, digest, counted)[3]
    assert counted <= logged <= len(data) + union_size((s[0], s[1] + 1) for s in spans if s)


def test_blob_that_does_not_match_its_digest_at_the_origin(registry, region_factory, tmp_path):
    small = random.Random(4).randbytes(300_000)
    large = random.Random(5).randbytes(5 << 20)
    region = region_factory(registry)
    for data in (small, large):
        digest = push_blob(registry, "lib/bad", data, tmp_path)
        stored = registry.storage / "docker/registry/v2/blobs/sha256" / digest[7:9] / digest[7:] / "data"
        bad = bytearray(data)
        bad[-1000:] = bytes(1000)  # same size, wrong bytes: the origin cannot tell
        stored.write_bytes(bad)

        if data is small:
            r = get(region, "lib/bad", digest)
            assert r.status_code == 502
            message = r.json()["errors"][0]["message"]
            assert digest in message and "hash to" in message and "not cached" in message
        else:
            # this response is already streaming when the digest check fails: cut short
            with pytest.raises((requests.exceptions.ChunkedEncodingError, requests.ConnectionError)):
                r = get(region, "lib/bad", digest)
                assert len(r.content) < len(data)
        assert not region.backend.contains(digest)
        # nothing cached: the next request goes to the origin again
        r = get(region, "lib/bad", digest, {"Range": "bytes=0-10"})
        assert origin_gets(registry, digest, 2) == 2
    stats = region.wait_idle()
    assert stats["fills_failed"] == 4 and stats["fills_committed"] == 0
    assert stats["backend"]["blobs"] == 0
    assert not os.listdir(Path(region.backend.root) / "tmp")


def test_a_corrupt_stored_copy_is_dropped_and_fetched_again(registry, region_factory, tmp_path):
    """Disk rot in the region's store, found after a restart: a whole-blob answer from
    the bad copy is cut short (never a complete bad body), a range answer makes the
    region check the copy in the background; either way the copy is dropped, and the
    next request is filled from the origin: good bytes, and a good copy in the backend."""
    from tests.services import wait_for

    data = random.Random(12).randbytes(3 << 20)
    digest = push_blob(registry, "lib/rot", data, tmp_path)
    root = tmp_path / "rot-store"

    def restart_with_rot(previous):
        if previous is not None:
            previous.stop()
        region = region_factory(registry, backend=backends.create("disk", root=root, capacity=1 << 30, fsync=False))
        if previous is None:
            assert get(region, "lib/rot", digest).content == data
            region.wait_idle()
            return restart_with_rot(region)
        bad = bytearray(data)
        bad[len(data) // 2] ^= 0xFF
        with open(region.backend.local_path(digest), "r+b") as fh:
            fh.write(bad)
        return region

    region = restart_with_rot(None)
    try:  # whole blob: the check fails before the last block is sent
        r = get(region, "lib/rot", digest)
        assert len(r.content) < len(data)
    except (requests.exceptions.ChunkedEncodingError, requests.ConnectionError):
        pass
    wait_for(lambda: not region.backend.contains(digest), "the bad copy to be dropped", 20)
    assert region.stats()["store_verify_failures"] == 1
    assert get(region, "lib/rot", digest).content == data
    region.wait_idle()
    assert region.backend.read(digest) == data

    region = restart_with_rot(region)
    get(region, "lib/rot", digest, {"Range": "bytes=0-99"})  # from the unchecked copy; starts the check
    wait_for(lambda: not region.backend.contains(digest), "the bad copy to be dropped", 20)
    r = get(region, "lib/rot", digest, {"Range": f"bytes={len(data) // 2 - 10}-{len(data) // 2 + 9}"})
    assert r.status_code == 206 and r.content == data[len(data) // 2 - 10:len(data) // 2 + 10]
    region.wait_idle()
    assert region.backend.read(digest) == data
    assert origin_gets(registry, digest, 3) == 3  # one fill, then one refill per detected rot


# --- auth ------------------------------------------------------------------------------------


def test_basic_auth_private_blob_is_served_only_to_clients_the_origin_would_serve(
        basic_registry, region_factory, tmp_path, docker_config):
    reg = basic_registry
    data = random.Random(6).randbytes(200_000)
    digest = push_blob(reg, "team-a/private", data, tmp_path, docker_config)
    other = push_blob(reg, "team-b/private", b"team b's secret layer", tmp_path, docker_config)
    region = region_factory(reg)
    good = basic(reg.username, reg.password)

    r = get(region, "team-a/private", digest, {"Authorization": good})  # client A: cached
    assert r.status_code == 200 and r.content == data
    assert region.wait_idle()["fills_committed"] == 1 and region.backend.contains(digest)

    r = get(region, "team-a/private", digest)  # client B, anonymous
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"].lower().startswith("basic")
    assert data[:100] not in r.content
    r = get(region, "team-a/private", digest, {"Authorization": basic(reg.username, "wrong")})
    assert r.status_code in (401, 403)
    r = get(region, "team-a/private", digest, {"Authorization": "Bearer not-a-token"})
    assert r.status_code in (401, 403)
    r = get(region, "team-a/private", digest, {"Range": "bytes=0-9"})  # remembered refusal
    assert r.status_code == 401

    # a blob cached through one repository is not served under another it is not in
    assert get(region, "team-b/private", other, {"Authorization": good}).status_code == 200
    r = get(region, "team-a/private", other, {"Authorization": good})
    assert r.status_code == 404

    r = get(region, "team-a/private", digest, {"Authorization": good, "Range": "bytes=5-9"})
    assert r.status_code == 206 and r.content == data[5:10]
    stats = region.stats()
    assert stats["denied"] >= 4 and stats["auth_cache_hits"] >= 1
    assert origin_gets(reg, digest) == 1


def test_a_cold_blobs_first_far_range_read_is_its_access_check(basic_registry, region_factory, tmp_path,
                                                                docker_config):
    """A range far into a cold blob (a lazy start's TOC) costs one origin round trip,
    not a HEAD and then a range read: the range read, made with the client's
    credentials, is the access check. The origin's refusal is the client's answer (and
    remembered), with no byte of the blob; the blob is served only under a repository
    it is in; the fill that starts from it commits one verified copy."""
    reg = basic_registry
    data = random.Random(16).randbytes(12 << 20)
    digest = push_blob(reg, "team-a/private", data, tmp_path, docker_config)
    push_blob(reg, "team-b/private", b"team b's own layer", tmp_path, docker_config)
    region = region_factory(reg)
    good = basic(reg.username, reg.password)
    far = {"Range": f"bytes={9 << 20}-{(10 << 20) - 1}"}
    heads = reg.count("HEAD", f"/blobs/{digest}")[0]  # (the push's)

    r = get(region, "team-a/private", digest, far)  # anonymous
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].lower().startswith("basic")
    assert data[9 << 20:(9 << 20) + 100] not in r.content
    r = get(region, "team-a/private", digest, {"Authorization": basic(reg.username, "wrong"), **far})
    assert r.status_code in (401, 403)
    r = get(region, "team-a/private", digest, {"Authorization": good, **far})
    assert r.status_code == 206 and r.content == data[9 << 20:10 << 20]
    stats = region.stats()
    assert stats["auth_checks"] == 0 and stats["range_probes"] == 3, stats  # no HEAD at all
    assert reg.count("HEAD", f"/blobs/{digest}")[0] == heads
    r = get(region, "team-a/private", digest, far)  # the refusal is remembered
    assert r.status_code == 401
    # under a repository the blob is not in: the origin's 404, never the bytes
    r = get(region, "team-b/private", digest, {"Authorization": good, **far})
    assert r.status_code == 404 and data[9 << 20:(9 << 20) + 100] not in r.content

    stats = region.wait_idle()
    assert stats["fills_committed"] == 1 and region.backend.contains(digest)
    assert stats["origin_bytes"] + stats["fill_reused_bytes"] == len(data)
    r = get(region, "team-a/private", digest, {"Authorization": good})
    assert r.status_code == 200 and r.content == data


def test_token_auth_origin(token_registry, region_factory, tmp_path, docker_config):
    reg = token_registry
    data = random.Random(7).randbytes(150_000)
    digest = push_blob(reg, "team-c/model", data, tmp_path, docker_config)
    region = region_factory(reg)

    # Basic credentials: the region does the token dance with them
    r = get(region, "team-c/model", digest, {"Authorization": basic(reg.username, reg.password)})
    assert r.status_code == 200 and r.content == data
    assert region.wait_idle()["fills_committed"] == 1 and region.backend.contains(digest)

    # anonymous: the token server refuses; the client sees the origin's bearer challenge
    r = get(region, "team-c/model", digest)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"].startswith("Bearer realm=")
    r = get(region, "team-c/model", digest, {"Authorization": basic(reg.username, "wrong")})
    assert r.status_code == 401

    # a token the client got itself from the token server (as docker and containerd do)
    scope = "repository:team-c/model:pull"
    tok = requests.get(reg.token_server.realm, params={"service": "shoal-test-registry", "scope": scope},
                       headers={"Authorization": basic(reg.username, reg.password)}, timeout=10).json()["token"]
    r = get(region, "team-c/model", digest, {"Authorization": f"Bearer {tok}", "Range": "bytes=1-3"})
    assert r.status_code == 206 and r.content == data[1:4]


# --- the node's fetch source ---------------------------------------------------------------


def test_region_source_in_a_fetch_chain(basic_registry, region_factory, tmp_path, docker_config):
    reg = basic_registry
    data = random.Random(8).randbytes(2 << 20)
    digest = push_blob(reg, "lib/chain", data, tmp_path, docker_config)  # also logs the node in
    region = region_factory(reg, tls=True)
    source = RegionSource(RegionLink(region.url, ca=region.ca))
    chain = FetchChain([source])
    ref = BlobRef(reg.host, "lib/chain", digest, len(data), plain_http=True)
    ranges = [(0, 10), (10, 20), (1 << 20, (1 << 20) + 5), (len(data) - 3, len(data))]
    assert chain.read_ranges(ref, ranges) == [data[a:b] for a, b in ranges]
    assert chain.statistics()["region"]["requests"] == 1
    with pytest.raises(NotHere):  # unknown at the origin
        source.read_ranges(BlobRef(reg.host, "lib/chain", digest_of(b"nope")), [(0, 1)])
    with pytest.raises(NotHere):  # another registry than the region's origin
        source.read_ranges(BlobRef("elsewhere.example", "lib/chain", digest), [(0, 1)])
    source.close()

    dead = RegionSource(f"http://127.0.0.1:{free_port()}", down_for=60)
    with pytest.raises(NotHere):
        dead.read_ranges(ref, [(0, 1)])
    with pytest.raises(NotHere, match="down"):  # remembered: not even tried
        dead.read_ranges(ref, [(0, 1)])
    dead.close()


def test_region_tls_refuses_a_ca_key_it_cannot_use_in_one_line_without_warnings(tmp_path):
    """A CA key of a kind the region does not sign with (DSA, deprecated by cryptography)
    is refused by name; a good CA loads without any warning on the way."""
    import warnings

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import dsa

    from shoal.errors import ShoalError

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the cryptography in .venv warns of what the module merely names
        ensure_region_tls(str(tmp_path / "good"), "127.0.0.1")
        ensure_region_tls(str(tmp_path / "good"), "127.0.0.1", ["region.example"])  # the CA loaded, a new server cert
    bad = tmp_path / "bad"
    ensure_region_tls(str(bad), "127.0.0.1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        key = dsa.generate_private_key(2048)
        (bad / "ca.key").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    with pytest.raises(ShoalError, match=r"ca\.key: a DSAPrivateKey cannot be the region's CA key") as err:
        ensure_region_tls(str(bad), "127.0.0.1", ["region.example"])
    assert "\n" not in str(err.value)


def test_region_source_pins_the_region_ca_and_keeps_credentials_off_plain_http(
        basic_registry, region_factory, tmp_path, docker_config, caplog):
    """Over HTTPS the region's certificate must chain to the pinned CA; to a plain-HTTP
    region the node sends no registry credentials (so a private blob is refused there),
    unless the region is on loopback and the node's option allows it."""
    reg = basic_registry
    data = random.Random(10).randbytes(64 << 10)
    digest = push_blob(reg, "lib/pin", data, tmp_path, docker_config)
    ref = BlobRef(reg.host, "lib/pin", digest, len(data), plain_http=True)
    secure = region_factory(reg, tls=True)
    stranger = ensure_region_tls(str(tmp_path / "another-ca"), "127.0.0.1")  # a CA of someone else
    for link in (RegionLink(secure.url, ca=stranger.ca), RegionLink(secure.url)):  # no CA: the system store
        source = RegionSource(link)
        with pytest.raises(TransportError, match="TLS refused .*certificate verify failed"):
            source.read_ranges(ref, [(0, 10)])
        source.close()
    pinned = RegionSource(RegionLink(secure.url, ca=secure.ca))
    assert pinned.read_ranges(ref, [(0, 10)]) == [data[:10]]
    pinned.close()
    assert oct(os.stat(secure.tls.key).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(secure.tls.key)).st_mode & 0o777) == "0o700"

    plain = region_factory(reg)
    source = RegionSource(plain.url)
    with caplog.at_level(logging.WARNING, "shoal.fetch"), pytest.raises(TransportError, match="HTTP 401"):
        source.read_ranges(ref, [(0, 10)])
    assert "registry credentials are not sent" in caplog.text
    source.close()
    allowed = RegionSource(RegionLink(plain.url, plain_http_credentials=True))  # loopback and asked for
    assert allowed.read_ranges(ref, [(0, 10)]) == [data[:10]]
    allowed.close()


# --- the S3 backend behind the server ------------------------------------------------------


def test_region_with_s3_backend(registry, region_factory, tmp_path, s3_bucket):  # noqa: F811
    data = random.Random(9).randbytes(3 << 20)
    digest = push_blob(registry, "lib/s3", data, tmp_path)
    backend = backends.create("s3", bucket=s3_bucket["bucket"], endpoint_url=s3_bucket["endpoint_url"],
                              prefix="region/", staging=tmp_path / "staging")
    region = region_factory(registry, backend=backend)
    r = get(region, "lib/s3", digest, {"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == data[10:20]
    assert region.wait_idle()["fills_committed"] == 1  # the upload finishes after the first response
    key = f"region/blobs/sha256/{digest[7:]}"
    assert s3_bucket["client"].head_object(Bucket=s3_bucket["bucket"], Key=key)["ContentLength"] == len(data)
    r = get(region, "lib/s3", digest, {"Range": "bytes=1048576-"})
    assert r.status_code == 206 and r.content == data[1 << 20:]
    assert region.stats()["hits"] >= 1
    assert origin_gets(registry, digest, 1) == 1
    assert not os.listdir(tmp_path / "staging")


# --- `shoal region` as a process ------------------------------------------------------------


def test_shoal_region_command(registry, tmp_path):
    data = random.Random(10).randbytes(500_000)
    digest = push_blob(registry, "lib/cli", data, tmp_path)
    port = free_port()
    config = tmp_path / "region.toml"
    config.write_text('backend = "disk"\n[disk]\ncapacity = "64M"\nfsync = false\n[auth]\nttl = 30.0\n'
                      '[tracker]\nsomething = "for another component"\n')
    log_path = tmp_path / "region.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "region", "--listen", f"127.0.0.1:{port}", "--origin", registry.url,
             "--store", str(tmp_path / "store dir"), "--config", str(config)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
        )
    try:
        line = proc.stdout.readline().decode()
        assert "serving" in line and f"https://127.0.0.1:{port}" in line, (line, log_path.read_text())
        # HTTPS by default, with a CA and certificate of its own made at first start
        tls = tmp_path / "store dir" / "tls"
        ca = str(tls / "ca.pem")
        assert {p.name: oct(p.stat().st_mode & 0o777) for p in tls.iterdir() if p.name.endswith((".key", "token"))} \
            == {"ca.key": "0o600", "server.key": "0o600", "swarm-ca.key": "0o600", "node-token": "0o600",
                "prefetch-token": "0o600"}
        assert oct(tls.stat().st_mode & 0o777) == "0o700"
        url = f"https://127.0.0.1:{port}"
        r = requests.get(f"{url}/v2/lib/cli/blobs/{digest}", headers={"Range": "bytes=0-99"}, timeout=30, verify=ca)
        assert r.status_code == 206 and r.content == data[:100]
        status = requests.get(f"{url}/-/status", timeout=10, verify=ca).json()
        assert status["misses"] == 1 and status["backend"]["capacity_bytes"] == 64 << 20
        with pytest.raises(requests.exceptions.SSLError):  # not a certificate the system trusts
            requests.get(f"{url}/-/status", timeout=10)
        with pytest.raises(requests.ConnectionError):  # no plain HTTP on the port
            requests.get(f"http://127.0.0.1:{port}/-/status", timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        text = log_path.read_text()
        assert digest in text and "127.0.0.1" in text  # logs name the blob and the client
        assert ca in text  # where nodes find the CA to pin
    finally:
        stop_process(proc)
        proc.stdout.close()


def test_metrics_text_format():
    """shoal/metrics.py, behind the node's /metrics and the region's /-/metrics: help and
    type lines, labels escaped, figures a service does not have (None) left out."""
    from shoal.metrics import parse, render

    text = render([
        ("a_total", "counter", "A.\nmore", 3),
        ("b_bytes", "gauge", "B.", [({"k": 'x"y\\z'}, 1.5), ({"k": "n"}, None)]),
        ("c", "gauge", "not known", None),
        ("d", "gauge", "D.", True),
    ])
    assert text == ('# HELP a_total A. more\n# TYPE a_total counter\na_total 3\n'
                    '# HELP b_bytes B.\n# TYPE b_bytes gauge\nb_bytes{k="x\\"y\\\\z"} 1.5\n'
                    '# HELP d D.\n# TYPE d gauge\nd 1\n')
    assert parse(text) == {"a_total": 3, 'b_bytes{k="x\\"y\\\\z"}': 1.5, "d": 1}


def test_shoal_region_usage_errors(tmp_path):
    def run(*args):
        return subprocess.run([sys.executable, "-m", "cli", "region", *args], check=False, cwd=REPO,
                              capture_output=True, text=True, timeout=60)

    r = run("--store", str(tmp_path))
    assert r.returncode == 2 and "origin" in r.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text("[disk]\ncapacity = -5\n")
    r = run("--origin", "http://127.0.0.1:1", "--config", str(bad))
    assert r.returncode == 2 and "disk.capacity = -5" in r.stderr
    r = run("--origin", "http://127.0.0.1:1", "--plain-http", "--listen", "192.0.2.1:5080")
    assert r.returncode == 2 and "plain HTTP" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = run("--origin", "ftp://x", "--store", str(tmp_path / "s"), "--listen", "127.0.0.1:0")
    assert r.returncode in (1, 2) and "origin" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_shoal_region_serves_torrent_metadata_only_to_allowed_clients(basic_registry, tmp_path, docker_config):
    """`shoal region` carries the swarm's metadata service: a blob's .torrent is made from
    the verified blob, and refused to a client the origin would refuse."""
    from p2p.metainfo import parse_torrent

    docker_config.login(basic_registry.host, basic_registry.username, basic_registry.password)
    data = random.Random(11).randbytes(3 << 20)
    digest = push_blob(basic_registry, "team/private", data, tmp_path, docker_config)
    port = free_port()
    log_path = tmp_path / "region.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "region", "--listen", f"127.0.0.1:{port}", "--origin",
             basic_registry.url, "--store", str(tmp_path / "store")],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
        )
    try:
        assert "serving" in proc.stdout.readline().decode(), log_path.read_text()
        ca = str(tmp_path / "store" / "tls" / "ca.pem")
        token = (tmp_path / "store" / "tls" / "node-token").read_text().strip()
        base = f"https://127.0.0.1:{port}/p2p/v1"
        url = f"{base}/torrents/{digest}?repo=team/private"
        node = {"X-Shoal-Node-Token": token}
        good = {"Authorization": basic(basic_registry.username, basic_registry.password), **node}
        ih = "%01" * 20
        # without the region's node token: no metadata, no tracker, whatever the registry credentials
        for call in (url, f"{base}/announce?info_hash={ih}&port=6881&left=1", f"{base}/scrape?info_hash={ih}",
                     f"{base}/rank?info_hash={ih}&port=6881", f"{base}/status"):
            for headers in ({}, {"Authorization": good["Authorization"]}, {"X-Shoal-Node-Token": "guess"}):
                r = requests.get(call, headers=headers, timeout=30, verify=ca)
                assert r.status_code == 401 and "node token" in r.text, (call, headers, r.status_code)
        assert requests.get(url, headers=node, timeout=30, verify=ca).status_code == 401  # no registry credentials
        # a bad-bytes report makes the region re-hash its copy: only its nodes may ask
        check = f"https://127.0.0.1:{port}/-/check/{digest}"
        assert requests.post(check, headers={"X-Shoal-Node-Token": "guess"}, timeout=30, verify=ca).status_code == 401
        assert requests.post(check, headers=node, timeout=30, verify=ca).status_code == 202
        # rank: the address the region sees, and only a port that address announced
        assert requests.get(f"{base}/rank?info_hash={ih}&port=7000", headers=node, timeout=30,
                            verify=ca).status_code == 400
        assert b"interval" in requests.get(f"{base}/announce?info_hash={ih}&port=7000&left=1", headers=node,
                                           timeout=30, verify=ca).content
        assert requests.get(f"{base}/rank?info_hash={ih}", headers=node, timeout=30, verify=ca).json()["rank"] == 0
        deadline = time.monotonic() + 30
        while True:  # the first request starts the fill through the region: 404 + Retry-After
            r = requests.get(url, headers=good, timeout=30, verify=ca)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            assert r.status_code == 404 and "Retry-After" in r.headers, (r.status_code, r.text)
            time.sleep(0.2)
        assert r.status_code == 200, r.text
        meta, announce = parse_torrent(r.content, digest, len(data))
        assert meta.length == len(data) and announce and announce.endswith("/p2p/v1/announce")
        assert requests.get(url, headers={"Authorization": basic("intruder", "nope"), **node}, timeout=30,
                            verify=ca).status_code in (401, 403)
        status = requests.get(f"https://127.0.0.1:{port}/-/status", timeout=10, verify=ca).json()
        assert status["swarm"]["unauthorized"] == 15 and status["swarm"]["refused"] == 1
    finally:
        stop_process(proc)
        proc.stdout.close()


def test_a_torrent_from_published_piece_hashes_comes_at_once_and_is_replaced_if_they_lie(registry, tmp_path):
    """A blob the region does not hold, whose piece hashes are published beside it
    (builder/pieces.py): its torrent comes at once, made from them (no 404 while a fill
    runs). These lie; once the region holds the blob, the next request checks them against
    it, and the torrent is replaced by the blob's own (an ERROR line names the blob)."""
    from builder.pieces import PieceHasher, Pieces, push_pieces
    from p2p.metainfo import parse_torrent
    from tests.services import start_region

    data = random.Random(21).randbytes(3 << 20)
    digest = push_blob(registry, "team/pieces", data, tmp_path)
    lying = Pieces(digest, len(data), 256 << 10, bytes(20 * 12))
    push_pieces(registry.host, "team/pieces", lying, plain_http=True)
    honest = PieceHasher(len(data), 256 << 10)
    honest.update(data)
    proc, url, ca = start_region(registry.url, tmp_path / "store", tmp_path / "region.log")
    try:
        node = {"X-Shoal-Node-Token": (tmp_path / "store" / "tls" / "node-token").read_text().strip()}
        torrent = f"{url}/p2p/v1/torrents/{digest}?repo=team/pieces"

        def pieces() -> bytes:
            r = requests.get(torrent, headers=node, timeout=30, verify=ca)
            assert r.status_code == 200, (r.status_code, r.text)
            return parse_torrent(r.content, digest, len(data))[0].hashes

        assert pieces() == lying.hashes  # at once: the published ones
        blob = requests.get(f"{url}/v2/team/pieces/blobs/{digest}", timeout=30, verify=ca)
        assert blob.content == data
        deadline = time.monotonic() + 60
        while pieces() != honest.finish(digest).hashes:  # each request after the fill may check them
            assert time.monotonic() < deadline, "the lying piece hashes were never replaced"
            time.sleep(0.2)
        status = requests.get(f"{url}/-/status", timeout=10, verify=ca).json()
        assert status["swarm"]["torrents"]["published"] == 1 and status["swarm"]["torrents"]["published_lied"] == 1
        log = (tmp_path / "region.log").read_text()
        assert any("ERROR" in line and digest in line and "do not match" in line for line in log.splitlines())
    finally:
        stop_process(proc)
        proc.stdout.close()


class _BlobOrigin:
    """An origin with one blob (enough of the registry API for the region), whose answers
    a subclass shapes: answer(first, body) sends the body of a GET from byte `first`
    (the whole blob's from 0, else a range's) to `out`."""

    def __init__(self, name: str, data: bytes) -> None:
        import http.server

        self.data, self.digest = data, digest_of(data)
        blob_path = f"/v2/{name}/blobs/{self.digest}"
        origin = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _head(self, code: int, length: int, extra: dict) -> None:
                self.send_response(code)
                self.send_header("Content-Length", str(length))
                self.send_header("Docker-Content-Digest", origin.digest)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.end_headers()

            def do_HEAD(self) -> None:
                if self.path != blob_path:
                    self._head(404, 0, {})
                    return
                self._head(200, len(origin.data), {})

            def do_GET(self) -> None:
                if self.path == "/v2/":
                    self._head(200, 0, {})
                    return
                if self.path != blob_path:
                    self._head(404, 0, {})
                    return
                size = len(origin.data)
                first, last = 0, size - 1
                header = self.headers.get("Range", "")
                if header.startswith("bytes="):
                    a, _, b = header[6:].partition("-")
                    first, last = int(a), min(int(b) if b else size - 1, size - 1)
                origin.asked(first)
                body = origin.data[first:last + 1]
                extra = {"Content-Range": f"bytes {first}-{last}/{size}"} if header else {}
                self._head(206 if header else 200, len(body), extra)
                try:
                    origin.answer(first, body, self.wfile)
                except OSError:
                    pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def asked(self, first: int) -> None:
        """A GET from byte `first` came (called before the answer starts)."""

    def answer(self, first: int, body: bytes, out) -> None:
        out.write(body)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _RangeCorruptingOrigin(_BlobOrigin):
    """An origin whose whole-blob answers are right and slow, and whose range answers
    from past the first byte are wrong: what a broken range path in front of an origin
    looks like to the region."""

    def answer(self, first: int, body: bytes, out) -> None:
        if first > 0:  # the broken range path
            body = bytes(x ^ 0xFF for x in body)
        for i in range(0, len(body), 64 << 10):
            out.write(body[i:i + (64 << 10)])
            if first == 0:
                time.sleep(0.02)  # the fill is slow: range reads get ahead of it


def test_a_fill_that_took_bad_range_bytes_fails_and_the_next_fill_takes_none(region_factory):
    """Bytes range reads brought are taken into the fill's hash (one origin copy in all),
    so a broken range answer fails the fill's digest check; the blob's next fill then
    fetches every byte itself, and the blob is cached, though its range answers stay
    broken (else it would never be)."""
    data = random.Random(9).randbytes(12 << 20)
    origin = _RangeCorruptingOrigin("lib/ranges", data)
    try:
        region = region_factory(origin)
        ahead = {"Range": f"bytes={8 << 20}-{len(data) - 1}"}  # past fill_window: a range read
        r = get(region, "lib/ranges", origin.digest, ahead)
        assert r.status_code == 206 and r.content != data[8 << 20:]  # ranges are not the region's to check
        stats = region.wait_idle(60)
        assert stats["fills_failed"] == 1 and stats["fills_committed"] == 0
        assert stats["fill_reused_bytes"] > 0  # the failure came from the bytes it took
        assert not region.backend.contains(origin.digest)

        r = get(region, "lib/ranges", origin.digest, ahead)  # range reads ahead of the next fill too
        stats = region.wait_idle(60)
        assert stats["fills_failed"] == 1 and stats["fills_committed"] == 1, stats
        assert region.backend.contains(origin.digest)
        whole = get(region, "lib/ranges", origin.digest)
        assert whole.status_code == 200 and whole.content == data
    finally:
        origin.close()


class _SlowWholeOrigin(_BlobOrigin):
    """An origin whose whole-blob answers are slow (the fill), and whose range answers go
    out at once."""

    def answer(self, first: int, body: bytes, out) -> None:
        for i in range(0, len(body), 64 << 10):
            out.write(body[i:i + (64 << 10)])
            if first == 0:
                time.sleep(0.02)


@pytest.mark.parametrize("background", [False, True])
def test_a_background_range_far_ahead_of_a_fill_waits_for_it_and_costs_the_origin_nothing_more(
        region_factory, background):
    """A range far ahead of a running fill goes to the origin as a range at once (a start
    waits on it), and the fill reads those bytes again (a run shorter than it takes):
    more than one copy. A background read (a preheat's warm-up, a proof:
    BACKGROUND_HEADER) waits for the fill instead: one copy."""
    data = random.Random(12).randbytes(12 << 20)
    origin = _SlowWholeOrigin("lib/slow", data)
    try:
        region = region_factory(origin)
        assert get(region, "lib/slow", origin.digest, {"Range": "bytes=0-1023"}).content == data[:1024]
        at = 8 << 20  # past fill_window ahead of the fill, which has about 1 MiB by now
        headers = {"Range": f"bytes={at}-{at + (1 << 20) - 1}"}
        if background:
            headers[BACKGROUND_HEADER] = "1"
        r = get(region, "lib/slow", origin.digest, headers)
        assert r.status_code == 206 and r.content == data[at:at + (1 << 20)]
        stats = region.wait_idle(60)
        assert stats["fills_committed"] == 1
        if background:
            assert stats["origin_range_bytes"] == 0 and stats["origin_bytes"] == len(data), stats
        else:
            assert stats["origin_range_bytes"] == 1 << 20, stats
            assert stats["origin_bytes"] + stats["origin_range_bytes"] > len(data), stats
    finally:
        origin.close()


class _HeldRangeOrigin(_BlobOrigin):
    """An origin that answers a range request (from past the first byte) only once the
    test says so (`send`; `heard` is set when one came), then sends its first `part`
    bytes and holds the rest until the test releases it (`go`); whole-blob answers go
    out at once."""

    def __init__(self, name: str, data: bytes, part: int) -> None:
        self.part = part
        self.heard, self.send, self.go = threading.Event(), threading.Event(), threading.Event()
        super().__init__(name, data)

    def asked(self, first: int) -> None:
        if first > 0:
            self.heard.set()
            self.send.wait(60)

    def answer(self, first: int, body: bytes, out) -> None:
        if first > 0:
            out.write(body[:self.part])
            out.flush()
            self.go.wait(60)
            body = body[self.part:]
        out.write(body)

    def close(self) -> None:
        self.send.set()
        self.go.set()
        super().close()


def test_a_range_ahead_of_the_fill_goes_out_as_the_origin_sends_it(region_factory):
    """A range answer ahead of the fill (a lazy start's TOC read) hands the origin's
    bytes on as they come, before they are in the fill's staging file: with every I/O
    thread of the region busy from before the origin's answer (the staging file can be
    neither opened nor written) and the origin holding back the rest of the range, the
    client has the range's first part already. Once both go on, the answer is whole
    and right and the fill commits the blob."""
    import http.client

    data = random.Random(11).randbytes(12 << 20)
    part = 256 << 10
    origin = _HeldRangeOrigin("lib/held", data, part)
    busy, started = threading.Event(), threading.Semaphore(0)
    try:
        region = region_factory(origin, io_threads=2)
        start = len(data) - (1 << 20)
        conn = http.client.HTTPConnection("127.0.0.1", region.port, timeout=30)
        conn.request("GET", f"/v2/lib/held/blobs/{origin.digest}", headers={"Range": f"bytes={start}-{len(data) - 1}"})
        assert origin.heard.wait(30), "the region did not ask the origin for the range"

        def hold() -> None:
            started.release()
            busy.wait(60)

        for _ in range(2):  # the region's whole I/O pool
            region.cache._pool.submit(hold)
        for _ in range(2):
            assert started.acquire(timeout=30)
        origin.send.set()
        resp = conn.getresponse()
        assert resp.status == 206
        first = resp.read(part)  # (a timeout here: the bytes waited for the staging file)
        assert first == data[start:start + part]
        busy.set()
        origin.go.set()
        assert first + resp.read() == data[start:]
        conn.close()
        stats = region.wait_idle(60)
        assert stats["fills_committed"] == 1 and stats["origin_range_bytes"] == 1 << 20, stats
        assert get(region, "lib/held", origin.digest).content == data
    finally:
        busy.set()
        origin.close()


def _on_loop(region: RunningRegion, fn, *args) -> None:
    """Call fn(*args) on the region's event loop (its state is the loop's alone)."""
    async def call():
        fn(*args)

    asyncio.run_coroutine_threadsafe(call(), region.loop).result(timeout=10)


def test_a_held_blob_costs_the_origin_the_ranges_asked_then_one_copy(registry, region_factory, tmp_path):
    """While a profile preheat holds a blob (hold_fills), the region answers its ranges by
    range reads alone: the origin serves the ranges the nodes ask for, once each however
    many nodes ask, and no whole copy. When the hold ends, or a client asks for the whole
    blob, the region fetches the blob whole, taking what it has, and commits one
    verified copy."""
    data = random.Random(21).randbytes(16 << 20)
    digest = push_blob(registry, "lib/held", data, tmp_path)
    region = region_factory(registry)
    _on_loop(region, region.cache.hold_fills, [digest], 600.0)
    # what a profile's warm-up reads: chunks at the start (within fill_window), in the
    # middle, overlapping ones, and the TOC at the end; two nodes ask for each at once
    spans = [(0, 64 << 10), (100 << 10, 300 << 10), (200 << 10, 400 << 10), (9 << 20, (9 << 20) + 4096),
             (len(data) - (70 << 10), len(data))]

    def read(span) -> bytes:
        r = get(region, "lib/held", digest, {"Range": f"bytes={span[0]}-{span[1] - 1}"})
        assert r.status_code == 206, r.text
        return r.content

    for _ in range(2):  # the second round is served from what the first brought
        results: dict[int, list[bytes]] = {}
        threads = [threading.Thread(target=lambda i=i, s=s, out=results: out.setdefault(i, []).append(read(s)))
                   for i, s in enumerate(spans) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(got == [data[a:b]] * 2 for (a, b), got in zip(spans, (results[i] for i in range(len(spans)))))
        stats = region.stats()
        assert stats["fills_running"] == 0 and stats["fills_holding"] == 1
        whole, _, range_bytes, _ = origin_reads(registry, digest)
        assert whole == 0 and range_bytes == union_size(spans), (whole, range_bytes, union_size(spans))

    _on_loop(region, region.cache.release_fills, [digest])
    stats = region.wait_idle(60)
    assert stats["fills_committed"] == 1 and stats["fills_holding"] == 0 and region.backend.contains(digest)
    assert stats["origin_bytes"] + stats["fill_reused_bytes"] == len(data)
    # one copy in all: the fill took every run of 64 KiB or more that the range reads
    # brought (and read the 4 KiB one again)
    assert registry.count("GET", f"/blobs/{digest}")[1] == len(data) + 4096
    r = get(region, "lib/held", digest)
    assert r.status_code == 200 and r.content == data

    # a held blob whose whole is asked for is fetched whole at once
    other = random.Random(22).randbytes(6 << 20)
    digest2 = push_blob(registry, "lib/held", other, tmp_path)
    _on_loop(region, region.cache.hold_fills, [digest2], 600.0)
    assert get(region, "lib/held", digest2, {"Range": "bytes=5000000-5000099"}).content == \
        other[5000000:5000100]
    r = get(region, "lib/held", digest2)
    assert r.status_code == 200 and r.content == other
    stats = region.wait_idle(60)
    assert stats["fills_committed"] == 2 and region.backend.contains(digest2)
