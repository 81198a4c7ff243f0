"""The layer file system server: one FUSE mount serving every lazy layer of a node.

    ROOT/mnt/<layer digest hex>/...   one read-only directory per layer (overlay lowerdir)
    ROOT/layers/<hex>/blob.json       where the blob lives (registry, repository, digest) and,
                                      for a layer whose TOC is not here yet, where its TOC is
                                      ("toc": {offset, end, digest, uncompressed}; the node writes it)
    ROOT/layers/<hex>/toc.json        the verified TOC (written by this server at `load`, from
                                      the TOC range read through the node's fetch chain)
    ROOT/fs.sock                      control socket: JSON lines {"op": ...} -> {"ok": ...}

It runs as a process of its own (pyfuse3 serves one mount per process, on trio), so a
restart of the node's control plane (gRPC, asyncio) does not take running containers'
files away: the node reconnects to this server by its socket. On start it loads every
layer found under ROOT/layers whose TOC is here, so a reboot restores the mounts too.

TOCs: `load` of a layer without toc.json reads its TOC range through the node's fetch
chain (swarm, region, origin, under the chain's deadline), each source's answer checked
by decompress_toc against the TOC digest (a source whose bytes fail it counts in its
verify_failures and the next source is asked), and writes toc.json (atomically) before
parsing it. The TOC's bytes count by source in the chain's figures, and in `tocs`.

Control ops (snapshotter/fs/control.py, the node's one control socket; FSClient calls
them): ping, load {id}, unload {id}, status, profile {layers?}, prefetch {chunks? whole?},
warmth {chunks? whole?}, prove {id, urgent?}, mark_bad {id, reason}, and the swarm's
(p2p/control.py: stats, download) when the node's fetch chain has one.

Proofs (fs/proof.py): `prove` answers, once it is known, the diff_id the layer's whole
blob decompresses to, {"diff_id"} or {"error", "final"}. One computation per layer
however many ask; background proofs run one at a time on a thread of lowered CPU
priority, in PROOF_RANGE requests through the node's fetch chain, so that containers'
own reads come first; an `urgent` one (a Prepare is waiting for it) starts at once.
`mark_bad` makes every open and read of the layer's files fail with EIO and a log line
(the reason names image, layer, claimed and actual diff_id); the mark is kept in
ROOT/layers/<hex>/bad and survives restarts.

Access profile: the server notes every chunk that reads use, once, in the order of their
first use, per layer and ordered across layers (prefetch/trace.py; `profile` returns
[[layer digest, start, end], ...]; a layer's trace goes when it is unloaded). `prefetch`
takes such a list (an image's published profile, prefetch/profile.py) and fetches those
chunks in that order on threads of its own, several chunks per request, before the reads
ask for them (prefetch/warmup.py).
Reads: file content comes from the TOC reader with the node's chunk loader (chunk store,
then swarm/region/origin, verified); any failure is EIO plus a log line that names the
layer, the file and the chunk. Metadata operations never touch the network.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import signal
import stat as statmod
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import pyfuse3
import trio

from builder.format.reader import ChunkLoader, LayerReader
from builder.format.toc import Chunk, decompress_toc, parse_toc
from cache.memory import ChunkMemory
from cache.source import BlobRef
from prefetch.trace import AccessTrace, LayerTrace
from prefetch.warmup import WarmLoader, Warmup
from shoal.digest import check_digest
from shoal.errors import FormatError, ShoalError, TransportError
from shoal.fsutil import PRIVATE_UMASK, mounts, private_dir
from shoal.localrpc import Server as ControlServer
from snapshotter.assemble import DataPath, make_data_path
from snapshotter.fs.control import SOCKET_NAME, NodeControl
from snapshotter.fs.proof import ProofError, prove_blob
from snapshotter.fs.view import LayerView, Node

log = logging.getLogger("shoal.fs")

LAYER_SHIFT = 32  # inode = layer number << LAYER_SHIFT | inode within the layer
TIMEOUT = 3600.0  # layers are immutable: the kernel may cache entries and attributes
ROOT_TIMEOUT = 1.0  # the set of layers changes
PROOF_NICE = 10  # CPU priority of the background proof thread (os.setpriority)
BAD_FILE = "bad"  # ROOT/layers/<hex>/bad: the reason the layer is refused


class LayerLoader(ChunkLoader, WarmLoader, Protocol):
    """What the layer file system needs of one layer's chunk loader (the seam to the
    cache: cache.loader.NodeChunkLoader fits; DataPath.loader makes one per layer).

    load (builder's ChunkLoader) turns chunks into verified bytes, raising ShoalError
    (EIO for the reader); it is called from the file system's worker threads, several at
    once. The warm-up's calls (prefetch.warmup.WarmLoader) come from its own threads.
    set_layout is called once, before any read; statistics() from the event loop."""

    memory: ChunkMemory | None  # the node's decompressed chunks, shared with the layer's reader

    def set_layout(self, chunks: Sequence[Chunk]) -> None:
        """The layer's chunks from its TOC (read-ahead and prefetch go by it)."""
        ...

    def statistics(self) -> dict:
        """The layer's figures: {fetched_chunks, fetched_bytes (compressed, from the
        network), readahead_chunks, prefetched_chunks, fetch_seconds, decode_seconds}."""
        ...


@dataclass
class Layer:
    number: int
    id: str  # blob digest hex
    blob: BlobRef
    image: str
    view: LayerView
    loader: LayerLoader
    loaded_at: float
    traced: LayerTrace  # its access trace (prefetch/trace.py)
    reads: int = 0
    read_bytes: int = 0
    errors: int = 0
    attrs: dict = field(default_factory=dict)  # inode -> EntryAttributes
    bad: str = ""  # why every read fails (mark_bad), "" for a good layer


def layer_dir(root: str, layer_id: str) -> str:
    return os.path.join(root, "layers", layer_id)


class LayerFS(pyfuse3.Operations):
    enable_writeback_cache = False

    def __init__(self, root: str, make_loader: Callable[[BlobRef, str], LayerLoader],
                 data_path: DataPath | None = None):
        super().__init__()
        self.root = root
        self.make_loader = make_loader  # (blob, layer name) -> its loader
        self.data_path = data_path  # the node's data path the loaders come from (figures, close)
        self.layers: dict[str, Layer] = {}
        self.by_number: dict[int, Layer] = {}
        self._next_number = 1
        self.started = time.time()
        self.readahead_kb = 0  # set once, at the first lookup (see set_readahead)
        self.ops: dict[str, list] = {}  # op -> [count, seconds]: `shoal status` shows them
        self._lock = threading.Lock()  # proofs, the TOC figures
        self.trace = AccessTrace()
        self.warmup = Warmup(self.loaders)
        self.read_ranges = data_path.read_ranges if data_path else None  # through the fetch chain: proofs, TOCs
        self.tocs = {"fetched": 0, "bytes": 0, "failed": 0}  # TOCs read through the chain (compressed bytes)
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

    def read_layer(self, layer_id: str) -> tuple[BlobRef, str, LayerView, LayerLoader]:
        """Everything of a layer but its registration: the TOC parsed and checked, the
        reader and the view (no state of the file system is touched, so this can run on
        a worker thread while the event loop goes on serving reads)."""
        if not layer_id.isalnum() or len(layer_id) != 64:
            raise ShoalError(f"bad layer id {layer_id[:80]!r}")
        d = layer_dir(self.root, layer_id)
        with open(os.path.join(d, "blob.json")) as f:
            meta = json.load(f)
        blob = BlobRef.from_dict(meta)
        name = f"layer {blob.digest} of {meta.get('image', '?')}"
        fetched = None
        try:
            with open(os.path.join(d, "toc.json"), "rb") as f:
                toc_json = f.read()
        except FileNotFoundError:
            toc_json = fetched = self.fetch_toc(blob, meta.get("toc"))
        toc = parse_toc(toc_json, blob.size)
        loader = self.make_loader(blob, name)
        loader.set_layout([c for e in toc.files() for c in e.chunks])
        view = LayerView(LayerReader(toc, loader=loader, layer=name, memory=loader.memory))
        if view.max_ino >= 1 << LAYER_SHIFT:
            raise ShoalError(f"{name}: too many entries")
        if fetched is not None:  # kept once it serves: a TOC that is refused leaves nothing
            tmp = os.path.join(d, f".toc.json.{threading.get_native_id()}")
            with open(tmp, "wb") as f:  # (the process's umask keeps it root's alone)
                f.write(fetched)
            os.rename(tmp, os.path.join(d, "toc.json"))
        return blob, meta.get("image", ""), view, loader

    def fetch_toc(self, blob: BlobRef, where: object) -> bytes:
        """The layer's TOC (decompressed, verified against its digest), read through the
        node's fetch chain from the location blob.json names (`where`).
        FormatError (DigestMismatch for a digest) when every source that answered sent
        bytes that fail the check, or the location is malformed; TransportError when no
        source answered. Any thread but the event loop's (it waits on the network)."""
        if not isinstance(where, dict):
            raise FormatError("no TOC, and blob.json names no TOC location")
        offset, end, uncompressed = where.get("offset"), where.get("end"), where.get("uncompressed")
        if (type(offset) is not int or type(end) is not int or not 0 <= offset < end
                or (uncompressed is not None and type(uncompressed) is not int)):
            raise FormatError(f"blob.json: bad TOC location {str(where)[:200]}")
        digest = check_digest(where.get("digest"), "TOC digest")
        if self.read_ranges is None:
            raise ShoalError("no fetch chain to read the TOC through")
        refused: list[ShoalError] = []  # what the check said of each source's bytes

        def check(_: int, raw: bytes) -> bytes:
            try:
                return decompress_toc(raw, digest, uncompressed)
            except ShoalError as e:
                refused.append(e)
                raise

        try:
            toc_json = self.read_ranges(blob, [(offset, end)], check)[0]
        except TransportError as e:
            with self._lock:
                self.tocs["failed"] += 1
            if refused:  # bytes came, and were not the TOC (the chain's message says from where)
                raise type(refused[-1])(f"TOC: {e}") from None
            raise
        with self._lock:
            self.tocs["fetched"] += 1
            self.tocs["bytes"] += end - offset
        return toc_json

    def register(self, layer_id: str, blob: BlobRef, image: str, view: LayerView, loader: LayerLoader) -> Layer:
        """Serve a layer read by read_layer (on the event loop; a layer loaded meanwhile
        by another request wins)."""
        if layer_id in self.layers:
            return self.layers[layer_id]
        layer = Layer(self._next_number, layer_id, blob, image, view, loader, time.time(), self.trace.layer(blob.digest))
        try:
            with open(os.path.join(layer_dir(self.root, layer_id), BAD_FILE)) as f:
                layer.bad = f.read().strip() or "marked bad"
        except FileNotFoundError:
            pass
        view.reader.on_read = layer.traced.note
        self._next_number += 1
        self.layers[layer_id] = layer
        self.by_number[layer.number] = layer
        log.info("loaded layer %s of %s (%d entries)", blob.digest, image or "?", len(view.reader.entries))
        self.warmup.layer_loaded(blob.digest)
        return layer

    def loaders(self) -> dict[str, WarmLoader]:
        """The loaded layers' loaders by layer digest (the warm-up's view of them)."""
        return {layer.blob.digest: layer.loader for layer in self.layers.values()}

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
            if self.read_ranges is None:
                raise ShoalError("no fetch chain to read the blob through")
            diff_id = prove_blob(self.read_ranges, layer.blob)
            answer: dict = {"diff_id": diff_id}
            log.info("proof of layer %s of %s: diff_id %s (%.1fs)", layer.blob.digest, layer.image or "?",
                     diff_id, time.monotonic() - started)
        except ProofError as e:
            answer = {"error": f"layer {layer.blob.digest}: {e}", "final": e.final}
            log.warning("proof of layer %s of %s: %s", layer.blob.digest, layer.image or "?", e)
        except Exception as e:
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
        self.trace.forget(layer.blob.digest)
        with contextlib.suppress(Exception):  # best effort: the entry times out anyway
            pyfuse3.invalidate_entry_async(pyfuse3.ROOT_INODE, layer_id.encode())
        log.info("unloaded layer %s", layer.blob.digest)
        return True

    def status(self) -> dict:
        layers = []
        for layer in self.layers.values():
            figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in layer.loader.statistics().items()}
            layers.append({
                "id": layer.id, "digest": layer.blob.digest, "image": layer.image,
                "registry": layer.blob.registry, "repository": layer.blob.repository,
                "reads": layer.reads, "read_bytes": layer.read_bytes, "errors": layer.errors,
                **figures, **self.proof_state(layer),
            })
        ops = {k: {"count": c, "seconds": round(t, 3)} for k, (c, t) in self.ops.items() if c}
        return {"layers": layers, "uptime_s": round(time.time() - self.started, 1), "ops": ops,
                "prefetch": self.warmup.statistics()}

    def data_path_statistics(self) -> dict:
        """The figures of the whole data path the layers read through (memory, chunk
        store, each source of the fetch chain, single flight): DataPath.statistics()."""
        if self.data_path is None:
            return {}
        with self._lock:
            tocs = dict(self.tocs)
        return {**self.data_path.statistics(), "tocs": tocs}

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
        root = layer.view.node(1)  # (every layer's view has its root)
        if root is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(layer, root)

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
        except Exception:
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


