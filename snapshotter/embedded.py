"""An embedded node for one job: `shoal node` and containerd under a temporary root, so
`shoal profile record` can run an image where no node is at hand (a CI runner).

    with EmbeddedNode(plain_http_hosts) as node:     # the registries the node reads over HTTP
        node.pull(ref, plain_http)
        code = node.run(ref, command, timeout)      # None when it ran past the timeout
        chunks = node.fs.profile(layers)

Everything lives under one private directory (0700, short enough for unix sockets):
the node's root and socket, containerd's root, state, sockets, runc state and FIFOs.
containerd runs with its CRI plugin off and shoal as its `shoal` proxy snapshotter.
Every process is stopped by its PID (the container's task, containerd, the shims it
started, `shoal node`, the layer file system), mounts under the directory are undone and
the directory removed: on success, on failure and on a start that never came up.
Needs root, containerd and runc (Debian packages), like `shoal node` itself.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from shoal.errors import ShoalError
from shoal.fsutil import mounts

if TYPE_CHECKING:
    from snapshotter.fs.client import FSClient

log = logging.getLogger("shoal.embedded")

CONTAINERD = "/usr/bin/containerd"
CTR = "/usr/bin/ctr"
NAMESPACE = "shoal-record"
MAX_TMP_PATH = 40  # longer, and ROOT/.../containerd.sock.ttrpc may pass the 107 bytes of a unix socket path
START_TIMEOUT = 30.0
STOP_TIMEOUT = 10.0
# containerd 1.6 puts its shims' sockets under /run/containerd whatever its configuration
# says; the directories it creates there are removed again when empty.
_RUN_DIRS = ("/run/containerd/s", "/run/containerd/fifo", "/run/containerd/runc", "/run/containerd")


def _toml(value: str) -> str:
    return json.dumps(value)  # a TOML basic string is a JSON string


def containerd_config(root: str, state: str, address: str, extra: str = "", cri: bool = False) -> str:
    """containerd's TOML with its own root, state and sockets (ADDRESS and ADDRESS.ttrpc),
    no CRI plugin (unless `cri`: then `extra` holds its table), no debug or metrics
    listener; `extra` is appended."""
    return "\n".join([
        "version = 2",
        f"root = {_toml(root)}",
        f"state = {_toml(state)}",
        *([] if cri else ['disabled_plugins = ["io.containerd.grpc.v1.cri"]']),
        "[grpc]",
        f"  address = {_toml(address)}",
        "[ttrpc]",
        f"  address = {_toml(address + '.ttrpc')}",
        "[debug]",
        '  address = ""',
        '  level = "info"',
        "[metrics]",
        '  address = ""',
        '[plugins."io.containerd.internal.v1.opt"]',
        f"  path = {_toml(os.path.join(root, 'opt'))}",  # default /opt/containerd
        "",
        extra,
    ])


def proxy_snapshotter(socket_path: str) -> str:
    """The [proxy_plugins.shoal] table: shoal as containerd's `shoal` snapshotter."""
    return f'[proxy_plugins.shoal]\n  type = "snapshot"\n  address = {_toml(socket_path)}\n'



