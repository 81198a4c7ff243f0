"""The region's preheat API: `shoal prefetch REF --region URL --nodes ...` warms an image on
the named nodes through their own warm-up, measured by each node and reported to the
region; the nodes are known to the region by their registration and long poll.

Real parts: Debian's registry (its access log counts what the origin served), `shoal
region` (HTTPS, its own CA and tokens), two `shoal node`s each with Debian's containerd
(their `[fetch] region_url` the region, `[node] name` n1 and n2), `shoal prefetch` as the
job-launch hook calls it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import requests

from snapshotter.embedded import stop_process
from tests.rootfs import lazy_app_image
from tests.services import SHOAL, shoal_node_with_containerd, start_region, wait_for

pytestmark = [pytest.mark.registry, pytest.mark.containerd]

CMD = ["/bin/sh", "-c", "cat /etc/motd; /usr/bin/python3 -c 'import json, email; print(json.dumps([6 * 7]))'"]
NODE_TIMEOUT = 4.0  # the region's [prefetch] node_timeout here: a silent node is down after it
HOLD_AFTER_JOB = 10.0  # the region's [prefetch] hold_after_job here
TOKEN = "X-Shoal-Prefetch-Token"


class Region:
    def __init__(self, proc, url: str, ca: str, store: Path) -> None:
        self.proc, self.url, self.ca, self.store = proc, url, ca, store
        self.token_file = store / "tls" / "prefetch-token"
        self.node_token_file = store / "tls" / "node-token"
        self.token = self.token_file.read_text().strip()

    def api(self, method: str, tail: str, token: str | None = None, **kwargs) -> requests.Response:
        headers = {TOKEN: self.token if token is None else token, **kwargs.pop("headers", {})}
        return requests.request(method, f"{self.url}/prefetch/v1{tail}", headers=headers, verify=self.ca,
                                timeout=30, **kwargs)

    def status(self) -> dict:
        return requests.get(f"{self.url}/-/status", verify=self.ca, timeout=10).json()

    def nodes(self) -> dict[str, dict]:
        return {n["name"]: n for n in self.api("GET", "/nodes").json()["nodes"]}


def region_for(registry, workdir: Path) -> Region:
    store = workdir / "region store"
    proc, url, ca = start_region(registry.url, store, workdir / "region.log",
                                 config=f"[prefetch]\nnode_timeout = {NODE_TIMEOUT}\n"
                                        f"hold_after_job = {HOLD_AFTER_JOB}\n")
    return Region(proc, url, ca, store)


def node_config(region: Region, name: str) -> str:
    return (f'[fetch]\nregion_url = "{region.url}"\nregion_ca = "{region.ca}"\n'
            f'region_token_file = "{region.node_token_file}"\n[node]\nname = "{name}"\n')


def shoal(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([SHOAL, *args], check=False, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def fleet(module_registry, tmp_path_factory):
    """The region and two registered nodes (with containerd): (region, {name: (node, ctd)})."""
    workdir = tmp_path_factory.mktemp("preheat")
    region = region_for(module_registry, workdir)
    try:
        with shoal_node_with_containerd("shoal-ph1-", node_config(region, "n1")) as n1, \
                shoal_node_with_containerd("shoal-ph2-", node_config(region, "n2")) as n2:
            wait_for(lambda: {"n1", "n2"} <= {n for n, v in region.nodes().items() if v["state"] == "up"},
                     "both nodes registered")
            yield region, {"n1": n1, "n2": n2}
    finally:
        stop_process(region.proc)
        region.proc.stdout.close()


def prefetch(region: Region, ref: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return shoal("prefetch", ref, "--region", region.url, "--ca", region.ca, "--token-file", str(region.token_file),
                 *args, env=env)


def lazy_start(registry, manifest, ref, node_ctd, name: str) -> tuple[str, dict]:
    """`shoal pull` + `ctr run` on a node: (the output, where the node's bytes came from during it)."""
    node, ctd = node_ctd
    before = json.loads(shoal("status", "--root", str(node.root), "--json").stdout)["fetch"]
    pulled = shoal("pull", ref, "--address", ctd.address, "--namespace", "shoal-test", "--json")
    assert pulled.returncode == 0, pulled.stderr
    assert [ly["kind"] for ly in json.loads(pulled.stdout)["layers"]] == ["lazy"] * 3
    out = ctd.ctr("run", "--rm", "--snapshotter", "shoal", ref, name, *CMD).stdout
    after = json.loads(shoal("status", "--root", str(node.root), "--json").stdout)["fetch"]
    return out, {k: after[k] - before[k] for k in ("bytes_from_origin", "bytes_from_region", "bytes_from_store")}


def test_full_and_profile_jobs_are_ready_at_one_origin_copy_and_starts_read_nothing_from_the_origin(
        module_registry, fleet, tmp_path):
    region, nodes = fleet
    registry = module_registry
    ref, manifest = lazy_app_image(registry, tmp_path / "full", "preheat/full", CMD)[1:]
    size = sum(ly["size"] for ly in manifest["layers"])
    before = registry.layer_bytes(manifest)
    proc = prefetch(region, ref, "--nodes", "n1,n2", "--mode", "full", "--wait", "--timeout", "180", "--json")
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)
    assert job["state"] == "ready" and job["mode"] == "full" and job["image"] == ref
    assert job["manifest"].startswith("sha256:") and job["ready_nodes"] == 2
    assert [n["name"] for n in job["nodes"]] == ["n1", "n2"]
    for n in job["nodes"]:
        assert n["state"] == "warm" and n["error"] is None and n["warm_bytes"] == n["target_bytes"] > 1_000_000
    target = job["nodes"][0]["target_bytes"]
    origin = registry.layer_bytes(manifest) - before
    print(f"full job: target {target} B per node, blobs {size} B, origin served {origin} B "
          f"({origin / target:.3f}x the target), job origin_bytes {job['origin_bytes']}")
    assert target <= origin <= 1.05 * target  # one copy for both nodes
    assert 0 < job["origin_bytes"] <= 1.05 * size
    # region egress: each node took its copy from the region (no swarm here), TOCs included
    # (what a node's TOC read shares with its chunk reads, the region serves once)
    print(f"full job: region served {job['region_bytes']} B to 2 nodes")
    assert 2 * 0.99 * target <= job["region_bytes"] <= 2 * 1.05 * size
    # the nodes say so too: shoal status per image and the metric per image digest
    status = json.loads(shoal("status", "--root", str(nodes["n1"][0].root), "--json").stdout)
    (im,) = [i for i in status["images"] if i["manifest"] == job["manifest"]]
    assert im["warm_bytes"] == im["target_bytes"] == target and im["mode"] == "full"
    text = shoal("status", "--root", str(nodes["n1"][0].root)).stdout
    assert f"{job['manifest']}  {ref}  full: {target:,} of {target:,} B warm" in text
    from shoal.metrics import parse
    from snapshotter.status import node_metrics, node_status

    metrics = parse(node_metrics(node_status(str(nodes["n2"][0].root))))
    assert metrics[f'shoal_node_image_warm_bytes{{manifest="{job["manifest"]}"}}'] == target
    assert metrics[f'shoal_node_image_target_bytes{{manifest="{job["manifest"]}"}}'] == target
    for name, node_ctd in nodes.items():
        out, fetched = lazy_start(registry, manifest, ref, node_ctd, f"ph-full-{name}")
        assert out.rstrip().endswith("[42]")
        assert fetched["bytes_from_origin"] == 0, fetched
        assert fetched["bytes_from_region"] <= 0.01 * target, fetched  # almost none (TOCs are loaded already)
    assert registry.layer_bytes(manifest) - before == origin

    # profile mode: a profile recorded on a node of its own (not of the region), then a job for both
    ref2, manifest2 = lazy_app_image(registry, tmp_path / "profile", "preheat/profile", CMD, salt="profile")[1:]
    with shoal_node_with_containerd("shoal-phr-") as recorder:
        out_first, _ = lazy_start(registry, manifest2, ref2, recorder, "ph-record")
        saved = shoal("profile", "save", ref2, "--root", str(recorder[0].root), "--push", "--json")
        assert saved.returncode == 0, saved.stderr
    before = registry.layer_bytes(manifest2)
    proc = prefetch(region, ref2, "--nodelist", "n[1-2]", "--wait", "--timeout", "180", "--json")
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)
    assert job["state"] == "ready" and job["mode"] == "profile" and job["ready_nodes"] == 2
    full = sum(ly["size"] for ly in manifest2["layers"])
    for n in job["nodes"]:
        assert n["state"] == "warm" and 0 < n["warm_bytes"] == n["target_bytes"] < full / 2
    target = job["nodes"][0]["target_bytes"]
    print(f"profile job: target {target} B per node, blobs {full} B, origin bytes during the job "
          f"{job['origin_bytes']} B ({job['origin_bytes'] / target:.3f}x the target)")
    # while the job ran the region fetched the ranges the nodes read, once for both (here,
    # where the nodes' stores have most chunks of the image from the full job already: the
    # TOCs and the salted files; test_region.py has the region's side with every range cold)
    assert 0 < job["origin_bytes"] <= 1.05 * target
    # the job's end lets the starts go: its blobs stay held a while (hold_after_job), no
    # whole-blob fill competes with them
    st = region.status()
    assert st["fills_holding"] >= 1 and st["fills_running"] == 0, st
    # then the region fills the blobs whole (taking what it has): about one copy in all
    wait_for(lambda: region.status()["fills_running"] == 0 and region.status()["fills_holding"] == 0,
             "the region's fills after the job", timeout=120)
    origin = registry.layer_bytes(manifest2) - before
    print(f"profile job: origin served {origin} B in all once the region's fills were done")
    assert full <= origin <= full + 1.05 * target
    for name, node_ctd in nodes.items():
        out, fetched = lazy_start(registry, manifest2, ref2, node_ctd, f"ph-profile-{name}")
        assert out == out_first and fetched["bytes_from_origin"] == 0, fetched


