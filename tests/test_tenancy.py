"""A closed swarm (issue 10, tests 4 and 5): who may get which bytes from the region, its
tracker and the peers, with real processes.

Test 4 runs in the network lab of tests/test_p2p_swarm.py (tests/lab/netlab.py): a hub
namespace with Debian's docker-registry behind a token server that grants scopes per
repository (tests/conftest.py TokenServer), and a real `shoal region` (HTTPS with its own
CA, the node token, SSL torrents); real `shoal node`s in namespaces of their own, each
with its own registry credentials. A stock libtorrent session stands in for an intruder
that knows a torrent and the seeders' addresses.

Test 5 puts a TCP relay that records every byte between a node's layer file system
(the real `shoal-fs`, through RemoteLayers) and a real `shoal region` on loopback.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

pytest.importorskip("libtorrent", reason="libtorrent is needed for the swarm (shoal[node])")
pytest.importorskip("aiohttp", reason="aiohttp is needed for the region (shoal[node])")

from tests.conftest import TOKEN_ISSUER, TOKEN_SERVICE
from tests.lab import netlab
from tests.services import free_port, stop_process, wait_for

MiB = 1 << 20
REPO = Path(__file__).resolve().parent.parent
ADMIN, ADMIN_PW = "ci-admin", "admin pässword:1"
TENANT, TENANT_PW = "tenant-a", "a secret:2"

# a TokenServer in the hub's namespace, on the hub's address (nodes reach it too)
_TOKEN_SERVER = """
import json, sys, time
from pathlib import Path
from tests.conftest import TokenServer
ts = TokenServer(Path(sys.argv[1]), json.loads(sys.argv[2]), host=sys.argv[3], grants=json.loads(sys.argv[4]))
print(json.dumps({"realm": ts.realm, "cert": str(ts.cert)}), flush=True)
while True:
    time.sleep(3600)
"""

# a stock libtorrent session: argv torrent, save dir, cert, key, dh ("" = none), peers
# (JSON [[ip, port]]), bind ip, seconds; prints the payload bytes it got
_INTRUDER = """
import json, sys, time
import libtorrent as lt
torrent, save, cert, key, dh, peers, ip, seconds = sys.argv[1:9]
s = lt.session({"listen_interfaces": f"{ip}:7881,{ip}:7882s", "enable_dht": False, "enable_lsd": False,
                "enable_upnp": False, "enable_natpmp": False, "allow_multiple_connections_per_ip": True,
                "enable_outgoing_utp": False, "alert_mask": 0x7fffffff})  # the nodes speak TCP only
atp = lt.add_torrent_params()
atp.ti = lt.torrent_info(torrent)
atp.save_path = save
atp.trackers = []
h = s.add_torrent(atp)
if cert:
    h.set_ssl_certificate(cert, key, dh, "")
end = time.monotonic() + float(seconds)
while time.monotonic() < end and not h.status().is_seeding:
    for peer in json.loads(peers):
        h.connect_peer((peer[0], peer[1]))
    time.sleep(0.5)
    for a in s.pop_alerts():
        print(a.message(), file=sys.stderr)
st = h.status()
print(json.dumps({"downloaded": st.total_payload_download, "pieces": st.num_pieces, "seeding": st.is_seeding}))
"""


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _docker_config(folder: Path, host: str, user: str, password: str) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"auths": {host: {"auth": base64.b64encode(
        f"{user}:{password}".encode()).decode()}}}))
    return folder


def _call(lab, host, method: str, url: str, ca: str, headers: dict, body: bytes = b"") -> int:
    """The HTTP status of one request made from inside the host's namespace."""
    code = ("import sys, json, ssl, urllib.request, urllib.error\n"
            "ctx = ssl.create_default_context(cafile=sys.argv[1])\n"
            "req = urllib.request.Request(sys.argv[3], method=sys.argv[2], headers=json.loads(sys.argv[4]),"
            " data=sys.argv[5].encode() or None)\n"
            "try:\n    print(urllib.request.urlopen(req, timeout=20, context=ctx).status)\n"
            "except urllib.error.HTTPError as e:\n    print(e.code)\n")
    out = lab.run(host, [sys.executable, "-c", code, ca, method, url, json.dumps(headers), body.decode()],
                  timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip())


