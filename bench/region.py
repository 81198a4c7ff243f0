"""The region cache serving one large blob in ranges to many clients at once, against the
origin registry serving them directly (what every node does without a region cache).

Set-up, all on this machine: Debian's docker-registry as the origin, one blob of 1 GiB
(--quick: 100 MiB) of random bytes pushed to it, `shoal region` (disk backend, the
default configuration) in front of it. Each of 16 client processes reads the whole blob
in 1 MiB Range requests (each starting at its own offset, as nodes starting the same job
read in different orders), all released at the same moment:

1. origin: the clients read from the registry directly;
2. region, cold: the clients read through the region cache with an empty store (every
   request arrives while the blob is not cached: a client miss);
3. region, warm: again, with the blob in the region's store.

Figures: aggregate throughput (client bytes / wall time) of each, their ratios to the
origin's, and origin requests: the number of blob GETs the origin saw per 100 client
misses (without a region: 100): the fill's one GET and the range reads that clients
ahead of the fill caused (docs/cache.md), with the origin bytes per blob byte.

4. tail, the lazy start's first read (a node reads a layer's TOC at its end): one client
   asks for the last MiB of the blob, from the origin directly, then through a cold
   region (a fresh `shoal region`, empty store, no access remembered, that has served
   one other blob the same way first, so that the figure is a cold blob's and not a
   fresh process's), --samples times each. Figures: the median answer time of each
   and their ratio (target: at most 1.5), where the region's fill was when the answer
   came, and the origin bytes per blob byte once the fill is done (the fill's whole
   copy plus the range reads). On loopback the origin is as close as the region and
   both are CPU-bound; with --origin-mbit N (root) the same runs in a network lab
   (tests/lab/netlab.py): the registry in a namespace behind a `tc tbf` link of N Mbit/s, the
   region in the hub, the client in a namespace of its own, as a node reaches both.
   --fill-window SIZE sets the region's fill_window ("1T": no range reads, the old
   behaviour of making every range wait for the fill).

    .venv/bin/python bench/region.py [--quick] [--json] [--clients N] [--size-mb N] [--range-kb N]
                                     [--scenario all|throughput|tail] [--samples N]
                                     [--origin-mbit N] [--fill-window SIZE]
"""

from __future__ import annotations

import hashlib
import http.client
import json
import multiprocessing
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, emit_json, parser, say, table
from builder.oci.refs import DockerRef
from builder.oci.registry import RegistryDestination
from tests.services import free_port, start_registry, stop_process

REPOSITORY = "bench/big-layer"


# --- clients (separate processes) ----------------------------------------------------


