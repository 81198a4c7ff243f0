"""The layer file system server: one FUSE mount serving every lazy layer of a node.

    ROOT/mnt/<layer digest hex>/...   one read-only directory per layer (overlay lowerdir)
    ROOT/layers/<hex>/blob.json       where the blob lives (registry, repository, digest) and,
                                      for a layer whose TOC is not here yet, where its TOC is
                                      ("toc": {offset, end, digest, uncompressed}; the node writes it)
    ROOT/layers/<hex>/toc.json        the verified TOC (written by this server at `load`, from
                                      the TOC range read through the node's fetch chain)
    ROOT/fs.sock                      control socket: JSON lines {"op": ...} -> {"ok": ...}

It runs as a process of its own, so a restart of the node's control plane (gRPC,
asyncio) does not take running containers' files away: the node reconnects to this
server by its socket. On start it loads every layer found under ROOT/layers whose TOC is
here, so a reboot restores the mounts too.

FUSE: shoal's own request loop (fs/session.py: threads reading /dev/fuse; fs/protocol.py:
the wire format), mounted with mount(2). Inode numbers are stable: (layer number <<
LAYER_SHIFT) | the entry's number in the layer's view (from its TOC), the layer number
kept in ROOT/layers/<hex>/number, so a server that takes the mount over from a dead one
answers the kernel's cached nodeids as that one did.

TOCs: `load` of a layer without toc.json reads its TOC range through the node's fetch
chain (swarm, region, origin, under the chain's deadline), each source's answer checked
by decompress_toc against the TOC digest (a source whose bytes fail it counts in its
verify_failures and the next source is asked), and writes toc.json (atomically) before
parsing it. The TOC's bytes count by source in the chain's figures, and in `tocs`.

Control ops (snapshotter/fs/control.py, the node's one control socket; FSClient calls
them): ping, load {id}, unload {id}, status, profile {layers?}, prefetch {chunks? whole?},
warmth {chunks? whole?}, prove {id, urgent?}, mark_bad {id, reason}, and the swarm's
(p2p/control.py: stats, download, fetch_blob, forget_blob) when the node's fetch chain has one.

Proofs (fs/proof.py): `prove` answers, once it is known, the diff_id the layer's whole
blob decompresses to, {"diff_id"} or {"error", "final"}. One computation per layer
however many ask; background proofs run one at a time on a thread of lowered CPU
priority, once the file system has served no READ for PROOF_QUIET seconds (at most
PROOF_QUIET_MAX after they were asked), in PROOF_RANGE requests through the node's fetch
chain, so that containers' own reads come first; an `urgent` one (a Prepare is waiting for
it) starts at once.
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
import ctypes
import errno
import faulthandler
import gc
import json
import logging
import mmap
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

from builder.format.reader import ChunkLoader, LayerReader
from builder.format.toc import Chunk, decompress_toc, parse_toc
from cache.memory import ChunkMemory
from cache.origin import merge_ranges
from cache.source import BACKGROUND, BlobRef
from prefetch.trace import AccessTrace, LayerTrace
from prefetch.warmup import WarmLoader, Warmup
from shoal.digest import check_digest
from shoal.errors import FormatError, ShoalError, TransportError
from shoal.fsutil import PRIVATE_UMASK, mounts, private_dir
from shoal.localrpc import Server as ControlServer
from snapshotter.assemble import DataPath, make_data_path
from snapshotter.fs import holder
from snapshotter.fs import protocol as p
from snapshotter.fs.backing import CACHED, Backings
from snapshotter.fs.control import SOCKET_NAME, NodeControl
from snapshotter.fs.proof import ProofError, prove_blob
from snapshotter.fs.session import Session, unmount
from snapshotter.fs.view import LayerView, Node

log = logging.getLogger("shoal.fs")

LAYER_SHIFT = 32  # inode = layer number << LAYER_SHIFT | inode within the layer
PAGE_IN_PIECE = 1 << 20  # the bytes of one FUSE_NOTIFY_STORE (LayerFS.page_in)
TIMEOUT = 3600.0  # layers are immutable: the kernel may cache entries and attributes
ROOT_TIMEOUT = 1.0  # the set of layers changes
PROOF_NICE = 10  # CPU priority of the background proof thread (os.setpriority)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt(3) parameters (malloc.h)
PROOF_QUIET = 5.0  # a background proof starts once no READ came for this long (a start reads) ...
PROOF_QUIET_MAX = 300.0  # ... or once it waited this long
BAD_FILE = "bad"  # ROOT/layers/<hex>/bad: the reason the layer is refused
NUMBER_FILE = "number"  # ROOT/layers/<hex>/number: the layer's number (the high bits of its inodes)
NUMBERS_FILE = "layer-numbers"  # ROOT/layer-numbers: the next new layer's number


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
    passthrough_opens: int = 0  # opens answered with a backing file (backing.py)
    paged_in_bytes: int = 0  # file bytes a preheat brought into the page cache (LayerFS.page_in)
    files_at: dict[int, list[tuple[str, int, int]]] | None = None  # chunk start -> (file, offset, size): page_in's
    paged: set[int] = field(default_factory=set)  # starts of the chunks page_in handed to the kernel once
    attrs: dict = field(default_factory=dict)  # inode within the layer -> protocol.Attr
    bad: str = ""  # why every read fails (mark_bad), "" for a good layer


def layer_dir(root: str, layer_id: str) -> str:
    return os.path.join(root, "layers", layer_id)


class FUSEError(Exception):
    """A request's answer is this errno (raised by the operations, answered by `handle`)."""

    def __init__(self, err: int):
        super().__init__(err)  # (its text only when shown: most are answered and forgotten)
        self.errno = err

    def __str__(self) -> str:
        return os.strerror(self.errno)


