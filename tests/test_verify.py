"""Every byte is checked at the source it came from (issue 10, test 3): a lazy layer read
through the real FUSE file system of a node whose region cache (in-process server, disk
backend or S3 through moto's server) holds a corrupt copy of the layer, or whose origin
(Debian's docker-registry behind a byte-flipping HTTP proxy of this test) answers ranges
with wrong bytes. The read succeeds from the next source; the bad source is counted in
`shoal status --json` and logged once; with every source bad, EIO and a log line; the
region drops the bad copy it was told of and a later request gets good bytes.
"""

from __future__ import annotations

import errno
import hashlib
import http.server
import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="aiohttp is needed for the region cache (shoal[node])")
import requests

from builder.inspect import read_toc
from builder.oci.refs import open_source
from cache.region import backends
from shoal.metrics import parse as parse_metrics
from snapshotter.remote import RemoteLayers
from snapshotter.status import node_metrics
from tests.services import wait_for
from tests.test_cache_store import s3_bucket, s3_server  # noqa: F401  (fixtures)
from tests.test_lazy_fs import layer_labels, publish_tree
from tests.test_region import region_factory  # noqa: F401  (fixture)

pytestmark = [pytest.mark.registry]

if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
    pytest.skip("needs root and /dev/fuse", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20


class FlippingProxy:
    """An HTTP proxy of this test in front of the real registry: passes every request
    on; while `flip` is set, inverts one byte in the middle of every 206 (range) answer,
    as an origin with a bad disk or a broken middlebox would; with `flip_whole` also of
    every whole blob (200) answer (so a region filling through it gets bad bytes)."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.flip = False
        self.flip_whole = False
        self.flipped = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                r = requests.request(self.command, proxy.upstream + self.path, headers=headers, timeout=30,
                                     allow_redirects=True, stream=False)
                body = r.content if self.command != "HEAD" else b""
                if body and ((r.status_code == 206 and proxy.flip) or
                             (r.status_code == 200 and proxy.flip_whole and "/blobs/" in self.path)):
                    body = bytearray(body)
                    body[len(body) // 2] ^= 0xFF
                    body = bytes(body)
                    proxy.flipped += 1
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "content-encoding"):
                        self.send_header(k, v)
                self.send_header("Content-Length", r.headers.get("Content-Length", "0") if self.command == "HEAD"
                                 else str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_HEAD = _forward  # (http.server API)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.url = f"http://{self.host}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)


@pytest.fixture
def image(registry, tmp_path):
    """A one-layer converted image of two random 3 MiB files (several chunks each) at the
    registry: (ref, layer descriptor, file name -> bytes)."""
    tree = tmp_path / "tree"
    (tree / "data").mkdir(parents=True)
    files = {f"data/{n}": random.Random(n).randbytes(3 * MiB) for n in ("a.bin", "b.bin")}
    for name, data in files.items():
        (tree / name).write_bytes(data)
    ref, layer = publish_tree(registry.host, "verify/img", tree, tmp_path)
    with open_source(f"docker://{ref}", plain_http=True) as s:
        _, toc = read_toc(s, layer, "layer")
    chunks = {e.name.lstrip("./"): e.chunks for e in toc.files()}
    return ref, layer, files, chunks


@pytest.fixture
def nodes(tmp_path):
    """make(config) -> RemoteLayers under a fresh root (layer fs stopped after the test)."""
    made: list[RemoteLayers] = []

    def make(config: dict) -> RemoteLayers:
        layers = RemoteLayers(str(tmp_path / f"node {len(made)}"), config)
        made.append(layers)
        return layers

    yield make
    for layers in made:
        layers.fs.stop()
        assert not os.path.ismount(layers.fs.mnt)


def status(node: RemoteLayers) -> dict:
    """`shoal status --json` of the node, as a user runs it."""
    out = subprocess.run([sys.executable, "-m", "cli", "status", "--root", node.root, "--json"],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def status_text(node: RemoteLayers) -> str:
    out = subprocess.run([sys.executable, "-m", "cli", "status", "--root", node.root],
                         capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    return out.stdout


def fs_log(node: RemoteLayers) -> list[str]:
    return Path(node.root, "logs", "fs.log").read_text().splitlines()


def corrupt(data: bytes, chunks) -> bytes:
    """`data` (the blob) with one byte inverted in the middle of each chunk given."""
    out = bytearray(data)
    for c in chunks:
        out[(c.start + c.end) // 2] ^= 0xFF
    return bytes(out)


def fill(region, ref: str, layer: dict) -> None:
    """The region fetches the whole blob (as a node's first request would) and commits it."""
    host, _, repo = ref.partition("/")
    r = requests.get(f"{region.url}/v2/{repo.rpartition(':')[0]}/blobs/{layer['digest']}?ns={host}", timeout=60)
    assert r.status_code == 200 and hashlib.sha256(r.content).hexdigest() == layer["digest"][7:]
    assert region.wait_idle()["fills_committed"] >= 1
    assert region.backend.contains(layer["digest"])


def stored(region, digest: str) -> bytes | None:
    try:
        return region.backend.read(digest)
    except backends.BlobNotFound:
        return None


def replace_stored(region, digest: str, data: bytes, s3: dict | None) -> None:
    """Overwrite the region's stored copy in place, as disk rot or a bad S3 object would."""
    if s3 is None:
        path = region.backend.local_path(digest)
        with open(path, "r+b") as fh:
            fh.write(data)
    else:
        s3["client"].put_object(Bucket=s3["bucket"], Key=f"region/blobs/sha256/{digest[7:]}", Body=data)
    assert stored(region, digest) == data


@pytest.mark.parametrize("backend", ["disk", "s3"])
def test_a_corrupt_region_copy_is_read_from_the_origin_and_dropped(backend, registry, image, region_factory,  # noqa: F811
                                                                   nodes, request, tmp_path):
    ref, layer, files, chunks = image
    digest = layer["digest"]
    s3 = None
    if backend == "s3":
        s3 = request.getfixturevalue("s3_bucket")
        made = backends.create("s3", bucket=s3["bucket"], endpoint_url=s3["endpoint_url"], prefix="region/",
                               staging=tmp_path / "staging")
        region = region_factory(registry, backend=made)
    else:
        region = region_factory(registry)
    fill(region, ref, layer)
    good = stored(region, digest)
    bad_chunks = chunks["data/a.bin"][1:3]  # two chunks of one file: one log line for the layer
    replace_stored(region, digest, corrupt(good, bad_chunks), s3)

    node = nodes({"region_url": region.url})
    mount = Path(node.prepare("t", "", layer_labels(ref, layer)).path)
    assert (mount / "data/a.bin").read_bytes() == files["data/a.bin"]

    st = status(node)
    fetch = st["fetch"]
    assert fetch["verify_failures"]["region"] >= 1, fetch
    assert fetch["verify_failures"].get("origin", 0) == 0, fetch
    assert fetch["bytes_from_origin"] > 0 and fetch["bytes_from_region"] > 0, fetch
    assert st["data_path"]["sources"]["region"]["verify_failures"] == fetch["verify_failures"]["region"]
    assert "verify failures" in status_text(node)
    metrics = parse_metrics(node_metrics(st))  # what the node's /metrics serves
    assert metrics['shoal_node_fetch_verify_failures_total{source="region"}'] == fetch["verify_failures"]["region"]
    lines = [line for line in fs_log(node) if "region" in line and digest in line and "failed verification" in line]
    assert len(lines) == 1, lines  # once per (source, layer), however many chunks
    assert "chunk at" in lines[0] and "data/a.bin" in lines[0], lines[0]

    # told by the node, the region checks its copy itself, drops it and fetches a good one
    wait_for(lambda: stored(region, digest) != corrupt(good, bad_chunks), "the region to drop its bad copy", 30)
    assert region.stats()["store_verify_failures"] >= 1
    second = nodes({"region_url": region.url})
    mount = Path(second.prepare("t", "", layer_labels(ref, layer)).path)
    assert (mount / "data/a.bin").read_bytes() == files["data/a.bin"]
    assert (mount / "data/b.bin").read_bytes() == files["data/b.bin"]
    fetch = status(second)["fetch"]
    assert not any(fetch["verify_failures"].values()) and fetch["bytes_from_region"] > 0, fetch
    region.wait_idle()
    assert stored(region, digest) == good


def toc_range(layer: dict) -> tuple[int, int]:
    """[start, end) of the layer's compressed TOC in its blob (from its annotations)."""
    from builder.format.footer import location_from_annotations

    loc = location_from_annotations(layer["annotations"])
    assert loc is not None
    return loc.toc.offset, loc.toc.end


def origin_blob_gets(registry, digest: str) -> int:
    return registry.count("GET", f"/blobs/{digest}")[0]


def filled_region(registry, image, start_region):
    """A region holding the image's layer: (ref, layer, files, digest, TOC range, region)."""
    ref, layer, files, _ = image
    region = start_region(registry)
    fill(region, ref, layer)
    return ref, layer, files, layer["digest"], toc_range(layer), region


def test_a_lazy_layers_toc_comes_through_the_region(registry, image, region_factory, nodes):  # noqa: F811
    """A node with a region reads its layers' TOCs through its fetch chain, in the layer
    file system: from the region's copy, the origin asked nothing; the TOC's bytes are
    counted by source and as TOC bytes in `shoal status` and /metrics."""
    ref, layer, files, digest, (start, end), region = filled_region(registry, image, region_factory)
    gets = origin_blob_gets(registry, digest)
    node = nodes({"region_url": region.url})
    mount = Path(node.prepare("t", "", layer_labels(ref, layer)).path)
    assert origin_blob_gets(registry, digest) == gets  # no TOC range (nor anything else) from the origin
    st = status(node)
    fetch, sources = st["fetch"], st["data_path"]["sources"]
    assert fetch["tocs_loaded"] == 1 and fetch["toc_bytes"] == end - start, fetch
    assert sources["region"]["bytes"] == end - start and "origin" not in sources, sources
    metrics = parse_metrics(node_metrics(st))
    assert metrics["shoal_node_toc_bytes_total"] == end - start
    assert metrics['shoal_node_fetched_bytes_total{source="region"}'] == end - start
    toc_json = Path(node.root, "layers", digest[7:], "toc.json")
    assert oct(toc_json.stat().st_mode & 0o777) == "0o600"  # written by the file system server, root's alone
    assert (mount / "data/a.bin").read_bytes() == files["data/a.bin"]
    assert origin_blob_gets(registry, digest) == gets


def test_a_region_sending_a_corrupt_toc_is_caught(registry, image, region_factory, nodes):  # noqa: F811
    """The region's copy is corrupt in the TOC range: the node's file system refuses the
    region's TOC bytes (a verify failure of the region, logged once), asks the origin, and
    the prepare succeeds. With a TOC digest that no source's bytes match, the prepare
    fails with one line naming the image and layer, and nothing is mounted."""
    from shoal.errors import DigestMismatch

    ref, layer, files, digest, (start, end), region = filled_region(registry, image, region_factory)
    good = stored(region, digest)
    bad = bytearray(good)
    bad[(start + end) // 2] ^= 0xFF
    replace_stored(region, digest, bytes(bad), None)
    node = nodes({"region_url": region.url})
    mount = Path(node.prepare("t", "", layer_labels(ref, layer)).path)
    assert (mount / "data/b.bin").read_bytes() == files["data/b.bin"]
    st = status(node)
    fetch, sources = st["fetch"], st["data_path"]["sources"]
    assert fetch["verify_failures"]["region"] == 1 and fetch["verify_failures"].get("origin", 0) == 0, fetch
    assert fetch["tocs_loaded"] == 1 and sources["origin"]["bytes"] >= end - start, sources
    lines = [line for line in fs_log(node) if "region" in line and digest in line and "failed verification" in line]
    assert len(lines) == 1 and "TOC digest mismatch" in lines[0] and f"[{start}, {end})" in lines[0], lines
    # told by the node, the region checks its copy, drops it (and fills again from the origin)
    wait_for(lambda: stored(region, digest) != bytes(bad), "the region to drop its bad copy", 30)

    other = nodes({"region_url": region.url})
    with pytest.raises(DigestMismatch) as err:
        other.prepare("t", "", layer_labels(ref, layer, toc_digest="sha256:" + "0" * 64))
    line = str(err.value)
    assert "\n" not in line and ref in line and f"layer {digest}" in line and "TOC digest mismatch" in line, line
    assert os.listdir(os.path.join(other.root, "layers")) == []
    assert not os.listdir(other.fs.mnt)
    assert status(other)["fetch"]["verify_failures"]["origin"] == 1


def test_an_origin_answering_wrong_ranges(registry, image, region_factory, nodes):  # noqa: F811
    """The origin (through a proxy that flips a byte of each range answer) is the only
    source: EIO with a log line, counted. With the region's copy corrupt as well, every
    source is bad (the region, told, drops its copy, and its refill through the proxy
    fails too): EIO naming both. Once the origin answers right again, the node's next
    read gets good bytes from the region's fresh fill."""
    ref, layer, files, chunks = image
    digest = layer["digest"]
    proxy = FlippingProxy(registry.url)
    try:
        ref = proxy.host + "/" + ref.partition("/")[2]
        alone = nodes({})
        mount = Path(alone.prepare("t", "", layer_labels(ref, layer)).path)  # the TOC comes unflipped
        proxy.flip = True
        with pytest.raises(OSError) as err:
            (mount / "data/a.bin").read_bytes()
        assert err.value.errno == errno.EIO and proxy.flipped >= 1
        fetch = status(alone)["fetch"]
        assert fetch["verify_failures"]["origin"] >= 1, fetch
        lines = fs_log(alone)
        assert any("WARNING" in line and "origin" in line and digest in line and "failed verification" in line
                   for line in lines)
        assert any("ERROR" in line and "data/a.bin" in line and digest in line for line in lines)

        proxy.flip = False
        region = region_factory(proxy)
        fill(region, ref, layer)
        good = stored(region, digest)
        replace_stored(region, digest, corrupt(good, chunks["data/b.bin"]), None)
        node = nodes({"region_url": region.url})
        mount = Path(node.prepare("t", "", layer_labels(ref, layer)).path)
        proxy.flip = proxy.flip_whole = True
        with open(mount / "data/b.bin", "rb") as f, pytest.raises(OSError) as err:
            f.read(4096)
        assert err.value.errno == errno.EIO
        fetch = status(node)["fetch"]
        assert fetch["verify_failures"]["region"] >= 1 and fetch["verify_failures"]["origin"] >= 1, fetch
        line = next(line for line in fs_log(node) if "ERROR" in line and "data/b.bin" in line)
        assert "region" in line and "origin" in line and "failed verification" in line, line
        wait_for(lambda: stored(region, digest) is None, "the region to drop its bad copy", 30)
        proxy.flip = proxy.flip_whole = False
        assert (mount / "data/b.bin").read_bytes() == files["data/b.bin"]  # the region refetched
        region.wait_idle()
        assert stored(region, digest) == good
    finally:
        proxy.stop()


def test_a_lazy_start_through_containerd_survives_a_corrupt_region_copy(registry, region_factory,  # noqa: F811
                                                                         tmp_path):
    """The issue's reproduction: `shoal pull` and `ctr run` of a lazy image on a node whose
    region holds corrupt copies of every layer (it used to fail with `exec /bin/cat:
    input/output error`): the container runs on the origin's bytes."""
    from tests.fixtures_services import containerd_missing
    from tests.rootfs import busybox_layer
    from tests.services import CTR_NAMESPACE, SHOAL, shoal_node_with_containerd

    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    layer_root = busybox_layer(tmp_path / "l1")
    ref, layer = publish_tree(registry.host, "verify/run", layer_root, tmp_path)
    region = region_factory(registry)
    fill(region, ref, layer)
    good = stored(region, layer["digest"])
    bad = bytearray(good)
    for i in range(0, len(bad), 2048):  # every chunk of the layer
        bad[i] ^= 0xFF
    replace_stored(region, layer["digest"], bytes(bad), None)
    config = f'[fetch]\nregion_url = "{region.url}"\n'
    with shoal_node_with_containerd("shoal-verify-", node_config=config) as (node, ctd):
        pulled = subprocess.run([SHOAL, "pull", ref, "--address", ctd.address, "--namespace", CTR_NAMESPACE,
                                 "--json"], capture_output=True, text=True, check=False)
        assert pulled.returncode == 0, pulled.stderr
        assert [ly["kind"] for ly in json.loads(pulled.stdout)["layers"]] == ["lazy"]
        out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", ref, "verify-1", "/bin/cat", "/etc/motd", check=False)
        assert out.returncode == 0 and out.stdout == "hello from a shoal test image\n", out.stderr
        st = subprocess.run([SHOAL, "status", "--root", str(node.root), "--json"], capture_output=True, text=True,
                            check=True)
        fetch = json.loads(st.stdout)["fetch"]
        assert fetch["verify_failures"]["region"] >= 1 and fetch["bytes_from_origin"] > 0, fetch
