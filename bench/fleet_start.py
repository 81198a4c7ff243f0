"""Fleet start: one new image started on N nodes at the same moment behind one region.

    .venv/bin/python bench/fleet_start.py [--quick] [--json] [--nodes 2,4,6] [--rate 1000]
                                          [--registry-rate 1000] [--small-from N] [--keep-work]
                                          [--scenarios abcd] [--passthrough on|off|both] [--page-in on|off|both]
                                          [--repeat K]

The lab (tests/lab/netlab.py): every node is a network namespace of its own with its own
containerd and, for shoal, its own `shoal node` (swarm on), its link capped both ways with
`tc tbf` at --rate Mbit/s; the origin registry (Debian docker-registry) is a namespace of
its own behind a link capped at --registry-rate Mbit/s (the registry's uplink is what melts
in a fleet start); `shoal region` (cache, tracker, torrent metadata) sits in the hub
(uncapped: a region cache is the fleet's big pipe). Cold nodes and a cold region for every
run; the image is pushed once before.

Scenarios, per N:
- a: containerd on every node: `ctr image pull --plain-http` (fetch + unpack) + `ctr run`;
- b: shoal, cold region, no access profile (`[fetch] prefetch_profiles = false`):
  `shoal pull` + `ctr run --snapshotter shoal`; the first (b) run's node 1 then publishes
  what it read as the image's access profile (`shoal profile save --push`, not timed);
- c: shoal with that profile (default nodes, which prefetch it at the pull);
- d: the scheduler's hook first: `shoal prefetch REF --region URL --nodes ... --wait` (the
  region's preheat API; the nodes, registered with the region, warm themselves with the
  profile's chunks), then every node starts at once; and node 1 once more on its own, the
  image all local (local_start_s, the baseline of d's target; its page cache still holds the
  image's files), then once more after `echo 3 > /proc/sys/vm/drop_caches` (local_cold_start_s:
  the image on the node's disk, as a node has an image some time after it last ran it). preheat_s,
  preheat_origin_bytes and preheat_target_bytes (per node) are the hook's.

--passthrough both runs each shoal scenario twice, with the nodes' FUSE passthrough
(`[fetch] passthrough`, docs/snapshotter.md) and then without: the same run's A/B (`off,on`:
the other order; the first shoal run of a sitting tends to be the slow one). --page-in the
same for `[fetch] page_in` (a preheat's page-in of the profile's files: what (d) measures);
with both knobs given, every pair of their values.

--repeat K runs the whole sequence K times over (every N's scenarios, then again), so
that each repeat's (b), (c) and (d) have a baseline from minutes before them; runs carry
"repeat" (0..K-1). The report gives each run's ratios to its own repeat's (a) and then, per
target, the median over the repeats with their range: on this machine one run's p99 moves
by up to 20% with nothing changed, which a single run cannot tell from a change (and in
the first hour after a boot and the torch image's build, 2026-12-07, every role took about
twice the CPU: (b)'s ratio at N=2 was 0.38x there against 0.24-0.32x in the four repeats
after it; run a sitting's first comparison after the machine has settled).

Every node starts at the same moment (one barrier); time to first useful work is from
there to the command's output on that node. Per run:
- p50_s, p99_s: nearest-rank percentiles over the nodes;
- origin_bytes: response bytes the registry logged from the start until the region's fills
  and the nodes' layer proofs were done (everything the start cost the origin);
  origin_wire_bytes: what the registry's link sent out over the same window (its device's
  tx counter, headers included): an answer the region cut counts in origin_bytes with what
  sat in the registry's socket buffer and never crossed the link;
- read_bytes: the blob bytes one node read (scenario a: the image's layers; shoal: the
  node's bytes from peers, region and origin once its layers are proven, which reads each
  layer's whole blob after the start: the largest over the nodes, one copy);
  start_read_bytes: the same when the last node's command answered (what the starts read);
  region_origin: the region's own count of what it read from the origin (origin_bytes: its
  fills; origin_range_bytes: its range reads; fill_reused_bytes: range read bytes its fills
  took instead of reading them again);
  node_start_figures: per node, its seconds and its `shoal status` fetch figures (bytes by
  source, the swarm's counters) when the last node's command answered;
- origin_bytes_ratio = origin_bytes / read_bytes; origin_image_ratio = origin_bytes / the
  image's compressed size; region_bytes_ratio: bytes the nodes took from the region /
  read_bytes; peer_bytes: bytes the nodes took from each other.
- cpu_busy: the machine's CPU use over the run (1.0 = both cores busy): where it reaches
  about 1, the CPU and not the network sets the times: then p99_s is close to
  sum(cpu_s) / cores / cpu_busy (every role's CPU second is start time, since all the
  nodes share this machine's cores), and a ratio between scenarios is a ratio of CPU.
- cpu_s: CPU seconds over the start window by role, from cgroup v1 cpuacct groups of the
  benchmark's own (common.CpuGroups): registry, region, shoal (each node's `shoal node`),
  shoal_fs (each node's layer file system: its server and its FUSE session's holder),
  containerd (with its shims), work (the containers), clients (`shoal pull`, `ctr`), other
  (the rest of the machine: the kernel's network, anything else running). For (d),
  local_cpu_s is the same for the local start: N such starts on this machine's cores need
  at least N x its CPU seconds / cores, whatever the network. The report sets that floor
  against (a)'s p99 of the same N and repeat: what a 0.2x target for (c) then leaves, in CPU
  seconds, for everything the nodes do to fetch and serve the start's bytes.
- machine_speed: before and after the runs, one core's seconds for a fixed Python loop,
  sha256's MB/s, page faults and copies (bench/common.py machine_speed): machines of one
  kind here differ by several times and drift within a run, so only ratios within one run
  compare.
- pull_s: per node, seconds from the release to the end of its pull (`ctr image pull`,
  `shoal pull`); the rest of its time is `ctr run` (the container's start and its work).
- --py-spy DIR records py-spy profiles (raw collapsed stacks, samples of the thread holding
  the GIL: Python's own CPU, not threads waiting for a core or in native code; with
  SHOAL_BENCH_SPY_ALL=1 in the environment, every thread's) of the region and every node's
  processes over each shoal start window; --perf adds `perf record -g`.

Then a model (labelled so) fitted on the measured runs of each scenario (p99 = x + y*N for
a, whose origin uplink carries N copies; p99 = x + y*log2(N) for shoal, one copy and a
swarm whose depth grows with log N) gives 1,000 and 10,000 nodes.

--quick: the small image (Debian python3.11, tests/rootfs.py), N = 2 and 3, about two
minutes; its nodes prove their lazy layers 5 s after the Prepare (`[fetch] prove_after`,
30 s by default), as each run's origin bytes are counted until the proofs are done, and
its starts are over in 3 s. Needs root (namespaces, containerd, FUSE).

Targets (issue 12): (b) p99 <= 0.3x (a)'s p99 and origin bytes <= 1.05x the bytes the nodes
read at every N; (c) p99 <= 0.2x (a)'s p99. (Issue 13) (d): the start's p99 <= 1.2x of a
single node's start with the image local; the preheat's origin bytes <= 1.05x its target.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import common
import lazy_start
from lazy_start import BenchFailure, Image, Procs

from tests import services
from tests.lab import netlab

TARGET_B, TARGET_C, TARGET_ORIGIN, TARGET_D = 0.3, 0.2, 1.05, 1.2
NAMESPACE = lazy_start.NAMESPACE
REPO_NAME = lazy_start.REPO_NAME
KNOBS = {"passthrough": True, "page_in": True}  # the nodes' [fetch] settings a run may A/B, and their defaults
QUICK_PROVE_AFTER = 5.0  # --quick: seconds from a lazy layer's Prepare to its proof (the default is 30)
ONOFF = {"on": (True,), "off": (False,), "both": (True, False), "off,on": (False, True)}  # --passthrough, --page-in


@dataclass
class HostNs:
    """A lab host as lazy_start's helpers take a namespace: `.prefix` runs a command in it."""

    host: netlab.Host

    @property
    def prefix(self) -> list[str]:
        return netlab._netns(self.host)


