"""The node's one control socket, ROOT/fs.sock, served by the layer file system process
(which owns the FUSE mount and the node's fetch chain, and so its swarm). One JSON
request per line, one JSON answer per line (shoal/localrpc.py: `call` and `Server`);
snapshotter/fs/client.py FSClient has a typed method for every op:

    {"op": "ping"}                                    -> {"pid", "version"[, "listen_port" of the swarm]}
    {"op": "load", "id": HEX}                         -> {"number"} | {"refused", "digest_mismatch"}
    {"op": "unload", "id": HEX}                       -> {"unloaded": bool}
    {"op": "status"}                                  -> {"layers", "uptime_s", "ops", "prefetch",
                                                          "store": the data path's figures}
    {"op": "profile", "layers": [DIGEST]?}            -> {"chunks": [[digest, start, end], ...]}
    {"op": "prefetch", "chunks": [ENTRY]?, "whole": [DIGEST]?, "part": [I, N]?, "background": bool?,
     "sparse": [DIGEST]?}
                                                      -> {"queued"}
                                                      (part: node I of a preheat job's N: its
                                                       own part of the chunks first, wrapping
                                                       around; prefetch/warmup.py. None: 0 of 1;
                                                       background: a preheat's, not a start's;
                                                       sparse: FSClient.prefetch)
    {"op": "warmth", "chunks": [ENTRY]?, "whole": [DIGEST]?}    -> {"layers": [row], "prefetch"}
    {"op": "prove", "id": HEX, "urgent": bool?}       -> {"diff_id"} | {"error", "final"}
    {"op": "mark_bad", "id": HEX, "reason": TEXT}     -> {}
    {"op": "credentials", "registry", "repository", "username"?, "password"?, "ttl"?}
                                                      -> {}: the node's fetch chain reads that
                                                         repository with them (builder/oci/auth.py
                                                         provide) for ttl seconds; no username:
                                                         forget them. From the CRI proxy
                                                         (snapshotter/criproxy.py); never logged
    {"op": "stats"}, {"op": "download", ...}          -> the swarm's ops (p2p/control.py), when
    {"op": "fetch_blob", ...}, {"op": "forget_blob"}     the node's fetch chain has a swarm
                                                         (fetch_blob: a whole blob the node
                                                         process unpacks, through the bulk path)

HEX is a layer's blob digest hex (ROOT/layers/HEX), ENTRY an access profile's row
(prefetch/profile.py); warmth rows and the prefetch figures are prefetch/warmup.py's.
`load` of a layer without its TOC reads the TOC through the node's fetch chain first
(fs/server.py); a layer whose TOC is bad (its bytes fail the TOC digest at every source
that sent them, or it does not parse) is answered {"refused": TEXT, "digest_mismatch":
bool}, nothing mounted; FSClient.load raises DigestMismatch or FormatError for it.
("store" keeps its name on the wire: a node talks to a server started by the one before.)

Threads: localrpc.Server answers each connection on a thread of its own. Every op that
touches the file system's layer tables runs under its `state` lock (LayerFS); what takes
long (parsing a TOC, waiting for a proof, a swarm download, dropping cached pages,
notifying the kernel of an unloaded layer) runs outside it.
Errors: an op raises ShoalError, OSError, ValueError or KeyError, logged here and
answered {"ok": false, "error"} by the server; an unknown op is a ShoalError.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prefetch.warmup import check_part
from shoal.errors import DigestMismatch, FormatError, ShoalError

if TYPE_CHECKING:
    from snapshotter.fs.server import LayerFS

log = logging.getLogger("shoal.fs")

SOCKET_NAME = "fs.sock"  # ROOT/fs.sock
SWARM_OPS = ("stats", "download", "fetch_blob", "forget_blob")  # served by the swarm's Control (p2p/control.py)


def software_version() -> str:
    """The version a node compares with its layer file system's (an upgrade hands the
    FUSE session over to a server of the node's version): $SHOAL_VERSION when set (what
    a package's wrapper or a test sets), else the installed package's."""
    env = os.environ.get("SHOAL_VERSION")
    if env:
        return env
    try:
        return importlib.metadata.version("shoal")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

Ops = Callable[[dict], dict]


class NodeControl:
    """The ops of the node's control socket over one layer file system and, when the
    node's fetch chain has a swarm, the swarm's ops (`swarm`: p2p/control.Control.handle)."""

    def __init__(self, fs: LayerFS, swarm: Ops | None = None) -> None:
        self.fs, self.swarm = fs, swarm
        self.ops: dict[str, Ops] = {
            "ping": self.ping, "load": self.load, "unload": self.unload, "status": self.status,
            "profile": self.profile, "prefetch": self.prefetch, "warmth": self.warmth, "prove": self.prove,
            "mark_bad": self.mark_bad, "credentials": self.credentials, **dict.fromkeys(SWARM_OPS, self.swarm_op),
        }

    def handle(self, req: dict) -> dict:
        op = req.get("op")
        fn = self.ops.get(op) if isinstance(op, str) else None
        if fn is None:
            raise ShoalError(f"unknown op {op!r}")
        try:
            return fn(req)
        except (ShoalError, OSError, ValueError, KeyError) as e:
            shown = {k: ("***" if k == "password" else v) for k, v in req.items()}
            log.error("control %s: %s", json.dumps(shown)[:200], e)
            raise

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) under the file system's state lock."""
        with self.fs.state:
            return fn(*args)

    # --- the layer file system's ops

    def ping(self, req: dict) -> dict:
        out: dict = {"pid": os.getpid(), "version": software_version()}
        if self.swarm is not None:
            out.update(self.swarm({"op": "ping"}))
        return out

    def load(self, req: dict) -> dict:
        layer_id = str(req["id"])
        layer = self._on_loop(self.fs.layers.get, layer_id)
        if layer is None:  # fetching and parsing a TOC takes a while: not on the event loop
            try:
                parts = self.fs.read_layer(layer_id)
            except FormatError as e:
                log.error("load of layer %s refused: %s", layer_id, e)
                return {"refused": str(e), "digest_mismatch": isinstance(e, DigestMismatch)}
            layer = self._on_loop(self.fs.register, layer_id, *parts)
        return {"number": layer.number}

    def unload(self, req: dict) -> dict:
        return {"unloaded": self.fs.unload(str(req["id"]))}  # (it notifies the kernel: not under the lock)

    def status(self, req: dict) -> dict:
        from builder.oci.auth import provided_statistics

        return self._on_loop(lambda: {**self.fs.status(), "store": self.fs.data_path_statistics(),
                                      "credentials": provided_statistics()})

    def profile(self, req: dict) -> dict:
        return {"chunks": self.fs.trace.profile(req.get("layers"))}  # (the trace is thread-safe)

    def _entries(self, req: dict) -> tuple[list, list]:
        entries, whole = req.get("chunks", []), req.get("whole", [])
        if not isinstance(entries, list) or not isinstance(whole, list):
            # a malformed request is a ValueError, answered as such (a TypeError would be a bug's)
            raise ValueError(f"{req.get('op')} needs lists of chunks and of whole layers")  # noqa: TRY004
        return entries, whole

    def prefetch(self, req: dict) -> dict:
        entries, whole = self._entries(req)
        part = check_part(req.get("part"))  # (a ValueError, answered as such)
        background = req.get("background", False) is True
        sparse = req.get("sparse") or []
        if not isinstance(sparse, list) or not all(isinstance(d, str) for d in sparse):
            raise ValueError("prefetch: sparse must be a list of layer digests")
        warmup = self.fs.warmup
        # a preheat's profile (background, no whole layers) is paged in as well: warmup.prefetch
        return {"queued": self._on_loop(lambda: warmup.prefetch(entries + warmup.whole_layers(whole), part,
                                                                background, sparse, page_in=background and not whole))}

    def warmth(self, req: dict) -> dict:
        entries, whole = self._entries(req)

        def measure() -> dict:
            warmup = self.fs.warmup
            rows = warmup.warmth(entries + warmup.whole_layers(whole))
            named = {r["digest"] for r in rows}
            loaded = {layer.blob.digest for layer in self.fs.layers.values()}
            # whole layers not loaded yet: named, not warm
            rows += [{"digest": d, "loaded": d in loaded, "target_chunks": 0, "target_bytes": 0, "warm_chunks": 0,
                      "warm_bytes": 0} for d in whole if isinstance(d, str) and d not in named]
            return {"layers": rows, "prefetch": warmup.statistics()}

        return self._on_loop(measure)

    def prove(self, req: dict) -> dict:
        future = self._on_loop(self.fs.prove, str(req["id"]), bool(req.get("urgent")))
        return dict(future.result())  # waits on this connection's thread

    def mark_bad(self, req: dict) -> dict:
        layer_id = str(req["id"])
        self._on_loop(self.fs.mark_bad, layer_id, str(req.get("reason") or "marked bad"))
        self.fs.drop_cached_pages(layer_id)
        return {}

    def credentials(self, req: dict) -> dict:
        from builder.oci.auth import Credentials, provide

        registry, repository, username = req.get("registry"), req.get("repository"), req.get("username")
        ttl, password = req.get("ttl", 0.0), req.get("password", "")
        if not (isinstance(registry, str) and registry and isinstance(repository, str) and repository):
            raise ValueError("credentials: needs a registry and a repository")
        if username is None:
            provide(registry, repository, None)
            return {}
        if not (isinstance(username, str) and isinstance(password, str) and isinstance(ttl, (int, float))):
            raise ValueError("credentials: username and password are strings, ttl a number")  # noqa: TRY004
        provide(registry, repository, Credentials(username, password), float(ttl))
        return {}

    # --- the swarm's

    def swarm_op(self, req: dict) -> dict:
        if self.swarm is None:
            raise ShoalError(f"{req.get('op')}: the swarm is off on this node")
        return self.swarm(req)
