"""The containerd snapshotter of `shoal node` (snapshotter/).

- the contract in-process: lifecycle, errors, mount shapes, labels, usage, Walk filters;
- metadata: survives reopening, orphaned directories are removed, a failed create
  leaves nothing behind;
- the remote seam with a fake RemoteLayers: commit-as-target + AlreadyExists, release,
  restore after a restart;
- the gRPC edge against a real `shoal node` process: every error class arrives as its
  gRPC code, socket mode, stale sockets, one daemon per root, config errors;
- containerd's own conformance suite (snapshots/testsuite through snapshots/proxy, Go,
  tests/conformance/) against a fresh `shoal node` per case;
- real containerd with shoal as its proxy snapshotter: pull from the registry, `ctr run
  --snapshotter shoal`, restart of `shoal node`, errors as ctr reports them.

Processes are started by fixtures and stopped by PID; mounts under the test's
directories are undone and the directories removed, also when a test fails.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from shoal.errors import ShoalError
from snapshotter.filters import parse_filters
from snapshotter.snapshotter import (
    LABEL_DIFF_ID,
    LABEL_LAYER_DIGEST,
    LABEL_LAYER_KIND,
    LABEL_PROOF,
    LABEL_SNAPSHOT_REF,
    OLD_LABEL_LAYER_KIND,
    AlreadyExists,
    FailedPrecondition,
    Info,
    InvalidArgument,
    Kind,
    Mount,
    NotFound,
    RemoteLayer,
    Usage,
    layer_kind,
)

grpc = pytest.importorskip("grpc", reason="the node dependencies are not installed (pip install '.[node]')")
pytest.importorskip("containerd", reason="the node dependencies are not installed (pip install '.[node]')")

# snapshotter.wire chooses protobuf's implementation: it comes before any protobuf import
from snapshotter import wire
from snapshotter.local import LocalSnapshotter, disk_usage
from snapshotter.node import load_config
from tests import services
from tests.services import NodeProcess, unmount_under

SHOAL = Path(sys.executable).parent / "shoal"  # .venv/bin/shoal, the installed entry point
REPO = Path(__file__).resolve().parent.parent
GC = {"containerd.io/gc.root": "2024-01-01T00:00:00Z"}


# --- helpers --------------------------------------------------------------------------------


@pytest.fixture
def short_tmp():
    """A directory with a short path (unix socket paths are limited to 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="shoal-sn-", dir="/tmp"))
    try:
        yield path
    finally:
        left = unmount_under(path)
        shutil.rmtree(path, ignore_errors=True)
        assert not left, f"still mounted: {left}"


@pytest.fixture
def sn(short_tmp):
    s = LocalSnapshotter(short_tmp / "root")
    s.recover()
    try:
        yield s
    finally:
        s.close()


class _IdleRemote:
    """The lifecycle half of RemoteLayers for test remotes: nothing to start, sweep or stop."""

    def start(self) -> None:
        pass

    def sweep(self, keep: set[str]) -> list[str]:
        return []

    def stop_if_idle(self) -> None:
        pass


class FakeRemote(_IdleRemote):
    """A RemoteLayers that provides targets listed in `layers` from plain directories."""

    def __init__(self, base: Path, provide: set[str] | None = None, fail: str | None = None) -> None:
        self.base, self.provide, self.fail = base, provide, fail
        self.prepared: list[str] = []
        self.released: list[RemoteLayer] = []
        self.restored: list[tuple[str, dict]] = []

    def prepare(self, target: str, parent: str, labels: dict[str, str]) -> RemoteLayer | None:
        self.prepared.append(target)
        if self.fail:
            raise ShoalError(self.fail)
        if self.provide is not None and target not in self.provide:
            return None
        path = self.base / hashlib.sha256(target.encode()).hexdigest()[:12]
        path.mkdir(parents=True, exist_ok=True)
        (path / "from-remote").write_text(target)
        return RemoteLayer(str(path), "lazy", {"shoal.io/toc-digest": "sha256:abc"}, Usage(4096, 2))

    def release(self, layer: RemoteLayer) -> None:
        self.released.append(layer)

    def restore(self, layer_path: str, labels: dict[str, str]) -> None:
        self.restored.append((layer_path, labels))


def _commit_layer(s, name: str, parent: str = "", files: dict[str, str] | None = None) -> None:
    """Prepare, write files straight into the snapshot's fs directory, commit."""
    mounts = s.prepare(name + "-active", parent, GC)
    upper = next(o[len("upperdir="):] for o in mounts[0].options if o.startswith("upperdir=")) \
        if mounts[0].type == "overlay" else mounts[0].source
    for rel, text in (files or {}).items():
        (Path(upper) / rel).write_text(text)
    s.commit(name, name + "-active", GC)


# --- the contract, in process -----------------------------------------------------------------


def test_lifecycle_kinds_parents_and_errors(sn):
    sn.prepare("a1", "", {"x": "1"})
    info = sn.stat("a1")
    assert (info.kind, info.name, info.parent, info.labels) == (Kind.ACTIVE, "a1", "", {"x": "1"})
    assert info.created_ns == info.updated_ns > 0

    sn.commit("c1", "a1", {"y": "2"})
    c1 = sn.stat("c1")
    assert (c1.kind, c1.parent, c1.labels) == (Kind.COMMITTED, "", {"y": "2"})  # labels replaced, not inherited
    with pytest.raises(NotFound):
        sn.stat("a1")  # the active key is gone after commit

    sn.prepare("a2", "c1")
    sn.view("v2", "c1")
    assert sn.stat("a2").parent == "c1" and sn.stat("v2").kind == Kind.VIEW

    with pytest.raises(AlreadyExists):
        sn.prepare("a2", "c1")
    with pytest.raises(AlreadyExists):
        sn.view("c1", "")  # keys and names share one namespace
    with pytest.raises(NotFound):
        sn.prepare("a3", "no-such-parent")
    with pytest.raises(InvalidArgument):
        sn.prepare("a3", "a2")  # an active snapshot cannot be a parent
    with pytest.raises(FailedPrecondition):
        sn.commit("c2", "v2")  # views never commit
    with pytest.raises(AlreadyExists):
        sn.commit("c1", "a2")
    with pytest.raises(NotFound):
        sn.commit("c3", "no-such-key")
    with pytest.raises(FailedPrecondition):
        sn.mounts("c1")  # committed snapshots have no mounts
    with pytest.raises(FailedPrecondition):
        sn.remove("c1")  # it has children
    with pytest.raises(NotFound):
        sn.remove("no-such-key")

    sn.remove("a2")
    sn.remove("v2")
    sn.remove("c1")
    assert sn.walk() == []
    assert os.listdir(sn.root / "snapshots") == []


