"""A lab network of Linux network namespaces, for the swarm tests and benchmark (root).

    with Lab() as lab:
        hub = lab.hub                      # namespace with the bridge, 192.0.2.1
        n1 = lab.add_node(rate_mbit=200)   # its own namespace, 192.0.2.11, link capped both ways
        proc = lab.popen(n1, [python, "-m", "tests.lab.agent", ...])
        registry = start_registry(lab, workdir); region = start_region(lab, workdir, registry)
        [node] = start_nodes(lab, [n1], workdir, region, registry)   # `shoal node`, swarm on

Layout: one *hub* namespace holds a bridge (192.0.2.1/24) and one veth end per node;
each node namespace holds the other end (192.0.2.(10+i)/24) and its loopback. The
registry and region run in the hub. Addresses are from TEST-NET-1 (RFC 5737) and exist
only inside these namespaces: nothing is routed to or from the host's own network.
`tc tbf` on both ends of a node's veth caps its upload and its download.

Processes enter a namespace's network only (`nsenter --net`), not `ip netns exec`, which
also makes a mount namespace of its own: the FUSE mounts of a `shoal node` in the lab
must be visible to the test that reads them.

Everything the lab makes is named with a per-lab prefix and removed by close(): the
processes it started or adopted (a node's layer file system server, which runs in a
session of its own), by PID: SIGTERM, then SIGKILL; then every mount under the nodes'
roots; then the namespaces (which takes their veths and the bridge with them). close()
runs on exceptions too (context manager) and is idempotent.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from shoal.fsutil import mounts

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
    if shutil.which("nsenter") is None:
        return "nsenter is not installed (Debian package util-linux)"
    return None


def lab_missing(fuse: bool = False) -> str | None:
    """Why a lab with a registry (and, with `fuse`, FUSE mounts) cannot run here, or None."""
    reason = available()
    if reason:
        return reason
    if not os.access(REGISTRY_BIN, os.X_OK):
        return f"{REGISTRY_BIN} is not installed (Debian package docker-registry)"
    if fuse and not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
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


def mounts_under(*paths: Path | str) -> list[str]:
    """Mount points at or below any of `paths`, deepest first."""
    prefixes = [os.path.realpath(p) for p in paths]
    found = [point for point, _ in mounts()
             if any(point == p or point.startswith(p.rstrip("/") + "/") for p in prefixes)]
    return sorted(set(found), key=lambda p: (p.count("/"), len(p)), reverse=True)


def unmount_under(*paths: Path | str) -> list[str]:
    """Lazily unmount everything at or below `paths` (deepest first); returns what was
    still mounted afterwards (empty when all went)."""
    for _ in range(3):
        points = mounts_under(*paths)
        if not points:
            return []
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    return mounts_under(*paths)


def _netns(host: Host) -> list[str]:
    """The prefix that runs a command in the host's network namespace (and nothing else's)."""
    return ["nsenter", f"--net=/run/netns/{host.ns}", "--"]


def pids_naming(marker: str) -> set[int]:
    """The processes whose command line has `marker` as one argument (a node root: the
    layer file system server and holder of that root, whoever started them)."""
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and _process_has(int(name), marker):
            found.add(int(name))
    return found - {os.getpid()}


def _process_has(pid: int, marker: str) -> bool:
    """Whether process `pid` is still the one whose command line names `marker`."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return marker.encode() in fh.read().split(b"\0")
    except OSError:
        return False


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
    adopted: list[tuple[int, str]] = field(default_factory=list)  # (pid, a word of its command line)
    node_roots: list[Path] = field(default_factory=list)  # unmounted by close()

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

    def tx_bytes(self, host: Host) -> int:
        """Bytes the host's link has sent out so far (its device's tx counter: what went
        over its uplink, headers included; not what its processes wrote into sockets)."""
        out = subprocess.run(["ip", "-n", host.ns, "-s", "-j", "link", "show", "dev", host.dev],
                             check=True, capture_output=True, text=True).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start a process inside the host's network namespace (nsenter execs it: the
        PID is the process's own)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen([*_netns(host), *map(str, argv)], **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, host: Host, argv: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("text", True)
        return subprocess.run([*_netns(host), *map(str, argv)], capture_output=True,
                              timeout=timeout, check=False, **kwargs)

    def adopt(self, pid: int, marker: str) -> None:
        """Stop `pid` in close() too (if its command line still names `marker`)."""
        if (pid, marker) not in self.adopted:
            self.adopted.append((pid, marker))

    def stop_pid(self, pid: int, marker: str, sig: int = signal.SIGTERM, timeout: float = 10) -> None:
        """Signal a process the lab did not start (by PID, checked against `marker`) and
        wait until it is gone, SIGKILL after `timeout`."""
        deadline = time.monotonic() + timeout
        for s in (sig, signal.SIGKILL):
            if not _process_has(pid, marker):
                return
            try:
                os.kill(pid, s)
            except ProcessLookupError:
                return
            while _process_has(pid, marker) and time.monotonic() < deadline:
                time.sleep(0.05)
            deadline = time.monotonic() + 5

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
        # (after the nodes: a node's supervisor restarts a server it sees gone)
        for root in self.node_roots:  # a layer file system server (and holder) that started unseen
            for pid in fs_pids(root) | pids_naming(str(root)):
                self.adopt(pid, str(root))
        for pid, marker in self.adopted:
            self.stop_pid(pid, marker)
        self.adopted.clear()
        left = unmount_under(*self.node_roots)
        self.node_roots.clear()
        if left:
            print(f"netlab: still mounted after umount -l: {left}", file=sys.stderr)
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
    ca: str = ""  # its CA when it serves HTTPS (start_registry tls)

    def bytes_written(self, uri_contains: str = "", method: str = "GET") -> tuple[int, int]:
        """(requests, response bytes) the registry logged for matching requests."""
        n = total = 0
        for entry in registry_log(self.log_path):
            if entry.get("http.request.method") == method and uri_contains in entry.get("http.request.uri", ""):
                n += 1
                total += int(entry.get("http.response.written", 0))
        return n, total


