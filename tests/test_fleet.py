"""A fleet start on real nodes (issue 12): four `shoal node`s (swarm on), each in a
network namespace of its own, start one lazy image at the same moment behind a cold
`shoal region`; the origin (Debian's docker-registry) sits behind a link of its own capped
with `tc tbf`, so the region's fill of the layer takes several seconds (tests/lab/netlab.py).

What must hold:
- the files read right on every node;
- a read that needs the end of the blob (the TOC, the last file) is answered while the
  region's fill is still far from there: no node's read waits for the fill of another
  part of the blob (checked against the region's own fill position, not a clock);
- the origin serves one copy: the bytes it sent for the layer are at most its size (plus
  the overlap of a range read that the fill overtook), however many nodes read it, and no
  node went to the origin itself (which a node does when the region does not answer
  within its read deadline).
"""

from __future__ import annotations

import hashlib
import random
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("libtorrent", reason="libtorrent is needed for the swarm (shoal[node])")
pytest.importorskip("aiohttp", reason="aiohttp is needed for the region (shoal[node])")

from tests.lab import netlab

MiB = 1 << 20
NODES = 4
REGISTRY_MBIT = 40  # the fill of the ~34 MiB layer takes about 7 s at best
HEAD_FILES = {f"a{i}": 8 * MiB for i in range(4)}
TAIL_FILE = ("z", 2 * MiB)  # sorted last: its chunks end the blob, just before the TOC
# what the fill may fetch again of what range reads brought: a run shorter than the
# region's TAKE_AT_LEAST that does not reach the blob's end (here the last file, before
# the TOC's frame), and what the origin had in flight in an answer the fill cut
OVERLAP = 4 * MiB

_MISSING = netlab.lab_missing(fuse=True)
pytestmark = [pytest.mark.registry, pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]






def _image(work: Path) -> tuple[Path, dict[str, str]]:
    """A one-layer zstd:chunked image of random (incompressible) files; name -> sha256."""
    from builder.convert import convert
    from tests.lab.fromdir import build_image

    tree = work / "tree"
    tree.mkdir(parents=True)
    files = {}
    for i, (name, size) in enumerate([*HEAD_FILES.items(), TAIL_FILE]):
        data = random.Random(1200 + i).randbytes(size)
        (tree / name).write_bytes(data)
        files[name] = hashlib.sha256(data).hexdigest()
    build_image([str(tree)], f"oci:{work}/plain", compression="none", workdir=str(work))
    convert(f"oci:{work}/plain", f"oci:{work}/chunked")
    return work / "chunked", files


def _fill_done(lab: netlab.Lab, region: netlab.LabRegion, timeout: float = 240) -> dict:
    """The region's status once it runs no fill (from then on it serves the layer from
    its store: the origin's part of this start is over)."""
    deadline = time.monotonic() + timeout
    while True:
        status = region.status(lab)["region"]
        if not status["fills_running"]:
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"the region's fill did not end: {status.get('filling')}")
        time.sleep(0.2)


def test_four_nodes_start_one_image_behind_a_cold_region_at_one_origin_copy(tmp_path):
    short = Path(tempfile.mkdtemp(prefix="shfl-", dir="/tmp"))  # unix socket paths must be short
    try:
        with netlab.Lab() as lab:
            registry_host = lab.add_node(rate_mbit=REGISTRY_MBIT)
            registry = netlab.start_registry(lab, tmp_path, host=registry_host)
            region = netlab.start_region(lab, tmp_path, registry)
            hosts = [lab.add_node() for _ in range(NODES)]
            layout, files = _image(tmp_path / "image")
            image = netlab.push_image(lab, registry, layout, "fleet/img:v1")
            [layer] = image.layers
            digest, size = layer["digest"], layer["size"]
            nodes = netlab.start_nodes(lab, hosts, short, region, registry)

            # every node at once: prepare the layer (its TOC, at the end of the blob), read the last file
            mounts = netlab.parallel(lambda node: node.provide(lab, image)[0], nodes)
            tail = netlab.parallel(lambda mount: netlab.sha256_file(mount / TAIL_FILE[0]), mounts)
            assert tail == [files[TAIL_FILE[0]]] * NODES
            filling = region.status(lab)["region"]["filling"].get(digest)
            assert filling is not None, "the region's fill ended before the reads of the blob's end did"
            assert filling["written"] < size - TAIL_FILE[1], (
                f"the fill had reached {filling['written']} of {size} bytes: the tail's reads may have waited for it")

            # then the rest of the image, every node at once
            for name in HEAD_FILES:
                assert netlab.parallel(lambda mount, name=name: netlab.sha256_file(mount / name), mounts) == [files[name]] * NODES

            status = _fill_done(lab, region)
            _, origin = registry.bytes_written(digest)
            assert origin <= size + OVERLAP, f"the origin sent {origin} bytes of a {size}-byte layer to {NODES} nodes"
            assert status["fills_committed"] >= 1
            for node in nodes:
                fetch = node.status()["fetch"]
                assert fetch["bytes_from_origin"] == 0, f"{node.host.ns} went to the origin: {fetch}"
                assert not any(fetch["hangs"].values()), f"{node.host.ns}: a source did not answer in time: {fetch}"
                assert fetch["tocs_loaded"] == 1
            netlab.stop_nodes(lab, nodes)
            for node in nodes:
                assert not node.unmount()
    finally:
        shutil.rmtree(short, ignore_errors=True)