@dataclass
class NodeRun:
    seconds: float | None = None
    pull_s: float | None = None  # from the release to the pull's end (the rest is `ctr run`)
    error: str = ""
    figures: dict = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


def registry_bytes(registry: netlab.LabRegistry) -> int:
    return sum(int(e.get("http.response.written", 0)) for e in netlab.registry_log(registry.log_path)
               if e.get("http.request.method") == "GET")


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as fh:
        parts = [int(x) for x in fh.readline().split()[1:]]
    idle = parts[3] + parts[4]
    return sum(parts) - idle, sum(parts)


def start_at_once(jobs: list, work) -> list[NodeRun]:
    """Run work(job) for every job on a thread of its own, all released by one barrier;
    each NodeRun's seconds from the release to its end, and its pull_s from the release
    to the time.perf_counter() work returns (when its pull ended)."""
    barrier = threading.Barrier(len(jobs) + 1)
    out = [NodeRun() for _ in jobs]

    def one(i: int) -> None:
        barrier.wait()
        t0 = time.perf_counter()
        try:
            pulled = work(jobs[i])
            out[i].seconds = time.perf_counter() - t0
            out[i].pull_s = pulled - t0
        except BenchFailure as e:
            out[i].error = str(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(jobs))]
    for t in threads:
        t.start()
    barrier.wait()
    for t in threads:
        t.join()
    return out


def node_figures(node: netlab.LabNode, run: NodeRun, sources: bool = False) -> dict:
    """The node's `shoal status` fetch figures (and, with `sources`, its fetch chain's
    figures per source: the swarm's piece counts and peer waits; and its layer file
    system's FUSE requests per opcode: count and the server's seconds)."""
    try:
        status = node.status()
        if sources:
            return {**status["fetch"], "sources": (status.get("data_path") or {}).get("sources"),
                    "fs_ops": (status.get("fs_server") or {}).get("ops")}
        return status["fetch"]
    except (RuntimeError, ValueError, KeyError) as e:
        run.error = run.error or f"status: {e}"
        return {}


def node_read(figures: dict) -> int:
    """Compressed blob bytes a node took from the network (peers, region, origin)."""
    return sum(figures.get(k, 0) for k in ("bytes_from_peers", "bytes_from_region", "bytes_from_origin"))


