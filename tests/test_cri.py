"""The kubelet's path: containerd's CRI plugin driven through the CRI v1 API (tests/cri.py)
as the kubelet drives it, on containerd configured by `shoal install containerd` as
deploy/ does it (proxy plugin, snapshot labels, runtime handler `shoal`; on containerd
1.6, which ignores a handler's snapshotter, shoal is also the default snapshotter:
deploy/kubernetes/README.md). Pods run on the `shoal` runtime handler with the host
network; their sandbox image is built here and served by the local registry.

Real parts: Debian's docker-registry, containerd with its CRI plugin, runc, `shoal node`
and its layer file system (FUSE).
"""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import time
from pathlib import Path

import pytest

from builder.convert import convert
from tests.cri import cri_node
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer
from tests.services import SHOAL, NodeProcess, mounts_under, wait_for

CRI_NS = "k8s.io"  # containerd's namespace for the CRI plugin's images and containers
HANDLER = "shoal"  # deploy/kubernetes/node/runtimeclass.yaml's handler
MiB = 1 << 20
# reads all of the small file and 64 KiB of the 8 MiB one
READ = ["/bin/sh", "-c", "cat /etc/motd /app/hello.txt; head -c 65536 /app/weights.bin | md5sum"]
TAIL = ["/bin/sh", "-c", "tail -c 65536 /app/weights.bin | md5sum"]  # another part of the weights


def build_app(registry_host: str, repository: str, work: Path, seed: int, plain_http: bool = True) -> dict:
    """A two-layer image (busybox; /app with a small text file and 8 MiB of random
    weights) pushed gzip and converted to shoal's lazy format in `repository`; and a
    sandbox (pause) image of the busybox layer that sleeps. {"lazy", "pause", "stdout"}:
    the refs and what READ prints in a container of the lazy image."""
    work.mkdir(parents=True, exist_ok=True)
    base = busybox_layer(work / "base")
    app = work / "app" / "app"
    app.mkdir(parents=True)
    hello = f"hello from {repository}\n"
    (app / "hello.txt").write_text(hello)
    weights = random.Random(seed).randbytes(8 * MiB)
    (app / "weights.bin").write_bytes(weights)
    ref = f"{registry_host}/{repository}"
    build_image([str(base), str(work / "app")], f"docker://{ref}:gzip", ImageConfig(cmd=READ), plain_http=plain_http,
                workdir=str(work))
    convert(f"docker://{ref}:gzip", f"docker://{ref}:lazy", plain_http=plain_http)
    build_image([str(base)], f"docker://{ref}:pause", ImageConfig(cmd=["/bin/sleep", "3600"]), plain_http=plain_http,
                workdir=str(work))
    motd = (work / "base" / "etc" / "motd").read_text()
    return {"lazy": f"{ref}:lazy", "pause": f"{ref}:pause",
            "stdout": f"{motd}{hello}{hashlib.md5(weights[:65536]).hexdigest()}  -\n",
            "tail": f"{hashlib.md5(weights[-65536:]).hexdigest()}  -\n"}


@pytest.fixture(scope="module")
def app(module_registry, tmp_path_factory):
    return build_app(module_registry.host, "kube/app", tmp_path_factory.mktemp("cri app"), seed=14)


def status(node) -> dict:
    proc = subprocess.run([SHOAL, "status", "--root", str(node.root), "--json"], check=True, capture_output=True,
                          text=True, timeout=60)
    return json.loads(proc.stdout)


def snapshots(ctd) -> list[tuple[str, str]]:
    """containerd's view of shoal's snapshots in the CRI namespace: [(key, kind)]."""
    out = ctd.ctr("snapshots", "--snapshotter", "shoal", "ls", namespace=CRI_NS).stdout.splitlines()[1:]
    return [(cols[0], cols[-1]) for cols in map(str.split, out) if cols]


def manifest(image: str) -> dict:
    from builder.oci.refs import open_source

    with open_source(f"docker://{image}", plain_http=True) as src:
        return json.loads(src.get_root().data)


