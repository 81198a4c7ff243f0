"""Image transports against real components: docker-registry on loopback, real files."""

from __future__ import annotations

import json
import os
import socket
import threading
from functools import partial
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from builder.oci.auth import find_credentials, parse_challenge
from builder.oci.ranges import ContentRange, ContentRangeError, check_content_range
from builder.oci.refs import open_destination, open_source, parse_reference, parse_registry_ref
from shoal import mediatypes as mt
from shoal.errors import DigestMismatch, FormatError, NotFound, ShoalError, TransportError, UsageError
from tests.imagetools import (
    copy_image,
    make_docker_archive,
    make_image,
    make_index,
    read_blob,
    sha256,
    write_layout,
)

FILES_A = {"etc/": None, "etc/hostname": b"shoal\n", "bin/sh": b"\x7fELF" + bytes(range(256)) * 40}
FILES_B = {"opt/model.bin": os.urandom(200_000), "opt/link": "->model.bin", "ünï côdé.txt": b"x"}


def one_line(exc: BaseException) -> str:
    """The error text, asserting it is the user-facing kind: a ShoalError of one line."""
    assert isinstance(exc, ShoalError), type(exc)
    text = str(exc)
    assert text and "\n" not in text, text
    return text


def blobs_of(manifest_data: bytes) -> list[dict]:
    doc = json.loads(manifest_data)
    return [doc["config"], *doc["layers"]]


@pytest.fixture
def image():
    return make_image([FILES_A, FILES_B], compress=True)


@pytest.fixture
def layout(tmp_path, image) -> Path:
    """A layout holding `image` tagged v1, in a directory with an awkward name."""
    return write_layout(tmp_path / "-src dir ü", {"v1": image.manifest}, [image])


# --- references -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ref",
    [
        "",
        "registry.example/foo",
        "docker://",
        "docker://host",
        "docker://host/",
        "docker://host/Upper",
        "docker://host/repo:bad tag",
        "docker://host/repo@sha256:abc",
        "docker://host/repo@md5:" + "0" * 32,
        "docker://bad_host!/repo",
        "oci:",
        "oci:dir:bad tag",
        "docker-archive:",
        "docker-archive:file.tar:@x",
    ],
)
def test_bad_reference_is_usage_error(ref):
    with pytest.raises(UsageError) as err:
        open_source(ref)
    one_line(err.value)


def test_reference_forms():
    ref = parse_reference("docker://127.0.0.1:5000/a/b")
    assert (ref.host, ref.repository, ref.tag, ref.digest) == ("127.0.0.1:5000", "a/b", "latest", None)
    digest = "sha256:" + "ab" * 32
    ref = parse_reference(f"docker://[::1]:5000/a@{digest}")
    assert (ref.host, ref.tag, ref.digest, ref.reference) == ("[::1]:5000", None, digest, digest)
    assert str(parse_reference("oci:-dir ü:v1.0")) == "oci:-dir ü:v1.0"
    assert parse_reference("oci:/x/y").tag is None
    ref = parse_reference("docker-archive:/tmp/a b.tar:example.com:5000/app:v2")
    assert (ref.path, ref.image) == ("/tmp/a b.tar", "example.com:5000/app:v2")


@pytest.mark.parametrize(
    "text,short_names,want",
    [
        # docker:// optional; the first component is the registry host
        ("127.0.0.1:5000/a/b:v1", False, ("127.0.0.1:5000", "a/b", "v1")),
        ("docker://reg.example/a", False, ("reg.example", "a", "latest")),
        ("org/app", False, ("org", "app", "latest")),
        # containerd's and CRI's names: short ones are on docker.io, one component under library/
        ("busybox", True, ("docker.io", "library/busybox", "latest")),
        ("busybox:1.36@sha256:" + "ab" * 32, True, ("docker.io", "library/busybox", "1.36")),
        ("org/app:v2", True, ("docker.io", "org/app", "v2")),
        ("docker.io/library/busybox:latest", True, ("docker.io", "library/busybox", "latest")),
        ("docker.io/busybox", True, ("docker.io", "busybox", "latest")),
        ("localhost/app", True, ("localhost", "app", "latest")),
        ("127.0.0.1:5000/a/b@sha256:" + "cd" * 32, True, ("127.0.0.1:5000", "a/b", None)),
        ("quay.io/org/app:v1", True, ("quay.io", "org/app", "v1")),
    ],
)
def test_registry_reference_forms(text, short_names, want):
    ref = parse_registry_ref(text, short_names=short_names)
    assert (ref.host, ref.repository, ref.tag) == want