def wait_settled(lab: netlab.Lab, region: netlab.LabRegion, nodes: list[netlab.LabNode],
                 timeout: float = 600) -> None:
    """Until the region runs no fill and every node has proven its lazy layers (each
    node's proof reads the layer's whole blob through its chain, after the start): then
    the origin's part of this start is over and each node has read the whole image."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if not region.status(lab)["region"].get("fills_running") and all(
                    ly.get("proof") in ("proven", "bad") for node in nodes for ly in node.status()["lazy_layers"]):
                return
        except (RuntimeError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    common.say("fills or proofs still running after the wait")


REGION_SPLIT = ("origin_bytes", "origin_range_bytes", "fill_reused_bytes", "range_reads", "range_joins",
                "range_probes", "fills", "coalesced")


def region_split(lab: netlab.Lab, region: netlab.LabRegion) -> dict:
    """What the region read from the origin, by kind (its own count, beside the registry's
    log): its fills' bytes, its range reads' bytes, and the range read bytes its fills took
    instead of reading them again (what keeps the origin at one copy); with the counts of
    its range reads (and those joined), access-check probes, fills and coalesced misses."""
    try:
        status = region.status(lab)["region"]
    except (RuntimeError, ValueError, KeyError) as e:
        common.say(f"the region's status: {e}")
        return {}
    return {k: status.get(k, 0) for k in REGION_SPLIT}


class Fleet:
    """The lab for a whole benchmark: hosts for the largest N, the registry host, the
    pushed image; runs one (N, scenario) at a time on cold nodes and a cold region."""

    def __init__(self, lab: netlab.Lab, work: Path, procs: Procs, image: Image, storage: Path, nodes: int,
                 rate: float, registry_rate: float) -> None:
        self.lab, self.work, self.procs, self.image = lab, work, procs, image
        self.reg_host = lab.add_node(rate_mbit=registry_rate)
        self.hosts = [lab.add_node(rate_mbit=rate) for _ in range(nodes)]
        self.registry = netlab.start_registry(lab, work / "registry", host=self.reg_host, storage=storage)
        self.gz_ref = f"{self.registry.host}/{REPO_NAME}:gzip"
        self.ref = f"{self.registry.host}/{REPO_NAME}:shoal"
        self.runs = 0
        self.profile_published = False
        self.cpu = common.CpuGroups()
        self.spy_dir: Path | None = None
        self.perf = False
        self.knobs = dict(KNOBS)  # the nodes' [fetch] settings under A/B (--passthrough, --page-in)
        self.prove_after: float | None = None  # the nodes' [fetch] prove_after, if not the default
        self.cpu.add("registry", [self.registry.proc.pid])

    def clients(self, argv: list) -> list:
        """A command the benchmark runs on a node (shoal pull, ctr), counted as "clients"."""
        return [*self.cpu.prefix("clients"), *argv]

    def window(self):
        """(machine ticks, CpuGroups usage) now: one end of a timed window."""
        return cpu_ticks(), self.cpu.usage()

    def cpu_seconds(self, w0, w1) -> dict:
        return common.cpu_table(w0[1], w1[1], (w1[0][0] - w0[0][0]) / os.sysconf("SC_CLK_TCK"))

    def _dir(self, label: str) -> Path:
        self.runs += 1
        d = self.work / f"r{self.runs}"
        d.mkdir()
        common.say(f"--- {label}")
        lazy_start.settle()
        return d

    def containerd(self, n: int) -> dict:
        d = self._dir(f"N={n} (a) containerd pull + run on every node")
        servers = [lazy_start.start_containerd_in(HostNs(h), d / f"c{i}", self.procs) for i, h in
                   enumerate(self.hosts[:n])]
        self.cpu.add("containerd", [s.pid for s in servers])
        try:
            def work(i: int) -> float:
                ns, server = HostNs(self.hosts[i]), servers[i]
                lazy_start.run_cmd(self.clients(lazy_start.ctr(ns, server, "image", "pull", "--plain-http",
                                                               self.gz_ref)), lazy_start.PULL_TIMEOUT, "ctr image pull")
                pulled = time.perf_counter()
                out = lazy_start.run_cmd(self.clients(lazy_start.ctr_run(
                    ns, server, self.gz_ref, f"fleet{i}", self.image.cmd,
                    cgroup=self.cpu.path("work", f"r{self.runs}-{i}"))), lazy_start.RUN_TIMEOUT, "ctr run")
                lazy_start.check_output(out, self.image.expected, "ctr run (overlayfs)")
                return pulled

            before, wire, w0 = registry_bytes(self.registry), self.lab.tx_bytes(self.reg_host), self.window()
            results = start_at_once(list(range(n)), work)
            w1 = self.window()
            cpu0, cpu1 = w0[0], w1[0]
            origin, wire = registry_bytes(self.registry) - before, self.lab.tx_bytes(self.reg_host) - wire
        finally:
            for server in servers:
                self.procs.stop_containerd(server)
        out = self._summary(n, "a", results, origin, self.image.gzip_bytes, self.image.gzip_bytes, 0, 0, cpu0, cpu1)
        out["origin_wire_bytes"] = wire
        out["cpu_s"] = self.cpu_seconds(w0, w1)
        return out

    def shoal(self, n: int, profiled: bool, preheat: bool = False) -> dict:
        scenario = "d" if preheat else "c" if profiled else "b"
        d = self._dir(f"N={n} ({scenario}) shoal pull + run, cold region, "
                      + ("after `shoal prefetch --region --wait` of the job's nodes" if preheat else
                         "the image's access profile" if profiled else "no profile"))
        region = netlab.start_region(self.lab, d, self.registry, port=5080 + self.runs)
        servers: list[services.ContainerdServer] = []
        nodes: list[netlab.LabNode] = []
        try:
            fetch = dict(self.knobs) if profiled else {"prefetch_profiles": False, **self.knobs}
            if self.prove_after is not None:
                fetch["prove_after"] = self.prove_after
            nodes = netlab.start_nodes(self.lab, self.hosts[:n], d, region, self.registry, fetch=fetch,
                                       tables=lambda nd: {"containerd": {"address": str(nd / "c" / "containerd.sock")}})
            servers = [lazy_start.start_containerd_in(HostNs(node.host), node.dir / "c", self.procs,
                                                      proxy_socket=node.socket) for node in nodes]
            self.cpu.add("region", [region.proc.pid])
            self.cpu.add("shoal", [node.proc.pid for node in nodes])
            self.cpu.add("shoal_fs", [pid for node in nodes for pid in netlab.fs_pids(node.root)])
            self.cpu.add("containerd", [s.pid for s in servers])

            def work(i: int, cid: str = "fleet") -> float:
                ns, server = HostNs(nodes[i].host), servers[i]
                lazy_start.run_cmd(self.clients([*ns.prefix, common.SHOAL, "pull", self.ref, "--address",
                                                 server.address, "--namespace", NAMESPACE, "--plain-http"]),
                                   lazy_start.PULL_TIMEOUT, "shoal pull")
                pulled = time.perf_counter()
                out = lazy_start.run_cmd(self.clients(lazy_start.ctr_run(
                    ns, server, self.ref, f"{cid}{i}", self.image.cmd, snapshotter="shoal",
                    cgroup=self.cpu.path("work", f"r{self.runs}-{cid}{i}"))), lazy_start.RUN_TIMEOUT,
                    "ctr run --snapshotter shoal")
                lazy_start.check_output(out, self.image.expected, "ctr run --snapshotter shoal")
                return pulled

            warm: dict = {}
            if preheat:
                warm = self._preheat(d, region, nodes)
            spies = self.spy(f"r{self.runs}-{scenario}", region, nodes)
            before, wire, w0 = registry_bytes(self.registry), self.lab.tx_bytes(self.reg_host), self.window()
            results = start_at_once(list(range(n)), work)
            w1 = self.window()
            self.unspy(spies)
            cpu0, cpu1 = w0[0], w1[0]
            at_start = [node_figures(node, r, sources=True) for node, r in zip(nodes, results, strict=True)]
            start_read = max((node_read(figs) for figs in at_start), default=0)
            if self.spy_dir is not None:  # the whole `shoal status` of each node, beside the profiles
                for i, node in enumerate(nodes):
                    with contextlib.suppress(RuntimeError, ValueError):
                        (self.spy_dir / f"r{self.runs}-{scenario}-node{i}-status.json").write_text(
                            json.dumps(node.status(), indent=1))
            wait_settled(self.lab, region, nodes)
            origin, wire = registry_bytes(self.registry) - before, self.lab.tx_bytes(self.reg_host) - wire
            region_origin = region_split(self.lab, region)
            for node, r in zip(nodes, results, strict=True):
                r.figures = node_figures(node, r)
            read = max((node_read(r.figures) for r in results), default=0)
            from_region = sum(r.figures.get("bytes_from_region", 0) for r in results)
            peers = sum(r.figures.get("bytes_from_peers", 0) for r in results)
            if not profiled and not self.profile_published and not any(r.error for r in results):
                saved = lazy_start.run_cmd([*HostNs(nodes[0].host).prefix, common.SHOAL, "profile", "save",
                                            self.ref, "--root", nodes[0].root, "--push", "--plain-http"], 120,
                                           "shoal profile save")
                self.profile_published = True
                common.say(f"published the access profile: {saved.stdout.strip().splitlines()[:1]}")
            for i, r in enumerate(results):
                if r.error:
                    r.error += "\n" + nodes[i].log(1500)
            if preheat and not any(r.error for r in results):  # the baseline: node 1 again, all of it local
                t0, l0 = time.perf_counter(), self.window()
                work(0, "again")
                warm["local_start_s"] = round(time.perf_counter() - t0, 3)
                warm["local_cpu_s"] = self.cpu_seconds(l0, self.window())
                # and with the page cache dropped: the image on the node's disk, not in its memory
                # (what a node that has the image has, some time after it last ran it)
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
                t0, l0 = time.perf_counter(), self.window()
                work(0, "cold")
                warm["local_cold_start_s"] = round(time.perf_counter() - t0, 3)
                warm["local_cold_cpu_s"] = self.cpu_seconds(l0, self.window())
        finally:
            for server in servers:
                self.procs.stop_containerd(server)
            netlab.stop_nodes(self.lab, nodes)
            for node in nodes:
                node.unmount()
            self.lab.kill(region.proc, signal.SIGTERM)
        out = self._summary(n, scenario, results, origin, read, self.image.shoal_bytes, from_region, peers,
                            cpu0, cpu1)
        out["start_read_bytes"] = start_read
        out["origin_wire_bytes"] = wire
        out["region_origin"] = region_origin
        out["node_start_figures"] = [{"seconds": r.seconds, **figs} for r, figs in zip(results, at_start, strict=True)]
        out["cpu_s"] = self.cpu_seconds(w0, w1)
        if preheat:
            out.update(warm)
            if warm.get("local_start_s") and out["p99_s"]:
                out["p99_vs_local"] = round(out["p99_s"] / warm["local_start_s"], 3)
            if warm.get("local_cold_start_s") and out["p99_s"]:
                out["p99_vs_local_cold"] = round(out["p99_s"] / warm["local_cold_start_s"], 3)
        return out

    def spy(self, label: str, region: netlab.LabRegion, nodes: list[netlab.LabNode]) -> list[subprocess.Popen]:
        """With --py-spy DIR: `py-spy record` (raw, collapsed stacks) of the region and of every
        node's processes (shoal node, its layer file system) over the start window."""
        if self.spy_dir is None:
            return []
        targets = [("region", region.proc.pid)] + [
            (f"node{i}", pid) for i, node in enumerate(nodes)
            for pid in [node.proc.pid, *sorted(netlab.fs_pids(node.root))]]
        out = []
        if self.perf:  # perf record of the same processes, for the native side (zstd, hashes, kernel)
            out.append(subprocess.Popen(["perf", "record", "-g", "-F", "999", "-o", str(self.spy_dir / f"{label}.perf"),
                                         "-p", ",".join(str(pid) for _, pid in targets)],
                                        stdout=subprocess.DEVNULL,
                                        stderr=open(self.spy_dir / f"{label}.perf.log", "wb")))  # noqa: SIM115
        for name, pid in targets:
            path = self.spy_dir / f"{label}-{name}-{pid}.txt"
            gil = [] if os.environ.get("SHOAL_BENCH_SPY_ALL") else ["--gil"]
            out.append(subprocess.Popen([str(common.VENV_BIN / "py-spy"), "record", "-p", str(pid), "-r", "200", *gil,
                                         "--nonblocking", "-f", "raw", "-o", str(path)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # py-spy attaches
        return out

    @staticmethod
    def unspy(spies: list[subprocess.Popen]) -> None:
        for proc in spies:
            proc.send_signal(signal.SIGINT)
        for proc in spies:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _preheat(self, d: Path, region: netlab.LabRegion, nodes: list[netlab.LabNode]) -> dict:
        """`shoal prefetch REF --region URL --nodes ... --wait --json` (the scheduler's hook,
        in the hub): its seconds, the origin bytes it cost and its target bytes."""
        before = registry_bytes(self.registry)
        t0 = time.perf_counter()
        argv = [common.SHOAL, "prefetch", self.ref, "--region", region.url, "--ca", region.ca, "--token-file",
                d / "region" / "tls" / "prefetch-token", "--nodes", ",".join(nd.host.ns for nd in nodes),
                "--wait", "--timeout", "600", "--json", "--plain-http"]
        proc = self.lab.run(self.lab.hub, argv, timeout=700, env=netlab._env())
        seconds = time.perf_counter() - t0
        if proc.returncode != 0:
            raise BenchFailure(f"shoal prefetch --region: exit {proc.returncode}: {proc.stderr.strip()[-800:]}")
        job = json.loads(proc.stdout)
        target = sum(nd.get("target_bytes") or 0 for nd in job.get("nodes", [])) // max(1, len(nodes))
        logged = registry_bytes(self.registry) - before
        # the job's own figure: what the region read from the origin from the job's creation to
        # its end (ready). The registry's log, read when the hook returned, also holds the
        # whole-blob fills the job's end starts (for the proofs after the start) if they are done
        # by then (a small image's are; a large one's are not yet logged): not the preheat's cost.
        origin = int(job.get("origin_bytes") or 0)
        common.say(f"preheat: {job.get('state')} in {seconds:.1f} s, origin {origin / 1e6:,.1f} MB for a target of "
                   f"{target / 1e6:,.1f} MB per node (registry log at the hook's return {logged / 1e6:,.1f} MB); "
                   f"region served {int(job.get('region_bytes') or 0) / 1e6:,.1f} MB")
        return {"preheat_s": round(seconds, 3), "preheat_origin_bytes": origin, "preheat_target_bytes": target,
                "preheat_origin_ratio": round(origin / target, 3) if target else None, "preheat_state": job.get("state"),
                "preheat_logged_origin_bytes": logged, "preheat_region_bytes": int(job.get("region_bytes") or 0)}

    def _summary(self, n: int, scenario: str, results: list[NodeRun], origin: int, read: int, image_bytes: int,
                 from_region: int, peers: int, cpu0: tuple[int, int], cpu1: tuple[int, int]) -> dict:
        times = [r.seconds for r in results if r.seconds is not None]
        errors = [r.error for r in results if r.error]
        out = {
            "nodes": n, "scenario": scenario,
            "p50_s": round(percentile(times, 50), 3) if times else None,
            "p99_s": round(percentile(times, 99), 3) if times else None,
            "times_s": [round(t, 3) for t in times],
            "pull_s": [round(r.pull_s, 3) for r in results if r.pull_s is not None],
            "origin_bytes": origin, "read_bytes": read, "image_bytes": image_bytes,
            "origin_bytes_ratio": round(origin / read, 3) if read else None,
            "origin_image_ratio": round(origin / image_bytes, 3) if image_bytes else None,
            "region_bytes_ratio": round(from_region / read, 3) if read else None,
            "region_bytes": from_region, "peer_bytes": peers,
            "cpu_busy": round((cpu1[0] - cpu0[0]) / max(1, cpu1[1] - cpu0[1]), 3),
            "image": self.image.what,
        }
        if errors:
            out["errors"] = [e[:3000] for e in errors]
        pulls = out["pull_s"]
        common.say(f"N={n} ({scenario}): p50 {out['p50_s']} s, p99 {out['p99_s']} s"
                   + (f" (pull done at {min(pulls)}-{max(pulls)} s)" if pulls else "") + f", origin {origin / 1e6:,.1f} MB "
                   f"({out['origin_bytes_ratio']}x of one read, {out['origin_image_ratio']}x of the image), "
                   f"region {from_region / 1e6:,.1f} MB, peers {peers / 1e6:,.1f} MB, CPU {out['cpu_busy']:.0%}"
                   + (f"; {len(errors)} node(s) FAILED: {errors[0][:300]}" if errors else ""))
        return out


def fit(points: list[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares y = x0 + x1 * t over (t, y); None with fewer than two distinct t."""
    if len({t for t, _ in points}) < 2:
        return None
    n = len(points)
    mt, my = sum(t for t, _ in points) / n, sum(y for _, y in points) / n
    slope = sum((t - mt) * (y - my) for t, y in points) / sum((t - mt) ** 2 for t, _ in points)
    return my - slope * mt, slope


def model(runs: list[dict]) -> list[dict]:
    """The fitted model at 1,000 and 10,000 nodes, per image and scenario, on the runs of
    that image (at least two N): scenario a linear in N (the origin uplink carries N
    copies), shoal linear in log2 N (one origin copy, spread by the swarm). Origin bytes:
    a, N copies of the image; shoal, the measured copies (at most one)."""
    out = []
    for image in sorted({r["image"] for r in runs}):
        for scenario, shape in (("a", "N"), ("b", "log2 N"), ("c", "log2 N"), ("d", "log2 N")):
            mine = [r for r in runs if r["image"] == image and r["scenario"] == scenario and r["p99_s"] is not None]
            coef = fit([(r["nodes"] if shape == "N" else math.log2(r["nodes"]), r["p99_s"]) for r in mine])
            if coef is None:
                continue
            per_node = [r["origin_image_ratio"] / r["nodes"] for r in mine if r["origin_image_ratio"] is not None]
            copies = max((r["origin_image_ratio"] for r in mine if r["origin_image_ratio"] is not None), default=None)
            for n in (1000, 10000):
                t = n if shape == "N" else math.log2(n)
                out.append({
                    "model": True, "image": image, "scenario": scenario, "nodes": n,
                    "shape": f"p99 = {coef[0]:.2f} + {coef[1]:.3f} * {shape}", "p99_s": round(coef[0] + coef[1] * t, 1),
                    "fitted_on": sorted(r["nodes"] for r in mine),
                    "origin_image_ratio": (round(n * sum(per_node) / len(per_node), 1) if scenario == "a" and per_node
                                           else copies),
                })
    return out


def measure(nodes: list[int], quick: bool, rate: float, registry_rate: float, small_from: int | None,
            keep: bool, scenarios: str = "abcd", spy_dir: Path | None = None, perf: bool = False,
            variants: Sequence[dict] = ({},), repeat: int = 1) -> dict:
    lazy_start.preflight()
    reason = netlab.lab_missing(fuse=True)
    if reason:
        sys.exit(f"bench: {reason}")
    work = Path(tempfile.mkdtemp(prefix="sf-", dir="/tmp"))  # short: unix socket paths live in it
    procs = Procs(work)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    runs: list[dict] = []
    images = []
    speed = [common.machine_speed()]
    common.say(f"machine: {common.speed_line(speed[0])}")
    try:
        groups: list[tuple[Image, list[int]]] = []
        big = [n for n in nodes if quick is False and (small_from is None or n < small_from)]
        small = [n for n in nodes if n not in big]
        if big:
            groups.append((lazy_start.torch_image(), big))
        if small:
            groups.append((lazy_start.quick_image(work), small))
        for image, ns in groups:
            image.gzip_bytes = lazy_start.layout_bytes(image.gzip_layout, image.tag)
            image.shoal_bytes = lazy_start.layout_bytes(image.shoal_layout, image.tag)
            common.say(f"image: {image.what}; gzip {image.gzip_bytes / 1e6:,.1f} MB, shoal "
                       f"{image.shoal_bytes / 1e6:,.1f} MB; N = {ns}")
            images.append({"image": image.what, "gzip_bytes": image.gzip_bytes, "shoal_bytes": image.shoal_bytes,
                           "nodes": ns})
            idir = work / f"i{len(images)}"
            idir.mkdir()
            storage = lazy_start.push_images(image, idir)
            with netlab.Lab() as lab:
                fleet: Fleet | None = None
                try:
                    fleet = Fleet(lab, idir, procs, image, storage, max(ns), rate, registry_rate)
                    fleet.spy_dir = spy_dir
                    fleet.perf = perf
                    if quick:
                        fleet.prove_after = QUICK_PROVE_AFTER
                    if spy_dir is not None:
                        spy_dir.mkdir(parents=True, exist_ok=True)
                    for rep, n in ((rep, n) for rep in range(repeat) for n in ns):
                        tag = {"repeat": rep} if repeat > 1 else {}
                        if "a" in scenarios:
                            runs.append({**fleet.containerd(n), **tag})
                        for knobs in variants:
                            fleet.knobs = {**KNOBS, **knobs}
                            shoal_runs = []
                            if "b" in scenarios or not fleet.profile_published:
                                shoal_runs.append(fleet.shoal(n, profiled=False))
                            if "c" in scenarios:
                                shoal_runs.append(fleet.shoal(n, profiled=True))
                            if "d" in scenarios:
                                shoal_runs.append(fleet.shoal(n, profiled=True, preheat=True))
                            runs += [{**r, **fleet.knobs, **tag} for r in shoal_runs]
                finally:
                    if fleet is not None:  # the registry is the lab's (not a leftover of procs)
                        lab.kill(fleet.registry.proc, signal.SIGTERM)
                    procs.stop_all()
                    if fleet is not None:
                        fleet.cpu.close()
        speed.append(common.machine_speed())
        return {"quick": quick, "rate_mbit": rate, "registry_rate_mbit": registry_rate, "cores": common.cores(),
                "machine_speed": speed, "images": images, "runs": runs, "model": model(runs)}
    finally:
        signal.signal(signal.SIGTERM, old)
        lazy_start.finish(work, procs, keep)


def _baseline(by: dict, r: dict) -> dict | None:
    """The (a) run of `r`'s N and repeat."""
    return by.get((r["nodes"], "a", r.get("repeat", 0)))


def _targets(r: dict, a: dict | None) -> list[tuple[str, str, float, float]]:
    """(target, what its ratio is of, the ratio, the target's bound) for one run."""
    out = []
    if r["scenario"] == "d":
        if r.get("p99_vs_local") is not None:
            out.append(("p99 vs local", f"of one node's local start ({r['local_start_s']} s, page cache warm)",
                        r["p99_vs_local"], TARGET_D))
        if r.get("p99_vs_local_cold") is not None:
            cold = f"of one node's local start ({r['local_cold_start_s']} s, page cache dropped)"
            out.append(("p99 vs local cold", cold, r["p99_vs_local_cold"], TARGET_D))
        if r.get("preheat_origin_ratio") is not None:
            out.append(("preheat origin", f"of its target (preheat {r['preheat_s']} s)", r["preheat_origin_ratio"],
                        TARGET_ORIGIN))
    elif r["scenario"] != "a" and a and a["p99_s"] and r["p99_s"]:
        out.append(("p99", "of (a)", r["p99_s"] / a["p99_s"], TARGET_B if r["scenario"] == "b" else TARGET_C))
        if r["origin_bytes_ratio"] is not None:
            out.append(("origin", "of one read", r["origin_bytes_ratio"], TARGET_ORIGIN))
    return out


def _scenario(r: dict) -> str:
    """The run's scenario letter, with the knobs an A/B turned off."""
    return r["scenario"] + "".join(f" {k} off" for k in KNOBS if r.get(k) is False)


def report(f: dict) -> str:
    by = {(r["nodes"], r["scenario"], r.get("repeat", 0)): r for r in f["runs"]}
    repeats = 1 + max((r.get("repeat", 0) for r in f["runs"]), default=0)
    rows = []
    for r in f["runs"]:
        a = _baseline(by, r)
        vs = f"{r['p99_s'] / a['p99_s']:.3f}x" if a and a["p99_s"] and r["p99_s"] else "-"
        rows.append([r["nodes"], _scenario(r), *([r.get("repeat", 0)] if repeats > 1 else []), r["p50_s"], r["p99_s"],
                     max(r["pull_s"]) if r.get("pull_s") else "",
                     vs, r["origin_bytes_ratio"], r["origin_image_ratio"],
                     f"{r['origin_wire_bytes'] / r['read_bytes']:.3f}" if r.get("origin_wire_bytes") and r["read_bytes"]
                     else "-", r["region_bytes_ratio"],
                     f"{r['peer_bytes'] / 1e6:,.1f}", f"{r['read_bytes'] / 1e6:,.1f}", f"{r['cpu_busy']:.0%}",
                     "FAILED" if r.get("errors") else ""])
    lines = [(f"fleet start: node links {f['rate_mbit']:g} Mbit/s, registry uplink {f['registry_rate_mbit']:g} Mbit/s, "
             f"{f['cores']} cores"),
             *[f"machine {when}: {common.speed_line(m)}" for when, m in zip(("before", "after"), f.get("machine_speed", []))],
             *[f"image: {i['image']} (gzip {i['gzip_bytes'] / 1e6:,.1f} MB, shoal {i['shoal_bytes'] / 1e6:,.1f} MB), "
               f"N = {i['nodes']}" for i in f["images"]],
             ("a: containerd pull + run; b: shoal, cold region, no profile; c: shoal with the access profile; "
             "d: c after the preheat API warmed the nodes"), "",
             common.table(["N", "scen", *(["rep"] if repeats > 1 else []), "p50 s", "p99 s", "pulled s", "p99/(a)", "origin/read",
                           "origin/image", "wire/read", "region/read", "peer MB", "read MB", "CPU", ""], rows), ""]
    groups: dict[tuple, list[float]] = {}
    for r in f["runs"]:
        for key, against, ratio, want in _targets(r, _baseline(by, r)):
            rep = f" repeat {r['repeat']}" if repeats > 1 else ""
            lines.append(f"target N={r['nodes']} ({_scenario(r)}){rep}: {key} {ratio:.3f}x {against} "
                         f"(want <= {want})  {'PASS' if ratio <= want else 'MISS'}")
            groups.setdefault((r["nodes"], _scenario(r), key, want), []).append(ratio)
    if repeats > 1:
        lines += ["", f"targets, the median over {repeats} repeats (each against its own repeat's baseline):"]
        for (n, scen, key, want), ratios in groups.items():
            mid = statistics.median(ratios)
            lines.append(f"target N={n} ({scen}): {key} median {mid:.3f}x (range {min(ratios):.3f}-{max(ratios):.3f}, "
                         f"{len(ratios)} runs; want <= {want})  {'PASS' if mid <= want else 'MISS'}")
    lines += ["", "CPU seconds over each start window, by role (cgroup cpuacct; other = the rest of the machine):"]
    for r in f["runs"]:
        cpu = r.get("cpu_s") or {}
        if cpu:
            total = sum(cpu.values())
            rep = f" repeat {r['repeat']}" if repeats > 1 else ""
            lines.append(f"N={r['nodes']} ({_scenario(r)}){rep}: {total:.1f} s in all, {total / r['nodes']:.1f} s per node: "
                         + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items()))
        local = r.get("local_cpu_s")
        if local and r.get("p99_s"):
            one = sum(local.values())
            floor = r["nodes"] * one / f["cores"]
            rep = f" repeat {r['repeat']}" if repeats > 1 else ""
            lines.append(f"N={r['nodes']} (d){rep}: one local start costs {one:.1f} CPU s ("
                         + ", ".join(f"{k} {v:.1f}" for k, v in local.items())
                         + f"); N of them on {f['cores']} cores need at least {floor:.1f} s: "
                         f"{floor / r['local_start_s']:.2f}x of the local start (d's p99: {r['p99_vs_local']}x)")
            a = _baseline(by, r)
            if a and a["p99_s"]:
                # what a start that fetches anything has left under the (c) target on this machine
                left = (TARGET_C * a["p99_s"] - floor) * f["cores"]
                lines.append(f"N={r['nodes']}{rep}: that floor is {floor / a['p99_s']:.3f}x of (a)'s p99 "
                             f"({a['p99_s']} s): (c) at {TARGET_C}x leaves {left:.1f} CPU s for every node's "
                             f"fetching, decompressing and serving of the start's bytes together")
    if f["model"]:
        lines += ["", "MODEL (not measured): fitted on the runs above",
                  common.table(["image", "scen", "N", "p99 s", "origin/image", "fit", "fitted on N"],
                               [[m["image"].split(" (")[0][:40], m["scenario"], m["nodes"], m["p99_s"],
                                 m["origin_image_ratio"], m["shape"], m["fitted_on"]] for m in f["model"]])]
    return "\n".join(lines)


def main() -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--nodes", help="comma-separated N (default 2,4,6; --quick 2,3)")
    p.add_argument("--rate", type=float, default=1000.0, help="each node's link, Mbit/s each way (default 1000)")
    p.add_argument("--registry-rate", type=float, default=1000.0, help="the registry's uplink, Mbit/s (default 1000)")
    p.add_argument("--small-from", type=int, default=None,
                   help="use the small image for N at or above this (the torch image does not fit more nodes)")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--py-spy", type=Path, default=None, metavar="DIR",
                   help="record py-spy profiles (raw collapsed stacks) of the region and the nodes' processes "
                        "over every shoal start window into DIR")
    p.add_argument("--perf", action="store_true",
                   help="with --py-spy DIR: also `perf record -g` the same processes into DIR/LABEL.perf")
    p.add_argument("--passthrough", choices=ONOFF, default="on",
                   help="the shoal nodes' [fetch] passthrough; both: every shoal scenario once with it, then once "
                        "without (off,on: the other order; runs carry \"passthrough\")")
    p.add_argument("--page-in", choices=ONOFF, default="on",
                   help="the shoal nodes' [fetch] page_in (a preheat puts the profile's file bytes into the page "
                        "cache), as --passthrough (runs carry \"page_in\")")
    p.add_argument("--scenarios", default="abcd",
                   help="which of a, b, c, d to run (default abcd; c and d need the profile b publishes, so b "
                        "runs once anyway)")
    p.add_argument("--repeat", type=int, default=1, metavar="K",
                   help="run every N's scenarios K times over, interleaved; the report adds each target's median "
                        "over the K runs (default 1)")
    args = p.parse_args()
    if not 1 <= args.repeat <= 10:
        p.error("--repeat: between 1 and 10")
    if not args.scenarios or set(args.scenarios) - set("abcd"):
        p.error("--scenarios: letters among a, b, c, d")
    try:
        nodes = sorted({int(x) for x in (args.nodes or ("2,3" if args.quick else "2,4,6")).split(",")})
    except ValueError:
        p.error("--nodes: comma-separated whole numbers")
    if not nodes or nodes[0] < 1 or nodes[-1] > 100:
        p.error("--nodes: between 1 and 100 nodes")
    try:
        figures = measure(nodes, args.quick, args.rate, args.registry_rate, args.small_from, args.keep_work,
                          args.scenarios, args.py_spy, args.perf,
                          [{"passthrough": pt, "page_in": pi} for pt in ONOFF[args.passthrough]
                           for pi in ONOFF[args.page_in]], args.repeat)
    except KeyboardInterrupt:
        common.say("interrupted; everything started was stopped")
        return 130
    except BenchFailure as e:
        sys.exit(f"bench: {e}")
    if args.json:
        common.emit_json({"runs": figures["runs"], **{k: v for k, v in figures.items() if k != "runs"}})
    else:
        print(report(figures))
    return 1 if any(r.get("errors") for r in figures["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