# The opcodes `shoal status` counts, by the names it has always shown them under.
_OP_NAMES = {p.Lookup: "lookup", p.Getattr: "getattr", p.Readdirplus: "readdir", p.Open: "open",
             p.Read: "read", p.Readlink: "readlink", p.Getxattr: "getxattr", p.Listxattr: "listxattr"}
READ_WORKERS = 32  # reads that wait for the store or the network, at once
MAX_PARTS = 512  # buffers of one READ reply's writev (IOV_MAX is 1024); more are joined first


class LayerFS:
    """The operations of the layer file system over shoal's own FUSE protocol module.

    Threads: `handle` runs on the session's reader thread (session.READER_THREADS; it
    must never wait: a READ whose chunks are not in memory is recorded with
    Session.defer and handed to one of READ_WORKERS worker threads, which writes the
    reply with Session.reply and the token); it only reads the
    layer tables (a dict lookup is atomic). Everything that changes them (register,
    unload, mark_bad, the warm-up's queue) runs under `state`, an RLock the control
    socket's ops take too (control.py). Notifications to the kernel are written outside
    `state` (an INVAL_ENTRY may wait on a request whose handler would wait on it).
    """

    def __init__(self, root: str, make_loader: Callable[[BlobRef, str], LayerLoader],
                 data_path: DataPath | None = None, page_in: bool = True):
        self.root = root
        self.mnt = os.path.join(root, "mnt")
        self.make_loader = make_loader  # (blob, layer name) -> its loader
        self.data_path = data_path  # the node's data path the loaders come from (figures, close)
        self.layers: dict[str, Layer] = {}
        self.by_number: dict[int, Layer] = {}
        self.started = time.time()
        self.readahead_kb = 0  # set once the mount's INIT is answered (see set_readahead)
        self.ops: dict[str, list] = {name: [0, 0.0] for name in _OP_NAMES.values()}  # `shoal status`
        self.state = threading.RLock()  # the layer tables (see the class docstring)
        self._lock = threading.Lock()  # proofs, the TOC figures, layer numbers
        self.session: Session | None = None  # where notifications go (set by `run`)
        self.backings: Backings | None = None  # passthrough opens (set by `run`)
        self.trace = AccessTrace()
        self.warmup = Warmup(self.loaders, self.page_in if page_in else None)  # ([fetch] page_in)
        self.read_ranges = data_path.read_ranges if data_path else None  # through the fetch chain: proofs, TOCs
        self.tocs = {"fetched": 0, "bytes": 0, "failed": 0}  # TOCs read through the chain (compressed bytes)
        self._proofs: dict[str, list] = {}  # layer id -> [Future of the answer, started?]
        self._proof_pool: ThreadPoolExecutor | None = None
        self.closing = threading.Event()  # set when the server stops: background proofs wait no longer
        self._read_pool = ThreadPoolExecutor(READ_WORKERS, thread_name_prefix="shoal-read")

    # --- layer numbers: stable across restarts ------------------------------------------------

    def layer_number(self, layer_id: str) -> int:
        """The layer's number, the high bits of its inodes: kept in ROOT/layers/<hex>/number
        so that a server taking over the mount gives the kernel's cached nodeids the same
        meaning; new numbers come from ROOT/layer-numbers, which only grows (a number is
        never given to another layer, even after its layer is swept)."""
        path = os.path.join(layer_dir(self.root, layer_id), NUMBER_FILE)
        with self._lock:
            try:
                with open(path) as f:
                    number = int(f.read().strip())
                if 0 < number < 1 << (64 - LAYER_SHIFT):
                    return number
            except (FileNotFoundError, ValueError):
                pass
            counter = os.path.join(self.root, NUMBERS_FILE)
            try:
                with open(counter) as f:
                    number = max(1, int(f.read().strip()))
            except (FileNotFoundError, ValueError):
                number = 1 + max(_numbers_in(os.path.join(self.root, "layers")), default=0)
            _write_private(counter, f"{number + 1}\n".encode())
            _write_private(path, f"{number}\n".encode())
            return number

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
            _write_private(os.path.join(d, "toc.json"), fetched)
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
        """Serve a layer read by read_layer (any thread; a layer loaded meanwhile by
        another request wins)."""
        number = self.layer_number(layer_id)  # (before the lock: it writes files)
        with self.state:
            return self._register(layer_id, number, blob, image, view, loader)

    def _register(self, layer_id: str, number: int, blob: BlobRef, image: str, view: LayerView,
                  loader: LayerLoader) -> Layer:
        if layer_id in self.layers:
            return self.layers[layer_id]
        layer = Layer(number, layer_id, blob, image, view, loader, time.time(), self.trace.layer(blob.digest))
        try:
            with open(os.path.join(layer_dir(self.root, layer_id), BAD_FILE)) as f:
                layer.bad = f.read().strip() or "marked bad"
        except FileNotFoundError:
            pass
        view.reader.on_read = layer.traced.note
        if self.backings is not None:
            self.backings.attach(layer_id)  # (this connection's earlier decisions, if any)
        self.layers[layer_id] = layer
        self.by_number[layer.number] = layer
        log.info("loaded layer %s of %s (%d entries)", blob.digest, image or "?", len(view.reader.entries))
        # A TOC's tens of thousands of entries live as long as the layer: out of the cyclic
        # collector's generations, so its full passes do not walk them again and again
        # (reference counting still frees them at unload).
        gc.freeze()
        self.warmup.layer_loaded(blob.digest)
        return layer

    def loaders(self) -> dict[str, WarmLoader]:
        """The loaded layers' loaders by layer digest (the warm-up's view of them)."""
        return {layer.blob.digest: layer.loader for layer in self.layers.values()}

    def page_in(self, loader: WarmLoader, chunks: list[Chunk]) -> None:
        """A preheat's hook (prefetch.warmup.Warmup, on a warm-up thread): the bytes of the
        files these chunks of the layer hold go into the kernel's page cache with
        FUSE_NOTIFY_STORE, so the start the preheat is for finds them there (FOPEN_KEEP_CACHE
        keeps them across opens; overlayfs reads the lower file's own pages) instead of
        asking this process for each READ. The kernel takes a store only for an inode it
        holds: a stat through this mount looks each file up first (answered by the reader
        threads). Never a read of this mount from here: a thread of a FUSE server that
        faults on its own file's pages (mmap) can deadlock the server on its own mm lock.
        Whole pages only (a part page at either end is left to the start's READ); the
        bytes are the verified chunks' own, not told to the access trace (they are no
        client's reads). A chunk is paged in once (a preheat asked again, or another job
        with it, finds it done). A failure is logged (the start then reads as without it);
        the page cache may drop the pages whenever it likes."""
        layer = next((ly for ly in list(self.layers.values()) if ly.loader is loader), None)
        session = self.session
        if layer is None or session is None or not chunks or self.closing.is_set():
            return
        if layer.files_at is None:
            files_at: dict[int, list[tuple[str, int, int]]] = {}
            for e in list(layer.view.reader.entries.values()):
                if e.type == "reg":
                    for c in e.chunks:
                        if not c.zeros:
                            files_at.setdefault(c.start, []).append((e.name, c.file_offset, c.size))
            layer.files_at = files_at
        ranges: dict[str, list[tuple[int, int]]] = {}
        for c in chunks:
            if c.start in layer.paged:
                continue
            layer.paged.add(c.start)
            for name, off, size in layer.files_at.get(c.start, ()):
                ranges.setdefault(name, []).append((off, off + size))
        for name, spans in ranges.items():
            if self.closing.is_set():
                return
            try:
                layer.paged_in_bytes += self._store_pages(session, layer, name, spans)
            except (OSError, ValueError, ShoalError) as e:
                log.warning("page-in of /%s in layer %s of %s: %s (its start reads it from this process)", name,
                            layer.blob.digest, layer.image or "?", e)

    def _store_pages(self, session: Session, layer: Layer, name: str, spans: list[tuple[int, int]]) -> int:
        """page_in of one file's [start, end) spans: how many bytes the kernel took."""
        st = os.stat(os.path.join(self.mnt, layer.id, name), follow_symlinks=False)
        if not statmod.S_ISREG(st.st_mode) or st.st_ino >> LAYER_SHIFT != layer.number:
            raise ValueError("not this layer's regular file")
        done = 0
        page = mmap.PAGESIZE
        for start, end in merge_ranges(spans, gap=0):
            start = -(-start // page) * page
            end = st.st_size if end >= st.st_size else end - end % page
            while start < end:
                n = min(end - start, PAGE_IN_PIECE)
                parts = layer.view.reader.read_parts(name, start, n, note=False, kept=True)
                if not session.notify(p.notify_store(st.st_ino, start, parts)):
                    return done  # the kernel let go of the inode (or the connection ended)
                done += n
                start += n
        return done

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
                    self._proof_pool.submit(self._run_proof, layer, entry, True)
            start_now = urgent and not entry[1]
        if start_now:
            threading.Thread(target=self._run_proof, args=(layer, entry), name="shoal-proof-urgent",
                             daemon=True).start()
        return entry[0]

    def _wait_quiet(self, layer: Layer) -> bool:
        """A background proof's wait: until the file system served no READ of any layer for
        PROOF_QUIET seconds (at most PROOF_QUIET_MAX): a proof reads, decompresses and hashes
        the whole blob, and the starts reading the node's layers come first (its thread's
        lower CPU priority does not hold back the swarm's and the chain's work it causes).
        False: the server stops meanwhile."""
        began = time.monotonic()
        last = sum(ly.reads for ly in list(self.layers.values()))
        while time.monotonic() - began < PROOF_QUIET_MAX:
            if self.closing.wait(PROOF_QUIET):
                return False
            now = sum(ly.reads for ly in list(self.layers.values()))
            if now == last:
                break
            last = now
        waited = time.monotonic() - began
        if waited > 2 * PROOF_QUIET:
            log.info("proof of layer %s of %s waited %.0fs for the reads to pause", layer.blob.digest,
                     layer.image or "?", waited)
        return True

    def _run_proof(self, layer: Layer, entry: list, background: bool = False) -> None:
        quiet = self._wait_quiet(layer) if background else True
        with self._lock:
            if entry[1]:
                return  # the other thread (background or urgent) has it
            entry[1] = True
        if not quiet:
            entry[0].set_result({"error": f"layer {layer.blob.digest}: the layer file system stopped before its "
                                          "proof", "final": False})
            return
        started = time.monotonic()
        token = BACKGROUND.set(background)  # (nobody waits on a background proof: the region may queue it)
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
        finally:
            BACKGROUND.reset(token)
        entry[0].set_result(answer)

    def mark_bad(self, layer_id: str, reason: str) -> None:
        """Refuse every read of the layer from now on, and after restarts."""
        layer = self.layers[layer_id]
        _write_private(os.path.join(layer_dir(self.root, layer_id), BAD_FILE), (reason + "\n").encode())
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
            if self.session is not None:  # (an inode the kernel does not hold: nothing cached)
                self.session.notify(p.notify_inval_inode((layer.number << LAYER_SHIFT) | node.ino, 0, 0))

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
        """Stop serving the layer (any thread but a request's; takes `state` itself)."""
        with self.state:
            layer = self.layers.pop(layer_id, None)
            if layer is None:
                return False
            del self.by_number[layer.number]
            self.trace.forget(layer.blob.digest)
            if self.backings is not None:
                self.backings.detach(layer_id)
        if self.session is not None:  # best effort: the entry times out anyway
            self.session.notify(p.notify_inval_entry(p.ROOT_ID, layer_id.encode()))
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
                "passthrough_opens": layer.passthrough_opens, "paged_in_bytes": layer.paged_in_bytes,
                **figures, **self.proof_state(layer),
            })
        ops = {k: {"count": c, "seconds": round(t, 3)} for k, (c, t) in self.ops.items() if c}
        return {"layers": layers, "uptime_s": round(time.time() - self.started, 1), "ops": ops,
                "prefetch": self.warmup.statistics(),
                "passthrough": self.backings.statistics() if self.backings is not None else {"on": False}}

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
        """The layer and node of a nodeid; ENOENT for one no loaded layer has (the kernel
        may still hold nodeids of a layer unloaded since, or given out by a predecessor)."""
        layer = self.by_number.get(inode >> LAYER_SHIFT)
        node = layer.view.node(inode & ((1 << LAYER_SHIFT) - 1)) if layer else None
        if layer is None or node is None:
            raise FUSEError(errno.ENOENT)
        return layer, node

    def _attrs(self, layer: Layer, node: Node) -> p.Attr:
        # Layers are immutable: each inode's attributes are computed once.
        cached = layer.attrs.get(node.ino)
        if cached is None:
            cached = layer.attrs[node.ino] = self._make_attrs(layer, node)
        return cached

    def _make_attrs(self, layer: Layer, node: Node) -> p.Attr:
        st = layer.view.stat(node)
        ns = int(st.mtime * 1e9)
        return p.Attr(ino=(layer.number << LAYER_SHIFT) | node.ino, mode=LayerView.mode(st), size=st.size,
                      nlink=st.nlink, uid=st.uid, gid=st.gid, rdev=os.makedev(st.devmajor, st.devminor),
                      atime_ns=ns, mtime_ns=ns, ctime_ns=ns)

    def _root_attrs(self) -> p.Attr:
        # ROOT/mnt lists the node's layers: root's alone (overlayfs looks up its lower
        # layers with the credentials of whoever mounted it, containerd: root)
        ns = int(self.started * 1e9)
        return p.Attr(ino=p.ROOT_ID, mode=statmod.S_IFDIR | 0o700, nlink=2 + len(self.layers),
                      atime_ns=ns, mtime_ns=ns, ctime_ns=ns)

    def _layer_root_attrs(self, layer: Layer) -> p.Attr:
        root = layer.view.node(1)  # (every layer's view has its root)
        if root is None:
            raise FUSEError(errno.ENOENT)
        return self._attrs(layer, root)

    # --- FUSE requests ----------------------------------------------------------------------

    def handle(self, req: p.Request) -> list | None:
        """The answer to one request (the session's Handler): the reply's buffers, None
        when there is none (FORGET, INTERRUPT) or a worker thread writes it later (a READ
        that loads chunks). Requests for nodeids this process never gave out are
        answered like any other: every inode of a loaded layer is addressable, and no
        lookup count is kept (FORGET has nothing to drop), so a server taking over a
        session answers the kernel's cached nodeids as its predecessor did."""
        u = req.header.unique
        name = _OP_NAMES.get(type(req))
        start = time.perf_counter()
        try:
            return self._answer(req)
        except FUSEError as e:
            return [p.reply_error(u, e.errno)]
        finally:
            if name is not None:
                counter = self.ops[name]
                counter[0] += 1
                counter[1] += time.perf_counter() - start

    def _answer(self, req: p.Request) -> list | None:
        u, inode = req.header.unique, req.header.nodeid
        match req:
            case p.Read():  # (first: the hot path)
                return self.read(u, req.fh, req.offset, req.size, not req.flags & os.O_DIRECT)
            case p.Lookup():
                return [self.lookup(u, inode, req.name)]
            case p.Getattr():
                attr = self._root_attrs() if inode == p.ROOT_ID else self._attrs(*self._resolve(inode))
                return [p.reply_attr(u, attr, attr_valid_ns=_ns(ROOT_TIMEOUT if inode == p.ROOT_ID else TIMEOUT))]
            case p.Open():
                return self.open(u, inode, req.flags)
            case p.Opendir():
                if inode != p.ROOT_ID and not statmod.S_ISDIR(self._attrs(*self._resolve(inode)).mode):
                    raise FUSEError(errno.ENOTDIR)
                return [p.reply_open(u, inode, 0)]
            case p.Readdirplus():
                return [self.readdir(u, req.fh, req.offset, req.size)]
            case p.Readlink():
                layer, node = self._resolve(inode)
                try:
                    return [p.reply(u, os.fsencode(layer.view.reader.readlink(node.path)))]
                except OSError as e:
                    raise FUSEError(e.errno or errno.EINVAL) from None
            case p.Listxattr():
                names = b"" if inode == p.ROOT_ID else b"".join(
                    os.fsencode(k) + b"\0" for k in self.layer_xattrs(inode))
                return [p.reply_xattr(u, req.size, names)]
            case p.Getxattr():
                # overlayfs asks each lower file for trusted.overlay.metacopy/origin at its
                # lookup, each directory for opaque/redirect: a third of a start's requests,
                # nearly all answered "none" (ENODATA)
                value = None if inode == p.ROOT_ID else self.layer_xattrs(inode).get(os.fsdecode(req.name))
                if value is None:
                    raise FUSEError(errno.ENODATA)
                return [p.reply_xattr(u, req.size, value)]
            case p.Access():
                if req.mask & os.W_OK:
                    raise FUSEError(errno.EROFS)
                return [p.reply(u)]
            case p.Statfs():
                layers = list(self.layers.values())
                files = sum(len(layer.view.nodes) for layer in layers)
                size = sum(e.size for layer in layers for e in layer.view.reader.entries.values())
                return [p.reply_statfs(u, blocks=(size + 4095) // 4096, bfree=0, bavail=0, files=files, ffree=0)]
            case p.Release() | p.Releasedir() | p.Flush() | p.Destroy():
                return [p.reply(u)]
            case p.Forget() | p.BatchForget() | p.Interrupt():
                return None
            case _:
                return [p.reply_error(u, errno.ENOSYS)]

    def describe(self, inode: int) -> str:
        """What a log line calls an inode: its layer and image (any thread)."""
        if inode == p.ROOT_ID:
            return "the mount's root"
        layer = self.by_number.get(inode >> LAYER_SHIFT)
        if layer is None:
            return f"inode {inode:#x} (no layer loaded)"
        return f"layer {layer.blob.digest} of {layer.image or '?'}"

    def layer_xattrs(self, inode: int) -> dict[str, bytes]:
        layer, node = self._resolve(inode)
        return layer.view.xattrs(node)

    def lookup(self, u: int, parent: int, name: bytes) -> bytes:
        text = os.fsdecode(name)
        if parent == p.ROOT_ID:
            layer = self.layers.get(text)
            if layer is None:
                raise FUSEError(errno.ENOENT)
            return p.reply_entry(u, self._layer_root_attrs(layer), entry_valid_ns=_ns(TIMEOUT),
                                 attr_valid_ns=_ns(TIMEOUT))
        layer, node = self._resolve(parent)
        child = layer.view.lookup(node, text)
        if child is None:
            # A negative entry the kernel may cache (inode 0): programs probe many paths
            # that do not exist (an import searches every sys.path entry), and through
            # overlayfs each probe would otherwise reach this process once per layer.
            return p.reply_negative_entry(u, entry_valid_ns=_ns(TIMEOUT))
        return p.reply_entry(u, self._attrs(layer, child), entry_valid_ns=_ns(TIMEOUT), attr_valid_ns=_ns(TIMEOUT))

    def readdir(self, u: int, fh: int, offset: int, size: int) -> bytes:
        # Attributes are computed only for the entries this reply holds: a large
        # directory is listed over many requests, each resuming at `offset` (the `off`
        # of the last entry the kernel took).
        if fh == p.ROOT_ID:
            layers = sorted(self.layers.items())
            entries = (p.DirEntry(os.fsencode(lid), i + 1, self._layer_root_attrs(layer))
                       for i, (lid, layer) in enumerate(layers) if i >= offset)
        else:
            layer, node = self._resolve(fh)
            listing = layer.view.listdir(node)
            entries = (p.DirEntry(os.fsencode(listing[i][0]), i + 1, self._attrs(layer, listing[i][1]))
                       for i in range(offset, len(listing)))
        body, _ = p.pack_direntplus(entries, size, entry_valid_ns=_ns(TIMEOUT), attr_valid_ns=_ns(TIMEOUT))
        return p.reply(u, body)

    def _refuse_bad(self, layer: Layer, node: Node, what: str) -> None:
        if layer.bad:
            layer.errors += 1
            log.error("%s /%s of layer %s of %s refused (EIO): %s", what, node.path, layer.blob.digest,
                      layer.image or "?", layer.bad)
            raise FUSEError(errno.EIO)

    def open(self, u: int, inode: int, flags: int) -> list | None:
        layer, node = self._resolve(inode)
        self._refuse_bad(layer, node, "open")
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise FUSEError(errno.EROFS)
        attr = self._attrs(layer, node)  # (cached: an import opens a thousand files)
        if not statmod.S_ISREG(attr.mode):
            raise FUSEError(errno.EINVAL)
        backings, session = self.backings, self.session
        if backings is None or session is None or session.negotiated is None or not session.negotiated.passthrough:
            return [self._open_reply(u, layer, inode, flags, CACHED)]
        known = backings.known(inode)
        if known is not None:
            return [self._open_reply(u, layer, inode, flags, known)]
        chunk = None if backings.off else self._passthrough_chunk(layer, node, attr.size)
        if chunk is None:  # decided here: the cached path
            return [self._open_reply(u, layer, inode, flags, backings.mode(layer.id, inode, lambda: None))]
        # first open of this inode on this connection, its chunk in the store: a worker
        # reads and verifies the chunk's file (the reader thread must not wait for that)
        token = session.defer(u, inode, p.Opcode.OPEN)
        self._read_pool.submit(self._open_first, u, layer, node, chunk, inode, flags, token)
        return None

    def _passthrough_chunk(self, layer: Layer, node: Node, size: int) -> Chunk | None:
        """The one chunk of the file's content if the file is worth a backing file: it
        is one chunk, held in the chunk store and not in memory. A chunk in memory is
        cheaper to serve from there (a READ costs less than reading and hashing the
        store's file to open it: measured, docs/snapshotter.md); one not in the store
        makes the first read fetch it, and the inode stays on the cached path."""
        store = self.data_path.store if self.data_path is not None else None
        if store is None:
            return None
        reader = layer.view.reader
        chunks = reader.chunks_for(node.path, 0, size) if size else []
        if len(chunks) != 1:
            return None
        c = chunks[0]
        if c.zeros or not c.digest or c.file_offset != 0 or c.size != size:
            return None
        memory = reader.memory
        if isinstance(memory, ChunkMemory) and memory.contains(reader.memory_key(c)):
            return None
        return c if store.contains(c.digest) else None

    def _open_first(self, u: int, layer: Layer, node: Node, chunk: Chunk, inode: int, flags: int,
                    token: int) -> None:
        assert self.backings is not None
        try:
            out = self._open_reply(u, layer, inode, flags,
                                   self.backings.mode(layer.id, inode, lambda: self._chunk_file(layer, chunk)))
        except Exception:  # the open's EIO, logged
            log.exception("open of %s in layer %s of %s", node.path, layer.blob.digest, layer.image or "?")
            out = p.reply_error(u, errno.EIO)
        session = self.session
        if session is not None:
            try:
                session.reply([out], token)
            except OSError as e:
                log.error("FUSE reply to an open refused: %s", e)

    def _open_reply(self, u: int, layer: Layer, inode: int, flags: int, backing_id: int) -> bytes:
        # fh: the inode (what READ needs). No FLUSH at close: a read-only file has nothing to
        # flush, and a close must not wait for a server (a process forked to become the next
        # server closes the FUSE files it inherited before it serves)
        if backing_id == CACHED:
            return p.reply_open(u, inode, p.FOPEN_KEEP_CACHE | p.FOPEN_NOFLUSH)
        layer.passthrough_opens += 1
        # (an O_DIRECT open of a passthrough inode: its reads come here, as any O_DIRECT read
        # does, where the store's file system would want aligned buffers; its maps still go
        # to the backing file, and the inode stays in the one mode the kernel allows)
        direct = p.FOPEN_DIRECT_IO if flags & os.O_DIRECT else 0
        return p.reply_open(u, inode, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH | direct, backing_id)

    def _chunk_file(self, layer: Layer, chunk: Chunk) -> int | None:
        """A descriptor of the chunk's store file, verified (None: gone, or it did not
        verify; the file is read through this process). The chunk counts as read for the
        layer's access trace: its reads will not come here."""
        assert self.data_path is not None and self.data_path.store is not None
        fd = self.data_path.store.open_verified(chunk.digest)
        if fd is not None and layer.view.reader.on_read is not None:
            layer.view.reader.on_read([chunk])
        return fd

    def read(self, u: int, fh: int, off: int, size: int, cached: bool = True) -> list | None:
        """A READ. `cached`: the kernel keeps the reply's pages (FOPEN_KEEP_CACHE; not an
        O_DIRECT read), so the chunk memory may forget a chunk once all its bytes went out
        (cache/memory.py)."""
        layer, node = self._resolve(fh)
        layer.reads += 1
        self._refuse_bad(layer, node, "read")
        # Chunks already decompressed in memory are served here; anything that must be
        # loaded (store, network) goes to a worker thread, which writes the reply.
        try:
            parts = layer.view.reader.read_cached(node.path, off, size, kept=cached)
        except Exception as e:  # noqa: BLE001 - answered as the slow path answers it
            return [self._read_failed(u, layer, node, off, size, e)]
        if parts is None:
            session = self.session
            token = session.defer(u, fh) if session is not None else -1  # (before the worker can answer)
            self._read_pool.submit(self._read_slow, u, layer, node, off, size, token, cached)
            return None
        return self._data_reply(u, layer, parts)

    def _data_reply(self, u: int, layer: Layer, parts: list[memoryview]) -> list:
        """A READ's reply: the header and views of the chunks' bytes, for one writev (the
        payload is copied once, by the kernel)."""
        n = sum(len(part) for part in parts)
        layer.read_bytes += n
        if len(parts) > MAX_PARTS:
            parts = [memoryview(b"".join(parts))]
        return [p.reply_header(u, n), *parts]

    def _read_slow(self, u: int, layer: Layer, node: Node, off: int, size: int, token: int,
                   cached: bool = True) -> None:
        try:
            out = self._data_reply(u, layer, layer.view.reader.read_parts(node.path, off, size, kept=cached))
        except Exception as e:  # noqa: BLE001 - every failure is the reader's EIO
            out = [self._read_failed(u, layer, node, off, size, e)]
        session = self.session
        if session is not None:
            try:
                session.reply(out, token)
            except OSError as e:
                log.error("FUSE reply to a read refused: %s", e)

    def _read_failed(self, u: int, layer: Layer, node: Node, off: int, size: int, e: Exception) -> bytes:
        if isinstance(e, ShoalError):
            layer.errors += 1
            log.error("read %s offset %d size %d of %s: %s", node.path, off, size, layer.blob.digest, e)
            return p.reply_error(u, errno.EIO)
        if isinstance(e, OSError):
            return p.reply_error(u, e.errno if e.errno and 0 < e.errno <= p.MAX_ERRNO else errno.EIO)
        layer.errors += 1
        log.error("read %s of %s failed", node.path, layer.blob.digest, exc_info=e)
        return p.reply_error(u, errno.EIO)


def _write_private(path: str, data: bytes) -> None:
    """Write a file under ROOT atomically (a temporary file renamed over it), 0600."""
    tmp = f"{path}.{os.getpid()}.{threading.get_native_id()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _numbers_in(layers: str) -> list[int]:
    """The layer numbers recorded under ROOT/layers (for a root made before ROOT/layer-numbers)."""
    out = []
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(layers):
            with contextlib.suppress(OSError, ValueError), open(os.path.join(layers, name, NUMBER_FILE)) as f:
                out.append(int(f.read().strip()))
    return out


def _lower_priority() -> None:
    """Lower the CPU priority of the calling thread alone (Linux: a thread is a task)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PROOF_NICE)
    except OSError as e:
        log.warning("cannot lower the priority of the proof thread: %s", e)


# --- process ------------------------------------------------------------------------------


HANDOVER_DRAIN = 5.0  # seconds a handover on a kernel without NOTIFY_RESEND waits for requests in flight
WAKE_XATTR = "user.shoal.handover"  # the server's GETXATTR of its own root that wakes a reader (ENODATA)
READAHEAD_KB = 1024  # the node passes [fetch] readahead_kb; this is for a server started alone


def set_readahead(mnt: str, kb: int) -> None:
    """Let the kernel read ahead `kb` KiB on the layers' files (the FUSE default is 128).

    A mapped library faults its pages in one by one, and each fault that misses is a
    read that waits for the network. With a wider window the kernel asks for the pages
    around the fault in several reads at once, which this server answers in parallel;
    the faulting page comes back first. The window is the mount's backing device's
    read_ahead_kb in sysfs (found through mountinfo: a stat of the mount would ask this
    very process). The kernel sets it when the mount's INIT is answered, so this runs
    right after that (Session.on_init)."""
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
    return LayerFS(root, path.loader, path, page_in=config.get("page_in", True) is not False)


def clear_dead_mount(mnt: str) -> None:
    """Detach what is mounted at `mnt` (a server that died without unmounting leaves a
    mount whose every access is ENOTCONN: makedirs and stat of it fail)."""
    while any(point == mnt for point, _ in mounts()):
        if not unmount(mnt):
            raise ShoalError(f"cannot unmount the dead mount {mnt}")
        log.warning("detached the mount left at %s", mnt)


INFLIGHT_FILE = "fs-inflight"  # ROOT/fs-inflight: the session's in-flight table (session.InFlight)


def open_session(root: str, mnt: str, log_path: str | None = None,
                 describe: Callable[[int], str] | None = None) -> Session:
    """The FUSE session to serve: the one the descriptor holder keeps for `mnt`, taken
    over (no INIT; Session.serve writes NOTIFY_RESEND first, or on a kernel without it
    answers EIO to what ROOT/fs-inflight records), or a new mount whose descriptor goes
    to the holder once INIT is answered. Nothing here touches `mnt` while a held session
    may be waiting for a server (a stat of it would wait for us)."""
    inflight = os.path.join(root, INFLIGHT_FILE)
    held = holder.get(root)
    if held is not None:
        fd, state = held
        if state.get("mnt") == mnt and any(point == mnt for point, _ in mounts()):
            try:
                negotiated = p.Negotiated.from_json(str(state.get("negotiated")).encode())
            except p.ProtocolError as e:
                log.error("the held FUSE session of %s: %s: mounting anew", mnt, e)
            else:
                log.info("taking over the FUSE session of %s from the descriptor holder", mnt)
                return Session(fd, negotiated, inflight=inflight, name=mnt, describe=describe)
        os.close(fd)
        holder.drop(root)  # a session of a mount that is gone: no one is served by it
    clear_dead_mount(mnt)
    os.makedirs(mnt, mode=0o700, exist_ok=True)
    try:
        holder.ensure(root, log_path)  # before the mount: the descriptor goes to it right after INIT
    except (OSError, ShoalError) as e:
        log.error("no descriptor holder (a crash of this process will end the FUSE session): %s", e)
    session = Session.mount(mnt, inflight)
    session.describe = describe

    def keep(negotiated: p.Negotiated) -> None:
        try:
            pid = holder.put(root, session.fd, {"mnt": mnt, "negotiated": negotiated.to_json().decode()}, log_path)
            log.info("the FUSE session of %s is held by pid %d (it survives this process)", mnt, pid)
        except (OSError, ShoalError) as e:
            log.error("cannot hand the FUSE session to the descriptor holder (a crash of this process "
                      "will end it): %s", e)

    session.on_init = keep
    return session


def tune_malloc() -> None:
    """Keep freed buffers for the next ones. Reads allocate and free chunk-sized buffers
    (about a MiB, decompressed chunks and replies) all the time; glibc's defaults give such
    memory back to the kernel when it is freed (munmap, or a trim of the heap's top), so
    every next buffer faults its pages in again and the kernel zeroes them: about 6% of
    this process's CPU in a fleet start. Buffers under 32 MiB come from the heap, which
    keeps up to 64 MiB free at its top."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(M_MMAP_THRESHOLD, 32 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 64 << 20)
    except (OSError, AttributeError) as e:  # not glibc: its defaults stay
        log.info("malloc left as it is: %s", e)


def _drain(session: Session, mnt: str, deadline: float) -> None:
    """A handover on a kernel without NOTIFY_RESEND: serve on until no request is in
    flight, then stop the readers (so none reads a request between the last check and
    the exit) and wait for what they took meanwhile; what is still in flight at
    `deadline` the next server answers EIO (logged by both)."""
    def busy() -> int:
        return session.table.busy() if session.table is not None else 0

    while busy() and time.monotonic() < deadline:
        time.sleep(0.01)

    def wake() -> None:
        with contextlib.suppress(OSError):  # (ENODATA: its answer)
            os.getxattr(mnt, WAKE_XATTR)

    stopped = session.stop_reading(wake, deadline)
    while busy() and time.monotonic() < deadline:
        time.sleep(0.01)
    if busy() or not stopped:
        log.warning("handover of %s: %d requests still in flight after %.0f s (the next server answers them "
                    "EIO)%s", mnt, busy(), HANDOVER_DRAIN, "" if stopped else "; a reader did not stop")


def _backings(fs: LayerFS, session: Session, config: dict) -> Backings:
    """The session's passthrough state: a takeover's takes up the records of its
    predecessor (whose backing ids the connection keeps), a new mount's starts with none
    and asks the kernel for passthrough unless [fetch] passthrough is false or there is
    no chunk store."""
    backings = Backings(session.fd, os.path.join(fs.root, "layers"))
    if not config.get("passthrough", True):
        backings.off = "[fetch] passthrough = false"
    elif fs.data_path is None or fs.data_path.store is None:
        backings.off = "no chunk store"
    if not session.took_over:
        backings.reset()
        if not backings.off:
            session.want |= p.FUSE_PASSTHROUGH
    for layer_id in list(fs.layers):  # (a takeover's: the records; a new mount's: none, the layers live)
        backings.attach(layer_id)
    return backings


def run(root: str, config: dict) -> int:
    os.umask(PRIVATE_UMASK)  # what this process makes under ROOT (chunks, swarm storage) is root's alone
    tune_malloc()
    private_dir(os.path.join(root, "layers"))
    fs = build_fs(root, config)
    mnt = fs.mnt
    for layer_id in sorted(os.listdir(os.path.join(root, "layers"))):
        if not os.path.exists(os.path.join(layer_dir(root, layer_id), "toc.json")):
            continue  # a prepare in progress (or cut short): its `load` fetches the TOC (or sweep removes it)
        try:
            fs.load(layer_id)
        except (ShoalError, OSError, ValueError, KeyError) as e:
            log.error("cannot restore layer %s: %s", layer_id, e)
    logs = os.path.join(root, "logs")
    session = fs.session = open_session(root, mnt, os.path.join(logs, "fs-holder.log") if os.path.isdir(logs) else None,
                                        fs.describe)
    fs.backings = _backings(fs, session, config)
    if not session.took_over:
        readahead_kb = int(config.get("readahead_kb", READAHEAD_KB))
        keep = session.on_init

        def on_init(negotiated: p.Negotiated) -> None:
            set_readahead(mnt, readahead_kb)
            if keep is not None:
                keep(negotiated)

        session.on_init = on_init
    control = NodeControl(fs, fs.data_path.swarm_ops if fs.data_path else None)
    server = ControlServer(os.path.join(root, SOCKET_NAME), control.handle).start()
    stop = {"how": ""}
    stopped = threading.Event()

    def _term(signum, _frame):
        # SIGTERM, SIGINT: stop serving (unmount; the holder lets the session go).
        # SIGUSR1: hand over (an upgrade): exit, leaving the session to the holder and
        # the next server; what this one has not answered, the kernel sends that one again.
        stop["how"] = "handover" if signum == signal.SIGUSR1 else "stop"
        stopped.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
        signal.signal(signum, _term)
    session.serve(fs.handle)
    log.info("serving %d layers at %s (pid %d%s)", len(fs.layers), mnt, os.getpid(),
             ", taken over" if session.took_over else "")
    try:
        while not stopped.wait(0.5) and not session.wait(0):
            pass
    finally:
        fs.closing.set()
        server.close()
        if stop["how"] == "handover":
            if not session.has_resend:  # the next server could only answer them EIO: let them end
                _drain(session, mnt, time.monotonic() + HANDOVER_DRAIN)
            log.info("handing the FUSE session of %s over to the next server", mnt)
        else:
            unmount(mnt)
            holder.drop(root)
            log.info("unmounted %s (%s)", mnt, "connection ended" if session.wait(0) else "told to stop")
        if fs.data_path is not None:
            fs.data_path.close(10.0)
    if stop["how"] == "handover":
        os._exit(0)  # (the reader threads wait in read(2): they must not read on)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="shoal-fs", description="shoal's layer file system server (started by shoal node)")
    p.add_argument("--root", required=True)
    p.add_argument("--config-json", default="{}", help="node configuration, as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s shoal-fs %(levelname)s %(message)s", stream=sys.stderr)
    faulthandler.register(signal.SIGUSR2)  # a developer's aid: every thread's stack to the log
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
