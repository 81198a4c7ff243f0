"""The install paths on real parts: the systemd units (systemd-analyze verify), `shoal
install containerd` against a real containerd and its own configuration file, `shoal
doctor` on a healthy and on broken set-ups, the node's and region's health endpoints."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from builder.convert import convert
from cli.install import containerd_minor
from shoal.config import DEFAULT_ROOT
from snapshotter.fs.client import FSClient
from snapshotter.node import DEFAULT_SOCKET
from tests.fixtures_services import containerd_missing
from tests.lab.fromdir import ImageConfig, build_image
from tests.rootfs import busybox_layer
from tests.services import (
    CONTAINERD_BIN,
    REPO,
    SHOAL,
    NodeProcess,
    free_port,
    shoal_node_with_containerd,
    start_containerd,
    stop_process,
    unmount_under,
    wait_for,
)

SYSTEMD = REPO / "deploy" / "systemd"
CAT = ["/bin/cat", "/etc/motd"]
MOTD = "hello from a shoal test image\n"


# --- systemd ---------------------------------------------------------------------------------


def unit_entries(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A unit file's (key, value) pairs per section, in order (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
            continue
        key, _, value = line.partition("=")
        current.append((key.strip(), value.strip()))
    return sections


def values(entries: list[tuple[str, str]], key: str) -> list[str]:
    return [v for k, v in entries if k == key]


def verify_unit(path: Path, tmp_path: Path) -> list[str]:
    """systemd-analyze verify's complaints about the unit (its ExecStart pointed at this
    checkout's shoal, which verify requires to exist)."""
    copy = tmp_path / path.name
    copy.write_text(path.read_text().replace("/usr/local/bin/shoal", SHOAL))
    proc = subprocess.run(["systemd-analyze", "verify", str(copy)], check=False, capture_output=True, text=True, timeout=60)
    return [line for line in (proc.stdout + proc.stderr).splitlines() if copy.name in line] + (
        [f"exit status {proc.returncode}"] if proc.returncode else [])


@pytest.fixture
def systemd_analyze():
    if not shutil.which("systemd-analyze"):
        pytest.skip("systemd-analyze is not installed (Debian package systemd)")


@pytest.mark.parametrize("unit", ["shoal-node.service", "shoal-region.service"])
def test_systemd_units_verify(unit, tmp_path, systemd_analyze):
    assert verify_unit(SYSTEMD / unit, tmp_path) == []


def test_systemd_verify_catches_a_broken_unit(tmp_path, systemd_analyze):
    """The check above can fail: a misspelt key and a bad value are reported."""
    broken = tmp_path / "src" / "shoal-node.service"
    broken.parent.mkdir()
    broken.write_text((SYSTEMD / "shoal-node.service").read_text()
                      .replace("KillMode=process", "KilMode=process").replace("OOMScoreAdjust=-999", "OOMScoreAdjust=low"))
    complaints = verify_unit(broken, tmp_path)
    assert any("KilMode" in c for c in complaints) and any("OOM" in c for c in complaints), complaints


def test_node_unit_keeps_the_layer_fs_and_containers_alive():
    unit = unit_entries(SYSTEMD / "shoal-node.service")
    service, section = unit["Service"], unit["Unit"]
    assert "containerd.service" in " ".join(values(section, "Before")).split()
    assert not values(section, "Requires") and not values(unit["Install"], "RequiredBy")  # containerd never waits on shoal
    # stop/restart signal the daemon alone: shoal-fs (same cgroup) keeps serving the mounts
    assert values(service, "KillMode") == ["process"]
    assert values(service, "Restart") == ["always"]
    assert int(values(service, "OOMScoreAdjust")[0]) <= -900
    # no option that gives the unit its own mount namespace or a device policy: the layer
    # mounts must be visible to containerd and /dev/fuse must open
    forbidden = {"ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
                 "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem", "BindPaths",
                 "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
                 "ProtectClock", "DevicePolicy", "DeviceAllow", "MountFlags", "RootDirectory", "ProtectProc"}
    assert not forbidden & {k for k, _ in service}
    [start] = values(service, "ExecStart")
    argv = shlex.split(start)
    assert argv[1] == "node" and argv[argv.index("--root") + 1] == DEFAULT_ROOT
    assert argv[argv.index("--socket") + 1] == DEFAULT_SOCKET
    assert DEFAULT_SOCKET in " ".join(values(service, "ExecStartPost"))  # containerd starts after the socket is up
    assert values(service, "StateDirectoryMode") == ["0700"]


