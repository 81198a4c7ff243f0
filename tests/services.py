"""Real services for tests, the demo and the benchmarks: Debian's docker-registry on
loopback and Debian's containerd on a private unix socket. Every process is stopped by
its PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from snapshotter.embedded import containerd_config, shim_pids, stop_process
from tests.lab.netlab import mounts_under, registry_log, unmount_under  # noqa: F401 (used by other tests)

REGISTRY_BIN = "/usr/bin/docker-registry"
START_TIMEOUT = 60.0  # a deadline, not a measure: a loaded CI machine once saw containerd boot and not answer `ctr version` within 20 s
STOP_TIMEOUT = 5.0


# --- the registry process ----------------------------------------------------------


@dataclass
class LoggedRequest:
    method: str
    uri: str
    status: int
    written: int


@dataclass
class RegistryServer:
    """A running docker-registry: `.host` ("127.0.0.1:PORT"), `.url`, `.log_path`."""

    host: str
    url: str
    log_path: Path
    storage: Path
    pid: int
    username: str | None = None
    password: str | None = None
    token_server: object = None  # the TokenServer, for token-auth registries
    _proc: subprocess.Popen | None = field(default=None, repr=False)

    def requests(self) -> list[LoggedRequest]:
        """Every request the registry answered before this call, in order (settle first:
        the log line of a request comes after its response)."""
        self.settle()
        return [
            LoggedRequest(
                method=entry["http.request.method"],
                uri=entry.get("http.request.uri", ""),
                status=int(entry["http.response.status"]),
                written=int(entry.get("http.response.written", 0)),
            )
            for entry in registry_log(self.log_path)
            if _SETTLE_MARK not in entry.get("http.request.uri", "")  # (settle()'s own requests)
        ]

    def count(self, method: str | None = None, uri_contains: str = "") -> tuple[int, int]:
        """(number of requests, response bytes written) matching method and URI part."""
        hits = [
            r for r in self.requests()
            if (method is None or r.method == method) and uri_contains in r.uri
        ]
        return len(hits), sum(r.written for r in hits)

    def settle(self, timeout: float = 10.0) -> None:
        """Wait until every request answered before this call is in the log: the registry
        logs a request after its response went out, so a client can have every byte before
        the line is written. A marker request, logged after those, shows they are, once
        the log has then been still for SETTLE_QUIET (a response on another connection can
        be logged after the marker: a 15 MB blob's line came 22 ms after it, in a CI run);
        not for a registry that is not running (stopped by a test, or gone)."""
        if not _running(self.pid):
            return
        marker = _SETTLE_MARK + secrets.token_hex(8)
        with contextlib.suppress(urllib.error.URLError, OSError):
            urllib.request.urlopen(f"{self.url}/v2/?{marker}", timeout=timeout).close()
        deadline = time.monotonic() + timeout
        # the access log's line of the marker, written after its answer whatever it was (an
        # auth registry answers 401 and logs no JSON completion line for it)
        done = f"GET /v2/?{marker} HTTP/"
        while done not in self.log_path.read_text(errors="replace"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the registry did not log the marker request {marker} in {timeout:.0f}s")
            time.sleep(0.02)
        size, still = self.log_path.stat().st_size, time.monotonic()
        busy_until = still + 1.0  # (a registry serving others meanwhile is never still: not past this)
        while time.monotonic() - still < SETTLE_QUIET and time.monotonic() < busy_until:
            time.sleep(0.02)
            if (now := self.log_path.stat().st_size) != size:
                size, still = now, time.monotonic()

    def layer_bytes(self, manifest: dict) -> int:
        """Bytes served so far of the layer blobs of `manifest` (a parsed image manifest)."""
        requests = self.requests()
        return sum(r.written for r in requests for ly in manifest["layers"]
                   if r.method == "GET" and ly["digest"] in r.uri)

    def stop(self) -> None:
        stop_process(self._proc)


_SETTLE_MARK = "shoal-settle="
SETTLE_QUIET = 0.15  # seconds the registry's log stays unchanged after settle()'s marker


def _running(pid: int) -> bool:
    """Process `pid` exists and is neither stopped (SIGSTOP), nor a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("T", "t", "Z", "X")
    except (OSError, IndexError):
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_region(origin_url: str, store: Path, log_path: Path, config: str = "",
                 port: int = 0) -> tuple[subprocess.Popen, str, str]:
    """`shoal region` in front of `origin_url` on a free loopback port (or `port`), answering:
    (its process, its https URL, the CA file it made at first start, which nodes pin). The
    caller stops it (stop_process) and closes its stdout. `config`: TOML for its --config."""
    port = port or free_port()
    extra = []
    if config:
        path = log_path.with_suffix(".toml")
        path.write_text(config)
        extra = ["--config", str(path)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "region", "--listen", f"127.0.0.1:{port}", "--origin", origin_url,
             "--store", str(store), *extra],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
        )
    if "serving" not in proc.stdout.readline().decode():
        stop_process(proc)
        proc.stdout.close()
        raise RuntimeError(f"shoal region did not start; log:\n{log_path.read_text(errors='replace')[-2000:]}")
    return proc, f"https://127.0.0.1:{port}", str(store / "tls" / "ca.pem")


