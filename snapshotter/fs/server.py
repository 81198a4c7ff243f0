"""The layer file system server: one FUSE mount serving every lazy layer of a node.

    ROOT/mnt/<layer digest hex>/...   one read-only directory per layer (overlay lowerdir)
    ROOT/layers/<hex>/toc.json        the verified TOC (written by the node before `load`)
    ROOT/layers/<hex>/blob.json       where the blob lives (registry, repository, digest)
    ROOT/fs.sock                      control socket: JSON lines {"op": ...} -> {"ok": ...}

It runs as a process of its own (pyfuse3 serves one mount per process, on trio), so a
restart of the node's control plane (gRPC, asyncio) does not take running containers'
files away: the node reconnects to this server by its socket. On start it loads every
layer found under ROOT/layers, so a reboot restores the mounts too.

Control ops: ping, load {id}, unload {id}, status, profile {layers?}, prefetch {chunks? whole?},
warmth {chunks? whole?}, prove {id, urgent?}, mark_bad {id, reason}.

Proofs (fs/proof.py): `prove` answers, once it is known, the diff_id the layer's whole
blob decompresses to, {"diff_id"} or {"error", "final"}. One computation per layer
however many ask; background proofs run one at a time on a thread of lowered CPU
priority, in PROOF_RANGE requests through the node's fetch chain, so that containers'
own reads come first; an `urgent` one (a Prepare is waiting for it) starts at once.
`mark_bad` makes every open and read of the layer's files fail with EIO and a log line
(the reason names image, layer, claimed and actual diff_id); the mark is kept in
ROOT/layers/<hex>/bad and survives restarts.

Access profile: the server notes every chunk that reads use, once, in the order of their
first use, per layer and ordered across layers (`profile` returns [[layer digest, start,
end], ...]; a layer's trace goes when it is unloaded). `prefetch` takes such a list (an
image's published profile, prefetch/profile.py) and fetches those chunks in that order on
threads of its own, several chunks per request, before the reads ask for them.
Reads: file content comes from the TOC reader with the node's chunk loader (chunk store,
then swarm/region/origin, verified); any failure is EIO plus a log line that names the
layer, the file and the chunk. Metadata operations never touch the network.
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import logging
import os
import signal
import stat as statmod
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import pyfuse3
import trio

from builder.format.reader import LayerReader
from builder.format.toc import parse_toc
from cache.source import BlobRef
from shoal.errors import ShoalError
from shoal.fsutil import PRIVATE_UMASK, mounts, private_dir
from snapshotter.fs.proof import ProofError, prove_blob
from snapshotter.fs.view import LayerView, Node

log = logging.getLogger("shoal.fs")

LAYER_SHIFT = 32  # inode = layer number << LAYER_SHIFT | inode within the layer
TIMEOUT = 3600.0  # layers are immutable: the kernel may cache entries and attributes
ROOT_TIMEOUT = 1.0  # the set of layers changes
TRACE_LIMIT = 250_000  # chunks of one layer noted in its access trace (a 30 GB layer has ~120,000)
PREFETCH_THREADS = 2
PREFETCH_FIRST = 1 << 20  # compressed bytes of the first prefetch job
PREFETCH_BATCH = 16 << 20  # and of the later ones (each doubles the one before)
PROOF_NICE = 10  # CPU priority of the background proof thread (os.setpriority)
BAD_FILE = "bad"  # ROOT/layers/<hex>/bad: the reason the layer is refused


@dataclass
class Layer:
    number: int
    id: str  # blob digest hex
    blob: BlobRef
    image: str
    view: LayerView
    loader: object
    loaded_at: float
    reads: int = 0
    read_bytes: int = 0
    errors: int = 0
    attrs: dict = field(default_factory=dict)  # inode -> EntryAttributes
    traced: dict = field(default_factory=dict)  # chunk start -> (first-use sequence, end): the access trace
    bad: str = ""  # why every read fails (mark_bad), "" for a good layer


def layer_dir(root: str, layer_id: str) -> str:
    return os.path.join(root, "layers", layer_id)


class LayerFS(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, root: str, make_loader):
        super().__init__()
        self.root = root
        self.make_loader = make_loader  # (blob, layer name) -> ChunkLoader
        self.layers: dict[str, Layer] = {}
        self.by_number: dict[int, Layer] = {}
        self._next_number = 1
        self.started = time.time()
        self.readahead_kb = 0  # set once, at the first lookup (see set_readahead)
        self.ops: dict[str, list] = {}  # op -> [count, seconds]: `shoal status` shows them
        self._trace_seq = itertools.count()  # orders first uses across layers
        self._lock = threading.Lock()  # access traces and prefetch figures
        self._prefetch_pool: ThreadPoolExecutor | None = None
        self._waiting_prefetch: dict[str, list] = {}  # layer digest -> profile entries
        self.prefetch_queued = 0
        self._prefetch_jobs = 0  # queued or running
        self._prefetch_since = 0.0
        self._prefetch_done = 0
        self.read_ranges = None  # (blob, ranges) -> bytes through the fetch chain: proofs need it
        self._proofs: dict[str, list] = {}  # layer id -> [Future of the answer, started?]
        self._proof_pool: ThreadPoolExecutor | None = None
        for name in ("lookup", "getattr", "readdir", "open", "read", "readlink", "getxattr", "listxattr"):
            setattr(self, name, self._timed(name, getattr(self, name)))

    def _timed(self, name: str, fn):
        counter = self.ops.setdefault(name, [0, 0.0])

        async def op(*args):
            start = time.perf_counter()
            try:
                return await fn(*args)
            finally:
                counter[0] += 1
                counter[1] += time.perf_counter() - start

        return op

    # --- layers -------------------------------------------------------------------------

    def load(self, layer_id: str) -> Layer:
        if layer_id in self.layers:
            return self.layers[layer_id]
        return self.register(layer_id, *self.read_layer(layer_id))

    def read_layer(self, layer_id: str) -> tuple[BlobRef, str, LayerView, object]:
        """Everything of a layer but its registration: the TOC parsed and checked, the
        reader and the view (no state of the file system is touched, so this can run on
        a worker thread while the event loop goes on serving reads)."""
        if not layer_id.isalnum() or len(layer_id) != 64:
            raise ShoalError(f"bad layer id {layer_id[:80]!r}")
        d = layer_dir(self.root, layer_id)
        with open(os.path.join(d, "blob.json")) as f:
            meta = json.load(f)
        blob = BlobRef.from_dict(meta)
        with open(os.path.join(d, "toc.json"), "rb") as f:
            toc = parse_toc(f.read(), blob.size)
        name = f"layer {blob.digest} of {meta.get('image', '?')}"
        loader = self.make_loader(blob, name)
        if hasattr(loader, "set_layout"):
            loader.set_layout([c for e in toc.files() for c in e.chunks])
        view = LayerView(LayerReader(toc, loader=loader, layer=name, memory=getattr(loader, "memory", None)))
        if view.max_ino >= 1 << LAYER_SHIFT:
            raise ShoalError(f"{name}: too many entries")
        return blob, meta.get("image", ""), view, loader

    def register(self, layer_id: str, blob: BlobRef, image: str, view: LayerView, loader: object) -> Layer:
        """Serve a layer read by read_layer (on the event loop; a layer loaded meanwhile
        by another request wins)."""
        if layer_id in self.layers:
            return self.layers[layer_id]
        layer = Layer(self._next_number, layer_id, blob, image, view, loader, time.time())
        try:
            with open(os.path.join(layer_dir(self.root, layer_id), BAD_FILE)) as f:
                layer.bad = f.read().strip() or "marked bad"
        except FileNotFoundError:
            pass
        view.reader.on_read = lambda chunks: self._note(layer, chunks)
        self._next_number += 1
        self.layers[layer_id] = layer
        self.by_number[layer.number] = layer
        log.info("loaded layer %s of %s (%d entries)", blob.digest, image or "?", len(view.reader.entries))
        waiting = self._waiting_prefetch.pop(blob.digest, None)
        if waiting:
            log.info("prefetching %d chunks of layer %s", self.prefetch(waiting), blob.digest)
        return layer

    def _note(self, layer: Layer, chunks) -> None:
        """Add the chunks of a read to the layer's access trace (first use only)."""
        traced = layer.traced
        if len(traced) >= TRACE_LIMIT:
            return
        new = [c for c in chunks if c.start not in traced and c.digest and not c.zeros]
        if not new:
            return
        with self._lock:
            for c in new:
                if c.start not in traced:
                    traced[c.start] = (next(self._trace_seq), c.end)

    def profile(self, digests=None) -> list[list]:
        """The access profile of the loaded layers (or of those named in `digests`):
        [[layer digest, start, end], ...] in order of first use across them."""
        keep = set(digests) if digests else None
        with self._lock:
            rows = [(seq, layer.blob.digest, start, end) for layer in self.layers.values()
                    if keep is None or layer.blob.digest in keep
                    for start, (seq, end) in layer.traced.items()]
        rows.sort()
        return [[d, a, b] for _, d, a, b in rows]

    def prefetch(self, entries) -> int:
        """Fetch the chunks of `entries` ([[layer digest, start, end], ...], an access
        profile) in that order, in jobs of one layer's chunks (PREFETCH_FIRST compressed
        bytes, then twice as many each, up to PREFETCH_BATCH), on PREFETCH_THREADS
        threads. Entries that are not chunks of their layer are skipped. Entries of a
        layer not loaded yet wait for it (the node sends the profile while containerd still prepares the image's
        layers). Returns the number of chunks queued now."""
        by_digest = {layer.blob.digest: layer for layer in self.layers.values()}
        jobs: list[list] = []
        queued = 0
        waiting: dict[str, list] = {}
        for entry in entries:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not isinstance(entry[0], str):
                continue
            layer = by_digest.get(entry[0])
            if layer is None:  # its turn comes when it is loaded
                waiting.setdefault(entry[0], []).append(entry)
                continue
            chunks_at = getattr(layer.loader, "chunks_at", None)
            chunks = chunks_at([entry[1:]]) if chunks_at else []
            if not chunks:
                continue
            c = chunks[0]
            # jobs grow from PREFETCH_FIRST to PREFETCH_BATCH: the first chunks come soon,
            # the rest in few requests (a job's chunks are fetched in blob order)
            budget = min(PREFETCH_BATCH, PREFETCH_FIRST << max(len(jobs) - 1, 0))
            if jobs and jobs[-1][0] is layer.loader and jobs[-1][2] + c.end - c.start <= budget:
                jobs[-1][1].append(c)
                jobs[-1][2] += c.end - c.start
            else:
                jobs.append([layer.loader, [c], c.end - c.start])
            queued += 1
        self._waiting_prefetch.update(waiting)  # a newer profile of a layer replaces an older one
        if not jobs:
            return 0
        if self._prefetch_pool is None:
            self._prefetch_pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="shoal-prefetch")
        with self._lock:
            if not self._prefetch_jobs:
                self._prefetch_since, self._prefetch_done = time.monotonic(), 0
            self._prefetch_jobs += len(jobs)
        for loader, chunks, _ in jobs:
            self._prefetch_pool.submit(self._prefetch_job, loader, chunks)
        self.prefetch_queued += queued
        return queued

    def whole_layers(self, digests) -> list[list]:
        """Every chunk of the loaded layers among `digests`, as profile entries (a layer
        not loaded has none yet)."""
        by_digest = {layer.blob.digest: layer for layer in self.layers.values()}
        return [[d, c.start, c.end] for d in digests if d in by_digest
                for c in getattr(by_digest[d].loader, "layout", list)()]

    def warmth(self, entries) -> list[dict]:
        """How much of `entries` (profile entries, or whole_layers) is in the chunk store,
        per layer named: {digest, loaded, target_chunks, target_bytes, warm_chunks,
        warm_bytes} (compressed bytes). Entries that are not chunks of their layer do not
        count (prefetch skips them too); a layer not loaded is not warm."""
        by_digest = {layer.blob.digest: layer for layer in self.layers.values()}
        out: dict[str, dict] = {}
        for entry in entries:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not isinstance(entry[0], str):
                continue
            row = out.setdefault(entry[0], {"digest": entry[0], "loaded": entry[0] in by_digest, "target_chunks": 0,
                                            "target_bytes": 0, "warm_chunks": 0, "warm_bytes": 0})
            layer = by_digest.get(entry[0])
            chunks_at = getattr(layer.loader, "chunks_at", None) if layer else None
            for c in chunks_at([entry[1:]]) if chunks_at else []:
                row["target_chunks"] += 1
                row["target_bytes"] += c.end - c.start
                if layer.loader.stored(c.digest):
                    row["warm_chunks"] += 1
                    row["warm_bytes"] += c.end - c.start
        return list(out.values())

    def _prefetch_job(self, loader, chunks) -> None:
        done = 0
        try:
            done = loader.prefetch(chunks)
        except Exception:  # noqa: BLE001 - a prefetch is an optimisation: the reads fetch what it misses
            log.exception("prefetch of %d chunks of %s failed", len(chunks), getattr(loader, "layer", "?"))
        with self._lock:
            self._prefetch_jobs -= 1
            self._prefetch_done += done
            if self._prefetch_jobs:
                return
            seconds, fetched = time.monotonic() - self._prefetch_since, self._prefetch_done
        log.info("prefetch done: %d chunks fetched in %.2fs (the others were here or on their way)", fetched, seconds)

    # --- proofs -----------------------------------------------------------------------------

    def prove(self, layer_id: str, urgent: bool = False) -> Future:
        """The proof of a loaded layer (see the module docstring): a Future of
        {"diff_id"} or {"error", "final"}. KeyError for a layer not loaded."""
        layer = self.layers[layer_id]
        with self._lock:
            entry = self._proofs.get(layer_id)
            if entry is None or (entry[0].done() and not entry[0].result().get("diff_id")
                                 and not entry[0].result().get("final")):
                entry = self._proofs[layer_id] = [Future(), False]  # a failed attempt is tried again
                if not urgent:
                    if self._proof_pool is None:
                        self._proof_pool = ThreadPoolExecutor(1, thread_name_prefix="shoal-proof",
                                                              initializer=_lower_priority)
                    self._proof_pool.submit(self._run_proof, layer, entry)
            start_now = urgent and not entry[1]
        if start_now:
            threading.Thread(target=self._run_proof, args=(layer, entry), name="shoal-proof-urgent",
                             daemon=True).start()
        return entry[0]

    def _run_proof(self, layer: Layer, entry: list) -> None:
        with self._lock:
            if entry[1]:
                return  # the other thread (background or urgent) has it
            entry[1] = True
        started = time.monotonic()
        try:
            diff_id = prove_blob(self.read_ranges, layer.blob)
            answer: dict = {"diff_id": diff_id}
            log.info("proof of layer %s of %s: diff_id %s (%.1fs)", layer.blob.digest, layer.image or "?",
                     diff_id, time.monotonic() - started)
        except ProofError as e:
            answer = {"error": f"layer {layer.blob.digest}: {e}", "final": e.final}
            log.warning("proof of layer %s of %s: %s", layer.blob.digest, layer.image or "?", e)
        except Exception as e:  # noqa: BLE001 - a bug answers as a failed attempt, never as a proof
            log.exception("proof of layer %s failed", layer.blob.digest)
            answer = {"error": f"layer {layer.blob.digest}: {type(e).__name__}: {e}", "final": False}
        entry[0].set_result(answer)

    def mark_bad(self, layer_id: str, reason: str) -> None:
        """Refuse every read of the layer from now on, and after restarts."""
        layer = self.layers[layer_id]
        path = os.path.join(layer_dir(self.root, layer_id), BAD_FILE)
        with open(path + ".tmp", "w") as f:
            f.write(reason + "\n")
        os.rename(path + ".tmp", path)
        if not layer.bad:
            log.error("layer %s of %s is bad, its reads fail from now on: %s", layer.blob.digest,
                      layer.image or "?", reason)
        layer.bad = reason

    def drop_cached_pages(self, layer_id: str) -> None:
        """Have the kernel forget the pages it holds of the layer's files (keep_cache), so
        that reads after mark_bad reach this process and fail. Any thread (the file
        system has no writeback cache, so the call does not wait on us)."""
        layer = self.layers.get(layer_id)
        if layer is None:
            return
        for node in list(layer.view.nodes.values()):
            entry = layer.view.reader.entries.get(node.path)
            if node.whiteout or entry is None or entry.type != "reg":
                continue
            try:
                pyfuse3.invalidate_inode((layer.number << LAYER_SHIFT) | node.ino, False)
            except OSError:
                pass  # an inode the kernel does not hold (ENOENT): nothing cached

    def proof_state(self, layer: Layer) -> dict:
        if layer.bad:
            return {"proof": "bad", "reason": layer.bad}
        entry = self._proofs.get(layer.id)
        if entry is None:
            return {"proof": "pending"}
        if not entry[0].done():
            return {"proof": "pending", "proving": entry[1]}
        answer = entry[0].result()
        if answer.get("diff_id"):
            return {"proof": "computed", "diff_id": answer["diff_id"]}
        return {"proof": "bad" if answer.get("final") else "pending", "reason": answer.get("error")}

    def unload(self, layer_id: str) -> bool:
        layer = self.layers.pop(layer_id, None)
        if layer is None:
            return False
        del self.by_number[layer.number]
        try:
            pyfuse3.invalidate_entry_async(pyfuse3.ROOT_INODE, layer_id.encode())
        except Exception:  # noqa: BLE001 - best effort: the entry times out anyway
            pass
        log.info("unloaded layer %s", layer.blob.digest)
        return True

    def status(self) -> dict:
        layers = []
        for layer in self.layers.values():
            loader = layer.loader
            layers.append({
                "id": layer.id, "digest": layer.blob.digest, "image": layer.image,
                "registry": layer.blob.registry, "repository": layer.blob.repository,
                "reads": layer.reads, "read_bytes": layer.read_bytes, "errors": layer.errors,
                "fetched_chunks": getattr(loader, "fetched_chunks", 0),
                "fetched_bytes": getattr(loader, "fetched_bytes", 0),
                "readahead_chunks": getattr(loader, "readahead_chunks", 0),
                "prefetched_chunks": getattr(loader, "prefetched_chunks", 0),
                "fetch_seconds": round(getattr(loader, "fetch_seconds", 0.0), 3),
                "decode_seconds": round(getattr(loader, "decode_seconds", 0.0), 3),
                **self.proof_state(layer),
            })
        ops = {k: {"count": c, "seconds": round(t, 3)} for k, (c, t) in self.ops.items() if c}
        prefetch = {"queued_chunks": self.prefetch_queued, "jobs_pending": self._prefetch_jobs,
                    "layers_waiting": len(self._waiting_prefetch)}
        return {"layers": layers, "uptime_s": round(time.time() - self.started, 1), "ops": ops, "prefetch": prefetch}

    # --- inode plumbing -------------------------------------------------------------------

    def _resolve(self, inode: int) -> tuple[Layer, Node]:
        layer = self.by_number.get(inode >> LAYER_SHIFT)
        node = layer.view.node(inode & ((1 << LAYER_SHIFT) - 1)) if layer else None
        if layer is None or node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return layer, node

    def _attrs(self, layer: Layer, node: Node) -> pyfuse3.EntryAttributes:
        # Layers are immutable: each inode's attributes are computed once.
        cached = layer.attrs.get(node.ino)
        if cached is not None:
            return cached
        attrs = layer.attrs[node.ino] = self._make_attrs(layer, node)
        return attrs

    def _make_attrs(self, layer: Layer, node: Node) -> pyfuse3.EntryAttributes:
        st = layer.view.stat(node)
        a = pyfuse3.EntryAttributes()
        a.st_ino = (layer.number << LAYER_SHIFT) | node.ino
        a.generation = 0
        a.entry_timeout = TIMEOUT
        a.attr_timeout = TIMEOUT
        a.st_mode = LayerView.mode(st)
        a.st_nlink = st.nlink
        a.st_uid = st.uid
        a.st_gid = st.gid
        a.st_rdev = os.makedev(st.devmajor, st.devminor)
        a.st_size = st.size
        a.st_blksize = 4096
        a.st_blocks = (st.size + 511) // 512
        ns = int(st.mtime * 1e9)
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = ns
        return a

    def _root_attrs(self) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = pyfuse3.ROOT_INODE
        a.entry_timeout = a.attr_timeout = ROOT_TIMEOUT
        # ROOT/mnt lists the node's layers: root's alone (overlayfs looks up its lower
        # layers with the credentials of whoever mounted it, containerd: root)
        a.st_mode = statmod.S_IFDIR | 0o700
        a.st_nlink = 2 + len(self.layers)
        a.st_blksize = 4096
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = int(self.started * 1e9)
        return a

    def _layer_root_attrs(self, layer: Layer) -> pyfuse3.EntryAttributes:
        a = self._attrs(layer, layer.view.node(1))
        return a

    # --- FUSE operations ------------------------------------------------------------------

    async def getattr(self, inode, ctx=None):
        if inode == pyfuse3.ROOT_INODE:
            return self._root_attrs()
        return self._attrs(*self._resolve(inode))

    async def lookup(self, parent_inode, name, ctx=None):
        if self.readahead_kb:
            kb, self.readahead_kb = self.readahead_kb, 0
            set_readahead(os.path.join(self.root, "mnt"), kb)
        text = os.fsdecode(name)
        if parent_inode == pyfuse3.ROOT_INODE:
            layer = self.layers.get(text)
            if layer is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._layer_root_attrs(layer)
        layer, node = self._resolve(parent_inode)
        child = layer.view.lookup(node, text)
        if child is None:
            # A negative entry the kernel may cache (inode 0): programs probe many paths
            # that do not exist (an import searches every sys.path entry), and through
            # overlayfs each probe would otherwise reach this process once per layer.
            negative = pyfuse3.EntryAttributes()
            negative.st_ino = 0
            negative.entry_timeout = TIMEOUT
            return negative
        return self._attrs(layer, child)

    async def opendir(self, inode, ctx):
        if inode != pyfuse3.ROOT_INODE:
            layer, node = self._resolve(inode)
            if layer.view.stat(node).type != "dir":
                raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        # Attributes are computed only for the entries this call returns: a large
        # directory is listed over many calls, each resuming at start_id.
        if fh == pyfuse3.ROOT_INODE:
            layers = sorted(self.layers.items())
            for i in range(start_id, len(layers)):
                lid, layer = layers[i]
                if not pyfuse3.readdir_reply(token, os.fsencode(lid), self._layer_root_attrs(layer), i + 1):
                    break
            return
        layer, node = self._resolve(fh)
        entries = layer.view.listdir(node)
        for i in range(start_id, len(entries)):
            name, child = entries[i]
            if not pyfuse3.readdir_reply(token, os.fsencode(name), self._attrs(layer, child), i + 1):
                break

    async def releasedir(self, fh):
        pass

    def _refuse_bad(self, layer: Layer, node: Node, what: str) -> None:
        if layer.bad:
            layer.errors += 1
            log.error("%s /%s of layer %s of %s refused (EIO): %s", what, node.path, layer.blob.digest,
                      layer.image or "?", layer.bad)
            raise pyfuse3.FUSEError(errno.EIO)

    async def open(self, inode, flags, ctx):
        layer, node = self._resolve(inode)
        self._refuse_bad(layer, node, "open")
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        if layer.view.stat(node).type != "reg":
            raise pyfuse3.FUSEError(errno.EINVAL)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        layer, node = self._resolve(fh)
        layer.reads += 1
        self._refuse_bad(layer, node, "read")
        reader = layer.view.reader
        try:
            # Chunks already decompressed in memory are served here; anything that must
            # be loaded (store, network) goes to a worker thread.
            data = reader.read_cached(node.path, off, size)
            if data is None:
                data = await trio.to_thread.run_sync(reader.read, node.path, off, size)
        except ShoalError as e:
            layer.errors += 1
            log.error("read %s offset %d size %d of %s: %s", node.path, off, size, layer.blob.digest, e)
            raise pyfuse3.FUSEError(errno.EIO) from None
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        except Exception:  # noqa: BLE001 - a bug must not take the mount down
            layer.errors += 1
            log.exception("read %s of %s failed", node.path, layer.blob.digest)
            raise pyfuse3.FUSEError(errno.EIO) from None
        layer.read_bytes += len(data)
        return data

    async def release(self, fh):
        pass

    async def readlink(self, inode, ctx):
        layer, node = self._resolve(inode)
        try:
            return os.fsencode(layer.view.reader.readlink(node.path))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EINVAL) from None

    async def listxattr(self, inode, ctx):
        if inode == pyfuse3.ROOT_INODE:
            return []
        layer, node = self._resolve(inode)
        return [os.fsencode(k) for k in layer.view.xattrs(node)]

    async def getxattr(self, inode, name, ctx):
        if inode == pyfuse3.ROOT_INODE:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        layer, node = self._resolve(inode)
        value = layer.view.xattrs(node).get(os.fsdecode(name))
        if value is None:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return value

    async def access(self, inode, mode, ctx):
        if mode & os.W_OK:
            raise pyfuse3.FUSEError(errno.EROFS)
        return True

    async def statfs(self, ctx):
        s = pyfuse3.StatvfsData()
        files = sum(len(layer.view.nodes) for layer in self.layers.values())
        size = sum(e.size for layer in self.layers.values() for e in layer.view.reader.entries.values())
        s.f_bsize = s.f_frsize = 4096
        s.f_blocks = (size + 4095) // 4096
        s.f_bfree = s.f_bavail = 0
        s.f_files = files
        s.f_ffree = s.f_favail = 0
        s.f_namemax = 255
        return s


