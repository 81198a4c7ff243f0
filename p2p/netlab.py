"""A lab network of Linux network namespaces, for the swarm tests and benchmark (root).

    with Lab() as lab:
        hub = lab.hub                      # namespace with the bridge, 192.0.2.1
        n1 = lab.add_node(rate_mbit=200)   # its own namespace, 192.0.2.11, link capped both ways
        proc = lab.popen(n1, [python, "-m", "p2p.agent", ...])

Layout: one *hub* namespace holds a bridge (192.0.2.1/24) and one veth end per node;
each node namespace holds the other end (192.0.2.(10+i)/24) and its loopback. The
registry and region run in the hub. Addresses are from TEST-NET-1 (RFC 5737) and exist
only inside these namespaces: nothing is routed to or from the host's own network.
`tc tbf` on both ends of a node's veth caps its upload and its download.

Everything the lab makes is named with a per-lab prefix and removed by close(): the
processes it started (by PID: SIGTERM, then SIGKILL), then the namespaces (which takes
their veths and the bridge with them). close() runs on exceptions too (context manager)
and is idempotent.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

SUBNET = "192.0.2"  # TEST-NET-1: documentation addresses, never routed
HUB_IP = f"{SUBNET}.1"
_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available() -> str | None:
    """Why a lab cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("/usr/sbin/ip", "/usr/sbin/tc"):
        if not os.access(tool, os.X_OK) and not os.access(tool.replace("/usr/sbin", "/sbin"), os.X_OK):
            return f"{os.path.basename(tool)} is not installed (Debian package iproute2)"
    return None




def registry_log(path: Path) -> list[dict]:
    """The completed requests a distribution registry logged (JSON log lines with
    http.request.method, http.request.uri, http.response.status and .written)."""
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "http.request.method" in entry and "http.response.status" in entry:
            out.append(entry)
    return out

@dataclass
class Host:
    ns: str
    ip: str
    dev: str  # the device inside the namespace
    hub_dev: str = ""  # the hub end of its veth


@dataclass
class Lab:
    prefix: str = ""
    hosts: list[Host] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prefix:
            self.prefix = f"shp{os.getpid() % 100000}x{next(_counter)}"
        self.hub = Host(f"{self.prefix}h", HUB_IP, "br0")
        try:
            self._netns_add(self.hub.ns)
            _ip("-n", self.hub.ns, "link", "set", "lo", "up")
            _ip("-n", self.hub.ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.hub.ns, "addr", "add", f"{HUB_IP}/24", "dev", "br0")
            _ip("-n", self.hub.ns, "link", "set", "br0", "up")
        except BaseException:
            self.close()
            raise

    def _netns_add(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)

    def add_node(self, rate_mbit: float | None = None) -> Host:
        i = len(self.hosts) + 1
        if i > 200:
            raise ValueError("at most 200 nodes in a lab")
        host = Host(f"{self.prefix}n{i}", f"{SUBNET}.{10 + i}", "eth0", f"v{i}")
        self._netns_add(host.ns)
        _ip("link", "add", "name", host.hub_dev, "netns", self.hub.ns, "type", "veth",
            "peer", "name", host.dev, "netns", host.ns)
        _ip("-n", self.hub.ns, "link", "set", host.hub_dev, "master", "br0")
        _ip("-n", self.hub.ns, "link", "set", host.hub_dev, "up")
        _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", host.dev)
        _ip("-n", host.ns, "link", "set", host.dev, "up")
        _ip("-n", host.ns, "link", "set", "lo", "up")
        if rate_mbit:
            self.cap(host, rate_mbit)
        self.hosts.append(host)
        return host

    def cap(self, host: Host, rate_mbit: float) -> None:
        """tbf on both ends of the host's link: its upload and its download."""
        burst = max(256 << 10, int(rate_mbit * 1e6 / 8 / 100))  # >= 10 ms of bytes: timer slack
        for ns, dev in ((host.ns, host.dev), (self.hub.ns, host.hub_dev)):
            subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                            "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"],
                           check=True, capture_output=True, text=True)

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start a process inside the host's namespace (`ip netns exec` execs it: the
        PID is the process's own)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(["ip", "netns", "exec", host.ns, *map(str, argv)], **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: Host, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", host.ns, *map(str, argv)], capture_output=True,
                              text=True, timeout=timeout, check=False, **kwargs)

    def kill(self, proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, sig)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def uncap(self, host: Host) -> None:
        for ns, dev in ((host.ns, host.dev), (self.hub.ns, host.hub_dev)):
            subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], capture_output=True, check=False)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    proc.terminate()
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        for ns in reversed(self.namespaces):
            _ip("netns", "del", ns, check=False)
        self.namespaces.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- services in the lab ----------------------------------------------------------------------

