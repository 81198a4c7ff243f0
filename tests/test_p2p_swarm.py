"""The swarm across real processes and a real network (issue 5): every node is a real
`shoal node` (snapshotter gRPC, FUSE layer file system, libtorrent swarm) in its own
network namespace with its own address; the origin (Debian's docker-registry) and a real
`shoal region` (cache, tracker, torrent metadata) run in a hub namespace that holds the
bridge. Addresses are 192.0.2.0/24 (TEST-NET-1) and exist only inside these namespaces
(tests/lab/netlab.py).

A layer reaches a node as containerd hands it over: a Prepare with the remote-snapshot
labels on the node's socket (tests/lab/provide.py provide_layers). The test then reads the
layer's files through the node's FUSE mount (ROOT/mnt/<hex>: processes enter only the
namespace's network, so the mounts are the test's too), which is the on-demand path, or
asks the node's swarm control socket for the whole blob (the bulk path).

Bytes are counted where they leave: the origin's own access log, the region's /-/status,
each node's `shoal status --json`. Every process is stopped by PID, every mount under
the nodes' roots unmounted and every namespace removed on teardown, also when a test
fails (netlab.Lab.close).
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("libtorrent", reason="libtorrent is needed for the swarm (shoal[node])")
pytest.importorskip("aiohttp", reason="aiohttp is needed for the region (shoal[node])")

from shoal.metrics import parse as parse_metrics
from snapshotter.status import node_status
from tests.lab import netlab

MiB = 1 << 20
PIECE = 256 << 10  # the region's piece size for blobs this small (p2p/metainfo.py)
# where a test asserts that bytes came from peers: a first read waits longer to meet its
# peers, and a read longer for their pieces, than the defaults (0.5 s, 1 s), so that a
# loaded machine (two test workers) does not send them to the region instead
PATIENT = {"settle_wait": 5.0, "peer_wait": 5.0}


_MISSING = netlab.lab_missing(fuse=True)
pytestmark = [pytest.mark.registry, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]


class World:
    """The lab shared by the tests of this module: the hub (registry, region) and five
    node namespaces; `shoal node` processes are started per test."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        # unix socket paths (node gRPC, layer file system, swarm control) must be short
        self.short = Path(tempfile.mkdtemp(prefix="shsw-", dir="/tmp"))
        self.lab = netlab.Lab()
        try:
            self.registry = netlab.start_registry(self.lab, workdir)
            self.region = netlab.start_region(self.lab, workdir, self.registry)
            self.hosts = [self.lab.add_node() for _ in range(5)]
        except BaseException:
            self.close()
            raise
        self._seed = 0
        self.layouts: dict[str, Path] = {}  # image name -> its OCI layout

    def close(self) -> None:
        self.lab.close()
        shutil.rmtree(self.short, ignore_errors=True)

    def image(self, sizes: dict[str, int], cold: bool = False) -> tuple[netlab.LabImage, dict[str, str]]:
        """A new one-layer image of random files (name -> size), converted to zstd:chunked,
        pushed to the origin (with its layer's piece hashes), its layer's torrent ready at
        the region (`cold`: the region has not seen it); with the sha256 of each file."""
        from builder.convert import convert
        from tests.lab.fromdir import build_image

        self._seed += 1
        work = self.workdir / f"image{self._seed}"
        tree = work / "tree"
        tree.mkdir(parents=True)
        files = {}
        for i, (name, size) in enumerate(sizes.items()):
            data = random.Random(self._seed * 100 + i).randbytes(size)
            (tree / name).write_bytes(data)
            files[name] = hashlib.sha256(data).hexdigest()
        build_image([str(tree)], f"oci:{work}/plain", compression="none", workdir=str(work))
        convert(f"oci:{work}/plain", f"oci:{work}/chunked")
        publish = netlab.push_image if cold else functools.partial(netlab.publish_image, region=self.region)
        image = publish(self.lab, self.registry, layout=work / "chunked", name=f"swarm/img{self._seed}:v1")
        self.layouts[image.name] = work / "chunked"
        return image, files

    def origin_bytes(self, digest: str) -> int:
        return self.registry.bytes_written(digest)[1]

    def region_bytes(self) -> int:
        return self.region.status(self.lab)["region"]["bytes_served"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    world = World(tmp_path_factory.mktemp("swarm"))
    try:
        yield world
    finally:
        world.close()


@pytest.fixture
def nodes(world):
    """start(n, **options) -> `shoal node`s on the first n hosts; after the test all are
    stopped (by PID: node and layer file system server), unmounted, links uncapped."""
    started: list[netlab.LabNode] = []

    def start(n: int = 4, **kwargs) -> list[netlab.LabNode]:
        run = Path(tempfile.mkdtemp(dir=world.short))
        out = netlab.start_nodes(world.lab, world.hosts[:n], run, world.region, world.registry, **kwargs)
        started.extend(out)
        return out

    try:
        yield start
    finally:
        netlab.stop_nodes(world.lab, started)
        for node in started:
            assert not node.unmount(), f"{node.root}: still mounted"
        for host in world.hosts:
            world.lab.uncap(host)






def _provide(world: World, nodes: list[netlab.LabNode], image: netlab.LabImage) -> list[Path]:
    """Each node provides the image's one layer (lazily); its mount point on each."""
    return [mounts[0] for mounts in netlab.parallel(lambda node: node.provide(world.lab, image), nodes)]


def _read(mount: Path, files: dict[str, str]) -> dict[str, str]:
    """Every file of the layer read through the node's FUSE mount (files at once): name -> sha256."""
    names = sorted(files)
    return dict(zip(names, netlab.parallel(lambda name: netlab.sha256_file(mount / name), names)))


def test_a_blob_one_node_fetched_comes_from_peers(world, nodes):
    """(1) Four `shoal node`s provide a lazy layer of large files. Node 1 reads every
    file (the region serves it, piece-aligned, into node 1's swarm); nodes 2-4 then read
    them all at once, mostly from peers: region and origin serve about one copy."""
    image, files = world.image({"a.bin": 20 * MiB, "b.bin": 12 * MiB, "c.bin": 4 * MiB})
    [layer] = image.layers
    digest, size = layer["digest"], layer["size"]
    origin_before, region_before = world.origin_bytes(digest), world.region_bytes()
    group = nodes(4, swarm=PATIENT)
    mounts = _provide(world, group, image)
    assert _read(mounts[0], files) == files
    assert netlab.parallel(lambda m: _read(m, files), mounts[1:]) == [files] * 3

    region_served = world.region_bytes() - region_before
    origin_served = world.origin_bytes(digest) - origin_before  # each node's TOC read (Prepare)
    statuses = [node.status() for node in group]
    figures = [s["fetch"] for s in statuses]
    print(f"\nblob {size:,} B: region served {region_served:,} B ({region_served / size:.3f} copies), "
          f"origin {origin_served:,} B after the publish, {world.origin_bytes(digest):,} B in all")
    for node, f in zip(group, figures):
        print(f"  {node.host.ip}: peers {f['bytes_from_peers']:,} region {f['bytes_from_region']:,} "
              f"origin {f['bytes_from_origin']:,} to peers {f['bytes_to_peers']:,} "
              f"peers connected {f['peers_connected']}")
    assert region_served <= 1.05 * size, f"region served {region_served / size:.2f} copies"
    assert origin_served < 0.01 * size, "the origin served layer bytes to nodes (beyond their TOCs)"
    assert world.origin_bytes(digest) <= 1.05 * size, "the origin served more than one copy in all"
    assert figures[0]["bytes_from_region"] >= 0.9 * size and figures[0]["bytes_from_peers"] < 0.1 * size
    for f in figures[1:]:
        assert f["bytes_from_peers"] >= 0.9 * size, f
        assert f["bytes_from_region"] <= 0.1 * size, f
        assert f["bytes_from_origin"] == 0, f
        assert f["peers_connected"] >= 1, f
    assert sum(f["bytes_to_peers"] for f in figures) >= 3 * 0.9 * size
    assert all(s["lazy_layers"][0]["digest"] == digest for s in statuses)
    text = subprocess.run([netlab.SHOAL, "status", "--root", str(group[1].root)], capture_output=True, text=True,
                          check=True).stdout
    assert re.search(r"bytes from: store [\d,]+, peers [\d,]{10}, region [\d,]+, origin 0\n", text), text
    assert re.search(r"swarm: [1-9] peers connected, 1 blobs", text), text


def test_a_node_killed_mid_transfer(world, nodes):
    """(2) The only complete node is killed (node and layer file system server, SIGKILL)
    while three others download the blob from it through the swarm: they finish from
    each other and the region, every byte is right (whole blob and every file through
    FUSE), and the region served about one copy."""
    image, files = world.image({"a.bin": 24 * MiB, "b.bin": 16 * MiB})
    [layer] = image.layers
    digest, size = layer["digest"], layer["size"]
    a, *others = group = nodes(4)
    mounts = _provide(world, group, image)
    a.download(digest)
    for node in group:
        world.lab.cap(node.host, 80)  # 10 MB/s each way: the transfer takes seconds
    region_before = world.region_bytes()
    results: dict = {}

    def download(node: netlab.LabNode) -> None:
        try:
            results[node.host.ip] = node.download(digest, timeout=120)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            results[node.host.ip] = exc

    threads = [threading.Thread(target=download, args=(node,)) for node in others]
    for t in threads:
        t.start()
    got = [0]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # kill node 1 once each of the others has about a quarter
        got = [node_status(str(node.root))["fetch"]["bytes_from_peers"] for node in others]
        if min(got) >= size // 4:
            break
        time.sleep(0.05)
    assert min(got) >= size // 4 and max(got) < size, f"no kill in the middle of the transfer: {got}"
    a.stop(world.lab, signal.SIGKILL)
    for t in threads:
        t.join(180)
    for node in others:
        path = results.get(node.host.ip)
        assert isinstance(path, str), f"{node.host.ip}: {path!r}\n{node.log()}"
        assert "sha256:" + netlab.sha256_file(path) == digest
    assert netlab.parallel(lambda m: _read(m, files), mounts[1:]) == [files] * 3
    region_served = world.region_bytes() - region_before
    print(f"\nkilled at {[g / size for g in got]} of the blob from peers; region then served "
          f"{region_served:,} B ({region_served / size:.3f} copies)")
    # what node 1 had not passed on yet came from the region: about once, not once per node
    assert region_served <= 1.05 * size, \
        f"region served {region_served / size:.2f} copies after the kill; {_region_duplicates(others)}"


def _wait_for_a_seed(node: netlab.LabNode, digest: str, timeout: float = 30) -> None:
    """Until `node`'s swarm is connected to a peer that has every piece of `digest`."""
    deadline = time.monotonic() + timeout
    torrents: list = []
    while time.monotonic() < deadline:
        torrents = node.status()["data_path"]["sources"]["swarm"].get("torrents") or []
        if any(t["digest"] == digest and t["seeds"] >= 1 for t in torrents):
            return
        time.sleep(0.1)
    raise AssertionError(f"{node.host.ip} never saw a seed of {digest} in {timeout:.0f} s: {torrents}")


def _region_duplicates(nodes: list[netlab.LabNode]) -> str:
    """What the nodes say of what they took from the region, the extents they fetched
    for others (their swarm stalled) and their ranks among the downloaders (a change
    moves extents between owners): a failure's message, to tell where duplicates from
    the region came from."""
    fetch = {node.host.ip: node_status(str(node.root))["fetch"] for node in nodes}
    helped = {ip: f["stall_help_extents"] for ip, f in fetch.items()}
    region = {ip: f["bytes_from_region"] for ip, f in fetch.items()}
    lines = [f"{node.host.ip}: {line}" for node in nodes for line in node.log(1 << 20).splitlines()
             if "does not own" in line or "downloaders" in line or "fallback fetch" in line]
    return f"stall help {helped}, bytes from the region {region}:\n" + "\n".join(lines)


def test_a_peer_sending_corrupt_pieces_is_banned(world, nodes):
    """(3) Node 1's torrent storage is corrupted after it completed the blob: node 2,
    reading the layer's files through FUSE, detects the bad pieces (hash check), bans
    node 1 and takes the data from the region; every file is right, the bad pieces and
    the ban are counted (`shoal status`) and logged. Node 1's own reads of its damaged
    storage fail their chunk digests and come from the region."""
    image, files = world.image({"a.bin": 16 * MiB})
    [layer] = image.layers
    digest, size = layer["digest"], layer["size"]
    # node 2 must ask node 1 for pieces for there to be a bad one to catch: on a loaded
    # machine (two failures in 33 runs, 2026-12-07: node 2 took all 16 MiB from the
    # region, no hash failure, with settle_wait 0.5 s and 2 s alike) node 1's answer can
    # take longer than the default peer_wait (1 s), and its pieces then come from the
    # region first; or node 2 reads before node 1's HAVEs are in. The failure message
    # carries node 2's swarm counters (pieces asked of peers, peer_timeouts) and log.
    a, b = nodes(2, swarm={"peer_wait": 4.0})
    mount_a, mount_b = _provide(world, [a, b], image)
    path = a.download(digest)
    with open(path, "r+b") as fh:  # every fourth piece gets 4 KiB of garbage
        for p in range(1, size // PIECE, 4):
            fh.seek(p * PIECE + 1000)
            fh.write(os.urandom(4096))
    _wait_for_a_seed(b, digest)
    assert _read(mount_b, files) == files
    status = b.status()
    f = status["fetch"]
    swarm = {k: v for k, v in status["data_path"]["sources"]["swarm"].items() if k != "torrents"}
    assert f["hash_failures"] >= 1, f"{f}\n{swarm}\n" + "\n".join(
        line for line in b.log(1 << 20).splitlines()[-400:] if digest in line or "swarm" in line or "peer" in line)
    assert f["peers_banned"] >= 1, f
    assert f["bytes_from_region"] > 0, f
    assert not any(f["verify_failures"].values()), f  # libtorrent dropped the bad pieces: no source sent any
    log = b.log(1 << 20)
    assert "failed its hash check" in log and "banned peer" in log
    # node 1 itself reads its damaged storage: the chunks fail their digest, come from
    # the region, and the torrent is dropped
    assert _read(mount_a, files) == files
    f = a.status()["fetch"]
    assert f["verify_failures"]["swarm"] >= 1 and f["bytes_from_region"] > 0, f
    assert any("dropping the torrent" in line and digest in line for line in a.log(1 << 20).splitlines())


def test_a_corrupt_region_copy_reaches_no_reader_through_the_swarm(world, nodes):
    """(3b) The region's stored copy of the layer rots after the region filled it: a
    node reading the layer's files through FUSE takes the pieces no peer has from its
    swarm's fallback; the region's fail their SHA-1, so they come from the origin. Every
    file is right, the region is counted (`shoal status`) and logged once; told by the
    node, the region checks its copy and drops it."""
    image, files = world.image({"a.bin": 8 * MiB})
    [layer] = image.layers
    digest, size = layer["digest"], layer["size"]
    [stored] = [p for p in (world.workdir / "region").rglob(digest[7:]) if p.is_file()]
    with open(stored, "r+b") as fh:  # every fourth piece gets one inverted byte
        for p in range(0, size // PIECE, 4):
            fh.seek(p * PIECE + 500)
            byte = fh.read(1)
            fh.seek(p * PIECE + 500)
            fh.write(bytes([byte[0] ^ 0xFF]))
    origin_before = world.origin_bytes(digest)
    [a] = nodes(1)
    [mount] = _provide(world, [a], image)
    assert _read(mount, files) == files
    f = a.status()["fetch"]
    assert f["verify_failures"]["region"] >= 1, f
    assert f["verify_failures"].get("origin", 0) == 0, f
    assert world.origin_bytes(digest) - origin_before >= PIECE  # the bad pieces, from the origin
    lines = [line for line in a.log(1 << 20).splitlines() if "failed verification" in line and digest in line]
    assert len(lines) == 1 and "from region" in lines[0] and "SHA-1" in lines[0], lines
    deadline = time.monotonic() + 30
    while not world.region.status(world.lab)["region"]["store_verify_failures"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert world.region.status(world.lab)["region"]["store_verify_failures"] >= 1, "the region kept its bad copy"
    # dropped, or already filled again from the origin by a later request: never the bad copy
    assert not stored.exists() or "sha256:" + netlab.sha256_file(stored) == digest


def _gzip_image(world: World, name: str, sizes: tuple[int, ...]) -> tuple[netlab.LabImage, dict[str, str]]:
    """A one-layer gzip image of random files (not converted: nodes unpack its layer),
    pushed to the origin as it is, its layer's torrent ready at the region; with the
    sha256 of each file (f0, f1, ...)."""
    from tests.lab.fromdir import build_image

    work = world.workdir / name
    tree = work / "tree"
    tree.mkdir(parents=True)
    files = {}
    for i, size in enumerate(sizes):
        data = random.Random(f"{name}{i}").randbytes(size)
        (tree / f"f{i}").write_bytes(data)
        files[f"f{i}"] = hashlib.sha256(data).hexdigest()
    build_image([str(tree)], f"oci:{work}/gz:v1", compression="gzip", workdir=str(work))
    image = netlab.push_unchanged(world.lab, world.registry, work / "gz", "v1", f"swarm/{name}")
    for layer in image.layers:
        netlab.wait_torrent(world.lab, world.region, world.registry, image.repository, layer["digest"])
    return image, files


def _unpacked(node: netlab.LabNode, status: dict, files: dict[str, str]) -> dict[str, str]:
    """The node's one unpacked layer's files: name -> sha256."""
    [unpacked] = status["unpacked_layers"]
    folder = node.root / "unpacked" / unpacked.split(":", 1)[1]
    return {name: netlab.sha256_file(folder / name) for name in files}


def test_a_peer_sending_corrupt_pieces_makes_no_bad_unpack(world, nodes):
    """(3c) The bulk path of a layer the node unpacks (a gzip layer, no TOC): node 1
    unpacks it, its whole blob through its swarm, and seeds it; its torrent storage is
    then corrupted (every fourth piece). Node 2 unpacks the layer: the bad pieces node 1
    sends fail their hash, node 1 is banned, the rest comes from the region; node 2's
    files are right and its unpack bytes are the swarm's."""
    image, files = _gzip_image(world, "gzip-corrupt", (10 * MiB, 6 * MiB))
    [layer] = image.layers
    digest, size = layer["digest"], layer["size"]
    a, b = nodes(2, swarm=PATIENT)
    assert a.provide(world.lab, image) == []  # unpacked, not lazy
    assert a.status()["fetch"]["unpack_swarm_bytes"] == size
    path = a.root / "swarm" / "data" / ("sha256-" + digest[7:])
    with open(path, "r+b") as fh:  # every fourth piece gets 4 KiB of garbage
        for p in range(1, size // PIECE, 4):
            fh.seek(p * PIECE + 1000)
            fh.write(os.urandom(4096))
    assert b.provide(world.lab, image) == []
    status = b.status()
    assert _unpacked(b, status, files) == files
    f = status["fetch"]
    assert f["unpack_bytes"] == f["unpack_swarm_bytes"] == size, (f, b.log())
    assert f["hash_failures"] >= 1, f
    assert f["peers_banned"] >= 1, f
    assert f["bytes_from_peers"] > 0 and f["bytes_from_region"] > 0, f
    assert status["node_fetch"]["blobs"]["swarm_copies_bad"] == 0  # the swarm let no bad piece into the file
    log = b.log(1 << 20)
    assert "failed its hash check" in log and "banned peer" in log


def test_a_rotted_swarm_copy_makes_no_bad_unpack(world, nodes):
    """(3d) A node's own complete copy of a blob in its torrent storage rots after the
    swarm checked it (seeded, so not checked again): the node unpacking that layer reads
    the file, finds it does not hash to the digest, drops it from the swarm and unpacks
    the layer again from the region; nothing built from the bad copy is committed."""
    from shoal import localrpc

    image, files = _gzip_image(world, "gzip-rot", (8 * MiB,))
    [layer] = image.layers
    digest, size = layer["digest"], layer["size"]
    [a] = nodes(1)
    blob = {"registry": world.registry.host, "repository": image.repository, "digest": digest, "size": size,
            "plain_http": True}
    path = localrpc.call(str(a.root / "fs.sock"), {"op": "download", "blob": blob, "timeout": 120}, 150)["path"]
    with open(path, "r+b") as fh:  # one inverted byte in the middle
        fh.seek(size // 2)
        byte = fh.read(1)
        fh.seek(size // 2)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert a.provide(world.lab, image) == []
    status = a.status()
    assert _unpacked(a, status, files) == files
    blobs = status["node_fetch"]["blobs"]
    assert blobs["swarm_copies_bad"] == 1 and blobs["whole_swarm"] == 1, blobs  # (its digest_mismatches: 1)
    assert status["fetch"]["unpack_bytes"] == 2 * size and status["fetch"]["unpack_swarm_bytes"] == size
    log = a.log(1 << 20)
    assert "the swarm's copy does not hash to" in log and "dropping the torrent" in log, log


@pytest.mark.skipif(shutil.which("aria2c") is None, reason="aria2c is not installed (Debian package aria2)")
def test_aria2_without_the_node_token_gets_nothing(world, nodes):
    """(4) A stock BitTorrent client with only the .torrent the region publishes (and so
    the tracker's address, but not the region's node token) is refused by the tracker
    and gets no byte of the blob from the two `shoal node`s seeding it."""
    image, _ = world.image({"a.bin": 12 * MiB})
    [layer] = image.layers
    digest = layer["digest"]
    seeders = nodes(2)
    _provide(world, seeders, image)
    for node in seeders:
        node.download(digest)
    unauthorized = world.region.status(world.lab)["swarm"]["unauthorized"]
    uploaded = [node.status()["fetch"]["bytes_to_peers"] for node in seeders]
    out = world.workdir / f"aria2-{digest[7:19]}"
    out.mkdir()
    (out / "blob.torrent").write_bytes(image.torrents[digest])
    proc = world.lab.run(world.hosts[4], [
        "aria2c", "--dir", str(out / "data"), "--seed-time=0", "--enable-dht=false", "--enable-dht6=false",
        "--bt-enable-lpd=false", "--enable-peer-exchange=false", "--listen-port=6891",
        "--bt-stop-timeout=8", "--summary-interval=0", "--console-log-level=warn",
        f"--ca-certificate={world.region.ca}", str(out / "blob.torrent")], timeout=90)
    assert proc.returncode != 0, proc.stdout[-2000:]
    blob = out / "data" / ("sha256-" + digest[7:])
    assert not blob.exists() or not blob.read_bytes().strip(b"\0"), "aria2 got bytes of the blob"
    assert world.region.status(world.lab)["swarm"]["unauthorized"] > unauthorized  # it asked, and was refused
    assert [node.status()["fetch"]["bytes_to_peers"] for node in seeders] == uploaded


def test_node_and_region_metrics(world, nodes):
    """`shoal node`'s /metrics ([metrics] address) and `shoal region`'s /-/metrics, in
    Prometheus text: the node's bytes by source, peers and layers agree with `shoal
    status`; the region's cache and tracker figures with its /-/status."""
    image, files = world.image({"a.bin": 8 * MiB})
    [layer] = image.layers
    size = layer["size"]
    a, b = nodes(2, metrics=True, swarm=PATIENT)
    mount_a, mount_b = _provide(world, [a, b], image)
    assert _read(mount_a, files) == files
    assert _read(mount_b, files) == files

    before = b.status()["fetch"]  # counters only grow: the metrics lie between two status reads
    m = parse_metrics(b.metrics(world.lab))
    after = b.status()["fetch"]
    for source in ("store", "peers", "region", "origin"):
        key = f"bytes_from_{source}"
        assert before[key] <= m[f'shoal_node_fetched_bytes_total{{source="{source}"}}'] <= after[key], source
    assert m['shoal_node_fetched_bytes_total{source="peers"}'] >= 0.9 * size
    assert m["shoal_node_swarm_peers_connected"] >= 1
    assert m['shoal_node_layers{kind="lazy"}'] == 1 and m["shoal_node_layer_fs_up"] == 1
    assert parse_metrics(a.metrics(world.lab))["shoal_node_uploaded_bytes_total"] >= 0.9 * size

    before = world.region.status(world.lab)
    text = world.region.metrics(world.lab)
    after = world.region.status(world.lab)
    r = parse_metrics(text)
    for metric, key in (("served_bytes_total", "bytes_served"), ("cache_hits_total", "hits"),
                        ("origin_bytes_total", "origin_bytes")):
        assert before["region"][key] <= r[f"shoal_region_{metric}"] <= after["region"][key], metric
    assert r["shoal_region_origin_bytes_total"] >= size  # every image of this module was filled once
    assert r["shoal_region_tracker_peers"] >= 2 and r["shoal_region_tracker_torrents"] >= 1
    assert r["shoal_region_torrents_made_total"] == after["swarm"]["torrents"]["made"] >= 1
    assert "# TYPE shoal_region_served_bytes_total counter" in text


def _preheat(world: World, image: netlab.LabImage, names: list[str], mode: str) -> dict:
    """`shoal prefetch --region --wait --json` for these nodes (in the hub): the job's final document."""
    import json

    token_file = str(Path(world.region.token_file).parent / "prefetch-token")
    proc = world.lab.run(world.lab.hub, [netlab.SHOAL, "prefetch", image.name, "--region", world.region.url,
                                         "--ca", world.region.ca, "--token-file", token_file, "--nodes",
                                         ",".join(names), "--mode", mode, "--wait", "--timeout", "120", "--json"],
                         timeout=200, env=netlab._env())
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_preheat_job_warms_four_nodes_through_the_swarm_at_one_origin_copy(world, nodes):
    """The region's preheat API over the swarm: `shoal prefetch --region --mode full` for
    four registered nodes (named after their namespaces); every node warm, measured by
    itself; the origin served one copy of the layer; the region sent about one copy too
    (each node fetches its own part of the target first, rank i of 4, and the rest from
    the peers that fetched it): not a copy per node."""
    image, _ = world.image({"a.bin": 12 * MiB, "b.bin": 4 * MiB})
    started = nodes(4)
    names = [n.host.ns for n in started]
    (layer,) = image.layers
    job = _preheat(world, image, names, "full")
    assert job["state"] == "ready" and job["ready_nodes"] == 4, "\n".join(n.log() for n in started)
    assert {n["name"] for n in job["nodes"]} == set(names)
    assert all(n["state"] == "warm" and n["warm_bytes"] == n["target_bytes"] > 15 * MiB for n in job["nodes"])
    target = job["nodes"][0]["target_bytes"]  # one node's (the same on each)
    origin = world.origin_bytes(layer["digest"])
    fetched = [n.status()["fetch"] for n in started]
    peers = sum(f["bytes_from_peers"] for f in fetched)
    region = sum(f["bytes_from_region"] for f in fetched)
    print(f"preheat over the swarm: 4 nodes, target {target} B per node (layer {layer['size']} B); "
          f"origin served {origin} B in all ({origin / target:.2f}x), the region {job['region_bytes']} B during "
          f"the job ({job['region_bytes'] / target:.2f}x); the nodes took {peers} B from peers and {region} B "
          f"from the region ({region / target:.2f}x); the job: peer_bytes {job.get('peer_bytes')} B")
    assert origin <= 1.05 * layer["size"]  # one copy for the four nodes (and the torrent's fill)
    assert job["region_bytes"] <= 1.5 * target, "the region sent a copy per node, not about one for all"
    assert region <= 1.5 * target
    assert peers >= 2 * target  # the other copies came from the swarm
    assert job["peer_bytes"] == sum(n["peer_bytes"] for n in job["nodes"]) >= 2 * target  # as the nodes reported


def test_a_profile_preheat_job_sends_about_one_copy_of_the_profile_from_the_region(world, nodes):
    """Mode profile over the swarm: a fifth node reads two of the layer's three files and
    publishes what it read (`shoal profile save --push`), and stops; a job for the four others warms
    the profile's chunks on each (not the third file's), the region sending about one
    copy of the profile for the four (their parts of it first, the rest from each other)."""
    image, files = world.image({"a.bin": 10 * MiB, "b.bin": 6 * MiB, "c.bin": 8 * MiB})
    *started, recorder = nodes(5)
    (mount,) = _provide(world, [recorder], image)
    assert _read(mount, {k: files[k] for k in ("a.bin", "b.bin")}) == {k: files[k] for k in ("a.bin", "b.bin")}
    netlab._shoal(world.lab, ["profile", "save", image.name, "--root", str(recorder.root), "--push",
                              "--plain-http"], host=recorder.host)
    # gone, as a crashed machine (its layer file system would seed the profile's pieces: the
    # region's share of a job is what this test measures)
    recorder.stop(world.lab, signal.SIGKILL)
    region_before = world.region_bytes()
    job = _preheat(world, image, [n.host.ns for n in started], "profile")
    assert job["state"] == "ready" and job["ready_nodes"] == 4 and job["mode"] == "profile"
    target = job["nodes"][0]["target_bytes"]
    assert all(n["state"] == "warm" and n["warm_bytes"] == n["target_bytes"] == target for n in job["nodes"])
    assert 15 * MiB < target < 17 * MiB  # the profile: a.bin and b.bin, not c.bin
    region = world.region_bytes() - region_before
    fetched = [n.status()["fetch"] for n in started]
    peers = sum(f["bytes_from_peers"] for f in fetched)
    print(f"profile preheat over the swarm: 4 nodes, target {target} B per node; the region served {region} B "
          f"({region / target:.2f}x; {job['region_bytes']} B during the job), the nodes took {peers} B from peers "
          f"(the job: {job.get('peer_bytes')} B), origin {world.origin_bytes(image.layers[0]['digest'])} B in all")
    assert job["region_bytes"] <= 1.5 * target and region <= 1.5 * target
    assert peers >= 2 * target
    assert world.origin_bytes(image.layers[0]["digest"]) <= 1.05 * image.layers[0]["size"]


def test_a_cold_layers_profile_preheat_swarms_on_its_published_piece_hashes(world, nodes):
    """A profile job for an image the region has never seen: the job holds its layer to
    the ranges the nodes read, so the region has no whole blob to make the torrent from;
    `shoal convert` published the layer's piece hashes beside the image, and the region
    makes the torrent from those at once. So the nodes take most of the profile from each
    other and the region sends about one copy of it (a copy per node without them: fleet
    bench scenario d). The profile also holds every fourth of 400 small files: a piece
    holds 32 of them, so fetched as pieces they would cost the origin four times their
    bytes; those reads pass the swarm by and go to the region as asked (coalesced there),
    and the job costs the origin one copy of its target."""
    import sys

    small = [f"s{i:04d}.bin" for i in range(400)]
    image, _ = world.image({"a.bin": 10 * MiB, "b.bin": 6 * MiB, "c.bin": 8 * MiB, **dict.fromkeys(small, 8 << 10)},
                           cold=True)
    assert len(image.layers) == 1
    code = ("import sys\nfrom tests.lab.provide import push_files_profile\n"
            "push_files_profile(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:])\n")
    proc = world.lab.run(world.lab.hub, [sys.executable, "-c", code, str(world.layouts[image.name]),
                                         world.registry.host, image.repository, "a.bin", "b.bin", *small[::4]],
                         timeout=120, cwd=netlab.REPO_ROOT, env=netlab._env())
    assert proc.returncode == 0, proc.stderr
    started = nodes(4)
    before = world.region.status(world.lab)
    job = _preheat(world, image, [n.host.ns for n in started], "profile")
    assert job["state"] == "ready" and job["ready_nodes"] == 4
    target = job["nodes"][0]["target_bytes"]
    assert 16 * MiB < target < 18 * MiB  # a.bin, b.bin, 100 small files (and the TOC)
    after = world.region.status(world.lab)
    assert after["swarm"]["torrents"]["published"] > before["swarm"]["torrents"]["published"]  # from the hashes
    fetched = [n.status()["fetch"] for n in started]
    peers = sum(f["bytes_from_peers"] for f in fetched)
    passed = sum(f["sparse_reads_passed"] for f in fetched)
    print(f"cold profile preheat over the swarm: 4 nodes, target {target} B per node; the region served "
          f"{job['region_bytes']} B during the job ({job['region_bytes'] / target:.2f}x), the origin "
          f"{job['origin_bytes']} B ({job['origin_bytes'] / target:.3f}x), the nodes took {peers} B from peers; "
          f"{passed} sparse reads passed the swarm by; ready in {job['age_s']} s")
    assert job["origin_bytes"] <= 1.05 * target  # one copy of what the nodes read, not of whole pieces
    # (1.34-1.38x with the image this test gets in this file's order; with the image one seed
    # later, a test inserted before it, 1.50-1.51x in three loaded runs, 2026-12-07: the
    # bound is tight for some layouts of the small files, whose reads pass the swarm by)
    assert job["region_bytes"] <= 1.5 * target, "the region sent a copy per node: no swarm for the cold layer"
    assert peers >= 2 * target
    assert passed > 0


def test_a_read_waiting_on_a_peer_that_dies_goes_to_the_region_at_once(world, nodes):
    """(2b) Node 2 reads a file through FUSE from node 1, the only node that has it, over
    node 1's slow link; node 1 is killed mid-read. The pieces node 2 had asked of it go to
    the region as soon as node 1's connection closes, not after `peer_wait` (60 s here)
    nor the chain's deadline: no read timed out or hung."""
    image, files = world.image({"a.bin": 24 * MiB})
    [layer] = image.layers
    digest = layer["digest"]
    a, b = nodes(2, swarm={"peer_wait": 60.0})
    _, mount_b = _provide(world, [a, b], image)
    a.download(digest)
    _wait_for_a_seed(b, digest)
    world.lab.cap(a.host, 8)  # 1 MB/s out of node 1: node 2's reads wait on its pieces (0.25 s each)
    got: dict = {}

    def read() -> None:
        try:
            got["files"] = _read(mount_b, files)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            got["files"] = exc

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and b.status()["fetch"]["bytes_from_peers"] < MiB // 2:
        time.sleep(0.05)
    a.stop(world.lab, signal.SIGKILL)
    reader.join(120)
    assert got.get("files") == files, got.get("files")
    swarm = b.status()["data_path"]["sources"]["swarm"]
    figures = f"{ {k: v for k, v in swarm.items() if k != 'torrents'} }\n" + "\n".join(
        line for line in b.log(1 << 20).splitlines() if digest in line)
    assert swarm["bytes_from_peers"] >= MiB // 2, figures  # the kill came mid-read, with pieces asked of node 1
    # (the pieces asked of node 1 are released by its going (peer_gone_pieces), or by a
    # later read that fetched one of them from the region meanwhile (a piece shared by two
    # chunks): either way no read waits for node 1 until peer_wait or the chain gives up
    # on the swarm (before: 2 hangs, the test 22 s against 8-10 s))
    assert swarm["peer_timeouts"] == 0 and swarm["hangs"] == 0, figures