def _answers(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        opener.open(url + "/v2/", timeout=1).close()
        return True
    except urllib.error.HTTPError:
        return True  # 401 from an auth registry still means it is up
    except OSError:
        return False


def _registry_config(storage: Path, port: int, auth: dict | None) -> str:
    config = {
        "version": 0.1,
        "log": {"level": "info", "formatter": "json", "accesslog": {"disabled": False}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": secrets.token_hex(16)},
    }
    if auth:
        config["auth"] = auth
    return json.dumps(config)  # JSON is YAML


def start_registry(workdir: Path, auth: dict | None) -> RegistryServer:
    """Start one registry on a free port; retries on a port taken meanwhile."""
    for _ in range(3):
        port = free_port()
        storage = workdir / "storage"
        storage.mkdir(exist_ok=True)
        config_path = workdir / "config.yml"
        config_path.write_text(_registry_config(storage, port, auth))
        log_path = workdir / "registry.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [REGISTRY_BIN, "serve", str(config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        server = RegistryServer(
            host=f"127.0.0.1:{port}", url=f"http://127.0.0.1:{port}", log_path=log_path,
            storage=storage, pid=proc.pid, _proc=proc,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while proc.poll() is None and time.monotonic() < deadline:
                if _answers(server.url):
                    return server
                time.sleep(0.05)
        except BaseException:
            stop_process(proc)
            raise
        stop_process(proc)
        if "address already in use" not in log_path.read_text(errors="replace"):
            break
    tail = log_path.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"docker-registry did not start; log:\n{tail}")


# --- mounts ---------------------------------------------------------------------------


def missing_dirs(*paths: Path | str) -> list[Path]:
    """Those of `paths` that do not exist yet (to remove them later if left empty)."""
    return [Path(p) for p in paths if not os.path.lexists(p)]


def remove_empty_dirs(paths: list[Path]) -> None:
    """rmdir each of `paths` (deepest first) that exists and is empty; never recursive."""
    for p in sorted(paths, key=lambda p: len(p.parts), reverse=True):
        try:
            p.rmdir()
        except OSError:
            pass


# --- containerd ------------------------------------------------------------------------

# containerd 1.6 keeps shim sockets in /run/containerd/s whatever its configuration says.
_CONTAINERD_RUN_DIRS = ("/run/containerd/s", "/run/containerd/fifo", "/run/containerd/runc", "/run/containerd")

CONTAINERD_BIN = "/usr/bin/containerd"
CTR_BIN = "/usr/bin/ctr"
CTR_NAMESPACE = "shoal-test"
# sun_path is 108 bytes with its NUL; containerd also listens on ADDRESS + ".ttrpc".
_MAX_SOCKET_PATH = 100


class CtrError(RuntimeError):
    """A `ctr` command failed; the message carries its command line and stderr."""

    def __init__(self, proc: subprocess.CompletedProcess) -> None:
        self.proc = proc
        args = " ".join(str(a) for a in proc.args)
        super().__init__(f"{args}: exit status {proc.returncode}\n{(proc.stderr or '')[-3000:]}")


@dataclass
class ContainerdServer:
    """A running containerd with its own root, state and gRPC socket (`.address`).

    `.ctr(...)` runs `ctr --address SOCK --namespace shoal-test ...`;
    `.run(image, id, *command)` runs a container to completion with runc's state and
    the IO FIFOs kept inside the work directory. `.stop()` stops everything it started.
    """

    address: str
    workdir: Path
    root: Path
    state: Path
    config_path: Path
    log_path: Path
    pid: int
    runc_root: Path
    fifo_dir: Path
    socket_dir: Path | None = None  # a short directory of our own, when workdir is too deep
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _created_run_dirs: list[Path] = field(default_factory=list, repr=False)

    def ctr(
        self, *args: str, check: bool = True, namespace: str = CTR_NAMESPACE, timeout: float = 120,
    ) -> subprocess.CompletedProcess:
        args = tuple(map(str, args))
        if args[:1] == ("run",) and "--runc-root" not in args:
            # runc's state and the IO FIFOs inside the work directory: containerd's defaults
            # (/run/containerd/runc/NAMESPACE) are shared with every other containerd here
            args = ("run", "--runc-root", str(self.runc_root), "--fifo-dir", str(self.fifo_dir), *args[1:])
        cmd = [CTR_BIN, "--address", self.address, "--namespace", namespace, *args]
        proc = subprocess.run(
            cmd, check=False, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
            encoding="utf-8", errors="surrogateescape",
        )
        if check and proc.returncode != 0:
            raise CtrError(proc)
        return proc

    def run(
        self, image: str, container_id: str, *command: str, namespace: str = CTR_NAMESPACE,
        check: bool = True, timeout: float = 120,
    ) -> subprocess.CompletedProcess:
        """`ctr run --rm IMAGE ID [COMMAND...]` (runc state and FIFOs under workdir)."""
        return self.ctr(
            "run", "--rm", "--runc-root", str(self.runc_root), "--fifo-dir", str(self.fifo_dir),
            image, container_id, *command, namespace=namespace, check=check, timeout=timeout,
        )

    def log_tail(self, size: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-size:]
        except OSError:
            return ""

    def restart(self) -> None:
        """Start containerd again on its configuration file as it is now (what a service
        manager does on `restart`), once the running one has exited (stopped if not)."""
        if self._proc is not None:
            try:
                self._proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                stop_process(self._proc)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [CONTAINERD_BIN, "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        self.pid = self._proc.pid
        deadline = time.monotonic() + START_TIMEOUT
        while self._proc.poll() is None and time.monotonic() < deadline:
            if os.path.exists(self.address) and self.ctr("version", check=False, timeout=5).returncode == 0:
                return
            time.sleep(0.05)
        raise RuntimeError(f"containerd did not restart (exit status {self._proc.poll()}); log:\n{self.log_tail()}")

    def _kill_tasks(self) -> None:
        """Kill and delete every task and container (so no container outlives us)."""
        try:
            namespaces = self.ctr("namespaces", "ls", "-q", timeout=10).stdout.split()
        except (CtrError, subprocess.TimeoutExpired, OSError):
            return
        for ns in namespaces:
            try:
                tasks = self.ctr("tasks", "ls", "-q", namespace=ns, timeout=10).stdout.split()
                for task in tasks:
                    self.ctr("tasks", "kill", "-a", "-s", "SIGKILL", task, namespace=ns, check=False, timeout=10)
                for task in tasks:
                    for _ in range(50):
                        if self.ctr("tasks", "rm", "-f", task, namespace=ns, check=False, timeout=10).returncode == 0:
                            break
                        time.sleep(0.1)
                containers = self.ctr("containers", "ls", "-q", namespace=ns, timeout=10).stdout.split()
                for cid in containers:
                    self.ctr("containers", "rm", cid, namespace=ns, check=False, timeout=10)
            except (CtrError, subprocess.TimeoutExpired, OSError):
                continue

    def stop(self) -> None:
        """Stop containers, containerd (by PID, killed after a timeout) and its shims,
        unmount whatever is left under its directories, and remove them."""
        if self._proc is not None and self._proc.poll() is None:
            self._kill_tasks()
        stop_process(self._proc)
        for pid in shim_pids(self.address):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        dirs = [self.root, self.state, self.runc_root, self.fifo_dir]
        if self.socket_dir is not None:
            dirs.append(self.socket_dir)
        left = unmount_under(*dirs)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
        remove_empty_dirs(self._created_run_dirs)
        if left:
            raise RuntimeError(f"containerd: still mounted after umount -l: {left}")


def _q(value: object) -> str:
    return json.dumps(str(value))  # a TOML basic string is a JSON string


def cri_config(snapshotter: str, registries: list[str], sandbox_image: str, cni_dir: Path) -> str:
    """The CRI plugin's table for a test containerd: pods on `snapshotter` with the
    remote-snapshot labels (disable_snapshot_annotations = false), plain-HTTP mirrors for
    the loopback `registries`, restrict_oom_score_adj (root here lacks CAP_SYS_RESOURCE:
    see /work/shared/notes/libraries.md), its stream server on loopback, and empty CNI
    folders of its own (pods use the host network). Its state and root are containerd's,
    inside the test's directories. `snapshotter` "": containerd's defaults (overlayfs, no
    labels), what `shoal install containerd` then edits."""
    cri = '[plugins."io.containerd.grpc.v1.cri"]'
    lines = [
        cri,
        f"  sandbox_image = {_q(sandbox_image)}",
        "  restrict_oom_score_adj = true",
        '  stream_server_address = "127.0.0.1"',
        '  stream_server_port = "0"',
        "  enable_selinux = false",
        f"{cri[:-1]}.containerd]",
        *([f"  snapshotter = {_q(snapshotter)}", "  disable_snapshot_annotations = false"] if snapshotter else
          ['  default_runtime_name = "runc"', f"{cri[:-1]}.containerd.runtimes.runc]",
           '  runtime_type = "io.containerd.runc.v2"', f"{cri[:-1]}.containerd.runtimes.runc.options]",
           "  SystemdCgroup = false"]),
        f"{cri[:-1]}.cni]",
        f"  bin_dir = {_q(cni_dir / 'bin')}",
        f"  conf_dir = {_q(cni_dir / 'conf')}",
    ]
    for host in registries:
        lines += [f'{cri[:-1]}.registry.mirrors."{host}"]', f'  endpoint = ["http://{host}"]']
    return "\n".join(lines) + "\n"


def start_containerd(workdir: Path | str, extra_config: str = "", cri: str | None = None,
                     edit_config=None) -> ContainerdServer:
    """Start /usr/bin/containerd with root, state and socket inside `workdir` (or, when
    that path is too long for a unix socket, a short private directory under /tmp).
    `extra_config` is appended to its TOML (e.g. a `[proxy_plugins.shoal]` table).
    `cri`: the CRI plugin's configuration (cri_config()); the plugin is disabled without
    it. With it, the CRI v1 API is served on the same socket (tests/cri.py).
    `edit_config(path)`: called on the written file before containerd starts (what an
    installer does to a node's file)."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    root, state = workdir / "root", workdir / "state"
    runc_root, fifo_dir = workdir / "runc", workdir / "fifo"
    for d in (root, state, runc_root, fifo_dir):
        d.mkdir(exist_ok=True)
    socket_dir = None
    address = str(workdir / "containerd.sock")
    if len(address) + len(".ttrpc") > _MAX_SOCKET_PATH:
        socket_dir = Path(tempfile.mkdtemp(prefix="shoal-ctd-", dir="/tmp"))
        address = str(socket_dir / "c.sock")
    config_path = workdir / "containerd.toml"
    config_path.write_text(containerd_config(str(root), str(state), address, extra_config + "\n" + (cri or ""),
                                             cri=cri is not None))
    if edit_config is not None:
        edit_config(config_path)
    created_run_dirs = missing_dirs(*_CONTAINERD_RUN_DIRS)
    log_path = workdir / "containerd.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [CONTAINERD_BIN, "--config", str(config_path)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
    server = ContainerdServer(
        address=address, workdir=workdir, root=root, state=state, config_path=config_path,
        log_path=log_path, pid=proc.pid, runc_root=runc_root, fifo_dir=fifo_dir,
        socket_dir=socket_dir, _proc=proc, _created_run_dirs=created_run_dirs,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while proc.poll() is None and time.monotonic() < deadline:
            if os.path.exists(address):
                try:
                    if server.ctr("version", check=False, timeout=5).returncode == 0:
                        return server
                except subprocess.TimeoutExpired:
                    pass
            time.sleep(0.05)
    except BaseException:
        server.stop()
        raise
    tail = server.log_tail()
    server.stop()
    raise RuntimeError(f"containerd did not start (exit status {proc.poll()}); log:\n{tail}")


# --- shoal node ----------------------------------------------------------------------

SHOAL = str(Path(sys.executable).parent / "shoal")  # .venv/bin/shoal


class NodeProcess:
    """A running `shoal node`, stopped by PID."""

    def __init__(self, root: Path, sock: Path, log: Path, extra: tuple[str, ...] = ()) -> None:
        self.root, self.socket, self.log_path = root, sock, log
        with open(log, "ab") as fh:
            self.proc = subprocess.Popen(
                [SHOAL, "-vv", "node", "--root", str(root), "--socket", str(sock), *extra],
                stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 20
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"shoal node did not start (exit {self.proc.returncode}):\n{self.log()}")
            time.sleep(0.02)

    def _answers(self) -> bool:
        """Listening (a stale socket file from a killed node refuses connections)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.socket))
                return True
            except OSError:
                return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> int | None:
        stop_process(self.proc)
        return self.proc.returncode

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