def test_mount_shapes_follow_containerds_overlay(sn):
    root = sn.root / "snapshots"
    index = ("index=off",) if os.path.exists("/sys/module/overlay/parameters/index") else ()

    [m] = sn.prepare("base-a", "")
    assert m == Mount("bind", f"{root}/1/fs", ("rw", "rbind"))
    assert oct(os.stat(m.source).st_mode & 0o777) == "0o755"
    [m] = sn.view("base-v", "")
    assert m == Mount("bind", f"{root}/2/fs", ("ro", "rbind"))

    sn.commit("l1", "base-a")  # keeps id 1
    _commit_layer(sn, "l2", "l1")  # id 3

    [m] = sn.prepare("top", "l2")  # id 4
    assert m == Mount("overlay", "overlay", index + (
        f"workdir={root}/4/work", f"upperdir={root}/4/fs", f"lowerdir={root}/3/fs:{root}/1/fs"))
    assert sn.mounts("top") == [m]
    [m] = sn.view("one-parent", "l1")
    assert m == Mount("bind", f"{root}/1/fs", ("ro", "rbind"))
    [m] = sn.view("two-parents", "l2")
    assert m == Mount("overlay", "overlay", index + (f"lowerdir={root}/3/fs:{root}/1/fs",))
    assert not (root / "6" / "work").exists()  # views have no work directory


def test_update_changes_only_labels(sn):
    sn.prepare("k", "", {"a": "1", "b": "2"})
    before = sn.stat("k")
    time.sleep(0.001)
    info = sn.update(Info(Kind.ACTIVE, "k", parent="ignored", labels={"c": "3"}))
    assert info.labels == {"c": "3"} and info.parent == "" and info.created_ns == before.created_ns
    assert info.updated_ns > before.updated_ns
    info = sn.update(Info(Kind.ACTIVE, "k", labels={"c": "x", "d": "4"}), ["labels.c", "labels.e"])
    assert info.labels == {"c": "x"}  # labels.e absent from the request: removed (it was absent anyway)
    info = sn.update(Info(Kind.ACTIVE, "k", labels={"z": "9"}), ["labels"])
    assert info.labels == {"z": "9"}
    info = sn.update(Info(Kind.ACTIVE, "k", labels={}), ["labels.z"])
    assert info.labels == {}
    with pytest.raises(InvalidArgument):
        sn.update(Info(Kind.ACTIVE, "k", parent="p"), ["parent"])
    with pytest.raises(NotFound):
        sn.update(Info(Kind.ACTIVE, "missing", labels={}))
    assert sn.stat("k") == info


def test_usage_walks_active_and_records_committed(sn):
    [m] = sn.prepare("a", "")
    Path(m.source, "data").write_bytes(os.urandom(100_000))
    os.link(Path(m.source, "data"), Path(m.source, "hardlink"))
    Path(m.source, "dir").mkdir()
    active = sn.usage("a")
    assert active == disk_usage(m.source)
    assert active.inodes == 3 and active.size >= 100_000  # fs, data (once), dir
    sn.commit("c", "a")
    assert sn.usage("c") == active
    sn.view("v", "c")
    assert sn.usage("v") == Usage(0, 0)


WALK_SET = [  # containerd's checkWalk fixture: (call, key, parent, labels)
    ("prepare", "a-np", "", {}), ("prepare", "p-tmp", "", {}), ("commit", "p", "p-tmp", {}),
    ("prepare", "a", "p", {}), ("view", "v", "p", {}), ("prepare", "p-wl-tmp", "", {}),
    ("commit", "p-wl", "p-wl-tmp", {"l": "1"}), ("prepare", "a-wl", "p-wl", {"l": "2"}),
    ("view", "v-wl", "p-wl", {"l": "3"}), ("prepare", "a-np-wl", "", {"l": "2"}),
]


@pytest.mark.parametrize("filters, expected", [
    ([], {"a-np", "p", "a", "v", "p-wl", "a-wl", "v-wl", "a-np-wl"}),
    (['labels."containerd.io/gc.root"==check-walk'], {"a-np", "p", "a", "v", "p-wl", "a-wl", "v-wl", "a-np-wl"}),
    (['kind==active,labels."containerd.io/gc.root"==check-walk'], {"a-np", "a", "a-wl", "a-np-wl"}),
    (["kind==view"], {"v", "v-wl"}),
    (["kind==committed"], {"p", "p-wl"}),
    (["name==p", "name==a-np-wl"], {"p", "a-np-wl"}),
    (["name==a-wl,labels.l"], {"a-wl"}),
    (["parent==p"], {"a", "v"}),
    (['parent!=""'], {"a", "v", "a-wl", "v-wl"}),
    (["labels.l"], {"p-wl", "a-wl", "v-wl", "a-np-wl"}),
    (["labels.l==2"], {"a-wl", "a-np-wl"}),
    (['labels.l~="[13]"'], {"p-wl", "v-wl"}),
    (["name~=/^a-np/"], {"a-np", "a-np-wl"}),
    (["labels.l!=2"], {"a-np", "p", "a", "v", "p-wl", "v-wl"}),  # != also matches absent labels
    ([' name == "v" , kind==view '], {"v"}),
    (['name=="\\x61"'], {"a"}),
    ([""], {"a-np", "p", "a", "v", "p-wl", "a-wl", "v-wl", "a-np-wl"}),
])
def test_walk_filters_as_containerd_parses_them(sn, filters, expected):
    for call, key, parent, labels in WALK_SET:
        labels = {**labels, "containerd.io/gc.root": "check-walk"}
        if call == "commit":
            sn.commit(key, parent, labels)
        else:
            getattr(sn, call)(key, parent, labels)
    assert {info.name for info in sn.walk(filters)} == expected


