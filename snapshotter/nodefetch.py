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
- small blobs (configs, profiles: read whole) through FetchChain.read_ranges: the
  region, then the origin, with the node's read deadline and the sources' health,
  checked per source (a source whose bytes fail goes on to the next one);
- the whole blob of a layer to unpack (open_blob, read_whole), when the node's swarm is
  on ([swarm] enabled): through the swarm's bulk path in the layer file system's process
  (its control op `fetch_blob`, p2p/control.py): peers first, the extents this node owns
  from the region (ranks split a first fetch between the nodes that fetch it at once),
  every piece checked against the torrent's SHA-1 as it enters (a peer that sends a bad
  one is banned), the whole file against the blob's sha256 before it is seeded; a cold
  region fills the blob before it can make its metadata, and the op waits for that
  (metadata_wait(): bounded by the blob's size). The node process then reads the
  complete file where it lies, in the torrent storage (FileBlobReader: no second copy;
  it stays there as the swarm's copy, seeded to the node's neighbours until the swarm
  evicts it within its `storage_capacity`), and checks its sha256 again as it reads;
- otherwise, or when the swarm cannot (the layer file system is not running or has no
  swarm, the region has no metadata for the blob, a stall: logged), through the node's
  own chain (BlobReader: the region, then the origin, PIECE-sized ranges, one ahead of
  the reader).
Either way a whole blob's digest is checked when the reader reaches its end
(DigestMismatch then, and nothing the reader built from it may be committed:
snapshotter/remote.py unpacks into a temporary folder and renames it only after). A
swarm file that fails that check (it rotted after the swarm's own check) is dropped from
the swarm (`forget_blob`) and read_whole raises SwarmCopyBad: the caller reads the blob
again through the node's own chain (swarm=False).

Single flight. The layer file system's loader coalesces chunk reads across containers.
A blob to unpack is read once per node by the node process (one unpack per layer digest
under the layer's lock in remote.py; a manifest or config once per prepare); through the
swarm, the two processes share the swarm's torrent table as their flight table: one
torrent per blob digest in the one session of the node, so a second `fetch_blob` of the
same blob (another process of the node: `shoal prefetch --root`) or a `download` of it
joins the download under way, and a blob completed before (also before a restart: the
`.complete` mark) is answered at once. Across nodes, the swarm's ranks give each
downloader its extents of the region's copy, and the region coalesces what reaches the
origin. The node's own chain (the fallback path) shares no flight table with the layer
file system: only the sources' configuration and the region's coalescing.

The figures (bytes and requests by source, and by kind: manifests, blobs) are kept in
ROOT/node-fetch.json (written after every fetch, 0600), which `shoal status` and the
node's /metrics add to the layer file system's own (snapshotter/status.py). A blob taken
through the swarm is counted in the layer file system's figures by source (peers, and
the region and origin through the swarm's fallback) and here as unpack bytes
(`whole_bytes`, and `whole_swarm`, `whole_swarm_bytes`; `swarm_fallbacks`: blobs the
swarm could not bring, read through the node's own chain; `swarm_copies_bad`).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import BinaryIO, Self, TypeVar

import requests

from builder.oci.documents import MAX_DOCUMENT_BYTES
from builder.oci.refs import DockerRef
from builder.oci.registry import RegistrySource
from cache.source import BlobRef, FetchChain
from shoal import mediatypes as mt
from shoal.digest import check_digest, sha256_digest
from shoal.errors import DigestMismatch, FormatError, ShoalError, TransportError
from shoal.fsutil import replace_file
from snapshotter.fs.client import FSClient

log = logging.getLogger("shoal.fetch")

T = TypeVar("T")

STATS_FILE = "node-fetch.json"  # ROOT/node-fetch.json
PIECE = 8 << 20  # bytes per range of a whole blob read through the chain
# a blob to unpack waits this long for a cold region to fill it and make its metadata:
# METADATA_WAIT seconds, plus its size at METADATA_FILL_RATE, at most METADATA_WAIT_MAX (a
# region whose fill cannot finish goes on saying "not yet": the node then reads around the swarm)
METADATA_WAIT, METADATA_FILL_RATE, METADATA_WAIT_MAX = 30.0, 20 << 20, 900.0
SWARM_STALL = 60.0  # seconds without a piece before the swarm's bulk path gives up on a blob
SWARM_FLOOR_RATE = 1 << 20  # bytes/s: the bulk call's outer bound is its size at this rate, plus the waits


class SwarmCopyBad(DigestMismatch):
    """The swarm's complete file of a blob does not hash to its digest (dropped from the
    swarm): read the blob again through the node's own chain."""


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
        self.root = root
        self.swarm = bool((config.get("swarm") or {}).get("enabled"))  # the layer fs runs the node's swarm
        self.path = os.path.join(root, STATS_FILE)
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()  # one writer of the figures' file at a time
        self._local = threading.local()
        self.manifests: dict[str, dict[str, int]] = {}  # source -> {"bytes", "requests"}
        self.blobs = {"small": 0, "whole": 0, "whole_bytes": 0, "digest_mismatches": 0, "whole_swarm": 0,
                      "whole_swarm_bytes": 0, "swarm_fallbacks": 0, "swarm_copies_bad": 0}
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

    def open_blob(self, blob: BlobRef, what: str, swarm: bool = True) -> BlobReader:
        """A reader of the whole blob (its size must be known), digest checked at its end:
        the swarm's complete file when the swarm is on and `swarm` (module doc), else
        through the node's own chain. `reader.source` says which."""
        if blob.size is None:
            raise FormatError(f"{what}: the blob's size is not known")
        with self._lock:
            self.blobs["whole"] += 1
        if swarm and self.swarm:
            reader = self._from_swarm(blob, what)
            if reader is not None:
                return reader
        return BlobReader(self.chain, blob, what, self._whole_done)

    def read_whole(self, blob: BlobRef, what: str, use: Callable[[BlobReader], T], swarm: bool = True) -> T:
        """use(a reader of the whole blob), then the blob read to its end, so its digest is
        checked before the result counts: DigestMismatch when it is not the blob;
        SwarmCopyBad when the swarm's file is not (it is dropped from the swarm: call
        again with swarm=False). What `use` raises passes through, unless the swarm's file
        turns out not to be the blob (then SwarmCopyBad)."""
        with self.open_blob(blob, what, swarm) as reader:
            try:
                result = use(reader)
            except ShoalError:
                if reader.source == "swarm" and not reader.drain():
                    self._bad_swarm_copy(blob, what)
                raise
            if not reader.drain():
                if reader.source == "swarm":
                    self._bad_swarm_copy(blob, what)
                raise DigestMismatch(f"{what}: its bytes do not hash to {blob.digest}")
        return result

    def _from_swarm(self, blob: BlobRef, what: str) -> BlobReader | None:
        """The blob's complete file from the swarm's bulk path, open; None (logged) when
        the swarm cannot bring it."""
        assert blob.size is not None
        wait = metadata_wait(blob.size)
        bound = wait + SWARM_STALL + blob.size / SWARM_FLOOR_RATE + 60
        try:
            path = FSClient(self.root).fetch_blob(blob, wait, SWARM_STALL, bound)
            fh = open(path, "rb")  # noqa: SIM115 - the reader owns it (closed with it)
        except (ShoalError, OSError, ValueError, KeyError) as e:
            log.warning("%s: not through the swarm (%s): from the region and origin", what, e)
            with self._lock:
                self.blobs["swarm_fallbacks"] += 1
            self.save()
            return None
        log.info("%s: %d bytes through the swarm, at %s", what, blob.size, path)
        return FileBlobReader(fh, blob, what, self._swarm_done)

    def _bad_swarm_copy(self, blob: BlobRef, what: str) -> None:
        with self._lock:
            self.blobs["swarm_copies_bad"] += 1
        log.error("%s: the swarm's copy does not hash to %s: dropping it; reading the blob through the "
                  "region and origin", what, blob.digest)
        try:
            FSClient(self.root).forget_blob(blob, "its file does not hash to the blob digest")
        except (ShoalError, OSError) as e:
            log.warning("%s: telling the swarm: %s", what, e)
        raise SwarmCopyBad(f"{what}: the swarm's copy does not hash to {blob.digest}")

    def _whole_done(self, nbytes: int, good: bool) -> None:
        with self._lock:
            self.blobs["whole_bytes"] += nbytes
            self.blobs["digest_mismatches"] += not good
        self.save()

    def _swarm_done(self, nbytes: int, good: bool) -> None:
        with self._lock:
            self.blobs["whole_swarm"] += 1
            self.blobs["whole_swarm_bytes"] += nbytes
        self._whole_done(nbytes, good)

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


def metadata_wait(size: int) -> float:
    """Seconds a blob of `size` bytes to unpack waits for the region to have its metadata."""
    return min(METADATA_WAIT_MAX, METADATA_WAIT + size / METADATA_FILL_RATE)


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
    One reader thread; the piece ahead is fetched on a thread of its own.
    `source`: where the bytes come from ("chain"; FileBlobReader: "swarm")."""

    source = "chain"

    def __init__(self, chain: FetchChain | None, blob: BlobRef, what: str, done: Callable[[int, bool], None]) -> None:
        assert blob.size is not None
        self.chain, self.blob, self.what, self._done = chain, blob, what, done
        self.size = blob.size
        self._pos = 0  # bytes of the blob fetched (handed to the buffer)
        self._buf = b""
        self._off = 0
        self._hash = hashlib.sha256()
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._ahead: concurrent.futures.Future | None = None
        self._checked = False
        self.good: bool | None = None  # the digest check's outcome, once the end is reached

    def _fetch(self, start: int) -> bytes:
        assert self.chain is not None
        end = min(self.size, start + PIECE)
        return self.chain.read_ranges(self.blob, [(start, end)])[0]

    def _get(self, start: int) -> bytes:
        """The next piece's bytes (the one ahead fetched meanwhile)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="shoal-blob")
        fut = self._ahead or self._pool.submit(self._fetch, start)
        self._ahead = None
        data = fut.result()
        if start + len(data) < self.size:
            self._ahead = self._pool.submit(self._fetch, start + len(data))
        return data

    def _next_piece(self) -> bytes:
        data = self._get(self._pos)
        want = min(PIECE, self.size - self._pos)
        if len(data) != want:
            raise TransportError(f"{self.what}: {len(data)} bytes at {self._pos}, want {want}")
        self._pos += len(data)
        self._hash.update(data)
        return data

    def _check(self) -> None:
        if self._checked:
            return
        self._checked = True
        got = "sha256:" + self._hash.hexdigest()
        self.good = got == self.blob.digest
        self._done(self.size, self.good)
        if not self.good:
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

    def drain(self) -> bool:
        """Read the rest of the blob (its digest checked at the end): True when it is the
        blob, False when it is not (TransportError as read())."""
        try:
            while self.read(1 << 20):
                pass
        except DigestMismatch:
            return False
        return bool(self.good)

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class FileBlobReader(BlobReader):
    """The blob from a file the swarm's bulk path completed (the torrent storage's copy,
    open here: an eviction that unlinks it meanwhile does not cut the read), read in
    PIECE-sized reads and checked against the digest at its end like BlobReader. A short
    file is a TransportError."""

    source = "swarm"

    def __init__(self, fh: BinaryIO, blob: BlobRef, what: str, done: Callable[[int, bool], None]) -> None:
        super().__init__(None, blob, what, done)
        self._fh = fh

    def _get(self, start: int) -> bytes:
        want = min(PIECE, self.size - start)
        data = self._fh.read(want)
        if len(data) != want:  # (not the blob: read_whole treats it as a failed digest check)
            raise DigestMismatch(f"{self.what}: the swarm's file ends at {start + len(data)}, the blob at {self.size}")
        return data

    def close(self) -> None:
        self._fh.close()