def _client(args) -> tuple[int, int, float]:
    """Read the blob in ranges from host:port, starting at range `first`; checks a few
    ranges against the source file. Returns (bytes, requests, seconds)."""
    index, host, port, digest, size, range_size, blob_path, barrier = args
    conn = http.client.HTTPConnection(host, port, timeout=300)
    path = f"/v2/{REPOSITORY}/blobs/{digest}"
    n = (size + range_size - 1) // range_size
    order = [(index * n // 16 + i) % n for i in range(n)]
    check = set(random.Random(index).sample(range(n), min(4, n)))
    buf = bytearray(range_size)
    got = 0
    barrier.wait()
    start = time.perf_counter()
    with open(blob_path, "rb") as source:
        for k in order:
            a = k * range_size
            b = min(size, a + range_size)
            conn.request("GET", path, headers={"Range": f"bytes={a}-{b - 1}"})
            resp = conn.getresponse()
            if resp.status != 206:
                raise RuntimeError(f"client {index}: HTTP {resp.status} for bytes {a}-{b - 1}: {resp.read(300)!r}")
            view = memoryview(buf)[: b - a]
            pos = 0
            while pos < b - a:
                r = resp.readinto(view[pos:])
                if not r:
                    raise RuntimeError(f"client {index}: short body at {a + pos}")
                pos += r
            resp.read()
            if k in check and bytes(view) != os.pread(source.fileno(), b - a, a):
                raise RuntimeError(f"client {index}: wrong bytes for range {a}-{b - 1}")
            got += b - a
    conn.close()
    return got, n, time.perf_counter() - start


def run_clients(host: str, port: int, digest: str, size: int, range_size: int, blob_path: str,
                clients: int) -> dict:
    ctx = multiprocessing.get_context("fork")
    with ctx.Manager() as manager:
        barrier = manager.Barrier(clients + 1)
        with ctx.Pool(clients) as pool:
            jobs = [(i, host, port, digest, size, range_size, blob_path, barrier) for i in range(clients)]
            result = pool.map_async(_client, jobs)
            barrier.wait()
            start = time.perf_counter()
            results = result.get(timeout=3600)
            wall = time.perf_counter() - start
    total = sum(r[0] for r in results)
    return {"seconds": wall, "bytes": total, "requests": sum(r[1] for r in results),
            "throughput_mb_s": total / wall / 1e6}


# --- services ------------------------------------------------------------------------


def make_blob(path: Path, size: int, seed: int = 1234) -> str:
    rnd = random.Random(seed)
    h = hashlib.sha256()
    with open(path, "wb") as fh:
        left = size
        while left:
            block = rnd.randbytes(min(left, 64 << 20))
            fh.write(block)
            h.update(block)
            left -= len(block)
    return "sha256:" + h.hexdigest()


def _region_config(work: Path, fill_window: str | None) -> list[str]:
    if not fill_window:
        return []
    (work / "region.toml").write_text(f"fill_window = {json.dumps(fill_window)}\n")
    return ["--config", str(work / "region.toml")]


def start_region(work: Path, origin_url: str, store: str = "region-store",
                 fill_window: str | None = None) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    log_path = work / "region.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "region", "--listen", f"127.0.0.1:{port}",
             "--origin", origin_url, "--store", str(work / store), *_region_config(work, fill_window),
             "--plain-http"],  # loopback; the figures compare serving, not TLS (docs/cache.md)
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, cwd=REPO,
        )
    line = proc.stdout.readline().decode()
    if "serving" not in line:
        stop_process(proc)
        sys.exit(f"bench: shoal region did not start: {line}{log_path.read_text()[-2000:]}")
    return proc, port, log_path


def _connection(host: str, port: int, timeout: float, ca: str = "") -> http.client.HTTPConnection:
    """HTTP, or HTTPS trusting `ca` alone (a lab region's own CA)."""
    if not ca:
        return http.client.HTTPConnection(host, port, timeout=timeout)
    import ssl

    return http.client.HTTPSConnection(host, port, timeout=timeout, context=ssl.create_default_context(cafile=ca))


def region_status(port: int, host: str = "127.0.0.1", ca: str = "") -> dict:
    conn = _connection(host, port, 30, ca)
    conn.request("GET", "/-/status")
    data = json.loads(conn.getresponse().read())
    conn.close()
    return data


