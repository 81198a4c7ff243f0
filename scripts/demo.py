"""The main job on embedded defaults, end to end, with every real part on this machine:

1. the origin: Debian's docker-registry, and a real image built as a build leaves it (gzip);
2. `shoal convert` to zstd:chunked, pushed to the origin; `shoal inspect --verify`;
3. `shoal profile record REF --push`: the image runs once on an embedded node, and what its
   start read is published as its access profile (the CI step);
4. `shoal region`: the region cache in front of the origin (tracker, preheat API);
5. two nodes, node-a and node-b: each a `shoal node` (swarm on, `[fetch] region_url` the
   region) and a containerd with shoal as its proxy snapshotter;
6. `shoal prefetch REF --region URL --nodes node-a,node-b --wait`: the scheduler's hook;
7. on each node `shoal pull` + `ctr run --snapshotter shoal`: a lazy start through containerd;
8. where each node's bytes came from (its chunk store, its peers, the region, the origin),
   and what the origin served.

The registry and the region run in a *hub* network namespace, each node in one of its own
(tests/lab/netlab.py: 192.0.2.0/24, which exists only inside them). Commands shown as
`hub$ ...` or `node-a$ ...` run in that namespace's network (`nsenter --net=/run/netns/NS --`).
Everything is stopped by the PID it was started with, unmounted and removed at the end, also
on failure, Ctrl-C or SIGTERM. Needs root. Run with `make demo` (a few minutes).
"""

from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from snapshotter.embedded import shim_pids
from tests.lab import netlab
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer, delta_layer, python_layer
from tests.services import ContainerdServer, start_containerd, wait_for

SHOAL = netlab.SHOAL
NAMES = ("node-a", "node-b")
REPO = "demo/python"
CMD = ["/usr/bin/python3", "-c",
       "import json, email.parser, http.client; print('hello from a lazy image:', json.dumps({'answer': 42}))"]
EXPECTED = 'hello from a lazy image: {"answer": 42}'


def step(text: str) -> None:
    print(f"\n==> {text}", flush=True)


def shown(argv: list[str]) -> str:
    return " ".join(shlex.quote("shoal" if a == SHOAL else str(a)) for a in argv)