@pytest.mark.parametrize("text", [
    "name==", "==x", "name=x", "name==a,", "labels.", "name==/x/", "name~=/[/", 'labels."open', "name==a b",
    'name=="\\q"', "name==.x", "kind=<active",
])
def test_walk_filter_errors_are_invalid_argument(text):
    with pytest.raises(InvalidArgument):
        parse_filters([text])


# --- metadata and crash consistency ------------------------------------------------------------


def test_metadata_survives_reopen_and_orphans_are_removed(short_tmp):
    root = short_tmp / "root"
    s = LocalSnapshotter(root)
    _commit_layer(s, "c1", "", {"f": "1"})
    _commit_layer(s, "c2", "c1", {"g": "2"})
    s.prepare("a", "c2", {"k": "v"})
    s.view("v", "c1")
    before = sorted(s.walk(), key=lambda i: i.name)
    mounts = s.mounts("a")
    s.close()
    s.close()  # idempotent

    # What a crash can leave: a half-built directory and a directory whose row never
    # committed (renamed, then killed before COMMIT).
    (root / "snapshots" / "new-12345" / "fs").mkdir(parents=True)
    (root / "snapshots" / "77" / "fs").mkdir(parents=True)
    (root / "snapshots" / "77" / "fs" / "junk").write_text("x")

    s = LocalSnapshotter(root)
    s.recover()
    try:
        assert sorted(s.walk(), key=lambda i: i.name) == before
        assert s.mounts("a") == mounts
        assert sorted(os.listdir(root / "snapshots")) == ["1", "2", "3", "4"]
        with pytest.raises(FailedPrecondition):
            s.remove("c1")
    finally:
        s.close()
    with pytest.raises(FailedPrecondition):
        s.stat("a")  # closed


def test_failed_create_leaves_no_row_and_no_directory(sn, monkeypatch):
    from snapshotter import metadata

    def broken_chain(self, rec):
        raise OSError(5, "simulated failure after the rename")

    monkeypatch.setattr(metadata.Tx, "chain", broken_chain)
    with pytest.raises(OSError):
        sn.prepare("k", "")
    monkeypatch.undo()
    assert sn.walk() == [] and os.listdir(sn.root / "snapshots") == []
    sn.prepare("k", "")  # the key is free, the next id works
    assert sn.stat("k").kind == Kind.ACTIVE


def test_cleanup_keeps_mounted_orphans(sn, short_tmp):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount")
    orphan = sn.root / "snapshots" / "999"
    (orphan / "fs").mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(orphan / "fs")], check=True)
    try:
        sn.cleanup()
        assert orphan.exists()  # never rm -rf through a mount
    finally:
        subprocess.run(["umount", str(orphan / "fs")], check=True)
    sn.cleanup()
    assert not orphan.exists()


# --- the remote seam ------------------------------------------------------------------------


def test_layer_kind_label_one_for_new_snapshots_and_the_old_one_still_read(short_tmp):
    # snapshots committed before carry the old label too (RemoteLayers set it): still read
    assert layer_kind({OLD_LABEL_LAYER_KIND: "lazy"}) == "lazy"
    assert layer_kind({LABEL_LAYER_KIND: "unpacked", OLD_LABEL_LAYER_KIND: "unpacked"}) == "unpacked"
    assert layer_kind({LABEL_LAYER_KIND: "lazy"}) == "lazy"
    assert layer_kind({"containerd.io/snapshot.ref": "sha256:l1"}) == ""
    # `shoal pull` asks whether a chain present is a lazy layer waiting for its proof by it
    from snapshotter import pull

    asked = []

    class Ctr:
        def view(self, snapshotter, key, parent, labels, what):
            asked.append(parent)

        def remove_snapshot(self, snapshotter, key):
            pass

    layer = {"digest": "sha256:" + "b" * 64}
    old = {OLD_LABEL_LAYER_KIND: "lazy", LABEL_LAYER_DIGEST: "sha256:" + "a" * 64}
    assert pull._check_present(Ctr(), "shoal", "img", layer, "sha256:c1", old, "what")
    assert asked == ["sha256:c1"]  # a lazy layer from another blob: its proof is waited for
    unpacked = {OLD_LABEL_LAYER_KIND: "unpacked", LABEL_LAYER_DIGEST: "sha256:" + "a" * 64}
    assert pull._check_present(Ctr(), "shoal", "img", layer, "sha256:c2", unpacked, "what")
    assert asked == ["sha256:c1"]


