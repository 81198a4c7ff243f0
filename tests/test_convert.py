"""`shoal convert` and `shoal inspect` through the real CLI, on real images and files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shoal import mediatypes as mt
from tests.imagetools import make_docker_archive, make_image, make_index, make_tar, sha256, write_layout
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer, delta_layer, python_layer

SHOAL = str(Path(sys.executable).parent / "shoal")


def shoal(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([SHOAL, *args], capture_output=True, text=True, env=env, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"shoal {' '.join(args)} exited {proc.returncode}: {proc.stderr}")
    return proc


def convert_json(src: str, dst: str, *extra: str) -> dict:
    return json.loads(shoal("convert", "--json", *extra, src, dst).stdout)


def layout_index(path: Path) -> dict:
    return json.loads((path / "index.json").read_text())


def layout_blob(path: Path, digest: str) -> bytes:
    return (path / "blobs" / "sha256" / digest.split(":")[1]).read_bytes()


def layout_manifest(path: Path, tag: str) -> dict:
    entry = next(m for m in layout_index(path)["manifests"]
                 if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)
    return json.loads(layout_blob(path, entry["digest"]))


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def real_image(tmp_path_factory) -> Path:
    """A real image from real trees: busybox, Debian's python3.11 and stdlib, a delta layer."""
    root = tmp_path_factory.mktemp("real image")
    layers = [busybox_layer(root / "l1"), python_layer(root / "l2"), delta_layer(root / "l3")]
    cfg = ImageConfig(cmd=["/bin/sh", "-c", "cat /etc/motd"], labels={"org.example.team": "training"})
    build_image([str(p) for p in layers], f"oci:{root / 'src'}:v1", cfg, workdir=str(root))
    return root / "src"


@pytest.fixture(scope="module")
def converted(real_image, tmp_path_factory) -> tuple[Path, dict]:
    dst = tmp_path_factory.mktemp("converted") / "out dir"
    summary = convert_json(f"oci:{real_image}:v1", f"oci:{dst}:v1")
    return dst, summary


def test_round_trip_zstd_cli_gives_the_diff_ids(real_image, converted, tmp_path):
    dst, summary = converted
    src_manifest = layout_manifest(real_image, "v1")
    manifest = layout_manifest(dst, "v1")
    # config is byte for byte the source's: diff_ids, history, labels unchanged
    assert manifest["config"]["digest"] == src_manifest["config"]["digest"]
    config = json.loads(layout_blob(dst, manifest["config"]["digest"]))
    assert config["config"]["Labels"] == {"org.example.team": "training"}
    assert len(config["history"]) == 3
    assert manifest["mediaType"] == mt.OCI_MANIFEST
    for layer, diff_id in zip(manifest["layers"], config["rootfs"]["diff_ids"], strict=True):
        assert layer["mediaType"] == mt.OCI_LAYER_ZSTD
        assert "io.github.containers.zstd-chunked.manifest-checksum" in layer["annotations"]
        blob = dst / "blobs" / "sha256" / layer["digest"].split(":")[1]
        tar = subprocess.run(["zstd", "-dc", str(blob)], capture_output=True, check=True).stdout
        assert "sha256:" + hashlib.sha256(tar).hexdigest() == diff_id
    # the summary tells what happened to each layer
    assert [ly["action"] for ly in summary["layers"]] == ["converted"] * 3
    python = summary["layers"][1]
    assert python["files"] > 500 and python["chunks"] >= python["files"]
    assert python["unique_chunks"] <= python["chunks"]
    assert python["bytes_in"] > python["bytes_out"] > 0
    assert python["seconds"] >= 0


def test_converting_a_converted_image_changes_nothing(converted, tmp_path):
    dst, summary = converted
    again = convert_json(f"oci:{dst}:v1", f"oci:{tmp_path / 'again'}:v1")
    assert again["digest"] == summary["digest"]
    assert [ly["action"] for ly in again["layers"]] == ["passed-through"] * 3


def test_conversion_is_reproducible(real_image, converted, tmp_path):
    _, summary = converted
    again = convert_json(f"oci:{real_image}:v1", f"oci:{tmp_path / 'second'}:v1")
    assert again["digest"] == summary["digest"]


