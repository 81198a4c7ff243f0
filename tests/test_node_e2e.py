"""End to end on real parts: Debian's registry and containerd, `shoal node` as containerd's
proxy snapshotter, `shoal pull`, `ctr run --snapshotter shoal`."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.rootfs import lazy_app_image
from tests.services import (
    SHOAL,
    NodeProcess,
    shoal_node_with_containerd,
    wait_for,
)

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.registry, pytest.mark.containerd]

CMD = ["/bin/sh", "-c", "cat /etc/motd; ls /data; /usr/bin/python3 -c 'import json; print(json.dumps([6 * 7]))'"]
EXPECTED = "changed by the top layer\n"


@pytest.fixture(scope="module")
def registry(module_registry):
    return module_registry


@pytest.fixture(scope="module")
def images(registry, tmp_path_factory):
    return lazy_app_image(registry, tmp_path_factory.mktemp("e2e image"), "e2e/app", CMD)


def shoal_json(*args: str) -> dict:
    proc = subprocess.run([SHOAL, *args, "--json"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def blob_bytes(registry, manifest: dict) -> int:
    return sum(registry.count("GET", ly["digest"])[1] for ly in manifest["layers"])


def test_lazy_image_starts_through_containerd_and_fetches_only_what_it_reads(registry, images, node_and_containerd):
    _, lazy, manifest = images
    node, ctd = node_and_containerd
    before = blob_bytes(registry, manifest)
    pulled = shoal_json("pull", lazy, "--address", ctd.address, "--namespace", "shoal-test")
    assert [ly["kind"] for ly in pulled["layers"]] == ["lazy"] * 3
    after_pull = blob_bytes(registry, manifest)
    assert after_pull - before < 200_000  # TOCs only
    out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "e2e-1", *CMD).stdout
    assert out.startswith(EXPECTED) and out.rstrip().endswith("[42]")
    assert "-leading-dash" not in out  # the whiteout in the top layer holds
    fetched = blob_bytes(registry, manifest) - before
    image_size = sum(ly["size"] for ly in manifest["layers"])
    assert 0 < fetched < image_size / 2, (fetched, image_size)
    # a second container from the same image fetches nothing
    mark = blob_bytes(registry, manifest)
    out2 = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "e2e-2", *CMD).stdout
    assert out2 == out
    assert blob_bytes(registry, manifest) == mark
    status = shoal_json("status", "--root", str(node.root))
    assert len(status["lazy_layers"]) == 3 and status["unpacked_layers"] == []
    assert sum(ly["fetched_bytes"] for ly in status["lazy_layers"]) > 0
    # decompressed chunks are kept in the node's chunk memory, within its bound
    memory = status["data_path"]["memory"]
    assert memory["memory_chunks"] > 0 and memory["memory_bytes"] <= memory["memory_capacity"]
    text = subprocess.run([SHOAL, "status", "--root", str(node.root)], capture_output=True, text=True, check=True)
    assert "lazy layers: 3" in text.stdout and "chunk memory:" in text.stdout and "on sources" in text.stdout


def test_a_published_access_profile_is_prefetched_by_a_cold_node(registry, images, node_and_containerd):
    """Node 1 runs the image; `shoal profile save --push` publishes what it read. On a cold
    node 2, `shoal pull` alone (its Prepares name the manifest) brings those chunks in,
    and the same container then reads nothing from the registry."""
    _, lazy, manifest = images
    node, ctd = node_and_containerd
    shoal_json("pull", lazy, "--address", ctd.address, "--namespace", "shoal-test")
    out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "e2e-p1", *CMD).stdout
    saved = shoal_json("profile", "save", lazy, "--root", str(node.root), "--push")
    assert saved["chunks"] > 0
    with shoal_node_with_containerd("shoal-e2e-cold-") as (cold, ctd2):
        shoal_json("pull", lazy, "--address", ctd2.address, "--namespace", "shoal-test")
        def prefetched():
            status = shoal_json("status", "--root", str(cold.root))
            return sum(ly["prefetched_chunks"] for ly in status["lazy_layers"]) == saved["chunks"] and status

        status = wait_for(prefetched, "every chunk of the profile to be prefetched", interval=0.2)
        assert status["prefetch"]["queued_chunks"] == saved["chunks"]
        mark = blob_bytes(registry, manifest)
        out2 = ctd2.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "e2e-p2", *CMD).stdout
        assert out2 == out
        assert blob_bytes(registry, manifest) == mark


def test_unconverted_layers_are_unpacked_by_the_node(registry, images, node_and_containerd):
    gz, _, _ = images
    node, ctd = node_and_containerd
    pulled = shoal_json("pull", gz, "--address", ctd.address, "--namespace", "shoal-test")
    assert [ly["kind"] for ly in pulled["layers"]] == ["unpacked"] * 3
    out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", gz, "e2e-gz", *CMD).stdout
    assert out.startswith(EXPECTED) and out.rstrip().endswith("[42]")
    status = shoal_json("status", "--root", str(node.root))
    assert len(status["unpacked_layers"]) == 3


def test_pull_of_a_missing_image_is_one_line(registry, node_and_containerd):
    _, ctd = node_and_containerd
    proc = subprocess.run([SHOAL, "pull", f"{registry.host}/e2e/nothing:here", "--address", ctd.address],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 1
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert "nothing" in proc.stderr


def test_containers_keep_running_when_the_node_restarts(registry, images, node_and_containerd):
    _, lazy, _ = images
    node, ctd = node_and_containerd
    shoal_json("pull", lazy, "--address", ctd.address, "--namespace", "shoal-test")
    ctd.ctr("run", "-d", "--snapshotter", "shoal", lazy, "e2e-long", "/bin/sh", "-c", "sleep 600")
    try:
        node.stop()
        # what a crash could leave: the restarted node removes it, and only it
        half = Path(node.root, "layers", ".tmp-crashed")
        half.mkdir()
        stray = Path(node.root, "unpacked", "f" * 64)
        stray.mkdir()
        node2 = NodeProcess(node.root, node.socket, node.log_path)
        try:
            assert not half.exists() and not stray.exists()
            # the running container's files are still there (served by the fs server)
            out = ctd.ctr("task", "exec", "--exec-id", "x1", "e2e-long", "/bin/cat", "/etc/motd").stdout
            assert out == EXPECTED
            # containerd reconnects to the restarted snapshotter with a backoff: retry
            for _ in range(40):
                proc = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy, "e2e-after", *CMD, check=False)
                if proc.returncode == 0 or "unavailable" not in proc.stderr:
                    break
                time.sleep(0.25)
            assert proc.returncode == 0, proc.stderr
            assert proc.stdout.startswith(EXPECTED)
        finally:
            node2.stop()
    finally:
        ctd.ctr("task", "kill", "-s", "KILL", "e2e-long", check=False)


