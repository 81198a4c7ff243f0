"""`shoal install containerd`: put shoal into an existing containerd configuration, and
take it out again.

What an install adds to the configuration file (version 2, containerd 1.6 and 1.7):

    [proxy_plugins.shoal]                       type = "snapshot", address = SOCKET
    [plugins."io.containerd.grpc.v1.cri".containerd]
      disable_snapshot_annotations = false      the CRI plugin passes the image reference
                                                and layer digests that lazy layers need
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.HANDLER]
      runtime_type = "io.containerd.runc.v2"    a runc runtime handler whose snapshotter is
      snapshotter = "shoal"                     shoal (containerd 1.7+; 1.6 drops the key),
      options = (a copy of the runc handler's)  for pods of RuntimeClass HANDLER

It never makes shoal the default snapshotter unless asked (`--default-snapshotter`):
system pods, and shoal's own pod, keep containerd's default, so a node whose shoal is
down still starts them (deploy/kubernetes/README.md).

Contract:
- Everything else in the file is kept: other keys, other proxy_plugins, comments.
- Idempotent: when the file already holds what an install would write, nothing is
  written and containerd is not restarted.
- containerd is restarted (`--restart-command`) only when the file changed, and only
  after shoal's socket answers gRPC, so containerd never comes up pointing at a
  snapshotter that is not there. If the socket does not answer, the file is untouched.
- The first install keeps the original bytes in CONFIG.pre-shoal and what it changed
  in CONFIG.shoal.json; `--uninstall` writes the original back byte for byte when the
  file is as the install left it, or, when someone edited it since, removes only what
  the install added (their edits stay). Then both side files are removed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from shoal.errors import ShoalError, UsageError
from shoal.fsutil import replace_file

DEFAULT_CONFIG = "/etc/containerd/config.toml"
DEFAULT_HANDLER = "shoal"
DEFAULT_RESTART = "systemctl restart containerd"
CRI = "io.containerd.grpc.v1.cri"
PLUGIN = "shoal"  # the proxy plugin's name: the snapshotter name containerd clients use
RUNC_V2 = "io.containerd.runc.v2"
MISSING = "(missing)"  # a key the file did not have before the install (in CONFIG.shoal.json)


@dataclass
class Options:
    config: Path = Path(DEFAULT_CONFIG)
    socket: str = "/run/shoal/snapshotter.sock"
    handler: str = DEFAULT_HANDLER
    restart_command: list[str] = field(default_factory=lambda: shlex.split(DEFAULT_RESTART))
    wait_socket: float = 60.0  # seconds to wait for shoal's socket before changing anything
    default_snapshotter: bool = False  # containerd 1.6's only way to lazy-start CRI pods: every pod uses shoal

    @property
    def backup(self) -> Path:
        return self.config.with_name(self.config.name + ".pre-shoal")

    @property
    def state(self) -> Path:
        return self.config.with_name(self.config.name + ".shoal.json")

    @contextlib.contextmanager
    def locked(self):
        """One install or uninstall in this file's directory at a time (a DaemonSet's
        container and an operator's shell): an flock on the directory, no file left."""
        self.config.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.config.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


# --- the configuration edit (no I/O) -----------------------------------------------------


def _table(container, key: str):
    """container[key] as a table, made (as a super-table: no header of its own) if absent."""
    import tomlkit

    if key not in container:
        container[key] = tomlkit.table(is_super_table=True)
    value = container[key]
    if not isinstance(value, dict):
        raise ShoalError(f"{key} is not a table (containerd expects one)")
    return value


def _cri(doc):
    return _table(_table(_table(doc, "plugins"), CRI), "containerd")


def _parse(text: str, where: str):
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as e:
        raise ShoalError(f"{where}: not valid TOML: {e}") from None
    version = doc.get("version", 1)
    if version != 2:
        raise ShoalError(
            f"{where}: containerd configuration version {version}; shoal install edits version 2 "
            "(containerd 1.6/1.7: `containerd config default` writes one; version 1 tables are named "
            "differently and version 3 is containerd 2.x)"
        )
    return doc


def merged(text: str, opts: Options, where: str = "config") -> tuple[str, dict]:
    """The configuration `text` with shoal installed, and the prior values of the keys it
    set that were there before (MISSING for those that were not)."""
    doc = _parse(text, where)
    try:
        return _merge(doc, opts)
    except ShoalError as e:
        raise ShoalError(f"{where}: {e}") from None


