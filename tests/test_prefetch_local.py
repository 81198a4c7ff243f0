"""`shoal prefetch REF --root DIR`: the local node warmed before a job starts, measured by
the node; afterwards `shoal pull` + `ctr run` read no layer bytes from the registry.

Real parts: Debian's registry (its access log counts the bytes it served), Debian's
containerd with `shoal node` as its proxy snapshotter, the node's layer file system.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from builder.format.footer import location_from_annotations
from tests.rootfs import lazy_app_image
from tests.services import SHOAL, shoal_node_with_containerd

pytestmark = [pytest.mark.registry, pytest.mark.containerd]

CMD = ["/bin/sh", "-c", "cat /etc/motd; /usr/bin/python3 -c 'import json, email; print(json.dumps([6 * 7]))'"]


@pytest.fixture(scope="module")
def registry(module_registry):
    return module_registry


def build(registry, root: Path, repo: str) -> tuple[str, dict]:
    _, lazy, manifest = lazy_app_image(registry, root, repo, CMD)
    return lazy, manifest


@pytest.fixture(scope="module")
def image(registry, tmp_path_factory):
    return build(registry, tmp_path_factory.mktemp("prefetch image"), "prefetch/app")


def shoal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SHOAL, *args], check=False, capture_output=True, text=True, timeout=300)



def lazy_start(registry, manifest, ref, ctd, name: str) -> tuple[str, int]:
    """`shoal pull` + `ctr run`: (the container's output, layer bytes the registry served)."""
    mark = registry.layer_bytes(manifest)
    pulled = shoal("pull", ref, "--address", ctd.address, "--namespace", "shoal-test", "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert [ly["kind"] for ly in json.loads(pulled.stdout)["layers"]] == ["lazy"] * 3
    out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", ref, name, *CMD).stdout
    return out, registry.layer_bytes(manifest) - mark


def test_full_mode_warms_every_lazy_layer_and_the_start_reads_nothing_from_the_registry(
        registry, image, node_and_containerd):
    ref, manifest = image
    node, ctd = node_and_containerd
    before = registry.layer_bytes(manifest)
    proc = shoal("prefetch", ref, "--root", str(node.root), "--mode", "full", "--wait", "--timeout", "120",
                 "--json", "--node-name", "n1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["state"] == "ready" and result["manifest"].startswith("sha256:") and result["image"] == ref
    (n1,) = result["nodes"]
    assert n1["name"] == "n1" and n1["state"] == "warm" and n1["error"] is None
    assert n1["warm_bytes"] == n1["target_bytes"] > 1_000_000
    assert registry.layer_bytes(manifest) - before >= n1["target_bytes"]  # fetched, not assumed
    # the node's own view: every lazy layer loaded, its chunks in the store
    status = json.loads(shoal("status", "--root", str(node.root), "--json").stdout)
    assert len(status["lazy_layers"]) == 3
    assert sum(ly["prefetched_chunks"] for ly in status["lazy_layers"]) > 0
    out, served = lazy_start(registry, manifest, ref, ctd, "pf-full")
    assert out.rstrip().endswith("[42]") and "changed by the top layer" in out
    assert served == 0
    # on a terminal, --wait shows its progress (on stderr; the result line on stdout)
    import os
    import pty

    leader, follower = pty.openpty()
    try:
        again = subprocess.run([SHOAL, "prefetch", ref, "--root", str(node.root), "--mode", "full", "--wait"],
                               stdout=subprocess.PIPE, stderr=follower, text=True, timeout=120, check=False)
        shown = os.read(leader, 65536).decode(errors="replace")
    finally:
        os.close(leader)
        os.close(follower)
    assert again.returncode == 0 and "ready (full)" in again.stdout
    assert f"{ref}: " in shown and "MB warm, 3/3 layers loaded" in shown


def test_profile_mode_warms_the_profile_and_the_start_reads_nothing_from_the_registry(
        registry, image, node_and_containerd):
    ref, manifest = image
    node, ctd = node_and_containerd
    # a node that ran the image publishes what its start read
    out_first, _ = lazy_start(registry, manifest, ref, ctd, "pf-record")
    saved = shoal("profile", "save", ref, "--root", str(node.root), "--push", "--json")
    assert saved.returncode == 0, saved.stderr
    with shoal_node_with_containerd("shoal-pf-cold-") as (cold, ctd2):
        before = registry.layer_bytes(manifest)
        proc = shoal("prefetch", ref, "--root", str(cold.root), "--wait", "--json")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        (n,) = result["nodes"]
        assert result["state"] == "ready" and result["mode"] == "profile" and n["state"] == "warm"
        assert result["profile_chunks"] == json.loads(saved.stdout)["chunks"]
        assert 0 < n["warm_bytes"] == n["target_bytes"] <= registry.layer_bytes(manifest) - before
        full = sum(ly["size"] for ly in manifest["layers"])
        assert n["target_bytes"] < full / 2  # the profile, not the layers
        # the preheat put the profile's file bytes into the kernel's page cache
        # (FUSE_NOTIFY_STORE): the start finds them there and asks this node for almost none
        paged = layer_figures(cold, "paged_in_bytes")
        assert sum(paged.values()) > 0 and layer_figures(cold, "read_bytes") == dict.fromkeys(paged, 0)
        # asked again, the warm node pages in nothing twice
        assert shoal("prefetch", ref, "--root", str(cold.root), "--wait", "--json").returncode == 0
        assert layer_figures(cold, "paged_in_bytes") == paged
        out, served = lazy_start(registry, manifest, ref, ctd2, "pf-profile")
        assert out == out_first and served == 0
        # (left: the part pages where a file's profile chunks meet chunks it did not read)
        assert sum(layer_figures(cold, "read_bytes").values()) < sum(paged.values()) / 20
        # the kernel read the paged bytes, not the trace: a profile this node saves merges
        # the published one in first, so it keeps every chunk of it
        resaved = shoal("profile", "save", ref, "--root", str(cold.root), "--out", str(cold.root / "p.json"), "--json")
        assert resaved.returncode == 0, resaved.stderr
        resaved_doc = json.loads(resaved.stdout)
        assert resaved_doc["paged_in_bytes"] == sum(paged.values()) > 0
        assert resaved_doc["chunks"] >= json.loads(saved.stdout)["chunks"]


def layer_figures(node, name: str) -> dict[str, int]:
    """One figure of each lazy layer in `shoal status`, by layer digest."""
    status = json.loads(shoal("status", "--root", str(node.root), "--json").stdout)
    return {ly["digest"]: ly[name] for ly in status["lazy_layers"]}


def test_a_prefetch_that_cannot_fetch_fails_naming_what_is_not_warm(registry, tmp_path, node_and_containerd):
    """The registry serves garbage for a layer's chunks (its TOC is intact): the node's
    checks refuse every chunk, so the layer never gets warm; `--wait` says so (exit 1,
    one line), the JSON says failed with the warm bytes as measured."""
    ref, manifest = build(registry, tmp_path, "prefetch/broken")
    node, _ = node_and_containerd
    top = manifest["layers"][-1]
    loc = location_from_annotations(top.get("annotations"))
    hexpart = top["digest"].split(":", 1)[1]
    data = registry.storage / "docker/registry/v2/blobs/sha256" / hexpart[:2] / hexpart / "data"
    blob = bytearray(data.read_bytes())
    blob[: loc.toc.offset] = bytes(loc.toc.offset)
    data.write_bytes(bytes(blob))
    proc = shoal("prefetch", ref, "--root", str(node.root), "--mode", "full", "--wait", "--timeout", "120",
                 "--json", "--node-name", "n1")
    assert proc.returncode == 1
    result = json.loads(proc.stdout)
    (n1,) = result["nodes"]
    assert result["state"] == "failed" and n1["state"] == "failed" and n1["warm_bytes"] < n1["target_bytes"]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"shoal prefetch: {ref}: node n1 not warm (failed):") and "chunk store" in line
    assert "Traceback" not in proc.stderr


def test_no_node_at_root_is_one_line(image, tmp_path):
    ref, _ = image
    proc = shoal("prefetch", ref, "--root", str(tmp_path), "--wait")
    assert proc.returncode == 1 and "no layer file system runs at" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize(("args", "message"), [
    (["--root", "/nonexistent", "--mode", "lazy"], "invalid choice: 'lazy'"),
    (["--root", "/nonexistent", "--timeout", "1e12"], "--timeout 1e+12: must be more than 0"),
    (["--root", "/nonexistent", "--timeout", "0"], "--timeout 0: must be more than 0"),
    (["--root", "/nonexistent", "--timeout", "nan"], "--timeout nan: must be more than 0"),
    ([], "say which node: --root DIR"),
    (["--root", "/x", "--nodelist", "n[1-2]"], "go with --region"),
    (["--region", "http://127.0.0.1:1", "--nodelist", "n[1-"], "'[' without ']'"),
    (["--region", "http://127.0.0.1:1", "--nodelist", ""], "name the job's nodes once"),
    (["--region", "http://127.0.0.1:1", "--nodelist", ",,"], "the node list is empty"),
    (["--region", "http://127.0.0.1:1"], "name the job's nodes once"),
    (["--region", "http://127.0.0.1:1", "--nodes", "a,n[1-2]"], "is not one node name"),
    (["--region", "http://127.0.0.1:1", "--nodes", "a", "--nodelist", "b"], "name the job's nodes once"),
    (["--region", "http://127.0.0.1:1", "--nodes-file", "/nonexistent"], "--nodes-file /nonexistent"),
])
def test_usage_errors_exit_2_with_one_line(args, message):
    proc = shoal("prefetch", "127.0.0.1:1/x:y", *args)
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_region_mode_checks_its_node_list_then_asks_the_region(tmp_path):
    """(The preheat API itself: tests/test_preheat.py.) An unreachable region is one line, exit 1."""
    nodes = tmp_path / "nodes"
    nodes.write_text("gpu[001-004]  # rack 1\ncpu7\n")
    token = tmp_path / "token"
    token.write_text("secret\n")
    for flags in (["--nodelist", "gpu[001-128,200],cpu7"], ["--nodes", "a,b"], ["--nodes-file", str(nodes)]):
        proc = shoal("prefetch", "127.0.0.1:1/x:y", "--region", "http://127.0.0.1:1", "--plain-http",
                     "--token-file", str(token), *flags, "--wait")
        assert proc.returncode == 1 and "region http://127.0.0.1:1: ConnectionError" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    proc = shoal("prefetch", "127.0.0.1:1/x:y", "--region", "http://127.0.0.1:1", "--token-file", str(token),
                 "--nodes", "a")
    assert proc.returncode == 2 and "plain HTTP only with --plain-http" in proc.stderr
    proc = shoal("prefetch", "127.0.0.1:1/x:y", "--region", "https://127.0.0.1:1", "--nodes", "a")
    assert proc.returncode == 2 and "needs the preheat API token: --token-file FILE or $SHOAL_PREFETCH_TOKEN_FILE" \
        in proc.stderr
