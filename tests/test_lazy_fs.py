"""Lazy layers through the real FUSE file system, from a real registry: an overlay of the
lazy layers equals `tar -x` of the layers in order, bad bytes never reach a reader."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from builder.convert import convert
from builder.format.footer import MANIFEST_CHECKSUM, MANIFEST_POSITION
from builder.oci.refs import open_source
from shoal.errors import DigestMismatch
from snapshotter import snapshotter as labels_of  # the remote-snapshot labels
from snapshotter.remote import RemoteLayers
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer, delta_layer, python_layer, special_layer
from tests.services import start_registry, wait_for

pytestmark = [pytest.mark.registry]

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse", allow_module_level=True)


def layer_labels(image: str, layer: dict, toc_digest: str | None = None) -> dict:
    ann = layer.get("annotations") or {}
    labels = {
        labels_of.LABEL_IMAGE_REF: image,
        labels_of.LABEL_LAYER_DIGEST: layer["digest"],
        labels_of.LABEL_LAYER_SIZE: str(layer["size"]),
        labels_of.LABEL_LAYER_MEDIA_TYPE: layer["mediaType"],
    }
    if MANIFEST_POSITION in ann:
        labels[labels_of.LABEL_TOC_POSITION] = ann[MANIFEST_POSITION]
        labels[labels_of.LABEL_TOC_DIGEST] = toc_digest or ann[MANIFEST_CHECKSUM]
    return labels


@pytest.fixture(scope="module")
def image(module_registry, tmp_path_factory):
    """A real image (busybox, python3.11 + stdlib, a delta layer with whiteouts) in a registry,
    gzip and converted."""
    registry = module_registry
    root = tmp_path_factory.mktemp("lazy image")
    layers = [busybox_layer(root / "l1"), python_layer(root / "l2"), delta_layer(root / "l3"),
              special_layer(root / "l4")]
    src = f"docker://{registry.host}/lazy/img:gzip"
    build_image([str(p) for p in layers], src, ImageConfig(), plain_http=True, workdir=str(root))
    dst = f"docker://{registry.host}/lazy/img:chunked"
    convert(src, dst, plain_http=True)
    with open_source(dst, plain_http=True) as s:
        manifest = json.loads(s.get_root().data)
    return registry, dst.removeprefix("docker://"), manifest, root


@pytest.fixture
def node(tmp_path):
    layers = RemoteLayers(str(tmp_path / "node root"))
    mounts: list[str] = []
    yield layers, mounts
    for m in reversed(mounts):
        subprocess.run(["umount", m], check=False)
    layers.fs.stop()
    assert not os.path.ismount(layers.fs.mnt)


def publish_tree(host: str, repo: str, root: Path, workdir: Path) -> tuple[str, dict]:
    """Build a one-layer image of the folder `root` at the registry `host` and convert
    it: (the converted image's reference, its layer's descriptor)."""
    src = f"docker://{host}/{repo}:gzip"
    build_image([str(root)], src, ImageConfig(), plain_http=True, workdir=str(workdir))
    dst = f"docker://{host}/{repo}:chunked"
    convert(src, dst, plain_http=True)
    with open_source(dst, plain_http=True) as s:
        layer = json.loads(s.get_root().data)["layers"][0]
    return dst.removeprefix("docker://"), layer


def prepare_tree(layers: RemoteLayers, host: str, repo: str, root: Path, workdir: Path) -> tuple[Path, dict]:
    """publish_tree, and the layer prepared on the node: (the layer's mount, its descriptor)."""
    ref, layer = publish_tree(host, repo, root, workdir)
    return Path(layers.prepare("t", "", layer_labels(ref, layer)).path), layer


def reference_rootfs(registry, image: str, manifest: dict, target: Path) -> None:
    """`tar -x` of the layers in order, whiteouts applied by hand, with GNU tar."""
    target.mkdir()
    with open_source(f"docker://{image}", plain_http=True) as src:
        for layer in manifest["layers"]:
            blob = target.parent / "layer.zst"
            with src.open_blob(layer["digest"], layer["size"]) as s, open(blob, "wb") as f:
                shutil.copyfileobj(s, f)
            tar_path = target.parent / "layer.tar"
            subprocess.run(f"zstd -dc '{blob}' > '{tar_path}'", shell=True, check=True)
            with tarfile.open(tar_path) as t:
                names = [m.name for m in t.getmembers()]
            for name in names:
                base = os.path.basename(name.rstrip("/"))
                parent = target / os.path.dirname(name.rstrip("/"))
                if base == ".wh..wh..opq":
                    for child in parent.iterdir() if parent.is_dir() else []:
                        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
                elif base.startswith(".wh."):
                    victim = parent / base[4:]
                    if victim.is_dir() and not victim.is_symlink():
                        shutil.rmtree(victim)
                    elif victim.exists() or victim.is_symlink():
                        victim.unlink()
            subprocess.run(["tar", "-x", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-p",
                            "--exclude=.wh.*", "-f", str(tar_path), "-C", str(target)], check=True)
            os.unlink(blob)
            os.unlink(tar_path)


def describe_tree(root: Path) -> dict:
    out = {}
    inodes: dict[int, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            item = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid}
            if stat.S_ISREG(st.st_mode):
                item["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
                item["size"] = st.st_size
                inodes.setdefault(st.st_ino, []).append(rel)
            elif stat.S_ISLNK(st.st_mode):
                item["target"] = os.readlink(p)
            elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
                item["rdev"] = st.st_rdev
            if not stat.S_ISLNK(st.st_mode):
                item["xattrs"] = {k: os.getxattr(p, k) for k in os.listxattr(p) if k.startswith("user.")}
                item["mtime"] = int(st.st_mtime)
            out[rel] = item
    out["<hard links>"] = sorted(sorted(v) for v in inodes.values() if len(v) > 1)
    return out


def test_overlay_of_lazy_layers_equals_tar_x(image, node, tmp_path):
    registry, ref, manifest, _ = image
    layers, mounts = node
    lowers = []
    for layer in manifest["layers"]:
        provided = layers.prepare("target", "", layer_labels(ref, layer))
        assert provided.kind == "lazy"
        lowers.append(provided.path)
    merged = tmp_path / "merged"
    merged.mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", "lowerdir=" + ":".join(reversed(lowers)),
                    str(merged)], check=True)
    mounts.append(str(merged))
    expected = tmp_path / "expected"
    reference_rootfs(registry, ref, manifest, expected)
    got, want = describe_tree(merged), describe_tree(expected)
    assert sorted(got) == sorted(want)
    for path in want:
        assert got[path] == want[path], path
    # the layers really are special: a whiteout, an opaque dir, a hard link, a setuid file
    assert not (merged / "data/-leading-dash").exists()
    assert sorted(os.listdir(merged / "data/d0")) == ["new"]
    assert (merged / "etc/motd").read_text() == "changed by the top layer\n"
    assert os.stat(merged / "data/setuid").st_mode & stat.S_ISUID
    assert (os.stat(merged / "data/with space.txt").st_uid, os.stat(merged / "data/with space.txt").st_gid) == (
        1234, 5678)
    # device nodes, a sparse file, a large directory, statfs
    assert stat.S_ISCHR(os.lstat(merged / "dev/null").st_mode) and os.lstat(merged / "dev/null").st_rdev == os.makedev(1, 3)
    assert stat.S_ISBLK(os.lstat(merged / "dev/loop9").st_mode)
    sparse = (merged / "var/sparse").read_bytes()
    assert sparse[: 6 << 20] == bytes(6 << 20) and sparse[6 << 20 :] == b"end of a sparse file\n"
    assert len(os.listdir(merged / "var/many")) == 3000 and os.listdir(merged / "var/empty-dir") == []
    vfs = os.statvfs(lowers[0])
    assert vfs.f_bsize == 4096 and vfs.f_files > 3000
    # a program runs from the lazy layers
    out = subprocess.run([str(merged / "usr/bin/python3.11"), "-c", "print(6*7)"], capture_output=True, text=True, check=False)
    assert out.stdout == "42\n"