def test_remote_layer_is_committed_as_target_and_answers_already_exists(short_tmp):
    remote = FakeRemote(short_tmp / "layers", provide={"sha256:l1", "sha256:l2"})
    s = LocalSnapshotter(short_tmp / "root", remote=remote)
    s.recover()
    try:
        labels = {LABEL_SNAPSHOT_REF: "sha256:l1", "containerd.io/snapshot/cri.layer-digest": "sha256:d1"}
        with pytest.raises(AlreadyExists, match="provided as a lazy layer"):
            s.prepare("ns/1/extract-1 sha256:l1", "", labels)
        info = s.stat("sha256:l1")
        assert info.kind == Kind.COMMITTED and info.parent == ""
        assert info.labels == {**labels, "shoal.io/toc-digest": "sha256:abc", LABEL_LAYER_KIND: "lazy"}
        with pytest.raises(NotFound):
            s.stat("ns/1/extract-1 sha256:l1")  # the key itself was never created
        assert s.usage("sha256:l1") == Usage(4096, 2)

        # containerd's metadata layer finds the target with exactly this filter
        found = s.walk([f'labels."{LABEL_SNAPSHOT_REF}"==sha256:l1,parent==""'])
        assert [i.name for i in found] == ["sha256:l1"]

        with pytest.raises(AlreadyExists):
            s.prepare("ns/1/extract-2 sha256:l2", "sha256:l1", {LABEL_SNAPSHOT_REF: "sha256:l2"})
        with pytest.raises(AlreadyExists, match="already exists"):  # again, from another namespace
            s.prepare("ns2/5/extract-9 sha256:l1", "", {LABEL_SNAPSHOT_REF: "sha256:l1"})
        assert remote.prepared == ["sha256:l1", "sha256:l2"]  # not asked twice

        # not a layer it can provide: an ordinary Prepare
        [m] = s.prepare("ns/1/extract-3 sha256:l3", "sha256:l2", {LABEL_SNAPSHOT_REF: "sha256:l3"})
        l1, l2 = (remote.base / hashlib.sha256(t.encode()).hexdigest()[:12] for t in ("sha256:l1", "sha256:l2"))
        assert m.type == "overlay" and m.options[-1] == f"lowerdir={l2}:{l1}"
        s.commit("sha256:l3", "ns/1/extract-3 sha256:l3", {LABEL_SNAPSHOT_REF: "sha256:l3"})
        [m] = s.view("container", "sha256:l1")
        assert m == Mount("bind", str(l1), ("ro", "rbind"))
        s.remove("container")
        s.remove("sha256:l3")

        s.close()
        remote2 = FakeRemote(remote.base)
        s = LocalSnapshotter(short_tmp / "root", remote=remote2)
        s.recover()
        assert sorted(p for p, _ in remote2.restored) == sorted([str(l1), str(l2)])
        assert dict(remote2.restored)[str(l1)][LABEL_LAYER_KIND] == "lazy"

        with pytest.raises(FailedPrecondition):
            s.remove("sha256:l1")
        s.remove("sha256:l2")
        s.remove("sha256:l1")
        assert [layer.path for layer in remote2.released] == [str(l2), str(l1)]
        assert remote2.released[0].kind == "lazy"
        assert s.walk() == []
    finally:
        s.close()


def test_remote_failures(short_tmp):
    remote = FakeRemote(short_tmp / "layers", fail="layer sha256:bad: TOC digest mismatch")
    s = LocalSnapshotter(short_tmp / "root", remote=remote)
    try:
        with pytest.raises(ShoalError, match="TOC digest mismatch"):
            s.prepare("k", "", {LABEL_SNAPSHOT_REF: "sha256:bad"})
        assert s.walk() == []
        with pytest.raises(NotFound):  # parent checked before asking the remote side
            s.prepare("k", "missing", {LABEL_SNAPSHOT_REF: "sha256:x"})
        assert remote.prepared == ["sha256:bad"]

        class BadPath(FakeRemote):
            def prepare(self, target, parent, labels):
                return RemoteLayer("/tmp/a,b", "lazy")

        bad = BadPath(short_tmp / "layers")
        s2 = LocalSnapshotter(short_tmp / "root2", remote=bad)
        try:
            with pytest.raises(ShoalError, match="must not contain"):
                s2.prepare("k", "", {LABEL_SNAPSHOT_REF: "sha256:y"})
            assert [layer.path for layer in bad.released] == ["/tmp/a,b"]  # given back
            assert s2.walk() == []
        finally:
            s2.close()
    finally:
        s.close()


def test_remote_layers_get_the_parents_chain_id_from_its_record_and_set_the_proof_labels_alone(short_tmp):
    """RemoteLayers.prepare gets the parent's chain id as the snapshotter recorded it
    (containerd's backend names NAMESPACE/SEQ/CHAINID for layers it applied itself), and
    the node-only labels a Prepare carries (an image's layer annotations can become
    Prepare labels) never reach the committed record."""
    asked: list[tuple[str, str, dict]] = []

    class Recording(FakeRemote):
        def prepare(self, target, parent_chain, labels):
            asked.append((target, parent_chain, labels))
            return super().prepare(target, parent_chain, labels)

    remote = Recording(short_tmp / "layers", provide={"sha256:top"})
    s = LocalSnapshotter(short_tmp / "root", remote=remote)
    try:
        s.prepare("ns/1/extract-1 sha256:base", "", {LABEL_SNAPSHOT_REF: "sha256:base"})  # containerd applies it
        s.commit("ns/2/sha256:base", "ns/1/extract-1 sha256:base", {LABEL_SNAPSHOT_REF: "sha256:base"})
        forged = {LABEL_SNAPSHOT_REF: "sha256:top", LABEL_DIFF_ID: "sha256:forged", LABEL_PROOF: "proven"}
        with pytest.raises(AlreadyExists):
            s.prepare("ns/3/extract-2 sha256:top", "ns/2/sha256:base", forged)
        assert asked[1:] == [("sha256:top", "sha256:base", {LABEL_SNAPSHOT_REF: "sha256:top"})]
        labels = s.stat("sha256:top").labels
        assert LABEL_DIFF_ID not in labels and LABEL_PROOF not in labels
    finally:
        s.close()


# --- configuration ------------------------------------------------------------------------


