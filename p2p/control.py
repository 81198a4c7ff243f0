"""The swarm's control ops: the bulk path (a whole blob through the swarm, for prefetch
and background completion) and the chain's figures.

The layer file system process serves them on the node's one control socket, ROOT/fs.sock,
beside its own ops (snapshotter/fs/control.py), when the swarm is on (p2p/chain.py);
tests/lab/agent.py serves the same ops plus its own. The protocol is shoal/localrpc.py's
(one JSON request per line, one JSON answer per line):

    {"op": "ping"}                                        -> {"pid", "listen_port"}
    {"op": "stats"}                                       -> {"stats": chain.statistics()}
    {"op": "download", "layer": HEX, "timeout": S}        -> {"path", "seconds"}
    {"op": "download", "blob": BLOB, "wait": false}       -> {"started": true}

`layer` names a layer the node provides (its digest or hex; the snapshotter side says
where its blob lives: `resolve_layer`); BLOB is {"registry", "repository", "digest", "size",
"plain_http"}. A download with `wait` (the default) answers when the blob is complete,
checked against its digest and seeded; without, at once.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cache.source import BlobRef, FetchChain
from shoal.digest import check_digest, is_digest
from shoal.errors import ShoalError

log = logging.getLogger("shoal.swarm")

if TYPE_CHECKING:
    from p2p.swarm import Swarm

# resolve_layer(hex) -> the blob of the layer this node provides under that id, or None
# (not provided). Supplied by the snapshotter side, which alone knows its layers' layout;
# called on the control socket's threads; may raise OSError/ValueError (answered as errors).
ResolveLayer = Callable[[str], "BlobRef | None"]


class Control:
    """The ops on a chain whose first source may be the swarm (p2p/chain.py SwarmChain).

    chain: the node's fetch chain (statistics()); swarm: its Swarm, or None (the swarm
    is off: download is refused); resolve_layer: see ResolveLayer (None: only `blob`
    downloads). handle(request) -> answer is the entry point (shoal.localrpc.Server's
    handler: raising ShoalError answers {"ok": false, "error": ...})."""

    def __init__(self, chain: FetchChain, swarm: Swarm | None = None,
                 resolve_layer: ResolveLayer | None = None) -> None:
        self.chain = chain
        self.swarm = swarm
        self.resolve_layer = resolve_layer

    def blob(self, req: dict) -> BlobRef:
        if "blob" in req:
            return BlobRef.from_dict(req["blob"])
        layer = str(req.get("layer", ""))
        layer = check_digest(layer).split(":", 1)[1] if ":" in layer else layer
        if self.resolve_layer is None or not is_digest("sha256:" + layer):
            raise ShoalError(f"download: want a blob or the id of a layer this node provides, not {layer[:80]!r}")
        blob = self.resolve_layer(layer)
        if blob is None:
            raise ShoalError(f"layer {layer}: not provided by this node")
        return blob

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        if op == "ping":
            return {"pid": os.getpid(), "listen_port": self.swarm.listen_port if self.swarm else 0}
        if op == "stats":
            return {"stats": self.chain.statistics()}
        if op == "download":
            if self.swarm is None:
                raise ShoalError("download: the swarm is off on this node")
            blob, start = self.blob(req), time.monotonic()
            if not req.get("wait", True):
                self.swarm.start_download(blob)
                return {"started": True}
            return {"path": self.swarm.download(blob, req.get("timeout")), "seconds": time.monotonic() - start}
        raise ShoalError(f"unknown op {op!r}")
