"""What the node process fetches itself, through the node's fetch chain: manifests by
digest, image configs, access profiles, and whole blobs of layers to unpack.

Chunks of lazy layers and their TOCs are the layer file system's to fetch (its process
owns the data path: memory, chunk store, single flight, and the swarm; assemble.py). The
node process fetches the rest, with a chain of its own over the same sources but the
swarm (one swarm session per node, in the layer file system's process):

- manifests by digest: the region first (its registry API passes manifests through to
  the origin with the node's credentials, so a region with a `resolve`-capable mirror
  configuration serves them), then the origin; the bytes must hash to the digest asked
  for, from wherever they come;
- blobs (configs, profiles: small, read whole; layers to unpack: read in PIECE-sized
  ranges, one ahead of the reader) through FetchChain.read_ranges: the region, then the
  origin, with the node's read deadline and the sources' health. A small blob is checked
  per source (a source whose bytes fail goes on to the next one); a whole blob's digest
  is checked when the reader reaches its end (BlobReader: DigestMismatch then, and
  nothing the reader built from it may be committed: snapshotter/remote.py unpacks into
  a temporary folder and renames it only after).

Single flight: the layer file system's loader coalesces chunk reads across containers;
the blobs fetched here are read once per node by construction (one unpack per layer
digest under the layer's lock in remote.py; a manifest or config once per prepare).
The two processes share the node's sources' configuration and the region's coalescing,
not a flight table.

The figures (bytes and requests by source, and by kind: manifests, blobs) are kept in
ROOT/node-fetch.json (written after every fetch, 0600), which `shoal status` and the
node's /metrics add to the layer file system's own (snapshotter/status.py).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Self

import requests

from builder.oci.documents import MAX_DOCUMENT_BYTES
from builder.oci.refs import DockerRef
from builder.oci.registry import RegistrySource
from cache.source import BlobRef, FetchChain
from shoal import mediatypes as mt
from shoal.digest import check_digest, sha256_digest
from shoal.errors import DigestMismatch, FormatError, TransportError
from shoal.fsutil import replace_file

log = logging.getLogger("shoal.fetch")

STATS_FILE = "node-fetch.json"  # ROOT/node-fetch.json
PIECE = 8 << 20  # bytes per range of a whole blob read through the chain


class NodeFetch:
    """The node process's fetches (see the module doc). Any thread. Every method raises
    ShoalError (shoal.errors) subclasses only: TransportError when no source served, DigestMismatch (a
    FormatError) when what came is not what was asked for."""

    def __init__(self, root: str, config: dict, chain: FetchChain | None = None) -> None:
        if chain is None:
            from snapshotter.assemble import make_chain

            # the swarm is the layer file system's: one session per node
            chain = make_chain({**config, "swarm": {"enabled": False}})
        self.chain = chain
        self.config = config
        self.deadline = float(config.get("read_deadline", 20.0))
        self.link = None
        if config.get("region_url"):
            from cache.region.client import RegionLink

            self.link = RegionLink.from_config(config)
        self.path = os.path.join(root, STATS_FILE)
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # one writer of the figures' file at a time
        self._local = threading.local()
        self.manifests: dict[str, dict[str, int]] = {}  # source -> {"bytes", "requests"}
        self.blobs = {"small": 0, "whole": 0, "whole_bytes": 0, "digest_mismatches": 0}
        # counters go on from what an earlier node process counted (the layer fs's outlive it too)
        self._before = read_statistics(root)

    # --- manifests

    def manifest(self, registry: str, repository: str, digest: str, plain_http: bool) -> bytes:
        """The manifest `digest` of registry/repository: its bytes, which hash to it."""
        digest = check_digest(digest, "manifest digest")
        what = f"{registry}/{repository}@{digest}"
        if self.link is not None:
            try:
                data = self._region_manifest(registry, repository, digest, what)
            except (TransportError, DigestMismatch) as e:
                log.info("%s: manifest from the region: %s; asking the origin", what, e)
                data = None
            if data is not None:
                self._count_manifest("region", len(data))
                return data
        source = RegistrySource(DockerRef(registry, repository, digest=digest), plain_http,
                                read_timeout=self.deadline)
        try:
            data = source.get_manifest(digest).data
        finally:
            source.close()
        self._count_manifest("origin", len(data))
        return data

    def _region_manifest(self, registry: str, repository: str, digest: str, what: str) -> bytes | None:
        """From the region, or None when it does not serve this registry's manifests (404)."""
        assert self.link is not None
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = self.link.session()
        headers = {"Accept": mt.ACCEPT_MANIFESTS}
        auth = self.link.authorization(registry, repository)
        if auth:
            headers["Authorization"] = auth
        url = f"{self.link.url}{self.link.path}/v2/{repository}/manifests/{digest}"
        try:
            with session.get(url, params={"ns": registry}, headers=headers, stream=True,
                             timeout=(min(2.0, self.deadline), self.deadline)) as resp:
                if resp.status_code == 404:
                    return None
                if resp.status_code != 200:
                    raise TransportError(f"region answered HTTP {resp.status_code}")
                data = b""
                for piece in resp.iter_content(64 << 10):
                    data += piece
                    if len(data) > MAX_DOCUMENT_BYTES:
                        raise TransportError(f"more than {MAX_DOCUMENT_BYTES} bytes: not a manifest")
        except requests.RequestException as e:
            raise TransportError(f"region {self.link.url}: {type(e).__name__}") from None
        if sha256_digest(data) != digest:
            raise DigestMismatch(f"{what}: the region's bytes hash to {sha256_digest(data)}")
        return data

    # --- blobs

    def small_blob(self, blob: BlobRef, what: str, limit: int) -> bytes:
        """A small blob (a config, a profile) whole, checked against its digest at each source."""
        if blob.size is None or not 0 <= blob.size <= limit:
            raise FormatError(f"{what}: size {blob.size} (at most {limit} bytes are read)")

        def check(_: int, raw: bytes) -> bytes:
            if len(raw) != blob.size or sha256_digest(raw) != blob.digest:
                raise DigestMismatch(f"{what}: bytes that are not {blob.digest}")
            return raw

        data = b"" if blob.size == 0 else self.chain.read_ranges(blob, [(0, blob.size)], check)[0]
        if blob.size == 0 and blob.digest != sha256_digest(b""):
            raise DigestMismatch(f"{what}: an empty blob is not {blob.digest}")
        with self._lock:
            self.blobs["small"] += 1
        self.save()
        return data

    def open_blob(self, blob: BlobRef, what: str) -> BlobReader:
        """A reader of the whole blob (its size must be known), digest checked at its end."""
        if blob.size is None:
            raise FormatError(f"{what}: the blob's size is not known")
        with self._lock:
            self.blobs["whole"] += 1
        return BlobReader(self.chain, blob, what, self._whole_done)

    def _whole_done(self, nbytes: int, good: bool) -> None:
        with self._lock:
            self.blobs["whole_bytes"] += nbytes
            self.blobs["digest_mismatches"] += not good
        self.save()

    # --- figures

    def _count_manifest(self, source: str, nbytes: int) -> None:
        with self._lock:
            row = self.manifests.setdefault(source, {"bytes": 0, "requests": 0})
            row["bytes"] += nbytes
            row["requests"] += 1
        self.save()

    def statistics(self) -> dict:
        with self._lock:
            now = {"manifests": {k: dict(v) for k, v in self.manifests.items()}, "blobs": dict(self.blobs),
                   "sources": self.chain.statistics()}
        return _added(self._before, now)

    def save(self) -> None:
        """ROOT/node-fetch.json, replaced whole (a reader never sees half of it)."""
        try:
            with self._save_lock:
                replace_file(self.path, json.dumps(self.statistics(), sort_keys=True).encode(), 0o600)
        except OSError as e:
            log.warning("%s: %s", self.path, e)

    def close(self) -> None:
        self.save()
        self.chain.close()


