"""A node within what exists (issue 15): deadlines on every read that needs the network,
a store that stays inside the disk, a root only root can read. Real registry, real
shoal-fs over /dev/fuse, real shoal region; containerd where a container must start."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from snapshotter.remote import RemoteLayers
from tests.services import start_region, start_registry, stop_process
from tests.test_lazy_fs import prepare_tree

pytestmark = [pytest.mark.registry]

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse", allow_module_level=True)

DEADLINE = 4.0  # the node's [fetch] read_deadline in these tests
BACKOFF = 2.0  # [fetch] source_backoff
HANG_MARGIN = 15.0  # a read longer than DEADLINE + this has hung (a hang check, not a speed check)


def _tree(root: Path, names: list[str], size: int = 1 << 20) -> dict[str, str]:
    (root / "data").mkdir(parents=True)
    digests = {}
    for name in names:
        data = os.urandom(size)
        (root / "data" / name).write_bytes(data)
        digests[name] = hashlib.sha256(data).hexdigest()
    return digests


def _read(path: Path, timeout: float) -> tuple[subprocess.CompletedProcess | None, float]:
    """`cat path` in a child (a read stuck in FUSE is killable, a thread is not): (its
    result, or None if it was still blocked after `timeout` seconds; the seconds taken)."""
    start = time.monotonic()
    try:
        done = subprocess.run(["cat", str(path)], capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return None, time.monotonic() - start
    return done, time.monotonic() - start


@pytest.fixture
def stopped():
    """Processes the test SIGSTOPs: continued (then stopped by their owner) on the way out."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def test_a_hung_registry_is_eio_within_the_deadline_and_recovers(tmp_path, stopped):
    """A registry that accepts connections and never answers (SIGSTOP): every read through
    the FUSE mount gets EIO within the deadline (not 3 x 60 s), the log names image, layer
    and file; the registry is then skipped at once; after it answers again, reads succeed
    without a restart."""
    (tmp_path / "registry").mkdir()
    registry = start_registry(tmp_path / "registry", None)
    layers = RemoteLayers(str(tmp_path / "node root"), {"read_deadline": DEADLINE, "source_backoff": BACKOFF})
    try:
        names = ["a", "b", "c", "d"]
        digests = _tree(tmp_path / "tree", names)
        path, layer = prepare_tree(layers, registry.host, "hung/img", tmp_path / "tree", tmp_path)
        os.kill(registry.pid, signal.SIGSTOP)
        stopped.append(registry.pid)
        taken = []
        for name in names[:3]:
            done, seconds = _read(path / "data" / name, DEADLINE + HANG_MARGIN)
            assert done is not None, f"read of data/{name} still blocked after {seconds:.0f}s"
            assert done.returncode != 0 and b"Input/output error" in done.stderr, done
            taken.append(seconds)
        log = Path(layers.root, "logs", "fs.log").read_text()
        errors = [line for line in log.splitlines() if "ERROR" in line and "data/a" in line]
        assert errors and "hung/img" in errors[0] and layer["digest"] in errors[0], log[-3000:]
        assert f"origin {registry.host}" in log and "unhealthy" in log, log[-3000:]
        sources = layers.fs.status()["store"]["sources"]["origin"]
        assert sources["hangs"] >= 1 and sources["skipped"] >= 1, sources
        os.kill(registry.pid, signal.SIGCONT)
        stopped.remove(registry.pid)
        # no restart: once the back-off ends, a read probes the registry and succeeds
        give_up = time.monotonic() + 3 * BACKOFF + DEADLINE + HANG_MARGIN
        while True:
            done, seconds = _read(path / "data" / "d", DEADLINE + HANG_MARGIN)
            assert done is not None, f"read of data/d still blocked after {seconds:.0f}s"
            if done.returncode == 0 or time.monotonic() > give_up:
                break
            time.sleep(0.5)
        assert done.returncode == 0, done.stderr
        assert hashlib.sha256(done.stdout).hexdigest() == digests["d"]
        assert "answers again" in Path(layers.root, "logs", "fs.log").read_text()
        print(f"hung registry: reads failed after {', '.join(f'{s:.1f}s' for s in taken)}")
    finally:
        layers.fs.stop()
        for pid in list(stopped):
            os.kill(pid, signal.SIGCONT)
        registry.stop()
    assert not os.path.ismount(layers.fs.mnt)