@pytest.mark.parametrize("text", ["busybox", "", "reg.example/Upper", "reg.example/a\nb", "reg.example/a@sha256:x"])
def test_malformed_registry_references_are_usage_errors(text):
    with pytest.raises(UsageError) as err:
        parse_registry_ref(text)
    one_line(err.value)


def test_challenge_parsing():
    header = ' Bearer realm="https://auth.example/token",Service="registry",scope="repository:a/b:pull" '
    assert parse_challenge(header) == (
        "bearer", {"realm": "https://auth.example/token", "service": "registry", "scope": "repository:a/b:pull"})
    assert parse_challenge('Basic realm="x"') == ("basic", {"realm": "x"})
    assert parse_challenge("") == ("", {})


def test_content_range_checks():
    assert check_content_range(" bytes 10-19/100 ", 10, 20, 100) == ContentRange(10, 19, 100)
    assert check_content_range("bytes 10-14/*", 10, 20) == ContentRange(10, 14, None)  # short: the caller's length check
    assert check_content_range("bytes 10-99/100", 10) == ContentRange(10, 99, 100)  # no end asked: start only
    for header, end, size in [
        ("bytes 11-19/100", 20, None),  # another start
        ("bytes 10-20/100", 20, None),  # past the end
        ("bytes 10-14/100", 20, 100),  # exact asked: short
        ("bytes 10-19/99", 20, 100),  # exact asked: another blob length
        ("bytes 10-19/*", 20, 100),
        ("bytes=10-19", 20, None),
        ("", 20, None),
        ("bytes 1\u0660-19/100", 20, None),  # ASCII digits only
    ]:
        with pytest.raises(ContentRangeError):
            check_content_range(header, 10, end, size)


def test_docker_archive_is_not_a_destination(tmp_path):
    with pytest.raises(UsageError):
        open_destination(f"docker-archive:{tmp_path}/x.tar")


# --- OCI layout -------------------------------------------------------------------------