def start_registry(lab: Lab, workdir: Path, port: int = 5000, auth: dict | None = None,
                   host: Host | None = None, storage: Path | None = None, tls: bool = False) -> LabRegistry:
    """docker-registry in the hub, or in `host` (a node namespace: behind its capped link);
    `auth`: its `auth` configuration (e.g. token), if any; `storage`: a registry storage
    folder to serve (images pushed there before), else an empty one in `workdir`; `tls`:
    HTTPS with a CA of its own (`.ca`), as registries are served."""
    host = host or lab.hub
    ca, https = "", {}
    if tls:
        from cache.region.tls import ensure_region_tls

        made = ensure_region_tls(str(workdir / "registry-tls"), host.ip)
        ca, https = made.ca, {"tls": {"certificate": made.cert, "key": made.key}}
    storage = storage or workdir / "registry"
    storage.mkdir(parents=True, exist_ok=True)
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "registry.yml"
    config.write_text(json.dumps({
        "version": 0.1,
        "log": {"level": "info", "formatter": "json", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}},
        "http": {"addr": f"{host.ip}:{port}", "secret": os.urandom(16).hex(), **https},
        **({"auth": auth} if auth else {}),
    }))
    log_path = workdir / "registry.log"
    with open(log_path, "wb") as log:
        proc = lab.popen(host, [REGISTRY_BIN, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT)
    reg = LabRegistry(f"{host.ip}:{port}", log_path, proc, ca)
    wait_http(lab, host, f"{'https' if tls else 'http'}://{reg.host}/v2/", proc, ca=ca)
    return reg


def wait_http(lab: Lab, host: Host, url: str, proc: subprocess.Popen, timeout: float = 20, ca: str = "") -> None:
    code = ("import ssl,sys,urllib.request,urllib.error\n"
            "ctx = ssl.create_default_context(cafile=sys.argv[2]) if sys.argv[2] else None\n"
            "try: urllib.request.urlopen(sys.argv[1], timeout=1, context=ctx)\n"
            "except urllib.error.HTTPError: pass\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with status {proc.returncode}")
        if lab.run(host, [sys.executable, "-c", code, url, ca], timeout=10).returncode == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {timeout}s")


# urllib from inside a namespace: argv[1] a CA file ("" = none), argv[2] request headers
# (JSON), then its own arguments; defines get(url) -> response
_GET = ("import sys,json,ssl,urllib.request\n"
        "ca,headers=sys.argv[1],json.loads(sys.argv[2])\n"
        "ctx=ssl.create_default_context(cafile=ca) if ca else None\n"
        "def get(u):\n"
        "    return urllib.request.urlopen(urllib.request.Request(u, headers=headers), timeout=10, context=ctx)\n")


def _headers(token: str = "", authorization: str = "") -> str:
    from p2p.tracker import TOKEN_HEADER

    return json.dumps({**({TOKEN_HEADER: token} if token else {}),
                       **({"Authorization": authorization} if authorization else {})})


def http_get(lab: Lab, host: Host, *urls: str, timeout: float = 30, ca: str = "", token: str = "") -> list[str]:
    """The bodies (text) of GET `urls`, fetched from inside the host's namespace
    (trusting `ca`, with the node token `token` if given)."""
    code = _GET + "print(json.dumps([get(u).read().decode() for u in sys.argv[3:]]))\n"
    out = lab.run(host, [sys.executable, "-c", code, ca, _headers(token), *urls], timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"GET {' '.join(urls)} in {host.ns}: {out.stderr[-1000:]}")
    return json.loads(out.stdout)


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


REPO_ROOT = Path(__file__).resolve().parents[2]
SHOAL = str(Path(sys.executable).parent / "shoal")  # .venv/bin/shoal


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONUNBUFFERED": "1"}


def _shoal(lab: Lab, argv: list[str], host: Host | None = None, timeout: float = 300) -> str:
    """Run a short `shoal ...` command (in the hub unless `host`); its stdout."""
    proc = lab.run(host or lab.hub, [SHOAL, *argv], timeout=timeout, cwd=REPO_ROOT, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"shoal {' '.join(map(str, argv))}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def push_blob(lab: Lab, registry: LabRegistry, repository: str, path: Path, digest: str) -> None:
    """Upload a file as a blob of `repository` (from inside the hub)."""
    code = ("import sys, os\n"
            "from builder.oci.refs import DockerRef\n"
            "from builder.oci.registry import RegistryDestination\n"
            "d = RegistryDestination(DockerRef(sys.argv[1], sys.argv[2], tag='x'), plain_http=True)\n"
            "d.put_blob(sys.argv[3], sys.argv[4], os.path.getsize(sys.argv[3])); d.close()\n")
    proc = lab.run(lab.hub, [sys.executable, "-c", code, registry.host, repository, str(path), digest],
                   timeout=300, cwd=REPO_ROOT, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"push of {digest} failed: {proc.stderr[-2000:]}")


# --- the region ---------------------------------------------------------------------------------


@dataclass
class LabRegion:
    """`shoal region` in the hub (cache, tracker and torrent metadata)."""

    url: str
    proc: subprocess.Popen
    log_path: Path
    ca: str = ""  # the region's own CA certificate (nodes pin it); "" over plain HTTP
    token_file: str = ""  # the node token nodes present to /p2p/v1

    @property
    def token(self) -> str:
        return Path(self.token_file).read_text().strip() if self.token_file else ""

    def fetch_config(self) -> dict:
        """A node's [fetch] keys for this region."""
        out = {"region_url": self.url, "region_token_file": self.token_file}
        if self.ca:
            out["region_ca"] = self.ca
        return out

    def status(self, lab: Lab) -> dict:
        """The region cache's /-/status and the swarm service's /p2p/v1/status."""
        region, swarm = http_get(lab, lab.hub, self.url + "/-/status", self.url + "/p2p/v1/status",
                                 ca=self.ca, token=self.token)
        return {"region": json.loads(region), "swarm": json.loads(swarm)}

    def metrics(self, lab: Lab) -> str:
        return http_get(lab, lab.hub, self.url + "/-/metrics", ca=self.ca)[0]


def start_region(lab: Lab, workdir: Path, registry: LabRegistry, port: int = 5080,
                 config: str = "") -> LabRegion:
    """`shoal region` (cache + swarm service) in the hub, over HTTPS with the CA and the
    node token it makes at first start (in its store); `config`: its TOML, if any."""
    store = workdir / "region"
    store.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "region.log"
    argv = [SHOAL, "-v", "region", "--listen", f"{HUB_IP}:{port}", "--origin",
            f"{'https' if registry.ca else 'http'}://{registry.host}", "--store", str(store)]
    if config:
        (workdir / "region.toml").write_text(config)
        argv += ["--config", str(workdir / "region.toml")]
    with open(log_path, "ab") as log:
        proc = lab.popen(lab.hub, argv, stdout=subprocess.PIPE, stderr=log, cwd=REPO_ROOT,
                         env={**_env(), **({"SSL_CERT_FILE": registry.ca} if registry.ca else {})})
    line = read_line(proc, 30)
    if not line.startswith("shoal region: serving"):
        raise RuntimeError(f"region: unexpected {line!r}")
    scheme = line.split(" on ", 1)[1].split("://", 1)[0]
    tls = store / "tls"
    return LabRegion(f"{scheme}://{HUB_IP}:{port}", proc, log_path, str(tls / "ca.pem") if scheme == "https" else "",
                     str(tls / "node-token"))


def wait_torrent(lab: Lab, region: LabRegion, registry: LabRegistry, repository: str, digest: str,
                 timeout: float = 120, authorization: str = "") -> bytes:
    """The blob's .torrent from the region, once made (the region fills the blob from the
    origin on the first metadata request and answers 404 meanwhile); `authorization`:
    registry credentials for a private repository."""
    code = _GET + ("import time,urllib.error\n"
                   "end=time.monotonic()+float(sys.argv[4])\n"
                   "while True:\n"
                   "    try:\n"
                   "        sys.stdout.buffer.write(get(sys.argv[3]).read()); break\n"
                   "    except urllib.error.HTTPError as e:\n"
                   "        if e.code != 404 or time.monotonic() > end: raise\n"
                   "        time.sleep(0.2)\n")
    url = f"{region.url}/p2p/v1/torrents/{digest}?repo={repository}&ns={registry.host}"
    proc = lab.run(lab.hub, [sys.executable, "-c", code, region.ca, _headers(region.token, authorization), url,
                             str(timeout)],
                   timeout=timeout + 30, text=False)
    if proc.returncode != 0:
        raise RuntimeError(f"no torrent for {digest} from the region: {proc.stderr.decode()[-1000:]}")
    return proc.stdout


def publish_blob(lab: Lab, registry: LabRegistry, region: LabRegion, repository: str, path: Path,
                 digest: str, timeout: float = 120) -> bytes:
    """Push the blob to the origin and wait until the region serves its torrent; returns
    the .torrent file."""
    push_blob(lab, registry, repository, path, digest)
    return wait_torrent(lab, region, registry, repository, digest, timeout)


@dataclass
class LabImage:
    """An image in the lab's registry: `name` HOST/REPO:TAG, its manifest's layers (with
    the zstd:chunked annotations), diff_ids, and each layer's .torrent from the region."""

    name: str
    manifest_digest: str
    layers: list[dict]
    diff_ids: list[str]
    torrents: dict[str, bytes] = field(default_factory=dict)

    @property
    def repository(self) -> str:
        return self.name.split("/", 1)[1].rsplit(":", 1)[0]


def publish_image(lab: Lab, registry: LabRegistry, region: LabRegion, layout: Path, name: str,
                  timeout: float = 120, authorization: str = "") -> LabImage:
    """push_image, then wait until the region serves the torrent of every layer and holds
    the layer (the torrent may come from the layer's published piece hashes first)."""
    image = push_image(lab, registry, layout, name)
    for layer in image.layers:
        image.torrents[layer["digest"]] = wait_torrent(lab, region, registry, image.repository, layer["digest"],
                                                       timeout, authorization)
        fill_region(lab, region, registry, image.repository, layer["digest"], timeout, authorization)
    return image


def fill_region(lab: Lab, region: LabRegion, registry: LabRegistry, repository: str, digest: str,
                timeout: float = 120, authorization: str = "") -> None:
    """Read the whole blob through the region, then wait until its fill is committed (the
    region's status lists it as filling no more)."""
    code = _GET + ("import time\n"
                   "r=get(sys.argv[3])\n"
                   "while r.read(1 << 20): pass\n"
                   "end=time.monotonic()+float(sys.argv[6])\n"
                   "while sys.argv[5] in json.loads(get(sys.argv[4]).read()).get('filling', {}):\n"
                   "    if time.monotonic() > end: raise SystemExit('the fill of ' + sys.argv[5] + ' never ended')\n"
                   "    time.sleep(0.1)\n")
    url = f"{region.url}/v2/{repository}/blobs/{digest}?ns={registry.host}"
    proc = lab.run(lab.hub, [sys.executable, "-c", code, region.ca, _headers(region.token, authorization), url,
                             f"{region.url}/-/status", digest, str(timeout)], timeout=timeout + 60)
    if proc.returncode != 0:
        raise RuntimeError(f"the region did not fill {digest}: {proc.stderr[-1000:]}")


def push_image(lab: Lab, registry: LabRegistry, layout: Path, name: str) -> LabImage:
    """Copy an OCI layout's image (converted already: its layers pass through) to the
    origin as REGISTRY/`name` with `shoal convert` (the region does not know it yet)."""
    ref = f"{registry.host}/{name}"
    summary = json.loads(_shoal(lab, ["convert", f"oci:{layout}", f"docker://{ref}", "--plain-http", "--json"]))
    image = layout_image(layout, ref)
    if summary["digest"] != image.manifest_digest:
        raise RuntimeError(f"{ref}: pushed {summary['digest']}, the layout holds {image.manifest_digest}")
    return image


def push_unchanged(lab: Lab, registry: LabRegistry, layout: Path, tag: str, repository: str) -> LabImage:
    """Copy the image tagged `tag` in an OCI layout to the origin as it is (a gzip image
    stays gzip: nodes unpack its layers), from inside the hub."""
    code = ("import sys\n"
            "from tests.torchimage import push\n"
            "push(sys.argv[1], sys.argv[2], sys.argv[3], repo=sys.argv[4])\n")
    proc = lab.run(lab.hub, [sys.executable, "-c", code, str(layout), tag, registry.host, repository], timeout=300,
                   cwd=REPO_ROOT, env=_env())
    if proc.returncode != 0:
        raise RuntimeError(f"push of {layout}:{tag} failed: {proc.stderr[-2000:]}")
    return layout_image(layout, f"{registry.host}/{repository}:{tag}")


def layout_image(layout: Path, ref: str) -> LabImage:
    """The LabImage `ref` of the image in an OCI layout (pushed there unchanged)."""
    from builder.oci.refs import open_source

    with open_source(f"oci:{layout}") as src:
        root = src.get_root()
        doc = json.loads(root.data)
        with src.open_blob(doc["config"]["digest"], doc["config"]["size"]) as stream:
            diff_ids = json.loads(stream.read())["rootfs"]["diff_ids"]
    return LabImage(ref, root.digest, doc["layers"], diff_ids)


def parallel(fn, items) -> list:
    """fn(item) for every item, each on a thread of its own, all at once; the results in
    order; the first exception raised again."""
    import threading

    results: list = [None] * len(items)
    errors: list = []

    def run(i, item):
        try:
            results[i] = fn(item)
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i, item)) for i, item in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def sha256_file(path: Path | str) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while data := fh.read(1 << 20):
            h.update(data)
    return h.hexdigest()