class EmbeddedNode:
    """`shoal node` + containerd under a temporary directory (see the module doc)."""

    def __init__(self, plain_http_hosts: list[str] | tuple[str, ...] = ()) -> None:
        """plain_http_hosts: registries (HOST:PORT) the node reads over plain HTTP (its
        `[fetch] plain_http_hosts`; loopback always is): the lazy reads of an image pulled
        with plain_http go there too, and an image cannot ask for it (no label does)."""
        self.plain_http_hosts = list(plain_http_hosts)
        self.dir = ""
        self.root = ""
        self.address = ""
        self._node: subprocess.Popen | None = None
        self._containerd: subprocess.Popen | None = None
        self._created_run_dirs: list[str] = []
        self.fs: FSClient | None = None  # once started

    # --- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> EmbeddedNode:  # noqa: PYI034 (not subclassed)
        if os.geteuid() != 0:
            raise ShoalError("an embedded node needs root (FUSE mounts, containerd)")
        for path, package in ((CONTAINERD, "containerd"), (CTR, "containerd"), ("/usr/sbin/runc", "runc")):
            if not os.access(path, os.X_OK):
                raise ShoalError(f"an embedded node needs {path} (Debian package {package})")
        # $TMPDIR (a CI runner's own) when its paths leave room for the unix sockets under it, else /tmp
        tmp = tempfile.gettempdir()
        self.dir = tempfile.mkdtemp(prefix="shoal-rec-", dir=tmp if len(tmp) <= MAX_TMP_PATH else "/tmp")  # 0700
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start(self) -> None:
        from snapshotter.fs.client import FSClient

        self.root = os.path.join(self.dir, "root")
        sock = os.path.join(self.dir, "s.sock")
        logs = os.path.join(self.dir, "logs")
        os.makedirs(logs)
        node_config = os.path.join(self.dir, "node.toml")
        with open(node_config, "w") as f:
            f.write(f"[fetch]\nplain_http_hosts = {json.dumps(self.plain_http_hosts)}\n")  # (a JSON list is TOML)
        with open(os.path.join(logs, "node.log"), "ab") as out:
            self._node = subprocess.Popen(
                [sys.executable, "-m", "cli", "node", "--root", self.root, "--socket", sock, "--config", node_config],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self._wait(lambda: _listening(sock), self._node, "shoal node", "node.log")
        self.fs = FSClient(self.root)
        ctd = os.path.join(self.dir, "ctd")
        for d in ("root", "state", "runc", "fifo"):
            os.makedirs(os.path.join(ctd, d))
        self.address = os.path.join(self.dir, "c.sock")
        config = os.path.join(ctd, "config.toml")
        with open(config, "w") as f:
            f.write(containerd_config(os.path.join(ctd, "root"), os.path.join(ctd, "state"), self.address,
                                      proxy_snapshotter(sock)))
        self._created_run_dirs = [d for d in _RUN_DIRS if not os.path.lexists(d)]
        with open(os.path.join(logs, "containerd.log"), "ab") as out:
            self._containerd = subprocess.Popen([CONTAINERD, "--config", config], stdin=subprocess.DEVNULL,
                                                stdout=out, stderr=subprocess.STDOUT)
        self._wait(lambda: os.path.exists(self.address) and self.ctr("version", check=False).returncode == 0,
                   self._containerd, "containerd", "containerd.log")

    def _wait(self, ready, proc: subprocess.Popen, what: str, log_name: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise ShoalError(f"embedded node: {what} did not start ({self._tail(log_name)})")
            time.sleep(0.05)

    def _tail(self, log_name: str) -> str:
        try:
            with open(os.path.join(self.dir, "logs", log_name), errors="replace") as f:
                lines = [ln for ln in f.read().splitlines() if ln.strip()]
        except OSError:
            return "no log"
        return lines[-1][-300:] if lines else "no log"

    def close(self) -> None:
        """Stop everything started, by PID; undo mounts; remove the directory."""
        if not self.dir:
            return
        try:
            if self._containerd is not None and self._containerd.poll() is None:
                self._kill_tasks()
            stop_process(self._containerd)
            for pid in shim_pids(self.address):
                _kill(pid)
            stop_process(self._node)
            if self.fs is not None:
                self.fs.stop()
        finally:
            left = _unmount_under(self.dir)
            shutil.rmtree(self.dir, ignore_errors=True)
            for d in sorted(self._created_run_dirs, key=len, reverse=True):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
            self.dir = ""
            if left:
                log.warning("embedded node: still mounted after umount -l: %s", ", ".join(left))

    # --- what runs on it ---------------------------------------------------------------------

    def ctr(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess:
        proc = subprocess.run([CTR, "--address", self.address, "--namespace", NAMESPACE, *args],
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, errors="replace",
                              timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise ShoalError(f"ctr {args[0]}: {(proc.stderr.strip().splitlines() or ['failed'])[-1][:300]}")
        return proc

    def pull(self, ref: str, plain_http: bool = False) -> dict:
        from snapshotter.pull import pull

        return pull(ref, self.address, NAMESPACE, plain_http)

    def run(self, ref: str, command: list[str], timeout: float, container: str = "shoal-record") -> int | None:
        """Run a container of `ref` (its own command when `command` is empty) until it
        exits (its exit status) or `timeout` seconds pass (None; it is killed). Its output
        goes to logs/container.log."""
        ctd = os.path.join(self.dir, "ctd")
        argv = [CTR, "--address", self.address, "--namespace", NAMESPACE, "run", "--rm", "--snapshotter", "shoal",
                "--runc-root", os.path.join(ctd, "runc"), "--fifo-dir", os.path.join(ctd, "fifo"),
                ref, container, *command]
        with open(os.path.join(self.dir, "logs", "container.log"), "ab") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.ctr("tasks", "kill", "-a", "-s", "SIGKILL", container, check=False)
                try:
                    proc.wait(timeout=STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                return None

    def container_log(self) -> str:
        return self._tail("container.log")

    def _kill_tasks(self) -> None:
        tasks = self.ctr("tasks", "ls", "-q", check=False).stdout.split()
        for task in tasks:
            self.ctr("tasks", "kill", "-a", "-s", "SIGKILL", task, check=False)
        for task in tasks:
            self.ctr("tasks", "rm", "-f", task, check=False)
        for cid in self.ctr("containers", "ls", "-q", check=False).stdout.split():
            self.ctr("containers", "rm", cid, check=False)


def shim_pids(address: str) -> list[int]:
    """The containerd shims serving the containerd on `address` (their command line
    names its socket): they outlive containerd, and are stopped by PID."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                argv = fh.read().split(b"\0")
        except OSError:
            continue
        if b"-address" in argv:
            i = argv.index(b"-address")
            if i + 1 < len(argv) and argv[i + 1] == os.fsencode(address):
                pids.append(int(entry))
    return pids


def _listening(path: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(path)
            return True
        except OSError:
            return False


def stop_process(proc: subprocess.Popen | None, timeout: float = STOP_TIMEOUT) -> None:
    """Terminate by PID, kill after `timeout` seconds, reap."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _unmount_under(path: str) -> list[str]:
    """Lazily unmount everything at or below `path`, deepest first; what is left."""
    prefix = os.path.realpath(path).rstrip("/") + "/"

    def under() -> list[str]:
        return sorted({p for p, _ in mounts() if (p + "/").startswith(prefix)}, key=len, reverse=True)

    for _ in range(3):
        points = under()
        if not points:
            return []
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    return under()