def test_config_defaults_and_errors(tmp_path):
    assert load_config(None).snapshotter.grpc_threads == 16
    good = tmp_path / "good.toml"
    good.write_text("[snapshotter]\ngrpc_threads = 4\nshutdown_grace = 1\n")
    config = load_config(good)
    assert (config.snapshotter.grpc_threads, config.snapshotter.shutdown_grace) == (4, 1.0)
    assert load_config(None).metrics.host_port() is None  # off by default
    good.write_text("[metrics]\naddress = '[::1]:9464'\n")
    assert load_config(good).metrics.host_port() == ("::1", 9464)
    for text, message in [
        ("[snapshotter]\ngrpc_threads = 'four'\n", "snapshotter.grpc_threads = 'four': must be a whole number"),
        ("[snapshotter]\ngrpc_threads = 0\n", "must be between 1 and 1024"),
        ("[snapshotter\n", "not valid TOML"),
        ("[metrics]\naddress = 'localhost'\n", "metrics.address = 'localhost': want HOST:PORT"),
        (f"[fetch]\nregion_ca = '{tmp_path}/no-ca.pem'\n", "fetch.region_ca"),
        (f"[fetch]\nregion_token_file = '{tmp_path}/no-token'\n", "fetch.region_token_file"),
        ("[fetch]\nregion_plain_http_credentials = 'yes'\n", "must be true or false"),
    ]:
        bad = tmp_path / "bad.toml"
        bad.write_text(text)
        with pytest.raises(ShoalError, match=re.escape(message)):
            load_config(bad)


# --- `shoal node` over gRPC ------------------------------------------------------------------


@pytest.fixture
def node_factory(short_tmp):
    started: list[NodeProcess] = []

    def start(root: Path | None = None, sock: Path | None = None, extra: tuple[str, ...] = ()) -> NodeProcess:
        node = NodeProcess(root or short_tmp / "root", sock or short_tmp / "s.sock", short_tmp / "node.log", extra)
        started.append(node)
        return node

    try:
        yield start
    finally:
        for node in started:
            node.stop()


class Client:
    """A plain gRPC client of the Snapshots service, built from wire.METHODS."""

    def __init__(self, sock: Path | str, namespace: str | None = None) -> None:
        self.channel = grpc.insecure_channel(f"unix:{sock}")
        self.methods = {m.name: m for m in wire.METHODS}
        # containerd's own Snapshots service (same API) wants a namespace
        self.metadata = (("containerd-namespace", namespace),) if namespace else None

    def __call__(self, method: str, labels: dict | None = None, **fields):
        m = self.methods[method]
        request = m.request(**fields)
        if labels:
            wire.labels_to_pb(request.labels, labels)
        factory = self.channel.unary_stream if m.streaming else self.channel.unary_unary
        call = factory(m.path, request_serializer=m.request.SerializeToString, response_deserializer=m.response.FromString)
        result = call(request, timeout=20, metadata=self.metadata)
        return list(result) if m.streaming else result

    def code(self, method: str, **fields) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as err:
            self(method, **fields)
        return err.value.code(), err.value.details()

    def close(self) -> None:
        self.channel.close()


def test_grpc_codes_socket_mode_and_listing(node_factory, short_tmp):
    from google.protobuf import field_mask_pb2

    node = node_factory()
    assert stat.S_IMODE(os.stat(node.socket).st_mode) == 0o600
    c = Client(node.socket)
    try:
        [m] = c("Prepare", snapshotter="any-name", key="a", labels={"l": "1"}).mounts
        assert (m.type, m.options[0]) == ("bind", "rw")
        c("Commit", key="a", name="c", labels={"l": "2"})
        c("Prepare", key="child", parent="c")
        c("View", key="v", parent="c")
        info = wire.info_from_pb(c("Stat", key="c").info)
        assert (info.kind, info.labels) == (Kind.COMMITTED, {"l": "2"})
        assert c("Usage", key="child").inodes == 1

        assert c.code("Stat", key="missing") == (grpc.StatusCode.NOT_FOUND, "snapshot 'missing' does not exist")
        assert c.code("Prepare", key="child", parent="c")[0] == grpc.StatusCode.ALREADY_EXISTS
        assert c.code("Commit", key="v", name="c2")[0] == grpc.StatusCode.FAILED_PRECONDITION
        code, message = c.code("Remove", key="c")
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "remove" in message
        assert c.code("Prepare", key="x", parent="child")[0] == grpc.StatusCode.INVALID_ARGUMENT
        assert c.code("List", filters=["name=="])[0] == grpc.StatusCode.INVALID_ARGUMENT
        mask = field_mask_pb2.FieldMask(paths=["parent"])
        assert c.code("Update", info=wire.info_to_pb(info), update_mask=mask)[0] == grpc.StatusCode.INVALID_ARGUMENT
        mask = field_mask_pb2.FieldMask(paths=["labels.m"])
        info.labels = {"m": "3"}
        updated = wire.info_from_pb(c("Update", info=wire.info_to_pb(info), update_mask=mask).info)
        assert updated.labels == {"l": "2", "m": "3"} and updated.updated_ns > updated.created_ns

        for i in range(250):  # more than one List batch
            c("View", key=f"view-{i:03d}", parent="c")
        listed = [wire.info_from_pb(i) for r in c("List") for i in r.info]
        assert len(listed) == 253 and {i.name for i in listed} >= {"c", "child", "v", "view-249"}
        assert [i.name for r in c("List", filters=["kind==active"]) for i in r.info] == ["child"]
        c("Cleanup")
    finally:
        c.close()
    assert node.stop() == 0
    assert not node.socket.exists()


