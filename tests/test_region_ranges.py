"""The region serves any range of any blob at once (issue 12): real processes in a
network lab (tests/lab/netlab.py). The origin (Debian's docker-registry) runs in a namespace of
its own behind a `tc tbf` capped link, so a fill of a cold blob takes seconds; `shoal
region` runs in the hub; the clients run in node namespaces, and the nodes' reads are
made as a node makes them (tests/region_reader.py: RegionSource, the node's chunk
loader, every chunk verified).

What the origin served is read from its own access log: a fill is a GET answered 200
(the whole blob), a range read a GET answered 206 with the bytes it wrote.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_region import union_size

pytest.importorskip("aiohttp", reason="aiohttp is needed for the region (shoal[node])")

from builder.format.footer import location_from_annotations
from builder.format.writer import LayerWriter
from tests.imagetools import make_tar
from tests.lab import netlab
from tests.services import wait_for

MiB = 1 << 20
ORIGIN_MBIT = 40  # the origin's uplink: 5 MB/s, so a fill of a few MiB takes a second or more


_MISSING = netlab.lab_missing()
pytestmark = [pytest.mark.registry, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]


@dataclass
class World:
    lab: netlab.Lab
    origin_host: netlab.Host
    readers: list[netlab.Host]
    registry: netlab.LabRegistry
    region: netlab.LabRegion  # the default configuration
    eager: netlab.LabRegion  # fill_window = 0: every range past the fill is read at once
    workdir: Path

    def push(self, repository: str, data: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        path = self.workdir / f"blob-{digest[7:19]}"
        path.write_bytes(data)
        netlab.push_blob(self.lab, self.registry, repository, path, digest)
        path.unlink()
        return digest

    def origin_reads(self, digest: str) -> list[tuple[int, int]]:
        """(status, bytes written) of each GET of the blob the origin logged."""
        return [(int(e["http.response.status"]), int(e.get("http.response.written", 0)))
                for e in netlab.registry_log(self.registry.log_path)
                if e.get("http.request.method") == "GET" and f"/blobs/{digest}" in e.get("http.request.uri", "")]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("region-ranges")
    lab = netlab.Lab()
    try:
        origin_host = lab.add_node()  # capped by each test after its pushes
        readers = [lab.add_node() for _ in range(4)]
        registry = netlab.start_registry(lab, workdir / "origin", host=origin_host)
        region = netlab.start_region(lab, workdir / "region", registry)
        eager = netlab.start_region(lab, workdir / "eager", registry, port=5081, config='fill_window = "0"\n')
        yield World(lab, origin_host, readers, registry, region, eager, workdir)
    finally:
        lab.close()


@pytest.fixture
def capped_origin(world):
    """The origin's link capped at ORIGIN_MBIT for the test (pushes happen before)."""
    def cap() -> None:
        world.lab.cap(world.origin_host, ORIGIN_MBIT)

    yield cap
    world.lab.uncap(world.origin_host)


def _wait_committed(world: World, region: netlab.LabRegion, digest: str) -> dict:
    def done():
        status = region.status(world.lab)["region"]
        return status if digest not in status["filling"] and status["fills_running"] == 0 else None

    return wait_for(done, f"the fill of {digest}", 120, interval=0.2)


def _trusting(region) -> dict:
    """The environment of a client process that trusts the region's own CA (HTTPS, the
    region's default; urllib reads SSL_CERT_FILE)."""
    return {**netlab._env(), "SSL_CERT_FILE": region.ca}


_GET_THEN_STATUS = """
import hashlib, json, sys, urllib.request
url, first, last, status_url = sys.argv[1:]
req = urllib.request.Request(url, headers={"Range": f"bytes={first}-{last}"})
with urllib.request.urlopen(req, timeout=60) as resp:
    body, code = resp.read(), resp.status
status = json.loads(urllib.request.urlopen(status_url, timeout=10).read())
print(json.dumps({"code": code, "sha": hashlib.sha256(body).hexdigest(), "len": len(body), "status": status}))
"""


