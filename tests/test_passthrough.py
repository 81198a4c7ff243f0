"""FUSE passthrough on the layer file system (snapshotter/fs/backing.py), on this
kernel's FUSE, a real registry and shoal's own layer file system server: a lazy file
whose content is one chunk already in the node's store is read and mapped by the kernel
from the store's file, with the right bytes, through a kill -9 of the server, never
from a store file that does not verify, never for a layer marked bad, and not at all
when [fetch] passthrough is false."""

from __future__ import annotations

import errno
import hashlib
import mmap
import os
import signal
from pathlib import Path

import pytest

from cache.content import ContentDir
from snapshotter.fs import holder
from snapshotter.fs.backing import RECORD
from snapshotter.remote import RemoteLayers
from tests.services import wait_for
from tests.test_lazy_fs import prepare_tree

pytestmark = [pytest.mark.registry]

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse", allow_module_level=True)

SMALL = {"a": 100_000, "b": 300_000, "c": 700_000, "d": 50_000}  # one chunk each (under 2 MiB)
BIG = 5 << 20  # cut into several chunks: read through the server


@pytest.fixture
def tree(tmp_path) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path / "tree"
    (root / "data").mkdir(parents=True)
    files = {name: os.urandom(size) for name, size in SMALL.items()}
    files["big"] = os.urandom(BIG)
    for name, data in files.items():
        (root / "data" / name).write_bytes(data)
    return root, files


@pytest.fixture
def node(tmp_path):
    made: list[RemoteLayers] = []

    def make(config: dict | None = None) -> RemoteLayers:
        layers = RemoteLayers(str(tmp_path / "node root"), config)
        made.append(layers)
        layers.start()
        return layers

    yield make
    for layers in made:
        layers.fs.release()
    if made:
        made[-1].fs.stop()
        answer = holder.ping(made[-1].fs.root)
        if answer is not None:
            holder.drop(made[-1].fs.root)
        assert not os.path.ismount(made[-1].fs.mnt)


def _warm(layers: RemoteLayers, layer: dict, restart: bool = True) -> None:
    """Every chunk of the layer in the node's store (a preheat's `full` warm-up), and
    then (`restart`) a new server and mount, as after a node's restart: the store warm,
    the memory cache empty (a chunk in memory is served from there, not passthrough)."""
    layers.fs.prefetch(whole=[layer["digest"]])

    def warm() -> bool:
        ly = layers.fs.warmth(whole=[layer["digest"]])["layers"][0]
        return ly["target_bytes"] > 0 and ly["warm_bytes"] == ly["target_bytes"]

    wait_for(warm, "the layer in the chunk store", timeout=60)
    if restart:
        layers.fs.stop()
        layers.fs.supervise()  # (it restores the layer from ROOT/layers)


def _layer_status(layers: RemoteLayers, layer: dict) -> dict:
    return next(ly for ly in layers.fs.status()["layers"] if ly["digest"] == layer["digest"])


def _read(path: Path, flags: int = 0) -> bytes:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        out = b""
        while part := os.read(fd, 1 << 20):
            out += part
        return out
    finally:
        os.close(fd)