def _merge(doc, opts: Options) -> tuple[str, dict]:
    import tomlkit

    prior: dict = {}
    proxy = _table(doc, "proxy_plugins")
    prior["proxy_plugin"] = proxy[PLUGIN].unwrap() if PLUGIN in proxy else MISSING
    plugin = tomlkit.table()
    plugin["type"] = "snapshot"
    plugin["address"] = opts.socket
    if PLUGIN not in proxy or proxy[PLUGIN].unwrap() != plugin.unwrap():
        proxy[PLUGIN] = plugin

    cri = _cri(doc)
    prior["disable_snapshot_annotations"] = cri.get("disable_snapshot_annotations", MISSING)
    if cri.get("disable_snapshot_annotations") is not False:
        cri["disable_snapshot_annotations"] = False
    prior["snapshotter"] = cri.get("snapshotter", MISSING)
    if opts.default_snapshotter and cri.get("snapshotter") != PLUGIN:
        cri["snapshotter"] = PLUGIN

    runtimes = _table(cri, "runtimes")
    prior["runtime"] = runtimes[opts.handler].unwrap() if opts.handler in runtimes else MISSING
    runtime = tomlkit.table()
    runtime["runtime_type"] = RUNC_V2
    runtime["snapshotter"] = PLUGIN
    runc = runtimes.get("runc")
    if isinstance(runc, dict) and isinstance(runc.get("options"), dict):
        # The same runc options (SystemdCgroup above all: it must match the kubelet's
        # cgroup driver) as the default handler.
        runtime["options"] = runc["options"].unwrap()
    if opts.handler not in runtimes or runtimes[opts.handler].unwrap() != runtime.unwrap():
        runtimes[opts.handler] = runtime
    return tomlkit.dumps(doc), {k: (v.unwrap() if hasattr(v, "unwrap") else v) for k, v in prior.items()}


def removed(text: str, opts: Options, prior: dict, where: str = "config") -> str:
    """`text` without what an install added: each key it set back to its prior value."""
    import tomlkit

    doc = _parse(text, where)

    def put(container, key: str, value) -> None:
        if value == MISSING:
            container.pop(key, None)
        else:
            container[key] = tomlkit.item(value)

    if "proxy_plugins" in doc:
        put(doc["proxy_plugins"], PLUGIN, prior.get("proxy_plugin", MISSING))
    try:
        cri = doc["plugins"][CRI]["containerd"]
    except KeyError:
        return tomlkit.dumps(doc)
    put(cri, "disable_snapshot_annotations", prior.get("disable_snapshot_annotations", MISSING))
    if cri.get("snapshotter") == PLUGIN:
        put(cri, "snapshotter", prior.get("snapshotter", MISSING))
    if "runtimes" in cri:
        put(cri["runtimes"], opts.handler, prior.get("runtime", MISSING))
    return tomlkit.dumps(doc)


# --- the node's side: socket, file, restart --------------------------------------------------


def _wait_socket(opts: Options) -> None:
    from snapshotter.grpc_server import socket_answers  # gRPC: loaded only when waited for

    deadline = time.monotonic() + opts.wait_socket
    while True:
        if socket_answers(opts.socket, timeout=min(2.0, max(0.1, deadline - time.monotonic()))):
            return
        if time.monotonic() >= deadline:
            raise ShoalError(
                f"shoal's socket {opts.socket} does not answer after {opts.wait_socket:.0f}s "
                f"(is `shoal node` running?); {opts.config} not changed"
            )
        time.sleep(0.2)


