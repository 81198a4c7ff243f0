"""Interop with real tools that know nothing of shoal (issue "builder: shoal convert").

- containerd 1.6 (`ctr image pull` / `ctr run`, no shoal involved) runs an image converted
  by `shoal convert` exactly as it runs the gzip original;
- shoal's reader reads the zstd:chunked layers Debian's skopeo 1.9.3 writes (the older
  variant) exactly as GNU tar sees the same blobs;
- Debian's podman 4.3.1 pulls shoal's layers through its partial-pull (zstd:chunked
  differ) path, and the files it lays down match the source trees.

Runs as root. Every process is started by a fixture and stopped by its PID; network
traffic goes to 127.0.0.1 only; temporary directories are removed and mounts undone.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from builder.format.footer import (
    FOOTER_MAGIC,
    OLD_FOOTER_MAGIC,
    OLD_MANIFEST_CHECKSUM,
    ZSTD_MAGIC,
    location_from_annotations,
    parse_footer,
)
from builder.format.reader import LayerReader
from builder.format.toc import decompress_toc, parse_toc
from builder.oci.refs import open_source
from shoal import mediatypes as mt
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer, delta_layer, python_layer
from tests.services import missing_dirs, remove_empty_dirs, unmount_under

SHOAL = Path(sys.executable).parent / "shoal"  # .venv/bin/shoal, the installed entry point
SKOPEO = "/usr/bin/skopeo"
PODMAN = "/usr/bin/podman"
ZSTD = "/usr/bin/zstd"
TAR = "/usr/bin/tar"

CMD = [
    "/bin/sh", "-c",
    "cat /etc/motd; ls /data; /usr/bin/python3 -c 'import json; print(json.dumps(sorted([1,3,2])))'",
]
# Lists the container's whole root file system (minus the runtime's mounts): type, mode,
# owner, size and link target of every entry, mtime of everything but directories (runc
# creates mount points in "/"), and the md5 of every regular file.
_PRUNE = r"\( -path ./proc -o -path ./sys -o -path ./dev -o -path ./run \) -prune -o"
TREE_SCRIPT = (
    f"cd / && find . -xdev {_PRUNE} -print0 | xargs -0 stat -c '%n|%F|%a|%u|%g|%s|%N' | sort"
    f" && find . -xdev {_PRUNE} ! -type d -print0 | xargs -0 stat -c '%n|%Y' | sort"
    f" && find . -xdev {_PRUNE} -type f -print0 | xargs -0 md5sum | sort"
)
TAR_MTIME = 1704067200  # build_image packs with tar --mtime=@1704067200 --clamp-mtime
SRC_NS = "shoal-test"
DST_NS = "shoal-test-converted"

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="interop tests run as root")


def _need(*paths: str) -> None:
    for path in paths:
        if not os.access(path, os.X_OK):
            pytest.skip(f"{path} is not installed")


def _run(cmd: list, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(c) for c in cmd], check=False, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout,
        encoding="utf-8", errors="surrogateescape", **kw,
    )


def _check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, f"{' '.join(map(str, proc.args))}: exit {proc.returncode}\n{proc.stderr[-4000:]}"
    return proc


# --- shared source trees ----------------------------------------------------------------


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    """The three layer folders of the test image (busybox, python, delta), built once."""
    base = tmp_path_factory.mktemp("interop-trees")
    try:
        yield [
            busybox_layer(base / "busybox"),
            python_layer(base / "python"),
            delta_layer(base / "delta"),
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("interop")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _build_and_convert(trees, registry, workdir: Path) -> tuple[str, str, dict]:
    """Push the gzip image to src:v1, `shoal convert` it (real CLI) to dst:v1."""
    src = f"{registry.host}/interop/src:v1"
    dst = f"{registry.host}/interop/dst:v1"
    build_image(
        [str(t) for t in trees], f"docker://{src}", ImageConfig(cmd=CMD), plain_http=True, workdir=str(workdir)
    )
    proc = _check(_run([SHOAL, "convert", "--plain-http", "--json", f"docker://{src}", f"docker://{dst}"]))
    summary = json.loads(proc.stdout)
    assert [ly["action"] for ly in summary["layers"]] == ["converted"] * len(trees)
    return src, dst, summary


def _image(ref: str) -> tuple[dict, dict]:
    """(manifest, config) of docker://ref, read with shoal's own registry client."""
    with open_source(f"docker://{ref}", plain_http=True) as source:
        manifest = json.loads(source.get_root().data)
        with source.open_blob(manifest["config"]["digest"], manifest["config"]["size"]) as stream:
            config = json.loads(stream.read())
    return manifest, config