def _gzip_image(tmp_path: Path, files_mib: list[int], seed: int) -> tuple[Path, dict[str, str], Path]:
    """A one-layer gzip image (not converted: its layer has no TOC, so nodes unpack it) of
    random files, pushed to a registry storage folder on the host (the lab's registry
    serves it); (layout, name -> sha256, registry storage)."""
    from tests import services
    from tests.lab.fromdir import build_image
    from tests.torchimage import push

    tree = tmp_path / "tree"
    tree.mkdir()
    files = {}
    for i, mib in enumerate(files_mib):
        data = random.Random(seed + i).randbytes(mib * MiB)
        (tree / f"f{i}").write_bytes(data)
        files[f"f{i}"] = hashlib.sha256(data).hexdigest()
    layout = tmp_path / "gz"
    build_image([str(tree)], f"oci:{layout}:v1", compression="gzip", workdir=str(tmp_path))
    (tmp_path / "staging").mkdir()
    staging = services.start_registry(tmp_path / "staging", None)  # on the host: pushes go there first
    try:
        push(layout, "v1", staging.host, repo="fleet/gz")
    finally:
        staging.stop()
    return layout, files, staging.storage


def _unpacked_files(node: netlab.LabNode, status: dict, files: dict[str, str]) -> dict[str, str]:
    [unpacked] = status["unpacked_layers"]
    folder = node.root / "unpacked" / unpacked.split(":", 1)[1]
    return {name: netlab.sha256_file(folder / name) for name in files}


def test_nodes_unpacking_one_gzip_image_take_it_through_the_region_at_one_origin_copy(tmp_path):
    """A layer without a TOC is downloaded whole and unpacked by each node; when the
    node's swarm cannot start ([swarm] required = false, its storage not writable), the
    layer file system has none and the download goes through the node process's own
    fetch chain (the region, then the origin; logged), as does the manifest the node
    reads at the first prepare, so N nodes cost the origin one copy; `shoal status`
    counts the bytes (unpack_bytes, manifest_bytes) by source."""
    layout, files, storage = _gzip_image(tmp_path, [3, 3, 3], 1300)
    short = Path(tempfile.mkdtemp(prefix="shfl-", dir="/tmp"))
    try:
        with netlab.Lab() as lab:
            registry = netlab.start_registry(lab, tmp_path / "origin", host=lab.add_node(), storage=storage)
            region = netlab.start_region(lab, tmp_path, registry)
            image = netlab.layout_image(layout, f"{registry.host}/fleet/gz:v1")
            [layer] = image.layers
            nodes = netlab.start_nodes(lab, [lab.add_node() for _ in range(2)], short, region, registry,
                                       swarm={"required": False, "storage": "/proc/shoal-no-such-folder"})
            assert netlab.parallel(lambda node: node.provide(lab, image), nodes) == [[], []]  # unpacked, not lazy
            _fill_done(lab, region)
            _, origin = registry.bytes_written(layer["digest"])
            assert origin == layer["size"], f"the origin sent {origin} bytes of a {layer['size']}-byte layer"
            for node in nodes:
                status = node.status()
                assert _unpacked_files(node, status, files) == files
                fetch = status["fetch"]
                assert fetch["unpack_bytes"] == layer["size"]
                assert fetch["unpack_swarm_bytes"] == 0 and not fetch["swarm"]
                assert status["node_fetch"]["blobs"]["swarm_fallbacks"] == 1
                assert "not through the swarm (layer file system: fetch_blob failed: fetch_blob: the swarm is off " \
                       "on this node): from the region and origin" in node.log(1 << 20)
                assert fetch["bytes_from_origin"] == 0, fetch
                assert fetch["bytes_from_region"] >= layer["size"] + fetch["manifest_bytes"] > layer["size"]
                assert status["node_fetch"]["manifests"]["region"]["requests"] >= 1
            netlab.stop_nodes(lab, nodes)
    finally:
        shutil.rmtree(short, ignore_errors=True)