def test_node_unit_waits_for_the_socket(tmp_path):
    """ExecStartPost (after which systemd starts containerd) returns once the socket is
    there: run as systemd would, on a socket of the test's own."""
    import socket as socketlib

    [post] = values(unit_entries(SYSTEMD / "shoal-node.service")["Service"], "ExecStartPost")
    sock = tmp_path / "s.sock"
    argv = shlex.split(post.replace(DEFAULT_SOCKET, str(sock)))
    with socketlib.socket(socketlib.AF_UNIX) as listener:
        listener.bind(str(sock))
        listener.listen()
        assert subprocess.run(argv, check=False, timeout=30).returncode == 0
    sock.unlink()
    waiting = subprocess.Popen(argv)
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.wait(timeout=1)  # no socket yet: still waiting
    finally:
        stop_process(waiting)


def test_region_unit_runs_unprivileged():
    service = unit_entries(SYSTEMD / "shoal-region.service")["Service"]
    assert values(service, "Restart") == ["always"]
    assert values(service, "DynamicUser") == ["yes"] and values(service, "ProtectSystem") == ["strict"]
    argv = shlex.split(values(service, "ExecStart")[0])
    assert argv[1] == "region" and "--config" in argv and "--store" in argv


# --- shoal install containerd ----------------------------------------------------------------

# What an operator's configuration already has: a comment, another proxy snapshotter, CRI
# settings of its own (the CRI plugin stays disabled here: the test containerd has no CNI).
EXISTING = """\
# site settings: keep this comment
[proxy_plugins.other]
  type = "snapshot"
  address = "/run/shoal-test-other/other.sock"

[plugins."io.containerd.grpc.v1.cri".containerd]
  default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
      SystemdCgroup = false
      BinaryName = "/usr/sbin/runc"
"""


