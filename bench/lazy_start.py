"""Lazy-start benchmark: time to first useful work, containerd's own pull against shoal.

    .venv/bin/python bench/lazy_start.py [--quick] [--json] [--links L,...] [--keep-work]

The image (tests/torchimage.py, built once and cached): Debian bookworm minbase from
debootstrap plus /opt/venv/site-packages with torch 2.13.0 (CPU) and numpy, about 1.1 GB
in two gzip layers; shoal's side pulls the same image after `shoal convert`. The work:
`python3 -c "import torch; a=torch.ones(256,256); print(float((a@a).sum()))"`.

On a cold node each time (a fresh containerd root and state, a fresh shoal --root):

- containerd: `ctr image pull --plain-http REF` (fetch + unpack into overlayfs), then
  `ctr run --rm REF ID CMD`;
- shoal: `shoal node --root R --socket S` and containerd with `[proxy_plugins.shoal]`
  already running (daemons a node has anyway; not timed), then `shoal pull REF
  --address CONTAINERD_SOCK --plain-http`, then `ctr run --snapshotter shoal --rm REF ID CMD`.
  Twice, on two cold nodes: first with `[fetch] prefetch_profiles = false` (no access
  profile: every chunk is fetched when a read asks for it), after which that node publishes
  what it read as the image's access profile (`shoal profile save --push`, not timed);
  then on a default node, which finds the profile when the pull prepares the layers and
  fetches those chunks ahead of the reads ("shoal+profile": an image whose profile was
  recorded once, e.g. in CI, as it would be before a fleet starts it).

Timed: from the start of the pull to the end of the run (the command's output checked).
Bytes fetched: response bytes the registry's access log records for the timed phase.

Links: every run happens in a network namespace of the benchmark's own, registry,
containerd, shoal node and the pulls all on its 127.0.0.1: `loopback` (no limit), `1gbit`
and `100mbit` (`tc qdisc add dev lo root tbf rate R burst 512kb latency 50ms` in that
namespace). Processes enter it with `nsenter --net=/run/netns/NS` (bench/common.py
NetNamespace): `ip netns exec` would also give each one a mount namespace of its own, and
containerd could then not see shoal's FUSE mounts. Each link is calibrated first: a timed
`curl` GET of up to 100 MB of a layer blob from the registry inside the namespace.

--quick: loopback only, with a small image (Debian's python3.11 and its standard library,
from tests/rootfs.py) and `import json, asyncio, email.parser` as the work; about a minute.

Target (issue 3): shoal at most 0.3x containerd's time on every link.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

sys.path.insert(0, str(common.REPO))
from tests import services

TARGET = 0.3
LINKS = {"loopback": None, "1gbit": "1gbit", "100mbit": "100mbit"}
NAMESPACE = "shoal-bench"  # containerd namespace
REGISTRY_PORT = 5000  # inside the benchmark's own network namespace: always free
REPO_NAME = "bench/torch"
CALIBRATION_BYTES = 100_000_000
TORCH_CMD = ["python3", "-c", "import torch; a=torch.ones(256,256); print(float((a@a).sum()))"]
TORCH_EXPECTED = "16777216.0"
QUICK_CMD = ["python3", "-c", "import json, asyncio, email.parser; print(sum(i * i for i in range(100000)))"]
QUICK_EXPECTED = "333328333350000"
PULL_TIMEOUT = 1200.0
RUN_TIMEOUT = 600.0


class BenchFailure(RuntimeError):
    pass


@dataclass
class Image:
    gzip_layout: Path
    shoal_layout: Path
    tag: str
    cmd: list[str]
    expected: str
    what: str
    gzip_bytes: int = 0
    shoal_bytes: int = 0
    tree_bytes: int = 0


@dataclass
class Side:
    seconds: float | None = None
    pull_s: float | None = None
    run_s: float | None = None
    bytes_fetched: int | None = None
    requests: int | None = None
    error: str | None = None
    detail: dict = field(default_factory=dict)


# --- processes: everything started is stopped by PID, also on failure and Ctrl-C ----------


class Procs:
    """Processes and daemons this benchmark started, stopped in reverse order."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.procs: list[subprocess.Popen] = []
        self.containerds: list[services.ContainerdServer] = []

    def popen(self, cmd: list, log_path: Path) -> subprocess.Popen:
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        services.stop_process(proc)
        if proc in self.procs:
            self.procs.remove(proc)

    def stop_containerd(self, server: services.ContainerdServer) -> None:
        try:
            server.stop()
        finally:
            if server in self.containerds:
                self.containerds.remove(server)

    def stop_all(self) -> None:
        for server in reversed(list(self.containerds)):
            try:
                self.stop_containerd(server)
            except Exception as e:  # noqa: BLE001  (keep going: everything else must stop too)
                common.say(f"cleanup: containerd: {e}")
        for proc in reversed(list(self.procs)):
            self.stop(proc)
        # whatever our daemons started (shims, shoal's layer file system server...) names
        # our private work directory on its command line
        left = common.pids_mentioning(str(self.work))
        if left:
            common.say(f"cleanup: stopping {len(left)} leftover process(es) by PID: {left}")
            common.kill_pids(left)


