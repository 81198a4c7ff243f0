"""`shoal profile record`: the CI step after `shoal convert`. The image runs once on an
embedded node (its own `shoal node` and containerd under a temporary directory), what
its start read becomes its access profile, recordings merge, and a cold node prefetches
the result. Real registry, containerd, runc, FUSE."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path

import pytest

from prefetch.profile import Profile, fetch_profile
from shoal.errors import FormatError
from shoal.fsutil import mounts
from tests.rootfs import lazy_app_image
from tests.services import SHOAL, stop_process

pytestmark = [pytest.mark.registry, pytest.mark.containerd]


@pytest.fixture(scope="module")
def registry(module_registry):
    return module_registry

FIRST = ["/bin/sh", "-c", "cat /etc/motd"]
SECOND = ["/bin/sh", "-c", "/usr/bin/python3 -c 'import json, email; print(json.dumps([6 * 7]))'"]


@pytest.fixture(scope="module")
def image(registry, tmp_path_factory):
    _, lazy, manifest = lazy_app_image(registry, tmp_path_factory.mktemp("record image"), "record/app", SECOND)
    return lazy, manifest


def shoal(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SHOAL, *args], capture_output=True, text=True, timeout=timeout, check=False)


def embedded_leftovers() -> list[str]:
    """What this test's recordings left: their folders and mounts under this process's
    TMPDIR (a test worker's own: another worker's recordings, the demo's, are not ours)."""
    tmp = Path(tempfile.gettempdir())
    dirs = [str(p) for p in tmp.glob("shoal-rec-*")]
    return dirs + [p for p, _ in mounts() if p.startswith(f"{tmp}/shoal-rec-")]



def test_record_push_merge_then_a_cold_node_prefetches_the_profile(registry, image, node_and_containerd, tmp_path):
    ref, manifest = image
    host, repo = ref.split("/", 1)[0], ref.split("/", 1)[1].split(":")[0]
    layers = [ly["digest"] for ly in manifest["layers"]]
    first = shoal("profile", "record", ref, "--push", "--out", str(tmp_path / "first.json"), "--json", "--", *FIRST)
    assert first.returncode == 0, first.stderr
    one = json.loads(first.stdout)
    assert one["chunks"] > 0 and one["merged_with"] == 0 and one["commands"] == [FIRST]
    assert embedded_leftovers() == []
    # a second recording (options after `--` are the command's) merges with the first
    second = shoal("profile", "record", ref, "--timeout", "120", "--push", "--json", "--", *SECOND)
    assert second.returncode == 0, second.stderr
    two = json.loads(second.stdout)
    assert two["merged_with"] == one["chunks"] and two["commands"] == [FIRST, SECOND]
    assert two["chunks"] > one["chunks"] and two["recorded_chunks"] <= two["chunks"]
    assert embedded_leftovers() == []
    published = fetch_profile(host, repo, one["manifest"], True, layers)
    assert published is not None and published.commands == [FIRST, SECOND]
    first_only = Profile.from_json((tmp_path / "first.json").read_bytes(), one["manifest"], layers)
    assert len(published.chunks) == two["chunks"]
    assert published.chunks[: one["chunks"]] == first_only.chunks  # first use first: the older recording's order
    shown = json.loads(shoal("profile", "show", ref, "--json").stdout)
    assert shown["chunks"] == two["chunks"] and shown["commands"] == [FIRST, SECOND]
    # a cold node prefetches that profile; then the second command reads nothing from the registry
    node, ctd = node_and_containerd
    warm = shoal("prefetch", ref, "--root", str(node.root), "--wait", "--json")
    assert warm.returncode == 0, warm.stderr
    result = json.loads(warm.stdout)
    assert result["state"] == "ready" and result["profile_chunks"] == two["chunks"]
    status = json.loads(shoal("status", "--root", str(node.root), "--json").stdout)
    assert sum(ly["prefetched_chunks"] for ly in status["lazy_layers"]) == two["chunks"]
    mark = registry.layer_bytes(manifest)
    pulled = shoal("pull", ref, "--address", ctd.address, "--namespace", "shoal-test")
    assert pulled.returncode == 0, pulled.stderr
    out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", ref, "rec-cold", *SECOND).stdout
    assert out.strip() == "[42]"
    assert registry.layer_bytes(manifest) == mark


def test_a_command_that_runs_past_the_timeout_is_recorded_until_then(image, tmp_path):
    ref, _ = image
    out = tmp_path / "profile.json"
    proc = shoal("profile", "record", ref, "--timeout", "3", "--out", str(out), "--json", "--", "/bin/sleep", "600")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["ran_past_timeout"] is True and summary["chunks"] > 0
    doc = json.loads(out.read_text())
    assert doc["commands"] == [["/bin/sleep", "600"]] and doc["manifest"] == summary["manifest"]
    assert embedded_leftovers() == []


def test_a_failing_command_publishes_nothing(registry, image):
    ref, _ = image
    before = registry.count("PUT", "/manifests/")[0]
    proc = shoal("profile", "record", ref, "--push", "--", "/bin/sh", "-c", "echo broken; exit 3")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [(
        f"shoal profile: {ref}: the recorded command exited with status 3, profile not published "
        "(its last line: broken)")]
    assert registry.count("PUT", "/manifests/")[0] == before
    assert embedded_leftovers() == []


@pytest.mark.parametrize(("args", "message"), [
    (["x/y:z"], "say where the profile goes"),
    (["x/y:z", "--push", "--timeout", "0"], "--timeout 0: must be more than 0"),
])
def test_record_usage_errors(args, message):
    proc = shoal("profile", "record", *args)
    assert proc.returncode == 2 and message in proc.stderr


def test_old_profiles_without_commands_still_read_and_bad_commands_are_refused():
    digest = "sha256:" + "a" * 64
    layer = "sha256:" + "b" * 64
    old = json.dumps({"schemaVersion": 1, "manifest": digest, "layers": [layer], "chunks": [[0, 1, 2]]}).encode()
    assert Profile.from_json(old, digest).commands == []
    for bad in ("x", [["a", 1]], [[]] * 65, [["a" * 5000]]):
        doc = json.dumps({"schemaVersion": 1, "manifest": digest, "layers": [layer], "chunks": [],
                          "commands": bad}).encode()
        with pytest.raises(FormatError):
            Profile.from_json(doc, digest)
    a = Profile(digest, [(layer, 1, 2), (layer, 5, 9)], [["a"]])
    b = Profile(digest, [(layer, 3, 4), (layer, 1, 2)], [["b"]])
    assert a.merge(b).chunks == [(layer, 1, 2), (layer, 5, 9), (layer, 3, 4)]
    assert a.merge(b).commands == [["a"], ["b"]]


def test_a_cancelled_recording_stops_everything_it_started(image):
    """SIGTERM (a cancelled CI job) while the container runs: the embedded node's
    container, containerd, shims, shoal node and layer file system are stopped, its mounts
    undone and its directory removed; exit 130."""
    import signal
    import time

    ref, _ = image
    before = set(Path(tempfile.gettempdir()).glob("shoal-rec-*"))
    proc = subprocess.Popen([SHOAL, "profile", "record", ref, "--timeout", "300", "--out", "/dev/null", "--",
                             "/bin/sleep", "600"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        started = []
        while not started and time.monotonic() < deadline and proc.poll() is None:
            started = [d for d in set(Path(tempfile.gettempdir()).glob("shoal-rec-*")) - before if (d / "logs/container.log").exists()]
            time.sleep(0.1)
        assert started, proc.stderr.read() if proc.poll() is not None else "no container started"
        address = str(started[0] / "c.sock")
        time.sleep(1.0)  # the container runs
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        stop_process(proc, 120)  # (the test failed) SIGTERM first: the recording cleans up on it
    assert proc.returncode == 130 and "interrupted" in err
    assert embedded_leftovers() == []
    from snapshotter.embedded import shim_pids

    assert shim_pids(address) == []


def test_plain_http_to_a_registry_not_on_loopback_reaches_the_embedded_nodes_lazy_reads(registry, image, tmp_path):
    """--plain-http for a registry elsewhere than loopback (here in a network namespace:
    tests/lab/netlab.py): the embedded node's layer file system reads the layers over HTTP
    too (it tried TLS there, and the recording failed)."""
    from tests.lab import netlab

    if reason := netlab.lab_missing(fuse=True):
        pytest.skip(reason)
    ref, _ = image
    with netlab.Lab() as lab:  # the module registry's storage, served in the hub (read only here)
        origin = netlab.start_registry(lab, tmp_path / "origin", storage=registry.storage)
        there = f"{origin.host}/{ref.split('/', 1)[1]}"
        proc = lab.run(lab.hub, [SHOAL, "profile", "record", there, "--plain-http", "--out", str(tmp_path / "p.json"),
                                 "--json", "--", *FIRST], timeout=300, env=netlab._env())
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["chunks"] > 0
        assert origin.bytes_written("/blobs/sha256:")[1] > 0  # (the layers came from there)
    assert embedded_leftovers() == []