def test_an_unregistered_node_and_a_node_killed_mid_warm_up_are_named_not_warm(module_registry, fleet, tmp_path):
    region, _ = fleet
    ref = lazy_app_image(module_registry, tmp_path / "img", "preheat/killed", CMD, salt="killed")[1]
    with shoal_node_with_containerd("shoal-ph3-", node_config(region, "n3")) as (n3, _):
        wait_for(lambda: region.nodes().get("n3", {}).get("state") == "up", "n3 registered")
        from snapshotter.fs.client import FSClient

        fs = FSClient(str(n3.root))
        assert fs.running() and fs.pid
        fs_pid = fs.pid
        os.kill(fs_pid, signal.SIGSTOP)  # n3's warm-up cannot get anywhere: it is killed in the middle
        try:
            hook = subprocess.Popen(
                [SHOAL, "prefetch", ref, "--region", region.url, "--ca", region.ca, "--token-file",
                 str(region.token_file), "--nodes", "n1,ghost,n3", "--mode", "full", "--wait", "--timeout", "20"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                wait_for(lambda: "preheat job" in n3.log() and "warming" in n3.log(), "n3 took the job", 30)
                n3.kill()
                _, err = hook.communicate(timeout=120)
            finally:
                stop_process(hook)
        finally:
            os.kill(fs_pid, signal.SIGCONT)
        assert hook.returncode == 1, err
        line = err.strip().splitlines()[-1]
        assert line.startswith(f"shoal prefetch: {ref}: job ") and " timeout: 2 of 3 nodes not warm: " in line
        assert "ghost (unknown: not registered with the region" in line
        assert "n3 (down: stopped answering" in line and "n1 (" not in line
        assert "Traceback" not in err
        assert region.nodes()["n3"]["state"] == "down"
    # a node that registers again is up again (n1 was never down)
    assert region.nodes()["n1"]["state"] == "up"


def test_a_node_that_stops_is_down_at_once_and_a_job_names_it(module_registry, fleet, tmp_path):
    """A `shoal node` stopped with SIGTERM tells the region (DELETE /nodes/NAME, its
    worker's last call): listed down at once, not NODE_TIMEOUT later, and a job naming it
    says it stopped."""
    region, _ = fleet
    ref = lazy_app_image(module_registry, tmp_path / "img", "preheat/stopped", CMD, salt="stopped")[1]
    with shoal_node_with_containerd("shoal-ph4-", node_config(region, "n4")) as (n4, _):
        wait_for(lambda: region.nodes().get("n4", {}).get("state") == "up", "n4 registered")
        assert n4.stop() == 0
        assert region.nodes()["n4"]["state"] == "down"  # at once: its last poll ended less than NODE_TIMEOUT ago
        assert "node n4 stopped (it said so)" in (region.store.parent / "region.log").read_text()
        made = prefetch(region, ref, "--nodes", "n4", "--mode", "full", "--wait", "--timeout", "3", "--json")
        assert made.returncode == 1, made.stderr
        assert "1 of 1 nodes not warm: n4 (down: its shoal node stopped" in made.stderr.strip().splitlines()[-1]
        (n,) = json.loads(made.stdout)["nodes"]
        assert n["state"] == "down" and "its shoal node stopped" in n["error"] and "it said so" in n["error"], n
        assert "Traceback" not in made.stderr


def test_a_job_for_an_image_the_caller_may_not_read_is_refused_with_the_origins_answer(
        registry_factory, docker_config, tmp_path):
    from builder.oci.refs import open_destination, open_source
    from tests.imagetools import copy_image, make_image, write_layout

    private = registry_factory(auth="htpasswd")
    image = make_image([{"etc/motd": "private\n"}])
    layout = write_layout(tmp_path / "layout", {"v1": image.manifest}, [image])
    docker_config.login(private.host, private.username, private.password)
    ref = f"{private.host}/team/secret:v1"
    with open_source(f"oci:{layout}:v1") as s, open_destination(f"docker://{ref}", plain_http=True) as d:
        copy_image(s, d, tmp_path)
    region = region_for(private, tmp_path)
    try:
        seen = len(private.requests())
        wrong = tmp_path / "wrong"
        wrong.mkdir()
        (wrong / "config.json").write_text(json.dumps({"auths": {private.host: {
            "auth": __import__("base64").b64encode(b"shoal-user:wrong").decode()}}}))
        for env in ({"DOCKER_CONFIG": str(wrong)}, {"DOCKER_CONFIG": str(tmp_path / "nobody")}):
            proc = prefetch(region, ref, "--nodes", "n1", "--wait", env=env)
            assert proc.returncode == 1, proc.stderr
            assert "HTTP 401: the origin refuses access to team/secret" in proc.stderr
            assert len(proc.stderr.strip().splitlines()) == 1
        resp = region.api("POST", "/jobs", json={"image": ref, "nodes": ["n1"]})
        assert resp.status_code == 401 and "WWW-Authenticate" in resp.headers
        assert region.api("GET", "/jobs").json()["jobs"] == []  # no job made
        assert not [r for r in private.requests()[seen:] if "/blobs/" in r.uri]  # nothing fetched
        assert region.status()["origin_bytes"] == 0
        # the right credentials make the job (no node of that name: it waits for one)
        ok = prefetch(region, ref, "--nodes", "n1", "--json")
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["manifest"] == image.digest
    finally:
        stop_process(region.proc)
        region.proc.stdout.close()


@pytest.mark.parametrize(("body", "reason"), [
    ({"image": "IMAGE", "nodes": ["n1"], "mode": "lazy"}, "mode 'lazy': want one of profile, full"),
    ({"image": "IMAGE", "nodes": []}, "nodes: want a non-empty list of node names"),
    ({"image": "IMAGE", "nodes": ["n[1-2]"]}, "nodes: 'n[1-2]' is not a node name"),
    ({"image": "IMAGE", "nodes": ["n1"], "timeout_s": 1e12}, "timeout_s 1e+12: must be more than 0"),
    ({"image": "IMAGE", "nodes": ["n1"], "timeout_s": True}, "timeout_s True: must be more than 0"),
    ({"image": "IMAGE", "nodes": ["n1"], "ready_fraction": 0}, "ready_fraction 0: must be more than 0"),
    ({"image": "IMAGE", "nodes": ["n1"], "colour": "red"}, "unknown field 'colour'"),
    ({"image": "other.example:5000/x:y", "nodes": ["n1"]}, "this region serves another registry"),
    ({"image": "not a ref", "nodes": ["n1"]}, "image 'not a ref'"),
    (["n1"], "the body must be a JSON object"),
])
def test_bad_job_requests_are_4xx_with_one_line(module_registry, fleet, body, reason):
    region, _ = fleet
    if isinstance(body, dict) and body.get("image") == "IMAGE":
        body = {**body, "image": f"{module_registry.host}/preheat/none:x"}
    resp = region.api("POST", "/jobs", json=body)
    assert resp.status_code == 400, resp.text
    assert reason in resp.json()["error"] and "\n" not in resp.json()["error"]


def test_the_api_needs_its_token_and_names_what_is_missing(module_registry, fleet):
    region, _ = fleet
    assert region.api("GET", "/jobs", token="wrong").status_code == 401
    assert region.api("POST", "/jobs", token="", json={}).json()["error"] == \
        "the preheat API needs X-Shoal-Prefetch-Token"
    assert region.api("GET", "/nodes/n1/work", token="").status_code == 401  # the node token, not this one
    resp = region.api("GET", "/jobs/0123456789abcdef")
    assert resp.status_code == 404 and resp.json()["error"] == "no preheat job '0123456789abcdef'"
    assert region.api("DELETE", "/jobs/nope").status_code == 404
    assert region.api("POST", "/jobs", data=b"{not json").json()["error"] == "the body is not JSON"
    missing = region.api("POST", "/jobs", json={"image": f"{module_registry.host}/preheat/none:x", "nodes": ["n1"]})
    assert missing.status_code == 404 and "is not at the origin" in missing.json()["error"]


@pytest.mark.parametrize(("args", "code", "message"), [
    (["--nodes", "n1", "--mode", "lazy"], 2, "invalid choice: 'lazy'"),
    (["--nodelist", "n[1-"], 2, "'[' without ']'"),
    (["--nodelist", ",,"], 2, "the node list is empty"),
    (["--nodes", "n1", "--timeout", "1e12"], 2, "--timeout 1e+12: must be more than 0"),
    (["--nodes", "n1", "--ready", "2"], 2, "--ready 2: must be more than 0 and at most 1"),
    (["--nodes", "n1", "--token-file", "/nonexistent"], 1, "region token file /nonexistent"),
])
def test_cli_bad_input_exits_2_or_1_with_one_line(fleet, module_registry, args, code, message):
    region, _ = fleet
    proc = shoal("prefetch", f"{module_registry.host}/preheat/none:x", "--region", region.url, "--ca", region.ca,
                 *(["--token-file", str(region.token_file)] if "--token-file" not in args else []), *args)
    assert proc.returncode == code, proc.stderr
    lines = [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith(("usage:", " "))]  # (argparse's usage)
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_cancel_and_a_job_without_wait(module_registry, fleet, tmp_path):
    """Without --wait the hook returns the job as made; DELETE cancels it, and the nodes are told."""
    region, _ = fleet
    ref = lazy_app_image(module_registry, tmp_path, "preheat/cancel", CMD)[1]
    proc = prefetch(region, ref, "--nodes", "n1,absent", "--timeout", "60", "--json")
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)
    assert job["state"] in ("pending", "running")
    gone = region.api("DELETE", f"/jobs/{job['id']}").json()
    assert gone["state"] == "cancelled"
    time.sleep(1)
    assert region.api("GET", f"/jobs/{job['id']}").json()["state"] == "cancelled"
    # on a terminal, --wait shows its progress (on stderr; the result line on stdout)
    import pty

    leader, follower = pty.openpty()
    try:
        again = subprocess.run([SHOAL, "prefetch", ref, "--region", region.url, "--ca", region.ca, "--token-file",
                                str(region.token_file), "--nodes", "n1", "--mode", "full", "--wait"],
                               stdout=subprocess.PIPE, stderr=follower, text=True, timeout=180, check=False)
        shown = os.read(leader, 65536).decode(errors="replace")
    finally:
        os.close(leader)
        os.close(follower)
    assert again.returncode == 0 and " ready (full): 1 of 1 nodes warm" in again.stdout
    assert f"{ref}: " in shown and "nodes warm (need 1)" in shown
    # a long node list fits one request (the API's limit is the node count)
    many = [f"gpu{i:06d}" for i in range(100_000)]
    resp = region.api("POST", "/jobs", json={"image": ref, "nodes": many, "timeout_s": 1})
    assert resp.status_code == 201, resp.text
    resp = region.api("POST", "/jobs", json={"image": ref, "nodes": [*many, "one-more"]})
    assert resp.status_code == 400 and resp.json()["error"] == "nodes: 100001 names, at most 100000"


def test_ready_fraction_counts_warm_nodes_and_never_one_for_all(module_registry, fleet, tmp_path):
    region, _ = fleet
    ref = lazy_app_image(module_registry, tmp_path, "preheat/fraction", CMD, salt="fraction")[1]
    half = prefetch(region, ref, "--nodes", "n1,ghost", "--ready", "0.5", "--mode", "full", "--wait", "--json",
                    "--timeout", "120")
    assert half.returncode == 0, half.stderr
    job = json.loads(half.stdout)
    assert job["state"] == "ready" and job["ready_nodes"] == 1 and job["needed_nodes"] == 1
    assert {n["name"]: n["state"] for n in job["nodes"]} == {"n1": "warm", "ghost": "unknown"}
    # n1 is warm now: with the default fraction (1.0) one warm node of two is not ready
    proc = prefetch(region, ref, "--nodes", "n1,ghost", "--mode", "full", "--wait", "--json", "--timeout", "3")
    assert proc.returncode == 1
    job = json.loads(proc.stdout)
    assert job["state"] == "timeout" and job["ready_nodes"] == 1 and job["needed_nodes"] == 2
    assert "1 of 2 nodes not warm: ghost (unknown: not registered" in proc.stderr


def node_call(region: Region, name: str, token: str, tail: str = "") -> requests.Response:
    """A node's call to the preheat service: its registration, or (tail "/work") its poll."""
    method, body = ("GET", None) if tail else ("POST", {"address": "192.0.2.7", "version": "test"})
    return requests.request(method, f"{region.url}/prefetch/v1/nodes/{name}{tail}", json=body,
                            headers={"X-Shoal-Node-Token": token}, verify=region.ca, timeout=30)


def own_token(region: Region, registry, name: str) -> str:
    made = shoal("region", "--store", str(region.store), "--origin", registry.url, "--node-token", name)
    assert made.returncode == 0, made.stderr
    return made.stdout.strip()


def test_a_nodes_own_token_speaks_for_it_alone(module_registry, fleet, tmp_path):
    """A node's own token (`shoal region --node-token NAME`, made from the region's node
    secret) registers NAME and polls for NAME's work, never another name's; a forged one is
    refused, by the preheat service and the swarm's; a real node with its own token
    registers and is up."""
    region, _ = fleet
    own = own_token(region, module_registry, "n7")
    assert own.startswith("shoal-node:n7:") and own != region.node_token_file.read_text().strip()
    assert node_call(region, "n7", own).status_code == 200
    other = node_call(region, "n8", own)
    assert other.status_code == 403
    assert other.json()["error"] == "this node token is node n7's: it cannot speak for node n8"
    assert node_call(region, "n8", own, "/work").status_code == 403
    mac = own.rsplit(":", 1)[1]
    forged = f"shoal-node:n7:{'0' * len(mac) if mac[0] != '0' else '1' * len(mac)}"
    assert node_call(region, "n7", forged).status_code == 401
    assert node_call(region, "n8", f"shoal-node:n8:{mac}").status_code == 401  # another name, n7's mac
    swarm = f"{region.url}/p2p/v1/status"
    assert requests.get(swarm, headers={"X-Shoal-Node-Token": own}, verify=region.ca, timeout=30).status_code == 200
    assert requests.get(swarm, headers={"X-Shoal-Node-Token": forged}, verify=region.ca,
                        timeout=30).status_code == 401
    token_file = tmp_path / "n9-token"
    token_file.write_text(own_token(region, module_registry, "n9") + "\n")
    token_file.chmod(0o600)
    config = node_config(region, "n9").replace(str(region.node_token_file), str(token_file))
    with shoal_node_with_containerd("shoal-ph9-", config):
        wait_for(lambda: region.nodes().get("n9", {}).get("state") == "up", "n9 registered with its own token")


def test_a_region_without_the_shared_token_takes_own_tokens_only(module_registry, tmp_path):
    """`[nodes] shared_token = false`: the secret itself no longer admits a node; own
    tokens do, except those of `[nodes] revoked` names."""
    store = tmp_path / "region store"
    config = '[nodes]\nshared_token = false\nrevoked = ["n6"]\n'
    proc, url, ca = start_region(module_registry.url, store, tmp_path / "region.log", config=config)
    try:
        region = Region(proc, url, ca, store)
        shared = region.node_token_file.read_text().strip()
        refused = node_call(region, "n5", shared)
        assert refused.status_code == 401 and "not revoked" in refused.json()["error"]
        assert node_call(region, "n5", own_token(region, module_registry, "n5")).status_code == 200
        assert node_call(region, "n6", own_token(region, module_registry, "n6")).status_code == 401
    finally:
        stop_process(proc)
        proc.stdout.close()


def test_nodes_register_again_with_a_region_that_restarted(module_registry, fleet):
    """(Last in the module: it restarts the fleet's region.) The region forgets its nodes
    when it stops; their next poll fails, they register again, and jobs reach them."""
    region, _ = fleet
    port = int(region.url.rsplit(":", 1)[1])
    stop_process(region.proc)
    region.proc.stdout.close()
    proc, url, _ = start_region(module_registry.url, region.store, region.store.parent / "region-2.log",
                                config=f"[prefetch]\nnode_timeout = {NODE_TIMEOUT}\n", port=port)
    region.proc = proc  # (the fixture stops this one)
    assert url == region.url and region.token == region.token_file.read_text().strip()  # same store, same secrets
    wait_for(lambda: {"n1", "n2"} <= {n for n, v in region.nodes().items() if v["state"] == "up"},
             "both nodes registered again", 90)