# --- control socket -----------------------------------------------------------------------


async def _handle(fs: LayerFS, stream: trio.SocketStream) -> None:
    buf = b""
    async with stream:
        while True:
            data = await stream.receive_some(65536)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                reply = await _dispatch(fs, line)
                await stream.send_all(json.dumps(reply).encode() + b"\n")


async def _dispatch(fs: LayerFS, line: bytes) -> dict:
    try:
        req = json.loads(line)
        op = req.get("op")
        if op == "ping":
            return {"ok": True, "pid": os.getpid()}
        if op == "load":
            layer_id = str(req["id"])
            layer = fs.layers.get(layer_id)
            if layer is None:  # parsing a large TOC takes a while: not on the event loop
                layer = fs.register(layer_id, *await trio.to_thread.run_sync(fs.read_layer, layer_id))
            return {"ok": True, "number": layer.number}
        if op == "unload":
            return {"ok": True, "unloaded": fs.unload(str(req["id"]))}
        if op == "status":
            return {"ok": True, **fs.status(), "store": fs_store_stats(fs)}
        if op == "profile":
            return {"ok": True, "chunks": fs.profile(req.get("layers"))}
        if op == "prove":
            future = fs.prove(str(req["id"]), bool(req.get("urgent")))
            answer = await trio.to_thread.run_sync(future.result, limiter=_PROOF_WAITERS)
            return {"ok": True, **answer}
        if op == "mark_bad":
            fs.mark_bad(str(req["id"]), str(req.get("reason") or "marked bad"))
            await trio.to_thread.run_sync(fs.drop_cached_pages, str(req["id"]))
            return {"ok": True}
        if op in ("prefetch", "warmth"):
            entries, whole = req.get("chunks", []), req.get("whole", [])
            if not isinstance(entries, list) or not isinstance(whole, list):
                raise ValueError(f"{op} needs lists of chunks and of whole layers")
            entries = entries + fs.whole_layers(whole)
            if op == "warmth":  # (whole layers not loaded yet: named, not warm)
                rows = fs.warmth(entries)
                named = {r["digest"] for r in rows}
                loaded = {layer.blob.digest for layer in fs.layers.values()}
                rows += [{"digest": d, "loaded": d in loaded, "target_chunks": 0, "target_bytes": 0, "warm_chunks": 0,
                          "warm_bytes": 0} for d in whole if isinstance(d, str) and d not in named]
                return {"ok": True, "layers": rows, "prefetch": fs.status()["prefetch"]}
            return {"ok": True, "queued": fs.prefetch(entries)}
        return {"ok": False, "error": f"unknown op {op!r}"}
    except (ShoalError, OSError, ValueError, KeyError) as e:
        log.error("control %s: %s", line[:200], e)
        return {"ok": False, "error": str(e) or type(e).__name__}