def test_a_hung_region_is_skipped_and_reads_go_to_the_origin(tmp_path, stopped):
    """A region cache that accepts connections and never answers (SIGSTOP of `shoal
    region`): reads still succeed, from the origin, each within the deadline; the region
    is marked unhealthy and skipped."""
    (tmp_path / "registry").mkdir()
    registry = start_registry(tmp_path / "registry", None)
    layers = None
    try:
        region, url = start_region(registry.url, tmp_path / "region store", tmp_path / "region.log")
    except BaseException:
        registry.stop()
        raise
    try:
        layers = RemoteLayers(str(tmp_path / "node root"), {
            "read_deadline": DEADLINE, "source_backoff": 60.0, "region_url": url})
        names = ["a", "b", "c"]
        digests = _tree(tmp_path / "tree", names)
        path, _ = prepare_tree(layers, registry.host, "hungregion/img", tmp_path / "tree", tmp_path)
        os.kill(region.pid, signal.SIGSTOP)
        stopped.append(region.pid)
        for name in names:
            done, seconds = _read(path / "data" / name, DEADLINE + HANG_MARGIN)
            assert done is not None, f"read of data/{name} still blocked after {seconds:.0f}s"
            assert done.returncode == 0, done.stderr
            assert hashlib.sha256(done.stdout).hexdigest() == digests[name]
        sources = layers.fs.status()["store"]["sources"]
        assert sources["region"]["hangs"] == 1 and sources["region"]["skipped"] >= 1, sources
        assert sources["origin"]["bytes"] >= 3 << 20, sources
        log = Path(layers.root, "logs", "fs.log").read_text()
        assert f"region cache {url}" in log and "unhealthy" in log, log[-3000:]
    finally:
        if layers is not None:
            layers.fs.stop()
        for pid in list(stopped):
            os.kill(pid, signal.SIGCONT)
        stop_process(region)
        region.stdout.close()
        registry.stop()


# --- the disk ----------------------------------------------------------------------------


def _free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_a_capacity_larger_than_the_disk_keeps_the_node_running(module_registry, tmp_path):
    """The node's root is a 96 MiB tmpfs, `store_capacity = "10G"`: the capacity is clamped
    with a warning, a container that reads 128 MiB of lazy files gets them right, the
    store stays within the free space, and new containers start. A disk filled by
    someone else makes `ctr run` fail with one line, never a traceback, and works again
    once there is room."""
    from builder.convert import convert
    from builder.oci.fromdir import ImageConfig, build_image
    from tests.fixtures_services import containerd_missing
    from tests.rootfs import busybox_layer
    from tests.services import SHOAL, CtrError, shoal_node_with_containerd

    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    registry = module_registry
    base = busybox_layer(tmp_path / "l1")
    digests = _tree(tmp_path / "l2", ["a", "b", "c", "d"], 32 << 20)
    whole = hashlib.sha256(b"".join((tmp_path / "l2/data" / n).read_bytes() for n in "abcd")).hexdigest()
    gz = f"{registry.host}/full/app:gzip"
    build_image([str(base), str(tmp_path / "l2")], f"docker://{gz}", ImageConfig(), plain_http=True,
                workdir=str(tmp_path))
    lazy = f"{registry.host}/full/app:lazy"
    convert(f"docker://{gz}", f"docker://{lazy}", plain_http=True)
    assert digests
    cmd = ["/bin/sh", "-c", "cat /data/a /data/b /data/c /data/d | sha256sum"]
    with shoal_node_with_containerd("shoal-full-", '[fetch]\nstore_capacity = "10G"\n', root_size="96m") as (node, ctd):
        import json

        pulled = subprocess.run([SHOAL, "pull", lazy, "--address", ctd.address, "--namespace", "shoal-test",
                                 "--json"], capture_output=True, text=True, check=False)
        assert pulled.returncode == 0, pulled.stderr
        out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "full-1", *cmd, timeout=300).stdout
        assert out.split()[0] == whole

        def status() -> dict:
            done = subprocess.run([SHOAL, "status", "--root", str(node.root), "--json"], capture_output=True,
                                  text=True, check=True)
            return json.loads(done.stdout)

        give_up = time.monotonic() + 60
        while status()["data_path"]["store"]["pending_writes"] and time.monotonic() < give_up:
            time.sleep(0.5)
        store = status()["data_path"]["store"]
        assert store["pending_writes"] == 0, store
        # new containers start (their snapshots and the metadata database need the room)
        out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "full-2", "/bin/sh", "-c",
                      "echo started > /tmp/x; cat /tmp/x; sha256sum /data/a").stdout
        assert out.startswith("started\n") and digests["a"] in out
        assert 0 < store["capacity_bytes"] < 96 << 20, store
        assert store["size_bytes"] <= store["capacity_bytes"], store
        assert _free_bytes(node.root) >= 40 << 20, (store, _free_bytes(node.root))
        fs_log = Path(node.root, "logs", "fs.log").read_text()
        assert "more than the disk holds" in fs_log, fs_log[-3000:]
        # a disk filled by someone else: one line naming the database, no traceback
        filler = node.root / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M"], capture_output=True, check=False)
        try:
            with pytest.raises(CtrError) as err:
                ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "full-3", "/bin/true")
            message = str(err.value)
            print("full disk:", message.splitlines()[-1])
            assert "disk full" in message or "no space left" in message.lower(), message
        finally:
            filler.unlink()
        assert "Traceback" not in node.log_path.read_text(errors="replace"), node.log()
        out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "full-4", "/bin/echo", "again").stdout
        assert out == "again\n"