@pytest.mark.containerd
def test_two_pods_through_cri_start_lazily_and_leave_nothing(module_registry, app, tmp_path):
    """PullImage of a converted image leaves its layers lazy (a few bytes fetched: the
    TOCs); a pod on the `shoal` handler runs it and its CRI log holds what it printed;
    a second pod of the same image fetches nothing more (the node's figures and the
    registry's log); stopping and removing the pods leaves no container snapshot and no
    mount of theirs, and RemoveImage (what the kubelet's image GC does) leaves no shoal
    snapshot at all."""
    reg = module_registry
    with cri_node([reg.host], app["pause"]) as (node, ctd, cri):
        assert cri.version()
        layers = manifest(app["lazy"])
        size = sum(ly["size"] for ly in layers["layers"])
        before = reg.layer_bytes(layers)
        image_id = cri.pull_image(app["lazy"])
        assert image_id.startswith("sha256:")
        s = status(node)
        lazy = {ly["digest"]: ly for ly in s["lazy_layers"]}
        pulled = [c for c in s["chains"] if c["image"] == app["lazy"]]
        assert len(pulled) == 2 and {c["kind"] for c in pulled} == {"lazy"}, s["chains"]
        assert {c["layer"] for c in pulled} <= set(lazy), (pulled, lazy)
        fetched_at_pull = reg.layer_bytes(layers) - before
        assert 0 < fetched_at_pull < size / 4, (fetched_at_pull, size)  # the TOCs, not the layers
        # the layer bytes from the origin are the TOCs; the node read the image's manifest besides
        assert s["fetch"]["manifest_bytes"] > 0, s["fetch"]
        assert s["fetch"]["bytes_from_origin"] - s["fetch"]["manifest_bytes"] == fetched_at_pull, s["fetch"]
        assert fetched_at_pull == s["fetch"]["toc_bytes"], s["fetch"]

        # pod 1: its log is what the container printed
        logs = tmp_path / "logs"
        logs.mkdir()
        out = cri.run(app["lazy"], READ, str(logs / "pod-1"), "pod-1", runtime_handler=HANDLER)
        assert out == app["stdout"], (out, ctd.log_tail(), node.log())
        s1 = status(node)
        read_from_origin = s1["fetch"]["bytes_from_origin"]
        assert fetched_at_pull < read_from_origin < size / 2, s1["fetch"]  # what it read, not the weights
        served = reg.layer_bytes(layers)

        # pod 2 of the same image: nothing more from the registry
        assert cri.run(app["lazy"], READ, str(logs / "pod-2"), "pod-2", runtime_handler=HANDLER) == app["stdout"]
        s2 = status(node)
        assert s2["fetch"]["bytes_from_origin"] == read_from_origin, s2["fetch"]
        assert reg.layer_bytes(layers) == served

        # the pods are gone, and so are their containers' snapshots and mounts
        assert cri.pods() == [] and cri.containers() == []
        assert {kind for _, kind in snapshots(ctd)} == {"Committed"}, snapshots(ctd)
        fs_mount = s2["fs_server"]["mount"]
        assert mounts_under(node.root.parent) == [fs_mount], mounts_under(node.root.parent)

        # RemoveImage of both images: no shoal snapshot is left, the lazy layers unload
        for image in (app["lazy"], app["pause"]):
            cri.remove_image(image)
        assert cri.list_images() == []
        wait_for(lambda: snapshots(ctd) == [], "containerd to remove shoal's snapshots", timeout=60)
        wait_for(lambda: status(node)["lazy_layers"] == [], "the lazy layers to unload", timeout=60)
        assert status(node)["chains"] == []
        assert mounts_under(node.root.parent) in ([fs_mount], [])


# --- private registries: PullImage's AuthConfig through shoal's CRI image service -------------------

CRI_SOCKET = "@DIR@/cri-image.sock"  # the kubelet's --image-service-endpoint
CRI_CONFIG = f'[cri]\nimage_service_socket = "{CRI_SOCKET}"\n'


def files_holding(secrets: list[bytes], *folders: Path) -> list[str]:
    """Files under `folders` (not crossing into mounts) whose bytes hold any of `secrets`."""
    import os

    found = []
    for folder in folders:
        for top, dirs, names in os.walk(folder):
            dirs[:] = [d for d in dirs if not os.path.ismount(os.path.join(top, d))]
            for name in names:
                path = os.path.join(top, name)
                try:
                    if not os.path.isfile(path) or os.path.islink(path):
                        continue
                    with open(path, "rb") as f:
                        data = f.read()
                except OSError:
                    continue
                if any(s in data for s in secrets):
                    found.append(path)
    return found


