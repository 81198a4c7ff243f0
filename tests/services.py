"""Real services for tests, the demo and the benchmarks: Debian's docker-registry on
loopback (and, later, containerd). Every process is stopped by its PID.
"""

from __future__ import annotations

import json
import secrets
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REGISTRY_BIN = "/usr/bin/docker-registry"
START_TIMEOUT = 20.0
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
        """Every request the registry logged as completed, in order."""
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "http.request.method" in entry and "http.response.status" in entry:
                out.append(
                    LoggedRequest(
                        method=entry["http.request.method"],
                        uri=entry.get("http.request.uri", ""),
                        status=int(entry["http.response.status"]),
                        written=int(entry.get("http.response.written", 0)),
                    )
                )
        return out

    def count(self, method: str | None = None, uri_contains: str = "") -> tuple[int, int]:
        """(number of requests, response bytes written) matching method and URI part."""
        hits = [
            r for r in self.requests()
            if (method is None or r.method == method) and uri_contains in r.uri
        ]
        return len(hits), sum(r.written for r in hits)

    def stop(self) -> None:
        stop_process(self._proc)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(proc: subprocess.Popen | None) -> None:
    """Terminate by PID, kill after STOP_TIMEOUT, reap."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


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


