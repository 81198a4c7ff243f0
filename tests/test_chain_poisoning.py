"""One image must not make another run on its bytes (issue 10, point 2).

An attacker's image config claims the victim's diff_id for the attacker's own layer, so
both images name the same chain id. Pulled first, the attacker's layer used to be
committed under that chain id, and the victim, pulled after it on the same node, ran on
the attacker's bytes: containerd's unpacker (CRI, `ctr`) and `shoal pull` skip a layer
whose chain id exists. Each case here pulls the attacker first and the victim after,
through `shoal pull` and through containerd's CRI PullImage, and checks the content the
victim's container prints: its own bytes, or a failed start with one line naming the
conflict; never the attacker's. Real registry, containerd (with its CRI plugin), runc,
`shoal node`, FUSE.

The gzip cases need node-unpacked layers to check their diff_id (branch i10-unpack).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from builder.convert import convert
from builder.oci.base import Manifest
from builder.oci.refs import open_destination, open_source
from tests.fixtures_services import containerd_missing
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer
from tests.services import SHOAL, shoal_node_with_containerd, wait_for

pytestmark = [pytest.mark.registry, pytest.mark.containerd]

VICTIM = "the victim's own bytes\n"
ATTACKER = "the attacker's bytes\n"
CMD = ["/bin/cat", "/secret"]
GATE = "[fetch]\nprove_after = 3600.0\n"  # no background proof: what a Prepare sees decides
CRI_NS = "k8s.io"


@pytest.fixture(scope="module")
def registry(module_registry):
    return module_registry


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _config(src, manifest: dict) -> bytes:
    return src.read_small_blob(manifest["config"]["digest"], manifest["config"]["size"], "config")


def forge(src: str, dst: str, diff_ids_of: str, workdir: Path) -> None:
    """Push `src` again as `dst` (same repository, so the same blobs) with a config whose
    last diff_id is the one `diff_ids_of`'s config names: the attacker's lie."""
    with open_source(f"docker://{diff_ids_of}", plain_http=True) as s:
        doc = json.loads(s.get_root().data)
        claimed = json.loads(_config(s, doc))["rootfs"]["diff_ids"]
    with open_source(f"docker://{src}", plain_http=True) as s:
        root = s.get_root()
        doc = json.loads(root.data)
        config = json.loads(_config(s, doc))
    config["rootfs"]["diff_ids"][-1] = claimed[-1]
    data = json.dumps(config).encode()
    path = workdir / f"config-{_sha256(data)[7:]}"
    path.write_bytes(data)
    doc["config"] = {**doc["config"], "digest": _sha256(data), "size": len(data)}
    manifest = json.dumps(doc).encode()
    with open_destination(f"docker://{dst}", plain_http=True) as d:
        d.put_blob(str(path), _sha256(data), len(data))
        d.put_root(Manifest(manifest, root.media_type, _sha256(manifest)))


@pytest.fixture(scope="module")
def images(registry, tmp_path_factory):
    """Two-layer images in one repository: a busybox base they share, and a top layer
    holding /secret. `attacker-*` claims the victim's diff_id for its top layer."""
    work = tmp_path_factory.mktemp("poison")
    base = busybox_layer(work / "base")
    tops = {}
    for who, text in (("victim", VICTIM), ("attacker", ATTACKER)):
        tops[who] = work / who
        tops[who].mkdir()
        (tops[who] / "secret").write_text(text)
    repo = f"{registry.host}/poison/app"
    refs = {}
    for who in ("victim", "attacker"):
        honest = f"{repo}:{who}-gzip" if who == "victim" else f"{repo}:honest-attacker-gzip"
        build_image([str(base), str(tops[who])], f"docker://{honest}", ImageConfig(cmd=CMD), plain_http=True,
                    workdir=str(work))
        lazy = honest.replace("-gzip", "-lazy")
        convert(f"docker://{honest}", f"docker://{lazy}", plain_http=True)
        refs[f"{who}-gzip"], refs[f"{who}-lazy"] = honest, lazy
    refs["pause"] = f"{repo}:pause"  # CRI's sandbox image: a command that waits
    build_image([str(base)], f"docker://{refs['pause']}", ImageConfig(cmd=["/bin/sleep", "3600"]), plain_http=True,
                workdir=str(work))
    for kind in ("gzip", "lazy"):
        forged = f"{repo}:attacker-{kind}"
        forge(refs[f"attacker-{kind}"], forged, refs[f"victim-{kind}"], work)
        refs[f"attacker-{kind}"] = forged
    return refs