def test_inspect_verify_passes_on_a_good_image_and_fails_on_a_corrupted_blob(converted, tmp_path):
    dst, _ = converted
    report = json.loads(shoal("inspect", "--json", "--verify", f"oci:{dst}:v1").stdout)
    assert report["ok"]
    layers = report["manifests"][0]["layers"]
    assert all(ly["verified"] for ly in layers)
    assert layers[1]["zstd_chunked"]["files"] > 500
    # corrupt one byte in a copy of the layout: inspect --verify must fail with exit 1
    bad = tmp_path / "bad"
    subprocess.run(["cp", "-a", str(dst), str(bad)], check=True)
    blob = bad / "blobs" / "sha256" / layers[1]["digest"].split(":")[1]
    data = bytearray(blob.read_bytes())
    data[len(data) // 3] ^= 0xFF
    blob.write_bytes(bytes(data))
    proc = shoal("inspect", "--json", "--verify", f"oci:{bad}:v1", check=False)
    assert proc.returncode == 1
    report = json.loads(proc.stdout)
    assert not report["ok"]
    failed = report["manifests"][0]["layers"][1]
    assert failed["verified"] is False and "digest mismatch" in failed["error"]
    assert "Traceback" not in proc.stderr


def test_multi_platform_index_every_platform_and_one(tmp_path):
    amd = make_image([{"etc/arch": "amd64\n", "bin/tool": os.urandom(3 << 20)}], arch="amd64")
    arm = make_image([{"etc/arch": "arm64\n"}], arch="arm64")
    index = make_index({"amd64": amd, "arm64": arm})
    src = write_layout(tmp_path / "src", {"multi": index}, [amd, arm])
    summary = convert_json(f"oci:{src}:multi", f"oci:{tmp_path / 'all'}:multi")
    assert len(summary["manifests"]) == 2
    out = json.loads(layout_blob(tmp_path / "all", summary["digest"]))
    assert out["mediaType"] == mt.OCI_INDEX
    assert [m["platform"]["architecture"] for m in out["manifests"]] == ["amd64", "arm64"]
    for m in out["manifests"]:
        child = json.loads(layout_blob(tmp_path / "all", m["digest"]))
        assert all(ly["mediaType"] == mt.OCI_LAYER_ZSTD for ly in child["layers"])
    one = convert_json(f"oci:{src}:multi", f"oci:{tmp_path / 'one'}:multi", "--platform", "linux/arm64")
    out = json.loads(layout_blob(tmp_path / "one", one["digest"]))
    assert [m["platform"]["architecture"] for m in out["manifests"]] == ["arm64"]
    proc = shoal("convert", "--platform", "linux/s390x", f"oci:{src}:multi", f"oci:{tmp_path / 'none'}:x",
                 check=False)
    assert proc.returncode == 2 and "no manifest for linux/s390x" in proc.stderr


def test_shared_chunks_are_reported_within_and_across_images(tmp_path):
    shared = os.urandom(6 << 20)  # a large file two images carry (a CUDA library, say)
    a = make_image([{"lib/libbig.so": shared, "a": "a\n"}, {"copy/libbig.so": shared}])
    b = make_image([{"opt/other/libbig.so": shared, "b": "b\n"}])
    src_a = write_layout(tmp_path / "a", {"a": a.manifest}, [a])
    src_b = write_layout(tmp_path / "b", {"b": b.manifest}, [b])
    index = str(tmp_path / "chunks.sqlite")
    sa = convert_json(f"oci:{src_a}:a", f"oci:{tmp_path / 'out'}:a", "--chunk-index", index)
    within = sa["dedup"]["shared_between_layers"]
    assert within and sa["dedup"]["shared_between_layers_bytes"] >= 5 << 20
    assert sa["dedup"]["shared_with_earlier_images"] == []
    sb = convert_json(f"oci:{src_b}:b", f"oci:{tmp_path / 'out'}:b", "--chunk-index", index)
    across = {c["digest"] for c in sb["dedup"]["shared_with_earlier_images"]}
    assert {c["digest"] for c in within} <= across
    assert sb["dedup"]["shared_with_earlier_images_bytes"] >= 5 << 20


def test_docker_archive_source(tmp_path):
    archive = tmp_path / "saved.tar"
    make_docker_archive(archive, [(["example/app:1"], [{"app/main.py": "print('hi')\n"}])])
    summary = convert_json(f"docker-archive:{archive}", f"oci:{tmp_path / 'out'}:app")
    assert [ly["action"] for ly in summary["layers"]] == ["converted"]
    assert json.loads(shoal("inspect", "--json", "--verify", f"oci:{tmp_path / 'out'}:app").stdout)["ok"]


def _layout_with_layer(tmp_path: Path, blob: bytes, media_type: str, diff_id: str) -> Path:
    img = make_image([{"x": "x\n"}])
    config = json.loads(img.config)
    config["rootfs"]["diff_ids"] = [diff_id]
    config_bytes = json.dumps(config).encode()
    manifest = {
        "schemaVersion": 2, "mediaType": mt.OCI_MANIFEST,
        "config": {"mediaType": mt.OCI_CONFIG, "digest": sha256(config_bytes), "size": len(config_bytes)},
        "layers": [{"mediaType": media_type, "digest": sha256(blob), "size": len(blob)}],
    }
    from builder.oci.base import Manifest

    data = json.dumps(manifest).encode()
    img.blobs = {sha256(config_bytes): config_bytes, sha256(blob): blob}
    img.manifest = Manifest(data, mt.OCI_MANIFEST, sha256(data))
    return write_layout(tmp_path / "src", {"bad": img.manifest}, [img])


@pytest.mark.parametrize(
    "case, fragments",
    [
        ("bzip2", ["layer 1/1", "unsupported layer media type", "bzip2"]),
        ("bad-gzip", ["layer 1/1", "cannot decompress"]),
        ("wrong-diff-id", ["layer 1/1", "diff_id"]),
        ("escaping-path", ["layer 1/1", "escapes the layer root"]),
        ("absolute-path", ["layer 1/1", "is absolute"]),
    ],
)
def test_bad_layers_stop_the_run_with_one_line(tmp_path, case, fragments):
    tar = make_tar({"ok": "ok\n"})
    blob, media_type, diff_id = tar, mt.OCI_LAYER_TAR, sha256(tar)
    if case == "bzip2":
        media_type = "application/vnd.oci.image.layer.v1.tar+bzip2"
    elif case == "bad-gzip":
        blob, media_type = b"\x1f\x8b\x08\x00" + os.urandom(200), mt.OCI_LAYER_GZIP
    elif case == "wrong-diff-id":
        diff_id = "sha256:" + "1" * 64
    elif case in ("escaping-path", "absolute-path"):
        import io
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            info = tarfile.TarInfo("../../etc/cron.d/evil" if case == "escaping-path" else "/etc/evil")
            info.size = 4
            t.addfile(info, io.BytesIO(b"evil"))
        blob = buf.getvalue()
        diff_id = sha256(blob)
    src = _layout_with_layer(tmp_path, blob, media_type, diff_id)
    dst = tmp_path / "dst"
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    env = dict(os.environ, TMPDIR=str(scratch))
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = shoal("convert", f"oci:{src}:bad", f"oci:{dst}:out", check=False, env=env)
    assert_one_line_error(proc, *fragments)
    # nothing tagged in the destination, no scratch files left, nothing written beside it
    if (dst / "index.json").exists():
        assert layout_index(dst)["manifests"] == []
    assert list(scratch.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before + (["dst"] if dst.exists() else []))
    assert not Path("/etc/evil").exists() and not Path("/etc/cron.d/evil").exists()


def test_usage_errors_exit_2(tmp_path):
    for args in (["convert", "nonsense", "oci:/tmp/x"], ["convert", "oci:/x", "docker-archive:/y"],
                 ["convert", "--level", "99", "oci:/a", "oci:/b"], ["frobnicate"], ["convert"]):
        proc = shoal(*args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_missing_source_is_a_clear_error(tmp_path):
    proc = shoal("convert", f"oci:{tmp_path / 'nothing'}", f"oci:{tmp_path / 'out'}", check=False)
    assert_one_line_error(proc, "no such directory")


@pytest.mark.registry
def test_registry_to_registry(registry, real_image, tmp_path):
    src = f"docker://{registry.host}/team/train:gzip"
    dst = f"docker://{registry.host}/team/train:chunked"
    from builder.oci.refs import open_destination, open_source
    from tests.imagetools import copy_image

    with open_source(f"oci:{real_image}:v1") as s, open_destination(src, plain_http=True) as d:
        copy_image(s, d, tmp_path)
    summary = convert_json(src, dst, "--plain-http")
    assert [ly["action"] for ly in summary["layers"]] == ["converted"] * 3
    report = json.loads(shoal("inspect", "--json", "--verify", "--plain-http", dst).stdout)
    assert report["ok"] and report["digest"] == summary["digest"]
    # each lazy layer's piece hashes are published beside the image (a region makes the
    # layer's torrent from them before it has the layer): they are the blob's own
    _check_published_pieces(registry, summary["pieces"])
    # a registry that is not there: one line, exit 1, quickly
    proc = shoal("convert", "--plain-http", "docker://127.0.0.1:1/x:y", f"oci:{tmp_path / 'o'}", check=False)
    assert_one_line_error(proc, "127.0.0.1:1")


def _check_published_pieces(registry, published: list[dict], repo: str = "team/train", tag: str = "chunked") -> None:
    from builder.oci.refs import DockerRef
    from builder.oci.registry import RegistrySource
    from builder.pieces import PieceHasher, Pieces, pieces_blob, pieces_tag

    with RegistrySource(DockerRef(registry.host, repo, tag=tag), True) as image:
        layers = json.loads(image.get_root().data)["layers"]
    assert sorted(p["blob"] for p in published) == sorted(ly["digest"] for ly in layers)
    for ly in layers:
        with RegistrySource(DockerRef(registry.host, repo, tag=pieces_tag(ly["digest"])), True) as src:
            desc = pieces_blob(src.get_root().data, ly["digest"], "pieces")
            published = Pieces.from_json(src.read_small_blob(desc.digest, desc.size, "pieces"), ly["digest"],
                                         ly["size"])
            hasher = PieceHasher(ly["size"], published.piece_length)
            with src.open_blob(ly["digest"], ly["size"]) as blob:
                while data := blob.read(1 << 20):
                    hasher.update(data)
        assert hasher.finish(ly["digest"]) == published
        assert published.count == -(-ly["size"] // published.piece_length)


@pytest.mark.registry
def test_pieces_push_publishes_the_hashes_of_an_image_converted_without_them(registry, real_image, converted,
                                                                             tmp_path):
    """`shoal pieces push` gives an image already in a registry what `shoal convert` would
    have published: each lazy layer's piece hashes, the blob's own; once, not again; never
    from bytes that do not match the layer's digest."""
    from builder.oci.refs import DockerRef, open_destination, open_source
    from builder.oci.registry import RegistrySource
    from builder.pieces import pieces_tag
    from shoal.errors import NotFound
    from tests.imagetools import copy_image

    dst, _ = converted
    ref = f"docker://{registry.host}/team/old:chunked"
    with open_source(f"oci:{dst}:v1") as s, open_destination(ref, plain_http=True) as d:
        copy_image(s, d, tmp_path)  # in the registry, with no piece hashes
    with RegistrySource(DockerRef(registry.host, "team/old", tag="chunked"), True) as image:
        layers = json.loads(image.get_root().data)["layers"]
    with RegistrySource(DockerRef(registry.host, "team/old", tag=pieces_tag(layers[0]["digest"])), True) as tag, \
            pytest.raises(NotFound):
        tag.get_root()
    summary = json.loads(shoal("pieces", "push", "--json", "--plain-http", ref).stdout)
    assert [ly["action"] for ly in summary["layers"]] == ["pushed"] * 3
    _check_published_pieces(registry, summary["layers"], "team/old", "chunked")
    # again: every layer's hashes are there, nothing is read or pushed
    puts, blob_gets = registry.count("PUT"), registry.count("GET", "/blobs/")
    again = shoal("pieces", "push", "--plain-http", ref).stdout.splitlines()
    assert sorted(line.split()[0] for line in again) == sorted(ly["digest"] for ly in layers)
    assert all(line.split()[1] == "present" for line in again)
    assert registry.count("PUT") == puts and registry.count("GET", "/blobs/") == blob_gets
    # a layer whose stored bytes are spoiled: one line naming it, exit 1, its hashes not pushed
    spoiled = layers[1]["digest"]
    data_file = registry.storage / "docker/registry/v2/blobs/sha256" / spoiled[7:9] / spoiled[7:] / "data"
    with open(data_file, "r+b") as fh:
        fh.seek(layers[1]["size"] // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    proc = shoal("pieces", "push", "--force", "--plain-http", ref, check=False)
    assert_one_line_error(proc, spoiled, "digest")
    assert registry.count("PUT", pieces_tag(layers[0]["digest"]))[0] == 2  # pushed again before the spoiled one
    assert registry.count("PUT", pieces_tag(spoiled))[0] == 1
    # not a registry; an image with no lazy layer
    proc = shoal("pieces", "push", f"oci:{dst}:v1", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "docker://" in proc.stderr
    gzip = f"docker://{registry.host}/team/old:gzip"
    with open_source(f"oci:{real_image}:v1") as s, open_destination(gzip, plain_http=True) as d:
        copy_image(s, d, tmp_path)
    assert_one_line_error(shoal("pieces", "push", "--plain-http", gzip, check=False), "no zstd:chunked layers")


def test_published_pieces_documents_are_checked():
    """A published pieces document is bound to one blob and shaped: anything else is a
    FormatError naming what is wrong (a region then waits for the whole blob)."""
    from builder.pieces import Pieces
    from shoal.errors import FormatError

    blob = "sha256:" + "a" * 64
    good = Pieces(blob, 600 << 10, 256 << 10, bytes(60))
    assert Pieces.from_json(good.to_json(), blob, 600 << 10) == good
    doc = json.loads(good.to_json())
    for change, message in [({"blob": "sha256:" + "b" * 64}, "names blob"), ({"size": 1}, "size"),
                            ({"piece_length": 3 << 10}, "power of two"), ({"pieces": "AAAA"}, "bytes of piece hashes"),
                            ({"pieces": "not base64!"}, "base64"), ({"schemaVersion": 2}, "schemaVersion")]:
        with pytest.raises(FormatError, match=message):
            Pieces.from_json(json.dumps({**doc, **change}).encode(), blob, 600 << 10)
    with pytest.raises(FormatError):
        Pieces.from_json(b"[1, 2]", blob)
