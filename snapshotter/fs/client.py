"""The node's side of the layer file system: start the server, talk to its socket."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

from shoal import localrpc
from shoal.errors import ShoalError
from shoal.fsutil import private_dir

log = logging.getLogger("shoal.fs")


class FSClient:
    """Talks to the layer file system server of ROOT, starting it if it is not running.

    The server runs in its own session, so stopping the node leaves it (and every
    container's files) running; stop() ends it explicitly.
    """

    def __init__(self, root: str, config: dict | None = None):
        self.root = os.path.abspath(root)
        self.config = config or {}
        self.sock_path = os.path.join(self.root, "fs.sock")
        self.mnt = os.path.join(self.root, "mnt")
        self.pid: int | None = None
        self._start_lock = threading.Lock()

    def call(self, op: str, timeout: float = 60.0, **args) -> dict:
        return localrpc.call(self.sock_path, {"op": op, **args}, timeout, "layer file system")

    def running(self) -> bool:
        try:
            self.pid = self.call("ping", timeout=5)["pid"]
            return os.path.ismount(self.mnt)
        except (OSError, ShoalError, ValueError):
            return False

    def ensure_running(self, timeout: float = 30.0) -> None:
        with self._start_lock:  # two prepares at once start one server
            self._ensure_running(timeout)

    def _ensure_running(self, timeout: float) -> None:
        if self.running():
            return
        private_dir(os.path.join(self.root, "logs"))
        log_path = os.path.join(self.root, "logs", "fs.log")
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # the layers' file names and errors: root's alone
        with os.fdopen(fd, "ab") as logf:
            proc = subprocess.Popen(
                [sys.executable, "-m", "snapshotter.fs.server", "--root", self.root,
                 "--config-json", json.dumps(self.config)],
                stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                start_new_session=True,  # survives a restart of the node's control plane
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                with open(log_path, errors="replace") as f:
                    lines = [line.strip() for line in f.read()[-4000:].splitlines() if line.strip()]
                # its last ERROR line says why (the server logs one line, never a traceback)
                why = next((line.split(" ERROR ", 1)[1] for line in reversed(lines) if " ERROR " in line),
                           lines[-1] if lines else "no output")
                raise ShoalError(f"layer file system server exited with {proc.returncode}: {why} (log: {log_path})")
            if self.running():
                log.info("layer file system server running (pid %d) at %s", self.pid, self.mnt)
                return
            time.sleep(0.05)
        raise ShoalError(f"layer file system server did not start within {timeout:.0f}s (log: {log_path})")

    def load(self, layer_id: str) -> str:
        self.call("load", id=layer_id)
        return os.path.join(self.mnt, layer_id)

    def unload(self, layer_id: str) -> None:
        self.call("unload", id=layer_id)

    def status(self) -> dict:
        return self.call("status")

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server by its PID and wait until the mount is gone."""
        if not self.running() or self.pid is None:
            return
        os.kill(self.pid, 15)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and os.path.ismount(self.mnt):
            time.sleep(0.05)
        if os.path.ismount(self.mnt):
            subprocess.run(["umount", "-l", self.mnt], check=False)
        # After the unmount the server still writes pending chunks to ROOT/chunks: gone
        # means the process has exited, so nothing writes under ROOT after stop().
        while time.monotonic() < deadline and _alive(self.pid):
            time.sleep(0.05)


def _alive(pid: int) -> bool:
    """Process `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False