def _layers(ref: str) -> list[str]:
    with open_source(f"docker://{ref}", plain_http=True) as s:
        return [ly["digest"] for ly in json.loads(s.get_root().data)["layers"]]


def _chains(ref: str) -> list[str]:
    from snapshotter.pull import chain_ids

    with open_source(f"docker://{ref}", plain_http=True) as s:
        doc = json.loads(s.get_root().data)
        return chain_ids(json.loads(_config(s, doc))["rootfs"]["diff_ids"])


class NodeFactory:
    """`shoal node` with containerd (`factory(node_config)`), or with containerd's CRI
    plugin as deploy/ sets it up and a CRI client on it (`factory.cri(node_config)`),
    pods pulling from the test registry. Context managers; both clean up on failure."""

    def __init__(self, registry_host: str) -> None:
        self.registry_host = registry_host

    def __call__(self, node_config: str = ""):
        return shoal_node_with_containerd("shoal-poison-", node_config)

    def cri(self, node_config: str = ""):
        from tests.cri import cri_node

        return cri_node([self.registry_host], f"{self.registry_host}/poison/app:pause", node_config,
                        prefix="shoal-poison-")


@pytest.fixture
def node_factory(registry):
    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    return NodeFactory(registry.host)


def cri_node(node_factory: NodeFactory, node_config: str = ""):
    """(node, containerd with its CRI plugin, a CRI client on it)."""
    return node_factory.cri(node_config)


def shoal_pull(ref: str, ctd, namespace: str = "shoal-test") -> subprocess.CompletedProcess:
    return subprocess.run([SHOAL, "pull", ref, "--address", ctd.address, "--namespace", namespace, "--json"],
                          capture_output=True, text=True, timeout=300, check=False)


def run(ctd, ref: str, cid: str, namespace: str = "shoal-test") -> subprocess.CompletedProcess:
    return ctd.ctr("run", "--rm", "--snapshotter", "shoal", "--runc-root", str(ctd.runc_root),
                   "--fifo-dir", str(ctd.fifo_dir), ref, cid, *CMD, namespace=namespace, check=False, timeout=300)


