"""`shoal doctor`: check a node's set-up and say what to fix.

Each check gives one line: `ok`, `warn` (shoal works, less well) or `FAIL` (a part of
the node shoal needs is missing or wrong), what it found and, when not ok, how to fix
it. Exit status 0 when nothing failed, 1 otherwise; `--json` prints
{"ok": bool, "checks": [{"name", "status", "detail", "fix"}]}.

The checks only read: no file is written, no process started or signalled.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import stat
import subprocess
import sys
import tomllib
from dataclasses import asdict, dataclass

from shoal.errors import ShoalError

OK, WARN, FAIL = "ok", "warn", "FAIL"
DEFAULT_CONTAINERD_ADDRESS = "/run/containerd/containerd.sock"
# Linux 6.9 (FUSE protocol 7.40) added FUSE passthrough (reads served by the kernel from
# a backing file) and FUSE_NOTIFY_RESEND (a restarted server asks the kernel to resend
# requests it had not answered).
KERNEL_FUSE_740 = (6, 9)


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""


def _filesystems() -> set[str]:
    try:
        with open("/proc/filesystems") as fh:
            return {line.split()[-1] for line in fh if line.strip()}
    except OSError:
        return set()


def check_fuse() -> list[Check]:
    out = []
    try:
        st = os.stat("/dev/fuse")
        if not stat.S_ISCHR(st.st_mode):
            raise FileNotFoundError
        fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        os.close(fd)
        out.append(Check("fuse device", OK, "/dev/fuse opens read-write"))
    except FileNotFoundError:
        out.append(Check("fuse device", FAIL, "/dev/fuse is missing",
                         "modprobe fuse; in a container, pass the device (--device /dev/fuse, privileged)"))
    except OSError as e:
        out.append(Check("fuse device", FAIL, f"/dev/fuse cannot be opened: {e.strerror}",
                         "run shoal as root; in a container, privileged with /dev/fuse"))
    fs = _filesystems()
    out.append(Check("fuse module", OK, "fuse is in /proc/filesystems") if "fuse" in fs else
               Check("fuse module", FAIL, "the kernel has no fuse file system", "modprobe fuse (package fuse3)"))
    out.append(Check("overlayfs", OK, "overlay is in /proc/filesystems") if "overlay" in fs else
               Check("overlayfs", FAIL, "the kernel has no overlay file system", "modprobe overlay"))
    return out


def check_kernel(release: str | None = None) -> Check:
    release = release or platform.release()
    m = re.match(r"(\d+)\.(\d+)", release)
    version = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    if version >= KERNEL_FUSE_740:
        return Check("kernel features", OK, f"Linux {release}: FUSE passthrough and NOTIFY_RESEND available (6.9+)")
    return Check("kernel features", WARN,
                 f"Linux {release}: no FUSE passthrough or NOTIFY_RESEND (Linux 6.9+)",
                 "shoal works; a kernel 6.9+ lets a restarted layer file system resume pending reads")


def _load_toml(path: str) -> dict:
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def check_containerd_config(path: str, socket: str, handler: str) -> tuple[list[Check], dict]:
    """The shoal entries in containerd's configuration; the parsed file ({} if unreadable)."""
    name = "containerd config"
    try:
        config = _load_toml(path)
    except FileNotFoundError:
        return [Check(name, FAIL, f"{path} does not exist", "shoal install containerd --config " + path)], {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        return [Check(name, FAIL, f"{path}: {e}", "fix the file's TOML")], {}
    out = []
    plugin = (config.get("proxy_plugins") or {}).get("shoal")
    install = f"shoal install containerd --config {path} --socket {socket}"
    if not isinstance(plugin, dict):
        out.append(Check(name, FAIL, f"{path} has no [proxy_plugins.shoal]", install))
    elif plugin.get("type") != "snapshot":
        out.append(Check(name, FAIL, f"[proxy_plugins.shoal] type is {plugin.get('type')!r}, not \"snapshot\"", install))
    elif os.path.realpath(str(plugin.get("address", ""))) != os.path.realpath(socket):
        out.append(Check(name, FAIL, f"[proxy_plugins.shoal] address is {plugin.get('address')!r}, shoal's socket is {socket}",
                         install + "  (or pass shoal doctor --socket)"))
    else:
        out.append(Check(name, OK, f"{path}: proxy plugin shoal at {socket}"))
    cri_name = "io.containerd.grpc.v1.cri"
    if cri_name in (config.get("disabled_plugins") or []) or "cri" in (config.get("disabled_plugins") or []):
        out.append(Check("containerd CRI", OK, "the CRI plugin is disabled (ctr and shoal pull only)"))
        return out, config
    cri = ((config.get("plugins") or {}).get(cri_name) or {}).get("containerd") or {}
    if cri.get("disable_snapshot_annotations", True) is not False:
        out.append(Check("containerd CRI", FAIL,
                         "disable_snapshot_annotations is not false: CRI pulls send no layer labels, so no lazy layers",
                         install))
    else:
        runtime = (cri.get("runtimes") or {}).get(handler) or {}
        if cri.get("snapshotter") == "shoal":
            out.append(Check("containerd CRI", WARN, "shoal is the default snapshotter of every pod",
                             "only on containerd 1.6; on 1.7+ use the runtime handler (deploy/kubernetes/README.md)"))
        elif runtime.get("snapshotter") != "shoal":
            out.append(Check("containerd CRI", WARN, f"no runtime handler {handler!r} with snapshotter shoal: no pod uses shoal",
                             install))
        else:
            out.append(Check("containerd CRI", OK, f"snapshot annotations on; runtime handler {handler} uses shoal"))
    return out, config


def check_containerd_plugin(address: str, ctr: str = "ctr") -> Check:
    name = "containerd plugin"
    try:
        proc = subprocess.run([ctr, "--address", address, "plugins", "ls"], check=False, capture_output=True, text=True,
                              timeout=20, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return Check(name, FAIL, f"{ctr} is not installed", "apt-get install containerd (ctr comes with it)")
    except subprocess.TimeoutExpired:
        return Check(name, FAIL, f"containerd at {address} did not answer in 20s", "systemctl status containerd")
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [""])[-1]
        return Check(name, FAIL, f"containerd at {address} does not answer: {last}",
                     "systemctl start containerd (or pass shoal doctor --containerd-address)")
    for line in proc.stdout.splitlines():
        cols = line.split()
        if len(cols) >= 4 and cols[0] == "io.containerd.snapshotter.v1" and cols[1] == "shoal":
            if cols[-1] == "ok":
                return Check(name, OK, "containerd has loaded the shoal snapshotter")
            return Check(name, FAIL, f"containerd's shoal snapshotter is {cols[-1]}", "journalctl -u containerd")
    return Check(name, FAIL, "containerd has no shoal snapshotter (its configuration changed since it started?)",
                 "shoal install containerd (restarts containerd when the file changed)")


def check_socket(socket: str) -> Check:
    from snapshotter.grpc_server import socket_answers

    try:
        answers = socket_answers(socket, timeout=5)
    except ImportError:
        return Check("shoal socket", FAIL, "grpc is not installed here", "pip install 'shoal[node]'")
    if answers:
        return Check("shoal socket", OK, f"{socket} answers")
    why = "does not exist" if not os.path.exists(socket) else "does not answer"
    return Check("shoal socket", FAIL, f"{socket} {why}", "systemctl start shoal-node (journalctl -u shoal-node)")


def check_root(root: str) -> Check:
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return Check("root", FAIL, f"{root} does not exist", "start shoal node --root " + root)
    if not stat.S_ISDIR(st.st_mode):
        return Check("root", FAIL, f"{root} is not a directory", "")
    if st.st_uid != 0 or st.st_mode & 0o077:
        return Check("root", FAIL, f"{root} is mode {st.st_mode & 0o7777:04o} owner uid {st.st_uid}: others can read layers",
                     f"chown root:root {root} && chmod 0700 {root}")
    return Check("root", OK, f"{root} is 0700, owned by root")


def check_region(node_config: str | None) -> Check:
    from snapshotter.node import load_config

    try:
        config = load_config(node_config)
    except ShoalError as e:
        return Check("region", FAIL, f"node configuration: {e}", "fix the node's configuration file")
    url = config.fetch.region_url.rstrip("/")
    if not url:
        return Check("region", OK, "no region configured ([fetch] region_url): chunks come from peers and the origin")
    import requests

    from cache.region.client import RegionLink

    try:
        link = RegionLink.from_config(asdict(config.fetch))
        status = link.session().get(url + "/healthz", timeout=5).status_code
    except requests.exceptions.SSLError as e:
        return Check("region", FAIL, f"{url}: its certificate is not trusted ({str(e)[:120]})",
                     "pin the region's CA with [fetch] region_ca = <its STORE/tls/ca.pem>")
    except (requests.RequestException, OSError, ValueError) as e:
        return Check("region", FAIL, f"{url} is not reachable: {str(e)[:160]}",
                     "check [fetch] region_url and that shoal region runs")
    if status >= 500:
        return Check("region", FAIL, f"{url} answers {status}", "the region's log (journalctl -u shoal-region)")
    return Check("region", OK, f"{url} answers")


def check_credentials(node_config: str | None = None) -> Check:
    from builder.oci.auth import auth_files

    cri = _cri_socket(node_config)
    if cri:
        from snapshotter.grpc_server import socket_answers

        if not socket_answers(cri, timeout=5):
            return Check("credentials", FAIL, f"the CRI image service ([cri] image_service_socket) {cri} does not "
                         "answer: the kubelet's image calls fail", "systemctl restart shoal-node (journalctl -u shoal-node)")
        return Check("credentials", OK, f"pods' pull credentials reach lazy reads through the CRI image service {cri} "
                     "(the kubelet's --image-service-endpoint)")

    for path in auth_files():
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as e:
            return Check("credentials", FAIL, f"{path}: not readable JSON: {e}", "fix or remove the file")
        auths = sorted((data.get("auths") or {}) if isinstance(data, dict) else {})
        if not auths:
            return Check("credentials", WARN, f"{path} has no registry entries (public images only)",
                         "docker login (or podman login --authfile) as root")
        return Check("credentials", OK, f"{path}: {len(auths)} registries ({', '.join(auths[:3])}{', ...' if len(auths) > 3 else ''})")
    return Check("credentials", WARN, "no credential file found (public images only): "
                 + ", ".join(str(p) for p in auth_files()),
                 "docker login as root, or set REGISTRY_AUTH_FILE in the node's environment")


def _cri_socket(node_config: str | None) -> str:
    from snapshotter.node import load_config

    try:
        return load_config(node_config).cri.image_service_socket
    except ShoalError:
        return ""  # (check_region says what is wrong with the file)


def run_checks(args: argparse.Namespace) -> list[Check]:
    checks = check_fuse()
    checks.append(check_kernel())
    config_checks, ctd_config = check_containerd_config(args.containerd_config, args.socket, args.runtime_handler)
    checks += config_checks
    address = args.containerd_address or (ctd_config.get("grpc") or {}).get("address") or DEFAULT_CONTAINERD_ADDRESS
    checks.append(check_containerd_plugin(address))
    checks.append(check_socket(args.socket))
    checks.append(check_root(args.root))
    checks.append(check_region(args.config))
    checks.append(check_credentials(args.config))
    return checks


def cmd_doctor(args: argparse.Namespace) -> int:
    args.socket = os.path.abspath(args.socket)
    checks = run_checks(args)
    ok = all(c.status != FAIL for c in checks)
    if args.json:
        print(json.dumps({"ok": ok, "checks": [asdict(c) for c in checks]}))
    else:
        for c in checks:
            line = f"{c.status:<5} {c.name}: {c.detail}"
            if c.status != OK and c.fix:
                line += f"  -> {c.fix}"
            print(line)
        if not ok:
            failed = ", ".join(c.name for c in checks if c.status == FAIL)
            print(f"shoal doctor: {failed} need fixing", file=sys.stderr)
    return 0 if ok else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from cli.install import DEFAULT_CONFIG, DEFAULT_HANDLER
    from shoal.config import DEFAULT_ROOT
    from snapshotter.node import DEFAULT_SOCKET

    p = subparsers.add_parser(
        "doctor",
        help="check this node's set-up and say what to fix",
        description=(
            "Check FUSE, overlayfs, kernel features, containerd's configuration and its view of the shoal "
            "plugin, shoal's socket, the root's permissions, the region and registry credentials. One line per "
            "check; exit status 1 if any failed."
        ),
    )
    p.add_argument("--root", default=DEFAULT_ROOT, metavar="DIR", help=f"shoal node's root (default {DEFAULT_ROOT})")
    p.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"shoal node's snapshotter socket (default {DEFAULT_SOCKET})")
    p.add_argument("--config", metavar="FILE", help="shoal node's configuration file (for the region and the CRI image service)")
    p.add_argument("--containerd-config", default=DEFAULT_CONFIG, metavar="FILE",
                   help=f"containerd's configuration (default {DEFAULT_CONFIG})")
    p.add_argument("--containerd-address", metavar="SOCK",
                   help=f"containerd's socket (default: its configuration's [grpc] address, else {DEFAULT_CONTAINERD_ADDRESS})")
    p.add_argument("--runtime-handler", default=DEFAULT_HANDLER, metavar="NAME",
                   help=f"the runtime handler that should use shoal (default {DEFAULT_HANDLER})")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_doctor)