def _restart(opts: Options) -> None:
    if not opts.restart_command:
        return
    try:
        proc = subprocess.run(opts.restart_command, check=False, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ShoalError(f"{opts.config} changed, but restarting containerd failed: {shlex.join(opts.restart_command)}: {e}") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
        raise ShoalError(
            f"{opts.config} changed, but restarting containerd failed: {shlex.join(opts.restart_command)} "
            f"exited {proc.returncode}: {tail[0]}"
        )


def _text(data: bytes, path: Path) -> str:
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        raise ShoalError(f"{path}: not UTF-8 text (byte {e.start}); not a containerd configuration") from None


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def install(opts: Options) -> dict:
    """Install into opts.config; {"config", "changed", "restarted", "backup"}."""
    try:
        original = opts.config.read_bytes()
        existed = True
    except FileNotFoundError:
        original, existed = b"version = 2\n", False
    except OSError as e:
        raise ShoalError(f"{opts.config}: cannot read: {e.strerror}") from None
    text, prior = merged(_text(original, opts.config), opts, str(opts.config))
    new = text.encode()
    result = {"config": str(opts.config), "changed": new != original or not existed, "restarted": False,
              "backup": str(opts.backup)}
    if not result["changed"]:
        return result
    _wait_socket(opts)
    if not opts.state.exists():
        # The first install: what was there before it (kept until --uninstall).
        replace_file(opts.backup, original)
        state = {"original_existed": existed, "prior": prior}
    else:
        state = json.loads(opts.state.read_text())
    opts.config.parent.mkdir(parents=True, exist_ok=True)
    replace_file(opts.config, new)
    state["installed"] = _sha256(new)
    replace_file(opts.state, json.dumps(state, indent=1).encode())
    _restart(opts)
    result["restarted"] = bool(opts.restart_command)
    return result


def uninstall(opts: Options) -> dict:
    """Take shoal out of opts.config; {"config", "changed", "restarted", "how"}."""
    result = {"config": str(opts.config), "changed": False, "restarted": False, "how": "not installed"}
    try:
        state = json.loads(opts.state.read_text())
        original = opts.backup.read_bytes()
    except FileNotFoundError:
        return result
    except (OSError, ValueError) as e:
        raise ShoalError(f"{opts.state}: cannot read the install record: {e}") from None
    try:
        current = opts.config.read_bytes()
    except FileNotFoundError:
        current = None
    if current is not None and _sha256(current) == state.get("installed"):
        result["how"] = "restored the original"
        if state.get("original_existed", True):
            replace_file(opts.config, original)
        else:
            opts.config.unlink()
        result["changed"] = True
    elif current is not None:
        result["how"] = "edited since the install: removed shoal's entries, kept the rest"
        new = removed(_text(current, opts.config), opts, state.get("prior", {}), str(opts.config)).encode()
        if new != current:
            replace_file(opts.config, new)
            result["changed"] = True
    opts.state.unlink()
    opts.backup.unlink()
    if result["changed"]:
        _restart(opts)
        result["restarted"] = bool(opts.restart_command)
    return result


def containerd_minor(binary: str = "containerd") -> tuple[int, int] | None:
    """containerd's (major, minor) from `containerd --version`, or None if unknown."""
    import re

    try:
        out = subprocess.run([binary, "--version"], check=False, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bv?(\d+)\.(\d+)\.\d+", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


# --- the command -----------------------------------------------------------------------------


def cmd_install(args: argparse.Namespace) -> int:
    if args.target != "containerd":
        raise UsageError(f"unknown target {args.target!r} (known: containerd)")
    try:
        import tomlkit  # noqa: F401
    except ImportError:
        raise ShoalError("shoal install needs the node dependencies (pip install 'shoal[node]'): no tomlkit") from None
    opts = Options(
        config=Path(args.config), socket=os.path.abspath(args.socket), handler=args.runtime_handler,
        restart_command=shlex.split(args.restart_command), wait_socket=args.wait,
        default_snapshotter=args.default_snapshotter,
    )
    with opts.locked():
        result = uninstall(opts) if args.uninstall else install(opts)
    if not args.uninstall:
        version = containerd_minor()
        if version is not None and version < (1, 7) and not opts.default_snapshotter:
            result["note"] = (
                f"containerd {version[0]}.{version[1]} ignores the runtime handler's snapshotter "
                f"(1.7+ honours it): pods of RuntimeClass {opts.handler} use the default snapshotter; "
                "see deploy/kubernetes/README.md for the options on 1.6"
            )
    if args.json:
        print(json.dumps(result))
    else:
        verb = "uninstalled" if args.uninstall else "installed"
        state = ("changed, containerd restarted" if result["restarted"] else "changed") if result["changed"] \
            else "no change, containerd not restarted"
        extra = f" ({result['how']})" if args.uninstall else ""
        print(f"shoal {verb} in {opts.config}: {state}{extra}")
        if "note" in result:
            print(f"note: {result['note']}", file=sys.stderr)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from snapshotter.node import DEFAULT_SOCKET

    p = subparsers.add_parser(
        "install",
        help="add shoal to containerd's configuration (or take it out)",
        description=(
            "Merge shoal's proxy snapshotter, the CRI plugin's snapshot annotations and a runc runtime "
            "handler whose snapshotter is shoal into an existing containerd configuration (version 2), "
            "keeping everything else. containerd is restarted only when the file changed, and only after "
            "shoal's socket answers. --uninstall restores the configuration from before the install."
        ),
    )
    p.add_argument("target", metavar="containerd", help="what to configure (containerd)")
    p.add_argument("--config", default=DEFAULT_CONFIG, metavar="FILE",
                   help=f"containerd's configuration file (default {DEFAULT_CONFIG})")
    p.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"shoal node's snapshotter socket (default {DEFAULT_SOCKET})")
    p.add_argument("--runtime-handler", default=DEFAULT_HANDLER, metavar="NAME",
                   help=f"the CRI runtime handler (RuntimeClass handler) that uses shoal (default {DEFAULT_HANDLER})")
    p.add_argument("--restart-command", default=DEFAULT_RESTART, metavar="CMD",
                   help=f"how to restart containerd after a change (default {DEFAULT_RESTART!r}; '' = do not)")
    p.add_argument("--wait", type=float, default=60.0, metavar="SECONDS",
                   help="how long to wait for shoal's socket before giving up (default 60)")
    p.add_argument("--default-snapshotter", action="store_true",
                   help="also make shoal the CRI plugin's default snapshotter (every pod; containerd 1.6's only "
                   "way to lazy-start pods: read deploy/kubernetes/README.md first)")
    p.add_argument("--uninstall", action="store_true", help="restore the configuration from before the install")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_install)