@pytest.fixture(scope="module")
def lazy_image(module_registry, tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy image")
    gz = f"{module_registry.host}/deploy/app:gzip"
    build_image([str(busybox_layer(root / "l1"))], f"docker://{gz}", ImageConfig(cmd=CAT), plain_http=True,
                workdir=str(root))
    lazy = f"{module_registry.host}/deploy/app:lazy"
    convert(f"docker://{gz}", f"docker://{lazy}", plain_http=True)
    return lazy


@pytest.fixture
def workdir():
    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    short = Path(tempfile.mkdtemp(prefix="shoal-inst-", dir="/tmp"))  # unix socket paths are short
    try:
        yield short
    finally:
        FSClient(str(short / "root")).stop()
        unmount_under(short)
        shutil.rmtree(short, ignore_errors=True)


def shoal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([SHOAL, *args], check=False, capture_output=True, text=True, timeout=300)


def install(config: Path, socket: Path, restart: str, *extra: str) -> subprocess.CompletedProcess:
    return shoal("install", "containerd", "--config", str(config), "--socket", str(socket),
                 "--restart-command", restart, *extra)


def snapshotters(ctd) -> dict[str, str]:
    """containerd's snapshotter plugins as `ctr plugins ls` shows them: {id: status}."""
    out = ctd.ctr("plugins", "ls").stdout
    return {cols[1]: cols[-1] for cols in map(str.split, out.splitlines()) if cols and cols[0] == "io.containerd.snapshotter.v1"}


def contains(big: object, small: object) -> bool:
    """Every key and value of `small` is in `big` (tables recursively)."""
    if isinstance(small, dict):
        return isinstance(big, dict) and all(k in big and contains(big[k], v) for k, v in small.items())
    return big == small


@pytest.mark.containerd
def test_install_merges_restarts_once_and_uninstalls_to_the_original(module_registry, lazy_image, workdir):
    node = ctd = None
    try:
        ctd = start_containerd(workdir / "ctd", extra_config=EXISTING)
        config = ctd.config_path
        original = config.read_bytes()
        assert "shoal" not in snapshotters(ctd)
        restarts = workdir / "restarts"
        # what a service manager does: stop this containerd (by its PID); the test starts it again
        restart = f"sh -c 'echo restart >> {restarts}; kill -TERM {ctd.pid}'"
        sock = workdir / "s.sock"

        # shoal's socket does not answer yet: nothing is changed, containerd is not restarted
        proc = install(config, sock, restart, "--wait", "1")
        assert proc.returncode == 1 and "does not answer" in proc.stderr and len(proc.stderr.splitlines()) == 1
        assert config.read_bytes() == original and not restarts.exists()

        node = NodeProcess(workdir / "root", sock, workdir / "node.log")
        proc = install(config, sock, restart, "--json")
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout)
        assert result["changed"] is True and result["restarted"] is True
        if containerd_minor(CONTAINERD_BIN) < (1, 7):
            assert "ignores the runtime handler's snapshotter" in result["note"]
        assert restarts.read_text() == "restart\n"
        ctd.restart()

        text = config.read_text()
        merged = tomllib.loads(text)
        assert contains(merged, tomllib.loads(original.decode()))  # everything that was there
        assert "# site settings: keep this comment" in text
        assert merged["proxy_plugins"]["shoal"] == {"type": "snapshot", "address": str(sock)}
        cri = merged["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
        assert cri["disable_snapshot_annotations"] is False and "snapshotter" not in cri  # not the default
        assert cri["runtimes"]["shoal"] == {"runtime_type": "io.containerd.runc.v2", "snapshotter": "shoal",
                                            "options": {"SystemdCgroup": False, "BinaryName": "/usr/sbin/runc"}}
        seen = snapshotters(ctd)
        assert seen["shoal"] == "ok" and seen["other"] == "ok"
        # containerd reads the file as intended (its own parse: `containerd config dump`,
        # which shows the CRI plugin's settings only when the plugin is enabled)
        with_cri = workdir / "with-cri.toml"
        with_cri.write_text(re.sub(r"(?m)^disabled_plugins = .*$", "", text))
        dumped = tomllib.loads(subprocess.run([CONTAINERD_BIN, "--config", str(with_cri), "config", "dump"],
                                              check=True, capture_output=True, text=True).stdout)
        assert dumped["proxy_plugins"]["shoal"]["address"] == str(sock)
        cri = dumped["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
        assert cri["disable_snapshot_annotations"] is False and cri["snapshotter"] == "overlayfs"
        assert cri["runtimes"]["shoal"]["runtime_type"] == "io.containerd.runc.v2"
        if containerd_minor(CONTAINERD_BIN) < (1, 7):  # 1.6 has no per-runtime snapshotter: it drops the key
            assert "snapshotter" not in cri["runtimes"]["shoal"]
        else:
            assert cri["runtimes"]["shoal"]["snapshotter"] == "shoal"

        # a lazy pull and run through the plugin the installer configured
        pulled = json.loads(shoal("pull", lazy_image, "--address", ctd.address, "--namespace", "shoal-test",
                                  "--json").stdout)
        assert [ly["kind"] for ly in pulled["layers"]] == ["lazy"]
        ran = ctd.ctr("run", "--rm", "--snapshotter", "shoal", lazy_image, "deploy-1", *CAT)
        assert ran.stdout == MOTD, (ran, ctd.log_tail(), node.log())

        # again: no change, no restart
        installed = config.read_bytes()
        proc = install(config, sock, restart, "--json")
        assert proc.returncode == 0 and json.loads(proc.stdout) | {"note": None} == {
            "config": str(config), "changed": False, "restarted": False,
            "backup": str(config) + ".pre-shoal", "note": None}
        assert config.read_bytes() == installed and restarts.read_text() == "restart\n"

        # uninstall: the original bytes, one more restart, no side files
        restart = f"sh -c 'echo restart >> {restarts}; kill -TERM {ctd.pid}'"
        proc = shoal("install", "containerd", "--config", str(config), "--uninstall", "--restart-command", restart)
        assert proc.returncode == 0, proc.stderr
        assert config.read_bytes() == original
        assert restarts.read_text() == "restart\n" * 2
        assert not Path(str(config) + ".pre-shoal").exists() and not Path(str(config) + ".shoal.json").exists()
        ctd.restart()
        assert "shoal" not in snapshotters(ctd) and "other" in snapshotters(ctd)
    finally:
        if ctd is not None:
            ctd.stop()
        if node is not None:
            node.stop()


@pytest.mark.containerd  # root and FUSE: a real shoal node answers on the socket
def test_install_and_uninstall_from_other_starting_points(workdir):
    """A file someone edited after the install (uninstall takes out only shoal's entries,
    each key back to what it was, and keeps their change); `containerd config default`;
    no file at all."""
    node = NodeProcess(workdir / "root", workdir / "s.sock", workdir / "node.log")
    try:
        config = workdir / "config.toml"
        before = "version = 2\n" + EXISTING.replace(
            'default_runtime_name = "runc"', 'default_runtime_name = "runc"\n  disable_snapshot_annotations = true')
        config.write_text(before)
        assert install(config, node.socket, "").returncode == 0
        config.write_text(config.read_text().replace('default_runtime_name = "runc"', 'default_runtime_name = "crun"'))
        proc = shoal("install", "containerd", "--config", str(config), "--uninstall", "--restart-command", "")
        assert proc.returncode == 0 and "kept the rest" in proc.stdout, proc.stdout + proc.stderr
        want = tomllib.loads(before)
        want["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["default_runtime_name"] = "crun"
        assert tomllib.loads(config.read_text()) == want

        # the file most nodes start from: `containerd config default`, as containerd reads it back
        default = workdir / "default.toml"
        default.write_bytes(subprocess.run([CONTAINERD_BIN, "config", "default"], check=True,
                                           capture_output=True).stdout)
        original = default.read_bytes()
        assert install(default, node.socket, "").returncode == 0
        dumped = tomllib.loads(subprocess.run([CONTAINERD_BIN, "--config", str(default), "config", "dump"],
                                              check=True, capture_output=True, text=True).stdout)
        cri = dumped["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]
        assert cri["disable_snapshot_annotations"] is False and cri["snapshotter"] == "overlayfs"
        assert cri["runtimes"]["shoal"]["options"] == cri["runtimes"]["runc"]["options"]
        assert dumped["proxy_plugins"]["shoal"] == {"type": "snapshot", "address": str(node.socket)}
        assert shoal("install", "containerd", "--config", str(default), "--uninstall", "--restart-command", "").returncode == 0
        assert default.read_bytes() == original

        # no configuration at all: the install writes one, the uninstall removes it
        fresh = workdir / "fresh" / "config.toml"
        assert install(fresh, node.socket, "").returncode == 0
        assert tomllib.loads(fresh.read_text())["proxy_plugins"]["shoal"]["address"] == str(node.socket)
        assert shoal("install", "containerd", "--config", str(fresh), "--uninstall", "--restart-command", "").returncode == 0
        assert list(fresh.parent.iterdir()) == []
    finally:
        node.stop()


def test_install_refuses_what_it_cannot_edit(tmp_path):
    for text, message in (("[grpc]\naddress = 'x'\n", "configuration version 1"),
                          ("version = 3\n", "configuration version 3"),
                          ("version = 2\n[proxy_plugins\n", "not valid TOML"),
                          ("version = 2\nproxy_plugins = 'x'\n", "config.toml: proxy_plugins is not a table"),
                          ("version = 2\n# \udcff\n", "not UTF-8")):
        config = tmp_path / "config.toml"
        config.write_bytes(text.encode(errors="surrogateescape"))
        proc = install(config, tmp_path / "none.sock", "", "--wait", "0")
        assert proc.returncode == 1 and message in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert config.read_bytes() == text.encode(errors="surrogateescape")


# --- shoal doctor ------------------------------------------------------------------------------


def doctor(node, config: Path, *extra: str) -> tuple[int, dict]:
    proc = shoal("doctor", "--root", str(node.root), "--socket", str(node.socket),
                 "--containerd-config", str(config), "--json", *extra)
    assert proc.stdout, proc.stderr
    return proc.returncode, {c["name"]: c for c in json.loads(proc.stdout)["checks"]}


@pytest.mark.containerd
def test_doctor_on_a_healthy_node_and_on_broken_ones(tmp_path):
    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    with shoal_node_with_containerd("shoal-doctor-") as (node, ctd):
        code, checks = doctor(node, ctd.config_path)
        assert code == 0, checks
        assert {n for n, c in checks.items() if c["status"] == "ok"} >= {
            "fuse device", "fuse module", "overlayfs", "containerd config", "containerd plugin", "shoal socket", "root"}
        text = shoal("doctor", "--root", str(node.root), "--socket", str(node.socket),
                     "--containerd-config", str(ctd.config_path))
        assert text.returncode == 0 and len(text.stdout.splitlines()) == len(checks)

        # a containerd configuration without the plugin
        bare = tmp_path / "bare.toml"
        bare.write_text(re.sub(r"\[proxy_plugins\.shoal\][^\[]*", "", ctd.config_path.read_text()))
        code, checks = doctor(node, bare)
        assert code == 1 and checks["containerd config"]["status"] == "FAIL"
        assert "no [proxy_plugins.shoal]" in checks["containerd config"]["detail"]
        assert "shoal install containerd" in checks["containerd config"]["fix"]

        # a containerd that never loaded the plugin
        plain = start_containerd(tmp_path / "plain")
        try:
            code, checks = doctor(node, ctd.config_path, "--containerd-address", plain.address)
            assert code == 1 and checks["containerd plugin"]["status"] == "FAIL", checks
        finally:
            plain.stop()

        # a root others can read
        os.chmod(node.root, 0o755)
        code, checks = doctor(node, ctd.config_path)
        assert code == 1 and checks["root"]["status"] == "FAIL" and "0755" in checks["root"]["detail"]
        os.chmod(node.root, 0o700)

        # an unreachable region in the node's configuration
        node_config = tmp_path / "node.toml"
        node_config.write_text(f'[fetch]\nregion_url = "http://127.0.0.1:{free_port()}"\n')
        code, checks = doctor(node, ctd.config_path, "--config", str(node_config))
        assert code == 1 and checks["region"]["status"] == "FAIL" and "not reachable" in checks["region"]["detail"]

        # a stopped node
        node.stop()
        code, checks = doctor(node, ctd.config_path)
        assert code == 1 and checks["shoal socket"]["status"] == "FAIL"
        assert checks["containerd config"]["status"] == "ok"


def test_doctor_checks_the_cri_settings(tmp_path):
    """With the CRI plugin on: snapshot annotations off is a failure (no lazy layers),
    no runtime handler a warning, what `shoal install` writes is ok."""
    from cli.doctor import check_containerd_config
    from cli.install import Options, merged

    sock = str(tmp_path / "s.sock")
    config = tmp_path / "config.toml"
    config.write_text(f'version = 2\n[proxy_plugins.shoal]\ntype = "snapshot"\naddress = "{sock}"\n')
    checks = {c.name: c for c in check_containerd_config(str(config), sock, "shoal")[0]}
    assert checks["containerd config"].status == "ok" and checks["containerd CRI"].status == "FAIL"
    config.write_text(config.read_text() + '[plugins."io.containerd.grpc.v1.cri".containerd]\n'
                      "disable_snapshot_annotations = false\n")
    checks = {c.name: c for c in check_containerd_config(str(config), sock, "shoal")[0]}
    assert checks["containerd CRI"].status == "warn" and "no pod uses shoal" in checks["containerd CRI"].detail
    config.write_text(merged(config.read_text(), Options(socket=sock))[0])
    checks = {c.name: c for c in check_containerd_config(str(config), sock, "shoal")[0]}
    assert [c.status for c in checks.values()] == ["ok", "ok"]
    checks = {c.name: c for c in check_containerd_config(str(config), str(tmp_path / "other.sock"), "shoal")[0]}
    assert checks["containerd config"].status == "FAIL" and "shoal's socket is" in checks["containerd config"].detail


# --- health endpoints ------------------------------------------------------------------------


def http_get(url: str, ca: str | None = None) -> tuple[int, str]:
    handlers = [urllib.request.ProxyHandler({})]
    if ca:
        handlers.append(urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca)))
    opener = urllib.request.build_opener(*handlers)
    try:
        with opener.open(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.containerd  # root and FUSE
def test_node_healthz_and_readyz(workdir):
    port = free_port()
    config = workdir / "node.toml"
    config.write_text(f'[metrics]\naddress = "127.0.0.1:{port}"\n')
    node = NodeProcess(workdir / "root", workdir / "s.sock", workdir / "node.log", ("--config", str(config)))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(url + "/healthz"), "the node's HTTP endpoint", timeout=30)  # starts after the socket
        assert wait_for(lambda: http_get(url + "/readyz")[0] == 200, "the node to be ready", timeout=30)
        FSClient(str(node.root)).stop()  # the layer file system is gone: not ready, still alive
        status, body = http_get(url + "/readyz")
        assert status == 503 and "layer file system" in body
        assert http_get(url + "/healthz")[0] == 200
        assert http_get(url + "/metrics")[0] == 200
    finally:
        node.stop()
    assert (os.stat(node.root).st_mode & 0o777) == 0o700  # the root is private, whoever made it


def test_region_healthz_and_readyz(module_registry, tmp_path):
    port = free_port()
    config = tmp_path / "region.toml"
    config.write_text('backend = "disk"\n[disk]\ncapacity = "64M"\n')
    with open(tmp_path / "region.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "region", "--listen", f"127.0.0.1:{port}", "--origin",
             module_registry.url, "--store", str(tmp_path / "store"), "--config", str(config)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        url = f"https://127.0.0.1:{port}"  # the region's default: HTTPS with a CA of its own
        ca = str(tmp_path / "store" / "tls" / "ca.pem")
        wait_for(lambda: os.path.exists(ca) and _answers(url + "/healthz", ca), "the region to answer", timeout=30)
        assert http_get(url + "/healthz", ca) == (200, "ok\n")
        assert http_get(url + "/readyz", ca) == (200, "ok\n")
    finally:
        stop_process(proc)


def _answers(url: str, ca: str | None = None) -> bool:
    try:
        return http_get(url, ca)[0] == 200
    except OSError:
        return False


# --- Kubernetes manifests ------------------------------------------------------------------

KUBE = REPO / "deploy" / "kubernetes"
# the oldest Kubernetes still commonly run, and the newest schema kubernetes-validate ships
KUBE_VERSIONS = ("1.30.0", "newest")


def manifests() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name != "kustomization.yaml")


def kube_docs(path: Path) -> list[dict]:
    import yaml

    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def find(kind: str, name: str, folder: str = "node") -> dict:
    for path in sorted((KUBE / folder).glob("*.yaml")):
        for doc in kube_docs(path):
            if doc.get("kind") == kind and doc["metadata"]["name"] == name:
                return doc
    raise AssertionError(f"no {kind} {name} in {folder}")


@pytest.mark.parametrize("path", manifests(), ids=lambda p: str(p.relative_to(KUBE)))
def test_manifest_is_valid_kubernetes(path):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    for doc in kube_docs(path):
        for version in KUBE_VERSIONS:
            version = kubernetes_validate.latest_version() if version == "newest" else version
            kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field


def test_manifest_validation_catches_mistakes():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    ds = find("DaemonSet", "shoal-node")
    ds["spec"]["template"]["spec"]["containers"][0]["securityContext"]["privilegd"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBE_VERSIONS[0], strict=True)


def test_kustomizations_list_their_folders():
    import yaml

    for kustomization in KUBE.rglob("kustomization.yaml"):
        listed = yaml.safe_load(kustomization.read_text())["resources"]
        present = sorted(p.name for p in kustomization.parent.glob("*.yaml") if p.name != "kustomization.yaml")
        assert sorted(listed) == present, kustomization


def test_node_daemonset_wiring(tmp_path):
    """What the node DaemonSet must hold together: the node's socket is the one the
    install step waits for and writes into containerd's configuration; probes and the
    scrape annotation hit the port of the node's [metrics] address; shoal is not made
    the default snapshotter; the RuntimeClass names the handler the install adds."""
    from cli.install import DEFAULT_HANDLER
    from snapshotter.node import load_config

    ds = find("DaemonSet", "shoal-node")["spec"]
    assert ds["updateStrategy"]["type"] == "OnDelete"  # an update must not end running containers' layer fs
    spec = ds["template"]["spec"]
    node, installer = spec["containers"]
    assert node["securityContext"]["privileged"] is True and spec["hostPID"] is True
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in node["volumeMounts"]}
    assert volumes[mounts["/dev/fuse"]["name"]]["hostPath"] == {"path": "/dev/fuse", "type": "CharDevice"}
    assert volumes[mounts["/var/lib/shoal"]["name"]]["hostPath"]["path"] == "/var/lib/shoal"
    assert mounts["/var/lib/shoal"]["mountPropagation"] == "Bidirectional"
    assert "limits" not in node["resources"] or "memory" not in node["resources"]["limits"]

    argv = node["command"]
    socket = argv[argv.index("--socket") + 1]
    config_path = argv[argv.index("--config") + 1]
    configmap = find("ConfigMap", "shoal-node")
    (tmp_path / "node.toml").write_text(configmap["data"][Path(config_path).name])
    config = load_config(tmp_path / "node.toml")  # the real loader: a bad key fails here
    port = config.metrics.host_port()[1]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert node[probe]["httpGet"]["port"] == port
    assert node["readinessProbe"]["httpGet"]["path"] == "/readyz" and node["livenessProbe"]["httpGet"]["path"] == "/healthz"
    annotations = find("DaemonSet", "shoal-node")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(port)

    [script] = installer["args"]
    words = shlex.split(script)
    cmd = words[:words.index("&&")]
    assert cmd[:3] == ["shoal", "install", "containerd"] and "--uninstall" not in cmd
    assert "--default-snapshotter" not in cmd
    assert cmd[cmd.index("--socket") + 1] == socket
    config_dir = Path(cmd[cmd.index("--config") + 1]).parent
    installer_mounts = {m["mountPath"]: m["name"] for m in installer["volumeMounts"]}
    assert volumes[installer_mounts[str(config_dir)]]["hostPath"]["path"] == "/etc/containerd"  # the directory
    assert volumes[installer_mounts[str(Path(socket).parent)]] == volumes[mounts[str(Path(socket).parent)]["name"]]
    assert find("RuntimeClass", "shoal")["handler"] == DEFAULT_HANDLER

    cleanup = find("DaemonSet", "shoal-cleanup", "cleanup")["spec"]["template"]["spec"]["containers"][0]
    words = shlex.split(cleanup["args"][0])
    assert words[:3] == ["shoal", "install", "containerd"] and "--uninstall" in words


@pytest.mark.parametrize("folder,kind", [("region", "StatefulSet"), ("region-s3", "Deployment")])
def test_region_manifests_wiring(folder, kind, tmp_path):
    from cache.region.config import load_config

    workload = find(kind, "shoal-region", folder)
    [container] = workload["spec"]["template"]["spec"]["containers"]
    argv = container["command"]
    configmap = find("ConfigMap", "shoal-region", folder)
    (tmp_path / "region.toml").write_text(configmap["data"]["region.toml"])
    config = load_config(str(tmp_path / "region.toml"), listen=argv[argv.index("--listen") + 1])
    config.backend_options()  # the backend's settings are complete
    port = config.listen_address[1]
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": port}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": port}
    service = find("Service", "shoal-region", folder)
    assert service["spec"]["selector"] == workload["spec"]["selector"]["matchLabels"]
    node_config = tomllib.loads(find("ConfigMap", "shoal-node")["data"]["node.toml"])
    assert node_config["fetch"]["region_url"].endswith(f"{service['metadata']['name']}.shoal-system.svc.cluster.local:{port}")
    if kind == "StatefulSet":
        assert workload["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] in {
            m["name"] for m in container["volumeMounts"]}
    else:
        assert config.backend == "s3"