REGISTRY_BIN = "/usr/bin/docker-registry"


@dataclass
class LabRegistry:
    """docker-registry in the hub: `.host` ("192.0.2.1:5000"), `.log_path`."""

    host: str
    log_path: Path
    proc: subprocess.Popen

    def bytes_written(self, uri_contains: str = "", method: str = "GET") -> tuple[int, int]:
        """(requests, response bytes) the registry logged for matching requests."""
        n = total = 0
        for entry in registry_log(self.log_path):
            if entry.get("http.request.method") == method and uri_contains in entry.get("http.request.uri", ""):
                n += 1
                total += int(entry.get("http.response.written", 0))
        return n, total


def start_registry(lab: Lab, workdir: Path, port: int = 5000) -> LabRegistry:
    storage = workdir / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    config = workdir / "registry.yml"
    config.write_text(json.dumps({
        "version": 0.1,
        "log": {"level": "info", "formatter": "json", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}},
        "http": {"addr": f"{HUB_IP}:{port}", "secret": os.urandom(16).hex()},
    }))
    log_path = workdir / "registry.log"
    with open(log_path, "wb") as log:
        proc = lab.popen(lab.hub, [REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    reg = LabRegistry(f"{HUB_IP}:{port}", log_path, proc)
    wait_http(lab, lab.hub, f"http://{reg.host}/v2/", proc)
    return reg


def wait_http(lab: Lab, host: Host, url: str, proc: subprocess.Popen, timeout: float = 20) -> None:
    code = ("import sys,urllib.request,urllib.error\n"
            "try: urllib.request.urlopen(sys.argv[1], timeout=1)\n"
            "except urllib.error.HTTPError: pass\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with status {proc.returncode}")
        if lab.run(host, [sys.executable, "-c", code, url], timeout=10).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


def push_blob(lab: Lab, registry: LabRegistry, repository: str, path: Path, digest: str) -> None:
    """Upload a file as a blob of `repository` (from inside the hub)."""
    code = ("import sys, os\n"
            "from builder.oci.refs import DockerRef\n"
            "from builder.oci.registry import RegistryDestination\n"
            "d = RegistryDestination(DockerRef(sys.argv[1], sys.argv[2], tag='x'), plain_http=True)\n"
            "d.put_blob(sys.argv[3], sys.argv[4], os.path.getsize(sys.argv[3])); d.close()\n")
    repo_root = Path(__file__).resolve().parent.parent
    proc = lab.run(lab.hub, [sys.executable, "-c", code, registry.host, repository, str(path), digest],
                   timeout=300, cwd=repo_root, env={**os.environ, "PYTHONPATH": str(repo_root)})
    if proc.returncode != 0:
        raise RuntimeError(f"push of {digest} failed: {proc.stderr[-2000:]}")


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line of a process's stdout (a `ready ...` line), or RuntimeError."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        if not sel.select(timeout):
            raise RuntimeError(f"process {proc.pid} printed nothing within {timeout}s")
    finally:
        sel.close()
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"process {proc.pid} exited (status {proc.wait()})")
    return line.decode().strip() if isinstance(line, bytes) else line.strip()


REPO_ROOT = Path(__file__).resolve().parent.parent


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}


@dataclass
class LabRegion:
    url: str
    proc: subprocess.Popen
    log_path: Path

    def status(self, lab: Lab) -> dict:
        """The region cache's /-/status and the swarm service's /p2p/v1/status."""
        code = ("import sys,json,urllib.request\n"
                "u=sys.argv[1]\n"
                "print(json.dumps({'region': json.load(urllib.request.urlopen(u+'/-/status')),"
                " 'swarm': json.load(urllib.request.urlopen(u+'/p2p/v1/status'))}))\n")
        out = lab.run(lab.hub, [sys.executable, "-c", code, self.url], timeout=20)
        if out.returncode != 0:
            raise RuntimeError(f"region status: {out.stderr[-1000:]}")
        return json.loads(out.stdout)