def status(node) -> dict:
    proc = subprocess.run([SHOAL, "status", "--root", str(node.root), "--json"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def one_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def assert_victim_safe(proc: subprocess.CompletedProcess, conflict: list[str]) -> None:
    """The victim's container printed its own bytes, or did not start, with one line
    naming the conflict; never the attacker's bytes."""
    assert ATTACKER not in proc.stdout, "the victim ran on the attacker's layer"
    if proc.returncode == 0:
        assert proc.stdout == VICTIM
    else:
        line = one_line(proc.stderr)
        for word in conflict:
            assert word in line, (word, line)


# --- zstd:chunked (lazy) ---------------------------------------------------------------------


def test_lazy_poisoning_through_shoal_pull_is_caught_by_the_pull(images, node_factory):
    """No background proof: the victim's pull finds the chain, provided from another
    blob, has the node prove it, and gets it provided again from its own layer."""
    with node_factory(GATE) as (node, ctd):
        assert shoal_pull(images["attacker-lazy"], ctd).returncode == 0
        # the attacker's own container runs on what its own manifest names
        assert run(ctd, images["attacker-lazy"], "poison-a").stdout == ATTACKER
        pulled = shoal_pull(images["victim-lazy"], ctd)
        assert pulled.returncode == 0, pulled.stderr
        proc = run(ctd, images["victim-lazy"], "poison-v")
        assert_victim_safe(proc, [])
        assert proc.returncode == 0 and proc.stdout == VICTIM, proc.stderr
        # provided again from the victim's own layer
        assert [ly["kind"] for ly in json.loads(pulled.stdout)["layers"]] == ["present", "lazy"]
        chain = _chains(images["victim-lazy"])[-1]
        assert f"BAD lazy layer: {images['attacker-lazy']}: layer {_layers(images['attacker-lazy'])[-1]} was " \
               f"provided as chain {chain}" in node.log_path.read_text()
        chains = {c["chain"]: c for c in status(node)["chains"]}
        assert chains[chain]["layer"] == _layers(images["victim-lazy"])[-1]


def test_lazy_poisoning_across_namespaces(images, node_factory):
    """The attacker in one containerd namespace, the victim in another: the victim's
    Prepare of the chain reaches the node, which finds the chain made from another blob,
    proves it bad, and provides it from the victim's layer."""
    with node_factory(GATE) as (node, ctd):
        assert shoal_pull(images["attacker-lazy"], ctd, namespace="tenant-a").returncode == 0
        pulled = shoal_pull(images["victim-lazy"], ctd, namespace="tenant-b")
        assert pulled.returncode == 0, pulled.stderr
        proc = run(ctd, images["victim-lazy"], "poison-ns-v", namespace="tenant-b")
        assert_victim_safe(proc, [])
        assert proc.returncode == 0 and proc.stdout == VICTIM, proc.stderr
        # the attacker's image in its own namespace lost the chain its config lied about
        chain = _chains(images["victim-lazy"])[-1]
        assert {c["chain"]: c["layer"] for c in status(node)["chains"]}[chain] == _layers(images["victim-lazy"])[-1]


def test_lazy_poisoning_through_cri_pull_fails_the_victims_start_then_heals(images, node_factory):
    """CRI: the victim's PullImage never reaches the node (containerd's unpacker finds
    the chain); the victim's container Prepare does, and the gate finds that another
    image of k8s.io names another blob for the chain."""
    with cri_node(node_factory, GATE) as (node, ctd, cri):
        cri.pull_image(images["attacker-lazy"])
        cri.pull_image(images["victim-lazy"])
        proc = run(ctd, images["victim-lazy"], "poison-cri-v", namespace=CRI_NS)
        chain = _chains(images["victim-lazy"])[-1]
        assert_victim_safe(proc, [chain, images["attacker-lazy"], images["victim-lazy"], "whose content is not"])
        assert proc.returncode != 0, "the gate let the victim start on an unproven chain of another blob"
        assert {c["kind"] for c in status(node)["chains"]} == {"lazy"}
        # the bad chain is removed, no container using it: the victim's next pull
        # provides it from its own layer
        wait_for(lambda: chain not in {c["chain"] for c in status(node)["chains"]},
                 "the bad chain's removal", timeout=30, interval=0.2)
        cri.pull_image(images["victim-lazy"])
        proc = run(ctd, images["victim-lazy"], "poison-cri-v2", namespace=CRI_NS)
        assert proc.returncode == 0 and proc.stdout == VICTIM, proc.stderr + node.log_path.read_text()[-20000:]


def test_lazy_poisoning_through_a_cri_pod(images, node_factory, tmp_path):
    """The kubelet's whole path: PullImage, RunPodSandbox, CreateContainer, StartContainer."""
    from tests.cri import CRIError

    with cri_node(node_factory, GATE) as (node, _ctd, cri):
        cri.pull_image(images["attacker-lazy"])
        cri.pull_image(images["victim-lazy"])
        chain = _chains(images["victim-lazy"])[-1]
        with pytest.raises(CRIError) as e:
            out = cri.run(images["victim-lazy"], CMD, str(tmp_path), "victim-pod")
            assert ATTACKER not in out, "the victim's pod ran on the attacker's layer"
        line = one_line(str(e.value))
        for word in (chain, images["attacker-lazy"], images["victim-lazy"], "whose content is not"):
            assert word in line, (word, line)
        wait_for(lambda: chain not in {c["chain"] for c in status(node)["chains"]},
                 "the bad chain's removal", timeout=30, interval=0.2)
        cri.pull_image(images["victim-lazy"])
        assert cri.run(images["victim-lazy"], CMD, str(tmp_path), "victim-pod-2") == VICTIM


def test_background_proof_marks_a_lying_lazy_layer_bad_and_proves_an_honest_one(images, node_factory):
    """The background proof: the attacker's top layer is bad (status, EIO with a log line
    for the container already running on it, removed once that container is gone); the
    shared base layer is proven."""
    with node_factory("[fetch]\nprove_after = 6.0\n") as (node, ctd):
        assert shoal_pull(images["attacker-lazy"], ctd).returncode == 0
        ctd.ctr("run", "-d", "--snapshotter", "shoal", "--runc-root", str(ctd.runc_root), "--fifo-dir",
                str(ctd.fifo_dir), images["attacker-lazy"], "poison-long", "/bin/sleep", "600")
        try:
            base, top = _chains(images["attacker-lazy"])
            layer = _layers(images["attacker-lazy"])[-1]
            # read before the proof: its own bytes, now in the kernel's page cache
            assert ctd.ctr("task", "exec", "--exec-id", "x0", "poison-long", *CMD).stdout == ATTACKER

            def decided():
                s = status(node)
                chains = {c["chain"]: c["proof"] for c in s["chains"]}
                return chains.get(base) == "proven" and chains.get(top) == "bad" and s

            s = wait_for(decided, "the background proofs", timeout=120, interval=0.5)
            assert [ly["proof"] for ly in s["lazy_layers"] if ly["digest"] == layer] == ["bad"]
            text = subprocess.run([SHOAL, "status", "--root", str(node.root)], capture_output=True, text=True, check=False).stdout
            assert f"BAD chain {top}" in text
            from snapshotter.status import node_metrics

            metrics = node_metrics(s)
            assert 'shoal_node_chains{proof="bad"} 1' in metrics and 'shoal_node_chains{proof="proven"} 1' in metrics
            proc = ctd.ctr("task", "exec", "--exec-id", "x1", "poison-long", "/bin/cat", "/secret", check=False)
            assert proc.returncode != 0 and ATTACKER not in proc.stdout
            assert "input/output error" in (proc.stderr + proc.stdout).lower()
            fs_log = (node.root / "logs" / "fs.log").read_text()
            assert f"open /secret of layer {layer} of {images['attacker-lazy']} refused (EIO)" in fs_log
            assert "which gives chain" in fs_log and "its content is diff_id" in fs_log
            # a new container on it fails its Prepare with one line
            proc = run(ctd, images["attacker-lazy"], "poison-again")
            assert proc.returncode != 0 and f"chain {top}" in one_line(proc.stderr)
        finally:
            ctd.ctr("task", "kill", "-s", "KILL", "poison-long", check=False)
        wait_for(lambda: ctd.ctr("task", "rm", "-f", "poison-long", check=False).returncode == 0
                 and ctd.ctr("containers", "rm", "poison-long", check=False).returncode == 0,
                 "the container's removal", timeout=30, interval=0.3)
        wait_for(lambda: top not in {c["chain"] for c in status(node)["chains"]},
                 "the bad chain's removal once unused", timeout=30, interval=0.3)
        # the proof table knows the blob: the same lie is refused at once, with one line
        again = shoal_pull(images["attacker-lazy"], ctd)
        assert again.returncode == 1
        assert f"layer {layer} cannot be chain {top}: its content is diff_id" in one_line(again.stderr)


def test_a_pending_proof_is_taken_up_again_after_a_node_restart(images, node_factory):
    """Proof state lives in the node's metadata: a layer still pending when the node
    stops is proven by the next node process (its bad verdict is kept, labels and
    proof table)."""
    from tests.services import NodeProcess

    with node_factory(GATE) as (node, ctd):
        assert shoal_pull(images["attacker-lazy"], ctd).returncode == 0
        base, top = _chains(images["attacker-lazy"])
        assert {c["chain"]: c["proof"] for c in status(node)["chains"]} == {base: "pending", top: "pending"}
        node.stop()
        config = node.root.parent / "node.toml"
        config.write_text(config.read_text().replace("prove_after = 3600.0", "prove_after = 0.0"))
        again = NodeProcess(node.root, node.socket, node.log_path, ("--config", str(config)))
        try:
            # the bad chain is removed (no container uses it), and with it the base, which
            # no image references any more (containerd's garbage collection)
            wait_for(lambda: top not in {c["chain"] for c in status(node)["chains"]},
                     "the proofs after the restart", timeout=60, interval=0.3)
            # removed from containerd's metadata as well (a chain removed from the node alone
            # would still be found there by the next pull, which would stack on nothing)
            assert top not in ctd.ctr("snapshots", "--snapshotter", "shoal", "ls").stdout
            log = node.log_path.read_text()
            assert f"chain {base} (layer {_layers(images['attacker-lazy'])[0]}" in log and "): proven" in log
            assert f"was provided as chain {top}" in log
            refused = shoal_pull(images["attacker-lazy"], ctd)
            assert refused.returncode == 1 and "cannot be chain" in one_line(refused.stderr), (
                refused.stdout + refused.stderr + node.log_path.read_text()[-6000:])
        finally:
            again.stop()


def test_with_prove_lazy_off_the_node_says_chains_are_trusted(images, node_factory):
    with node_factory("[fetch]\nprove_lazy = false\nprove_after = 0.0\n") as (node, ctd):
        assert "lazy layers are not proven ([fetch] prove_lazy = false)" in node.log_path.read_text()
        assert shoal_pull(images["attacker-lazy"], ctd).returncode == 0
        assert run(ctd, images["attacker-lazy"], "trusted-a").stdout == ATTACKER


def test_a_legitimate_share_of_one_diff_id_by_gzip_and_lazy_images_works(images, node_factory):
    """Two images, same diff_ids, one zstd:chunked and one gzip (and a base layer shared
    by all): the second finds the chains provided from other blobs, the node proves
    them, and both run."""
    with node_factory(GATE) as (node, ctd):
        assert shoal_pull(images["victim-lazy"], ctd).returncode == 0
        pulled = shoal_pull(images["victim-gzip"], ctd)
        assert pulled.returncode == 0, pulled.stderr
        assert [ly["kind"] for ly in json.loads(pulled.stdout)["layers"]] == ["present", "present"]
        assert run(ctd, images["victim-gzip"], "share-g").stdout == VICTIM
        assert run(ctd, images["victim-lazy"], "share-z").stdout == VICTIM
        assert {c["proof"] for c in status(node)["chains"]} == {"proven"}


def test_a_legitimate_share_through_a_cri_pod(images, node_factory, tmp_path):
    with cri_node(node_factory, GATE) as (node, _ctd, cri):
        cri.pull_image(images["victim-lazy"])
        cri.pull_image(images["victim-gzip"])
        assert cri.run(images["victim-gzip"], CMD, str(tmp_path), "share-g") == VICTIM
        assert cri.run(images["victim-lazy"], CMD, str(tmp_path), "share-z") == VICTIM
        lazy = {c["proof"] for c in status(node)["chains"] if c["kind"] == "lazy"}
        assert lazy == {"proven"}


# --- gzip (node-unpacked) ------------------------------------------------------------------------


def test_gzip_poisoning_through_shoal_pull(images, node_factory):
    with node_factory() as (_node, ctd):
        attacker = shoal_pull(images["attacker-gzip"], ctd)
        if attacker.returncode != 0:
            assert "diff_id" in one_line(attacker.stderr)
        victim = shoal_pull(images["victim-gzip"], ctd)
        if victim.returncode != 0:
            assert_victim_safe(victim, [_chains(images["victim-gzip"])[-1]])
            return
        assert_victim_safe(run(ctd, images["victim-gzip"], "poison-gz"), [_chains(images["victim-gzip"])[-1]])


def test_gzip_poisoning_through_a_cri_pod(images, node_factory, tmp_path):
    from tests.cri import CRIError

    with cri_node(node_factory) as (_node, _ctd, cri):
        try:
            cri.pull_image(images["attacker-gzip"])
        except CRIError as e:
            assert "diff_id" in e.details
        try:
            cri.pull_image(images["victim-gzip"])
        except CRIError as e:
            # containerd's own race: the failed pull's base snapshot, Stat-ed by the
            # victim's unpacker, is garbage-collected before the unpacker stacks on it
            if "parent snapshot" not in e.details:
                raise
            cri.pull_image(images["victim-gzip"])
        out = cri.run(images["victim-gzip"], CMD, str(tmp_path), "poison-gz")
        assert ATTACKER not in out, "the victim's pod ran on the attacker's layer"
        assert out == VICTIM


# --- the proof itself --------------------------------------------------------------------------


def test_prove_blob_gives_the_diff_id_and_tells_a_bad_read_from_a_bad_blob():
    """The whole zstd:chunked blob, read in ranges, decompresses to the tar whose digest
    is the diff_id; bytes that do not match the blob digest are a failed attempt (retry,
    another source), a verified blob that does not decompress is final."""
    import io

    import zstandard

    from builder.format.writer import LayerWriter
    from cache.source import BlobRef
    from snapshotter.fs import proof
    from tests.imagetools import make_tar

    tar = make_tar({"secret": VICTIM, "big": bytes(range(256)) * 40_000, "d": None})
    out = io.BytesIO()
    LayerWriter().write(io.BytesIO(tar), out)
    blob = out.getvalue()

    def reader(data: bytes):
        calls = []

        def read_ranges(ref, ranges):
            calls.append(ranges)
            return [data[a:b] for a, b in ranges]

        return read_ranges, calls

    read, calls = reader(blob)
    ref = BlobRef("127.0.0.1:1", "r", _sha256(blob), len(blob))
    old, proof.PROOF_RANGE = proof.PROOF_RANGE, 1 << 20  # several ranges for this small blob
    try:
        assert proof.prove_blob(read, ref) == _sha256(tar)
        assert len(calls) == -(-len(blob) // (1 << 20)) and all(len(r) == 1 for r in calls)
        flipped = bytearray(blob)
        flipped[len(blob) // 2] ^= 1
        with pytest.raises(proof.ProofError) as e:
            proof.prove_blob(reader(bytes(flipped))[0], ref)
        assert not e.value.final and "do not match the blob digest" in str(e.value)
        garbage = zstandard.ZstdCompressor().compress(b"x" * 1000)[:-3] + b"\0" * 64
        with pytest.raises(proof.ProofError) as e:
            proof.prove_blob(reader(garbage)[0], BlobRef("h", "r", _sha256(garbage), len(garbage)))
        assert e.value.final and "does not decompress" in str(e.value)
    finally:
        proof.PROOF_RANGE = old


# --- labels an image can set -------------------------------------------------------------------


def test_layer_annotations_cannot_redirect_the_node(images, registry, node_factory, tmp_path):
    """containerd's unpacker turns an image's layer annotations named
    containerd.io/snapshot/... into Prepare labels. A tenant's image whose top layer
    annotations name another repository's layer (`shoal.image-ref`, `shoal.layer-digest`,
    its TOC) and whose config claims that layer's diff_id must not make the node fetch
    that layer with the node's credentials and serve it: through CRI, the node takes the
    layer CRI names (the image's own, from the image's own repository)."""
    from builder.format.footer import MANIFEST_CHECKSUM, MANIFEST_POSITION

    private = f"{registry.host}/poison/private:victim-lazy"
    convert(f"docker://{images['victim-gzip']}", f"docker://{private}", plain_http=True)
    with open_source(f"docker://{private}", plain_http=True) as s:
        victim_top = json.loads(s.get_root().data)["layers"][-1]
    # the tenant's image: its own layers, its config claiming the victim's diff_id, and
    # annotations pointing the node at the private repository's copy of the victim's layer
    tenant = f"{registry.host}/poison/tenant:redirect"
    with open_source(f"docker://{images['attacker-lazy']}", plain_http=True) as s:
        root = s.get_root()
        doc = json.loads(root.data)
        config = _config(s, doc)
    ann = victim_top["annotations"]
    doc["layers"][-1]["annotations"] = {
        **doc["layers"][-1].get("annotations", {}),
        "containerd.io/snapshot/shoal.image-ref": private,
        "containerd.io/snapshot/shoal.layer-digest": victim_top["digest"],
        "containerd.io/snapshot/shoal.layer-size": str(victim_top["size"]),
        "containerd.io/snapshot/shoal.toc-position": ann[MANIFEST_POSITION],
        "containerd.io/snapshot/shoal.toc-digest": ann[MANIFEST_CHECKSUM],
        "containerd.io/snapshot/shoal.plain-http": "true",
    }
    manifest = json.dumps(doc).encode()
    with open_source(f"docker://{images['attacker-lazy']}", plain_http=True) as s, \
            open_destination(f"docker://{tenant}", plain_http=True) as d:
        for desc in [doc["config"], *doc["layers"]]:
            path = tmp_path / desc["digest"][7:]
            with s.open_blob(desc["digest"], desc["size"]) as blob, open(path, "wb") as out:
                while chunk := blob.read(1 << 20):
                    out.write(chunk)
            d.put_blob(str(path), desc["digest"], desc["size"])
        d.put_root(Manifest(manifest, root.media_type, _sha256(manifest)))
    assert json.loads(config)["rootfs"]["diff_ids"][-1] == _chains_diff_ids(images["victim-lazy"])[-1]
    before = registry.count("GET", "/v2/poison/private/")
    with cri_node(node_factory, GATE) as (_node, ctd, cri):
        cri.pull_image(tenant)
        proc = run(ctd, tenant, "redirect-t", namespace=CRI_NS)
        assert VICTIM not in proc.stdout, "the node served another repository's layer to the tenant"
        assert proc.returncode == 0 and proc.stdout == ATTACKER, proc.stderr
    assert registry.count("GET", "/v2/poison/private/") == before  # the node never went there


def _chains_diff_ids(ref: str) -> list[str]:
    with open_source(f"docker://{ref}", plain_http=True) as s:
        return json.loads(_config(s, json.loads(s.get_root().data)))["rootfs"]["diff_ids"]
