"""`shoal node`: registered by cli/main.py (COMMAND_MODULES). Imports nothing heavy at
module level, so `shoal` works without the node's dependencies installed."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import threading

from shoal.errors import ShoalError
from shoal.fsutil import PRIVATE_UMASK


def cmd_node(args: argparse.Namespace) -> int:
    missing = [m for m in ("grpc", "containerd") if importlib.util.find_spec(m) is None]
    if missing:
        raise ShoalError(f"shoal node needs the node dependencies (pip install 'shoal[node]'): no {', '.join(missing)}")
    from snapshotter.node import Node, load_config

    root_logger = logging.getLogger()
    if root_logger.level > logging.INFO:
        root_logger.setLevel(logging.INFO)  # a daemon says what it does
    config = load_config(args.config)
    # Everything the node and its layer file system make under ROOT is root's alone,
    # whatever umask it was started with (layer contents and snapshot roots get the modes
    # their layer or containerd's contract gives them, set explicitly).
    os.umask(PRIVATE_UMASK)

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        logging.getLogger("shoal.node").info("%s: shutting down", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    from dataclasses import asdict

    from snapshotter.remote import RemoteLayers

    data_path = asdict(config.fetch)
    data_path["root"] = os.path.abspath(args.root)  # the swarm's `download` takes layers of ROOT
    if config.swarm:
        from p2p.config import SwarmConfig

        warnings: list[str] = []
        SwarmConfig.from_dict(config.swarm, warnings)  # a bad value: a one-line error now, not in the fs server
        for w in warnings:
            logging.getLogger("shoal.node").warning("%s: %s", args.config, w)
        data_path["swarm"] = {"storage": os.path.join(os.path.abspath(args.root), "swarm"), **config.swarm}
    remote = RemoteLayers(args.root, data_path) if config.fetch.lazy else None
    if remote is None:
        logging.getLogger("shoal.node").info("[fetch] lazy = false: no layer file system, no lazy layers")
    node = Node(args.root, args.socket, config, remote=remote)
    node.start()
    worker = None
    try:
        from snapshotter.preheat import start_worker

        worker = start_worker(os.path.abspath(args.root), config)  # with [fetch] region_url: the region's work
        node.wait(stop)
    finally:
        if worker is not None:
            worker.stop()
        node.stop()
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from shoal.config import DEFAULT_ROOT
    from snapshotter.node import DEFAULT_SOCKET

    p = subparsers.add_parser(
        "node",
        help="run the node daemon (containerd snapshotter)",
        description=(
            "Run the node daemon: containerd's snapshots API on a unix socket, as a proxy "
            "snapshotter (configure containerd with [proxy_plugins.shoal] type = \"snapshot\" "
            "and this socket's address). Snapshot metadata lives under --root and survives "
            "restarts. Stops cleanly on SIGTERM or SIGINT."
        ),
    )
    p.add_argument("--root", default=DEFAULT_ROOT, metavar="DIR",
                   help=f"state directory: snapshots and their metadata (default {DEFAULT_ROOT})")
    p.add_argument("--socket", default=DEFAULT_SOCKET, metavar="PATH",
                   help=f"the snapshotter's gRPC socket for containerd (default {DEFAULT_SOCKET})")
    p.add_argument("--config", metavar="FILE", help="TOML configuration file (default: built-in defaults)")
    p.set_defaults(func=cmd_node)