REPO = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def shoal_node_with_containerd(prefix: str = "shoal-", node_config: str = "", cri_registries: list[str] | None = None,
                               sandbox_image: str = "", root_size: str = "", install: bool = False):
    """`shoal node` and Debian's containerd using it as its `shoal` proxy snapshotter
    (deploy/containerd/config.toml), in a short private directory (unix socket paths are
    short). Yields (node, containerd); stops both, the layer file system server and every
    mount under the directory, then removes it — also on failure.

    The node's configuration is `node_config` (TOML; `@DIR@` in it stands for the private
    directory) plus `[containerd] address` = this containerd. `cri_registries`: enable containerd's CRI plugin (cri_config) with pods on
    shoal, pulling from these loopback registries, sandboxes from `sandbox_image`.
    `root_size`: the node's root is a tmpfs of that size ("96m"). `install`: containerd's
    file gets shoal as deploy/ puts it there, from `shoal install containerd` (proxy plugin,
    snapshot labels, runtime handler `shoal`; on containerd 1.6, which ignores a handler's
    snapshotter, also --default-snapshotter: deploy/kubernetes/README.md) instead of the
    snippet and cri_config's own settings."""
    from snapshotter.fs.client import FSClient

    short = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    node = ctd = None
    try:
        if root_size:
            (short / "root").mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={root_size},mode=0700", "tmpfs",
                            str(short / "root")], check=True, capture_output=True)
        ctd_dir = short / "ctd"
        config = short / "node.toml"
        config.write_text(f"{node_config.replace('@DIR@', str(short))}\n[containerd]\naddress = {_q(ctd_dir / 'containerd.sock')}\n")
        node = NodeProcess(short / "root", short / "s.sock", short / "node.log", ("--config", str(config)))
        snippet = (REPO / "deploy/containerd/config.toml").read_text().replace(
            "/run/shoal/snapshotter.sock", str(short / "s.sock"))
        cri = None
        if cri_registries is not None:
            cri = cri_config("" if install else "shoal", cri_registries, sandbox_image, short / "cni")
        edit = None
        if install:
            snippet = ""

            def edit(path: Path) -> None:
                from cli.install import containerd_minor

                old = (containerd_minor(CONTAINERD_BIN) or (1, 6)) < (1, 7)
                subprocess.run([SHOAL, "install", "containerd", "--config", str(path), "--socket", str(short / "s.sock"),
                                "--restart-command", "", *(["--default-snapshotter"] if old else [])],
                               check=True, capture_output=True, timeout=120)

        ctd = start_containerd(ctd_dir, extra_config=snippet, cri=cri, edit_config=edit)
        assert ctd.address == str(ctd_dir / "containerd.sock"), ctd.address
        yield node, ctd
    finally:
        if ctd is not None:
            ctd.stop()
        if node is not None:
            node.stop()
        FSClient(str(short / "root")).stop()
        unmount_under(short)
        shutil.rmtree(short, ignore_errors=True)


def wait_for(predicate, what: str, timeout: float = 60.0, interval: float = 0.1):
    """Poll `predicate` until it returns something true (returned), or fail the test
    with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