def test_sigterm_delivered_to_a_grpc_thread_stops_the_node(node_factory):
    """The kernel may deliver a process-directed SIGTERM to any thread; the node must not
    sit on it while its main thread waits (it did: containerd's suite caught it)."""
    import ctypes
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("tgkill's syscall number is x86_64's here")
    node = node_factory()
    c = Client(node.socket)
    c("Prepare", key="a")  # gRPC's threads exist now
    c.close()
    tids = [int(t) for t in os.listdir(f"/proc/{node.proc.pid}/task") if int(t) != node.proc.pid]
    assert tids
    libc = ctypes.CDLL(None, use_errno=True)
    SYS_tgkill = 234  # x86_64
    assert libc.syscall(SYS_tgkill, node.proc.pid, tids[-1], signal.SIGTERM) == 0
    assert node.proc.wait(timeout=5) == 0
    assert "SIGTERM: shutting down" in node.log()


def test_error_mapping_of_unexpected_errors():
    code, message = wire.error_status(KeyError("x"))
    assert code == grpc.StatusCode.UNKNOWN and message == "KeyError: 'x'"
    code, message = wire.error_status(OSError(28, "No space left on device", "/var/lib/shoal/x"))
    assert (code, message) == (grpc.StatusCode.UNKNOWN, "No space left on device: /var/lib/shoal/x")
    code, message = wire.error_status(ShoalError("line one\nline two"))
    assert (code, message) == (grpc.StatusCode.UNKNOWN, "line one")


def test_node_restarts_after_kill_and_refuses_a_second_daemon(node_factory, short_tmp):
    node = node_factory()
    c = Client(node.socket)
    c("Prepare", key="a")
    c("Commit", key="a", name="c")
    c.close()
    node.kill()  # no clean shutdown: the socket file stays
    assert node.socket.exists()

    node = node_factory()  # removes the stale socket
    c = Client(node.socket)
    try:
        assert wire.info_from_pb(c("Stat", key="c").info).kind == Kind.COMMITTED
    finally:
        c.close()

    for root, sock, message in [
        (node.root, short_tmp / "other.sock", "is in use by another shoal node"),
        (short_tmp / "other-root", node.socket, "another process is serving on this socket"),
    ]:
        proc = subprocess.run([str(SHOAL), "node", "--root", str(root), "--socket", str(sock)],
                              capture_output=True, text=True, timeout=30, check=False)
        assert proc.returncode == 1 and message in proc.stderr.strip().splitlines()[-1], proc.stderr
    assert node.proc.poll() is None

    bad = short_tmp / "bad.toml"
    bad.write_text("[snapshotter]\ngrpc_threads = -3\n")
    proc = subprocess.run([str(SHOAL), "node", "--root", str(short_tmp / "r2"), "--socket", str(short_tmp / "x.sock"),
                           "--config", str(bad)], capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 2
    assert "snapshotter.grpc_threads = -3" in proc.stderr.strip().splitlines()[-1]


# --- containerd's conformance suite (Go) -----------------------------------------------------

GO = "/usr/bin/go"
GOCODE = Path("/usr/share/gocode")
TESTSUITE = GOCODE / "src/github.com/containerd/containerd/snapshots/testsuite"
CONFORMANCE_SRC = REPO / "tests" / "conformance" / "shoal_test.go"
SUITE_CASES = {
    "Basic", "StatActive", "StatComitted", "TransitivityTest", "PreareViewFailingtest", "Update", "Remove",
    "Walk", "LayerFileupdate", "RemoveDirectoryInLowerLayer", "Chown", "DirectoryPermissionOnCommit",
    "RemoveIntermediateSnapshot", "DeletedFilesInChildSnapshot", "MoveFileFromLowerLayer", "Rename",
    "ViewReadonly", "StatInWalk", "CloseTwice", "RootPermission", "128LayersMount",
}


def _conformance_binary() -> Path:
    """`go test -c` of tests/conformance once per source, Go and containerd-dev version,
    cached under the temp directory (about 20 s to build)."""
    versions = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version} ", "golang-go", "golang-github-containerd-containerd-dev"],
        capture_output=True, text=True, check=False,
    ).stdout
    recipe = "GO111MODULE=off CGO_ENABLED=0 go test -c"  # part of the key: change it, rebuild
    key = hashlib.sha256(CONFORMANCE_SRC.read_bytes() + versions.encode() + recipe.encode()).hexdigest()[:16]
    binary = Path(tempfile.gettempdir()) / f"shoal-conformance-{key}.test"
    if binary.exists():
        return binary
    build = Path(tempfile.mkdtemp(prefix="shoal-conformance-build-"))
    try:
        pkg = build / "gopath" / "src" / "shoalconformance"
        pkg.mkdir(parents=True)
        shutil.copy(CONFORMANCE_SRC, pkg)
        env = {
            **os.environ, "GO111MODULE": "off", "GOPATH": f"{build / 'gopath'}:{GOCODE}",
            "GOCACHE": str(build / "cache"), "GOFLAGS": "", "CGO_ENABLED": "0",  # no C compiler needed
        }
        out = build / "conformance.test"
        proc = subprocess.run([GO, "test", "-c", "-o", str(out), "."], cwd=pkg, env=env,
                              capture_output=True, text=True, timeout=600, check=False)
        assert proc.returncode == 0, f"go test -c failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        os.replace(out, binary)  # atomic: concurrent runs see a whole binary or none
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return binary