def test_prometheus_scrape_config_targets_the_annotated_ports():
    import yaml

    [job] = yaml.safe_load((KUBE / "prometheus" / "scrape-config.yml").read_text())["scrape_configs"]
    [address_rule] = [r for r in job["relabel_configs"] if r.get("target_label") == "__address__"]
    for folder, kind in (("node", "DaemonSet"), ("region", "StatefulSet")):
        template = find(kind, "shoal-" + folder.split("-")[0], folder)["spec"]["template"]
        port = template["metadata"]["annotations"]["prometheus.io/port"]
        # Prometheus joins the source labels with ";" and applies the (RE2) regex
        joined = f"10.1.2.3:{template['spec']['containers'][0]['ports'][0]['containerPort']};{port}"
        m = re.fullmatch(address_rule["regex"], joined)
        assert m and address_rule["replacement"].replace("$1", m.group(1)).replace("$2", m.group(2)) == f"10.1.2.3:{port}"
        assert template["metadata"]["labels"]["app.kubernetes.io/part-of"] == "shoal"


# --- the CI step ---------------------------------------------------------------------------


def _ci_env(registry, home: Path, **values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DOCKER_CONFIG", "REGISTRY_AUTH_FILE")}
    env.update(HOME=str(home), PATH=f"{Path(SHOAL).parent}:{env.get('PATH', '/usr/bin:/bin')}",
               PYTHONPATH=str(REPO), **values)
    return env


def _source_image(registry, docker_config, tmp_path: Path) -> str:
    docker_config.login(registry.host, registry.username, registry.password)
    ref = f"{registry.host}/ci/app:built"
    build_image([str(busybox_layer(tmp_path / "rootfs"))], f"docker://{ref}", ImageConfig(cmd=CAT),
                plain_http=True, workdir=str(tmp_path))
    return ref


def _check_converted(target: str, docker_config) -> None:
    proc = subprocess.run([SHOAL, "inspect", f"docker://{target}", "--verify", "--plain-http", "--json"],
                          check=False, capture_output=True, text=True,
                          env=os.environ | {"DOCKER_CONFIG": str(docker_config.path)})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    layers = [ly for m in report["manifests"] for ly in m["layers"]]
    assert report["ok"] and layers and all(ly["zstd_chunked"] and ly["verified"] for ly in layers), report
    # the profile step recorded the image's start on an embedded node and pushed it
    shown = subprocess.run([SHOAL, "profile", "show", target, "--plain-http", "--json"], check=False,
                           capture_output=True, text=True, env=os.environ | {"DOCKER_CONFIG": str(docker_config.path)})
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["chunks"] > 0


def test_github_actions_steps_convert_verify_and_push(basic_registry, docker_config, tmp_path):
    import yaml

    workflow = yaml.safe_load((REPO / "deploy" / "ci" / "github-actions.yml").read_text())
    [job] = workflow["jobs"].values()
    steps = {s["id"]: s for s in job["steps"] if s.get("id") in ("convert", "verify", "profile")}
    assert list(steps) == ["convert", "verify", "profile"]
    source = _source_image(basic_registry, docker_config, tmp_path)  # what the build step pushed
    target = f"{basic_registry.host}/ci/app:built-shoal"
    output = tmp_path / "github-output"
    ours = {"IMAGE": f"{basic_registry.host}/ci/app", "SHOAL_FLAGS": "--plain-http", "SOURCE": source,
            "TARGET": target, "GITHUB_OUTPUT": str(output), "GITHUB_SHA": "built",
            "DOCKER_CONFIG": str(docker_config.path)}  # where docker/login-action left the credentials
    for step in steps.values():
        env = dict(workflow.get("env", {})) | dict(step.get("env", {}))
        unresolved = [k for k, v in env.items() if "${{" in str(v) and k not in ours]
        assert not unresolved, f"step {step['id']}: the test does not set {unresolved}"
        env = _ci_env(basic_registry, tmp_path, **{k: str(v) for k, v in env.items()}) | ours
        # GitHub's shell for run: is bash -e -o pipefail
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", step["run"]], env=env,
                              check=False, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (step["id"], proc.stdout, proc.stderr)
    assert re.fullmatch(r"digest=sha256:[0-9a-f]{64}\n", output.read_text())
    _check_converted(target, docker_config)


def test_gitlab_job_converts_verifies_and_pushes(basic_registry, docker_config, tmp_path):
    import yaml

    pipeline = yaml.safe_load((REPO / "deploy" / "ci" / "gitlab-ci.yml").read_text())
    job = pipeline["shoal-convert"]
    source = _source_image(basic_registry, docker_config, tmp_path / "build")
    target = f"{basic_registry.host}/ci/app:built-shoal"
    home = tmp_path / "home"  # the job's credentials come from its own before_script
    home.mkdir()
    ours = {"CI_REGISTRY": basic_registry.host, "CI_REGISTRY_USER": basic_registry.username,
            "CI_REGISTRY_PASSWORD": basic_registry.password, "CI_REGISTRY_IMAGE": f"{basic_registry.host}/ci",
            "CI_COMMIT_SHA": "built", "SHOAL_FLAGS": "--plain-http"}
    variables = {k: str(v) for k, v in pipeline["variables"].items()}
    # GitLab expands $NAME in variables from the CI variables
    variables = {k: re.sub(r"\$(\w+)", lambda m: ours.get(m.group(1), m.group(0)), v) for k, v in variables.items()}
    assert variables["SOURCE"] == source and variables["TARGET"] == target
    lines = [line for line in job["before_script"] if not line.startswith("pip install")]  # shoal is installed here
    script = "\n".join(lines + job["script"])
    env = _ci_env(basic_registry, home, **variables) | ours
    proc = subprocess.run(["bash", "-e", "-c", script], check=False, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert json.loads((tmp_path / "shoal-convert.json").read_text())["digest"].startswith("sha256:")
    assert json.loads((home / ".docker" / "config.json").read_text())["auths"][basic_registry.host]
    _check_converted(target, docker_config)


# --- the README's install sections, as a platform engineer reads them ----------------------------


def readme_blocks(section: str) -> list[str]:
    """The ```sh blocks of the README's `## SECTION`."""
    text = (REPO / "README.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```sh\n(.*?)```", body, re.DOTALL)


def shell_commands(block: str) -> list[list[str]]:
    """Each command of a block (comments dropped, `&&` split, a heredoc's body skipped)."""
    out, heredoc = [], None
    for line in block.splitlines():
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        words = shlex.split(line, comments=True)
        if m := re.search(r"<<'?(\w+)'?", line):
            heredoc = m.group(1)
        cmd: list[str] = []
        for w in words + ["&&"]:
            if w == "&&":
                if cmd:
                    out.append(cmd)
                cmd = []
            else:
                cmd.append(w)
    return out


@pytest.mark.parametrize("section", ["Install with systemd", "Install on Kubernetes"])
def test_readme_install_commands_exist_and_shoal_flags_parse(section):
    """Every command of the section is a program of this machine (or one an earlier line
    makes), and every `shoal ...` line parses with shoal's own parser."""
    from cli.main import build_parser

    made: set[str] = set()
    [block] = readme_blocks(section)
    for cmd in shell_commands(block):
        program = cmd[0]
        if program == "ln":
            made.add(cmd[-1])
        if program == "python3" and "venv" in cmd:
            made.add(cmd[cmd.index("venv") + 1])
        if program == "shoal":
            assert "/usr/local/bin/shoal" in made or shutil.which("shoal"), cmd
            build_parser().parse_args(cmd[1:])  # exits (SystemExit) on a wrong flag
            continue
        if any(program.startswith(m.rstrip("/") + "/") for m in made):
            continue
        assert shutil.which(program), f"{section}: {program} is not a program here ({' '.join(cmd)})"


def test_the_image_holds_every_package_and_the_readme_overlay_builds(tmp_path):
    """The Containerfile copies every product package (the `shoal` command is cli's), and
    the README's overlay builds with `kubectl kustomize` into manifests whose every
    container runs the image it names."""
    import yaml

    packages = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = re.findall(r"^COPY (\w+) /src/\1$", (REPO / "deploy/kubernetes/Containerfile").read_text(), re.MULTILINE)
    assert {p.rstrip("*") for p in packages} <= set(copied), (packages, copied)

    if not shutil.which("kubectl"):
        pytest.skip("kubectl is not installed (kubectl kustomize builds the overlay)")
    [block] = readme_blocks("Install on Kubernetes")
    m = re.search(r"cat > (\S+) <<'EOF'\n(.*?)\nEOF\n", block, re.DOTALL)
    assert m, block
    (tmp_path / "deploy").symlink_to(REPO / "deploy")
    target = tmp_path / m.group(1)
    target.parent.mkdir(parents=True)
    target.write_text(m.group(2) + "\n")
    proc = subprocess.run(["kubectl", "kustomize", str(target.parent)], check=False, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    want = yaml.safe_load(m.group(2))["images"][0]
    images = [c["image"] for d in docs if d["kind"] in ("DaemonSet", "StatefulSet", "Deployment")
              for c in d["spec"]["template"]["spec"]["containers"]]
    assert images and set(images) == {f"{want['newName']}:{want['newTag']}"}, images
    assert {d["kind"] for d in docs} >= {"Namespace", "RuntimeClass", "DaemonSet", "StatefulSet", "Service"}