def _chain_ids(diff_ids: list[str]) -> list[str]:
    out = [diff_ids[0]]
    for d in diff_ids[1:]:
        out.append("sha256:" + hashlib.sha256(f"{out[-1]} {d}".encode()).hexdigest())
    return out


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "reg"), (stat.S_ISDIR, "dir"), (stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "fifo"),
        (stat.S_ISCHR, "char"), (stat.S_ISBLK, "block"),
    ):
        if test(mode):
            return name
    return "other"


def _walk(root: Path) -> list[str]:
    """Every path below root (files, links, directories), root-relative."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for name in dirnames + filenames:
            out.append(name if rel == "." else f"{rel}/{name}")
    return sorted(out)


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while data := fh.read(1 << 20):
            h.update(data)
    return h.hexdigest()


def _user_xattrs(path: Path) -> dict[str, bytes]:
    return {
        k: os.getxattr(path, k, follow_symlinks=False)
        for k in os.listxattr(path, follow_symlinks=False) if k.startswith("user.")
    }


# --- a. containerd runs converted images -------------------------------------------------


def _image_digest(containerd, ref: str, namespace: str) -> str:
    for line in containerd.ctr("images", "ls", namespace=namespace).stdout.splitlines()[1:]:
        fields = line.split()
        if fields and fields[0] == ref:
            return fields[2]
    raise AssertionError(f"ctr images ls ({namespace}) does not list {ref}")


@pytest.mark.containerd
@pytest.mark.registry
def test_containerd_runs_converted_image_like_its_source(trees, registry, containerd, workdir):
    src, dst, summary = _build_and_convert(trees, registry, workdir)

    # The two images share diff_ids, hence snapshot chain IDs: pulled into one namespace,
    # containerd would reuse the source's snapshots and never unpack a converted layer.
    # Each image gets its own namespace, so both are really unpacked.
    for ref, ns in ((src, SRC_NS), (dst, DST_NS)):
        containerd.ctr("image", "pull", "--plain-http", ref, namespace=ns)

    manifests = {}
    for ref, ns in ((src, SRC_NS), (dst, DST_NS)):
        digest = _image_digest(containerd, ref, ns)
        manifests[ref] = json.loads(containerd.ctr("content", "get", digest, namespace=ns).stdout)
    src_manifest, dst_manifest = manifests[src], manifests[dst]
    assert dst_manifest["config"]["digest"] == src_manifest["config"]["digest"]
    assert {ly["mediaType"] for ly in src_manifest["layers"]} == {mt.OCI_LAYER_GZIP}
    assert [ly["mediaType"] for ly in dst_manifest["layers"]] == [mt.OCI_LAYER_ZSTD] * len(trees)
    assert [ly["digest"] for ly in dst_manifest["layers"]] == [ly["digest"] for ly in summary["layers"]]

    # containerd holds the zstd:chunked blobs themselves (zstd frames first, footer last)
    content = containerd.ctr("content", "ls", namespace=DST_NS).stdout
    blobs = containerd.root / "io.containerd.content.v1.content" / "blobs" / "sha256"
    for layer in dst_manifest["layers"]:
        assert layer["digest"] in content
        data = (blobs / layer["digest"].split(":")[1]).read_bytes()
        assert len(data) == layer["size"]
        assert data[:4] == ZSTD_MAGIC
        assert data[-8:] == FOOTER_MAGIC
        loc = location_from_annotations(layer["annotations"])
        assert loc is not None and parse_footer(data[-64:]).toc == loc.toc

    # ...and unpacked every one of them: its unpacker checks each layer's uncompressed
    # digest against the config's diff_id, and names the snapshot by the chain ID.
    config = json.loads(containerd.ctr("content", "get", dst_manifest["config"]["digest"], namespace=DST_NS).stdout)
    chain = _chain_ids(config["rootfs"]["diff_ids"])
    for ns in (SRC_NS, DST_NS):
        rows = [line.split() for line in containerd.ctr("snapshots", "ls", namespace=ns).stdout.splitlines()[1:]]
        assert sorted(r[0] for r in rows) == sorted(chain)
        assert all(r[-1] == "Committed" for r in rows)

    src_out = containerd.run(src, "interop-src", namespace=SRC_NS).stdout
    dst_out = containerd.run(dst, "interop-dst", namespace=DST_NS).stdout
    assert src_out.strip(), "the source image printed nothing"
    assert dst_out == src_out
    lines = dst_out.splitlines()
    assert lines[0] == "changed by the top layer" and lines[-1] == "[1, 2, 3]"
    assert "-leading-dash" not in lines and "with space.txt" in lines  # whiteout applied

    src_tree = containerd.run(src, "interop-src-tree", "/bin/sh", "-c", TREE_SCRIPT, namespace=SRC_NS).stdout
    dst_tree = containerd.run(dst, "interop-dst-tree", "/bin/sh", "-c", TREE_SCRIPT, namespace=DST_NS).stdout
    assert len(src_tree.splitlines()) > 1000
    assert dst_tree == src_tree
    assert "./data/with space.txt|regular file|644|1234|5678|" in dst_tree


# --- b. shoal reads skopeo's zstd:chunked layers ------------------------------------------


def _extract(blob: Path, dest: Path) -> str:
    """`zstd -dc blob | tar -x` into dest (as root: owners, modes, xattrs kept); returns
    the sha256 of the tar stream."""
    dest.mkdir()
    zstd = subprocess.Popen([ZSTD, "-dc", str(blob)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    tar = subprocess.Popen(
        [TAR, "-x", "--numeric-owner", "--same-permissions", "--xattrs", "--xattrs-include=*", "-C", str(dest)],
        stdin=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    h = hashlib.sha256()
    try:
        while data := zstd.stdout.read(1 << 20):
            h.update(data)
            tar.stdin.write(data)
        tar.stdin.close()
        tar_err = tar.stderr.read()
        zstd_err = zstd.stderr.read()
        assert zstd.wait(timeout=60) == 0, f"zstd -dc {blob}: {zstd_err[-2000:]!r}"
        assert tar.wait(timeout=60) == 0, f"tar -x: {tar_err[-2000:]!r}"
    finally:
        for proc in (zstd, tar):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None and not stream.closed:
                    stream.close()
    return "sha256:" + h.hexdigest()


def _compare_reader_with_tree(reader: LayerReader, root: Path, what: str) -> dict[str, int]:
    """Every entry the reader lists matches what tar extracted, and vice versa."""
    listed: list[str] = []

    def walk(path: str) -> None:
        for child in reader.readdir(path):
            p = f"{path}/{child}" if path else child
            listed.append(p)
            if reader.entries[p].type == "dir":
                walk(p)

    walk("")
    assert sorted(listed) == _walk(root), f"{what}: the TOC and tar list different paths"
    counts = {"files": 0, "multi_chunk_files": 0, "zero_chunks": 0, "hardlinks": 0, "symlinks": 0}
    for p in [""] + listed:
        full = root / p if p else root
        st = os.lstat(full)
        entry = reader.entries[p]
        s = reader.stat(p)
        where = f"{what}: {p!r}"
        assert _kind(st.st_mode) == s.type, where
        if entry.type != "symlink":
            assert stat.S_IMODE(st.st_mode) == s.mode, where
            assert _user_xattrs(full) == {k: v for k, v in entry.xattrs.items() if k.startswith("user.")}, where
        if p:
            assert (st.st_uid, st.st_gid) == (s.uid, s.gid), where
        if s.type == "dir":
            assert sorted(reader.readdir(p)) == sorted(os.listdir(full)), where
        elif s.type == "symlink":
            counts["symlinks"] += 1
            assert reader.readlink(p) == os.readlink(full), where
        elif s.type == "reg":
            assert s.size == st.st_size, where
            assert int(s.mtime) == int(st.st_mtime), where
            if entry.type == "hardlink":
                counts["hardlinks"] += 1
                assert os.path.samestat(os.lstat(root / entry.linkname), st), where
                continue
            counts["files"] += 1
            data = full.read_bytes()
            assert reader.read(p, 0, s.size + 10) == data, where
            if len(entry.chunks) > 1:
                counts["multi_chunk_files"] += 1
                for c in entry.chunks[1:]:  # reads across every chunk boundary
                    lo = max(0, c.file_offset - 3000)
                    assert reader.read(p, lo, 6000) == data[lo : lo + 6000], f"{where} at {lo}"
            counts["zero_chunks"] += sum(1 for c in entry.chunks if c.zeros)
    return counts


def test_shoal_reads_skopeo_zstd_chunked_layers(trees, workdir):
    _need(SKOPEO, ZSTD, TAR)
    build_image([str(t) for t in trees], f"oci:{workdir}/src:v1", ImageConfig(cmd=CMD), workdir=str(workdir))
    policy = workdir / "policy.json"
    policy.write_text(json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
    _check(_run(
        [SKOPEO, "--policy", policy, "copy", "--dest-compress", "--dest-compress-format", "zstd:chunked",
         f"oci:{workdir}/src:v1", f"oci:{workdir}/skopeo:v1"],
        cwd=workdir,
    ))

    with open_source(f"oci:{workdir}/skopeo:v1") as source:
        manifest = json.loads(source.get_root().data)
    blobs = workdir / "skopeo" / "blobs" / "sha256"
    totals: dict[str, int] = {}
    for i, layer in enumerate(manifest["layers"]):
        what = f"skopeo layer {i} {layer['digest']}"
        assert layer["mediaType"] == mt.OCI_LAYER_ZSTD, what
        annotations = layer.get("annotations") or {}
        loc = location_from_annotations(annotations)
        assert loc is not None, f"{what}: no zstd:chunked annotations ({annotations})"
        assert loc.variant == "old" and loc.tarsplit is None, what
        assert loc.toc_digest == annotations[OLD_MANIFEST_CHECKSUM], what

        path = blobs / layer["digest"].split(":")[1]
        size = path.stat().st_size
        assert size == layer["size"], what
        with open(path, "rb") as fh:
            fh.seek(size - 64)
            tail = fh.read()
            assert tail[-8:] == OLD_FOOTER_MAGIC, what  # the 40-byte footer, "GnUlInUx"
            footer = parse_footer(tail)
            assert footer.variant == "old" and footer.toc == loc.toc, what
            fh.seek(loc.toc.offset)
            compressed = fh.read(loc.toc.length)

        toc = parse_toc(decompress_toc(compressed, loc.toc_digest, loc.toc.uncompressed), size)

        def fetch(ranges, path=path):
            out = []
            with open(path, "rb") as fh:
                for start, end in ranges:
                    out.append(os.pread(fh.fileno(), end - start, start))
            return out

        reader = LayerReader(toc, fetch, layer=what)
        extracted = workdir / f"extracted-{i}"
        # Not compared with diff_ids[i]: skopeo 1.9 (containers/storage 1.43) re-packs the
        # tar when it writes zstd:chunked but leaves the config's diff_ids as they were.
        _extract(path, extracted)
        for k, v in _compare_reader_with_tree(reader, extracted, what).items():
            totals[k] = totals.get(k, 0) + v
        shutil.rmtree(extracted)
    # the comparison covered what matters: chunked files, holes, links
    assert totals["files"] > 700 and totals["multi_chunk_files"] > 5, totals
    assert totals["zero_chunks"] > 0 and totals["hardlinks"] > 0 and totals["symlinks"] > 100, totals


# --- c. podman partial pulls of shoal's layers ------------------------------------------------


class Podman:
    """podman with its own storage (overlay), configuration, tmp and state, all in `base`."""

    def __init__(self, base: Path, registry_host: str):
        self.base = base
        self.graph, self.run_root, self.tmp = base / "graph", base / "run", base / "tmp"
        for d in (self.graph, self.run_root, self.tmp, base / "net", base / "vol"):
            d.mkdir(parents=True, exist_ok=True)
        (base / "storage.conf").write_text(
            "[storage]\n"
            'driver = "overlay"\n'
            f"graphroot = {json.dumps(str(self.graph))}\n"
            f"runroot = {json.dumps(str(self.run_root))}\n"
            "[storage.options]\n"
            'pull_options = {enable_partial_images = "true", use_hard_links = "false", ostree_repos = ""}\n'
        )
        (base / "registries.conf").write_text(
            "unqualified-search-registries = []\n"
            "[[registry]]\n"
            f"location = {json.dumps(registry_host)}\n"
            "insecure = true\n"
        )
        (base / "containers.conf").write_text(
            "[engine]\n"
            'events_logger = "none"\n'
            'cgroup_manager = "cgroupfs"\n'
            f"image_copy_tmp_dir = {json.dumps(str(self.tmp))}\n"
        )
        (base / "auth.json").write_text('{"auths": {}}')
        self.env = {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "HOME": str(base),
            "TMPDIR": str(self.tmp),
            "CONTAINERS_STORAGE_CONF": str(base / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(base / "registries.conf"),
            "CONTAINERS_CONF": str(base / "containers.conf"),
            "REGISTRY_AUTH_FILE": str(base / "auth.json"),
        }
        self.flags = [
            "--root", self.graph, "--runroot", self.run_root, "--tmpdir", base / "libpod",
            "--network-config-dir", base / "net", "--volumepath", base / "vol",
            "--storage-driver", "overlay", "--events-backend", "none", "--cgroup-manager", "cgroupfs",
        ]

    def __call__(self, *args, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = _run([PODMAN, *self.flags, *args], timeout=timeout, env=self.env)
        return _check(proc) if check else proc

    def cleanup(self) -> list[str]:
        for args in (("image", "unmount", "--all", "--force"), ("rmi", "--all", "--force")):
            try:
                self(*args, check=False, timeout=60)
            except subprocess.TimeoutExpired:
                pass
        left = unmount_under(self.base)
        shutil.rmtree(self.base, ignore_errors=True)
        return left


# podman 4.3 creates these for its network backend even for a pull
_PODMAN_RUN_DIRS = ("/run/containers/networks", "/run/containers")


@pytest.fixture
def podman(registry, tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("podman tests run as root")
    _need(PODMAN)
    created = missing_dirs(*_PODMAN_RUN_DIRS)
    base = Path(tempfile.mkdtemp(prefix="shoal-pm-", dir="/tmp"))  # podman wants a runroot of at most 50 bytes
    store = Podman(base, registry.host)
    try:
        yield store
    finally:
        left = store.cleanup()
        remove_empty_dirs(created)
        assert not left, f"still mounted after podman cleanup: {left}"


def _cs143_name(name: str) -> str:
    """The name containers/storage 1.43 gives a TOC entry: it reads names with jsoniter's
    ReadStringAsSlice, which does not undo JSON escapes, so a tab in a name becomes a
    backslash and a "t" (it does the same with skopeo's own layers)."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def _compare_podman_layer(src: Path, diff: Path, what: str) -> dict[str, int]:
    """A layer podman laid down (`diff` of its overlay layer) against the folder it was
    built from: whiteouts became 0/0 char devices, opaque markers an xattr."""
    expected, whiteouts, opaque, fifos = [], [], [], []
    for rel in _walk(src):
        parent, _, base = rel.rpartition("/")
        if base == ".wh..wh..opq":
            opaque.append(parent)
        elif base.startswith(".wh."):
            whiteouts.append(f"{parent}/{base[4:]}" if parent else base[4:])
        elif stat.S_ISFIFO(os.lstat(src / rel).st_mode):
            fifos.append(rel)  # containers/storage 1.43 creates no fifos (nor devices)
        else:
            expected.append(rel)
    got = _walk(diff)
    assert got == sorted(_cs143_name(p) for p in expected + whiteouts), f"{what}: podman laid down other paths"
    for rel in whiteouts:
        st = os.lstat(diff / _cs143_name(rel))
        assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0, f"{what}: whiteout {rel!r}"
    for rel in opaque:
        assert os.getxattr(diff / rel, "trusted.overlay.opaque") == b"y", f"{what}: opaque {rel!r}"
    counts = {"files": 0, "owned": 0, "xattrs": 0, "renamed": 0, "hardlinks": 0}
    inodes: dict[tuple[int, int], list[str]] = {}
    for rel in expected:
        st = os.lstat(src / rel)
        if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
            inodes.setdefault((st.st_dev, st.st_ino), []).append(rel)
    for names in inodes.values():  # hard links inside the layer stay hard links
        first = os.lstat(diff / _cs143_name(names[0]))
        for other in names[1:]:
            counts["hardlinks"] += 1
            assert os.path.samestat(first, os.lstat(diff / _cs143_name(other))), f"{what}: {other!r}"
    for rel in expected:
        there = diff / _cs143_name(rel)
        counts["renamed"] += _cs143_name(rel) != rel
        a, b = os.lstat(src / rel), os.lstat(there)
        where = f"{what}: {rel!r}"
        assert _kind(a.st_mode) == _kind(b.st_mode), where
        assert (a.st_uid, a.st_gid) == (b.st_uid, b.st_gid), where
        if stat.S_ISLNK(a.st_mode):
            assert os.readlink(src / rel) == os.readlink(there), where
            continue
        assert stat.S_IMODE(a.st_mode) == stat.S_IMODE(b.st_mode), where
        if stat.S_ISREG(a.st_mode):
            counts["files"] += 1
            counts["owned"] += (a.st_uid, a.st_gid) != (0, 0)
            assert a.st_size == b.st_size, where
            assert int(b.st_mtime) == min(int(a.st_mtime), TAR_MTIME), where  # tar --clamp-mtime
            assert _sha256_file(src / rel) == _sha256_file(there), where
            src_x = _user_xattrs(src / rel)
            counts["xattrs"] += len(src_x)
            assert _user_xattrs(there) == src_x, where
    return counts


@pytest.mark.registry
def test_podman_partial_pull_of_converted_image(trees, registry, podman, workdir):
    _, dst, _ = _build_and_convert(trees, registry, workdir)
    manifest, config = _image(dst)
    layer_digests = [ly["digest"] for ly in manifest["layers"]]

    proc = podman("--log-level=debug", "pull", dst)
    log = proc.stderr
    # The partial-pull path: the zstd:chunked differ fetches file ranges and c/image
    # reports the blob as retrieved partially; a fallback to a full download logs
    # "Failed to retrieve partial blob" and no differ.
    assert "Failed to retrieve partial blob" not in log, log[-4000:]
    assert log.count("Applying differ in ") == len(layer_digests), log[-4000:]
    for digest in layer_digests:
        assert f"Retrieved partial blob {digest}" in log, f"{digest} was not pulled partially:\n{log[-4000:]}"
    assert log.count("Missing ") >= len(layer_digests)

    info = json.loads(podman("image", "inspect", dst).stdout)[0]
    assert info["RootFS"]["Layers"] == config["rootfs"]["diff_ids"]
    data = info["GraphDriver"]["Data"]
    assert info["GraphDriver"]["Name"] == "overlay"
    diffs = [data["UpperDir"], *data["LowerDir"].split(":")][::-1]  # bottom layer first
    assert len(diffs) == len(trees)

    totals: dict[str, int] = {}
    for i, (tree, diff) in enumerate(zip(trees, diffs)):
        for k, v in _compare_podman_layer(tree, Path(diff), f"layer {i} {layer_digests[i]}").items():
            totals[k] = totals.get(k, 0) + v
    assert totals["files"] > 700 and totals["xattrs"] >= 1 and totals["owned"] >= 1, totals
    assert totals["hardlinks"] >= 1, totals
    # uid/gid came through the old reader's case-sensitive "UID"/"GID" keys
    owned = os.lstat(Path(diffs[0]) / "data" / "with space.txt")
    assert (owned.st_uid, owned.st_gid) == (1234, 5678)

    # The merged view podman would give a container: whiteout and opaque dir applied.
    merged = Path(podman("image", "mount", dst).stdout.strip())
    try:
        assert (merged / "etc/motd").read_text() == "changed by the top layer\n"
        assert sorted(os.listdir(merged / "data/d0")) == ["new"]
        assert not os.path.lexists(merged / "data/-leading-dash")
        assert (merged / "usr/bin/python3").resolve().name == "python3.11"
    finally:
        podman("image", "unmount", dst, check=False)