_PROOF_WAITERS = trio.CapacityLimiter(32)  # control calls waiting for a proof (not the reads' threads)


def _lower_priority() -> None:
    """Lower the CPU priority of the calling thread alone (Linux: a thread is a task)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PROOF_NICE)
    except OSError as e:
        log.warning("cannot lower the priority of the proof thread: %s", e)


def fs_store_stats(fs: LayerFS) -> dict:
    path = getattr(fs, "data_path", None)
    return path.statistics() if path else {}


async def serve_control(fs: LayerFS, path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)
    sock = trio.socket.socket(trio.socket.AF_UNIX, trio.socket.SOCK_STREAM)
    await sock.bind(path)
    os.chmod(path, 0o600)
    sock.listen(64)
    listener = trio.SocketListener(sock)
    await trio.serve_listeners(lambda s: _handle(fs, s), [listener])


# --- process ------------------------------------------------------------------------------


READAHEAD_KB = 1024  # the node passes [fetch] readahead_kb; this is for a server started alone


def set_readahead(mnt: str, kb: int) -> None:
    """Let the kernel read ahead `kb` KiB on the layers' files (the FUSE default is 128).

    A mapped library faults its pages in one by one, and each fault that misses is a
    read that waits for the network. With a wider window the kernel asks for the pages
    around the fault in several reads at once, which this server answers in parallel;
    the faulting page comes back first. The window is the mount's backing device's
    read_ahead_kb in sysfs (found through mountinfo: a stat of the mount would ask this
    very process). The kernel sets it when the mount's INIT is answered, so this runs
    at the first request after that (LayerFS.lookup)."""
    try:
        dev = next((dev for point, dev in mounts() if point == mnt), None)  # the bdi's name
        if dev is None:
            log.warning("cannot set read-ahead on %s: not in /proc/self/mountinfo", mnt)
            return
        with open(f"/sys/class/bdi/{dev}/read_ahead_kb", "w") as f:
            f.write(str(kb))
        log.info("read-ahead %d KiB on %s (bdi %s)", kb, mnt, dev)
    except OSError as e:
        log.warning("cannot set read-ahead on %s: %s", mnt, e)


def build_fs(root: str, config: dict) -> LayerFS:
    """The file system with the node's fetch chain and chunk store (from config)."""
    from snapshotter.assemble import make_data_path

    path = make_data_path(root, config)
    fs = LayerFS(root, path.loader)
    fs.data_path = path  # type: ignore[attr-defined]
    fs.read_ranges = path.read_ranges
    return fs


