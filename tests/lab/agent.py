"""A node's data path without FUSE or containerd, as a process: the fetch chain that
snapshotter/assemble.py builds (swarm, region, origin) behind a control socket.

For the swarm benchmark (bench/swarm.py), which runs many of these in network namespaces:

    python -m tests.lab.agent --root DIR --control SOCK --config-json '{"region_url": ..., "swarm": {...}}'

It prints one line `ready <pid> <listen port>` when it serves. The control socket takes
the ops of p2p/control.py (ping, stats, download) and these:

    {"op": "read", "blob": BLOB, "ranges": [[a, b], ...]}      -> sha256 of the bytes
    {"op": "read_all", "blob": BLOB, "chunk": N, "threads": T}  -> the whole blob by ranges
    {"op": "fetch_direct", "blob": BLOB, "source": "region"}    -> the whole blob from one source
BLOB is {"registry", "repository", "digest", "size", "plain_http"}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from cache.source import BlobRef
from p2p.control import Control
from shoal.localrpc import Server as ControlServer

log = logging.getLogger("shoal.agent")


class Agent(Control):
    def __init__(self, config: dict) -> None:
        from p2p.chain import SwarmChain
        from snapshotter.assemble import make_chain

        chain = make_chain(config)
        super().__init__(chain, chain.swarm if isinstance(chain, SwarmChain) else None)

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op not in ("read", "read_all", "fetch_direct"):
            return super().handle(req)
        blob = BlobRef.from_dict(req["blob"])
        start = time.monotonic()
        if op == "read":
            datas = self.chain.read_ranges(blob, [tuple(r) for r in req["ranges"]])
            h = hashlib.sha256()
            for d in datas:
                h.update(d)
            return {"sha256": h.hexdigest(), "bytes": sum(map(len, datas)), "seconds": time.monotonic() - start}
        if op == "read_all":
            return self._read_all(blob, int(req.get("chunk", 1 << 20)), int(req.get("threads", 4)), start)
        source = next(s for s in self.chain.sources if s.name == req.get("source", "region"))
        return self._read_all(blob, int(req.get("chunk", 4 << 20)), int(req.get("threads", 4)), start,
                              read=source.read_ranges)

    def _read_all(self, blob: BlobRef, chunk: int, threads: int, start: float, read=None) -> dict:
        read = read or self.chain.read_ranges
        size = blob.size
        spans = [(a, min(a + chunk, size)) for a in range(0, size, chunk)]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            parts = list(pool.map(lambda span: read(blob, [span])[0], spans))
        h = hashlib.sha256()
        for part in parts:
            h.update(part)
        return {"sha256": h.hexdigest(), "bytes": sum(map(len, parts)), "seconds": time.monotonic() - start}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tests.lab.agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", required=True)
    p.add_argument("--control", required=True, help="unix socket path for requests")
    p.add_argument("--config-json", default="{}")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args(argv)
    level = os.environ.get("SHOAL_AGENT_LOG") or (logging.INFO if args.verbose else logging.WARNING)
    logging.basicConfig(level=level,
                        format=f"%(asctime)s agent[{os.getpid()}] %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    config = json.loads(args.config_json)
    config.setdefault("root", args.root)
    os.makedirs(args.root, exist_ok=True)
    agent = Agent(config)
    server = ControlServer(args.control, agent.handle)

    def on_signal(*_: object) -> None:
        server.close()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    port = agent.swarm.listen_port if agent.swarm else 0
    print(f"ready {os.getpid()} {port}", flush=True)
    server.serve_forever()
    agent.chain.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
