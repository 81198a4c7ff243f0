"""Passthrough opens of the layer file system: a file whose content is one whole chunk
held in the node's chunk store is opened with FOPEN_PASSTHROUGH, and the kernel reads
(and maps) the store's file of that chunk itself, without a READ to this process.

The kernel's rule (fs/fuse/iomode.c): while an inode is open, all its opens are
passthrough with one backing file, or none is; an open that breaks it fails with EIO.
So each inode's mode is decided at its first open on this connection and kept for the
connection's life: `Backings.mode`. The decision is written to the layer's record,
ROOT/layers/<id>/backing (one line "INODE BACKING_ID" per inode; 0 = cached), before the
open is answered, so that a server taking the session over (from the descriptor holder)
answers every later open as its predecessor did, with the same backing ids, which the
connection keeps. A new mount starts with no records (`reset`); an unloaded layer's ids
are closed and its record removed (`detach`).

Trust: the descriptor registered is one whose content the store verified through that
very descriptor (ChunkStore.open_verified); store files are never written in place, so
what the kernel reads is the verified chunk, even after the store evicts it (the kernel
holds the file until the layer is unloaded).

Threads: `mode` runs on the session's reader thread and the read workers; `attach` and
`detach` on the control socket's; one lock covers the tables and the records' descriptors
(a record is written and closed under it, so a write never goes to a reused descriptor
number), and a first open decided while its layer is detached records nothing.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import threading
from collections.abc import Callable

from snapshotter.fs import protocol as p

log = logging.getLogger("shoal.fs")

RECORD = "backing"  # ROOT/layers/<id>/backing
CACHED = 0  # a record's backing id for an inode answered without passthrough

# backing_open errors that say this connection or machine cannot do passthrough at all
_NOT_HERE = {errno.EPERM: "no CAP_SYS_ADMIN, or the kernel took no passthrough for this mount",
             errno.ELOOP: "the chunk store is on a stacked file system (overlayfs?)",
             errno.ENOTTY: "this kernel has no FUSE backing files", errno.EINVAL: "refused by the kernel",
             errno.EOPNOTSUPP: "refused by the kernel"}


class Backings:
    """The passthrough state of one FUSE connection (`dev_fd`: its /dev/fuse descriptor)."""

    def __init__(self, dev_fd: int, layers_dir: str):
        self.dev_fd = dev_fd
        self.layers_dir = layers_dir
        self.off = ""  # why passthrough is off for this connection ("" while it is on)
        self._lock = threading.Lock()
        self._modes: dict[int, int] = {}  # inode -> backing id (CACHED: not passthrough)
        self._inodes: dict[str, list[int]] = {}  # layer id -> its decided inodes
        self._fds: dict[str, int] = {}  # layer id -> its record, open for appending
        self._live: set[str] = set()  # layers attached and not detached (the ones a record is kept for)
        self._gates: dict[int, threading.Lock] = {}  # inode -> the lock of its first open's decision
        self.opened = 0  # backing files registered by this process

    def _record(self, layer_id: str) -> str:
        return os.path.join(self.layers_dir, layer_id, RECORD)

    def reset(self) -> None:
        """A new mount: no backing id of an earlier connection means anything."""
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.layers_dir):
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    os.unlink(self._record(name))

    def attach(self, layer_id: str) -> int:
        """Serve the layer's opens from now on (records are kept for it until `detach`),
        taking up its record (a predecessor's decisions on this connection): how many
        inodes it names. A line that is not two numbers is skipped, logged."""
        try:
            with open(self._record(layer_id), "rb") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        got: dict[int, int] = {}
        with self._lock:
            self._live.add(layer_id)
        for n, line in enumerate(lines, 1):
            try:
                inode, backing_id = (int(x) for x in line.split())
            except ValueError:
                log.warning("%s line %d: not 'INODE BACKING_ID': skipped (an open of that inode may fail)",
                            self._record(layer_id), n)
                continue
            got.setdefault(inode, backing_id)
        with self._lock:
            self._modes.update(got)
            self._inodes.setdefault(layer_id, []).extend(got)
        return len(got)

    def detach(self, layer_id: str) -> None:
        """The layer is unloaded: drop its backing ids (files open with them keep their
        backing file) and its record."""
        with self._lock:
            inodes = self._inodes.pop(layer_id, [])
            ids = {self._modes.pop(i, CACHED) for i in inodes} - {CACHED}
            fd = self._fds.pop(layer_id, None)
            self._live.discard(layer_id)
            if fd is not None:
                os.close(fd)  # (under the lock: no write of `mode` can use the number after this)
        for backing_id in ids:
            try:
                p.backing_close(self.dev_fd, backing_id)
            except OSError as e:
                log.debug("closing backing id %d: %s", backing_id, e)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._record(layer_id))

    def known(self, inode: int) -> int | None:
        """The inode's mode if it is decided on this connection (any thread, no lock)."""
        return self._modes.get(inode)

    def mode(self, layer_id: str, inode: int, open_chunk: Callable[[], int | None]) -> int:
        """The inode's backing id, or CACHED: as decided before on this connection, else
        decided now (`open_chunk`: a verified descriptor of the file's whole content, or
        None) and recorded before the caller answers the open. Two first opens of one
        inode decide once; first opens of different inodes do not wait for each other."""
        known = self._modes.get(inode)
        if known is not None:
            return known
        with self._lock:
            gate = self._gates.setdefault(inode, threading.Lock())
        with gate:
            known = self._modes.get(inode)
            if known is not None:
                return known
            backing_id = self._register(open_chunk) if not self.off else CACHED
            with self._lock:
                self._gates.pop(inode, None)
                if layer_id not in self._live:  # unloaded meanwhile: nothing to record, nothing kept
                    self._close_id(backing_id)
                    return CACHED
                try:
                    os.write(self._record_fd(layer_id), b"%d %d\n" % (inode, backing_id))  # (one append)
                except OSError as e:  # unrecorded, a takeover could answer it otherwise: not passthrough
                    log.error("cannot record the open mode of inode %#x in %s: %s", inode, self._record(layer_id),
                              e)
                    self._close_id(backing_id)
                    backing_id = CACHED
                self._modes[inode] = backing_id
                self._inodes.setdefault(layer_id, []).append(inode)
            return backing_id

    def _close_id(self, backing_id: int) -> None:
        if backing_id != CACHED:
            with contextlib.suppress(OSError):
                p.backing_close(self.dev_fd, backing_id)

    def _record_fd(self, layer_id: str) -> int:
        """The layer's record, open for appending (kept open until `detach`). Under the lock."""
        fd = self._fds.get(layer_id)
        if fd is None:
            fd = self._fds[layer_id] = os.open(
                self._record(layer_id), os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        return fd

    def _register(self, open_chunk: Callable[[], int | None]) -> int:
        fd = open_chunk()
        if fd is None:
            return CACHED
        try:
            backing_id = p.backing_open(self.dev_fd, fd)
        except OSError as e:
            if e.errno in _NOT_HERE:
                self.off = f"{e.strerror} ({_NOT_HERE[e.errno]})"
                log.warning("FUSE passthrough is off for this mount: %s; files are read through this process",
                            self.off)
            else:
                log.warning("FUSE passthrough: registering a chunk file: %s (this file is read through this "
                            "process)", e)
            return CACHED
        finally:
            os.close(fd)
        with self._lock:
            self.opened += 1
        return backing_id

    def statistics(self) -> dict:
        with self._lock:
            modes = list(self._modes.values())
        passthrough = sum(1 for m in modes if m != CACHED)
        return {"on": not self.off, "off_reason": self.off, "passthrough_inodes": passthrough,
                "cached_inodes": len(modes) - passthrough, "backing_files_registered": self.opened}
