"""Warm the local node for an image: `shoal prefetch REF --root DIR` (per-node hooks),
through the node's control socket (snapshotter/fs/client.py) and its RemoteLayers.

What "warm" means is measured by the node's layer file system (its `warmth` op), never
assumed from a finished request:

- mode "profile": every lazy layer's TOC is loaded, and every chunk of the image's
  published access profile (bounded by `[fetch] prefetch_max_bytes`) is in the node's
  chunk store;
- mode "full": every lazy layer's TOC is loaded, and every chunk of every lazy layer
  (its whole content; tar headers are never read lazily) is in the chunk store.

Layers without a TOC (to be unpacked at prepare) are not warmed here; they are named in
the result (`unpacked_layers`). The work is the node's own: the layers are loaded by
RemoteLayers' warm-up (snapshotter/remote.py, as at an image's first prepare) and the
chunks fetched by the layer file system's prefetch threads (prefetch/warmup.py) through
the node's fetch chain, so they land in its store and a later `shoal pull` + start finds
them there.

States: the image is "ready" (warm), "running" (not yet; returned without --wait),
"timeout" or "failed"; the node "warm", "warming", "timeout" or "failed" with an error.
A prefetch that stops making progress is asked again (chunks already here are skipped);
after STALLED_ROUNDS rounds without a new chunk it has failed.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from builder.format.footer import location_from_annotations
from cache.source import BlobRef
from prefetch.profile import Profile
from prefetch.warmup import Warmth
from shoal.errors import ShoalError
from snapshotter.fs.client import FSClient
from snapshotter.remote import RemoteLayers

log = logging.getLogger("shoal.prefetch")

MODES = ("profile", "full")
POLL_S = 0.2
STALLED_ROUNDS = 5  # re-asked prefetches in a row that brought no chunk: failed


@dataclass
class LocalPrefetch:
    """One image's warm-up on the node at `root` (whose layer file system must run)."""

    image: str  # HOST/REPO[:TAG|@DIGEST]
    blob: BlobRef  # registry, repository and plain HTTP of the image (digest: its manifest)
    manifest: str
    descriptors: list  # the manifest's layer descriptors (documents.Descriptor)
    root: str
    mode: str = "profile"
    config: dict = field(default_factory=dict)  # the node's [fetch] table, as a dict
    part: tuple[int, int] = (0, 1)  # node I of a region preheat job's N: its own part first (prefetch/warmup.py)
    held: tuple[str, ...] = ()  # layers the region holds to the ranges asked (FSClient.prefetch `sparse`)

    def __post_init__(self) -> None:
        self.fs = FSClient(self.root, self.config)
        if not self.fs.running():
            raise ShoalError(f"no layer file system runs at {self.root}: start `shoal node --root {self.root}` first")
        # The hook asked for the profile: fetched whatever [fetch] prefetch_profiles says.
        self.remote = RemoteLayers(self.root, {**self.config, "prefetch_profiles": True}, self.fs)
        tocs = {d.digest: location_from_annotations(d.annotations) for d in self.descriptors}
        self.lazy = [digest for digest, loc in tocs.items() if loc is not None]
        # a lazy layer's TOC is part of what warm means (its layer loaded): its compressed
        # bytes count in the target, and as warm once the layer is loaded
        self.toc_bytes = {digest: loc.toc.length for digest, loc in tocs.items() if loc is not None}
        self.unpacked = [d.digest for d in self.descriptors if d.digest not in self.lazy]
        self.profile: Profile | None = None
        self._chunks: list | None = None  # what this job asks the layer fs for: profile entries,
        self._whole: list[str] | None = None  # or whole layers

    def start(self) -> None:
        """Load the lazy layers' TOCs (waits for them) and hand the chunks to fetch to
        the layer file system (which fetches them on its own threads)."""
        self.profile = self.remote.warm_image(self.blob, self.manifest, self.image, self.part, self.held)
        if self.mode == "profile":
            self._chunks = [list(c) for c in self.profile.chunks] if self.profile else []
        else:
            self._whole = self.lazy
            self.fs.prefetch(whole=self._whole, part=self.part, background=True, sparse=self.held)

    def measure(self) -> Warmth:
        reply = self.fs.warmth(self._chunks, self._whole)
        rows = {r["digest"]: r for r in reply["layers"]}
        empty = {"target_chunks": 0, "target_bytes": 0, "warm_chunks": 0, "warm_bytes": 0}
        loaded = {ly["digest"] for ly in self.fs.status().get("layers", [])}
        layers = []
        for d in self.lazy:
            row = dict(rows.get(d) or {"digest": d, "loaded": d in loaded, **empty})
            row["toc_bytes"] = toc = self.toc_bytes.get(d, 0)
            row["target_bytes"] += toc
            if row["loaded"]:
                row["warm_bytes"] += toc
            layers.append(row)
        w = Warmth(layers, int((reply.get("prefetch") or {}).get("jobs_pending", 0)))
        record_warmth(self.root, self.image, self.manifest, self.mode, w)
        return w

    def wait_warm(self, timeout: float, progress: Callable[[Warmth], None] | None = None) -> tuple[str, Warmth, str]:
        """Poll until warm or `timeout` seconds pass: (node state, last measure, error)."""
        deadline = time.monotonic() + timeout
        stalled, best = 0, -1
        while True:
            w = self.measure()
            if progress:
                progress(w)
            if w.warm:
                return "warm", w, ""
            failed = {d: self.remote.warm_errors[d] for d in w.not_loaded if d in self.remote.warm_errors}
            if failed:
                d, why = next(iter(failed.items()))
                return "failed", w, f"layer {d} not loaded: {why}"
            if time.monotonic() >= deadline:
                return "timeout", w, self.missing(w)
            if not w.jobs_pending:  # nothing on its way: ask again for what is missing
                stalled = stalled + 1 if w.warm_bytes <= best else 0
                best = max(best, w.warm_bytes)
                if stalled >= STALLED_ROUNDS:
                    return "failed", w, self.missing(w) + f" (fetches fail: see {self.root}/logs/fs.log)"
                self.fs.prefetch(self._chunks, self._whole, self.part, background=True, sparse=self.held)
            time.sleep(POLL_S)

    def peer_bytes(self) -> int | None:
        """The blob bytes the node's layer file system took from swarm peers so far (its
        `shoal status` figure; the node's, so starts at the same time count too), or None
        when the layer file system does not say."""
        from snapshotter.status import fetch_figures

        try:
            return int(fetch_figures(self.fs.status().get("store") or {})["bytes_from_peers"])
        except (ShoalError, OSError, ValueError, TypeError):
            return None

    def missing(self, w: Warmth) -> str:
        if w.not_loaded:
            return f"{len(w.not_loaded)} of {len(self.lazy)} layers not loaded ({w.not_loaded[0]}, ...)"
        cold = [r for r in w.layers if r["warm_bytes"] < r["target_bytes"]]
        chunks = sum(r["target_chunks"] - r["warm_chunks"] for r in cold)
        return (f"{chunks} chunks ({(w.target_bytes - w.warm_bytes) / 1e6:.1f} MB) of {len(cold)} layers not in the "
                f"chunk store ({cold[0]['digest']}, ...)" if cold else "")