def sh(lab: netlab.Lab, host: netlab.Host, label: str, *argv: str, timeout: float = 600,
       quiet: bool = False) -> str:
    """Run `shoal ARGV` in the host's namespace, shown as `LABEL$ shoal ...`; its stdout
    (printed unless `quiet`); RuntimeError with its stderr when it fails."""
    print(f"{label}$ {shown([SHOAL, *argv])}", flush=True)
    proc = lab.run(host, [SHOAL, *argv], timeout=timeout, cwd=ROOT, env=netlab._env())
    if not quiet:
        print(proc.stdout, end="", flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"shoal {argv[0]}: exit status {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def blob_bytes(registry: netlab.LabRegistry) -> int:
    """Blob bytes the origin served so far (its own access log)."""
    return registry.bytes_written("/blobs/")[1]


def proven(node: netlab.LabNode, count: int) -> bool:
    """Whether the node has `count` lazy layers, every one proven (`shoal status`)."""
    layers = node.status()["lazy_layers"]
    return len(layers) == count and all(ly["proof"] == "proven" for ly in layers)


def figures(node: netlab.LabNode) -> dict[str, int]:
    """The node's fetch figures (`shoal status --json`: "fetch"), and its chunk reads
    answered from its memory and its chunk store ("data_path")."""
    status = node.status()
    f, data = status["fetch"], status.get("data_path") or {}
    out = {k: f[f"bytes_{k}"] for k in ("from_store", "from_peers", "from_region", "from_origin", "to_peers")}
    out["memory_hits"] = (data.get("memory") or {}).get("memory_hits", 0)
    out["store_hits"] = (data.get("store") or {}).get("hits", 0)
    return out


def build(work: Path) -> tuple[Path, int]:
    step("building a real image: busybox, Debian's python3.11 and its standard library (gzip, as a build leaves it)")
    layers = [busybox_layer(work / "l1"), python_layer(work / "l2"), delta_layer(work / "l3")]
    layout = work / "image"
    manifest = build_image([str(p) for p in layers], f"oci:{layout}:gzip", ImageConfig(cmd=CMD), workdir=str(work))
    size = sum(ly["size"] for ly in json.loads(manifest.data)["layers"])
    print(f"oci:{layout}:gzip: {len(layers)} layers, {size:,} bytes")
    return layout, size


def lazy_start(lab: netlab.Lab, name: str, node: netlab.LabNode, ctd: ContainerdServer, ref: str) -> str:
    sh(lab, node.host, name, "pull", ref, "--plain-http", "--address", ctd.address, "--namespace", "shoal-test")
    run = ["run", "--rm", "--snapshotter", "shoal", ref, f"demo-{name}"]
    print(f"{name}$ ctr --address {ctd.address} --namespace shoal-test {' '.join(run)}", flush=True)
    out = ctd.ctr(*run).stdout
    print(out, end="", flush=True)
    return out


def table(rows: list[tuple[str, dict[str, int]]]) -> None:
    cols = ("from_store", "from_peers", "from_region", "from_origin", "to_peers")
    print(f"{'':22}" + "".join(f"{c.replace('_', ' '):>15}" for c in cols))
    for label, f in rows:
        print(f"{label:22}" + "".join(f"{f[c]:>15,}" for c in cols))


class Demo:
    """What the demo started, so that cleanup can stop it and say so: the lab (its
    processes, mounts and namespaces: netlab.Lab.close) and the containerds."""

    def __init__(self, stack: contextlib.ExitStack) -> None:
        self.stack = stack
        self.lab: netlab.Lab | None = None
        self.servers: list[ContainerdServer] = []
        self.dirs: list[Path] = []  # the directories it made (removed at the end)

    def pids(self) -> list[int]:
        """Every process started so far (and a node's layer file system server and holder)."""
        if self.lab is None:
            return []
        out = [p.pid for p in self.lab.procs] + [pid for pid, _ in self.lab.adopted]
        out += [pid for root in self.lab.node_roots for pid in netlab.fs_pids(root)]
        out += [s.pid for s in self.servers] + [pid for s in self.servers for pid in shim_pids(s.address)]
        return sorted(set(out))


def demo(work: Path, d: Demo) -> None:
    step("a lab network: a hub namespace (origin, region) and a namespace per node, on 192.0.2.0/24")
    short = Path(tempfile.mkdtemp(prefix="shd-", dir="/tmp"))  # the nodes' (unix socket paths must be short)
    d.stack.callback(shutil.rmtree, short, ignore_errors=True)  # (after the lab's close: nothing mounted there)
    d.dirs.append(short)
    lab = d.lab = d.stack.enter_context(netlab.Lab())
    hosts = [lab.add_node() for _ in NAMES]
    print(f"hub: {lab.hub.ns} ({lab.hub.ip}); "
          + "; ".join(f"{n}: {h.ns} ({h.ip})" for n, h in zip(NAMES, hosts, strict=True)))
    print(f"a `NAME$ CMD` line runs CMD as `nsenter --net=/run/netns/NS -- CMD`; work directory {work}")

    step("the origin: Debian's docker-registry in the hub")
    registry = netlab.start_registry(lab, work / "origin")
    print(f"hub$ docker-registry serve {work / 'origin' / 'registry.yml'}    # at {registry.host}")

    layout, gzip_size = build(work)
    ref = f"{registry.host}/{REPO}:v1"
    step("converting it to zstd:chunked, pushed to the origin")
    summary = json.loads(sh(lab, lab.hub, "hub", "convert", "--plain-http", "--json", f"oci:{layout}:gzip",
                            f"docker://{ref}", quiet=True))
    layers = summary["layers"]
    size = sum(ly["bytes_out"] for ly in layers)
    print(f"{ref}: {summary['digest']}, {len(layers)} zstd:chunked layers, {size:,} bytes")
    step("inspecting and verifying every digest of the converted image")
    sh(lab, lab.hub, "hub", "inspect", "--plain-http", "--verify", f"docker://{ref}")
    step("converting again changes nothing (same digest)")
    sh(lab, lab.hub, "hub", "convert", "--plain-http", f"docker://{ref}", f"docker://{registry.host}/{REPO}:again")

    step("recording the image's access profile: it runs once on an embedded node; the profile is pushed")
    before = blob_bytes(registry)
    sh(lab, lab.hub, "hub", "profile", "record", ref, "--push", "--plain-http")
    record_origin = blob_bytes(registry) - before

    step("the region: `shoal region` in the hub, in front of the origin (cache, swarm tracker, preheat API)")
    region = netlab.start_region(lab, work, registry)
    store = work / "region"
    token = store / "tls" / "prefetch-token"
    print(f"hub$ shoal region --listen {region.url.split('://', 1)[1]} --origin http://{registry.host} --store {store}")
    print(f"its CA {region.ca}, node token {region.token_file}, preheat API token {token}")

    step("two nodes: each a `shoal node` (swarm on, [fetch] region_url the region) and a containerd using it")
    names = {h.ns: n for h, n in zip(hosts, NAMES, strict=True)}
    nodes = netlab.start_nodes(lab, hosts, short, region, registry, tables=lambda nd: {
        "node": {"name": names[nd.name]}, "containerd": {"address": str(nd / "c" / "containerd.sock")}})
    snippet = (ROOT / "deploy/containerd/config.toml").read_text()
    for node in nodes:  # containerd with the node as its `shoal` proxy snapshotter (deploy/containerd)
        d.servers.append(start_containerd(node.dir / "c", extra_config=snippet.replace(
            "/run/shoal/snapshotter.sock", str(node.socket))))
        d.stack.callback(d.servers[-1].stop)
    for name, node, ctd in zip(NAMES, nodes, d.servers, strict=True):
        print(f"{name}$ shoal node --root {node.root} --socket {node.socket} --config {node.dir / 'node.toml'}")
        print(f"$ containerd --config {ctd.config_path}    # {name}'s (unix sockets only: no network of its own)")
    print(f"--- {nodes[0].dir / 'node.toml'}\n{(nodes[0].dir / 'node.toml').read_text().strip()}\n---")
    for name, node in zip(NAMES, nodes, strict=True):
        wait_for(lambda node=node: "registered with region" in (node.dir / "node.log").read_text(errors="replace"),
                 f"{name} registered with the region", 60)
    print("both nodes registered with the region")

    step("the scheduler's hook before the job: warm the image on the job's nodes, through the region")
    marks = [figures(n) for n in nodes]
    before = fleet_before = blob_bytes(registry)
    sh(lab, lab.hub, "hub", "prefetch", ref, "--region", region.url, "--ca", region.ca, "--token-file", str(token),
       "--nodes", ",".join(NAMES), "--wait", "--timeout", "300")
    preheat_origin = blob_bytes(registry) - before
    warm = [figures(n) for n in nodes]

    step("the job starts: on each node, `shoal pull` + `ctr run --snapshotter shoal` (a lazy start)")
    before = blob_bytes(registry)
    for name, node, ctd in zip(NAMES, nodes, d.servers, strict=True):
        if EXPECTED not in lazy_start(lab, name, node, ctd, ref):
            raise RuntimeError(f"{name}: the container did not print {EXPECTED!r}")
    start_origin = blob_bytes(registry) - before
    started = [figures(n) for n in nodes]

    step("each node then proves its lazy layers in the background ([fetch] prove_after, 30 s after their "
         "prepare): their whole blobs, read through the chain (swarm first), checked against the image's diff_ids")
    for name, node in zip(NAMES, nodes, strict=True):
        wait_for(lambda node=node: proven(node, len(layers)), f"{name}'s layers proven", 240, 1)
        print(f"{name}$ shoal status --root {node.root}    # every lazy layer: proven")
    proof_origin = blob_bytes(registry) - before - start_origin
    # the region completes its copy of the blobs after the job (what a preheat in profile
    # mode left out); the origin logs an answer when it ends
    def region_idle() -> bool:
        st = region.status(lab)["region"]
        return st["fills_running"] == 0 and st["fills_holding"] == 0

    wait_for(region_idle, "the region's fills", 240, 0.5)
    st = region.status(lab)["region"]
    received = st["origin_bytes"] + st["origin_range_bytes"]  # what the region took from the origin
    # (the origin logs an answer the region cut when it notices: wait for the log to hold them)
    wait_for(lambda: blob_bytes(registry) - fleet_before >= received, "the origin's log of the region's reads", 60, 0.2)
    fleet = blob_bytes(registry) - fleet_before
    later = fleet - preheat_origin - start_origin - proof_origin
    done = [figures(n) for n in nodes]

    step("where each node's bytes came from (compressed blob bytes; the store's are decompressed chunks)")
    for name, node in zip(NAMES, nodes, strict=True):
        print(f"{name}$ shoal status --root {node.root} --json    # its \"fetch\" figures")
    rows = []
    for name, *phases in zip(NAMES, marks, warm, started, done, strict=True):
        for label, a, b in zip(("preheat", "start", "proof"), phases, phases[1:], strict=False):
            rows.append((f"{name} {label}", {k: b[k] - a[k] for k in b}))
    table(rows)
    for name, w, e in zip(NAMES, warm, started, strict=True):
        print(f"{name} start: {e['memory_hits'] - w['memory_hits']} chunk reads from its memory, "
              f"{e['store_hits'] - w['store_hits']} from its chunk store (the preheat's chunks)")
    served = region.status(lab)["region"]["bytes_served"]
    print(f"\nthe image: {size:,} bytes of zstd:chunked layers ({gzip_size:,} gzip)")
    print(f"the origin's access log: {record_origin:,} blob bytes to the recording (CI, no region), "
          f"{preheat_origin:,} to the preheat, {start_origin:,} to both starts, {proof_origin:,} to both proofs, "
          f"{later:,} logged after them (the region's fill completing its copy)")
    print(f"origin bytes for the fleet: {fleet:,} = {fleet / size:.2f} copies of the image; "
          f"the region served {served:,}, the nodes each other {sum(e['to_peers'] for e in done):,}")


def left_running(pids: list[int], timeout: float = 10) -> list[str]:
    """Those of `pids` still running (not gone, not a zombie) after up to `timeout` s (a
    process killed by PID is gone once its parent, maybe init, reaped it): PID and command."""
    def running(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    out = []
    for pid in alive:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\0", b" ").decode(errors="replace")[:120].strip()
            out.append(f"{pid} ({command})")
        except OSError:
            pass
    return out


def main() -> int:
    def on_term(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the cleanup below runs to its end
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        raise KeyboardInterrupt

    if reason := netlab.lab_missing(fuse=True):
        print(f"demo: {reason}", file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="shoal-demo-"))
    pids: list[int] = []
    dirs = [work]
    code = 0
    try:
        with contextlib.ExitStack() as stack:
            stack.callback(shutil.rmtree, work, ignore_errors=True)  # last: after every process and mount
            d = Demo(stack)
            try:
                demo(work, d)
            finally:
                pids, dirs = d.pids(), [work, *d.dirs]
                step("cleaning up: every process by its PID, then mounts, namespaces and directories")
    except KeyboardInterrupt:
        print("demo: interrupted", file=sys.stderr)
        code = 130
    except (RuntimeError, AssertionError, subprocess.SubprocessError, OSError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        code = 1
    alive, mounted = left_running(pids), netlab.mounts_under(*dirs)
    left = [str(p) for p in dirs if p.exists()]
    print(f"stopped PIDs {' '.join(map(str, pids)) or '(none)'}; still running: {alive or 'none'}; "
          f"mounts left: {mounted or 'none'}; directories left: {left or 'none'}", flush=True)
    if code == 0:
        print(f"\ndone in {time.monotonic() - t0:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