def test_layout_round_trip(tmp_path, layout, image):
    dst_dir = tmp_path / "--dst dir ünï"
    with open_source(f"oci:{layout}:v1") as src, open_destination(f"oci:{dst_dir}:copy") as dst:
        root = copy_image(src, dst, tmp_path)
    assert root.data == image.manifest.data and root.media_type == mt.OCI_MANIFEST
    with open_source(f"oci:{dst_dir}:copy") as back:
        got = back.get_root()
        assert (got.data, got.digest, got.media_type) == (root.data, image.digest, mt.OCI_MANIFEST)
        for desc in blobs_of(got.data):
            assert read_blob(back, desc["digest"], desc["size"]) == image.blobs[desc["digest"]]
    assert json.loads((dst_dir / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    assert not [p for p in (dst_dir / "blobs" / "sha256").iterdir() if p.name.startswith(".")]
    # untagged source with exactly one image
    with open_source(f"oci:{dst_dir}") as only:
        assert only.get_root().digest == image.digest


def test_layout_put_root_replaces_same_tag(tmp_path, image):
    other = make_image([{"x": b"other"}], compress=False)
    dst_dir = tmp_path / "dst"
    for img in (image, other):
        with open_destination(f"oci:{dst_dir}:latest") as dst:
            for digest, data in img.blobs.items():
                blob = tmp_path / "blob"
                blob.write_bytes(data)
                dst.put_blob(str(blob), digest, len(data))
                dst.put_blob(str(blob), digest, len(data))  # idempotent
            dst.put_root(img.manifest)
    with open_destination(f"oci:{dst_dir}:second") as dst:
        dst.put_root(image.manifest)
    entries = json.loads((dst_dir / "index.json").read_text())["manifests"]
    names = [e["annotations"]["org.opencontainers.image.ref.name"] for e in entries]
    assert sorted(names) == ["latest", "second"]
    with open_source(f"oci:{dst_dir}:latest") as src:
        assert src.get_root().digest == other.digest
    with pytest.raises(UsageError) as err:
        open_source(f"oci:{dst_dir}").get_root()
    assert "latest, second" in one_line(err.value)


def test_layout_missing_tag_is_not_found(layout):
    with open_source(f"oci:{layout}:nope") as src, pytest.raises(NotFound) as err:
        src.get_root()
    assert one_line(err.value) == f"oci:{layout}:nope: no image tagged 'nope' (tags: v1)"


def test_layout_tampered_blob_raises_at_eof(layout, image):
    layer = blobs_of(image.manifest.data)[2]
    path = layout / "blobs" / "sha256" / layer["digest"].split(":")[1]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with open_source(f"oci:{layout}:v1") as src:
        stream = src.open_blob(layer["digest"], layer["size"])
        assert stream.read(100)  # nothing is known to be wrong yet
        with pytest.raises(DigestMismatch) as err:
            while stream.read(4096):
                pass
        assert layer["digest"] in one_line(err.value)
        stream.close()
        # a truncated copy: the byte count is checked too
        path.write_bytes(bytes(data[:-10]))
        with pytest.raises(DigestMismatch, match="bytes, want"):
            read_blob(src, layer["digest"], layer["size"])
        with pytest.raises(NotFound):
            src.open_blob("sha256:" + "0" * 64)


def test_layout_refuses_escaping_digests(layout, tmp_path):
    with open_source(f"oci:{layout}:v1") as src:
        for bad in ("sha256:../../../etc/passwd", "sha256:" + "A" * 64, "sha512:" + "0" * 128, "../x"):
            with pytest.raises(FormatError):
                src.open_blob(bad)
    with open_destination(f"oci:{tmp_path / 'd'}") as dst, pytest.raises(FormatError):
        dst.put_blob(str(layout / "index.json"), "sha256:../../index.json", 1)


def test_layout_destination_verifies_and_refuses_foreign_dirs(tmp_path, image):
    blob = tmp_path / "blob"
    blob.write_bytes(b"not what the digest says")
    with open_destination(f"oci:{tmp_path / 'dst'}") as dst:
        with pytest.raises(DigestMismatch):
            dst.put_blob(str(blob), image.digest, blob.stat().st_size)
        assert not dst.has_blob(image.digest)
    assert not [p for p in (tmp_path / "dst" / "blobs" / "sha256").iterdir()]
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(TransportError, match="not an OCI layout"):
        open_destination(f"oci:{tmp_path / 'busy'}")
    with pytest.raises(TransportError, match="no such directory"):
        open_source(f"oci:{tmp_path / 'absent'}")


# --- registry ---------------------------------------------------------------------------


def test_registry_push_then_pull(registry, layout, image, tmp_path):
    ref = f"docker://{registry.host}/shoal/test-image:v1"
    with open_source(f"oci:{layout}:v1") as src, open_destination(ref, plain_http=True) as dst:
        copy_image(src, dst, tmp_path)
    uploads, _ = registry.count("PUT", "/blobs/uploads/")
    assert uploads == len(image.blobs)

    with open_source(ref, plain_http=True) as pulled:
        root = pulled.get_root()
        assert (root.data, root.digest, root.media_type) == (image.manifest.data, image.digest, mt.OCI_MANIFEST)
        for desc in blobs_of(root.data):
            assert read_blob(pulled, desc["digest"], desc["size"]) == image.blobs[desc["digest"]]
        layer = blobs_of(root.data)[2]
        whole = image.blobs[layer["digest"]]
        assert pulled.read_range(layer["digest"], 10, 1000) == whole[10:1000]
        assert pulled.read_range(layer["digest"], len(whole) - 5, len(whole)) == whole[-5:]
        with pytest.raises(FormatError):
            pulled.read_range(layer["digest"], len(whole) - 5, len(whole) + 5)
        with pytest.raises(NotFound):
            read_blob(pulled, "sha256:" + "1" * 64)

    by_digest = f"docker://{registry.host}/shoal/test-image@{image.digest}"
    with open_source(by_digest, plain_http=True) as pinned:
        assert pinned.get_root().data == image.manifest.data

    # pushing again uploads nothing: HEAD finds every blob
    with open_source(f"oci:{layout}:v1") as src, open_destination(ref, plain_http=True) as dst:
        copy_image(src, dst, tmp_path)
    assert registry.count("PUT", "/blobs/uploads/")[0] == uploads
    assert registry.count("HEAD", "/blobs/sha256:")[0] >= 2 * len(image.blobs)


def test_registry_missing_tag_is_not_found(registry):
    ref = f"docker://{registry.host}/foo:bar"
    with open_source(ref, plain_http=True) as src, pytest.raises(NotFound) as err:
        src.get_root()
    assert one_line(err.value) == f"{ref}: manifest unknown (HTTP 404)"


def test_registry_tampered_blob_raises_at_eof(registry, layout, image, tmp_path):
    ref = f"docker://{registry.host}/tamper:v1"
    with open_source(f"oci:{layout}:v1") as src, open_destination(ref, plain_http=True) as dst:
        copy_image(src, dst, tmp_path)
    layer = blobs_of(image.manifest.data)[1]
    hexa = layer["digest"].split(":")[1]
    stored = registry.storage / "docker/registry/v2/blobs/sha256" / hexa[:2] / hexa / "data"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0x01
    stored.write_bytes(bytes(data))
    with open_source(ref, plain_http=True) as pulled, pytest.raises(DigestMismatch) as err:
        read_blob(pulled, layer["digest"], layer["size"])
    assert "digest mismatch" in one_line(err.value)


def test_registry_index_push_and_pull(registry, tmp_path):
    images = {
        "amd64": make_image([FILES_A], arch="amd64"),
        "arm64": make_image([FILES_A, {"arm": b"64"}], arch="arm64", compress=False),
    }
    index = make_index(images)
    src_dir = write_layout(tmp_path / "multi", {"all": index}, list(images.values()))
    ref = f"docker://{registry.host}/multi/arch:all"
    with open_source(f"oci:{src_dir}:all") as src, open_destination(ref, plain_http=True) as dst:
        assert copy_image(src, dst, tmp_path).media_type == mt.OCI_INDEX
    with open_source(ref, plain_http=True) as pulled:
        root = pulled.get_root()
        assert (root.data, root.media_type, root.digest) == (index.data, mt.OCI_INDEX, index.digest)
        for img in images.values():
            child = pulled.get_manifest(img.digest)
            assert (child.data, child.media_type) == (img.manifest.data, mt.OCI_MANIFEST)
        with pytest.raises(NotFound):
            pulled.get_manifest("sha256:" + "2" * 64)
        # and from the registry into a layout, where the index root is a blob
        out = tmp_path / "out layout"
        with open_destination(f"oci:{out}:all") as dst:
            copy_image(pulled, dst, tmp_path)
    entry = json.loads((out / "index.json").read_text())["manifests"][0]
    assert (entry["mediaType"], entry["digest"]) == (mt.OCI_INDEX, index.digest)
    with open_source(f"oci:{out}:all") as back:
        assert back.get_root().data == index.data
        assert back.get_manifest(images["arm64"].digest).media_type == mt.OCI_MANIFEST


def test_registry_digest_pinned_destination_must_match(registry, image, tmp_path):
    ref = f"docker://{registry.host}/pinned@sha256:{'3' * 64}"
    with open_destination(ref, plain_http=True) as dst, pytest.raises(UsageError):
        dst.put_root(image.manifest)


def test_unreachable_registry_is_transport_error():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        ref = f"docker://127.0.0.1:{port}/foo:bar"
        with open_source(ref, plain_http=True) as src, pytest.raises(TransportError) as err:
            src.get_root()
    assert one_line(err.value) == f"{ref}: connection refused"


def test_https_to_plain_registry_suggests_plain_http(registry):
    with open_source(f"docker://{registry.host}/foo:bar") as src, pytest.raises(TransportError) as err:
        src.get_root()
    assert "--plain-http" in one_line(err.value)


def test_range_falls_back_when_server_ignores_range(tmp_path):
    """A plain static HTTP server (no Range support) standing in for a registry."""
    blob = os.urandom(5000)
    digest = sha256(blob)
    blob_dir = tmp_path / "v2" / "static" / "blobs"
    blob_dir.mkdir(parents=True)
    (blob_dir / digest).write_bytes(blob)
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a: None
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        ref = f"docker://127.0.0.1:{httpd.server_port}/static:x"
        with open_source(ref, plain_http=True) as src:
            assert src.read_range(digest, 100, 4000) == blob[100:4000]
            assert read_blob(src, digest, len(blob)) == blob
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


class _Flaky(BaseHTTPRequestHandler):
    """Answers 503 `failures` times, then serves `manifest` (an OCI manifest)."""

    failures = 0
    manifest = b""
    seen: ClassVar[list[str]] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.path)
        if len(self.seen) <= self.failures:
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", mt.OCI_MANIFEST)
        self.send_header("Content-Length", str(len(self.manifest)))
        self.end_headers()
        self.wfile.write(self.manifest)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("failures,ok", [(2, True), (3, False)])
def test_5xx_is_retried_three_times_in_all(image, failures, ok):
    handler = type("Flaky", (_Flaky,), {"failures": failures, "manifest": image.manifest.data, "seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        ref = f"docker://127.0.0.1:{httpd.server_port}/flaky:v1"
        with open_source(ref, plain_http=True) as src:
            if ok:
                assert src.get_root().digest == image.digest
            else:
                with pytest.raises(TransportError) as err:
                    src.get_root()
                assert one_line(err.value) == f"{ref}: Service Unavailable (HTTP 503)"
        assert len(handler.seen) == 3
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


# --- authentication ----------------------------------------------------------------------


def test_basic_auth_registry(basic_registry, docker_config, layout, image, tmp_path):
    ref = f"docker://{basic_registry.host}/private/img:v1"
    with open_source(f"oci:{layout}:v1") as src, open_destination(ref, plain_http=True) as dst, \
            pytest.raises(TransportError) as err:
        copy_image(src, dst, tmp_path)
    text = one_line(err.value)
    assert "HTTP 401" in text and f"no credentials for {basic_registry.host}" in text

    docker_config.login(basic_registry.host, basic_registry.username, "wrong")
    with open_source(ref, plain_http=True) as src, pytest.raises(TransportError) as err:
        src.get_root()
    assert one_line(err.value).endswith(f"(HTTP 401); the credentials of user '{basic_registry.username}' were rejected")

    docker_config.login(basic_registry.host, basic_registry.username, basic_registry.password)
    with open_source(f"oci:{layout}:v1") as src, open_destination(ref, plain_http=True) as dst:
        copy_image(src, dst, tmp_path)
    docker_config.login(
        f"http://{basic_registry.host}/v1/", basic_registry.username, basic_registry.password, "fields"
    )
    (docker_config.path / "config.json").write_text(json.dumps({"auths": {
        f"http://{basic_registry.host}/v1/": {
            "username": basic_registry.username, "password": basic_registry.password,
        }
    }}))
    with open_source(ref, plain_http=True) as pulled:
        assert pulled.get_root().digest == image.digest
        layer = blobs_of(image.manifest.data)[2]
        assert read_blob(pulled, layer["digest"], layer["size"]) == image.blobs[layer["digest"]]


@pytest.mark.parametrize("token_field", ["token", "access_token"])
def test_bearer_token_registry(registry_factory, docker_config, layout, image, tmp_path, token_field):
    server = registry_factory("token", token_field=token_field)
    ref = f"docker://{server.host}/team/img:v1"
    with open_source(ref, plain_http=True) as src, pytest.raises(TransportError) as err:
        src.get_root()
    text = one_line(err.value)
    assert "token server" in text and "HTTP 401" in text and "no credentials" in text

    docker_config.login(server.host, server.username, server.password)
    with open_source(f"oci:{layout}:v1") as src, open_destination(ref, plain_http=True) as dst:
        copy_image(src, dst, tmp_path)
    assert any("repository:team/img:pull,push" in t["scopes"] for t in server.token_server.issued)
    with open_source(ref, plain_http=True) as pulled:
        assert pulled.get_root().data == image.manifest.data
        for desc in blobs_of(image.manifest.data):
            assert read_blob(pulled, desc["digest"], desc["size"]) == image.blobs[desc["digest"]]
    assert server.token_server.issued[-1]["scopes"] == ["repository:team/img:pull"]


def test_credential_files(tmp_path, monkeypatch, docker_config):
    assert find_credentials("127.0.0.1:5000") is None
    docker_config.login("https://index.docker.io/v1/", "hub", "hubpw")
    assert find_credentials("docker.io").username == "hub"
    (docker_config.path / "config.json").write_text(json.dumps({"auths": {
        "reg.example:5000": {"username": "u", "password": "p:w"},
        "reg.example:5000/team": {"auth": "dGVhbTpzZWNyZXQ6eA=="},  # team:secret:x
        "helper.example": {},
    }}))
    assert (find_credentials("reg.example:5000", "other").password) == "p:w"
    team = find_credentials("reg.example:5000", "team/app")
    assert (team.username, team.password) == ("team", "secret:x")
    assert find_credentials("helper.example") is None
    assert "secret" not in repr(team)

    podman = tmp_path / "auth.json"
    podman.write_text(json.dumps({"auths": {"reg.example:5000": {"username": "pod", "password": "x"}}}))
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(podman))
    assert find_credentials("reg.example:5000").username == "pod"
    podman.write_text("{not json")
    with pytest.raises(TransportError) as err:
        find_credentials("reg.example:5000")
    assert str(podman) in one_line(err.value)


# --- docker-archive ----------------------------------------------------------------------


@pytest.mark.parametrize("style,gzip_layers", [("legacy", False), ("blobs", False), ("legacy", True)])
def test_docker_archive_source(tmp_path, style, gzip_layers):
    archive = tmp_path / "-saved ü image.tar"
    first, second = make_docker_archive(
        archive,
        [(["app:v1"], [FILES_A, FILES_B]), (["example.com:5000/other:v2", "other:latest"], [FILES_B])],
        style=style, gzip_layers=gzip_layers,
    )
    want_type = mt.DOCKER_LAYER_GZIP if gzip_layers else mt.OCI_LAYER_TAR
    for ref, image in [
        (f"docker-archive:{archive}", first),
        (f"docker-archive:{archive}:app:v1", first),
        (f"docker-archive:{archive}:example.com:5000/other:v2", second),
        (f"docker-archive:{archive}:other", second),
        (f"docker-archive:{archive}:@1", second),
    ]:
        with open_source(ref) as src:
            root = src.get_root()
            doc = json.loads(root.data)
            assert root.media_type == doc["mediaType"] == mt.DOCKER_MANIFEST
            assert root.digest == sha256(root.data) and src.get_manifest(root.digest) == root
            assert doc["config"] == {"mediaType": mt.DOCKER_CONFIG, "size": len(image.config), "digest": sha256(image.config)}
            assert [layer["mediaType"] for layer in doc["layers"]] == [want_type] * len(image.layers)
            assert [layer["digest"] for layer in doc["layers"]] == [sha256(b) for b in image.layers]
            for desc in blobs_of(root.data):
                assert read_blob(src, desc["digest"], desc["size"]) == image.blobs[desc["digest"]]
    with pytest.raises(NotFound) as err:
        open_source(f"docker-archive:{archive}:missing:tag")
    assert "app:v1" in one_line(err.value)


def test_docker_archive_gzipped_and_symlinked_layers(tmp_path):
    """`docker save | gzip`, and a layer stored once with a symlink for its second use."""
    from tests.imagetools import gzip_bytes, make_tar

    plain = tmp_path / "plain.tar"
    (image,) = make_docker_archive(plain, [(["app:v1"], [FILES_A])])
    compressed = tmp_path / "saved.tar.gz"
    compressed.write_bytes(gzip_bytes(plain.read_bytes()))
    with open_source(f"docker-archive:{compressed}:app:v1") as src:
        layer = blobs_of(src.get_root().data)[1]
        assert read_blob(src, layer["digest"], layer["size"]) == image.layers[0]

    layer_tar = image.layers[0]
    manifest = [{"Config": "c.json", "RepoTags": ["dup:v1"], "Layers": ["a/layer.tar", "b/layer.tar"]}]
    members = {
        "manifest.json": json.dumps(manifest).encode(), "c.json": image.config,
        "a/layer.tar": layer_tar, "b/layer.tar": "->../a/layer.tar",
    }
    linked = tmp_path / "linked.tar"
    linked.write_bytes(make_tar(members))
    with open_source(f"docker-archive:{linked}") as src:
        layers = json.loads(src.get_root().data)["layers"]
        assert [d["digest"] for d in layers] == [sha256(layer_tar)] * 2
        assert read_blob(src, layers[1]["digest"], layers[1]["size"]) == layer_tar
    members["b/layer.tar"] = "->../../etc/passwd"
    linked.write_bytes(make_tar(members))
    with pytest.raises(FormatError, match="unsafe member name"):
        open_source(f"docker-archive:{linked}")


def test_docker_archive_to_registry(registry, tmp_path):
    archive = tmp_path / "saved.tar"
    make_docker_archive(archive, [(["app:v1"], [FILES_A, FILES_B])])
    ref = f"docker://{registry.host}/from/archive:v1"
    with open_source(f"docker-archive:{archive}") as src, open_destination(ref, plain_http=True) as dst:
        root = copy_image(src, dst, tmp_path)
    with open_source(ref, plain_http=True) as pulled:
        assert pulled.get_root().data == root.data


def test_docker_archive_rejects_escaping_members(tmp_path):
    from tests.imagetools import make_tar

    for bad in ("../outside/layer.tar", "/abs/layer.tar", "a/../../b"):
        archive = tmp_path / "bad.tar"
        manifest = [{"Config": "c.json", "RepoTags": ["x:y"], "Layers": [bad]}]
        archive.write_bytes(make_tar({"manifest.json": json.dumps(manifest).encode(), "c.json": b"{}"}))
        with pytest.raises(FormatError) as err:
            open_source(f"docker-archive:{archive}")
        assert "unsafe member name" in one_line(err.value)
    archive.write_bytes(b"this is not a tar file at all" * 100)
    with pytest.raises(FormatError):
        open_source(f"docker-archive:{archive}")
    with pytest.raises(TransportError, match="no such file"):
        open_source(f"docker-archive:{tmp_path / 'absent.tar'}")