def _lower_priority() -> None:
    """Lower the CPU priority of the calling thread alone (Linux: a thread is a task)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PROOF_NICE)
    except OSError as e:
        log.warning("cannot lower the priority of the proof thread: %s", e)


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
    path = make_data_path(root, config)
    return LayerFS(root, path.loader, path)


async def _main(fs: LayerFS, root: str) -> None:
    # the node's one control socket, bound once the event loop runs (its ops reach it)
    control = NodeControl(fs, trio.lowlevel.current_trio_token(), fs.data_path.swarm_ops if fs.data_path else None)
    server = ControlServer(os.path.join(root, SOCKET_NAME), control.handle).start()
    try:
        await pyfuse3.main()
    finally:
        server.close()


def run(root: str, config: dict) -> int:
    os.umask(PRIVATE_UMASK)  # what this process makes under ROOT (chunks, swarm storage) is root's alone
    mnt = os.path.join(root, "mnt")
    os.makedirs(mnt, mode=0o700, exist_ok=True)
    private_dir(os.path.join(root, "layers"))
    if os.path.ismount(mnt):  # a server that died without unmounting
        os.system(f"fusermount3 -u -z {mnt!r} 2>/dev/null || umount -l {mnt!r}")
    fs = build_fs(root, config)
    for layer_id in sorted(os.listdir(os.path.join(root, "layers"))):
        if not os.path.exists(os.path.join(layer_dir(root, layer_id), "toc.json")):
            continue  # a prepare in progress (or cut short): its `load` fetches the TOC (or sweep removes it)
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
        if fs.data_path is not None:
            fs.data_path.close(10.0)
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