# --- nodes -----------------------------------------------------------------------------------


def fs_server_pid(root: Path | str) -> int | None:
    """The PID of the layer file system server of a node root, if it answers."""
    from shoal.errors import ShoalError
    from snapshotter.fs.client import FSClient

    try:
        return FSClient(str(root)).ping(timeout=2)["pid"]
    except (OSError, ValueError, KeyError, ShoalError):
        return None


def fs_pids(root: Path | str) -> set[int]:
    """The PIDs of a node root's layer file system: its server and the holder of its FUSE
    session (snapshotter/fs/holder.py), those that answer."""
    from snapshotter.fs import holder

    held = holder.ping(str(root))
    return {pid for pid in (fs_server_pid(root), held and int(held["pid"])) if pid}


def _toml(tables: dict[str, dict]) -> str:
    """TOML of {table: {key: str | int | float | bool | list[str]}} (JSON strings are TOML strings)."""
    lines = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


@dataclass
class LabNode:
    """A `shoal node` in a node namespace (start_nodes): its gRPC socket, root (the layer
    file system mounts at ROOT/mnt/<hex>), control socket (ROOT/fs.sock) and figures."""

    host: Host
    proc: subprocess.Popen
    dir: Path
    metrics_address: str = ""

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def socket(self) -> Path:
        return self.dir / "s.sock"

    def log(self, size: int = 3000) -> str:
        out = []
        for path in (self.dir / "node.log", self.root / "logs" / "fs.log"):
            try:
                out.append(f"--- {path}\n" + path.read_text(errors="replace")[-size:])
            except OSError:
                pass
        return "\n".join(out)

    def provide(self, lab: Lab, image: LabImage) -> list[Path]:
        """Prepare the image's layers through the node's Snapshots API (what containerd's
        unpacker or `shoal pull` sends); the lazy layers' mount points."""
        from tests.lab.provide import provide_layers

        layers = provide_layers(str(self.socket), image.name, image.manifest_digest, image.layers,
                                image.diff_ids)  # plain HTTP: the node's plain_http_hosts
        for pid in fs_pids(self.root):
            lab.adopt(pid, str(self.root))
        return [self.layer_dir(ly.digest) for ly in layers if ly.kind == "lazy"]

    def layer_dir(self, digest: str) -> Path:
        return self.root / "mnt" / digest.split(":", 1)[1]

    def status(self) -> dict:
        """`shoal status --root ROOT --json` (over the layer file system's socket)."""
        out = subprocess.run([SHOAL, "status", "--root", str(self.root), "--json"], capture_output=True,
                             text=True, timeout=90, check=False, env=_env())
        if out.returncode != 0:
            raise RuntimeError(f"shoal status of {self.host.ip}: {out.stderr[-1000:]}")
        return json.loads(out.stdout)

    def download(self, digest: str, timeout: float = 120) -> str:
        """Bulk: the whole layer blob through the swarm (the node's control socket); the
        complete file's path."""
        from snapshotter.fs.client import FSClient

        return FSClient(str(self.root)).download(digest, timeout)["path"]

    def metrics(self, lab: Lab) -> str:
        return http_get(lab, self.host, f"http://{self.metrics_address}/metrics")[0]

    def stop(self, lab: Lab, sig: int = signal.SIGTERM) -> None:
        """Stop the layer file system server (the swarm's process), the holder of its FUSE
        session and the node, by PID. SIGKILL kills them all as a crashed machine would,
        and leaves a dead FUSE mount behind (unmount())."""
        root = str(self.root)
        pids = {p for p, marker in lab.adopted if marker == root} | fs_pids(root)
        lab.kill(self.proc, sig)  # first: its supervisor would start a server again after the one stopped
        for pid in (pids | pids_naming(root)) - {None}:  # (and one it was starting)
            lab.stop_pid(pid, root, sig)

    def unmount(self) -> list[str]:
        return unmount_under(self.root)