@pytest.fixture
def lab_world(tmp_path_factory):
    reason = netlab.available()
    if reason:
        pytest.skip(reason)
    if not os.access(netlab.REGISTRY_BIN, os.X_OK) or not os.path.exists("/dev/fuse"):
        pytest.skip("needs docker-registry and /dev/fuse")
    work = tmp_path_factory.mktemp("tenancy")
    short = Path(tempfile.mkdtemp(prefix="shtn-", dir="/tmp"))  # unix socket paths stay short
    lab = netlab.Lab()
    nodes: list[netlab.LabNode] = []
    try:
        yield lab, work, short, nodes
    finally:
        netlab.stop_nodes(lab, nodes)
        for node in nodes:
            node.unmount()
        lab.close()
        import shutil

        shutil.rmtree(short, ignore_errors=True)


def _image(lab, registry, region, work: Path, name: str, seed: int, sizes: dict[str, int]):
    from builder.convert import convert
    from tests.lab.fromdir import build_image

    root = work / name.replace("/", "_")
    tree = root / "tree"
    tree.mkdir(parents=True)
    files = {}
    for i, (fname, size) in enumerate(sizes.items()):
        data = random.Random(seed * 100 + i).randbytes(size)
        (tree / fname).write_bytes(data)
        files[fname] = hashlib.sha256(data).hexdigest()
    build_image([str(tree)], f"oci:{root}/plain", compression="none", workdir=str(root))
    convert(f"oci:{root}/plain", f"oci:{root}/chunked")
    image = netlab.publish_image(lab, registry, region, root / "chunked", f"{name}:v1",
                                 authorization=_basic(ADMIN, ADMIN_PW))
    return image, files