def wait_idle(port: int, timeout: float = 600) -> dict:
    deadline = time.monotonic() + timeout
    while (status := region_status(port))["fills_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return status


def stop_region(region: subprocess.Popen) -> None:
    region.send_signal(signal.SIGTERM)
    try:
        region.wait(timeout=30)
    except subprocess.TimeoutExpired:
        stop_process(region)
    region.stdout.close()


def read_range(host: str, port: int, digest: str, start: int, end: int, ca: str = "",
               first: tuple[str, int, int] | None = None) -> tuple[float, bytes]:
    """(seconds, body) of one GET of bytes [start, end) on a new connection (with its TLS
    handshake when `ca` is given), as a node's first request makes it; with `first`
    (digest, start, end), on a connection kept alive after that read (not timed), as a
    node's later requests are made."""
    t0 = time.perf_counter()
    conn = _connection(host, port, 300, ca)
    if first is not None:
        conn.request("GET", f"/v2/{REPOSITORY}/blobs/{first[0]}", headers={"Range": f"bytes={first[1]}-{first[2] - 1}"})
        warm = conn.getresponse()
        if warm.status != 206 or len(warm.read()) != first[2] - first[1]:
            raise RuntimeError(f"HTTP {warm.status} for the first read on the connection")
        t0 = time.perf_counter()
    conn.request("GET", f"/v2/{REPOSITORY}/blobs/{digest}", headers={"Range": f"bytes={start}-{end - 1}"})
    resp = conn.getresponse()
    body = resp.read()
    seconds = time.perf_counter() - t0
    conn.close()
    if resp.status != 206 or len(body) != end - start:
        raise RuntimeError(f"HTTP {resp.status}, {len(body)} bytes for bytes {start}-{end - 1}")
    return seconds, body


def run_tail(work: Path, registry, digest: str, size: int, blob_path: Path, samples: int,
             fill_window: str | None = None) -> dict:
    """Scenario 4 (module doc): the last MiB, from the origin and through a cold region."""
    start, end = max(0, size - (1 << 20)), size
    warm_size = 16 << 20
    warm_digest = make_blob(work / "warm-blob", warm_size, seed=99)
    dest = RegistryDestination(DockerRef(registry.host, REPOSITORY, tag="x"), plain_http=True)
    dest.put_blob(str(work / "warm-blob"), warm_digest, warm_size)
    dest.close()
    with open(blob_path, "rb") as fh:
        want = os.pread(fh.fileno(), end - start, start)
    host, port = registry.host.split(":")
    origin_times, region_times, fill_at_answer = [], [], []
    origin_ratio = None
    for i in range(samples):
        seconds, body = read_range(host, int(port), digest, start, end)
        assert body == want, "the origin answered wrong bytes"
        origin_times.append(seconds)
        region, rport, _ = start_region(work, registry.url, f"tail-store-{i}", fill_window)
        try:
            read_range("127.0.0.1", rport, warm_digest, warm_size - (1 << 20), warm_size)
            before = wait_idle(rport)
            seconds, body = read_range("127.0.0.1", rport, digest, start, end)
            status = region_status(rport)
            if body != want:
                raise RuntimeError("the region answered wrong bytes")
            region_times.append(seconds)
            fill = status.get("filling", {}).get(digest)
            fill_at_answer.append(fill["written"] if fill else size)
            if i == samples - 1:
                status = wait_idle(rport)
                origin_ratio = sum(status[k] - before[k] for k in ("origin_bytes", "origin_range_bytes")) / size
        finally:
            stop_region(region)
            shutil.rmtree(work / f"tail-store-{i}", ignore_errors=True)
    return _tail_figures(start, end, samples, origin_times, region_times, fill_at_answer, origin_ratio)


_LAB_READ = ("import hashlib, json, sys\n"
             "from bench.region import read_range, region_status\n"
             "h, p, d, a, b, st, ca, first = sys.argv[1:]\n"
             "f = first.split(',')\n"
             "s, body = read_range(h, int(p), d, int(a), int(b), ca, (f[0], int(f[1]), int(f[2])) if first else None)\n"
             "status = region_status(int(p), h, ca) if st == 'status' else None\n"
             "print(json.dumps({'seconds': s, 'sha': hashlib.sha256(body).hexdigest(), 'status': status}))\n")


def run_tail_lab(work: Path, digest: str, size: int, blob_path: Path, samples: int, mbit: float,
                 fill_window: str | None = None, origin_tls: bool = False) -> dict:
    """Scenario 4 in a network lab: the origin behind a link capped at `mbit` (HTTPS with
    `origin_tls`, as registries are served)."""
    from tests.lab import netlab

    start, end = max(0, size - (1 << 20)), size
    with open(blob_path, "rb") as fh:
        want = hashlib.sha256(os.pread(fh.fileno(), end - start, start)).hexdigest()
    warm_size = 16 << 20
    warm_digest = make_blob(work / "warm-blob", warm_size, seed=99)
    origin_times, region_times, fill_at_answer = [], [], []
    kept_origin, kept_region = [], []
    origin_ratio = None
    with netlab.Lab() as lab:
        origin_host, client = lab.add_node(), lab.add_node()
        registry = netlab.start_registry(lab, work / "lab-origin", host=origin_host)
        netlab.push_blob(lab, registry, REPOSITORY, blob_path, digest)
        netlab.push_blob(lab, registry, REPOSITORY, work / "warm-blob", warm_digest)
        if origin_tls:  # the same storage served over HTTPS (the blobs pushed in plain HTTP first)
            lab.kill(registry.proc, signal.SIGTERM)
            registry = netlab.start_registry(lab, work / "lab-origin-tls", host=origin_host,
                                             storage=work / "lab-origin" / "registry", tls=True)
        lab.cap(origin_host, mbit)

        def read(host: str, port: int, blob: str, a: int, b: int, then_status: bool = False, ca: str = "",
                 first: str = "") -> dict:
            out = lab.run(client, [sys.executable, "-c", _LAB_READ, host, str(port), blob, str(a), str(b),
                                   "status" if then_status else "-", ca, first],
                          timeout=600, cwd=REPO, env=netlab._env())
            if out.returncode != 0:
                raise RuntimeError(f"lab read: {out.stderr[-1000:]}")
            return json.loads(out.stdout)

        def status(region) -> dict:
            return json.loads(netlab.http_get(lab, lab.hub, region.url + "/-/status", ca=region.ca)[0])

        def idle(region) -> dict:
            deadline = time.monotonic() + 600
            while (st := status(region))["fills_running"] and time.monotonic() < deadline:
                time.sleep(0.2)
            return st

        ohost, oport = registry.host.split(":")
        warm_first = f"{warm_digest},{warm_size - (1 << 20)},{warm_size}"

        def cold_region(i: int, kept: bool) -> dict:
            """The tail through a fresh region that served the warm blob's tail first: on
            a new connection, or (`kept`) on a connection that read the warm blob (stored
            by then) first."""
            config = f"fill_window = {json.dumps(fill_window)}\n" if fill_window else ""
            name = f"lab-region-{i}{'-kept' if kept else ''}"
            region = netlab.start_region(lab, work / name, registry, port=5080 + 2 * i + kept, config=config)
            rhost, rport = region.url.split("://", 1)[1].split(":")
            try:  # (HTTPS, the region's default: the origin is plain HTTP, so the region pays a handshake more)
                read(rhost, int(rport), warm_digest, warm_size - (1 << 20), warm_size, ca=region.ca)
                before = idle(region)  # (kept: the connection's first read is that blob's, a hit)
                got = read(rhost, int(rport), digest, start, end, then_status=True, ca=region.ca,
                           first=warm_first if kept else "")
                if got["sha"] != want:
                    raise RuntimeError("the region answered wrong bytes")
                if kept:
                    return got
                st = got["status"]
                fill = st.get("filling", {}).get(digest)
                got["fill_at_answer"] = fill["written"] if fill else size
                if i == samples - 1:
                    st = idle(region)
                    got["origin_ratio"] = sum(st[k] - before[k] for k in ("origin_bytes", "origin_range_bytes")) / size
                return got
            finally:
                lab.kill(region.proc, signal.SIGTERM)
                shutil.rmtree(work / name, ignore_errors=True)

        for i in range(samples):
            for first, times in (("", origin_times), (warm_first, kept_origin)):
                got = read(ohost, int(oport), digest, start, end, first=first, ca=registry.ca)
                if got["sha"] != want:
                    raise RuntimeError("the origin answered wrong bytes")
                times.append(got["seconds"])
            got = cold_region(i, False)
            region_times.append(got["seconds"])
            fill_at_answer.append(got["fill_at_answer"])
            origin_ratio = got.get("origin_ratio", origin_ratio)
            kept_region.append(cold_region(i, True)["seconds"])
    figures = _tail_figures(start, end, samples, origin_times, region_times, fill_at_answer, origin_ratio)
    origin_kept_s, region_kept_s = statistics.median(kept_origin), statistics.median(kept_region)
    figures.update(origin_mbit=mbit, origin_tls=origin_tls, origin_kept_s=round(origin_kept_s, 4), region_cold_kept_s=round(region_kept_s, 4),
                   kept_ratio=round(region_kept_s / origin_kept_s, 2),
                   origin_kept_times_s=[round(t, 4) for t in kept_origin],
                   region_kept_times_s=[round(t, 4) for t in kept_region])
    return figures


def _tail_figures(start: int, end: int, samples: int, origin_times: list[float], region_times: list[float],
                  fill_at_answer: list[int], origin_ratio: float | None) -> dict:
    origin_s, region_s = statistics.median(origin_times), statistics.median(region_times)
    return {
        "range_bytes": end - start, "samples": samples,
        "origin_s": round(origin_s, 4), "region_cold_s": round(region_s, 4),
        "ratio": round(region_s / origin_s, 2),
        "origin_times_s": [round(t, 4) for t in origin_times], "region_times_s": [round(t, 4) for t in region_times],
        "fill_bytes_at_answer": fill_at_answer,
        "origin_bytes_per_blob_byte": round(origin_ratio, 4) if origin_ratio is not None else None,
    }


def main() -> int:
    p = parser(__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=16, help="concurrent client processes (default 16)")
    p.add_argument("--size-mb", type=int, help="blob size in MiB (default 1024, --quick 100)")
    p.add_argument("--range-kb", type=int, default=1024, help="bytes per Range request in KiB (default 1024)")
    p.add_argument("--scenario", choices=("all", "throughput", "tail"), default="all",
                   help="throughput (1-3), tail (4) or all (default)")
    p.add_argument("--samples", type=int, default=3, help="cold regions measured in the tail scenario (default 3)")
    p.add_argument("--origin-mbit", type=float, help="tail scenario in a network lab, the origin's link capped (root)")
    p.add_argument("--origin-tls", action="store_true", help="with --origin-mbit: the origin serves HTTPS, as "
                   "registries do (else plain HTTP, while the region serves HTTPS)")
    p.add_argument("--fill-window", help='the region\'s fill_window (e.g. "1T": every range waits for the fill)')
    args = p.parse_args()
    size = (args.size_mb or (100 if args.quick else 1024)) << 20
    range_size = args.range_kb << 10
    clients = args.clients

    work = Path(tempfile.mkdtemp(prefix="shoal-bench-region-"))
    registry = region = None
    try:
        say(f"making a {size >> 20} MiB blob")
        blob_path = work / "blob"
        digest = make_blob(blob_path, size)
        (work / "registry").mkdir()
        registry = start_registry(work / "registry", None)
        dest = RegistryDestination(DockerRef(registry.host, REPOSITORY, tag="x"), plain_http=True)
        dest.put_blob(str(blob_path), digest, size)
        dest.close()
        host, port = registry.host.split(":")
        tail = None
        if args.scenario in ("all", "tail"):
            say(f"tail: the last MiB of the {size >> 20} MiB blob, from the origin and through a cold region "
                f"({args.samples} samples)")
            if args.origin_mbit:
                tail = run_tail_lab(work, digest, size, blob_path, max(1, args.samples), args.origin_mbit,
                                    args.fill_window, args.origin_tls)
            else:
                tail = run_tail(work, registry, digest, size, blob_path, max(1, args.samples), args.fill_window)
        if args.scenario == "tail":
            return report_tail(tail, size, args.json)

        say(f"origin: {clients} clients x {size >> 20} MiB in {range_size >> 10} KiB ranges")
        before = registry.count("GET", f"/blobs/{digest}")[0]
        origin = run_clients(host, int(port), digest, size, range_size, str(blob_path), clients)
        origin["origin_gets"] = registry.count("GET", f"/blobs/{digest}")[0] - before

        region, rport, _ = start_region(work, registry.url)
        say("region, cold (empty store)")
        before_gets = registry.count("GET", f"/blobs/{digest}")[0]
        before_all = len(registry.requests())
        cold = run_clients("127.0.0.1", rport, digest, size, range_size, str(blob_path), clients)
        status = wait_idle(rport)
        time.sleep(0.5)  # the registry logs a request when it completes
        cold["origin_gets"] = registry.count("GET", f"/blobs/{digest}")[0] - before_gets
        cold["origin_requests_all"] = len(registry.requests()) - before_all
        cold["client_misses"] = status["misses"]
        cold["client_hits"] = status["hits"]
        cold["coalesced"] = status["coalesced"]

        say("region, warm (blob in the store)")
        before_gets = registry.count("GET", f"/blobs/{digest}")[0]
        warm = run_clients("127.0.0.1", rport, digest, size, range_size, str(blob_path), clients)
        warm["origin_gets"] = registry.count("GET", f"/blobs/{digest}")[0] - before_gets
        final = region_status(rport)
    finally:
        if region is not None:
            stop_region(region)
        if registry is not None:
            registry.stop()
        shutil.rmtree(work, ignore_errors=True)

    misses = max(1, cold["client_misses"])
    figures = {
        "blob_bytes": size, "clients": clients, "range_bytes": range_size, "cpus": os.cpu_count(),
        "origin_throughput_mb_s": round(origin["throughput_mb_s"], 1),
        "region_cold_throughput_mb_s": round(cold["throughput_mb_s"], 1),
        "region_warm_throughput_mb_s": round(warm["throughput_mb_s"], 1),
        "throughput_ratio_vs_origin": round(warm["throughput_mb_s"] / origin["throughput_mb_s"], 3),
        "cold_throughput_ratio_vs_origin": round(cold["throughput_mb_s"] / origin["throughput_mb_s"], 3),
        "origin_requests_per_100_misses": round(100 * cold["origin_gets"] / misses, 3),
        "origin_requests_per_100_misses_without_region": 100.0,
        "origin_blob_gets": {"origin": origin["origin_gets"], "region_cold": cold["origin_gets"],
                             "region_warm": warm["origin_gets"]},
        "origin_requests_all_cold": cold["origin_requests_all"],
        "client_requests_per_phase": cold["requests"],
        "cold_client_misses": cold["client_misses"], "cold_client_hits": cold["client_hits"],
        "cold_coalesced": cold["coalesced"],
        "origin_bytes_cold": final["origin_bytes"],
        "origin_range_bytes_cold": final["origin_range_bytes"],
        "cold_origin_bytes_per_blob_byte": round((final["origin_bytes"] + final["origin_range_bytes"]) / size, 3),
        "tail": tail,
    }
    if args.json:
        emit_json(figures)
        return 0
    rows = [
        ["origin registry, direct", f"{origin['seconds']:.2f}", f"{origin['throughput_mb_s']:,.0f}", "1.00",
         origin["origin_gets"]],
        ["region cache, cold", f"{cold['seconds']:.2f}", f"{cold['throughput_mb_s']:,.0f}",
         f"{figures['cold_throughput_ratio_vs_origin']:.2f}", cold["origin_gets"]],
        ["region cache, warm", f"{warm['seconds']:.2f}", f"{warm['throughput_mb_s']:,.0f}",
         f"{figures['throughput_ratio_vs_origin']:.2f}", warm["origin_gets"]],
    ]
    print(f"{clients} clients reading a {size >> 20} MiB blob in {range_size >> 10} KiB ranges "
          f"({cold['requests']} requests per run, {os.cpu_count()} CPUs)")
    print(table(["served by", "seconds", "MB/s", "vs origin", "origin blob GETs"], rows))
    print(f"origin requests per 100 client misses: {figures['origin_requests_per_100_misses']} with the region "
          f"({cold['client_misses']} misses, {cold['coalesced']} joined a running fill), 100 without; "
          f"origin bytes per blob byte (the fill's copy and range reads ahead of it): "
          f"{figures['cold_origin_bytes_per_blob_byte']}")
    if tail is not None:
        print()
        report_tail(tail, size, False)
    return 0


def report_tail(tail: dict, size: int, as_json: bool) -> int:
    if as_json:
        emit_json({"blob_bytes": size, "cpus": os.cpu_count(), "tail": tail})
        return 0
    link = f"the origin behind a {tail['origin_mbit']:g} Mbit/s link" if tail.get("origin_mbit") else "loopback"
    link += ", the origin on HTTPS" if tail.get("origin_tls") else ""
    print(f"the last MiB of a cold {size >> 20} MiB blob ({link}; median of {tail['samples']}, new connection each)")
    print(table(["served by", "seconds"], [["origin registry, direct", f"{tail['origin_s']:.4f}"],
                                          ["region cache, cold", f"{tail['region_cold_s']:.4f}"]]))
    at = ", ".join(f"{n >> 20} MiB" for n in tail["fill_bytes_at_answer"])
    print(f"region / origin: {tail['ratio']:.2f}x (target at most 1.5x); the region's fill had "
          f"written {at} when each answer came; origin bytes per blob byte: {tail['origin_bytes_per_blob_byte']}")
    if "kept_ratio" in tail:
        print(f"on a connection kept alive (as a node's requests after its first): origin {tail['origin_kept_s']:.4f} s, "
              f"region {tail['region_cold_kept_s']:.4f} s: {tail['kept_ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