def stop_nodes(lab: Lab, nodes: list[LabNode], sig: int = signal.SIGTERM) -> None:
    """LabNode.stop on every node at once (each takes a second or two: the layer file system
    server unmounts and its swarm sends its last announces first)."""
    parallel(lambda node: node.stop(lab, sig), nodes)


def start_nodes(lab: Lab, hosts: list[Host], workdir: Path, region: LabRegion, registry: LabRegistry,
                swarm: dict | None = None, metrics: bool = False, timeout: float = 30,
                env: dict | None = None, fetch: dict | None = None,
                tables: Callable[[Path], dict[str, dict]] | None = None) -> list[LabNode]:
    """One `shoal node` per host (the swarm on, listening on the host's address; the
    region and origin in the hub), started at once; returns when all answer. `workdir`
    must be short: unix socket paths live in it. `env`: more environment (e.g. a
    DOCKER_CONFIG of the nodes' own); `fetch`: [fetch] keys over the region's; `tables`:
    more configuration tables, a function of the node's folder (e.g. its [containerd])."""
    nodes = []
    for host in hosts:
        d = workdir / host.ns
        d.mkdir(parents=True)
        config = {
            "fetch": {**region.fetch_config(), "plain_http_hosts": [registry.host], **(fetch or {})},
            "swarm": {"enabled": True, "listen": f"{host.ip}:6881", "advertise_ip": host.ip, **(swarm or {})},
            "node": {"name": host.ns},  # (one host name for all: the namespaces share the UTS one)
            **(tables(d) if tables else {}),
        }
        metrics_address = ""
        if metrics:
            metrics_address = f"{host.ip}:9464"
            config["metrics"] = {"address": metrics_address}
        (d / "node.toml").write_text(_toml(config))
        lab.node_roots.append(d / "root")
        with open(d / "node.log", "ab") as log:
            proc = lab.popen(host, [SHOAL, "-v", "node", "--root", d / "root", "--socket", d / "s.sock",
                                    "--config", d / "node.toml"], stdout=log, stderr=subprocess.STDOUT,
                             cwd=REPO_ROOT, env={**_env(), **(env or {})})
        nodes.append(LabNode(host, proc, d, metrics_address))
    deadline = time.monotonic() + timeout
    for node in nodes:
        while True:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(str(node.socket))
                    break
                except OSError:
                    pass
            if node.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"shoal node in {node.host.ns} did not start:\n{node.log()}")
            time.sleep(0.05)
    return nodes


# --- agents (the benchmark) --------------------------------------------------------------------


@dataclass
class LabAgent:
    """A tests.lab.agent process in a node namespace; call() sends one control request."""

    host: Host
    proc: subprocess.Popen
    control: str
    root: Path
    log_path: Path

    def call(self, request: dict, timeout: float = 120) -> dict:
        from shoal.errors import ShoalError
        from shoal.localrpc import call

        try:
            return call(self.control, request, timeout)
        except ShoalError as exc:
            raise RuntimeError(f"agent {self.host.ip}: {exc}") from None

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
    """Start a tests.lab.agent in the host's namespace; wait_ready() before using it."""
    root = workdir / host.ns
    root.mkdir(parents=True, exist_ok=True)
    control = str(root / "control.sock")
    config = {**region.fetch_config(), "root": str(root),
              "swarm": {"enabled": swarm_enabled, "listen": f"{host.ip}:6881", "advertise_ip": host.ip,
                        **(swarm or {})}}
    log_path = root / "agent.log"
    argv = [sys.executable, "-m", "tests.lab.agent", "--root", str(root), "--control", control,
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