def test_a_range_past_the_fill_is_answered_while_the_fill_runs(world, capped_origin):
    """The last MiB of a cold blob (where a layer's TOC is) is read from the origin as a
    range and answered while the region's fill is still far from it; the fill goes on
    and commits one verified copy."""
    data = random.Random(1).randbytes(16 * MiB)
    digest = world.push("ranges/tail", data)
    start = len(data) - MiB
    capped_origin()
    url = f"{world.region.url}/v2/ranges/tail/blobs/{digest}"
    out = world.lab.run(world.readers[0], [sys.executable, "-c", _GET_THEN_STATUS, url, str(start),
                                           str(len(data) - 1), world.region.url + "/-/status"], timeout=120,
                        env=_trusting(world.region))
    assert out.returncode == 0, out.stderr[-2000:]
    answer = json.loads(out.stdout)
    assert answer["code"] == 206 and answer["sha"] == hashlib.sha256(data[start:]).hexdigest()
    # the region's own figures, right after the answer: the fill had not reached the range
    filling = answer["status"]["filling"].get(digest)
    assert filling is not None, answer["status"]
    assert filling["size"] == len(data) and filling["written"] < start

    status = _wait_committed(world, world.region, digest)
    assert status["store_verify_failures"] == 0
    reads = world.origin_reads(digest)
    # one copy in all: the range, and the fill's answer up to it (or, had it started
    # before the range read, its whole answer)
    assert sorted(reads) in ([(206, MiB), (206, len(data) - MiB)], [(200, len(data)), (206, MiB)]), reads
    assert status["origin_range_bytes"] == MiB

    # the stored copy is the fill's: whole and good
    out = world.lab.run(world.readers[1], [sys.executable, "-c", _GET_THEN_STATUS, url, "0", str(len(data) - 1),
                                           world.region.url + "/-/status"], timeout=120, env=_trusting(world.region))
    assert json.loads(out.stdout)["sha"] == hashlib.sha256(data).hexdigest()
    assert len(world.origin_reads(digest)) == 2


def _chunked_layer(seed: int) -> tuple[bytes, dict, dict[str, str]]:
    """A zstd:chunked layer of incompressible files (small ones and a few of several
    chunks): (blob, annotations, {file name: sha256 of its content})."""
    rnd = random.Random(seed)
    files: dict[str, bytes | None] = {"app": None}
    for i in range(24):
        files[f"app/mod{i:02d}.bin"] = rnd.randbytes(rnd.randrange(32 << 10, 600 << 10))
    for i in range(2):
        files[f"app/big{i}.bin"] = rnd.randbytes(3 * MiB)
    out = io.BytesIO()
    result = LayerWriter().write(io.BytesIO(make_tar(files)), out)
    want = {name: "sha256:" + hashlib.sha256(content).hexdigest() for name, content in files.items() if content}
    return out.getvalue(), result.annotations, want



def test_nodes_starting_one_lazy_layer_cost_the_origin_one_copy_of_each_range(world, capped_origin):
    """Four nodes start reading one cold lazy layer at the same moment behind a cold
    region: each reads the TOC, then every file in an order of its own. The origin serves
    the TOC range once and every chunk range at most once (plus the fill's one whole
    copy), and no read waits for the fill: each node has the TOC, and files, while the
    region's fill has not reached them yet."""
    blob, annotations, want = _chunked_layer(2)
    digest = world.push("ranges/lazy", blob)
    loc = location_from_annotations(annotations)
    capped_origin()
    at = time.time() + 1.5  # the readers start at one moment
    procs = []
    for i, host in enumerate(world.readers):
        procs.append(world.lab.popen(host, [
            sys.executable, "-m", "tests.region_reader", world.eager.url, world.registry.host, "ranges/lazy",
            digest, str(len(blob)), json.dumps(annotations), "--seed", str(i), "--at", str(at),
            "--ca", world.eager.ca],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=netlab.REPO_ROOT, env=netlab._env()))
    outs = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=180)
        assert proc.returncode == 0, stderr.decode()[-2000:]
        outs.append(json.loads(stdout))
    for out in outs:
        assert out["files"] == want and out["toc"] == [loc.toc.offset, loc.toc.end]
    # no read waited for the fill: every node had its TOC, at the blob's end, while the
    # fill was still before it, and read files that the fill had not reached yet
    for out in outs:
        toc_start, _, _, after = out["loads"][0]
        assert after < toc_start, out["loads"][0]
        ahead = [load for load in out["loads"][1:] if load[3] < load[0]]
        assert ahead, out["loads"]

    status = _wait_committed(world, world.eager, digest)
    origin = world.origin_reads(digest)
    # the fill: one whole answer at most (it reads ranges past what range reads hold,
    # and takes the rest from them: docs/cache.md, "One copy in all")
    assert [code for code, _ in origin].count(200) <= 1
    ranges = [w for code, w in origin if code == 206]
    assert all(code in (200, 206) for code, _ in origin)
    # every byte the nodes asked for came from the origin at most once, besides the fill's
    # one copy of the blob (less what it took from range reads)
    asked = union_size([tuple(r) for out in outs for r in out["asked"]])
    assert sum(w for _, w in origin) <= len(blob) + asked
    assert status["origin_bytes"] + status["fill_reused_bytes"] == len(blob)
    assert ranges.count(loc.toc.end - loc.toc.offset) == 1  # four nodes, one TOC range read
    # (the region counts what it received: a read the fill overtook is cut, the origin may
    # have sent more into the connection than the region read from it)
    assert status["range_joins"] >= 3 and 0 < status["origin_range_bytes"] <= sum(ranges)
    # ... while serving each node every byte it read
    assert status["bytes_served"] >= 4 * asked