def test_second_read_fetches_nothing_and_chunks_come_once(image, node):
    registry, ref, manifest, _ = image
    layers, _ = node
    python = manifest["layers"][1]
    path = Path(layers.prepare("t", "", layer_labels(ref, python)).path)
    before = registry.count("GET", python["digest"])
    data = (path / "usr/bin/python3.11").read_bytes()
    mid = registry.count("GET", python["digest"])
    assert mid[0] > before[0] and 0 < mid[1] - before[1] < python["size"]
    assert (path / "usr/bin/python3.11").read_bytes() == data  # page cache / chunk cache
    # a restarted file system server serves the layer again, from the node's chunk store
    layers.fs.stop()
    assert not os.path.ismount(layers.fs.mnt)
    layers.restore(str(path))
    assert (path / "usr/bin/python3.11").read_bytes() == data
    assert registry.count("GET", python["digest"]) == mid
    status = layers.fs.status()
    assert status["store"]["store"]["hits"] > 0
    assert "origin" not in status["store"]["sources"]


def test_read_ahead_chunks_are_decoded_only_when_read(image, node):
    """A read fetches the small files after its own in the same request, but decompresses
    and verifies only what is read: the next file is served from what came ahead, with
    no request to the registry, and a file never read is never decoded. Bytes fetched
    ahead that do not verify are fetched again when read, with a log line naming the
    chunk: never served."""
    from builder.inspect import read_toc
    from cache.loader import READAHEAD_GAP

    registry, ref, manifest, _ = image
    layers, _ = node
    layer = manifest["layers"][1]
    with open_source(f"docker://{ref}", plain_http=True) as src:
        _, toc = read_toc(src, layer, "layer")
    small = sorted((e for e in toc.files() if len(e.chunks) == 1 and e.chunks[0].end - e.chunks[0].start < 8 << 10),
                   key=lambda e: e.chunks[0].start)
    a, b, c = next((x, y, z) for x, y, z in zip(small, small[1:], small[2:])
                   if y.chunks[0].start - x.chunks[0].end <= READAHEAD_GAP
                   and z.chunks[0].start - y.chunks[0].end <= READAHEAD_GAP
                   and len({x.digest, y.digest, z.digest}) == 3
                   and sum(e.digest in (x.digest, y.digest, z.digest) for e in small) == 3)
    data_file = (registry.storage / "docker/registry/v2/blobs/sha256" / layer["digest"][7:9] / layer["digest"][7:]
                 / "data")
    original = data_file.read_bytes()
    corrupted = bytearray(original)
    corrupted[(c.chunks[0].start + c.chunks[0].end) // 2] ^= 0xFF

    def figures() -> dict:
        return next(ly for ly in layers.fs.status()["layers"] if ly["digest"] == layer["digest"])

    path = Path(layers.prepare("t", "", layer_labels(ref, layer)).path)
    try:
        data_file.write_bytes(bytes(corrupted))  # c's bytes are bad when the read of a brings them
        assert hashlib.sha256((path / a.name).read_bytes()).hexdigest() == a.digest[7:]
        ahead = figures()
        assert ahead["readahead_chunks"] >= 2 and ahead["readahead_used"] == 0, ahead
        memory = layers.fs.status()["store"]["memory"]
        assert memory["memory_chunks"] <= ahead["fetched_chunks"] - ahead["readahead_chunks"], (memory, ahead)
        registry.settle()
        gets = registry.count("GET", layer["digest"])[0]
        assert hashlib.sha256((path / b.name).read_bytes()).hexdigest() == b.digest[7:]
        registry.settle()
        assert registry.count("GET", layer["digest"])[0] == gets
        assert figures()["readahead_used"] == 1
    finally:
        data_file.write_bytes(original)
    assert hashlib.sha256((path / c.name).read_bytes()).hexdigest() == c.digest[7:]
    log = Path(layers.root, "logs", "fs.log").read_text()
    assert any("read ahead does not verify" in line and c.digest in line for line in log.splitlines()), log[-2000:]
    registry.settle()
    assert registry.count("GET", layer["digest"])[0] > gets
    assert figures()["readahead_used"] == 1 and figures()["errors"] == 0


def test_chunks_the_kernel_keeps_leave_the_chunk_memory(image, node):
    """A chunk whose every byte went to the kernel in READ replies (kept in its page
    cache) is forgotten by the chunk memory, so the next chunk decoded reuses its memory
    instead of faulting in fresh pages; the file still reads right once the kernel drops
    its pages (the chunk comes back through the loader, verified). An O_DIRECT read is
    not kept by the kernel: its chunks stay in memory. Fails before: every chunk read
    stayed in memory until the capacity pushed it out."""
    from builder.inspect import read_toc

    _, ref, manifest, _ = image
    layers, _ = node
    layer = manifest["layers"][1]
    with open_source(f"docker://{ref}", plain_http=True) as src:
        _, toc = read_toc(src, layer, "layer")
    digests = [c.digest for e in toc.files() for c in e.chunks]
    big, other = [e for e in toc.files() if len(e.chunks) >= 3 and e.size >= 64 << 10
                  and all(digests.count(c.digest) == 1 for c in e.chunks)][:2]

    def memory() -> dict:
        return layers.fs.status()["store"]["memory"]

    path = Path(layers.prepare("t", "", layer_labels(ref, layer)).path)
    before = memory()
    data = (path / big.name).read_bytes()
    assert hashlib.sha256(data).hexdigest() == big.digest[7:]
    after = memory()
    assert after["memory_bytes"] - before["memory_bytes"] < big.size // 2, (before, after)
    assert after["memory_released"] - before["memory_released"] >= len(big.chunks), (before, after)

    fd = os.open(path / big.name, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel lets its pages go
        misses = memory()["memory_misses"]
        assert hashlib.sha256(os.pread(fd, big.size, 0)).hexdigest() == big.digest[7:]
        assert memory()["memory_misses"] > misses  # the READs came back to the memory, which had let go
    finally:
        os.close(fd)

    held = memory()
    fd = os.open(path / other.name, os.O_RDONLY | os.O_DIRECT)
    try:
        buf = mmap.mmap(-1, -(-other.size // 4096) * 4096)
        got = os.preadv(fd, [buf], 0)
        assert hashlib.sha256(buf[:got]).hexdigest() == other.digest[7:]
    finally:
        os.close(fd)
    direct = memory()
    assert direct["memory_released"] == held["memory_released"], (held, direct)
    assert direct["memory_bytes"] - held["memory_bytes"] >= other.size, (held, direct)
    assert next(ly for ly in layers.fs.status()["layers"] if ly["digest"] == layer["digest"])["errors"] == 0


def test_toc_digest_mismatch_refuses_the_layer(image, node):
    _, ref, manifest, _ = image
    layers, _ = node
    with pytest.raises(DigestMismatch, match="TOC digest mismatch"):
        layers.prepare("t", "", layer_labels(ref, manifest["layers"][1], toc_digest="sha256:" + "0" * 64))
    assert os.listdir(os.path.join(layers.root, "layers")) == []


def test_corrupted_chunk_at_the_registry_is_eio_with_a_log_line(image, node, tmp_path):
    registry, ref, manifest, _root = image
    layers, _ = node
    # a fresh copy of the image under another name, whose python layer we corrupt in the
    # registry's storage: every byte the node gets is checked against the TOC digests
    layer = manifest["layers"][1]
    data_file = (registry.storage / "docker/registry/v2/blobs/sha256" / layer["digest"][7:9] / layer["digest"][7:]
                 / "data")
    original = data_file.read_bytes()
    try:
        path = Path(layers.prepare("t", "", layer_labels(ref, layer)).path)
        from builder.inspect import read_toc

        with open_source(f"docker://{ref}", plain_http=True) as src:
            _, toc = read_toc(src, layer, "layer")
        big = next(e for e in toc.files() if e.name.endswith("usr/bin/python3.11"))
        chunk = big.chunks[1]
        corrupted = bytearray(original)
        corrupted[(chunk.start + chunk.end) // 2] ^= 0xFF
        data_file.write_bytes(bytes(corrupted))
        with open(path / "usr/bin/python3.11", "rb") as f:
            f.seek(chunk.file_offset)
            with pytest.raises(OSError) as err:
                f.read(4096)
        assert err.value.errno == errno.EIO
        log = Path(layers.root, "logs", "fs.log").read_text()
        line = next(line for line in log.splitlines() if "ERROR" in line and "usr/bin/python3.11" in line)
        assert layer["digest"] in line and ("digest mismatch" in line or "cannot decompress" in line)
        assert layers.fs.status()["layers"][0]["errors"] >= 1
    finally:
        data_file.write_bytes(original)


def test_registry_down_is_eio_after_bounded_retries(tmp_path, node):
    """A read whose chunk cannot be fetched fails with EIO and a log line; it does not hang."""
    (tmp_path / "registry").mkdir()
    registry = start_registry(tmp_path / "registry", None)
    try:
        layers, _ = node
        root = tmp_path / "tree"
        (root / "data").mkdir(parents=True)
        (root / "data/big").write_bytes(os.urandom(3 << 20))
        path, layer = prepare_tree(layers, registry.host, "down/img", root, tmp_path)
    finally:
        registry.stop()
    import time

    start = time.monotonic()
    with pytest.raises(OSError) as err:
        (path / "data/big").read_bytes()
    assert err.value.errno == errno.EIO
    assert time.monotonic() - start < 120  # bounded (retries with timeouts), not a hang
    log = Path(layers.root, "logs", "fs.log").read_text()
    assert any("ERROR" in line and "data/big" in line and layer["digest"] in line for line in log.splitlines())


def test_registry_credentials_come_from_docker_config(basic_registry, docker_config, node, tmp_path):
    """A private registry: the node fetches TOC and chunks with the docker config.json credentials."""
    layers, _ = node
    docker_config.login(basic_registry.host, basic_registry.username, basic_registry.password)
    root = tmp_path / "tree"
    (root / "etc").mkdir(parents=True)
    (root / "etc/secret").write_text("private content\n")
    path, _ = prepare_tree(layers, basic_registry.host, "private/img", root, tmp_path)
    assert (path / "etc/secret").read_text() == "private content\n"


def test_cri_labels_alone_find_the_toc_through_the_manifest(image, node):
    """containerd's CRI sends image ref, layer digest and manifest digest only: the node
    fetches the manifest (verified by its digest) for the layer's TOC annotations."""
    _registry, ref, manifest, _ = image
    layers, _ = node
    with open_source(f"docker://{ref}", plain_http=True) as s:
        manifest_digest = s.get_root().digest
    layer = manifest["layers"][0]
    labels = {
        labels_of.LABEL_CRI_IMAGE_REF: ref,
        labels_of.LABEL_CRI_LAYER_DIGEST: layer["digest"],
        labels_of.LABEL_CRI_MANIFEST_DIGEST: manifest_digest,
    }
    provided = layers.prepare("t", "", labels)
    assert provided.kind == "lazy"
    assert (Path(provided.path) / "etc/motd").read_text() == "hello from a shoal test image\n"


def test_two_nodes_behind_a_region_cost_the_origin_one_copy(image, tmp_path):
    """`shoal region` in front of the origin; two nodes configured with it read the same
    file: the origin serves the blob once (to the region), the second node's reads are
    region hits."""
    import signal

    import requests

    from tests.services import start_region, stop_process

    registry, ref, manifest, _ = image
    python = manifest["layers"][1]
    region, url, ca = start_region(registry.url, tmp_path / "region store", tmp_path / "region.log")
    nodes = []
    try:
        origin_before = registry.count("GET", f"/blobs/{python['digest']}")
        datas = []
        for i in range(2):
            n = RemoteLayers(str(tmp_path / f"node {i}"), {"region_url": url, "region_ca": ca})
            nodes.append(n)
            path = Path(n.prepare("t", "", layer_labels(ref, python)).path)
            datas.append((path / "usr/bin/python3.11").read_bytes())
            sources = n.fs.status()["store"]["sources"]
            assert sources["region"]["bytes"] > 0 and "origin" not in sources, sources
        assert datas[0] == datas[1] and datas[0] == Path("/usr/bin/python3.11").read_bytes()
        gets, _ = registry.count("GET", f"/blobs/{python['digest']}")
        # the nodes asked the origin nothing, their TOCs included (no "origin" source above):
        # the region fetched the blob once (and, at most, ranges of it ahead of its fill)
        assert gets - origin_before[0] <= 3
        status = requests.get(f"{url}/-/status", timeout=10, verify=ca).json()
        assert status["hits"] > 0
        region.send_signal(signal.SIGTERM)
        region.wait(timeout=20)
    finally:
        for n in nodes:
            n.fs.stop()
        stop_process(region)
        region.stdout.close()


def test_malformed_toc_with_a_valid_digest_refuses_the_layer(image, node, tmp_path):
    """A TOC whose digest matches its annotation but whose entries are hostile (a path
    that escapes the root) is refused when the layer is prepared: nothing is mounted and
    the layer leaves nothing behind on the node."""
    import zstandard

    from builder.format.footer import MANIFEST_TYPE_CRFS, skippable_frame
    from shoal.errors import ShoalError
    from tests.test_region import push_blob

    registry, ref, _, _ = image
    toc = json.dumps({"version": 1, "entries": [
        {"type": "reg", "name": "../../etc/evil", "size": 1, "offset": 0, "endOffset": 1,
         "digest": "sha256:" + "a" * 64}]}).encode()
    compressed = zstandard.ZstdCompressor().compress(toc)
    blob = skippable_frame(compressed)
    repo = ref.split("/", 1)[1].split(":")[0]
    digest = push_blob(registry, repo, blob, tmp_path)
    layer = {"digest": digest, "size": len(blob), "mediaType": "application/vnd.oci.image.layer.v1.tar+zstd",
             "annotations": {MANIFEST_POSITION: f"8:{len(compressed)}:{len(toc)}:{MANIFEST_TYPE_CRFS}",
                             MANIFEST_CHECKSUM: "sha256:" + hashlib.sha256(compressed).hexdigest()}}
    layers, _ = node
    with pytest.raises(ShoalError, match="escapes the layer root") as err:
        layers.prepare("t", "", layer_labels(ref, layer))
    assert digest in str(err.value)
    assert os.listdir(os.path.join(layers.root, "layers")) == []
    assert not os.listdir(layers.fs.mnt)


def test_sweep_drops_layers_no_snapshot_uses(image, node):
    """What a crash can leave (a layer whose snapshot is gone, a half-made layer folder,
    an unpacked folder nobody records) is removed when the node starts; recorded layers
    stay mounted and readable."""
    _, ref, manifest, _ = image
    layers, _ = node
    kept = Path(layers.prepare("a", "", layer_labels(ref, manifest["layers"][0])).path)
    orphan = Path(layers.prepare("b", "", layer_labels(ref, manifest["layers"][1])).path)
    half = Path(layers.root, "layers", ".tmp-crashed")
    half.mkdir()
    stray = Path(layers.unpacked_dir, "0" * 64)
    stray.mkdir()
    removed = layers.sweep({str(kept)})
    assert sorted(removed) == sorted([str(half), str(Path(layers.root, "layers", orphan.name)), str(stray)])
    assert not half.exists() and not stray.exists() and not Path(layers.root, "layers", orphan.name).exists()
    assert [ly["id"] for ly in layers.fs.status()["layers"]] == [kept.name]
    assert not orphan.exists()
    assert (kept / "bin/busybox").read_bytes()[:4] == b"\x7fELF"


def test_kernel_read_ahead_is_raised_on_the_mount(image, node):
    """The layer file system widens the kernel's read-ahead on its mount (FUSE's default
    is 128 KiB) once the mount is up: a page fault in a mapped library then asks for the
    pages around it in parallel."""
    _, ref, manifest, _ = image
    layers, _ = node
    path = Path(layers.prepare("t", "", layer_labels(ref, manifest["layers"][0])).path)
    assert (path / "bin/busybox").read_bytes()[:4] == b"\x7fELF"
    from shoal.fsutil import mounts

    dev = next(dev for point, dev in mounts() if point == layers.fs.mnt)
    assert Path(f"/sys/class/bdi/{dev}/read_ahead_kb").read_text().strip() == "1024"


def test_first_prepare_warms_the_image_s_other_layers(image, node):
    """The first prepare of an image's layer loads the TOCs of its other lazy layers in
    the background (containerd prepares them one after the other); their own prepares
    then fetch nothing more, and serve the same files."""
    registry, ref, manifest, _ = image
    layers, _ = node
    manifest_digest = _manifest_digest(ref)
    labels = [{**layer_labels(ref, ly), labels_of.LABEL_CRI_MANIFEST_DIGEST: manifest_digest}
              for ly in manifest["layers"]]
    layers.prepare("l0", "", labels[0])
    others = {ly["digest"][7:] for ly in manifest["layers"][1:]}
    wait_for(lambda: others <= {ly["id"] for ly in layers.fs.status()["layers"]}
             and layers.warmed_layers == len(others), "the other layers to be warmed")
    before = [registry.count("GET", ly["digest"]) for ly in manifest["layers"][1:]]
    paths = [Path(layers.prepare(f"l{i}", "", labels[i]).path) for i in range(1, len(labels))]
    assert [registry.count("GET", ly["digest"]) for ly in manifest["layers"][1:]] == before
    assert (paths[0] / "usr/bin/python3.11").stat().st_size > 0


# --- access profiles (prefetch/profile.py, shoal profile, prefetch by the node) -------------------


def _manifest_digest(ref: str) -> str:
    with open_source(f"docker://{ref}", plain_http=True) as src:
        return "sha256:" + hashlib.sha256(src.get_root().data).hexdigest()


def _prepare_image(layers: RemoteLayers, ref: str, manifest: dict, manifest_digest: str) -> list[Path]:
    """Prepare every layer the way CRI does (with the manifest digest label)."""
    labels = [{**layer_labels(ref, ly), labels_of.LABEL_CRI_MANIFEST_DIGEST: manifest_digest}
              for ly in manifest["layers"]]
    return [Path(layers.prepare(f"p{i}", "", lab).path) for i, lab in enumerate(labels)]




def test_access_profile_is_recorded_published_and_prefetched(image, node, tmp_path):
    """A node notes the chunks reads use, in order; `shoal profile save --push` publishes
    them next to the image; a cold node that prepares the image fetches exactly those
    chunks before any read, and the same reads then send nothing to the registry."""
    from prefetch.profile import profile_tag
    from tests.services import SHOAL

    registry, ref, manifest, _ = image
    digest = _manifest_digest(ref)
    layers_a, _ = node
    mounts_a = _prepare_image(layers_a, ref, manifest, digest)
    reads = [(1, "usr/bin/python3.11", 0, 200_000), (0, "bin/busybox", 0, None),
             (1, "usr/lib/python3.11/json/decoder.py", 0, None)]

    def read_all(mounts: list[Path]) -> list[bytes]:
        out = []
        for i, path, off, size in reads:
            with open(mounts[i] / path, "rb") as f:
                f.seek(off)
                out.append(f.read(size) if size else f.read())
        return out

    want = read_all(mounts_a)
    trace = layers_a.fs.profile()
    assert trace and trace[0][0] == manifest["layers"][1]["digest"]  # python3.11 was read first
    assert len({(d, a) for d, a, _ in trace}) == len(trace)  # each chunk once

    saved = subprocess.run([SHOAL, "profile", "save", ref, "--root", str(tmp_path / "node root"), "--push", "--json"],
                           capture_output=True, text=True, check=False)
    assert saved.returncode == 0, saved.stderr
    summary = json.loads(saved.stdout)
    assert summary["chunks"] == len(trace) and profile_tag(digest) in summary["where"]
    shown = subprocess.run([SHOAL, "profile", "show", ref, "--json"], capture_output=True, text=True, check=False)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["chunks"] == len(trace)

    # a cold node: preparing the image fetches the profile's chunks, before any read
    layers_b = RemoteLayers(str(tmp_path / "cold node"))
    try:
        mounts_b = _prepare_image(layers_b, ref, manifest, digest)

        def prefetched():
            status = layers_b.fs.status()["layers"]
            return sum(ly["prefetched_chunks"] for ly in status) == len(trace) and status

        wait_for(prefetched, "the profile's chunks to be prefetched")
        assert layers_b.prefetched_images == 1
        status = subprocess.run([SHOAL, "status", "--root", str(tmp_path / "cold node"), "--json"],
                                capture_output=True, text=True, check=True)
        assert json.loads(status.stdout)["prefetch"]["queued_chunks"] == len(trace)
        text = subprocess.run([SHOAL, "status", "--root", str(tmp_path / "cold node")],
                              capture_output=True, text=True, check=True).stdout
        assert f"prefetch (access profiles): {len(trace)} chunks queued" in text
        blobs = [ly["digest"] for ly in manifest["layers"]]
        before = [registry.count("GET", b) for b in blobs]
        assert read_all(mounts_b) == want
        assert [registry.count("GET", b) for b in blobs] == before  # every chunk was there already
        # `shoal status --json` counts the FUSE requests the layer file system answered, per opcode
        status = subprocess.run([SHOAL, "status", "--root", str(tmp_path / "cold node"), "--json"],
                                capture_output=True, text=True, check=True)
        ops = json.loads(status.stdout)["fs_server"]["ops"]
        assert ops["read"]["count"] >= 1 and ops["lookup"]["count"] >= 1 and ops["open"]["count"] >= 1
        assert all(op["seconds"] >= 0 for op in ops.values())
        from snapshotter.status import node_metrics

        metrics = node_metrics(json.loads(status.stdout))
        assert f'shoal_node_fuse_requests_total{{op="read"}} {ops["read"]["count"]}' in metrics, metrics
    finally:
        layers_b.fs.stop()
    assert not os.path.ismount(layers_b.fs.mnt)


def test_node_ignores_profiles_when_told_and_survives_bad_ones(image, tmp_path, caplog):
    """`[fetch] prefetch_profiles = false` fetches no profile; a malformed profile is
    refused with a log line naming the image, and reads are unaffected; a profile whose
    ranges are not chunks of the layer prefetches nothing."""
    import logging

    from prefetch.profile import Profile, fetch_profile, push_profile
    from shoal.errors import FormatError
    from tests.lab.provide import push_profile_bytes

    registry, ref, manifest, _ = image
    digest = _manifest_digest(ref)
    host, repo = ref.split("/", 1)
    repo = repo.split(":", 1)[0]
    top = manifest["layers"][1]["digest"]

    def cold_node(name: str, config: dict | None = None) -> tuple[RemoteLayers, list[Path]]:
        layers = RemoteLayers(str(tmp_path / name), config)
        return layers, _prepare_image(layers, ref, manifest, digest)

    # ranges that are no chunk of the layer: accepted by the format, skipped by the node
    layer_digests = [ly["digest"] for ly in manifest["layers"]]
    push_profile(host, repo, Profile(digest, [(top, 1, 2), (top, 3, 99)]), layer_digests, plain_http=True)
    layers, mounts = cold_node("skips")
    try:
        wait_for(lambda: layers.prefetched_images == 1, "the profile to be handed over")
        assert sum(ly["prefetched_chunks"] for ly in layers.fs.status()["layers"]) == 0
        assert (mounts[1] / "usr/bin/python3.11").read_bytes()[:4] == b"\x7fELF"
    finally:
        layers.fs.stop()

    # malformed: refused when fetched, with a log line; the node goes on
    for blob in (b"{not json", json.dumps({"schemaVersion": 1, "manifest": digest, "layers": [top],
                                           "chunks": [[5, 0, 10]]}).encode()):
        push_profile_bytes(host, repo, digest, blob, plain_http=True)
        with pytest.raises(FormatError):
            fetch_profile(host, repo, digest, True, layer_digests)
    caplog.set_level(logging.WARNING, logger="shoal.remote")
    layers, mounts = cold_node("bad")
    try:
        wait_for(lambda: any("access profile" in r.getMessage() and ref in r.getMessage()
                              for r in caplog.records), "a log line about the bad profile")
        assert layers.prefetched_images == 0
        assert (mounts[0] / "bin/busybox").stat().st_size > 0
    finally:
        layers.fs.stop()

    # switched off: the profile is not even fetched
    push_profile(host, repo, Profile(digest, [(top, 1, 2)]), layer_digests, plain_http=True)
    gets = registry.count("GET", "shoal-profile")[0]
    layers, _ = cold_node("off", {"prefetch_profiles": False})
    try:
        layers._warm_pool.shutdown(wait=True)  # the warm-up, which would fetch the profile, is over
        assert registry.count("GET", "shoal-profile")[0] == gets and layers.prefetched_images == 0
    finally:
        layers.fs.stop()


def test_a_profile_is_bounded_and_bound_to_its_manifest(image, node, tmp_path, caplog):
    """Anyone who can push to a repository can publish its profile, so a profile can make
    a node fetch at most `[fetch] prefetch_max_bytes` (its first ranges), names each range
    once, and is used only for the manifest its artifact is bound to."""
    import logging

    from builder.oci.refs import DockerRef
    from builder.oci.registry import RegistryDestination, RegistrySource
    from prefetch.profile import Profile, fetch_profile, profile_tag, push_profile
    from shoal.errors import FormatError

    _registry, ref, manifest, _ = image
    digest = _manifest_digest(ref)
    host, repo = ref.split("/", 1)
    repo = repo.split(":", 1)[0]
    layer_digests = [ly["digest"] for ly in manifest["layers"]]
    layers_a, _ = node
    mounts_a = _prepare_image(layers_a, ref, manifest, digest)
    (mounts_a[1] / "usr/bin/python3.11").read_bytes()
    (mounts_a[0] / "bin/busybox").read_bytes()
    trace = [tuple(c) for c in layers_a.fs.profile()]
    assert len(trace) >= 4

    # every range twice: published as it is, read back with each range once, in order
    push_profile(host, repo, Profile(digest, trace + trace[::-1]), layer_digests, plain_http=True)
    assert fetch_profile(host, repo, digest, True, layer_digests).chunks == trace

    # a budget of half the ranges' bytes: the first ranges only, and a log line
    half = len(trace) // 2
    budget = sum(end - start for _, start, end in trace[:half])
    caplog.set_level(logging.WARNING, logger="shoal.remote")
    cold = RemoteLayers(str(tmp_path / "bounded"), {"prefetch_max_bytes": budget})
    try:
        _prepare_image(cold, ref, manifest, digest)
        wait_for(lambda: cold.prefetched_images == 1, "the profile to be handed over")
        wait_for(lambda: sum(ly["prefetched_chunks"] for ly in cold.fs.status()["layers"]) == half,
                 "the first half of the profile to be prefetched")
        assert cold.fs.status()["prefetch"]["queued_chunks"] == half
        assert any("prefetch_max_bytes" in r.getMessage() and ref in r.getMessage() for r in caplog.records)
    finally:
        cold.fs.stop()

    # another image's profile put under this image's profile tag is refused
    other = "sha256:" + "ab" * 32
    push_profile(host, repo, Profile(other, trace[:1]), layer_digests, plain_http=True)
    src = RegistrySource(DockerRef(host, repo, tag=profile_tag(other)), True)
    dest = RegistryDestination(DockerRef(host, repo, tag=profile_tag(digest)), True)
    try:
        dest.put_root(src.get_root())
    finally:
        src.close()
        dest.close()
    with pytest.raises(FormatError, match="bound to"):
        fetch_profile(host, repo, digest, True, layer_digests)


def test_profile_commands_fail_in_one_line(image, node, tmp_path):
    """`shoal profile`: nothing read yet, no layer fs, no profile published, no
    destination: each a one-line error and its exit status."""
    from tests.services import SHOAL

    registry, ref, _manifest, _ = image
    layers, _ = node

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([SHOAL, "profile", *args], capture_output=True, text=True, check=False)

    for args, status, words in [
        (("save", ref, "--root", str(tmp_path / "none"), "--push"), 1, "no layer file system runs"),
        (("save", ref, "--root", str(tmp_path / "node root")), 2, "--push"),
        (("show", f"{registry.host}/lazy/img:gzip"), 1, "no access profile published"),
        (("save", f"{registry.host}/lazy/nothing:here", "--push"), 1, "lazy/nothing"),
    ]:
        proc = run(*args)
        assert proc.returncode == status, (args, proc.stderr)
        assert words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    # a running layer fs that has read nothing of the image
    layers.fs.ensure_running()
    proc = run("save", ref, "--root", str(tmp_path / "node root"), "--push")
    assert proc.returncode == 1 and "has read nothing" in proc.stderr, proc.stderr


def test_a_read_waiting_on_a_failed_prefetch_fetches_the_chunk_itself(image, tmp_path):
    """A read that finds its chunk claimed by a read-ahead or prefetch waits for it; if
    that speculative fetch fails, the read fetches the chunk itself (from the real
    registry here) instead of failing. A failed fetch that a read asked for still fails
    the reads that wait on it."""
    import threading

    from builder.format.footer import location_from_annotations
    from builder.format.toc import decompress_toc, parse_toc
    from builder.oci.refs import DockerRef
    from builder.oci.registry import RegistrySource
    from cache.loader import Unfetched
    from cache.source import BlobRef
    from shoal.errors import ShoalError
    from snapshotter.assemble import make_data_path

    _registry, ref, manifest, _ = image
    host, repo = ref.split("/", 1)
    repo = repo.split(":", 1)[0]
    desc = manifest["layers"][1]
    loc = location_from_annotations(desc["annotations"])
    src = RegistrySource(DockerRef(host, repo, digest=desc["digest"]), plain_http=True)
    try:
        toc = parse_toc(decompress_toc(src.read_range(desc["digest"], loc.toc.offset, loc.toc.end),
                                       loc.toc_digest, loc.toc.uncompressed), desc["size"])
    finally:
        src.close()
    chunks = [c for e in toc.files() for c in e.chunks if c.digest and not c.zeros][:2]
    path = make_data_path(str(tmp_path / "node"), {})
    try:
        loader = path.loader(BlobRef(host, repo, desc["digest"], desc["size"], True), "layer under test")
        flight = loader.flight
        for error, survives in ((Unfetched("prefetch: registry gone"), True), (ShoalError("read: registry gone"), False)):
            c = chunks[0] if survives else chunks[1]
            _fut, owner = flight.claim(c.digest)  # someone else's fetch of the chunk is on its way
            assert owner
            got: dict = {}
            reader = threading.Thread(target=lambda got=got, c=c: got.update(r=_try(lambda: loader.load([c], "read"))))
            reader.start()
            wait_for(lambda: flight.waits > 0, "the read to wait for the chunk")
            flight.resolve(c.digest, error=error)
            reader.join(60)
            if survives:
                assert got["r"][0] is not None and len(got["r"][0][0]) == c.size
            else:
                assert isinstance(got["r"][1], ShoalError) and "registry gone" in str(got["r"][1])
            flight.waits = 0
    finally:
        path.close(10.0)


def _try(fn):
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - the test looks at it
        return None, e