def start_region(lab: Lab, workdir: Path, registry: LabRegistry, port: int = 5080,
                 piece_size: int | None = None, interval: int = 60) -> LabRegion:
    """The region cache with the swarm service mounted (p2p/region.py), in the hub."""
    store = workdir / "region"
    store.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "region.log"
    argv = [sys.executable, "-m", "p2p.region", "--listen", f"{HUB_IP}:{port}",
            "--origin", f"http://{registry.host}", "--store", str(store), "--interval", str(interval)]
    if piece_size:
        argv += ["--piece-size", str(piece_size)]
    with open(log_path, "ab") as log:
        proc = lab.popen(lab.hub, argv, stdout=subprocess.PIPE, stderr=log, cwd=REPO_ROOT, env=_env())
    line = read_line(proc, 30)
    if not line.startswith("ready"):
        raise RuntimeError(f"region: unexpected {line!r}")
    return LabRegion(f"http://{HUB_IP}:{port}", proc, log_path)


@dataclass
class LabAgent:
    """A p2p.agent process in a node namespace; call() sends one control request."""

    host: Host
    proc: subprocess.Popen
    control: str
    root: Path
    log_path: Path

    def call(self, request: dict, timeout: float = 120) -> dict:
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(self.control)
            sock.sendall(json.dumps(request).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                part = sock.recv(1 << 16)
                if not part:
                    raise RuntimeError(f"agent {self.host.ip}: connection closed")
                data += part
        answer = json.loads(data)
        if not answer.get("ok"):
            raise RuntimeError(f"agent {self.host.ip}: {request.get('op')}: {answer.get('error')}")
        return answer

    def stats(self) -> dict:
        return self.call({"op": "stats"}, timeout=30)["stats"]

    def wait_ready(self, timeout: float = 30) -> None:
        line = read_line(self.proc, timeout)
        if not line.startswith("ready"):
            raise RuntimeError(f"agent {self.host.ip}: unexpected {line!r}")

    def stop(self, lab: Lab, sig: int = signal.SIGTERM) -> None:
        lab.kill(self.proc, sig)


def spawn_agent(lab: Lab, host: Host, workdir: Path, region: LabRegion, swarm: dict | None = None,
                swarm_enabled: bool = True, verbose: bool = False) -> LabAgent:
    """Start a p2p.agent in the host's namespace; wait_ready() before using it."""
    root = workdir / host.ns
    root.mkdir(parents=True, exist_ok=True)
    control = str(root / "control.sock")
    config = {"region_url": region.url, "root": str(root),
              "swarm": {"enabled": swarm_enabled, "listen": f"{host.ip}:6881", "advertise_ip": host.ip,
                        **(swarm or {})}}
    log_path = root / "agent.log"
    argv = [sys.executable, "-m", "p2p.agent", "--root", str(root), "--control", control,
            "--config-json", json.dumps(config)]
    if verbose:
        argv.append("-v")
    with open(log_path, "ab") as log:
        proc = lab.popen(host, argv, stdout=subprocess.PIPE, stderr=log, cwd=REPO_ROOT, env=_env())
    return LabAgent(host, proc, control, root, log_path)


def start_agents(lab: Lab, hosts: list[Host], workdir: Path, region: LabRegion, **kwargs) -> list[LabAgent]:
    """One agent per host, started in parallel; returns when all serve."""
    agents = [spawn_agent(lab, host, workdir, region, **kwargs) for host in hosts]
    for agent in agents:
        agent.wait_ready()
    return agents


def start_agent(lab: Lab, host: Host, workdir: Path, region: LabRegion, **kwargs) -> LabAgent:
    return start_agents(lab, [host], workdir, region, **kwargs)[0]


def publish_blob(lab: Lab, registry: LabRegistry, region: LabRegion, repository: str, path: Path,
                 digest: str, timeout: float = 120) -> bytes:
    """Push the blob to the origin and wait until the region serves its torrent (the
    region fills the blob on the first metadata request); returns the .torrent file."""
    push_blob(lab, registry, repository, path, digest)
    code = ("import sys,time,urllib.request,urllib.error\n"
            "end=time.monotonic()+float(sys.argv[2])\n"
            "while True:\n"
            "    try:\n"
            "        sys.stdout.buffer.write(urllib.request.urlopen(sys.argv[1], timeout=10).read()); break\n"
            "    except urllib.error.HTTPError as e:\n"
            "        if e.code != 404 or time.monotonic() > end: raise\n"
            "        time.sleep(0.2)\n")
    url = f"{region.url}/p2p/v1/torrents/{digest}?repo={repository}&ns={registry.host}"
    proc = subprocess.run(["ip", "netns", "exec", lab.hub.ns, sys.executable, "-c", code, url, str(timeout)],
                          capture_output=True, timeout=timeout + 30, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"no torrent for {digest} from the region: {proc.stderr.decode()[-1000:]}")
    return proc.stdout