@pytest.mark.containerd
def test_containerd_snapshotter_conformance_suite(short_tmp):
    if os.geteuid() != 0:
        pytest.skip("containerd's snapshotter suite needs root (overlay mounts)")
    if not os.access(GO, os.X_OK) or not TESTSUITE.is_dir():
        pytest.skip("needs Debian golang-go and golang-github-containerd-containerd-dev")
    binary = _conformance_binary()
    logs = short_tmp / "logs"
    logs.mkdir()
    tmp = short_tmp / "t"  # the suite's case directories (and their sockets) go here
    tmp.mkdir()
    env = {**os.environ, "SHOAL_BIN": str(SHOAL), "SHOAL_LOG_DIR": str(logs), "TMPDIR": str(tmp)}
    proc = subprocess.run([str(binary), "-test.v", "-test.timeout", "10m"], cwd=short_tmp, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    results = {
        m.group(2): m.group(1)
        for m in re.finditer(r"^\s*--- (PASS|FAIL|SKIP): TestShoalSnapshotter/(\S+)", proc.stdout, re.MULTILINE)
    }
    failed = sorted(name for name, r in results.items() if r == "FAIL")
    node_logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(logs.iterdir()))
    assert proc.returncode == 0 and not failed, (
        f"failed cases: {failed}\n{proc.stdout[-6000:]}\n{proc.stderr[-2000:]}\nnode logs:\n{node_logs[-6000:]}"
    )
    assert set(results) == SUITE_CASES
    assert {name for name, r in results.items() if r == "SKIP"} <= {"Rename"}  # skipped by the suite itself
    assert len(list(logs.iterdir())) == len(SUITE_CASES)  # one fresh node per case


# --- real containerd with shoal as its proxy snapshotter -----------------------------------------


@pytest.fixture
def containerd_with_shoal(tmp_path_factory, monkeypatch):
    """start(socket) -> containerd with deploy/containerd/config.toml's
    `[proxy_plugins.shoal]` pointing at `socket`.

    tests.services.start_containerd writes its own configuration; the proxy plugin is
    appended through its config function for the duration of the start."""
    from tests.fixtures_services import containerd_missing

    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    started = []

    def start(sock: Path) -> services.ContainerdServer:
        snippet = (REPO / "deploy" / "containerd" / "config.toml").read_text()
        snippet = snippet.replace("/run/shoal/snapshotter.sock", str(sock))
        workdir = tmp_path_factory.mktemp("containerd")
        server = services.start_containerd(workdir, extra_config=snippet)
        started.append((server, workdir))
        return server

    try:
        yield start
    finally:
        for server, workdir in started:
            try:
                server.stop()
            finally:
                shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def shoal_containerd(containerd_with_shoal, node_factory):
    """(containerd, the `shoal node` process it uses)."""
    node = node_factory()
    return containerd_with_shoal(node.socket), node


def _ctr_retry(ctd, *args: str, attempts: int = 60) -> subprocess.CompletedProcess:
    """A ctr call that may race containerd's reconnection to a restarted node (it retries
    the proxy connection with a backoff of up to 3 s)."""
    for _ in range(attempts):
        proc = ctd.ctr(*args, check=False)
        if proc.returncode == 0 or "Unavailable" not in proc.stderr and "connection" not in proc.stderr:
            break
        time.sleep(0.25)
    if proc.returncode != 0:
        raise services.CtrError(proc)
    return proc


def _run(ctd, image: str, cid: str, script: str) -> str:
    """What `sh -c SCRIPT` printed in a container of IMAGE on shoal. The script writes into a
    file bind-mounted from the host, read once `ctr run` has returned: ctr's own stdout can
    lose what a container prints just before it exits (the shim's copy of the last writes
    races the exit; seen once here, 2026-12-07: the first line of four and exit status 0;
    concourse/concourse#6775, containerd/containerd#770)."""
    out = Path(tempfile.mkdtemp(prefix="out-", dir=ctd.fifo_dir.parent))
    try:
        ctd.ctr("run", "--rm", "--snapshotter", "shoal", "--mount", f"type=bind,src={out},dst=/shoal-out,options=rbind:rw",
                image, cid, "/bin/sh", "-c", f"{{ {script}\n}} > /shoal-out/stdout")
        return (out / "stdout").read_text()
    finally:
        shutil.rmtree(out, ignore_errors=True)


@pytest.mark.containerd
def test_ctr_runs_containers_on_shoal_across_node_restarts(shoal_containerd, registry, tmp_path_factory, node_factory):
    from tests.lab.fromdir import ImageConfig, build_image
    from tests.rootfs import busybox_layer, delta_layer

    ctd, node = shoal_containerd
    trees = tmp_path_factory.mktemp("trees")
    ref = f"{registry.host}/shoal/snap:v1"
    build_image([str(busybox_layer(trees / "base")), str(delta_layer(trees / "delta"))], f"docker://{ref}",
                ImageConfig(cmd=["/bin/sh"]), plain_http=True, workdir=str(trees))
    shutil.rmtree(trees, ignore_errors=True)

    ctd.ctr("image", "pull", "--plain-http", "--snapshotter", "shoal", ref, timeout=300)
    script = ("cat /etc/motd; ls /data/d0; test -e /data/-leading-dash && echo present || echo whited-out;"
              " echo written > /tmp/x && cat /tmp/x")
    expected = "changed by the top layer\nnew\nwhited-out\nwritten\n"
    assert _run(ctd, ref, "shoal-c1", script) == expected

    def committed() -> list[str]:
        out = _ctr_retry(ctd, "snapshots", "--snapshotter", "shoal", "ls").stdout.splitlines()[1:]
        return sorted(line.split()[0] for line in out if line.split()[-1] == "Committed")

    layers = committed()
    assert len(layers) == 2 and all(k.startswith("sha256:") for k in layers)
    c = Client(node.socket)
    backend = sorted(wire.info_from_pb(i).name for r in c("List", filters=["kind==committed"]) for i in r.info)
    c.close()
    assert len(backend) == 2  # containerd's metadata names them; the backend keys are its own

    assert node.stop() == 0  # stop by PID, start again on the same root and socket
    node = node_factory()
    assert committed() == layers
    assert _run(ctd, ref, "shoal-c2", script) == expected

    # An error from shoal as ctr reports it: a snapshot containerd knows of but whose
    # backend record is gone (removed behind containerd's back) -> NotFound from shoal.
    ctd.ctr("snapshots", "--snapshotter", "shoal", "prepare", "orphan-key", layers[-1])
    c = Client(node.socket)
    [victim] = [wire.info_from_pb(i).name for r in c("List", filters=["name~=/orphan-key$/"]) for i in r.info]
    c("Remove", key=victim)
    c.close()
    proc = ctd.ctr("snapshots", "--snapshotter", "shoal", "info", "orphan-key", check=False)
    assert proc.returncode != 0
    assert f"snapshot {victim!r} does not exist: not found" in proc.stderr
    usage = ctd.ctr("snapshots", "--snapshotter", "shoal", "usage", layers[0]).stdout
    assert layers[0] in usage
    assert node.proc.poll() is None


