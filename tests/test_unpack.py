"""The node's unpack of layers without a TOC (snapshotter/unpack.py, remote.py): every
entry stays inside its layer, and a chain id holds only what its diff_ids say.

Unit tests unpack into a temporary directory; the end-to-end table pulls hostile images
with `shoal pull` into a real containerd + `shoal node` and checks that a tree of
sentinels beside the layer (another image's unpacked layers, a file in the node's root,
a directory outside it, /etc/shadow) is unchanged byte for byte and that the image pulled
before still runs.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.oci.base import Manifest
from builder.oci.refs import DockerRef, open_source
from builder.oci.registry import RegistryDestination
from shoal import mediatypes as mt
from shoal.errors import FormatError
from snapshotter.unpack import unpack
from tests.fixtures_services import containerd_missing
from tests.imagetools import gzip_bytes, sha256
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer
from tests.services import SHOAL, shoal_node_with_containerd

MTIME = 1_700_000_000


# --- building tars entry by entry ---------------------------------------------------------


@dataclass
class E:
    """One tar entry as a hostile (or ordinary) layer writes it."""

    name: str
    type: str = "reg"  # reg, dir, symlink, hardlink, char, block, fifo
    data: bytes = b""
    linkname: str = ""
    mode: int = 0o644
    dev: tuple[int, int] = (0, 0)


_TAR_TYPES = {"reg": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
              "hardlink": tarfile.LNKTYPE, "char": tarfile.CHRTYPE, "block": tarfile.BLKTYPE,
              "fifo": tarfile.FIFOTYPE}


def tar_of(entries: list[E]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in entries:
            info = tarfile.TarInfo(e.name)
            info.type, info.mode, info.mtime = _TAR_TYPES[e.type], e.mode, MTIME
            info.linkname = e.linkname
            info.devmajor, info.devminor = e.dev
            info.size = len(e.data) if e.type == "reg" else 0
            tar.addfile(info, io.BytesIO(e.data) if e.type == "reg" else None)
    return buf.getvalue()


def tree_state(path: Path) -> dict:
    """Everything about a tree that a write could change, without following links:
    names, types, modes, owners, link counts, contents, link targets, xattrs."""
    out = {}
    base = os.fspath(path)
    todo = [base]
    while todo:
        p = todo.pop()
        st = os.lstat(p)
        rel = os.path.relpath(p, base)
        what: object = None
        if stat.S_ISREG(st.st_mode):
            with open(p, "rb") as f:
                what = hashlib.sha256(f.read()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            what = os.readlink(p)
        elif stat.S_ISDIR(st.st_mode):
            todo.extend(os.path.join(p, n) for n in os.listdir(p))
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            what = st.st_rdev
        xattrs = {} if stat.S_ISLNK(st.st_mode) else {
            k: os.getxattr(p, k, follow_symlinks=False) for k in os.listxattr(p, follow_symlinks=False)}
        out[rel] = (st.st_mode, st.st_uid, st.st_gid, st.st_nlink, what, xattrs)
    return out


# --- the rules, table-driven ----------------------------------------------------------------

SENTINEL_NAME = "sentinel-dir"  # under a temporary directory beside the layer's root

# (case id, entries, the entry the one-line error must name)
HOSTILE = [
    ("whiteout-of-dotdot", [E("./", "dir", mode=0o755), E(".wh...")], ".wh..."),
    ("whiteout-of-dot", [E(".wh..")], ".wh.."),
    ("whiteout-of-nothing", [E("etc/.wh.")], "etc/.wh."),
    ("dotdot", [E("../x", data=b"escaped")], "../x"),
    ("dotdot-inside", [E("a/", "dir"), E("a/../../x", data=b"escaped")], "a/../../x"),
    ("absolute", [E("/abs", data=b"absolute")], "/abs"),
    ("dot-component", [E("a/./b", data=b"x")], "a/./b"),
    ("empty-component", [E("a//b", data=b"x")], "a//b"),
    ("symlinked-parent", [E("d", "symlink", linkname="@SENTINEL"), E("d/file", data=b"through a link")], "d/file"),
    ("symlinked-parent-relative", [E("d", "symlink", linkname="../" * 12 + "@SENTINEL"),
                                   E("d/file", data=b"through a link")], "d/file"),
    ("whiteout-through-symlink", [E("d", "symlink", linkname="@SENTINEL"), E("d/.wh.precious")], "d/.wh.precious"),
    ("opaque-through-symlink", [E("d", "symlink", linkname="@SENTINEL"), E("d/.wh..wh..opq")], "d/.wh..wh..opq"),
    ("hardlink-to-etc-shadow", [E("shadow", "hardlink", linkname="/etc/shadow")], "shadow"),
    ("hardlink-escaping", [E("shadow", "hardlink", linkname="../../../../../../../etc/shadow")], "shadow"),
    ("hardlink-to-outside-file", [E("p", "hardlink", linkname="@SENTINEL/precious")], "p"),
    ("hardlink-not-in-layer", [E("x", "hardlink", linkname="etc/passwd")], "x"),
    ("hardlink-through-symlink", [E("d", "symlink", linkname="@SENTINEL"),
                                  E("p", "hardlink", linkname="d/precious")], "p"),
    ("block-device", [E("dev/", "dir"), E("dev/sda", "block", mode=0o660, dev=(8, 0))], "dev/sda"),
    ("char-device", [E("dev/", "dir"), E("dev/mem", "char", mode=0o640, dev=(1, 1))], "dev/mem"),
]


def _resolve(entries: list[E], sentinel: Path) -> list[E]:
    return [E(e.name, e.type, e.data, e.linkname.replace("@SENTINEL", str(sentinel).lstrip("/")
                                                        if e.linkname.startswith("../") else str(sentinel)),
              e.mode, e.dev) for e in entries]


@pytest.fixture
def sentinel(tmp_path) -> Path:
    d = tmp_path / SENTINEL_NAME
    (d / "sub").mkdir(parents=True)
    (d / "precious").write_bytes(b"do not touch\n")
    (d / "sub" / "deeper").write_bytes(b"nor this\n")
    return d


def _outside_state(sentinel: Path) -> dict:
    return {"sentinel": tree_state(sentinel), "shadow": tree_state(Path("/etc/shadow"))}


@pytest.mark.parametrize("case,entries,entry", HOSTILE, ids=[c[0] for c in HOSTILE])
def test_unpack_refuses_an_entry_that_leaves_its_layer(tmp_path, sentinel, case, entries, entry):
    root = tmp_path / "layer" / "root"
    root.mkdir(parents=True)
    before = _outside_state(sentinel)
    data = tar_of(_resolve(entries, sentinel))
    with pytest.raises(FormatError) as err:
        unpack(io.BytesIO(data), str(root), "img: layer L")
    message = str(err.value)
    assert message.startswith("img: layer L: ") and "\n" not in message
    assert f"entry {entry!r}" in message, message
    assert _outside_state(sentinel) == before


def test_unpack_applies_an_ordinary_layer_the_overlay_way(tmp_path):
    entries = [
        E("./", "dir", mode=0o755),
        E("./etc/", "dir", mode=0o755),
        E("./etc/motd", data=b"hello\n"),
        E("./etc/motd-link", "hardlink", linkname="./etc/motd"),
        E("./etc/abs-link", "symlink", linkname="/etc/motd"),  # a symlink may point anywhere
        E("./etc/up-link", "symlink", linkname="../../../../etc/shadow"),
        E("./etc/.wh.gone"),
        E("./etc/.wh..wh.plnk"),  # the whiteout of a name that starts with .wh.
        E("./etc/.wh.motd-link"),  # a real entry of the same layer wins over its whiteout
        E("./opaque/.wh..wh..opq"),
        E("./opaque/new", data=b"new\n"),
        E("./dev/", "dir"),
        E("./dev/whiteout", "char", mode=0, dev=(0, 0)),  # overlay's own whiteout form
        E("./run/fifo", "fifo", mode=0o600),
        E("./bin/setuid", data=b"#!/bin/sh\n", mode=0o4755),
        E("./.wh.base-file"),
    ]
    data = tar_of(entries)
    root = tmp_path / "root"
    root.mkdir()
    result = unpack(io.BytesIO(data), str(root), "img: layer L")
    assert result.diff_id == sha256(data)
    assert (root / "etc/motd").read_bytes() == b"hello\n"
    assert os.stat(root / "etc/motd").st_ino == os.stat(root / "etc/motd-link").st_ino
    assert os.readlink(root / "etc/abs-link") == "/etc/motd"
    assert os.readlink(root / "etc/up-link") == "../../../../etc/shadow"
    for name in ("etc/gone", "etc/.wh.plnk", "base-file", "dev/whiteout"):
        st = os.lstat(root / name)
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0, name
    assert stat.S_ISREG(os.lstat(root / "etc/motd-link").st_mode)
    assert not [n for d, _, names in os.walk(root) for n in names
                if n.startswith(".wh.") and not stat.S_ISCHR(os.lstat(os.path.join(d, n)).st_mode)]
    assert os.getxattr(root / "opaque", "trusted.overlay.opaque") == b"y"
    assert stat.S_ISFIFO(os.lstat(root / "run/fifo").st_mode)
    assert stat.S_IMODE(os.lstat(root / "bin/setuid").st_mode) == 0o4755
    assert os.lstat(root / "etc/motd").st_mtime == MTIME


def test_unpack_refuses_duplicates_and_links_to_what_is_not_an_earlier_file(tmp_path):
    cases = [
        ([E("a", data=b"1"), E("a", data=b"2")], "a"),
        ([E("a", "symlink", linkname="/"), E("a", "dir")], "a/"),
        ([E("d/", "dir"), E("x", "hardlink", linkname="d")], "x"),
        ([E("x", "hardlink", linkname="y"), E("y", data=b"later")], "x"),
        ([E(".wh.gone", "dir"), E(".wh.gone/x", data=b"x")], ".wh.gone/"),
        ([E(".wh.gone"), E(".wh.gone/x", data=b"x")], ".wh.gone/x"),
        ([E("f", data=b"file"), E("f/x", data=b"under a file")], "f/x"),
        ([E("./", "symlink", linkname="/")], "./"),
    ]
    for i, (entries, entry) in enumerate(cases):
        root = tmp_path / str(i)
        root.mkdir()
        with pytest.raises(FormatError, match=f"entry {entry!r}"):
            unpack(io.BytesIO(tar_of(entries)), str(root), "img: layer L")


def test_unpack_drops_overlay_xattrs_a_layer_carries(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("d")
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        info.pax_headers = {"SCHILY.xattr.trusted.overlay.redirect": "/elsewhere",
                            "SCHILY.xattr.user.kept": "yes"}
        tar.addfile(info)
    root = tmp_path / "root"
    root.mkdir()
    unpack(io.BytesIO(buf.getvalue()), str(root), "img: layer L")
    assert os.listxattr(root / "d") == ["user.kept"]


# --- end to end: shoal pull into containerd ------------------------------------------------

SENTINEL_CMD = ["/bin/cat", "/keep/precious"]
REPO = "hostile/img"


@dataclass
class Node:
    node: object
    ctd: object
    registry: object
    outside: Path
    base_desc: dict
    base_diff_id: str
    sentinel_ref: str

    @property
    def root(self) -> Path:
        return Path(self.node.root)

    def state(self) -> dict:
        return {"unpacked": tree_state(self.root / "unpacked"),
                "root-file": tree_state(self.root / "sentinel-file"),
                "outside": tree_state(self.outside),
                "shadow": tree_state(Path("/etc/shadow"))}

    def run(self, ref: str, container: str, *cmd: str) -> str:
        return self.ctd.ctr("run", "--rm", "--snapshotter", "shoal", ref, container, *cmd).stdout

    def pull(self, ref: str) -> subprocess.CompletedProcess:
        return subprocess.run([SHOAL, "pull", ref, "--address", self.ctd.address, "--namespace", "shoal-test"],
                              check=False, capture_output=True, text=True, timeout=300)


def push_image(registry, tag: str, layers: list[tuple[dict, bytes | None]], diff_ids: list[str],
               cmd: list[str] | None = None) -> tuple[str, list[dict]]:
    """Push an image of REPO whose config claims `diff_ids`; a layer's blob None: already
    in the repository. Returns (reference, layer descriptors)."""
    config = json.dumps({
        "architecture": "amd64", "os": "linux", "created": "2024-01-01T00:00:00Z",
        "config": {"Cmd": cmd or ["/bin/sh"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
    }, sort_keys=True).encode()
    doc = {"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST,
           "config": {"mediaType": mt.OCI_CONFIG, "digest": sha256(config), "size": len(config)},
           "layers": [desc for desc, _ in layers]}
    data = json.dumps(doc).encode()
    dest = RegistryDestination(DockerRef(registry.host, REPO, tag=tag), plain_http=True)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for blob in [config] + [b for _, b in layers if b is not None]:
                path = os.path.join(tmp, "blob")
                Path(path).write_bytes(blob)
                dest.put_blob(path, sha256(blob), len(blob))
            dest.put_root(Manifest(data, mt.OCI_MANIFEST, sha256(data)))
        finally:
            dest.close()
    return f"{registry.host}/{REPO}:{tag}", doc["layers"]


def gzip_layer(tar: bytes) -> tuple[dict, bytes]:
    blob = gzip_bytes(tar)
    return {"mediaType": mt.OCI_LAYER_GZIP, "digest": sha256(blob), "size": len(blob)}, blob


@pytest.fixture(scope="module")
def node(module_registry, tmp_path_factory):
    """A node and containerd that have pulled (and run) a sentinel image whose layers the
    node unpacked: busybox, then a layer with /keep/precious."""
    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    work = tmp_path_factory.mktemp("unpack e2e")
    busybox_layer(work / "l1")
    base_ref = f"{module_registry.host}/{REPO}:base"
    build_image([str(work / "l1")], f"docker://{base_ref}", ImageConfig(), plain_http=True, workdir=str(work))
    with open_source(f"docker://{base_ref}", plain_http=True) as s:
        root = s.get_root()
        manifest = json.loads(root.data)
        config = json.loads(s.read_small_blob(manifest["config"]["digest"], manifest["config"]["size"], "config"))
    base_desc, base_diff = manifest["layers"][0], config["rootfs"]["diff_ids"][0]
    keep = tar_of([E("keep/", "dir", mode=0o755), E("keep/precious", data=b"sentinel layer\n")])
    desc, blob = gzip_layer(keep)
    outside = Path(tempfile.mkdtemp(prefix="shoal-sentinel-", dir="/tmp"))
    try:
        (outside / SENTINEL_NAME / "sub").mkdir(parents=True)
        (outside / SENTINEL_NAME / "precious").write_bytes(b"do not touch\n")
        (outside / SENTINEL_NAME / "sub" / "deeper").write_bytes(b"nor this\n")
        ref, _ = push_image(module_registry, "sentinel", [(base_desc, None), (desc, blob)], [base_diff, sha256(keep)])
        with shoal_node_with_containerd("shoal-unpack-") as (n, ctd):
            (Path(n.root) / "sentinel-file").write_bytes(b"a file in the node's root\n")
            env = Node(n, ctd, module_registry, outside, base_desc, base_diff, ref)
            proc = env.pull(ref)
            assert proc.returncode == 0, proc.stderr
            assert env.run(ref, "sentinel-0", *SENTINEL_CMD) == "sentinel layer\n"
            yield env
    finally:
        shutil.rmtree(outside, ignore_errors=True)


E2E = [c for c in HOSTILE if c[0] not in ("dot-component", "empty-component")]


@pytest.mark.registry
@pytest.mark.containerd
@pytest.mark.parametrize("case,entries,entry", E2E, ids=[c[0] for c in E2E])
def test_pull_of_a_hostile_layer_fails_in_one_line_and_changes_nothing_beside_it(node, case, entries, entry):
    tar = tar_of(_resolve(entries, node.outside / SENTINEL_NAME))
    desc, blob = gzip_layer(tar)
    ref, _ = push_image(node.registry, case, [(node.base_desc, None), (desc, blob)], [node.base_diff_id, sha256(tar)])
    before = node.state()
    proc = node.pull(ref)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    assert ref in line and desc["digest"] in line and f"entry {entry!r}" in line, line
    assert node.state() == before
    assert not [n for n in os.listdir(node.root / "unpacked") if n.startswith(".")]  # the temp dir is gone
    out = node.run(node.sentinel_ref, f"sentinel-{case}", *SENTINEL_CMD)
    assert out == "sentinel layer\n"


@pytest.mark.registry
@pytest.mark.containerd
@pytest.mark.parametrize("where", ["top", "base"])
def test_an_image_claiming_another_images_diff_id_cannot_poison_its_chain(node, where):
    """The attacker's config claims the victim's diff_id for the attacker's own layer and
    is pulled first: its pull fails naming both diff_ids, nothing is committed, and the
    victim, pulled after, runs on its own bytes."""
    who = {w: tar_of([E("who", data=f"{w} {where}\n".encode())]) for w in ("victim", "attacker")}
    if where == "top":  # on top of the shared busybox layer: parent chain = busybox's
        victim_layers = [(node.base_desc, None), gzip_layer(who["victim"])]
        attack_layers = [(node.base_desc, None), gzip_layer(who["attacker"])]
        victim_diffs = [node.base_diff_id, sha256(who["victim"])]
        claimed, poisoned = victim_diffs[1], -1
    else:  # the base layer itself (parent ""), busybox on top of it
        victim_layers = [gzip_layer(who["victim"]), (node.base_desc, None)]
        attack_layers = [gzip_layer(who["attacker"]), (node.base_desc, None)]
        victim_diffs = [sha256(who["victim"]), node.base_diff_id]
        claimed, poisoned = victim_diffs[0], 0
    attacker, attack_descs = push_image(node.registry, f"attacker-{where}", attack_layers, victim_diffs)
    victim, _ = push_image(node.registry, f"victim-{where}", victim_layers, victim_diffs)
    proc = node.pull(attacker)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    line = lines[0]
    assert attacker in line and attack_descs[poisoned]["digest"] in line, line
    assert claimed in line and sha256(who["attacker"]) in line, line
    assert not [n for n in os.listdir(node.root / "unpacked") if n.startswith(".")]
    proc = node.pull(victim)
    assert proc.returncode == 0, proc.stderr
    out = node.run(victim, f"victim-{where}", "/bin/cat", "/who")
    assert out == f"victim {where}\n"


@pytest.mark.registry
def test_a_folder_unpacked_before_a_restart_is_reused_for_another_chain_only_after_hashing(module_registry, tmp_path):
    """One unpacked folder serves every chain its blob is in. A node that did not unpack
    it itself (it was restarted) hashes the blob again before it commits the folder
    under a new chain: the right chain gets it, a chain the bytes do not make does not."""
    from shoal.digest import chain_id
    from snapshotter import remote as rm

    tar = tar_of([E("etc/", "dir", mode=0o755), E("etc/shared", data=b"in two chains\n")])
    desc, blob = gzip_layer(tar)
    ref, _ = push_image(module_registry, "shared", [(desc, blob)], [sha256(tar)])
    labels = {rm.LABEL_IMAGE_REF: ref, rm.LABEL_LAYER_DIGEST: desc["digest"], rm.LABEL_LAYER_SIZE: str(desc["size"]),
              rm.LABEL_LAYER_MEDIA_TYPE: desc["mediaType"]}
    root = tmp_path / "root"
    first = rm.RemoteLayers(str(root)).prepare(sha256(tar), "", labels)
    assert first.info_labels[rm.LABEL_DIFF_ID] == sha256(tar) and first.info_labels[rm.LABEL_PROOF] == "proven"
    before = tree_state(Path(first.path))
    restarted = rm.RemoteLayers(str(root))
    other_parent = "sha256:" + "1" * 64
    wrong = chain_id(other_parent, "sha256:" + "2" * 64)
    with pytest.raises(FormatError, match=f"have diff_id {sha256(tar)}"):
        restarted.prepare(wrong, other_parent, labels)
    second = restarted.prepare(chain_id(other_parent, sha256(tar)), other_parent, labels)
    assert second.path == first.path and second.info_labels[rm.LABEL_DIFF_ID] == sha256(tar)
    assert tree_state(Path(first.path)) == before
    assert module_registry.count("GET", desc["digest"])[0] == 2  # the unpack, and one hash after the restart


# --- fuzzing: whatever the entries, refused with FormatError or unpacked inside the root --

_parts = st.sampled_from(["a", "b", "d", "..", ".", "", ".wh.a", ".wh..", ".wh...", ".wh..wh..opq", ".wh.", "@"])
_names = st.lists(_parts, min_size=1, max_size=4).map("/".join) | st.sampled_from(["./", "/", "/a", "./a/"])
_entries = st.lists(st.builds(
    E, name=_names, type=st.sampled_from(["reg", "dir", "symlink", "hardlink", "char", "fifo"]),
    data=st.just(b"x"), linkname=_names | st.just("@SENTINEL") | st.just("../../@SENTINEL"),
    mode=st.just(0o644), dev=st.sampled_from([(0, 0), (1, 3)])), max_size=8)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(_entries)
def test_any_entries_are_refused_or_stay_inside_the_root(tmp_path, entries):
    sentinel = tmp_path / SENTINEL_NAME
    if not sentinel.exists():
        (sentinel / "a").mkdir(parents=True)
        (sentinel / "a" / "b").write_bytes(b"do not touch\n")
    before = tree_state(tmp_path)
    root = Path(tempfile.mkdtemp(dir=tmp_path, prefix="layer-"))
    named = [E(e.name.replace("@", "d"), e.type, e.data, e.linkname.replace("@SENTINEL", str(sentinel))
               .replace("../../" + str(sentinel), "../../" + str(sentinel).lstrip("/")), e.mode, e.dev)
             for e in entries]
    try:
        unpack(io.BytesIO(tar_of(named)), str(root), "img: layer L")
    except FormatError as e:
        assert str(e).startswith("img: layer L: ") and "\n" not in str(e)
    shutil.rmtree(root)
    assert tree_state(tmp_path) == before