def warm_local(image: str, blob: BlobRef, manifest: str, descriptors: list, root: str, mode: str, config: dict,
               node_name: str, wait: bool, timeout: float,
               progress: Callable[[Warmth], None] | None = None) -> tuple[dict, LocalPrefetch]:
    """Warm the node at `root` for `image`; the result in the preheat API's shape:
    {"image", "manifest", "state", "mode", "nodes": [{"name", "state", "warm_bytes",
    "target_bytes", "error"}], "unpacked_layers", "profile_chunks"}."""
    job = LocalPrefetch(image, blob, manifest, descriptors, root, mode, config)
    start = time.monotonic()
    job.start()
    if wait:
        node_state, w, error = job.wait_warm(max(0.0, timeout - (time.monotonic() - start)), progress)
    else:
        w = job.measure()
        node_state, error = ("warm" if w.warm else "warming"), ""
    state = {"warm": "ready", "warming": "running"}.get(node_state, node_state)
    result = {
        "image": image, "manifest": manifest, "state": state, "mode": mode,
        "nodes": [{"name": node_name, "state": node_state, "warm_bytes": w.warm_bytes,
                   "target_bytes": w.target_bytes, "error": error or None}],
        "unpacked_layers": job.unpacked,
        "profile_chunks": len(job.profile.chunks) if job.profile else None,
        "seconds": round(time.monotonic() - start, 2),
    }
    return result, job


def default_node_name() -> str:
    return os.uname().nodename


WARMTH_DIR = "prefetch"  # ROOT/prefetch/<manifest hex>.json: each image's last measured warmth
MAX_WARMTH_RECORDS = 256


def record_warmth(root: str, image: str, manifest: str, mode: str, w: Warmth) -> None:
    """Keep the image's last measure where `shoal status` and the node's /metrics read it
    (warmth_records); written by rename, root's alone; the oldest beyond
    MAX_WARMTH_RECORDS images removed."""
    folder = os.path.join(root, WARMTH_DIR)
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        path = os.path.join(folder, manifest.split(":", 1)[-1] + ".json")
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump({"image": image, "manifest": manifest, "mode": mode, "warm_bytes": w.warm_bytes,
                       "target_bytes": w.target_bytes, "warm": w.warm, "measured": time.time()}, f)
        os.replace(tmp, path)
        names = sorted((e for e in os.scandir(folder) if e.name.endswith(".json")), key=lambda e: e.stat().st_mtime)
        for old in names[:-MAX_WARMTH_RECORDS]:
            os.unlink(old.path)
    except OSError as e:
        log.debug("warmth record of %s: %s", manifest, e)


def warmth_records(root: str) -> list[dict]:
    """Every image's last measured warmth on the node at `root` (record_warmth), newest first."""
    folder = os.path.join(root, WARMTH_DIR)
    out = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for e in entries:
        if not e.name.endswith(".json"):
            continue
        try:
            with open(e.path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("manifest"), str):
            out.append(doc)
    return sorted(out, key=lambda d: -float(d.get("measured") or 0))


def resolve_image(ref: str, plain_http: bool = False, platform: str | None = None):
    """(DockerRef, plain HTTP?, manifest digest, layer descriptors) of an image in its
    registry, read with this node's credentials (the platform's manifest of an index)."""
    from builder.oci.documents import parse_manifest
    from builder.oci.registry import RegistrySource
    from snapshotter.pull import image_ref, resolve_manifest

    _, parsed, plain = image_ref(ref, plain_http)
    src = RegistrySource(parsed, plain_http=plain)
    try:
        _, manifest, _ = resolve_manifest(src, ref, platform)
    finally:
        src.close()
    return parsed, plain, manifest.digest, parse_manifest(manifest.data, ref).layers