class UnpackedRemote(_IdleRemote):
    """RemoteLayers serving the chain ids in `layers` from ready directories."""

    def __init__(self, layers: dict[str, Path]) -> None:
        self.layers = layers
        self.prepared: list[str] = []
        self.restored: list[str] = []

    def prepare(self, target: str, parent: str, labels: dict[str, str]) -> RemoteLayer | None:
        self.prepared.append(target)
        if target not in self.layers:
            return None
        return RemoteLayer(str(self.layers[target]), "unpacked", {"shoal.io/test": "yes"})

    def release(self, layer: RemoteLayer) -> None:
        pass

    def restore(self, layer_path: str, labels: dict[str, str]) -> None:
        self.restored.append(layer_path)


@pytest.mark.containerd
def test_containerd_takes_remote_layers_through_the_seam(containerd_with_shoal, registry, short_tmp, tmp_path_factory):
    """The remote-snapshotter protocol with real containerd: the base layer comes from
    RemoteLayers (commit as target + AlreadyExists), the top one is unpacked by
    containerd onto it, the container sees both, and a node restart restores the layer.

    `ctr image pull` unpacks without the remote labels (rootfs.ApplyLayers), so the
    unpacker's labelled Prepare (client.Pull / CRI / `shoal pull`) is sent to containerd's
    own Snapshots API here, as containerd's unpacker.go sends it."""
    from builder.oci.refs import open_source
    from snapshotter.node import Node
    from tests.lab.fromdir import ImageConfig, build_image
    from tests.rootfs import busybox_layer, delta_layer

    trees = tmp_path_factory.mktemp("trees")
    base, delta = busybox_layer(trees / "base"), delta_layer(trees / "delta")
    ref = f"{registry.host}/shoal/remote:v1"
    build_image([str(base), str(delta)], f"docker://{ref}", ImageConfig(cmd=["/bin/sh"]), plain_http=True,
                workdir=str(trees))
    with open_source(f"docker://{ref}", plain_http=True) as source:
        manifest = json.loads(source.get_root().data)
        with source.open_blob(manifest["config"]["digest"], manifest["config"]["size"]) as stream:
            diff_ids = json.loads(stream.read())["rootfs"]["diff_ids"]
    chain = [diff_ids[0], "sha256:" + hashlib.sha256(f"{diff_ids[0]} {diff_ids[1]}".encode()).hexdigest()]
    layer_dir = short_tmp / "layers" / "base"
    layer_dir.parent.mkdir()
    subprocess.run(["cp", "-a", str(base), str(layer_dir)], check=True)  # what an unpacked remote layer holds
    shutil.rmtree(trees, ignore_errors=True)

    remote = UnpackedRemote({chain[0]: layer_dir})
    root, sock = short_tmp / "root", short_tmp / "s.sock"
    node = Node(root, sock, remote=remote)
    node.start()
    try:
        ctd = containerd_with_shoal(sock)
        via_containerd = Client(ctd.address, namespace=services.CTR_NAMESPACE)
        labels = {LABEL_SNAPSHOT_REF: chain[0], "containerd.io/gc.root": "2024-01-01T00:00:00Z",
                  "containerd.io/snapshot/cri.layer-digest": manifest["layers"][0]["digest"]}
        code, message = via_containerd.code("Prepare", snapshotter="shoal", key=f"extract-1 {chain[0]}", labels=labels)
        via_containerd.close()
        assert code == grpc.StatusCode.ALREADY_EXISTS and chain[0] in message
        assert remote.prepared == [chain[0]]

        ctd.ctr("image", "pull", "--plain-http", "--snapshotter", "shoal", ref, timeout=300)
        assert remote.prepared == [chain[0]]  # ctr's unpack found the base and applied only the top layer
        [top] = [i for i in node.snapshotter.walk() if i.name.endswith(chain[1])]  # containerd's own key
        assert top.kind == Kind.COMMITTED and top.parent == chain[0] and LABEL_LAYER_KIND not in top.labels
        info = node.snapshotter.stat(chain[0])
        assert info.labels[LABEL_LAYER_KIND] == "unpacked" and info.labels[LABEL_SNAPSHOT_REF] == chain[0]
        seen = ctd.ctr("snapshots", "--snapshotter", "shoal", "info", chain[0]).stdout
        assert '"shoal.io/layer-kind": "unpacked"' in seen  # containerd recorded the backend's labels

        script = "cat /etc/motd; ls /data/d0; cat '/data/with space.txt'; stat -c %u:%g '/data/with space.txt'"
        expected = "changed by the top layer\nnew\ncontent of 'with space.txt'\n1234:5678\n"
        assert _run(ctd, ref, "remote-1", script) == expected
        assert (layer_dir / "etc" / "motd").read_text() == "hello from a shoal test image\n"  # lower stays untouched

        node.stop()
        remote = UnpackedRemote({chain[0]: layer_dir})
        node = Node(root, sock, remote=remote)
        node.start()
        assert remote.restored == [str(layer_dir)]
        assert _ctr_retry(ctd, "snapshots", "--snapshotter", "shoal", "info", chain[0]).returncode == 0
        assert _run(ctd, ref, "remote-2", script) == expected
    finally:
        node.stop()