UNPACK_NODES = 3


def test_nodes_unpacking_one_gzip_image_at_once_share_it_through_the_swarm(tmp_path):
    """Three nodes (swarm on) prepare one gzip image's layer at the same moment behind a
    cold region, whose origin link is capped: each node's whole blob to unpack comes
    through the swarm's bulk path in its layer file system (the node waits while the
    region fills the blob and makes its metadata; the tracker's ranks then split the
    region's copy between the nodes, which take the rest from each other). The origin
    serves one copy, the region less than one per node, peers move bytes, and every
    node's unpacked files are right; `shoal status` counts the unpack bytes as the
    swarm's, by source."""
    layout, files, storage = _gzip_image(tmp_path, [6, 6, 6, 6], 1400)
    short = Path(tempfile.mkdtemp(prefix="shfl-", dir="/tmp"))
    try:
        with netlab.Lab() as lab:
            registry = netlab.start_registry(lab, tmp_path / "origin", host=lab.add_node(rate_mbit=REGISTRY_MBIT),
                                             storage=storage)
            region = netlab.start_region(lab, tmp_path, registry)
            image = netlab.layout_image(layout, f"{registry.host}/fleet/gz:v1")
            [layer] = image.layers
            digest, size = layer["digest"], layer["size"]
            nodes = netlab.start_nodes(lab, [lab.add_node() for _ in range(UNPACK_NODES)], short, region, registry,
                                       swarm={"settle_wait": 2.0})
            assert netlab.parallel(lambda node: node.provide(lab, image), nodes) == [[]] * UNPACK_NODES
            _fill_done(lab, region)
            _, origin = registry.bytes_written(digest)
            statuses = [node.status() for node in nodes]
            figures = [s["fetch"] for s in statuses]
            from_region = sum(f["bytes_from_region"] - f["manifest_bytes"] for f in figures)
            peers = sum(f["bytes_from_peers"] for f in figures)
            print(f"\nlayer {size:,} B to {UNPACK_NODES} nodes: origin {origin:,} B ({origin / size:.3f} copies), "
                  f"region {from_region:,} B ({from_region / size:.3f} copies), peers {peers:,} B")
            for node, f in zip(nodes, figures, strict=True):
                print(f"  {node.host.ip}: peers {f['bytes_from_peers']:,} region {f['bytes_from_region']:,} "
                      f"origin {f['bytes_from_origin']:,} to peers {f['bytes_to_peers']:,}")
            for node, status in zip(nodes, statuses, strict=True):
                assert _unpacked_files(node, status, files) == files, node.host.ip
                fetch, blobs = status["fetch"], status["node_fetch"]["blobs"]
                assert fetch["unpack_bytes"] == fetch["unpack_swarm_bytes"] == size, (fetch, node.log())
                assert blobs["whole_swarm"] == 1 and blobs["swarm_fallbacks"] == 0, blobs
                assert fetch["bytes_from_origin"] == 0, fetch
                assert not any(fetch["verify_failures"].values()), fetch
            assert origin == size, f"the origin sent {origin} bytes of a {size}-byte layer"
            assert peers > 0, "no node took a part of the blob from another"
            assert from_region < UNPACK_NODES * size, f"the region served {from_region / size:.2f} copies"
            assert from_region + peers >= UNPACK_NODES * size  # every node got the whole blob from somewhere
            text = subprocess.run([netlab.SHOAL, "status", "--root", str(nodes[0].root)], capture_output=True,
                                  text=True, check=True).stdout
            assert f"layers to unpack {size:,} B ({size:,} B through the swarm)" in text, text
            netlab.stop_nodes(lab, nodes)
    finally:
        shutil.rmtree(short, ignore_errors=True)