def sh_prefix(ns: common.NetNamespace | None) -> list[str]:
    return ns.prefix if ns is not None else []


def run_cmd(cmd: list, timeout: float, what: str) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              timeout=timeout, check=False, errors="replace")
    except subprocess.TimeoutExpired:
        raise BenchFailure(f"{what}: timed out after {timeout:.0f}s") from None
    if proc.returncode != 0:
        raise BenchFailure(f"{what}: exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc


# --- the registry (one per link, inside its namespace, on a shared storage folder) --------


def registry_config(storage: Path, port: int) -> str:
    return json.dumps({
        "version": 0.1,
        "log": {"level": "info", "formatter": "json", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "maintenance": {"uploadpurging": {"enabled": False}}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": "shoal-bench"},
    })


def start_registry_in(ns: common.NetNamespace, storage: Path, workdir: Path, procs: Procs) -> services.RegistryServer:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "registry.yml"
    config.write_text(registry_config(storage, REGISTRY_PORT))
    log = workdir / "registry.log"
    proc = procs.popen([*ns.prefix, services.REGISTRY_BIN, "serve", config], log)
    host = f"127.0.0.1:{REGISTRY_PORT}"
    server = services.RegistryServer(host=host, url=f"http://{host}", log_path=log, storage=storage,
                                     pid=proc.pid, _proc=proc)
    deadline = time.monotonic() + services.START_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        if subprocess.run([*ns.prefix, "curl", "-s", "-o", "/dev/null", f"{server.url}/v2/"],
                          capture_output=True, check=False).returncode == 0:
            return server
        time.sleep(0.1)
    raise BenchFailure(f"registry in {ns.name} did not start: {log.read_text(errors='replace')[-1500:]}")


def registry_mark(server: services.RegistryServer) -> int:
    return len(server.requests())


def registry_since(server: services.RegistryServer, mark: int) -> tuple[int, int]:
    """(requests, response bytes) logged after `mark`."""
    time.sleep(0.3)  # the access log line is written when the response completes
    reqs = server.requests()[mark:]
    return len(reqs), sum(r.written for r in reqs)


# --- containerd (inside the namespace: its pulls reach the registry on 127.0.0.1 there) ---


def containerd_config(root: Path, state: Path, address: str, proxy_socket: Path | None) -> str:
    def q(value: object) -> str:
        return json.dumps(str(value))

    lines = [
        "version = 2",
        f"root = {q(root)}",
        f"state = {q(state)}",
        'disabled_plugins = ["io.containerd.grpc.v1.cri"]',
        "[grpc]", f"  address = {q(address)}",
        "[ttrpc]", f"  address = {q(address + '.ttrpc')}",
        "[debug]", '  address = ""', '  level = "info"',
        "[metrics]", '  address = ""',
        '[plugins."io.containerd.internal.v1.opt"]', f"  path = {q(root / 'opt')}",
    ]
    if proxy_socket is not None:
        lines += ["[proxy_plugins]", "  [proxy_plugins.shoal]", '    type = "snapshot"',
                  f"    address = {q(proxy_socket)}"]
    return "\n".join(lines) + "\n"


def start_containerd_in(ns: common.NetNamespace | None, workdir: Path, procs: Procs,
                        proxy_socket: Path | None = None) -> services.ContainerdServer:
    workdir.mkdir(parents=True, exist_ok=True)
    root, state, runc_root, fifo = (workdir / d for d in ("root", "state", "runc", "fifo"))
    for d in (root, state, runc_root, fifo):
        d.mkdir(exist_ok=True)
    address = str(workdir / "containerd.sock")
    config = workdir / "containerd.toml"
    config.write_text(containerd_config(root, state, address, proxy_socket))
    log = workdir / "containerd.log"
    created = services.missing_dirs("/run/containerd/s", "/run/containerd/fifo", "/run/containerd/runc",
                                    "/run/containerd")
    proc = procs.popen([*sh_prefix(ns), services.CONTAINERD_BIN, "--config", config], log)
    server = services.ContainerdServer(
        address=address, workdir=workdir, root=root, state=state, config_path=config, log_path=log,
        pid=proc.pid, runc_root=runc_root, fifo_dir=fifo, _proc=proc, _created_run_dirs=created,
    )
    procs.procs.remove(proc)
    procs.containerds.append(server)
    deadline = time.monotonic() + services.START_TIMEOUT
    while time.monotonic() < deadline and proc.poll() is None:
        if os.path.exists(address) and server.ctr("version", check=False, timeout=5).returncode == 0:
            return server
        time.sleep(0.05)
    raise BenchFailure(f"containerd did not start: {server.log_tail(1500)}")


def ctr(ns: common.NetNamespace | None, server: services.ContainerdServer, *args: str) -> list[str]:
    return [*sh_prefix(ns), services.CTR_BIN, "--address", server.address, "--namespace", NAMESPACE, *args]


def ctr_run(ns, server, ref: str, cid: str, cmd: list[str], snapshotter: str | None = None,
            cgroup: str | None = None) -> list[str]:
    extra = ["--snapshotter", snapshotter] if snapshotter else []
    if cgroup:
        extra += ["--cgroup", cgroup]
    return ctr(ns, server, "run", "--rm", *extra, "--runc-root", str(server.runc_root), "--fifo-dir",
               str(server.fifo_dir), ref, cid, *cmd)


def check_output(proc: subprocess.CompletedProcess, expected: str, what: str) -> None:
    if expected not in proc.stdout:
        raise BenchFailure(f"{what}: expected {expected!r} in the output, got {proc.stdout[-500:]!r} "
                           f"{proc.stderr[-1500:]!r}")


# --- the two sides -------------------------------------------------------------------------


def containerd_side(ns, registry, image: Image, ref: str, work: Path, procs: Procs) -> Side:
    side = Side()
    server = start_containerd_in(ns, work / "containerd", procs)
    try:
        mark = registry_mark(registry)
        t0 = time.perf_counter()
        run_cmd(ctr(ns, server, "image", "pull", "--plain-http", ref), PULL_TIMEOUT, "ctr image pull")
        t1 = time.perf_counter()
        out = run_cmd(ctr_run(ns, server, ref, "bench-ctd", image.cmd), RUN_TIMEOUT, "ctr run")
        t2 = time.perf_counter()
        check_output(out, image.expected, "ctr run (overlayfs)")
        side.pull_s, side.run_s, side.seconds = t1 - t0, t2 - t1, t2 - t0
        side.requests, side.bytes_fetched = registry_since(registry, mark)
    finally:
        procs.stop_containerd(server)
    return side


def start_shoal_node(ns, workdir: Path, procs: Procs, config: str = "") -> tuple[subprocess.Popen, Path, Path]:
    root, sock = workdir / "shoal-root", workdir / "shoal.sock"
    log = workdir / "shoal-node.log"
    extra = []
    if config:
        (workdir / "shoal.toml").write_text(config)
        extra = ["--config", workdir / "shoal.toml"]
    proc = procs.popen([*sh_prefix(ns), common.SHOAL, "node", "--root", root, "--socket", sock, *extra], log)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        if sock.exists():
            return proc, root, sock
        time.sleep(0.05)
    raise BenchFailure(f"shoal node did not start (exit {proc.poll()}): {log.read_text(errors='replace')[-1500:]}")


def shoal_side(ns, registry, image: Image, ref: str, work: Path, procs: Procs, profiles: bool) -> Side:
    """One cold shoal node. profiles=False: the node ignores published access profiles
    ([fetch] prefetch_profiles = false), and after its run publishes what it read as the
    image's profile (`shoal profile save --push`, not timed). profiles=True: a default
    node, which prefetches the published profile when the pull prepares the layers."""
    side = Side()
    workdir = work / ("shoal-profiled" if profiles else "shoal")
    workdir.mkdir(parents=True, exist_ok=True)
    node = server = None
    try:
        # the node asks this containerd which images name a chain (chain proofs); a node that
        # cannot ask it proves every lazy chain before a container starts on it
        ctd_address = json.dumps(str(workdir / "containerd" / "containerd.sock"))
        fetch = "" if profiles else "[fetch]\nprefetch_profiles = false\n"
        node, root, sock = start_shoal_node(ns, workdir, procs, f"{fetch}[containerd]\naddress = {ctd_address}\n")
        server = start_containerd_in(ns, workdir / "containerd", procs, proxy_socket=sock)
        mark = registry_mark(registry)
        t0 = time.perf_counter()
        pull = run_cmd([*sh_prefix(ns), common.SHOAL, "pull", ref, "--address", server.address,
                        "--namespace", NAMESPACE, "--plain-http"], PULL_TIMEOUT, "shoal pull")
        t1 = time.perf_counter()
        out = run_cmd(ctr_run(ns, server, ref, "bench-shoal", image.cmd, snapshotter="shoal"), RUN_TIMEOUT,
                      "ctr run --snapshotter shoal")
        t2 = time.perf_counter()
        check_output(out, image.expected, "ctr run --snapshotter shoal")
        side.pull_s, side.run_s, side.seconds = t1 - t0, t2 - t1, t2 - t0
        side.requests, side.bytes_fetched = registry_since(registry, mark)
        side.detail["pull"] = pull.stdout.strip()[-2000:]
        if not profiles:
            saved = run_cmd([*sh_prefix(ns), common.SHOAL, "profile", "save", ref, "--root", root, "--push",
                             "--plain-http"], 120, "shoal profile save")
            side.detail["profile"] = saved.stdout.strip().splitlines()[0] if saved.stdout.strip() else ""
        status = subprocess.run([common.SHOAL, "status", "--root", str(root), "--json"], capture_output=True,
                                text=True, check=False, timeout=30)
        if status.returncode == 0:
            try:
                side.detail["status"] = json.loads(status.stdout)
            except ValueError:
                pass
    except BenchFailure as e:
        side.error = str(e)
        tail = (workdir / "shoal-node.log").read_text(errors="replace")[-1500:] if (workdir / "shoal-node.log").exists() else ""
        side.detail["node_log_tail"] = tail
    finally:
        if server is not None:
            procs.stop_containerd(server)
        if node is not None:
            procs.stop(node)
        # shoal's layer file system server outlives the node by design: stop it by PID
        left = common.pids_mentioning(str(workdir))
        if left:
            common.kill_pids(left)
        stuck = services.unmount_under(workdir)
        if stuck:
            common.say(f"shoal: still mounted after umount -l: {stuck}")
    return side


# --- images ----------------------------------------------------------------------------------


def layout_bytes(layout: Path, tag: str) -> int:
    """Compressed size of the image: manifest + config + layer blobs."""
    index = json.loads((layout / "index.json").read_text())
    desc = next(m for m in index["manifests"]
                if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag)
    manifest = json.loads((layout / "blobs" / desc["digest"].replace(":", "/", 1)).read_text())
    return desc["size"] + manifest["config"]["size"] + sum(x["size"] for x in manifest["layers"])


def largest_layer(layout: Path, tag: str) -> tuple[str, int]:
    index = json.loads((layout / "index.json").read_text())
    desc = next(m for m in index["manifests"]
                if (m.get("annotations") or {}).get("org.opencontainers.image.ref.name") == tag)
    manifest = json.loads((layout / "blobs" / desc["digest"].replace(":", "/", 1)).read_text())
    layer = max(manifest["layers"], key=lambda x: x["size"])
    return layer["digest"], layer["size"]


def torch_image() -> Image:
    from tests import torchimage

    t = time.monotonic()
    gz = torchimage.torch_image_layout()
    conv = torchimage.torch_image_converted()
    common.say(f"image: {gz} and {conv} ({time.monotonic() - t:.1f}s)")
    info = torchimage.image_info(gz)
    return Image(gz, conv, torchimage.TAG, TORCH_CMD, TORCH_EXPECTED,
                 f"Debian bookworm minbase + torch {torchimage.TORCH} CPU + numpy (tests/torchimage.py)",
                 tree_bytes=info.get("tree_bytes", 0))


def quick_image(work: Path) -> Image:
    from tests.lab.fromdir import ImageConfig, build_image
    from tests.rootfs import python_layer

    tree = work / "quick-tree"
    python_layer(tree)
    for d in ("proc", "sys", "dev", "tmp"):
        (tree / d).mkdir(exist_ok=True)
    tree_bytes = sum(p.stat().st_size for p in tree.rglob("*") if p.is_file() and not p.is_symlink())
    gz, conv = work / "quick-gzip", work / "quick-shoal"
    build_image([str(tree)], f"oci:{gz}:quick", ImageConfig(cmd=QUICK_CMD), compression="gzip", workdir=str(work))
    run_cmd([common.SHOAL, "convert", f"oci:{gz}:quick", f"oci:{conv}:quick"], 600, "shoal convert")
    shutil.rmtree(tree)
    return Image(gz, conv, "quick", QUICK_CMD, QUICK_EXPECTED, "Debian python3.11 + stdlib (tests/rootfs.py)",
                 tree_bytes=tree_bytes)


def push_images(image: Image, work: Path) -> Path:
    """Push both images into a registry storage folder (a registry on the host's
    loopback, stopped afterwards); the per-link registries serve that folder."""
    from tests.lab.provide import publish_layout_pieces
    from tests.torchimage import push

    regdir = work / "registry-push"
    regdir.mkdir()
    server = services.start_registry(regdir, None)
    try:
        t = time.monotonic()
        push(image.gzip_layout, image.tag, server.host, repo=REPO_NAME, dest_tag="gzip")
        push(image.shoal_layout, image.tag, server.host, repo=REPO_NAME, dest_tag="shoal")
        # as `shoal convert` to a registry publishes them: a region makes a lazy layer's
        # torrent from these before it holds the layer
        pieces = publish_layout_pieces(str(image.shoal_layout), image.tag, server.host, REPO_NAME)
        common.say(f"pushed both images (and the piece hashes of {pieces} lazy layers) in "
                   f"{time.monotonic() - t:.1f}s")
    finally:
        server.stop()
    return server.storage


# --- per link --------------------------------------------------------------------------------


def calibrate(ns: common.NetNamespace, registry, image: Image) -> dict:
    digest, size = largest_layer(image.gzip_layout, image.tag)
    n = min(size, CALIBRATION_BYTES)
    url = f"{registry.url}/v2/{REPO_NAME}/blobs/{digest}"
    proc = run_cmd([*ns.prefix, "curl", "-sS", "-f", "-o", "/dev/null", "-r", f"0-{n - 1}", "-w",
                    "%{size_download} %{time_total}", url], 600, "calibration GET")
    got, secs = proc.stdout.split()
    got, secs = int(got), float(secs)
    return {"bytes": got, "seconds": round(secs, 3), "mbit_s": round(got * 8 / secs / 1e6, 1) if secs else None}


def settle() -> None:
    """Before each side: write out what the previous side left dirty (containerd's unpacked
    layers, a shoal node's chunk store), so that its writeback does not land in the next
    side's timed start (not timed)."""
    os.sync()
    time.sleep(1)


def run_link(link: str, rate: str | None, image: Image, storage: Path, work: Path, procs: Procs) -> dict:
    ns_name = f"shoal-bench-{os.getpid()}-{link}"
    linkdir = work / link
    linkdir.mkdir()
    with common.NetNamespace(ns_name, rate) as ns:
        try:
            common.say(f"[{link}] namespace {ns_name}: {ns.qdisc()}")
            load = round(os.getloadavg()[0], 2)
            if load > common.cores():
                common.say(f"[{link}] note: load average {load} on {common.cores()} cores: other work on this "
                           "machine; the unpack (CPU-bound) and the figures will be noisy")
            registry = start_registry_in(ns, storage, linkdir / "registry", procs)
            cal = calibrate(ns, registry, image)
            common.say(f"[{link}] calibration: GET {cal['bytes'] / 1e6:.0f} MB of a layer blob in "
                       f"{cal['seconds']:.2f}s = {cal['mbit_s']:,.0f} Mbit/s")
            host = registry.host
            gz_ref, shoal_ref = f"{host}/{REPO_NAME}:gzip", f"{host}/{REPO_NAME}:shoal"
            common.say(f"[{link}] containerd: ctr image pull + ctr run (overlayfs), cold node")
            settle()
            try:
                ctd = containerd_side(ns, registry, image, gz_ref, linkdir, procs)
            except BenchFailure as e:
                ctd = Side(error=str(e))
            if ctd.error:
                common.say(f"[{link}] containerd FAILED: {ctd.error}")
            else:
                common.say(f"[{link}] containerd: {ctd.seconds:.2f}s (pull+unpack {ctd.pull_s:.2f}s, run "
                           f"{ctd.run_s:.2f}s), {ctd.bytes_fetched / 1e6:,.1f} MB fetched")
            sides = {}
            for profiles, label in ((False, "shoal"), (True, "shoal+profile")):
                common.say(f"[{link}] {label}: shoal pull + ctr run --snapshotter shoal, cold node"
                           + (" (the image's access profile published)" if profiles else ", no access profile"))
                settle()
                sh = sides[label] = shoal_side(ns, registry, image, shoal_ref, linkdir, procs, profiles)
                if sh.error:
                    common.say(f"[{link}] {label} FAILED: {sh.error}")
                else:
                    common.say(f"[{link}] {label}: {sh.seconds:.2f}s (pull {sh.pull_s:.2f}s, run {sh.run_s:.2f}s), "
                               f"{sh.bytes_fetched / 1e6:,.1f} MB fetched in {sh.requests} requests")
                if sh.detail.get("profile"):
                    common.say(f"[{link}] published the access profile: {sh.detail['profile']}")
            sh, pf = sides["shoal"], sides["shoal+profile"]
        finally:
            procs.stop_all()
    ratio = round(sh.seconds / ctd.seconds, 4) if sh.seconds and ctd.seconds else None
    ratio_pf = round(pf.seconds / ctd.seconds, 4) if pf.seconds and ctd.seconds else None
    return {
        "link": link,
        "containerd_s": round(ctd.seconds, 3) if ctd.seconds is not None else None,
        "shoal_s": round(sh.seconds, 3) if sh.seconds is not None else None,
        "ratio": ratio,
        "bytes_fetched": sh.bytes_fetched,
        "image_bytes": image.shoal_bytes,
        "containerd_bytes_fetched": ctd.bytes_fetched,
        "gzip_image_bytes": image.gzip_bytes,
        "fetched_fraction": round(sh.bytes_fetched / image.shoal_bytes, 4) if sh.bytes_fetched is not None else None,
        "containerd_pull_s": round(ctd.pull_s, 3) if ctd.pull_s is not None else None,
        "containerd_run_s": round(ctd.run_s, 3) if ctd.run_s is not None else None,
        "shoal_pull_s": round(sh.pull_s, 3) if sh.pull_s is not None else None,
        "shoal_run_s": round(sh.run_s, 3) if sh.run_s is not None else None,
        "shoal_requests": sh.requests,
        "containerd_requests": ctd.requests,
        "calibration": cal,
        "loadavg_1m": load,
        "target_met": ratio is not None and ratio <= TARGET,
        "shoal_profiled_s": round(pf.seconds, 3) if pf.seconds is not None else None,
        "ratio_profiled": ratio_pf,
        "profiled_bytes_fetched": pf.bytes_fetched,
        "profiled_requests": pf.requests,
        "profiled_pull_s": round(pf.pull_s, 3) if pf.pull_s is not None else None,
        "profiled_run_s": round(pf.run_s, 3) if pf.run_s is not None else None,
        "target_met_profiled": ratio_pf is not None and ratio_pf <= TARGET,
        **({"containerd_error": ctd.error} if ctd.error else {}),
        **({"shoal_error": sh.error, "shoal_node_log_tail": sh.detail.get("node_log_tail", "")} if sh.error else {}),
        **({"profiled_error": pf.error, "profiled_node_log_tail": pf.detail.get("node_log_tail", "")}
           if pf.error else {}),
    }


# --- main ------------------------------------------------------------------------------------


def preflight() -> None:
    if os.geteuid() != 0:
        sys.exit("bench: lazy_start needs root (containerd, runc, network namespaces, FUSE)")
    for tool in (services.CONTAINERD_BIN, services.CTR_BIN, services.REGISTRY_BIN, "/usr/sbin/runc"):
        if not os.access(tool, os.X_OK):
            sys.exit(f"bench: {tool} not found (scripts/install.sh)")
    for tool in ("nsenter", "ip", "tc", "curl"):
        if not shutil.which(tool):
            sys.exit(f"bench: {tool} not found")
    if not common.SHOAL.is_file():
        sys.exit(f"bench: {common.SHOAL} not found (make install)")


def measure(quick: bool, links: list[str], keep: bool) -> dict:
    preflight()
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-lazy-"))
    procs = Procs(work)

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        image = quick_image(work) if quick else torch_image()
        image.gzip_bytes = layout_bytes(image.gzip_layout, image.tag)
        image.shoal_bytes = layout_bytes(image.shoal_layout, image.tag)
        common.say(f"image: {image.what}; {image.tree_bytes / 1e6:,.0f} MB of files; gzip "
                   f"{image.gzip_bytes / 1e6:,.1f} MB, shoal {image.shoal_bytes / 1e6:,.1f} MB")
        storage = push_images(image, work)
        runs = []
        for link in links:
            runs.append(run_link(link, LINKS[link], image, storage, work, procs))
        return {
            "quick": quick,
            "image": image.what,
            "image_tree_bytes": image.tree_bytes,
            "gzip_image_bytes": image.gzip_bytes,
            "shoal_image_bytes": image.shoal_bytes,
            "command": " ".join(image.cmd),
            "target_ratio": TARGET,
            "runs": runs,
        }
    finally:
        signal.signal(signal.SIGTERM, old)
        finish(work, procs, keep)


def finish(work: Path, procs: Procs, keep: bool) -> None:
    """A benchmark's end, also on failure: everything it started stopped by PID, mounts
    under its work directory undone, the directory removed (or kept, with `keep`)."""
    procs.stop_all()
    stuck = services.unmount_under(work)
    if stuck:
        common.say(f"cleanup: still mounted under {work}: {stuck}")
    if keep:
        common.say(f"work directory kept: {work}")
    elif not stuck:
        shutil.rmtree(work, ignore_errors=True)


def mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.2f}"


def report(f: dict) -> str:
    rows = []
    for r in f["runs"]:
        rows.append([
            r["link"], f"{r['calibration']['mbit_s']:,.0f}",
            secs(r["containerd_s"]), f"{secs(r['containerd_pull_s'])} + {secs(r['containerd_run_s'])}",
            secs(r["shoal_s"]), f"{secs(r['shoal_pull_s'])} + {secs(r['shoal_run_s'])}",
            "-" if r["ratio"] is None else f"{r['ratio']:.3f}x",
            secs(r["shoal_profiled_s"]), f"{secs(r['profiled_pull_s'])} + {secs(r['profiled_run_s'])}",
            "-" if r["ratio_profiled"] is None else f"{r['ratio_profiled']:.3f}x",
            mb(r["containerd_bytes_fetched"]), mb(r["bytes_fetched"]),
            "-" if r["fetched_fraction"] is None else f"{r['fetched_fraction'] * 100:.1f}%",
            f"{r['loadavg_1m']:.1f}",
        ])
    lines = [
        f"lazy-start benchmark ({'quick' if f['quick'] else 'full'}): {f['image']}",
        (f"files {f['image_tree_bytes'] / 1e6:,.0f} MB; gzip image {f['gzip_image_bytes'] / 1e6:,.1f} MB, "
         f"shoal image {f['shoal_image_bytes'] / 1e6:,.1f} MB"),
        f"work: {f['command']}",
        ("cold node each run; seconds from the start of the pull to the end of the run; "
         f"load: 1-minute load average at the link's start ({common.cores()} cores)"),
        "",
        common.table(["link", "Mbit/s", "containerd s", "pull + run", "shoal s", "pull + run", "shoal/ctd",
                      "+profile s", "pull + run", "+profile/ctd", "ctd MB fetched", "shoal MB fetched", "of image", "load"], rows),
        "",
    ]
    for r in f["runs"]:
        for key in ("containerd_error", "shoal_error", "profiled_error"):
            if key in r:
                msg = r[key].strip().splitlines() or [""]
                text = msg[0] if len(msg) == 1 else f"{msg[0]} ... {msg[-1]}"
                lines.append(f"{r['link']}: {key.replace('_', ' ')}: {text[:400]}")
        if r["ratio"] is not None:
            lines.append(f"target {r['link']}: shoal {r['ratio']:.3f}x containerd (want <= {f['target_ratio']}x)  "
                         f"{'PASS' if r['target_met'] else 'MISS'}")
        if r["ratio_profiled"] is not None:
            lines.append(f"target {r['link']}: shoal with the image's access profile {r['ratio_profiled']:.3f}x "
                         f"containerd (want <= {f['target_ratio']}x)  {'PASS' if r['target_met_profiled'] else 'MISS'}")
    return "\n".join(lines)


def main() -> int:
    p = common.parser("time to first useful work: containerd's pull + run against shoal pull + lazy run")
    p.add_argument("--links", help=f"comma-separated subset of {','.join(LINKS)} (default: all; --quick: loopback)")
    p.add_argument("--keep-work", action="store_true", help="keep the work directory (logs) for a look afterwards")
    args = p.parse_args()
    links = args.links.split(",") if args.links else (["loopback"] if args.quick else list(LINKS))
    bad = [x for x in links if x not in LINKS]
    if bad:
        p.error(f"unknown link {bad[0]} (one of {', '.join(LINKS)})")
    try:
        figures = measure(args.quick, links, args.keep_work)
    except KeyboardInterrupt:
        common.say("interrupted; everything started was stopped")
        return 130
    except BenchFailure as e:
        sys.exit(f"bench: {e}")
    common.emit(figures, report, args.json)
    failed = any("containerd_error" in r or "shoal_error" in r or "profiled_error" in r for r in figures["runs"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
