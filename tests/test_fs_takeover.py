"""The layer file system's FUSE session outlives its server: kill -9 of shoal-fs, or an
upgrade, while a reader reads a lazy file in a loop; the descriptor holder keeps the
connection, a new server takes it over (NOTIFY_RESEND), and the reader never sees a
failed read (real registry, real FUSE mount, shoal's own processes)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from builder.convert import convert
from builder.oci.refs import open_source
from shoal.errors import ShoalError
from shoal.fsutil import mounts
from snapshotter import status as node_status_module
from snapshotter.fs import client as fs_client
from snapshotter.fs import holder
from snapshotter.fs.client import WATCH_INTERVAL, FSClient
from snapshotter.fs.session import NO_RESEND_ENV
from snapshotter.remote import RemoteLayers
from snapshotter.status import node_status
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer, lazy_app_image
from tests.services import SHOAL, NodeProcess, shoal_node_with_containerd, start_registry, wait_for
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
    dead = any(point == fs.mnt for point, _ in mounts())  # (a session no server serves: ENOTCONN)
    if dead:
        subprocess.run(["umount", "-l", fs.mnt], check=False)
    assert not dead and not os.path.ismount(fs.mnt)


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


# A child that reads a file whole with O_DIRECT: each read(2) is READ requests whose answer
# (data or error) is what it gets, with no page cache in between (a buffered read's failed
# readahead would be tried again by the kernel as a read of one page).
DIRECT_READER = """
import hashlib, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
h = hashlib.sha256()
try:
    while chunk := os.read(fd, 1 << 20):
        h.update(chunk)
except OSError as e:
    sys.exit(f"read: {e.strerror}")