_shared: dict[str, NodeFetch] = {}
_shared_lock = threading.Lock()


def node_fetch(root: str, config: dict) -> NodeFetch:
    """The one NodeFetch of this process for the node at root (the node's RemoteLayers and
    a preheat's or `shoal prefetch --root`'s in the same process share it, and so its
    figures' file); made with the first caller's configuration."""
    key = os.path.abspath(root)
    with _shared_lock:
        if key not in _shared:
            _shared[key] = NodeFetch(key, config)
        return _shared[key]


def _added(before: object, now: dict) -> dict:
    """`now` with the numbers of `before` (same shape, or not: what does not match is
    dropped) added in."""
    out = dict(now)
    if not isinstance(before, dict):
        return out
    for key, old in before.items():
        new = out.get(key)
        if isinstance(old, dict) and (new is None or isinstance(new, dict)):
            out[key] = _added(old, new or {})
        elif isinstance(old, int | float) and not isinstance(old, bool) and (new is None or isinstance(new, int | float)):
            out[key] = old + (new or 0)
    return out


def read_statistics(root: str) -> dict:
    """What NodeFetch.save wrote for the node at root ({} when nothing yet, or unreadable)."""
    try:
        with open(os.path.join(root, STATS_FILE)) as fh:
            out = json.load(fh)
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


class BlobReader:
    """A whole blob read sequentially through a FetchChain, PIECE bytes per range and one
    range ahead of the reader; its sha256 checked when the reader reaches the end
    (DigestMismatch from that read()). TransportError when no source serves a range.
    One reader thread; the piece ahead is fetched on a thread of its own."""

    def __init__(self, chain: FetchChain, blob: BlobRef, what: str, done: Callable[[int, bool], None]) -> None:
        assert blob.size is not None
        self.chain, self.blob, self.what, self._done = chain, blob, what, done
        self.size = blob.size
        self._pos = 0  # bytes of the blob fetched (handed to the buffer)
        self._buf = b""
        self._off = 0
        self._hash = hashlib.sha256()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shoal-blob")
        self._ahead: concurrent.futures.Future | None = None
        self._checked = False

    def _fetch(self, start: int) -> bytes:
        end = min(self.size, start + PIECE)
        return self.chain.read_ranges(self.blob, [(start, end)])[0]

    def _next_piece(self) -> bytes:
        fut = self._ahead or self._pool.submit(self._fetch, self._pos)
        self._ahead = None
        data = fut.result()
        want = min(PIECE, self.size - self._pos)
        if len(data) != want:
            raise TransportError(f"{self.what}: {len(data)} bytes at {self._pos}, want {want}")
        self._pos += len(data)
        if self._pos < self.size:
            self._ahead = self._pool.submit(self._fetch, self._pos)
        self._hash.update(data)
        return data

    def _check(self) -> None:
        if self._checked:
            return
        self._checked = True
        got = "sha256:" + self._hash.hexdigest()
        self._done(self.size, got == self.blob.digest)
        if got != self.blob.digest:
            raise DigestMismatch(f"{self.what}: its bytes hash to {got}, not {self.blob.digest}")

    def read(self, n: int = -1) -> bytes:
        out = []
        want = n if n is not None and n >= 0 else self.size
        while want > 0:
            if self._off >= len(self._buf):
                if self._pos >= self.size:
                    self._check()
                    break
                self._buf, self._off = self._next_piece(), 0
            take = self._buf[self._off:self._off + want]
            self._off += len(take)
            want -= len(take)
            out.append(take)
        if self._pos >= self.size and self._off >= len(self._buf):
            self._check()
        return b"".join(out)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