@pytest.mark.containerd
def test_a_private_image_through_cri_with_credentials_only_in_authconfig(
        basic_registry, module_registry, app, docker_config, monkeypatch, tmp_path):
    """A private image (htpasswd registry), with the node given no credential file: its
    PullImage through shoal's CRI image service without AuthConfig fails with one line;
    with the user and password in AuthConfig the pull leaves the layers lazy and a pod
    reads them from the origin with those credentials. The credentials serve that
    repository only (another repository of the same registry is refused to the node's
    own reads), are in no file, log or process environment, the socket is root's alone;
    they outlive a restart of `shoal node`, and RemoveImage of the repository's last
    image forgets them."""
    import base64
    import os

    from tests.cri import CRIError

    reg = basic_registry
    docker_config.login(reg.host, reg.username, reg.password)  # the CI step's push, not the node's
    private = build_app(reg.host, "private/app", tmp_path / "app", seed=21)
    other = build_app(reg.host, "private/other", tmp_path / "other", seed=22)
    empty = tmp_path / "node docker config"
    empty.mkdir()
    monkeypatch.setenv("DOCKER_CONFIG", str(empty))  # the node and its layer fs: no credential file
    secrets = [reg.password.encode(), base64.b64encode(f"{reg.username}:{reg.password}".encode())]
    auth = {"username": reg.username, "password": reg.password}

    with cri_node([reg.host, module_registry.host], app["pause"], CRI_CONFIG, CRI_SOCKET) as (node, ctd, cri):
        sock = Path(CRI_SOCKET.replace("@DIR@", str(node.root.parent)))
        st = sock.stat()
        assert oct(st.st_mode & 0o777) == "0o600" and st.st_uid == 0
        assert cri.list_images() == []  # the proxy answers as containerd
        proc = subprocess.run([SHOAL, "doctor", "--root", str(node.root), "--socket", str(node.socket), "--config",
                               str(node.root.parent / "node.toml"), "--containerd-config", str(ctd.config_path),
                               "--containerd-address", ctd.address, "--json"],
                              check=False, capture_output=True, text=True, timeout=120)
        checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
        assert checks["credentials"]["status"] == "ok" and str(sock) in checks["credentials"]["detail"], checks

        # no AuthConfig: refused, one line, nothing kept
        with pytest.raises(CRIError) as refused:
            cri.pull_image(private["lazy"])
        assert "401 Unauthorized" in refused.value.details or "unauthorized" in refused.value.details.lower()
        assert "\n" not in str(refused.value)
        assert status(node).get("credentials", []) == [] and cri.list_images() == []
        # a wrong password: refused, and the node keeps nothing of it
        with pytest.raises(CRIError):
            cri.pull_image(private["lazy"], auth={"username": reg.username, "password": "wrong"})
        assert status(node)["credentials"] == []

        # the user and password in AuthConfig: a lazy pull, a pod that reads from the origin
        cri.pull_image(private["lazy"], auth=auth)
        s = status(node)
        assert [(c["registry"], c["repository"]) for c in s["credentials"]] == [(reg.host, "private/app")]
        text = subprocess.run([SHOAL, "status", "--root", str(node.root)], check=True, capture_output=True, text=True,
                              timeout=60).stdout
        assert f"pull credentials from CRI: 1 repositories\n    {reg.host}/private/app  expires in" in text, text
        assert reg.password not in text
        assert {c["kind"] for c in s["chains"] if c["image"] == private["lazy"]} == {"lazy"}, s["chains"]
        toc = s["fetch"]["bytes_from_origin"]
        out = cri.run(private["lazy"], READ, str(tmp_path / "logs"), "private-pod", runtime_handler=HANDLER)
        assert out == private["stdout"], (out, node.log())
        assert status(node)["fetch"]["bytes_from_origin"] > toc  # lazy reads, with the captured credentials

        # another repository of the same registry gets none of them: containerd's pull is
        # refused, and so is the node's own read of its layers (a pull whose manifest the
        # client fetched with a credential file of its own: the layer's TOC read is the node's)
        with pytest.raises(CRIError):
            cri.pull_image(other["lazy"])
        own = tmp_path / "client docker config"
        own.mkdir()
        (own / "config.json").write_text((docker_config.path / "config.json").read_text())
        proc = subprocess.run([SHOAL, "pull", other["lazy"], "--address", ctd.address, "--namespace", "shoal-test"],
                              check=False, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "DOCKER_CONFIG": str(own)})
        assert proc.returncode != 0 and "401" in proc.stderr, (proc.stdout, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        # ... while its own credentials (as `auth`, base64 of user:password) do serve it
        cri.pull_image(other["lazy"], auth={"auth": base64.b64encode(f"{reg.username}:{reg.password}".encode()).decode()})
        assert cri.run(other["lazy"], READ, str(tmp_path / "logs"), "other-pod", runtime_handler=HANDLER) \
            == other["stdout"]
        assert {c["repository"] for c in status(node)["credentials"]} == {"private/app", "private/other"}

        # nowhere on disk, in no log, in no process's environment or command line
        pids = [node.proc.pid, status(node)["fs_server"]["pid"], ctd.pid]
        for pid in pids:
            for what in ("environ", "cmdline"):
                data = Path(f"/proc/{pid}/{what}").read_bytes()
                assert not any(sec in data for sec in secrets), (pid, what)
        assert files_holding(secrets, node.root.parent) == []
        # (the registry's own files hold only its htpasswd hash; the test's docker configs are the CI's)

        # a restart of `shoal node` keeps them (the layer file system holds them): a new
        # pod reads another part of the weights from the origin
        node.stop()
        again = NodeProcess(node.root, node.socket, node.log_path, ("--config", str(node.root.parent / "node.toml")))
        try:
            assert {c["repository"] for c in status(again)["credentials"]} == {"private/app", "private/other"}
            before = status(again)["fetch"]["bytes_from_origin"]
            # containerd may send its first snapshotter call after the restart down its
            # connection to the stopped node ("connection closed": UNAVAILABLE, twice in CI
            # under load); the kubelet retries a pod that failed so, and so does this
            for attempt in range(3):
                try:
                    out = cri.run(private["lazy"], TAIL, str(tmp_path / "logs"), f"after-restart-{attempt}",
                                  runtime_handler=HANDLER)
                    break
                except CRIError as e:
                    if e.code.name != "UNAVAILABLE" or attempt == 2:
                        raise
                    time.sleep(1)
            assert out == private["tail"]
            assert status(again)["fetch"]["bytes_from_origin"] > before

            # RemoveImage of a repository's last image forgets its credentials
            cri.remove_image(private["lazy"])
            assert [c["repository"] for c in status(again)["credentials"]] == ["private/other"]
        finally:
            again.stop()


# --- what the proxy reads of the CRI messages (no services) ----------------------------------------


def _pull_request(image: str, **auth) -> bytes:
    from tests.cri import api_pb2

    request = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image, annotations={"a": "b"}),
                                       sandbox_config=api_pb2.PodSandboxConfig(hostname="h"))
    if auth:
        request.auth.CopyFrom(api_pb2.AuthConfig(**auth))
    return request.SerializeToString()