def test_a_file_of_one_stored_chunk_is_read_and_mapped_from_the_store(node, tree, module_registry, tmp_path):
    layers = node()
    mount, layer = prepare_tree(layers, module_registry.host, "passthrough/read", tree[0], tmp_path)
    files = tree[1]
    _warm(layers, layer, restart=False)
    cold = _layer_status(layers, layer)
    assert _read(mount / "data/d") == files["d"]  # its chunk is in memory: served from there
    assert _layer_status(layers, layer)["passthrough_opens"] == 0 and _layer_status(layers, layer)["reads"] > cold[
        "reads"]
    _warm(layers, layer)
    before = _layer_status(layers, layer)
    assert layers.fs.status()["passthrough"]["on"] is True
    assert _read(mount / "data/a") == files["a"]
    with open(mount / "data/b", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert hashlib.sha256(m).digest() == hashlib.sha256(files["b"]).digest()
    after = _layer_status(layers, layer)
    assert after["passthrough_opens"] == before["passthrough_opens"] + 2
    assert after["reads"] == before["reads"]  # the kernel read them: no READ came here
    # a file of several chunks is read through the server, as before
    assert _read(mount / "data/big") == files["big"]
    big = _layer_status(layers, layer)
    assert big["reads"] > after["reads"] and big["passthrough_opens"] == after["passthrough_opens"]
    # an O_DIRECT open of a passthrough inode: its reads come to the server (an unaligned
    # buffer is fine), and its open keeps the inode's one mode
    fd = os.open(mount / "data/a", os.O_RDONLY)
    try:
        assert _read(mount / "data/a", os.O_DIRECT) == files["a"]
        assert os.pread(fd, 1000, 5) == files["a"][5:1005]
    finally:
        os.close(fd)
    final = _layer_status(layers, layer)
    assert final["passthrough_opens"] == big["passthrough_opens"] + 2 and final["reads"] > big["reads"]
    record = Path(layers.fs.root) / "layers" / layer["digest"].removeprefix("sha256:") / RECORD
    assert len(record.read_text().splitlines()) == 3  # a, b, big: decided once each
    assert layers.fs.status()["passthrough"]["passthrough_inodes"] == 2


def test_a_takeover_answers_opens_as_the_dead_server_did(node, tree, module_registry, tmp_path):
    """A file open through passthrough (and mapped) when shoal-fs is killed -9: the
    supervisor's new server takes the session over and opens that file again with the
    same backing file (another one would be the kernel's EIO), and a file the dead one
    left to the cached path (several chunks) stays there."""
    layers = node()
    mount, layer = prepare_tree(layers, module_registry.host, "passthrough/takeover", tree[0], tmp_path)
    files = tree[1]
    _warm(layers, layer)
    wait_for(lambda: (holder.ping(layers.fs.root) or {}).get("holding"), "the holder", timeout=10)
    with open(mount / "data/c", "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m, \
            open(mount / "data/big", "rb") as d:
        assert _layer_status(layers, layer)["passthrough_opens"] == 1
        first = layers.fs.ping()["pid"]
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: layers.fs.restarts >= 1, "the supervisor's restart", timeout=60)
        assert layers.fs.ping()["pid"] != first
        assert _read(mount / "data/c") == files["c"]  # a second open, while the first is open
        assert _read(mount / "data/big") == files["big"]
        assert m[:] == files["c"] and f.read() == files["c"] and d.read() == files["big"]
        status = _layer_status(layers, layer)
        assert status["passthrough_opens"] == 1  # (the new server's count: c once)
        assert "taking over the FUSE session" in (Path(layers.fs.root) / "logs/fs.log").read_text()


def test_a_store_file_that_does_not_verify_is_never_a_backing_file(node, tree, module_registry, tmp_path):
    layers = node()
    mount, layer = prepare_tree(layers, module_registry.host, "passthrough/corrupt", tree[0], tmp_path)
    files = tree[1]
    _warm(layers, layer)
    chunks = ContentDir.__new__(ContentDir)  # (only its path layout)
    chunks.data = Path(layers.fs.root) / "chunks" / "data"
    stored = ContentDir.path(chunks, "sha256:" + hashlib.sha256(files["c"]).hexdigest())
    spoiled = bytearray(stored.read_bytes())
    spoiled[1000] ^= 0xFF
    stored.write_bytes(bytes(spoiled))
    before = _layer_status(layers, layer)
    assert _read(mount / "data/c") == files["c"]  # through the server, from a good copy
    after = _layer_status(layers, layer)
    assert after["passthrough_opens"] == before["passthrough_opens"] and after["reads"] > before["reads"]
    assert layers.fs.status()["store"]["store"]["corrupt"] >= 1
    assert not stored.exists() or stored.read_bytes() != bytes(spoiled)


def test_no_open_of_a_layer_marked_bad_and_none_passthrough_when_off(node, tree, module_registry, tmp_path):
    layers = node()
    mount, layer = prepare_tree(layers, module_registry.host, "passthrough/bad", tree[0], tmp_path)
    files = tree[1]
    _warm(layers, layer)
    assert _read(mount / "data/a") == files["a"]
    assert _layer_status(layers, layer)["passthrough_opens"] == 1
    layers.fs.mark_bad(layer["digest"].removeprefix("sha256:"), "test: its blob proved bad")
    for name in ("a", "b"):  # decided passthrough, and not decided yet
        with pytest.raises(OSError) as e:
            _read(mount / "data" / name)
        assert e.value.errno == errno.EIO
    layers.fs.release()
    layers.fs.stop()
    off = node({"passthrough": False})
    (tmp_path / "off").mkdir()
    other = os.urandom(200_000)  # (another layer: the first one stays marked bad)
    (tree[0] / "data/b").write_bytes(other)
    mount2, layer2 = prepare_tree(off, module_registry.host, "passthrough/off", tree[0], tmp_path / "off")
    _warm(off, layer2)
    assert _read(mount2 / "data/b") == other
    status = off.fs.status()
    assert status["passthrough"]["on"] is False and "passthrough = false" in status["passthrough"]["off_reason"]
    assert _layer_status(off, layer2)["passthrough_opens"] == 0


def test_a_spoiled_record_is_read_line_by_line(tmp_path, caplog):
    """A takeover takes up what it can of a layer's record: lines that are not two
    numbers are skipped with a warning naming the file and line, the rest count; a
    layer with no record names nothing; detach removes the record."""
    from snapshotter.fs.backing import Backings

    layer = tmp_path / "layers" / "ab12"
    layer.mkdir(parents=True)
    (layer / RECORD).write_bytes(b"77 0\nnot a line\n78 5 9\n79 3\n\xff\xfe\n79 4\n")
    null = os.open(os.devnull, os.O_RDONLY)  # (not a FUSE connection: its ioctls are ENOTTY)
    backings = Backings(null, str(tmp_path / "layers"))
    with caplog.at_level("WARNING", logger="shoal.fs"):
        assert backings.attach("ab12") == 2
        assert backings.attach("none") == 0
    assert backings.known(77) == 0 and backings.known(79) == 3 and backings.known(78) is None
    warned = [r.getMessage() for r in caplog.records]
    assert sum("not 'INODE BACKING_ID'" in m for m in warned) == 3 and any(f"{RECORD} line 2" in m for m in warned)
    try:
        backings.detach("ab12")  # (closing id 3 fails, quietly: ENOTTY here)
    finally:
        os.close(null)
    assert not (layer / RECORD).exists() and backings.known(79) is None


def test_a_first_open_decided_while_its_layer_goes_records_nothing(tmp_path):
    """An unload that comes while a worker decides a first open (here: in the middle of
    it) leaves no record behind and keeps no mode for that inode; a layer attached again
    starts clean."""
    from snapshotter.fs.backing import CACHED, Backings

    (tmp_path / "layers" / "cd34").mkdir(parents=True)
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        backings = Backings(null, str(tmp_path / "layers"))
        backings.attach("cd34")
        assert backings.mode("cd34", 5, lambda: None) == CACHED  # (recorded: the layer lives)
        record = tmp_path / "layers" / "cd34" / RECORD
        assert record.read_text() == "5 0\n"

        def unloaded_meanwhile() -> None:
            backings.detach("cd34")

        assert backings.mode("cd34", 6, unloaded_meanwhile) == CACHED
        assert not record.exists() and backings.known(6) is None and backings.known(5) is None
        backings.attach("cd34")
        assert backings.mode("cd34", 7, lambda: None) == CACHED and record.read_text() == "7 0\n"
    finally:
        os.close(null)