def test_a_tenant_gets_only_the_repositories_the_origin_grants_it(lab_world, docker_config):
    """(4) Repositories tenant/a and tenant/b are private; the token server grants user
    tenant-a scopes on tenant/a only. A node with tenant-a's credentials reads A's files
    through FUSE with A's pieces from a peer, but gets neither B's metadata, nor B's bytes
    from the region, nor a peer certificate for B, nor B's pieces from the peer that
    seeds them (not even with the certificate it holds for A). A node without the
    region's node token can neither announce, scrape, rank nor fetch metadata, and a
    stock libtorrent client that knows the torrent and the seeder's addresses but has no
    certificate of the region's gets no byte."""
    lab, work, short, started = lab_world
    users = {ADMIN: ADMIN_PW, TENANT: TENANT_PW}
    tokens = lab.popen(lab.hub, [sys.executable, "-c", _TOKEN_SERVER, str(work), json.dumps(users), netlab.HUB_IP,
                                 json.dumps({TENANT: ["tenant/a"]})],
                       stdout=subprocess.PIPE, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    token = json.loads(netlab.read_line(tokens, 30))
    registry = netlab.start_registry(lab, work, auth={"token": {
        "realm": token["realm"], "service": TOKEN_SERVICE, "issuer": TOKEN_ISSUER, "rootcertbundle": token["cert"]}})
    docker_config.login(registry.host, ADMIN, ADMIN_PW)  # the CI step that pushes
    region = netlab.start_region(lab, work, registry)
    image_a, files_a = _image(lab, registry, region, work, "tenant/a/img", 1, {"a.bin": 3 * MiB, "b.bin": MiB})
    image_b, _ = _image(lab, registry, region, work, "tenant/b/img", 2, {"c.bin": 3 * MiB})
    [layer_a], [layer_b] = image_a.layers, image_b.layers
    hosts = [lab.add_node() for _ in range(3)]

    admin_cfg = _docker_config(work / "admin-docker", registry.host, ADMIN, ADMIN_PW)
    tenant_cfg = _docker_config(work / "tenant-docker", registry.host, TENANT, TENANT_PW)
    wrong_token = work / "wrong-token"
    wrong_token.write_text("not the region's token\n")

    def start(host, cfg, **kwargs):
        out = netlab.start_nodes(lab, [host], Path(tempfile.mkdtemp(dir=short)), region, registry,
                                 env={"DOCKER_CONFIG": str(cfg)}, **kwargs)
        started.extend(out)
        return out[0]

    seeder = start(hosts[0], admin_cfg)
    tenant = start(hosts[1], tenant_cfg)
    outsider = start(hosts[2], admin_cfg, fetch={"region_token_file": str(wrong_token)})

    # the seeder (whose credentials read both repositories) holds both blobs
    for image in (image_a, image_b):
        seeder.provide(lab, image)
        seeder.download(image.layers[0]["digest"])
    seeds = [[seeder.host.ip, 6881], [seeder.host.ip, 6882]]  # plain and SSL listen ports

    # the tenant reads A through its mount, from the peer
    [mount_a] = tenant.provide(lab, image_a)
    assert {n: netlab.sha256_file(mount_a / n) for n in files_a} == files_a
    f = tenant.status()["fetch"]
    assert f["bytes_from_peers"] >= 0.9 * layer_a["size"], f

    # ... and nothing of B: not its metadata, its region bytes or a certificate
    node_token = {"X-Shoal-Node-Token": region.token}
    tenant_auth = {"Authorization": _basic(TENANT, TENANT_PW), **node_token}
    q_b = f"?repo={image_b.repository}&ns={registry.host}"
    q_a = f"?repo={image_a.repository}&ns={registry.host}"
    assert _call(lab, tenant.host, "GET", f"{region.url}/p2p/v1/torrents/{layer_b['digest']}{q_b}", region.ca,
                 tenant_auth) in (401, 403)
    assert _call(lab, tenant.host, "GET", f"{region.url}/v2/{image_b.repository}/blobs/{layer_b['digest']}",
                 region.ca, {**tenant_auth, "Range": "bytes=0-99"}) in (401, 403)
    assert _call(lab, tenant.host, "POST", f"{region.url}/p2p/v1/certs/{layer_b['digest']}{q_b}", region.ca,
                 tenant_auth, b"-") in (401, 403)
    # (the same calls for A are allowed: the refusals are about B)
    assert _call(lab, tenant.host, "GET", f"{region.url}/p2p/v1/torrents/{layer_a['digest']}{q_a}", region.ca,
                 tenant_auth) == 200
    assert _call(lab, tenant.host, "GET", f"{region.url}/v2/{image_a.repository}/blobs/{layer_a['digest']}",
                 region.ca, {**tenant_auth, "Range": "bytes=0-99"}) == 206

    # ... nor B's pieces from the seeder, with the certificate the region gave it for A
    torrents = work / "torrents"
    torrents.mkdir()
    (torrents / "a.torrent").write_bytes(image_a.torrents[layer_a["digest"]])
    (torrents / "b.torrent").write_bytes(image_b.torrents[layer_b["digest"]])
    certs = tenant.root / "swarm" / "certs"
    cert_a = certs / f"sha256-{layer_a['digest'][7:]}.pem"
    assert cert_a.exists() and oct(certs.stat().st_mode & 0o777) == "0o700"

    def intruder(host, torrent: str, cert: Path | None, seconds: float) -> dict:
        save = Path(tempfile.mkdtemp(dir=work))
        out = lab.run(host, [sys.executable, "-c", _INTRUDER, str(torrents / torrent), str(save),
                             str(cert or ""), str(certs / "peer.key") if cert else "",
                             str(certs / "dh.pem") if cert else "", json.dumps(seeds), host.ip, str(seconds)],
                      timeout=seconds + 60, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr[-2000:]
        log = work / f"intruder-{torrent}-{host.ns}-{'cert' if cert else 'none'}.log"
        log.write_text(out.stderr)  # libtorrent's own log of every connection
        return {**json.loads(out.stdout.strip().splitlines()[-1]), "log": str(log)}

    # (run beside the outsider's node: the seeder takes one connection per address and
    # torrent, and the tenant's own node holds A's)
    got = intruder(outsider.host, "b.torrent", cert_a, 8)
    assert got["downloaded"] == 0 and got["pieces"] == 0, got

    # the outsider (no node token): no tracker, no metadata; no certificate, no pieces
    admin_auth = {"Authorization": _basic(ADMIN, ADMIN_PW), "X-Shoal-Node-Token": "not the region's token"}
    ih = "%01" * 20
    for url in (f"{region.url}/p2p/v1/announce?info_hash={ih}&port=6881&left=1",
                f"{region.url}/p2p/v1/scrape?info_hash={ih}", f"{region.url}/p2p/v1/rank?info_hash={ih}",
                f"{region.url}/p2p/v1/torrents/{layer_a['digest']}{q_a}"):
        assert _call(lab, outsider.host, "GET", url, region.ca, admin_auth) == 401, url
    assert _call(lab, outsider.host, "POST", f"{region.url}/p2p/v1/certs/{layer_a['digest']}{q_a}", region.ca,
                 admin_auth, b"-") == 401
    got = intruder(outsider.host, "a.torrent", None, 8)
    assert got["downloaded"] == 0 and got["pieces"] == 0, got
    # the same client does work: with a certificate the region issued for A, it gets A
    got = intruder(outsider.host, "a.torrent", cert_a, 30)
    assert got["seeding"], got
    # the outsider's own node reads A (region and origin check its registry credentials), never from peers
    [mount_o] = outsider.provide(lab, image_a)
    assert {n: netlab.sha256_file(mount_o / n) for n in files_a} == files_a
    f = outsider.status()["fetch"]
    assert f["bytes_from_peers"] == 0 and f["bytes_from_region"] > 0, f
    swarm = region.status(lab)["swarm"]
    assert swarm["unauthorized"] >= 6 and swarm["certs_refused"] >= 1, swarm


# --- test 5: no registry password in clear -------------------------------------------------------


class Recorder:
    """A TCP relay on 127.0.0.1 to `target`: forwards both ways and keeps every byte."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.data = bytearray()
        self._lock = threading.Lock()
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while chunk := src.recv(65536):
                with self._lock:
                    self.data += chunk
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._sock.close()
        for s in self._conns:
            s.close()


def _start_region(tmp_path: Path, origin: str, *extra: str) -> tuple[subprocess.Popen, int, Path]:
    port = free_port()
    log_path = tmp_path / f"region-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "region", "--listen", f"127.0.0.1:{port}",
                                 "--origin", origin, "--store", str(tmp_path / f"store-{port}"), *extra],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, cwd=REPO)
    line = proc.stdout.readline().decode()
    assert "serving" in line, log_path.read_text()
    return proc, port, tmp_path / f"store-{port}"


@pytest.mark.parametrize("transport", ["https", "plain-http"])
def test_no_registry_password_crosses_the_wire_in_clear(basic_registry, tmp_path, docker_config, transport):
    """(5) A node reads a private image's lazy layer through the region while a relay
    records every byte between them: neither the registry password nor the base64 of
    user:password is in it. Over HTTPS (the default) the node's reads come from the
    region; to a plain-HTTP region the node sends no credentials at all (one warning),
    so the private blob is refused there and comes from the origin."""
    from snapshotter.remote import RemoteLayers
    from tests.test_lazy_fs import prepare_tree

    reg = basic_registry
    docker_config.login(reg.host, reg.username, reg.password)
    tree = tmp_path / "tree"
    tree.mkdir()
    data = random.Random(5).randbytes(2 * MiB)
    (tree / "model.bin").write_bytes(data)
    extra = ("--plain-http",) if transport == "plain-http" else ()
    region, port, store = _start_region(tmp_path, reg.url, *extra)
    relay = Recorder(("127.0.0.1", port))
    config = {"region_url": f"{'https' if transport == 'https' else 'http'}://127.0.0.1:{relay.port}"}
    if transport == "https":
        config["region_ca"] = str(store / "tls" / "ca.pem")
    layers = RemoteLayers(str(tmp_path / "node root"), config)
    mounts: list[str] = []
    try:
        (tmp_path / "build").mkdir()
        mount, _ = prepare_tree(layers, reg.host, "private/model", tree, tmp_path / "build")
        mounts.append(str(mount))
        assert (mount / "model.bin").read_bytes() == data
        sources = layers.fs.status()["store"]["sources"]
        wait_for(lambda: relay.data, "bytes through the relay", timeout=10)
    finally:
        for m in mounts:
            subprocess.run(["umount", m], check=False)
        layers.fs.stop()
        relay.close()
        stop_process(region)
        region.stdout.close()
    wire = bytes(relay.data)
    secret = reg.password.encode()
    encoded = base64.b64encode(f"{reg.username}:{reg.password}".encode())
    assert secret not in wire and encoded not in wire and b"authorization:" not in wire.lower()
    if transport == "https":
        assert sources["region"]["bytes"] > 0, sources  # the region served, over TLS
        assert b"GET /v2/" not in wire  # nothing readable at all
    else:
        assert b"GET /v2/private/model/blobs/" in wire  # the relay saw the requests in clear ...
        assert sources["origin"]["bytes"] > 0, sources  # ... refused without credentials: from the origin
        log = (tmp_path / "node root" / "logs" / "fs.log").read_text()
        assert "registry credentials are not sent" in log