@pytest.mark.parametrize(("auth", "expected"), [
    ({}, None),
    ({"username": "u", "password": "p ä:ss"}, ("u", "p ä:ss")),
    ({"auth": "dTpwIMOkOnNz"}, ("u", "p ä:ss")),  # base64 of "u:p ä:ss"
    ({"auth": "not base64!"}, None),
    ({"auth": "bm9jb2xvbg=="}, None),  # "nocolon"
    ({"username": "u", "password": "p", "server_address": "https://reg.example:5000/v1/"}, ("u", "p")),
    ({"username": "u", "password": "p", "server_address": "reg.example:5000"}, ("u", "p")),
    ({"username": "u", "password": "p", "server_address": "https://other.example"}, None),  # another host's
    ({"identity_token": "t"}, None),
    ({"registry_token": "t"}, None),
])
def test_pull_credentials_as_containerd_reads_them(auth, expected):
    from snapshotter.criproxy import credentials_of, parse_pull

    pull = parse_pull(_pull_request("reg.example:5000/team/app:v1", **auth))
    assert pull.image == "reg.example:5000/team/app:v1"
    assert pull.tokens == bool(auth.get("identity_token") or auth.get("registry_token"))
    creds = credentials_of(pull, "reg.example:5000")
    assert (None if creds is None else (creds.username, creds.password)) == expected
    assert "p ä:ss" not in repr(pull) and "p ä:ss" not in repr(creds)


def test_image_names_of_status_and_list_replies():
    from snapshotter.criproxy import image_names
    from tests.cri import api_pb2

    one = api_pb2.Image(id="sha256:1", repo_tags=["r/a:v1", "r/a:v2"], repo_digests=["r/a@sha256:9"], size=3)
    two = api_pb2.Image(id="sha256:2", repo_tags=["r/b:v1"])
    assert image_names(api_pb2.ImageStatusResponse(image=one, info={"k": "v"}).SerializeToString()) == [
        "r/a:v1", "r/a:v2", "r/a@sha256:9"]
    assert image_names(api_pb2.ListImagesResponse(images=[one, two]).SerializeToString()) == [
        "r/a:v1", "r/a:v2", "r/a@sha256:9", "r/b:v1"]
    assert image_names(b"") == []


def test_the_message_reader_accepts_or_refuses_any_bytes():
    """h11's rule: accepted, or ValueError (the proxy then forwards the request unread)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from snapshotter.criproxy import fields, image_names, parse_pull

    @settings(max_examples=400, deadline=None)
    @given(st.binary(max_size=200) | st.builds(lambda b, i: _pull_request("h/r:t", username="u")[:i] + b,
                                                st.binary(max_size=20), st.integers(0, 40)))
    def check(data: bytes) -> None:
        for parse in (fields, parse_pull, image_names):
            try:
                parse(data)
            except ValueError:
                pass

    check()