print(h.hexdigest())
"""
IN_FLIGHT_TIMEOUT = 90.0  # a reader still blocked after this has hung (the read deadline is 600 s)


class InFlightRead:
    """A node (supervised shoal-fs, read deadline 600 s) serving a layer of two 1 MiB
    files from a registry of the test's own, which is then stopped (SIGSTOP: it accepts
    connections and never answers) while an O_DIRECT read of data/a waits in shoal-fs.
    `finish()` gives the reader's (returncode, stdout, stderr), or fails the test if it
    is still blocked after IN_FLIGHT_TIMEOUT; `read(name)` reads a file anew."""

    def __init__(self, root: Path, clients: list, tmp_path: Path):
        self.root, self.clients = root, clients
        (tmp_path / "registry").mkdir()
        self.registry = start_registry(tmp_path / "registry", None)
        self.stopped = False
        self.reader: subprocess.Popen | None = None
        self.layers = RemoteLayers(str(root), {"read_deadline": 600.0})
        clients.append(self.layers.fs)
        self.layers.start()
        self.digests = {}
        (tmp_path / "tree/data").mkdir(parents=True)
        for name in ("a", "b"):
            data = os.urandom(1 << 20)
            (tmp_path / "tree/data" / name).write_bytes(data)
            self.digests[name] = hashlib.sha256(data).hexdigest()
        self.mount, self.layer = prepare_tree(self.layers, self.registry.host, "inflight/img", tmp_path / "tree",
                                              tmp_path)
        wait_for(lambda: (holder.ping(str(root)) or {}).get("holding"), "the holder", timeout=10)
        os.kill(self.registry.pid, signal.SIGSTOP)
        self.stopped = True
        before = self.reads()
        self.reader = subprocess.Popen([sys.executable, "-c", DIRECT_READER, str(self.mount / "data/a")],
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(lambda: self.reads() > before, "the READ in shoal-fs", timeout=30)
        time.sleep(0.5)  # (its worker asks the stopped registry)
        assert self.reader.poll() is None  # blocked in the server

    def reads(self) -> int:
        return sum(ly["reads"] for ly in self.layers.fs.status()["layers"])

    def resume_registry(self) -> None:
        if self.stopped:
            os.kill(self.registry.pid, signal.SIGCONT)
            self.stopped = False

    def finish(self) -> tuple[int, str, str]:
        assert self.reader is not None
        try:
            out, err = self.reader.communicate(timeout=IN_FLIGHT_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the read in flight still blocked after {IN_FLIGHT_TIMEOUT:.0f}s")
        return self.reader.returncode, out, err

    def read(self, name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", DIRECT_READER, str(self.mount / "data" / name)],
                              capture_output=True, text=True, timeout=IN_FLIGHT_TIMEOUT, check=False)

    def close(self) -> None:
        if self.reader is not None and self.reader.poll() is None:
            self.reader.kill()  # (a read blocked in FUSE dies with SIGKILL)
            self.reader.wait(30)
        self.resume_registry()
        for client in self.clients:
            client.stop()
        self.registry.stop()


@pytest.fixture
def in_flight_read(node_root, tmp_path):
    root, clients = node_root
    made: list[InFlightRead] = []
    yield lambda: made.append(InFlightRead(root, clients, tmp_path)) or made[-1]
    for read in made:
        read.close()


@pytest.mark.parametrize("resend", [True, False], ids=["resend", "kernel without resend"])
def test_a_read_in_flight_at_kill_9_is_answered_after_the_takeover(resend, in_flight_read, monkeypatch):
    """A READ waits in shoal-fs (its registry accepts connections and never answers)
    when shoal-fs is killed -9; the node's supervisor starts a new server, which takes
    the session over from the holder. With FUSE_NOTIFY_RESEND the kernel sends the READ
    again and it succeeds once the registry answers. Acting as a kernel without it
    (SHOAL_FUSE_NO_RESEND=1, from the INIT on), the new server answers that READ EIO
    from the dead one's in-flight table: the reader gets EIO long before any deadline,
    never a hang, and later reads succeed."""
    if resend:
        monkeypatch.delenv(NO_RESEND_ENV, raising=False)
    else:
        monkeypatch.setenv(NO_RESEND_ENV, "1")
    t = in_flight_read()
    first = t.layers.fs.ping()["pid"]
    os.kill(first, signal.SIGKILL)
    if resend:
        t.resume_registry()
    wait_for(lambda: t.layers.fs.restarts >= 1, "the supervisor's restart", timeout=60)
    assert t.layers.fs.ping()["pid"] != first
    code, out, err = t.finish()
    log = (t.root / "logs/fs.log").read_text()
    assert "taking over the FUSE session" in log
    if resend:
        assert code == 0, err
        assert out.strip() == t.digests["a"]
        assert "answered EIO" not in log
    else:
        assert code != 0 and "Input/output error" in err, (out, err)
        line = next((ln for ln in log.splitlines() if "answered EIO" in ln), "")
        assert "without FUSE_NOTIFY_RESEND" in line and str(t.root / "mnt") in line, log[-3000:]
        assert f"1 requests in flight at the takeover answered EIO: READ of layer {t.layer['digest']}" in line, line
        t.resume_registry()
    # later reads succeed: the other file, and the one whose read failed
    for name in ("b", "a"):
        done = t.read(name)
        assert done.returncode == 0 and done.stdout.strip() == t.digests[name], done.stderr


def test_an_upgrade_without_resend_lets_the_reads_in_flight_end_first(in_flight_read, monkeypatch):
    """On a kernel without FUSE_NOTIFY_RESEND (the knob) an upgrade's old server, told to
    hand over, waits for the requests in flight before it exits (the next server could
    only answer them EIO): a READ waiting for the registry when the upgrade starts ends
    with the right bytes once the registry answers, and the new server answers none EIO."""
    monkeypatch.setenv(NO_RESEND_ENV, "1")
    t = in_flight_read()
    old = t.layers.fs.ping()["pid"]
    t.layers.fs.release()  # (the old node goes)
    monkeypatch.setenv("SHOAL_VERSION", "inflight-upgrade")
    upgraded = RemoteLayers(str(t.root), {"read_deadline": 600.0})
    t.clients.append(upgraded.fs)
    started = threading.Thread(target=upgraded.start, daemon=True)
    started.start()  # (it waits for the old server to be gone)
    wait_for(lambda: not _answers(t.root) or not started.is_alive(), "the hand-over to begin", timeout=30)
    time.sleep(0.5)
    assert _running(old)  # told to hand over (its control socket closed), still draining: its READ waits
    t.resume_registry()
    started.join(60)
    assert upgraded.fs.ping()["pid"] != old and not _running(old)
    code, out, err = t.finish()
    assert code == 0 and out.strip() == t.digests["a"], err
    log = (t.root / "logs/fs.log").read_text()
    assert "0 requests in flight at the takeover answered EIO" in log, log[-3000:]
    assert t.read("b").stdout.strip() == t.digests["b"]


XATTR_HAMMER = """
import errno, json, os, sys
path, stop = sys.argv[1], sys.argv[2]
calls, errors = 0, []
while not os.path.exists(stop):
    try:
        os.getxattr(path, "user.none")
    except OSError as e:
        if e.errno != errno.ENODATA:
            errors.append(e.strerror)
    calls += 1
