"""A node's data path without FUSE or containerd, as a process: the fetch chain that
snapshotter/assemble.py builds (swarm, region, origin) behind a control socket.

For the swarm tests and benchmark, which run many of these in network namespaces:

    python -m p2p.agent --root DIR --control SOCK --config-json '{"region_url": ..., "swarm": {...}}'

It prints one line `ready <pid> <listen port>` when it serves. The control socket (a unix
socket: it lives in the file system, so the test reaches it from outside the namespace)
takes one JSON request per line and answers one JSON line:

    {"op": "ping"}
    {"op": "read", "blob": BLOB, "ranges": [[a, b], ...]}      -> sha256 of the bytes
    {"op": "read_all", "blob": BLOB, "chunk": N, "threads": T}  -> the whole blob by ranges
    {"op": "download", "blob": BLOB, "timeout": S}              -> bulk through the swarm
    {"op": "fetch_direct", "blob": BLOB, "source": "region"}    -> the whole blob from one source
    {"op": "stats"}
BLOB is {"registry", "repository", "digest", "size", "plain_http"}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from cache.source import BlobRef
from shoal.errors import ShoalError

log = logging.getLogger("shoal.agent")


def _blob(d: dict) -> BlobRef:
    return BlobRef(d["registry"], d["repository"], d["digest"], d.get("size"), bool(d.get("plain_http")))


class Agent:
    def __init__(self, config: dict) -> None:
        from snapshotter.assemble import make_chain

        self.chain = make_chain(config)
        self.swarm = getattr(self.chain, "swarm", None)

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "ping":
            return {"pid": os.getpid(), "listen_port": self.swarm.listen_port if self.swarm else 0}
        if op == "stats":
            return {"stats": self.chain.statistics()}
        blob = _blob(req["blob"])
        start = time.monotonic()
        if op == "read":
            datas = self.chain.read_ranges(blob, [tuple(r) for r in req["ranges"]])
            h = hashlib.sha256()
            for d in datas:
                h.update(d)
            return {"sha256": h.hexdigest(), "bytes": sum(map(len, datas)), "seconds": time.monotonic() - start}
        if op == "read_all":
            return self._read_all(blob, int(req.get("chunk", 1 << 20)), int(req.get("threads", 4)), start)
        if op == "download":
            if self.swarm is None:
                raise ShoalError("no swarm in this chain")
            path = self.swarm.download(blob, req.get("timeout"))
            return {"path": path, "seconds": time.monotonic() - start}
        if op == "fetch_direct":
            source = next(s for s in self.chain.sources if s.name == req.get("source", "region"))
            return self._read_all(blob, int(req.get("chunk", 4 << 20)), int(req.get("threads", 4)), start,
                                  read=source.read_ranges)
        raise ShoalError(f"unknown op {op!r}")

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


def _serve(agent: Agent, conn: socket.socket) -> None:
    with conn, conn.makefile("rwb") as fh:
        for line in fh:
            try:
                out = {"ok": True, **agent.handle(json.loads(line))}
            except (ShoalError, OSError, ValueError, KeyError, StopIteration, TimeoutError) as exc:
                out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            except Exception as exc:
                log.exception("agent: %s", line[:200])
                out = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            fh.write(json.dumps(out).encode() + b"\n")
            fh.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="p2p.agent", description=__doc__.split("\n\n")[0])
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
    if os.path.exists(args.control):
        os.unlink(args.control)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(args.control)
    server.listen(64)
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()
        server.close()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    port = agent.swarm.listen_port if agent.swarm else 0
    print(f"ready {os.getpid()} {port}", flush=True)
    while not stop.is_set():
        try:
            conn, _ = server.accept()
        except OSError:
            break
        threading.Thread(target=_serve, args=(agent, conn), daemon=True).start()
    agent.chain.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
