"""The layer file system's FUSE session outlives its server: kill -9 of shoal-fs, or an
upgrade, while a reader reads a lazy file in a loop; the descriptor holder keeps the
connection, a new server takes it over (NOTIFY_RESEND), and the reader never sees a
failed read (real registry, real FUSE mount, shoal's own processes)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from builder.convert import convert
from builder.oci.refs import open_source
from snapshotter.fs import holder
from snapshotter.fs.client import FSClient
from snapshotter.remote import RemoteLayers
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer
from tests.services import wait_for
from tests.test_lazy_fs import layer_labels, prepare_tree

pytestmark = [pytest.mark.registry]

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse", allow_module_level=True)


class LoopReader:
    """Reads one file of a lazy mount whole, again and again, dropping its cached pages
    each time (fadvise DONTNEED) so that every round asks the file system; records every
    failure and the longest wait for one round."""

    def __init__(self, path: Path, digest: str):
        self.path, self.digest = path, digest
        self.rounds = 0
        self.failures: list[str] = []
        self.longest = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.monotonic()
            try:
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    data = b""
                    while chunk := os.read(fd, 1 << 20):
                        data += chunk
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                if hashlib.sha256(data).hexdigest() != self.digest:
                    self.failures.append(f"round {self.rounds}: wrong bytes ({len(data)})")
            except OSError as e:
                self.failures.append(f"round {self.rounds}: {e}")
            self.longest = max(self.longest, time.monotonic() - start)
            self.rounds += 1

    def rounds_after(self, n: int, timeout: float = 60.0) -> None:
        target = self.rounds + n
        wait_for(lambda: self.rounds >= target or not self.thread.is_alive(), f"{n} more reads", timeout=timeout)


@pytest.fixture(scope="module")
def lazy_image(module_registry, tmp_path_factory):
    root = tmp_path_factory.mktemp("takeover image")
    src = f"docker://{module_registry.host}/takeover/img:gzip"
    build_image([str(busybox_layer(root / "l1"))], src, ImageConfig(), plain_http=True, workdir=str(root))
    dst = f"docker://{module_registry.host}/takeover/img:chunked"
    convert(src, dst, plain_http=True)
    with open_source(dst, plain_http=True) as s:
        manifest = json.loads(s.get_root().data)
    return dst.removeprefix("docker://"), manifest, root / "l1"


@pytest.fixture
def node_root(tmp_path):
    root = tmp_path / "node root"
    clients: list[FSClient] = []
    yield root, clients
    for client in clients:
        client.release()  # (their supervisors restart nothing now)
    fs = FSClient(str(root))
    fs.stop()
    answer = holder.ping(str(root))
    if answer is not None:  # a test that failed before its server unmounted
        holder.drop(str(root))
        os.kill(int(answer["pid"]), signal.SIGTERM) if holder.ping(str(root)) else None
    assert not os.path.ismount(fs.mnt)


def test_kill_9_of_the_server_and_an_upgrade_lose_no_read(lazy_image, module_registry, node_root, monkeypatch,
                                                         tmp_path):
    ref, manifest, tree = lazy_image
    node_root, clients = node_root
    layers = RemoteLayers(str(node_root))
    clients.append(layers.fs)
    layers.start()  # the node's start: the server runs, supervised
    lazy = Path(layers.prepare("k", "", layer_labels(ref, manifest["layers"][0])).path)
    expected = hashlib.sha256((tree / "bin/busybox").read_bytes()).hexdigest()
    wait_for(lambda: (holder.ping(str(node_root)) or {}).get("holding"), "the holder", timeout=10)
    held = holder.ping(str(node_root))
    assert held is not None
    reader = LoopReader(lazy / "bin/busybox", expected)
    reader.thread.start()
    try:
        reader.rounds_after(3)
        ino = os.stat(lazy / "bin/busybox").st_ino
        pauses = {}
        # 1. kill -9 of shoal-fs: the supervisor starts a new one, which takes the session over
        first = layers.fs.ping()["pid"]
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: layers.fs.restarts >= 1, "the supervisor's restart", timeout=60)
        second = layers.fs.ping()["pid"]
        assert second != first
        reader.rounds_after(5)
        pauses["kill -9"], reader.longest = reader.longest, 0.0
        assert reader.failures == [], reader.failures
        log = (node_root / "logs/fs.log").read_text()
        assert "taking over the FUSE session" in log
        # 2. an upgrade: a node of another version hands the session over to a server of its own
        layers.fs.release()  # (the old node goes)
        monkeypatch.setenv("SHOAL_VERSION", "takeover-test-2")
        upgraded = RemoteLayers(str(node_root))
        clients.append(upgraded.fs)
        upgraded.start()
        third = upgraded.fs.ping()
        assert third["pid"] not in (first, second) and third["version"] == "takeover-test-2"
        reader.rounds_after(5)
        pauses["upgrade"] = reader.longest
        assert reader.failures == [], reader.failures
        # the kernel's nodeids mean what they meant (the numbers come from ROOT and the TOC)
        assert os.stat(lazy / "bin/busybox").st_ino == ino
        # a new layer after the takeovers is served too (new containers work)
        (tmp_path / "new/etc").mkdir(parents=True)
        (tmp_path / "w").mkdir()
        (tmp_path / "new/etc/hello").write_bytes(b"after the takeover\n")
        mount, _ = prepare_tree(upgraded, module_registry.host, "takeover/new", tmp_path / "new", tmp_path / "w")
        assert (mount / "etc/hello").read_bytes() == b"after the takeover\n"
        assert holder.ping(str(node_root))["pid"] == held["pid"]  # one holder all along
    finally:
        reader.stop.set()
        reader.thread.join(30)
    assert reader.failures == [], reader.failures
    print(f"\nreads: {reader.rounds}, failed: {len(reader.failures)}, longest read: "
          + ", ".join(f"{k} {v:.3f}s" for k, v in pauses.items()))
    upgraded.fs.stop()
    wait_for(lambda: holder.ping(str(node_root)) is None, "the holder's exit at the stop", timeout=30)
