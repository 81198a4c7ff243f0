"""Malformed OCI documents through `shoal convert`, `shoal inspect` and `shoal pull`:
one line on stderr naming the document and the field, exit 1, no traceback, nothing
written. The documents come from an OCI layout (convert, inspect) and from a hostile
registry (pull): a small HTTP server of the test's own that serves them as a registry
would, because the distribution registry refuses to store most of them."""

from __future__ import annotations

import gzip
import hashlib
import http.server
import io
import json
import subprocess
import tarfile
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from shoal import mediatypes as mt
from tests.fixtures_services import containerd_missing
from tests.services import CTR_NAMESPACE, SHOAL, start_containerd


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _layer() -> tuple[bytes, str]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("odd dir/hello.txt")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"hello\n"))
    raw = buf.getvalue()
    return gzip.compress(raw, mtime=0), _digest(raw)


class Image:
    """A one-layer image as documents and blobs, to be broken one field at a time."""

    def __init__(self) -> None:
        self.layer, diff_id = _layer()
        self.config = {"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [diff_id]}}
        self.manifest: dict = {"schemaVersion": 2, "mediaType": mt.OCI_MANIFEST, "layers": [
            {"mediaType": mt.OCI_LAYER_GZIP, "digest": _digest(self.layer), "size": len(self.layer)}]}
        self.config_bytes: bytes | None = None  # set to serve a config that is not this JSON
        self.index: dict | None = None  # set to serve an index as the root
        self.manifest_bytes: bytes | None = None

    def blobs(self) -> tuple[bytes, str, dict[str, bytes]]:
        """(root bytes, root media type, every blob and manifest by digest)."""
        config = self.config_bytes if self.config_bytes is not None else json.dumps(self.config).encode()
        if "config" not in self.manifest:
            self.manifest["config"] = {"mediaType": mt.OCI_CONFIG, "digest": _digest(config), "size": len(config)}
        elif self.manifest["config"] is None:
            del self.manifest["config"]
        manifest = self.manifest_bytes if self.manifest_bytes is not None else json.dumps(self.manifest).encode()
        blobs = {_digest(config): config, _digest(self.layer): self.layer, _digest(manifest): manifest}
        if self.index is None:
            return manifest, mt.OCI_MANIFEST, blobs
        self.index.setdefault("manifests", [{"mediaType": mt.OCI_MANIFEST, "digest": _digest(manifest),
                                             "size": len(manifest),
                                             "platform": {"os": "linux", "architecture": "amd64"}}])
        index = json.dumps(self.index).encode()
        blobs[_digest(index)] = index
        return index, mt.OCI_INDEX, blobs


def _deep(n: int) -> bytes:
    return b'{"schemaVersion": 2, "layers": ' + b"[" * n + b"]" * n + b"}"


def _case(fn):
    image = Image()
    fn(image)
    return image


CASES = {
    "manifest without config": (lambda i: i.manifest.update(config=None), "manifest.config: missing"),
    "config not JSON": (lambda i: setattr(i, "config_bytes", b"{not json"), "config: not valid JSON"),
    "config a JSON list": (lambda i: setattr(i, "config_bytes", b"[1, 2]"), "config: not a JSON object"),
    "rootfs a string": (lambda i: i.config.update(rootfs="layers"), "config.rootfs: not an object"),
    "diff_ids not digests": (lambda i: i.config["rootfs"].update(diff_ids=["abc"]), "diff_ids[0]"),
    "diff_ids too few": (lambda i: i.config["rootfs"].update(diff_ids=[]), "lists 0 diff_ids for 1 layers"),
    "layer without digest": (lambda i: i.manifest["layers"][0].pop("digest"), "layers[0].digest: missing"),
    "layer digest malformed": (lambda i: i.manifest["layers"][0].update(digest="sha256:../../x"), "layers[0].digest"),
    "layer size negative": (lambda i: i.manifest["layers"][0].update(size=-5), "layers[0].size: not a size"),
    "layer size a string": (lambda i: i.manifest["layers"][0].update(size="5"), "layers[0].size: not a size"),
    "layer not an object": (lambda i: i.manifest.update(layers=["sha256:" + "a" * 64]), "layers[0]: not an object"),
    "layers an object": (lambda i: i.manifest.update(layers={"a": 1}), "layers: not a list"),
    "annotations not strings": (lambda i: i.manifest["layers"][0].update(annotations={"a": 1}),
                                "annotations: not an object of strings"),
    "config absurdly large": (lambda i: i.manifest.update(config={"mediaType": mt.OCI_CONFIG,
                                                                  "digest": "sha256:" + "b" * 64, "size": 1 << 40}),
                              "more than"),
    "manifest a JSON list": (lambda i: setattr(i, "manifest_bytes", b"[]"), "not a JSON object"),
    "manifest nested 100,000 deep": (lambda i: setattr(i, "manifest_bytes", _deep(100_000)), "nested more than"),
    "index manifests a string": (lambda i: setattr(i, "index", {"schemaVersion": 2, "mediaType": mt.OCI_INDEX,
                                                                 "manifests": "all of them"}),
                                 "index.manifests: not a list"),
    "index entry not an object": (lambda i: setattr(i, "index", {"schemaVersion": 2, "mediaType": mt.OCI_INDEX,
                                                                  "manifests": [7]}),
                                  "index.manifests[0]: not an object"),
    "index platform a string": (lambda i: setattr(i, "index", {
        "schemaVersion": 2, "mediaType": mt.OCI_INDEX,
        "manifests": [{"mediaType": mt.OCI_MANIFEST, "digest": "sha256:" + "c" * 64, "size": 2,
                       "platform": "linux"}]}), "platform: not an object"),
}


def _layout(path: Path, image: Image) -> None:
    root, media_type, blobs = image.blobs()
    (path / "blobs" / "sha256").mkdir(parents=True)
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    for digest, data in blobs.items():
        (path / "blobs" / "sha256" / digest[7:]).write_bytes(data)
    index = {"schemaVersion": 2, "manifests": [{"mediaType": media_type, "digest": _digest(root), "size": len(root),
                                                "annotations": {"org.opencontainers.image.ref.name": "t"}}]}
    (path / "index.json").write_text(json.dumps(index))


def _one_line_failure(argv: list[str], want: str) -> str:
    proc = subprocess.run([SHOAL, *argv], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, (argv, proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0], (argv, proc.stderr)
    return lines[0]


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_documents_in_a_layout(case, tmp_path):
    fn, want = CASES[case]
    src = tmp_path / "odd src"
    _layout(src, _case(fn))
    _one_line_failure(["inspect", f"oci:{src}:t"], want)
    dst = tmp_path / "odd dst"
    _one_line_failure(["convert", f"oci:{src}:t", f"oci:{dst}:out"], want)
    assert not (dst / "index.json").exists() or "out" not in (dst / "index.json").read_text()


class _Hostile(http.server.BaseHTTPRequestHandler):
    """A registry that serves whatever documents it was given."""

    root: tuple[bytes, str] = (b"", "")
    blobs: ClassVar[dict[str, bytes]] = {}

    def log_message(self, *args) -> None:
        pass

    def _send(self, body: bytes, content_type: str, head: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Docker-Content-Digest", _digest(body))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _serve(self, head: bool) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/v2/":
            return self._send(b"{}", "application/json", head)
        _, _, rest = path.partition("/v2/")
        repo, kind, ref = rest.rpartition("/")[0].rpartition("/")[0], rest.split("/")[-2], rest.split("/")[-1]
        if kind == "manifests" and ref == "t":
            return self._send(*self.root, head)
        body = self.blobs.get(ref)
        if body is None or not repo:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        return self._send(body, mt.OCI_MANIFEST if kind == "manifests" else "application/octet-stream", head)

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)


@pytest.fixture
def hostile_registry():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture(scope="module")
def module_containerd(tmp_path_factory):
    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    server = start_containerd(tmp_path_factory.mktemp("containerd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.containerd
@pytest.mark.parametrize("case", list(CASES))
def test_malformed_documents_from_a_registry(case, hostile_registry, module_containerd):
    fn, want = CASES[case]
    root, media_type, blobs = _case(fn).blobs()
    _Hostile.root, _Hostile.blobs = (root, media_type), blobs
    host = f"127.0.0.1:{hostile_registry.server_address[1]}"
    _one_line_failure(["pull", f"{host}/odd/img:t", "--address", module_containerd.address,
                       "--namespace", CTR_NAMESPACE], want)
    assert module_containerd.ctr("images", "ls", "-q").stdout.strip() == ""  # nothing written
    assert module_containerd.ctr("content", "ls", "-q").stdout.strip() == ""
    _one_line_failure(["inspect", f"docker://{host}/odd/img:t", "--plain-http"], want)


def test_convert_refuses_a_path_through_the_layer_s_own_symlink(tmp_path):
    """`esc -> /tmp` then `esc/file`: the node would refuse to serve it, so the converter
    refuses to write it (one line naming the layer and the entry)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        link = tarfile.TarInfo("esc")
        link.type, link.linkname = tarfile.SYMTYPE, "/tmp"
        tar.addfile(link)
        f = tarfile.TarInfo("esc/file")
        f.size = 3
        tar.addfile(f, io.BytesIO(b"abc"))
    raw = buf.getvalue()
    image = Image()
    image.layer = gzip.compress(raw, mtime=0)
    image.config["rootfs"]["diff_ids"] = [_digest(raw)]
    image.manifest["layers"][0].update(digest=_digest(image.layer), size=len(image.layer))
    _layout(tmp_path / "src", image)
    line = _one_line_failure(["convert", f"oci:{tmp_path / 'src'}:t", f"oci:{tmp_path / 'dst'}:o"],
                             "'esc/file': path goes through 'esc', which this layer makes a symlink")
    assert _digest(image.layer) in line
