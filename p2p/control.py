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
    {"op": "fetch_blob", "blob": BLOB, "metadata_wait": S, "stall": S}
                                                          -> {"path", "seconds", "size"}
    {"op": "forget_blob", "blob": BLOB, "why": TEXT}      -> {}

`layer` names a layer the node provides (its digest or hex; the snapshotter side says
where its blob lives: `resolve_layer`); BLOB is {"registry", "repository", "digest", "size",
"plain_http"}. A download with `wait` (the default) answers when the blob is complete,
checked against its digest and seeded; without, at once.

`fetch_blob` is the bulk path for a blob that is not a layer the file system serves: the
whole blob of a layer the node process unpacks (snapshotter/nodefetch.py). Its size must
be known. It is a `download` that waits for the metadata up to `metadata_wait` seconds
while the region says "not yet" (a cold region fills the blob first and makes the
metadata from the verified copy; any other "no" answers at once), and that gives up
when no piece has come in for `stall` seconds (every piece in, the file's digest check
does not count as a stall). The answer's path is the complete file in the torrent
storage, checked against the blob's sha256 (with `verify_complete`) and seeded until
evicted; the caller reads it there (no second copy) and checks the digest as it reads.
The errors (ShoalError, answered {"ok": false}) mean "not through the swarm": no
metadata, no peer certificate, the blob failed its digest (torrent dropped), a stall;
the caller fetches the blob some other way. `forget_blob` drops the blob's torrent and
its file (the caller found the file not to hash to the digest: it rotted after the check).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from cache.source import BlobRef, FetchChain, NotHere
from shoal.digest import check_digest, is_digest
from shoal.errors import FormatError, ShoalError, TransportError

log = logging.getLogger("shoal.swarm")

if TYPE_CHECKING:
    from p2p.swarm import Swarm

_WATCH_EVERY = 1.0  # seconds between looks at a fetch_blob's progress

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
        if op == "fetch_blob":
            return self.fetch_blob(req)
        if op == "forget_blob":
            if self.swarm is not None:
                self.swarm.drop(BlobRef.from_dict(req.get("blob")), str(req.get("why") or "forgotten")[:200])
            return {}
        raise ShoalError(f"unknown op {op!r}")

    def fetch_blob(self, req: dict) -> dict:
        """The `fetch_blob` op (module doc); runs on the control connection's thread."""
        if self.swarm is None:
            raise ShoalError("fetch_blob: the swarm is off on this node")
        blob = BlobRef.from_dict(req.get("blob"))
        if blob.size is None:
            raise FormatError(f"fetch_blob: {blob}: the blob's size is not known")
        metadata_wait, stall = float(req.get("metadata_wait", 0.0)), float(req.get("stall", 60.0))
        start = time.monotonic()
        fut = self._start_waiting(blob, start + metadata_wait)
        held, moved = (-1, 0), time.monotonic()
        while True:
            try:
                path = fut.result(timeout=_WATCH_EVERY)
                break
            except TimeoutError:
                pass
            now, seen = time.monotonic(), self.swarm.pieces_held(blob)
            if seen[0] < 0:  # gone: its future fails in a moment (torrent removed)
                continue
            if seen != held or seen[0] == seen[1]:  # a piece came, or all are in and the file is checked
                held, moved = seen, now
            elif now - moved > stall:
                raise TransportError(f"fetch_blob: {blob}: no piece came in {stall:.0f}s ({held[0]} of {held[1]} "
                                     "held)")
        return {"path": path, "seconds": time.monotonic() - start, "size": blob.size}

    def _start_waiting(self, blob: BlobRef, until: float) -> Future:
        """swarm.start_download(blob), asked again while the region says its metadata is
        not made yet (a fill under way) and `until` has not passed; NotHere otherwise."""
        assert self.swarm is not None
        waited, t0 = False, time.monotonic()
        while True:
            try:
                fut = self.swarm.start_download(blob)
                if waited:
                    log.info("%s: metadata after %.1fs; downloading it through the swarm", blob,
                             time.monotonic() - t0)
                return fut
            except NotHere:
                retry = self.swarm.metadata.waiting(blob.digest)
                if retry is None or time.monotonic() + retry > until:
                    raise
                if not waited:
                    log.info("%s: the region fills the blob before it has its metadata: waiting", blob)
                    waited = True
                time.sleep(max(0.05, retry))