def test_the_fill_takes_what_range_reads_brought_one_origin_copy_in_all(world, capped_origin):
    """Range reads far ahead of a cold blob's fill bring most of it; the fill does not
    fetch those bytes again: it takes each run of them from the staging file into its
    hash and asks the origin (`Range: bytes=POS-`) only for what no range read
    brought. The origin serves about one copy of the blob in all, and the stored copy
    is whole and good."""
    data = random.Random(4).randbytes(24 * MiB)
    digest = world.push("ranges/reuse", data)
    # two adjacent reads (one run of 7 MiB), a gap the fill reads itself, a run to the end
    spans = [(5 * MiB, 9 * MiB), (9 * MiB, 12 * MiB), (14 * MiB, 19 * MiB), (19 * MiB, 24 * MiB)]
    before = world.region.status(world.lab)["region"]
    capped_origin()
    url = f"{world.region.url}/v2/ranges/reuse/blobs/{digest}"
    procs = [world.lab.popen(host, [sys.executable, "-c", _GET_THEN_STATUS, url, str(a), str(b - 1),
                                    world.region.url + "/-/status"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_trusting(world.region))
             for host, (a, b) in zip(world.readers, spans, strict=True)]
    for proc, (a, b) in zip(procs, spans, strict=True):
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr.decode()[-2000:]
        answer = json.loads(stdout)
        assert answer["code"] == 206 and answer["sha"] == hashlib.sha256(data[a:b]).hexdigest()

    status = _wait_committed(world, world.region, digest)
    assert status["fills_committed"] == before["fills_committed"] + 1
    assert status["fills_failed"] == before["fills_failed"]
    reads = world.origin_reads(digest)
    served = sum(written for _, written in reads)
    print(f"origin answers {reads}; {served / len(data):.3f} bytes per blob byte")
    # the fill's answers: ranges up to each run of range read bytes (or its first, whole,
    # answer cut at the first run, if the range reads came after it had started)
    assert [code for code, _ in reads].count(200) <= 1 and all(code in (200, 206) for code, _ in reads)
    # one copy in all (and what the origin had in flight in an answer the fill cut)
    assert served <= 1.1 * len(data), reads
    got = {k: status[k] - before[k] for k in ("origin_bytes", "origin_range_bytes", "fill_reused_bytes")}
    assert got["origin_range_bytes"] == sum(b - a for a, b in spans)
    # the fill took (nearly) every range read's byte from the staging file
    assert got["fill_reused_bytes"] >= sum(b - a for a, b in spans) - 2 * MiB, got
    assert got["origin_bytes"] + got["fill_reused_bytes"] == len(data), got
    assert got["origin_bytes"] + got["origin_range_bytes"] <= 1.05 * len(data), got

    # the stored copy is the fill's, every byte of it checked against the digest
    out = world.lab.run(world.readers[0], [sys.executable, "-c", _GET_THEN_STATUS, url, "0", str(len(data) - 1),
                                           world.region.url + "/-/status"], timeout=120, env=_trusting(world.region))
    answer = json.loads(out.stdout)
    assert answer["sha"] == hashlib.sha256(data).hexdigest()
    assert answer["status"]["hits"] == status["hits"] + 1 and answer["status"]["store_verify_failures"] == 0
    assert len(world.origin_reads(digest)) == len(reads)  # served from the store


def test_the_fill_leaves_out_the_small_runs_range_reads_bring_while_it_runs(world, capped_origin):
    """A lazy start's first reads: its TOC at the blob's end, then chunks of about a MiB
    scattered over the blob, all while the region's fill has only begun. The fill knows
    the size (from the TOC's range read), so it asks the origin for a segment at a time
    (FILL_SEGMENT) and plans each next request around the runs range reads brought,
    shorter ones too (TAKE_PLANNED): it takes them from the staging file and the origin
    serves one copy of the blob, not one plus those chunks."""
    from cache.region.server import FILL_SEGMENT, TAKE_AT_LEAST, TAKE_PLANNED

    size = 40 * MiB
    assert FILL_SEGMENT < 34 * MiB and TAKE_PLANNED <= MiB < TAKE_AT_LEAST  # the case under test
    data = random.Random(6).randbytes(size)
    digest = world.push("ranges/scattered", data)
    spans = [(size - MiB, size), (34 * MiB, 35 * MiB), (36 * MiB + MiB // 2, 37 * MiB + MiB // 2),
             (38 * MiB, 39 * MiB)]
    before = world.region.status(world.lab)["region"]
    capped_origin()
    url = f"{world.region.url}/v2/ranges/scattered/blobs/{digest}"

    def get(host, a, b):
        return world.lab.popen(host, [sys.executable, "-c", _GET_THEN_STATUS, url, str(a), str(b - 1),
                                      world.region.url + "/-/status"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_trusting(world.region))

    first = get(world.readers[0], *spans[0])  # the TOC: its range read starts the fill
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 0, stderr.decode()[-2000:]
    procs = [get(host, a, b) for host, (a, b) in zip(world.readers[1:], spans[1:], strict=True)]
    for proc, (a, b) in zip([first, *procs], spans, strict=True):
        if proc is not first:
            stdout, stderr = proc.communicate(timeout=120)
            assert proc.returncode == 0, stderr.decode()[-2000:]
        answer = json.loads(stdout)
        assert answer["code"] == 206 and answer["sha"] == hashlib.sha256(data[a:b]).hexdigest()
        if proc is not first:  # answered ahead of the fill, while it ran
            assert answer["status"]["filling"][digest]["written"] < a, answer["status"]["filling"]

    status = _wait_committed(world, world.region, digest)
    assert status["fills_committed"] == before["fills_committed"] + 1
    reads = world.origin_reads(digest)
    served = sum(written for _, written in reads)
    print(f"origin answers {reads}; {served / size:.3f} bytes per blob byte")
    assert all(code == 206 for code, _ in reads), reads  # (the fill knew the size: ranges only)
    got = {k: status[k] - before[k] for k in ("origin_bytes", "origin_range_bytes", "fill_reused_bytes")}
    assert got["origin_range_bytes"] == sum(b - a for a, b in spans), got
    assert got["fill_reused_bytes"] == sum(b - a for a, b in spans), got  # every run taken, none read again
    assert got["origin_bytes"] + got["fill_reused_bytes"] == size, got
    assert served == size, reads  # one copy

    out = world.lab.run(world.readers[0], [sys.executable, "-c", _GET_THEN_STATUS, url, "0", str(size - 1),
                                           world.region.url + "/-/status"], timeout=120, env=_trusting(world.region))
    assert json.loads(out.stdout)["sha"] == hashlib.sha256(data).hexdigest()  # the stored copy: whole and good


_GET_OUTCOME = """
import json, sys, urllib.request, http.client
url, first, last = sys.argv[1:]
req = urllib.request.Request(url, headers={"Range": f"bytes={first}-{last}"})
try:
    with urllib.request.urlopen(req, timeout=60) as resp:
        body = resp.read()
    print(json.dumps({"status": resp.status, "len": len(body)}))
except urllib.error.HTTPError as e:
    print(json.dumps({"status": e.code, "len": 0, "body": e.read().decode(errors="replace")[:300]}))
except (http.client.IncompleteRead, ConnectionError) as e:
    print(json.dumps({"status": "cut", "len": len(getattr(e, "partial", b""))}))
"""


def test_a_range_read_that_loses_the_origin_fails_the_answer_without_retrying(world, tmp_path):
    """The origin goes away while a range read ahead of the fill is under way: the
    client's answer is cut (a short body; a node asks its next source), the region does
    not retry the read on its own, and answers the next request
    for the blob with one clear error instead of hanging."""
    lab = world.lab
    host = lab.add_node()
    registry = netlab.start_registry(lab, tmp_path / "origin", host=host)
    region = netlab.start_region(lab, tmp_path / "region", registry, port=5082)
    data = random.Random(3).randbytes(24 * MiB)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    (tmp_path / "blob").write_bytes(data)
    netlab.push_blob(lab, registry, "ranges/lost", tmp_path / "blob", digest)
    lab.cap(host, 20)  # 2.5 MB/s: the 8 MiB range below takes seconds
    url = f"{region.url}/v2/ranges/lost/blobs/{digest}"
    start = len(data) - 8 * MiB
    client = lab.popen(world.readers[0], [sys.executable, "-c", _GET_OUTCOME, url, str(start), str(len(data) - 1)],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_trusting(region))
    wait_for(lambda: region.status(lab)["region"]["range_reads"] >= 1, "the range read to start", 30)
    time.sleep(0.5)
    lab.kill(registry.proc)
    stdout, _ = client.communicate(timeout=120)
    outcome = json.loads(stdout)
    assert outcome["status"] in ("cut", 502) and outcome["len"] < 8 * MiB, outcome

    status = wait_for(lambda: (s := region.status(lab)["region"])["fills_running"] == 0 and s, "the fill to end", 60)
    assert status["range_reads"] == 1  # failed (or stopped with the failed fill), not retried
    assert status["fills_failed"] == 1 and status["fills_committed"] == 0
    out = lab.run(world.readers[0], [sys.executable, "-c", _GET_OUTCOME, url, str(start), str(len(data) - 1)],
                  timeout=120, env=_trusting(region))
    again = json.loads(out.stdout)
    assert again["status"] in (502, 503) and "192.0.2" in again["body"], again  # names the origin
    lab.kill(region.proc)
