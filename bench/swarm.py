"""Swarm distribution: one blob to N nodes at once, through the swarm and, as the
baseline, with every node reading it from the region directly.

    .venv/bin/python bench/swarm.py [--quick] [--json] [--nodes 2,4,8,16] [--size 1G] [--rate 200]

Each node is a tests.lab.agent process (the node's fetch chain: swarm, region, origin) in its
own network namespace; its link is capped with `tc tbf` at --rate Mbit/s each way. The
origin registry and the region (with tracker and metadata service) share a hub namespace
(tests/lab/netlab.py). The blob is published first (pushed to the origin; the region fills it
once and makes its torrent), so a run measures distribution only. Per N:

- p50_s / p99_s: time from the start until a node has the whole blob, verified against
  its digest (nearest-rank percentiles over the nodes); ideal_s = size / per-node rate;
- origin_bytes_ratio: bytes the region and the origin served during the run / size;
- baseline_p99_s, baseline_origin_bytes_ratio: the same when every node reads the blob
  from the region (4 parallel 4 MiB range requests, as a node's chain would);
- rss_mb: peak resident memory of a node process.

Then a flow-level model (simulate(), documented there) calibrated on the largest measured
run extrapolates to 1,000 and 10,000 nodes. Needs root (namespaces); --quick: a 128 MiB
blob to N = 2, 4, in about a minute.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common

from tests.lab import netlab

REPO = "bench/swarm"


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.lower().rstrip("ib")
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def make_blob(path: Path, size: int) -> str:
    """A random blob (reused across runs from the bench cache); returns its digest."""
    rng = random.Random(size)
    if not path.exists() or path.stat().st_size != size:
        with open(path.with_suffix(".tmp"), "wb") as fh:
            left = size
            while left:
                n = min(left, 16 << 20)
                fh.write(rng.randbytes(n))
                left -= n
        os.replace(path.with_suffix(".tmp"), path)
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while data := fh.read(16 << 20):
            h.update(data)
    return "sha256:" + h.hexdigest()


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _run_nodes(lab, hosts, workdir: Path, region, blob: dict, op: dict,
               swarm_enabled: bool) -> tuple[list[float], float, float]:
    """Start one agent per host, run `op` on all at once; (seconds per node, max RSS MB,
    mean CPU seconds per node)."""
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=workdir))
    agents = netlab.start_agents(lab, hosts, run_dir, region, swarm_enabled=swarm_enabled)
    times: list[float] = [0.0] * len(agents)
    errors: list[str] = []
    try:
        barrier = threading.Barrier(len(agents))
        start = [0.0]

        def go(i: int) -> None:
            barrier.wait()
            if i == 0:
                start[0] = time.monotonic()
            try:
                answer = agents[i].call({**op, "blob": blob}, timeout=3600)
                if answer.get("sha256") and answer["sha256"] != blob["digest"][7:]:
                    errors.append(f"node {i}: wrong bytes")
            except RuntimeError as exc:
                errors.append(str(exc))
            times[i] = time.monotonic() - start[0]

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(agents))]
        cpu0 = [_cpu_s(a.proc.pid) for a in agents]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rss = max(_rss_mb(a.proc.pid) for a in agents)
        cpu = sum(_cpu_s(a.proc.pid) - c for a, c in zip(agents, cpu0)) / len(agents)
    finally:
        for agent in agents:
            agent.stop(lab)
        if not os.environ.get("SHOAL_BENCH_KEEP"):
            shutil.rmtree(run_dir, ignore_errors=True)
    if errors:
        sys.exit(f"bench: {errors[0]}")
    return times, rss, cpu


def measure(nodes: list[int], size: int, rate: float, aggregate: float, baseline: bool) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-swarm-"))
    runs = []
    try:
        blob_path = common.cache_dir() / f"swarm-blob-{size}"
        common.say(f"blob of {size / 2**20:.0f} MiB")
        digest = make_blob(blob_path, size)
        with netlab.Lab() as lab:
            registry = netlab.start_registry(lab, work)
            region = netlab.start_region(lab, work, registry)
            hosts = [lab.add_node() for _ in range(max(nodes))]
            common.say("publishing (origin push, region fill, torrent)")
            netlab.publish_blob(lab, registry, region, REPO, blob_path, digest, timeout=600)
            blob = {"registry": registry.host, "repository": REPO, "digest": digest, "size": size, "plain_http": True}
            for n in nodes:
                node_rate = min(rate, aggregate / n)  # keep the machine's CPU out of the measurement
                ideal = size / (node_rate * 1e6 / 8)
                for host in hosts[:n]:
                    lab.cap(host, node_rate)
                served0 = region.status(lab)["region"]["bytes_served"] + registry.bytes_written(digest)[1]
                common.say(f"N={n}: swarm")
                times, rss, cpu = _run_nodes(lab, hosts[:n], work, region, blob,
                                             {"op": "download", "timeout": 3000}, swarm_enabled=True)
                served1 = region.status(lab)["region"]["bytes_served"] + registry.bytes_written(digest)[1]
                run = {"nodes": n, "p50_s": round(percentile(times, 50), 2), "p99_s": round(percentile(times, 99), 2),
                       "ideal_s": round(ideal, 2), "origin_bytes_ratio": round((served1 - served0) / size, 3),
                       "rate_mbit": round(node_rate, 1), "rss_mb": round(rss, 1),
                       "cpu_s_per_gib": round(cpu / (size / 2**30), 2)}
                if baseline:
                    common.say(f"N={n}: baseline (every node from the region)")
                    times, _, _ = _run_nodes(lab, hosts[:n], work, region, blob,
                                          {"op": "fetch_direct", "source": "region", "chunk": 4 << 20, "threads": 4},
                                          swarm_enabled=False)
                    served2 = region.status(lab)["region"]["bytes_served"] + registry.bytes_written(digest)[1]
                    run["baseline_p99_s"] = round(percentile(times, 99), 2)
                    run["baseline_origin_bytes_ratio"] = round((served2 - served1) / size, 3)
                runs.append(run)
                common.say(f"N={n}: {run}")
    finally:
        if os.environ.get("SHOAL_BENCH_KEEP"):
            common.say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return runs


# --- the flow-level model ------------------------------------------------------------------------


@dataclass
class Model:
    """A flow-level model of one blob spreading through a swarm (mean field).

    The blob is P pieces of `piece` bytes; c[p] is the number of nodes holding piece p
    (a real number: the model moves flows, not packets). Every node's link carries
    eff * rate bytes/s each way (eff: protocol overhead, choking, pipelining, fitted to
    the measured runs). Each step of dt seconds:

    1. Download capacity: D = N * eff * rate * dt, at most what is still missing
       (N*P - sum(c) pieces).
    2. Region: pieces nobody holds are fetched by their extent owner (p2p/bulk.py, p2p/extents.py),
       `dup` times each when owners disagree; the region sends at most region_rate*dt
       and that traffic uses part of D. A fetched piece gets c = 1.
    3. Peers: the rest of D, at most U = eff * rate * dt * (nodes holding anything,
       taken as min(N, sum(c))), moves between nodes, rarest piece first; piece p gains
       at most c[p] * eff * rate * dt / piece copies (its holders' upload: the doubling
       limit that makes spreading take log(N) piece times) and at most N - c[p].
    4. With pieces spread at random, the fraction of nodes holding all is prod(c/N);
       p50 and p99 are when it reaches 0.5 and 0.99.

    Region bytes = pieces fetched * dup * piece. No per-node identity: stragglers from
    slow or failing nodes are outside the model, so read it as a bound on what the
    protocol costs at scale, calibrated on the measured runs, not as a prediction.
    """

    nodes: int
    size: int
    rate: float  # bytes/s per node link
    piece: int = 256 << 10
    eff: float = 0.9
    region_rate: float = 10e9 / 8
    dup: float = 1.0

    def run(self, horizon: float = 7200.0) -> dict:
        P = max(1, -(-self.size // self.piece))
        n = self.nodes
        c = [0.0] * P
        t, fetched, region_credit = 0.0, 0.0, 0.0
        p50 = p99 = None
        dt = self.piece / (self.eff * self.rate)  # one piece time: a link moves one piece per step
        link = 1.0
        while t < horizon:
            t += dt
            total = sum(c)
            down = min(n * link, n * P - total)
            # region: pieces nobody holds, in order, while the region and the downlinks allow
            region_credit = min(region_credit + self.region_rate * dt / self.piece, down + self.dup)
            used = 0.0
            for p in range(P):
                if region_credit < self.dup or used + self.dup > down:
                    break
                if c[p] == 0:
                    c[p] = 1.0
                    region_credit -= self.dup
                    used += self.dup
                    fetched += self.dup
            # peers: the rest of the downlinks, within the holders' upload, rarest first
            total = sum(c)
            flow = min(min(n, total) * link, down - used)
            for p in sorted(range(P), key=c.__getitem__):
                if flow <= 0:
                    break
                if 0 < c[p] < n:
                    gain = min(c[p] * link, n - c[p], flow)
                    c[p] += gain
                    flow -= gain
            if min(c) > 0:
                done = math.exp(sum(math.log(x / n) for x in c))
                if p50 is None and done >= 0.5:
                    p50 = t
                if done >= 0.99:
                    p99 = t
                    break
        return {"nodes": n, "p50_s": round(p50 or horizon, 1), "p99_s": round(p99 or horizon, 1),
                "ideal_s": round(self.size / self.rate, 1),
                "origin_bytes_ratio": round(fetched * self.piece / self.size, 3)}


def simulate(measured: list[dict], size: int, rate_bytes: float) -> list[dict]:
    """Fit eff to the largest measured run, then extrapolate to 1,000 and 10,000 nodes.
    Blobs are scaled to 64 pieces per MiB-rate unit for speed: times scale with size."""
    eff = 0.9
    if measured:
        last = max(measured, key=lambda r: r["nodes"])
        best, best_err = eff, float("inf")
        for e in [x / 100 for x in range(50, 101, 2)]:
            m = Model(last["nodes"], size, last["rate_mbit"] * 1e6 / 8, eff=e, piece=max(256 << 10, size // 512)).run()
            err = abs(m["p99_s"] - last["p99_s"])
            if err < best_err:
                best, best_err = e, err
        eff = best
    out = []
    # dup 1: owners from the tracker's ranks; N/101: the tracker unreachable, so each node
    # decides from its own ~100 peers and every extent has about N/101 owners
    for n, dup, how in ((1000, 1.0, "ranks"), (10000, 1.0, "ranks"), (1000, 1000 / 101, "local views"),
                        (10000, 10000 / 101, "local views")):
        m = Model(n, size, rate_bytes, eff=eff, piece=max(256 << 10, size // 512), dup=dup).run()
        m.update(eff=eff, dup=round(dup, 1), owners=how)
        out.append(m)
    return out


def main() -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default=None, help="comma-separated N (default 2,4,8,16; quick 2,4)")
    p.add_argument("--size", default=None, help="blob size (default 1G; quick 128M)")
    p.add_argument("--rate", type=float, default=200.0, help="per-node link cap, Mbit/s (default 200)")
    p.add_argument("--aggregate", type=float, default=1600.0,
                   help="cap N * rate at this many Mbit/s (default 1600: what 2 cores move without the CPU "
                        "becoming the bottleneck; see docs/p2p.md)")
    p.add_argument("--no-baseline", action="store_true", help="skip the every-node-from-the-region runs")
    p.add_argument("--simulate-only", action="store_true", help="only the model (no namespaces, no root)")
    args = p.parse_args()
    nodes = [int(x) for x in (args.nodes or ("2,4" if args.quick else "2,4,8,16")).split(",")]
    size = _size(args.size or ("128M" if args.quick else "1G"))
    rate_bytes = args.rate * 1e6 / 8
    runs: list[dict] = []
    if not args.simulate_only:
        reason = netlab.available()
        if reason:
            sys.exit(f"bench: {reason} (or use --simulate-only)")
        runs = measure(nodes, size, args.rate, args.aggregate, not args.no_baseline)
    sim = simulate(runs, size, rate_bytes)
    figures = {"runs": runs, "simulated": sim, "blob_bytes": size, "rate_mbit": args.rate}
    if args.json:
        common.emit_json(figures)
        return 0
    if runs:
        print(f"swarm: {size / 2**20:.0f} MiB blob to N nodes at once (measured; link Mbit/s each way)")
        print(common.table(
            ["nodes", "link", "p50 s", "p99 s", "ideal s", "p99/ideal", "region+origin / size", "baseline p99 s",
             "baseline region / size", "node RSS MB", "node CPU s/GiB"],
            [[r["nodes"], r["rate_mbit"], r["p50_s"], r["p99_s"], r["ideal_s"], f"{r['p99_s'] / r['ideal_s']:.2f}",
              f"{r['origin_bytes_ratio']:.3f}", r.get("baseline_p99_s", "-"),
              r.get("baseline_origin_bytes_ratio", "-"), r["rss_mb"], r["cpu_s_per_gib"]] for r in runs]))
        print()
    print(f"flow-level model (bench/swarm.py Model) at {args.rate:g} Mbit/s, efficiency {sim[0]['eff']} fitted to "
          "the largest measured run; region 10 Gbit/s")
    print(common.table(
        ["nodes", "extent owners", "region copies/piece", "p50 s", "p99 s", "ideal s", "p99/ideal", "region / size"],
        [[m["nodes"], m["owners"], m["dup"], m["p50_s"], m["p99_s"], m["ideal_s"], f"{m['p99_s'] / m['ideal_s']:.2f}",
          f"{m['origin_bytes_ratio']:.3f}"] for m in sim]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
