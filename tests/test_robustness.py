"""A node within what exists (issue 15): deadlines on every read that needs the network,
a store that stays inside the disk, a root only root can read. Real registry, real
shoal-fs over /dev/fuse, real shoal region; containerd where a container must start."""

from __future__ import annotations

import hashlib
import os
import shutil
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
        from cli.pull_status import fetch_figures

        assert fetch_figures(layers.fs.status()["store"])["hangs"]["origin"] == sources["hangs"]
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
        region, url, ca = start_region(registry.url, tmp_path / "region store", tmp_path / "region.log")
    except BaseException:
        registry.stop()
        raise
    try:
        layers = RemoteLayers(str(tmp_path / "node root"), {
            "read_deadline": DEADLINE, "source_backoff": 60.0, "region_url": url, "region_ca": ca})
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
        # a hung region answers neither the request nor (HTTPS) its TLS handshake: a hang
        # at the chain's deadline, or the region's own timeout; either way it is then
        # skipped (the chain's back-off, or the region source's own) for the next reads
        rs = sources["region"]
        assert rs["hangs"] + rs["errors"] >= 1 and rs["skipped"] + rs["not_here"] >= 1, rs
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
    with a warning (and `memory_cache = "64T"` to a quarter of the memory), a container that reads 128 MiB of lazy files gets them right, the
    store stays within the free space, and new containers start. A disk filled by
    someone else makes `ctr run` fail with one line, never a traceback, and works again
    once there is room."""
    from builder.convert import convert
    from tests.fixtures_services import containerd_missing
    from tests.lab.fromdir import ImageConfig, build_image
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
    config = '[fetch]\nstore_capacity = "10G"\nmemory_cache = "64T"\n'
    with shoal_node_with_containerd("shoal-full-", config, root_size="96m") as (node, ctd):
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
        # memory too: the chunk memory is at most a quarter of the machine's
        memory = status()["data_path"]["memory"]
        assert memory["memory_capacity"] <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4, memory
        assert "memory_cache" in fs_log and "quarter of this machine's memory" in fs_log
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


# --- the node's root is private ------------------------------------------------------------

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
CONNECT = "import socket, sys; socket.socket(socket.AF_UNIX).connect(sys.argv[1])"


def _as_nobody(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run([*NOBODY, *cmd], capture_output=True, text=True, timeout=30, check=False)


def _loose(root: Path) -> list[str]:
    """Paths under the node's root that a user other than root could read or enter by
    their mode (what keeps ROOT's own 0700 from being the only wall). Not looked into:
    the layer file system's mount (its files have their layers' modes), an unpacked
    layer's content (its tar's modes) and a snapshot's fs/ and work/ (containerd's modes)."""
    loose = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel = here.relative_to(root)
        if rel.parts[:1] == ("unpacked",) or (rel.parts[:1] == ("snapshots",) and len(rel.parts) == 2):
            dirnames[:] = []  # a layer's root and content, a snapshot's fs/ and work/
            continue
        for name in [*dirnames, *filenames]:
            p = here / name
            mode = os.lstat(p).st_mode
            if not p.is_symlink() and mode & 0o077:
                loose.append(f"{p.relative_to(root)} {oct(mode & 0o7777)}")
        if rel == Path("."):
            dirnames[:] = [d for d in dirnames if d != "mnt"]
    return loose


def test_the_node_root_is_root_s_alone(module_registry, tmp_path):
    """After a lazy and an unpacked image ran, nobody (uid 65534) can list or read
    anything under ROOT — the chunk store, metadata.db, layers/, unpacked/, the logs, the
    sockets — also with ROOT itself opened up to 0755 (every part is private on its own).
    Through the layer file system a file is served only as its layer's mode says: a
    0644 file to anyone, a root-owned 0600 file to root alone (default_permissions)."""
    from builder.convert import convert
    from tests.fixtures_services import containerd_missing
    from tests.lab.fromdir import ImageConfig, build_image
    from tests.rootfs import busybox_layer
    from tests.services import SHOAL, shoal_node_with_containerd

    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    registry = module_registry
    base = busybox_layer(tmp_path / "l1")
    pub = tmp_path / "l2" / "pub"
    (pub / "closed").mkdir(parents=True)
    (pub / "open").write_text("anyone may read this\n")
    (pub / "secret").write_text("root alone\n")
    (pub / "closed" / "inner").write_text("root alone too\n")
    os.chmod(pub / "open", 0o644)
    os.chmod(pub / "secret", 0o600)
    os.chmod(pub / "closed", 0o700)
    gz = f"{registry.host}/private/app:gzip"
    build_image([str(base), str(tmp_path / "l2")], f"docker://{gz}", ImageConfig(), plain_http=True,
                workdir=str(tmp_path))
    lazy = f"{registry.host}/private/app:lazy"
    convert(f"docker://{gz}", f"docker://{lazy}", plain_http=True)
    (tmp_path / "l3" / "etc").mkdir(parents=True)  # an unconverted image: the node unpacks it
    (tmp_path / "l3" / "etc" / "other").write_text("an unpacked layer\n")
    unpacked = f"{registry.host}/private/other:gzip"
    build_image([str(tmp_path / "l3")], f"docker://{unpacked}", ImageConfig(), plain_http=True,
                workdir=str(tmp_path))
    from builder.oci.refs import open_source

    with open_source(f"docker://{lazy}", plain_http=True) as s:
        import json

        top = json.loads(s.get_root().data)["layers"][1]["digest"]
    view = Path(tempfile_dir := subprocess.run(["mktemp", "-d", "/tmp/shoal-view-XXXXXX"], capture_output=True,
                                                 text=True, check=True).stdout.strip())
    os.chmod(view, 0o755)
    try:
        with shoal_node_with_containerd("shoal-priv-") as (node, ctd):
            for ref in (lazy, unpacked):
                pulled = subprocess.run([SHOAL, "pull", ref, "--address", ctd.address, "--namespace", "shoal-test"],
                                        capture_output=True, text=True, check=False)
                assert pulled.returncode == 0, pulled.stderr
            out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "priv-1", "/bin/sh", "-c",
                          "cat /pub/open /pub/secret; su -s /bin/sh nobody -c 'cat /pub/open; cat /pub/secret' 2>&1; "
                          "true").stdout
            assert out.count("anyone may read this") == 2 and out.count("root alone\n") == 1, out
            assert "Permission denied" in out, out
            done = subprocess.run([SHOAL, "status", "--root", str(node.root), "--json"], capture_output=True,
                                  text=True, check=True)
            assert json.loads(done.stdout)["unpacked_layers"], done.stdout
            root = Path(node.root)
            give_up = time.monotonic() + 60  # the chunks the container read reach the store
            while not any((root / "chunks" / "data").rglob("*")) or not any(
                    p.is_file() for p in (root / "chunks" / "data").rglob("*")):
                assert time.monotonic() < give_up, "no chunk reached the store"
                time.sleep(0.5)
            chunk = next(p for p in (root / "chunks" / "data").rglob("*") if p.is_file())
            assert oct(os.stat(root).st_mode & 0o777) == "0o700"
            assert _loose(root) == [], _loose(root)
            targets = [("ls", root), ("ls", root / "chunks" / "data"), ("cat", chunk), ("cat", root / "metadata.db"),
                       ("ls", root / "layers"), ("ls", root / "unpacked"), ("ls", root / "mnt"),
                       ("cat", root / "logs" / "fs.log")]
            sockets = [p for p in root.iterdir() if p.is_socket()]
            assert root / "fs.sock" in sockets
            os.chmod(root, 0o755)  # an admin's chmod, or a root made by someone else: the parts hold on their own
            try:
                for cmd, path in targets[1:]:
                    done = _as_nobody(cmd, str(path))
                    assert done.returncode != 0 and "Permission denied" in done.stderr, (cmd, path, done)
                for sock in sockets:
                    done = _as_nobody("/usr/bin/python3", "-c", CONNECT, str(sock))
                    assert done.returncode != 0 and "PermissionError" in done.stderr, (sock, done)
            finally:
                os.chmod(root, 0o700)
            for cmd, path in targets:
                assert _as_nobody(cmd, str(path)).returncode != 0, (cmd, path)
            # the layer file system itself, seen by nobody through a bind mount of the layer
            subprocess.run(["mount", "--bind", str(root / "mnt" / top[7:]), str(view)], check=True)
            try:
                done = _as_nobody("cat", str(view / "pub" / "open"))
                assert done.returncode == 0 and done.stdout == "anyone may read this\n", done
                for path in (view / "pub" / "secret", view / "pub" / "closed" / "inner"):
                    done = _as_nobody("cat", str(path))
                    assert done.returncode != 0 and "Permission denied" in done.stderr, (path, done)
                assert (view / "pub" / "secret").read_text() == "root alone\n"
            finally:
                subprocess.run(["umount", str(view)], check=False)
    finally:
        subprocess.run(["umount", "-l", str(view)], capture_output=True, check=False)
        os.rmdir(tempfile_dir)


# --- parts that cannot start ---------------------------------------------------------------


@pytest.mark.parametrize("config, broken, why", [
    ("", "mnt", "layer file system"),  # ROOT/mnt is a file: the layer file system cannot mount
    ("[swarm]\nenabled = true\n", None, "swarm cannot start"),  # no metadata service for the swarm
], ids=["layer-fs", "swarm"])
def test_a_part_that_cannot_start_stops_the_node_unless_told_to_run_without(config, broken, why):
    """`shoal node` whose layer file system or swarm cannot start exits 1 with one line
    naming the part and the key that would let it run without; with that key
    (`[fetch] lazy = false`, `[swarm] required = false`) it starts."""
    import tempfile

    from snapshotter.fs.client import FSClient
    from tests.services import SHOAL, NodeProcess, unmount_under

    short = Path(tempfile.mkdtemp(prefix="shoal-part-", dir="/tmp"))  # unix socket paths are short
    try:
        root = short / "root"
        root.mkdir(mode=0o700)
        if broken:
            (root / broken).write_text("not a directory\n")
        (short / "node.toml").write_text(config)
        cmd = [SHOAL, "node", "--root", str(root), "--socket", str(short / "s.sock"), "--config", str(short / "node.toml")]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            stop_process(proc)
            pytest.fail(f"shoal node kept running without its {why.split()[0]} part")
        assert proc.returncode == 1, err
        assert "Traceback" not in err, err
        last = err.strip().splitlines()[-1]
        assert why in last and ("lazy = false" in last or "required = false" in last), err
        # told to run without it, the node starts
        without = "[fetch]\nlazy = false\n" if broken else config + "required = false\n"
        (short / "node.toml").write_text(without)
        node = NodeProcess(root, short / "s.sock", short / "node.log", ("--config", str(short / "node.toml")))
        try:
            assert node.proc.poll() is None
        finally:
            assert node.stop() == 0, node.log()
    finally:
        FSClient(str(short / "root")).stop()
        unmount_under(short)
        shutil.rmtree(short, ignore_errors=True)