print(json.dumps({"calls": calls, "errors": errors}))
"""


def test_an_upgrade_without_resend_answers_every_request_that_comes_meanwhile(in_flight_read, monkeypatch,
                                                                              tmp_path):
    """On a kernel without FUSE_NOTIFY_RESEND, requests keep coming while the old server
    drains and exits (here a process asks for an xattr of a file, which always reaches
    the server, as fast as it is answered): the old server reads none that it cannot
    answer before it exits, so each is answered by one server or the other, and none
    gets EIO from the next server's in-flight table."""
    monkeypatch.setenv(NO_RESEND_ENV, "1")
    t = in_flight_read()
    t.resume_registry()
    code, out, err = t.finish()
    assert code == 0 and out.strip() == t.digests["a"], err
    stop = tmp_path / "stop hammer"
    hammer = subprocess.Popen([sys.executable, "-c", XATTR_HAMMER, str(t.mount / "data/b"), str(stop)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(0.5)
        assert hammer.poll() is None, hammer.communicate()
        old = t.layers.fs.ping()["pid"]
        t.layers.fs.release()
        monkeypatch.setenv("SHOAL_VERSION", "busy-upgrade")
        upgraded = RemoteLayers(str(t.root), {"read_deadline": 600.0})
        t.clients.append(upgraded.fs)
        upgraded.start()
        assert upgraded.fs.ping()["pid"] != old
        wait_for(lambda: not _running(old), "the old server's exit", timeout=30)
        time.sleep(0.5)  # (the hammer goes on against the new server)
        stop.touch()
        out, err = hammer.communicate(timeout=60)
    finally:
        if hammer.poll() is None:
            hammer.kill()
            hammer.wait(30)
    assert hammer.returncode == 0, err
    result = json.loads(out)
    assert result["calls"] > 100 and result["errors"] == [], result
    log = (t.root / "logs/fs.log").read_text()
    assert "0 requests in flight at the takeover answered EIO" in log, log[-3000:]


def test_a_stopped_node_restarts_no_layer_file_system_server(lazy_image, node_root):
    """The node's stop leaves a server that serves layers running, unsupervised: one
    stopped after it (by hand, or by what embedded the node) stays stopped, where the
    node process's supervisor thread, still alive, would start it again."""
    ref, manifest, _ = lazy_image
    root, clients = node_root
    layers = RemoteLayers(str(root))
    clients.append(layers.fs)
    layers.start()
    layers.prepare("s", "", layer_labels(ref, manifest["layers"][0]))
    layers.stop_if_idle()  # (the node's stop)
    pid = layers.fs.ping()["pid"]
    assert _running(pid)  # it serves a layer: it keeps running
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not _running(pid), "the server's exit", timeout=30)
    time.sleep(6 * WATCH_INTERVAL)  # (the supervisor would have restarted it by now)
    assert layers.fs.restarts == 0 and not _answers(root)
    layers.fs.ensure_running()  # (a server to end the session: the fixture's stop unmounts)


def _servers(root: Path) -> list[int]:
    """PIDs of the layer file system server processes of `root` (running or stopped)."""
    fs = FSClient(str(root))
    return sorted(int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit() and fs._server_alive(int(e.name)))


def test_a_server_that_answers_late_is_not_joined_by_a_second_one(lazy_image, node_root, monkeypatch, caplog):
    """A server that is alive but does not answer the supervisor's pings for a while (here
    SIGSTOP; on a node, a machine too loaded to answer in time) gets no second server on
    its session beside it: the supervisor waits. One that has not answered for
    HUNG_AFTER is killed by its PID and replaced, and the layer reads on through the new one."""
    monkeypatch.setattr(fs_client, "PING_TIMEOUT", 0.5)
    monkeypatch.setattr(fs_client, "HUNG_AFTER", 60.0)
    monkeypatch.setattr(node_status_module, "STATUS_TIMEOUT", 0.5)
    caplog.set_level(logging.WARNING, logger="shoal.fs")
    ref, manifest, tree = lazy_image
    root, clients = node_root
    layers = RemoteLayers(str(root))
    clients.append(layers.fs)
    layers.start()
    lazy = Path(layers.prepare("late", "", layer_labels(ref, manifest["layers"][0])).path)
    busybox = (tree / "bin/busybox").read_bytes()
    assert (lazy / "bin/busybox").read_bytes() == busybox
    first = layers.fs.ping()["pid"]
    os.kill(first, signal.SIGSTOP)
    try:
        time.sleep(12 * max(WATCH_INTERVAL, fs_client.PING_TIMEOUT))  # 4 failed pings and more
        late = (layers.fs.restarts, _servers(root))
        # a Prepare meanwhile (it makes sure a server runs) fails in one line, starting none
        with pytest.raises(ShoalError, match=f"server \\(pid {first}\\) runs but does not answer"):
            layers.fs.ensure_running()
        late += (_servers(root),)
        # and `shoal status` says it does not know the server's figures (not a node whose
        # server has served nothing: before, no fs_server and every count 0)
        with pytest.raises(ShoalError, match="did not answer within 0.5s: its figures are not known"):
            node_status(str(root))
    finally:
        os.kill(first, signal.SIGCONT)
    assert late == (0, [first], [first])
    assert layers.fs.ping()["pid"] == first
    assert node_status(str(root))["fs_server"]["pid"] == first
    monkeypatch.setattr(fs_client, "HUNG_AFTER", 2.0)
    os.kill(first, signal.SIGSTOP)
    try:
        wait_for(lambda: layers.fs.restarts >= 1, "the supervisor's restart", timeout=60)
    finally:
        if _running(first):
            os.kill(first, signal.SIGCONT)
    wait_for(lambda: not _running(first), "the hung server's end", timeout=10)
    second = layers.fs.ping()["pid"]
    assert second != first and _servers(root) == [second]
    with open(lazy / "bin/busybox", "rb") as f:  # (through the new server: the cached pages dropped)
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert f.read() == busybox
    assert f"layer file system server (pid {first}) has not answered for" in caplog.text


def test_a_dead_mount_is_replaced_when_the_holder_died_too(lazy_image, node_root):
    """kill -9 of the holder and of shoal-fs: nothing keeps the session, the mount is
    dead (ENOTCONN). The next server detaches it and mounts anew (no FileExistsError on
    ROOT/mnt), with the layers it served before."""
    ref, manifest, tree = lazy_image
    node_root, clients = node_root
    layers = RemoteLayers(str(node_root))
    clients.append(layers.fs)
    lazy = Path(layers.prepare("d", "", layer_labels(ref, manifest["layers"][0])).path)
    assert (lazy / "bin/busybox").read_bytes() == (tree / "bin/busybox").read_bytes()
    wait_for(lambda: (holder.ping(str(node_root)) or {}).get("holding"), "the holder", timeout=10)
    os.kill(int(holder.ping(str(node_root))["pid"]), signal.SIGKILL)
    os.kill(layers.fs.ping()["pid"], signal.SIGKILL)
    wait_for(lambda: _enotconn(lazy), "the dead mount", timeout=10)
    layers.fs.ensure_running()
    assert (lazy / "bin/busybox").read_bytes() == (tree / "bin/busybox").read_bytes()
    assert "detached the mount left at" in (node_root / "logs/fs.log").read_text()


def _enotconn(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ENOTCONN
    return False


# --- test 1 of issue 15: containerd, a container reading in a loop ------------------------------

LOOP = ("/bin/sh", "-c", ("while true; do if sha256sum /bin/busybox >> /out/reads; then :; "
                          "else echo FAILED >> /out/reads; fi; done"))


class Lines:
    """Follows the container's output file from the host: every line, the time it came."""

    def __init__(self, path: Path):
        self.path = path
        self.lines: list[str] = []
        self.times: list[float] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        at = 0
        while not self.stop.is_set():
            with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
                f.seek(at)
                data = f.read()
                complete = data[:data.rfind(b"\n") + 1]
                at += len(complete)
                now = time.monotonic()
                for line in complete.decode(errors="replace").splitlines():
                    self.lines.append(line)
                    self.times.append(now)
            time.sleep(0.01)

    def more(self, n: int, timeout: float = 120.0) -> None:
        target = len(self.lines) + n
        wait_for(lambda: len(self.lines) >= target, f"{n} more reads of the container", timeout=timeout)

    def longest_gap(self, since: float) -> float:
        times = [t for t in self.times if t >= since]
        before = [t for t in self.times if t < since][-1:]
        times = before + times
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


class PageDropper:
    """Drops the kernel's cached pages of one file of a lazy mount, again and again
    (fadvise on a descriptor held open: no request to the file system), so that the
    container's every read of it reaches the layer file system."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop.wait(0.02):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        os.close(self.fd)


def _status(root: Path) -> dict:
    proc = subprocess.run([SHOAL, "status", "--root", str(root), "--json"], capture_output=True, text=True,
                          check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _fs_pid(root: Path) -> int | None:
    try:
        return int(_status(root)["fs_server"]["pid"])
    except (AssertionError, KeyError, TypeError, ValueError):
        return None


def _new_container_works(ctd, lazy: str, name: str) -> None:
    """A new container from the lazy image runs (containerd reconnects to a restarted
    snapshotter with a back-off: retried while it says unavailable)."""
    for _ in range(80):
        proc = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, name, "/bin/cat", "/etc/motd", check=False)
        if proc.returncode == 0 or "unavailable" not in proc.stderr:
            break
        time.sleep(0.25)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "changed by the top layer\n"


@pytest.mark.containerd
def test_a_container_reads_on_through_kill_9_upgrade_and_kill_9_of_node_and_server(
        module_registry, tmp_path_factory, monkeypatch):
    """Issue 15, test 1: a container reads a lazy file in a loop (its cached pages dropped
    all the time, so every read reaches shoal-fs); kill -9 of shoal-fs, an upgrade (the
    node restarted with another version) and kill -9 of both the node and shoal-fs: the
    reads go on after a pause, none fails, every hash is right, and new containers run."""
    monkeypatch.delenv("SHOAL_VERSION", raising=False)
    _, lazy, manifest = lazy_app_image(module_registry, tmp_path_factory.mktemp("takeover app"), "takeover/app",
                                       ["/bin/true"])
    out_dir = Path(tempfile.mkdtemp(prefix="shoal-takeover-out-"))
    nodes: list[NodeProcess] = []
    container = "takeover-loop"
    with shoal_node_with_containerd("shoal-takeover-") as (node, ctd):
        root = node.root
        pulled = subprocess.run([SHOAL, "pull", lazy, "--address", ctd.address, "--namespace", "shoal-test"],
                                capture_output=True, text=True, check=False)
        assert pulled.returncode == 0, pulled.stderr
        lines = Lines(out_dir / "reads")
        dropper = None
        try:
            ctd.ctr("run", "-d", "--snapshotter", "shoal", "--mount",
                    f"type=bind,src={out_dir},dst=/out,options=rbind:rw", lazy, container, *LOOP)
            lines.thread.start()
            lines.more(3)
            busybox = root / "mnt" / manifest["layers"][0]["digest"].split(":")[1] / "bin/busybox"
            expected = hashlib.sha256(busybox.read_bytes()).hexdigest()
            dropper = PageDropper(busybox)
            dropper.thread.start()
            lines.more(5)
            pauses: dict[str, float] = {}
            held = _status(root)["fs_server"]["session_holder"]
            assert held is not None
            text = subprocess.run([SHOAL, "status", "--root", str(root)], capture_output=True, text=True, check=False)
            assert f"its FUSE session held by pid {held}" in text.stdout

            def after(event: str, since: float, old_pid: int | None) -> None:
                wait_for(lambda: (pid := _fs_pid(root)) is not None and pid != old_pid,
                         f"a new layer file system server after {event}", timeout=120, interval=0.2)
                lines.more(10)
                pauses[event] = lines.longest_gap(since)
                _new_container_works(ctd, lazy, f"takeover-new-{len(pauses)}")

            # 1. kill -9 of shoal-fs: the node restarts it, the new one takes the session over
            pid = _fs_pid(root)
            assert pid is not None
            since = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            after("kill -9 of shoal-fs", since, pid)
            assert "does not answer: restarting it" in node.log()
            # 2. an upgrade: the node restarted with another version hands the session over
            pid = _fs_pid(root)
            node.stop()
            monkeypatch.setenv("SHOAL_VERSION", "takeover-upgrade")
            since = time.monotonic()
            nodes.append(NodeProcess(root, node.socket, node.log_path, ("--config", str(root.parent / "node.toml"))))
            after("upgrade", since, pid)
            assert _status(root)["fs_server"]["pid"] != pid
            assert "handing its session over" in node.log()
            # 3. kill -9 of both shoal node and shoal-fs; a node started after takes over
            pid = _fs_pid(root)
            nodes[-1].kill()
            since = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            nodes.append(NodeProcess(root, node.socket, node.log_path, ("--config", str(root.parent / "node.toml"))))
            after("kill -9 of node and shoal-fs", since, pid)
            # the container's reads did reach the layer file system (not the page cache alone)
            first_layer = manifest["layers"][0]["digest"]
            reads = sum(ly["reads"] for ly in _status(root)["lazy_layers"] if ly["digest"] == first_layer)
            assert reads >= 10, reads
            fs_log = (root / "logs/fs.log").read_text()
            assert fs_log.count("taking over the FUSE session") == 3
            assert _status(root)["fs_server"]["session_holder"] == held  # one holder through it all
        finally:
            if dropper is not None:
                dropper.close()
            ctd.ctr("task", "kill", "-s", "KILL", container, check=False)
            lines.stop.set()
            lines.thread.join(10)
            for n in nodes:
                n.stop()
            ctd.ctr("container", "rm", container, check=False)
    failed = [line for line in lines.lines if not line.startswith(f"{expected}  ")]
    shutil.rmtree(out_dir, ignore_errors=True)
    assert failed == [], failed[:5]
    print(f"\ncontainer reads: {len(lines.lines)}, failed: {len(failed)}; longest pause: "
          + ", ".join(f"{k} {v:.2f}s" for k, v in pauses.items()))


def test_the_holder_hands_back_the_same_open_file_to_its_owner_alone(tmp_path):
    """put/get/drop over ROOT/fs-holder.sock: the descriptor handed back is the same open
    file (not a new open); another user cannot reach the holder; drop ends it."""
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    holder.start(str(root))
    pid = int(holder.ping(str(root))["pid"])
    r, w = os.pipe()
    try:
        assert holder.get(str(root)) is None  # holds nothing yet
        holder.put(str(root), w, {"mnt": "/x", "negotiated": "{}"})
        os.close(w)
        w = -1
        got = holder.get(str(root))
        assert got is not None and got[1] == {"mnt": "/x", "negotiated": "{}"}
        os.write(got[0], b"through the held descriptor")  # the pipe's write end, still open
        os.close(got[0])
        assert os.read(r, 100) == b"through the held descriptor"
        assert oct(os.stat(root / holder.SOCKET_NAME).st_mode & 0o777) == "0o600"
        child = os.fork()
        if child == 0:  # another user: refused
            try:
                os.chmod(root, 0o755)  # (only the socket's own permissions and the peer check stay)
                os.setgid(65534)
                os.setuid(65534)
                code = 0 if holder.ping(str(root)) is None and holder.get(str(root)) is None else 1
            except BaseException:  # noqa: BLE001 - the exit code says it
                code = 2
            os._exit(code)
        _, status = os.waitpid(child, 0)
        os.chmod(root, 0o700)
        assert os.waitstatus_to_exitcode(status) == 0
        holder.drop(str(root))
        wait_for(lambda: not _running(pid), "the holder's exit", timeout=10)
        assert os.read(r, 100) == b""  # every write end closed: the holder's copy went with it
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)
        if _running(pid):
            os.kill(pid, signal.SIGTERM)


def _answers(root: Path) -> bool:
    """The layer file system server of `root` answers on its control socket."""
    try:
        FSClient(str(root)).ping(timeout=1.0)
    except Exception:  # noqa: BLE001 - any failure: it does not answer
        return False
    return True


def _running(pid: int) -> bool:
    """Process `pid` runs (a zombie, exited and not reaped by this process, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_the_in_flight_table_keeps_what_was_read_and_not_answered(tmp_path):
    """session.InFlight: a request the kernel wrote into a reader's buffer is recorded
    until the reader says it is answered; a READ handed to a worker until its reply; a
    table written by a process that died (its mapping gone) still says so; requests that
    take no reply are not listed; a file that is not a table lists nothing."""
    from snapshotter.fs import protocol as p
    from snapshotter.fs.session import InFlight

    path = str(tmp_path / "fs-inflight")

    def request(opcode: int, unique: int, nodeid: int) -> bytes:
        return p.IN_HEADER.pack(p.IN_HEADER_SIZE, opcode, unique, nodeid, 0, 0, 1, 0)

    child = os.fork()
    if child == 0:  # the serving process: records, then dies without a word
        try:
            table = InFlight(path, 2, 8192)
            table.buffer(0)[:p.IN_HEADER_SIZE] = request(p.Opcode.GETATTR, 0x10, 7)
            table.buffer(1)[:p.IN_HEADER_SIZE] = request(p.Opcode.READ, 0x12, 9)
            table.defer(0x12, 9)  # handed on: recorded twice for a moment
            table.answered(1)
            done = table.defer(0x14, 11)
            table.done(done)  # answered by its worker
            table.defer(0x16, 1 << 32 | 5)
            table.defer(0x18, 13, p.Opcode.OPEN)  # a first open decided on a worker
            busy = table.busy()
            with open(f"{path}.busy", "w") as f:
                f.write(str(busy))
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    os.waitpid(child, 0)
    assert (tmp_path / "fs-inflight.busy").read_text() == "4"
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert InFlight.pending(path) == [(0x10, p.Opcode.GETATTR, 7), (0x12, p.Opcode.READ, 9),
                                      (0x16, p.Opcode.READ, 1 << 32 | 5), (0x18, p.Opcode.OPEN, 13)]
    # a predecessor's table of version 1 (its deferred records: unique and nodeid, all READs)
    old = tmp_path / "fs-inflight-v1"
    buffers = request(p.Opcode.LOOKUP, 0x30, 3).ljust(4096, b"\0")
    old.write_bytes(InFlight.HEADER.pack(InFlight.MAGIC, 1, 1, 4096, 2) + buffers
                    + struct.pack("<QQQQ", 0x32, 21, 0, 0))
    assert InFlight.pending(str(old)) == [(0x30, p.Opcode.LOOKUP, 3), (0x32, p.Opcode.READ, 21)]
    table = InFlight(path, 1, 8192)  # the next process's own table: nothing in flight
    table.buffer(0)[:p.IN_HEADER_SIZE] = request(p.Opcode.FORGET, 0x20, 7)
    assert InFlight.pending(path) == []
    (tmp_path / "other").write_bytes(b"not a table" * 100)
    assert InFlight.pending(str(tmp_path / "other")) == []
    assert InFlight.pending(str(tmp_path / "missing")) == []