async def _main(fs: LayerFS, root: str) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve_control, fs, os.path.join(root, "fs.sock"))
        await pyfuse3.main()
        nursery.cancel_scope.cancel()


def run(root: str, config: dict) -> int:
    os.umask(PRIVATE_UMASK)  # what this process makes under ROOT (chunks, swarm storage) is root's alone
    mnt = os.path.join(root, "mnt")
    os.makedirs(mnt, mode=0o700, exist_ok=True)
    private_dir(os.path.join(root, "layers"))
    if os.path.ismount(mnt):  # a server that died without unmounting
        os.system(f"fusermount3 -u -z {mnt!r} 2>/dev/null || umount -l {mnt!r}")  # noqa: S605
    fs = build_fs(root, config)
    for layer_id in sorted(os.listdir(os.path.join(root, "layers"))):
        try:
            fs.load(layer_id)
        except (ShoalError, OSError, ValueError, KeyError) as e:
            log.error("cannot restore layer %s: %s", layer_id, e)
    options = set(pyfuse3.default_options)
    options |= {"fsname=shoal", "subtype=shoal", "ro", "allow_other", "default_permissions"}
    options.discard("default_permissions")
    options.add("default_permissions")
    pyfuse3.init(fs, mnt, options)
    fs.readahead_kb = int(config.get("readahead_kb", READAHEAD_KB))
    stop = {"flag": False}

    def _term(*_):
        stop["flag"] = True
        pyfuse3.terminate()

    signal.signal(signal.SIGTERM, _term)
    signal.signal(signal.SIGINT, _term)
    log.info("serving %d layers at %s (pid %d)", len(fs.layers), mnt, os.getpid())
    try:
        trio.run(_main, fs, root)
    finally:
        pyfuse3.close(unmount=True)
        log.info("unmounted %s", mnt)
        path = getattr(fs, "data_path", None)
        if path is not None:
            path.close(10.0)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shoal-fs", description="shoal's layer file system server (started by shoal node)")
    p.add_argument("--root", required=True)
    p.add_argument("--config-json", default="{}", help="node configuration, as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s shoal-fs %(levelname)s %(message)s", stream=sys.stderr)
    profile = os.environ.get("SHOAL_FS_PROFILE")  # a developer's aid: cProfile output path
    try:
        if profile:
            import cProfile

            prof = cProfile.Profile()
            try:
                return prof.runcall(run, os.path.abspath(args.root), json.loads(args.config_json))
            finally:
                prof.dump_stats(profile)
        return run(os.path.abspath(args.root), json.loads(args.config_json))
    except (ShoalError, OSError) as e:  # cannot start (or go on): one line, which the node reports
        why = f"{e.strerror}: {e.filename}" if isinstance(e, OSError) and e.strerror and e.filename else e
        log.error("cannot serve: %s", why)
        return 1


if __name__ == "__main__":
    sys.exit(main())
