"""The overlayfs snapshotter, after containerd's snapshots/overlay, plus the remote seam.

On disk, under ROOT:

    metadata.db            the MetaStore (metadata.py)
    snapshots/ID/fs        the snapshot's own files: the upper directory of an active
                           snapshot, a lower directory once committed
    snapshots/ID/work      overlayfs' work directory (active snapshots only)
    snapshots/new-XXXX     a directory being created (exists only inside a transaction)

A committed snapshot provided by RemoteLayers has no directory here: its lower
directory is the layer's own path (recorded in the metadata), typically a FUSE mount.

Mounts (what containerd mounts; we never mount anything ourselves):
- no parent: a bind mount of fs, "rw" for an active snapshot, "ro" for a view;
- active with parents: overlay, lowerdir = the parents' directories nearest first,
  upperdir = fs, workdir = work;
- view with one parent: a read-only bind of the parent's directory (overlayfs needs two
  lower directories when there is no upper one);
- view with several parents: overlay with lowerdirs only (read-only by construction).
containerd shortens long lowerdir lists itself (relative paths from their common
directory), so deep stacks (128 layers) mount although their options exceed a page.

Crash consistency (see metadata.py): a new directory is built under a temporary name and
renamed to its id inside the transaction that inserts the row; a removed snapshot's
directory is deleted after the row's deletion has committed. Cleanup (also run at start)
deletes directories that no row owns.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from shoal.errors import ShoalError
from shoal.fsutil import mounts
from snapshotter.chainproof import ChainProofs, ProofConfig, chain_id_of
from snapshotter.filters import parse_filters
from snapshotter.metadata import MetaStore, Record
from snapshotter.snapshotter import (
    LABEL_LAYER_KIND,
    LABEL_SNAPSHOT_REF,
    NODE_LABELS,
    AlreadyExists,
    FailedPrecondition,
    Info,
    Kind,
    Mount,
    RemoteLayer,
    RemoteLayers,
    Usage,
)

log = logging.getLogger("shoal.snapshotter")

# overlayfs splits its options at "," and lowerdir lists at ":".
_MOUNT_OPTION_SEPARATORS = (",", ":")
LAYER_KINDS = ("lazy", "unpacked")


def check_mountable_path(path: str, what: str) -> None:
    """Paths that go into overlayfs options must be absolute and free of its separators."""
    if not os.path.isabs(path):
        raise ShoalError(f"{what} {path!r} must be an absolute path")
    bad = [c for c in _MOUNT_OPTION_SEPARATORS if c in path]
    if bad:
        raise ShoalError(f"{what} {path!r} must not contain {' or '.join(repr(c) for c in bad)} (overlayfs options)")


def disk_usage(path: str | Path) -> Usage:
    """Allocated bytes and distinct inodes under `path`, hard links counted once
    (what containerd's continuity fs.DiskUsage reports)."""
    seen: set[tuple[int, int]] = set()
    size = 0

    def account(st: os.stat_result) -> None:
        nonlocal size
        ident = (st.st_dev, st.st_ino)
        if ident not in seen:
            seen.add(ident)
            size += st.st_blocks * 512

    account(os.lstat(path))  # FileNotFoundError if the snapshot itself is gone
    stack = [os.fspath(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as entries:
                for entry in entries:
                    try:
                        account(entry.stat(follow_symlinks=False))
                    except FileNotFoundError:
                        continue  # deleted while we walk (a running container's upper)
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except FileNotFoundError:
            continue
    return Usage(size=size, inodes=len(seen))



class LocalSnapshotter:
    """containerd's overlay snapshotter in Python, with remote layers plugged in through
    `remote` (see snapshotter.RemoteLayers). Implements snapshotter.Snapshotter."""

    def __init__(self, root: str | Path, remote: RemoteLayers | None = None,
                 proofs: ProofConfig | None = None) -> None:
        self.root = Path(os.path.abspath(root))
        check_mountable_path(str(self.root), "snapshotter root")
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._snapshots = self.root / "snapshots"
        self._snapshots.mkdir(mode=0o700, exist_ok=True)
        self._db = MetaStore(self.root / "metadata.db")
        self._remote = remote
        # containerd sets index=off whenever the kernel knows the option: with the index
        # on, overlayfs refuses lower directories that moved or were mounted elsewhere.
        self._index_off = os.path.exists("/sys/module/overlay/parameters/index")
        self._targets_guard = threading.Lock()
        self._targets: dict[str, list] = {}  # target -> [lock, users]
        # The proofs of lazy layers and the gate before containers (chainproof.py); none
        # without a remote layer provider or a proof configuration.
        self.proofs = ChainProofs(self._db, remote, proofs, self.remove) if remote and proofs else None

    # --- start-up

    def recover(self) -> None:
        """After a (re)start: delete orphaned directories, have RemoteLayers drop the
        layers no snapshot uses, then re-establish every remote layer recorded in the
        metadata."""
        self.cleanup()
        with self._db.read() as tx:
            remote = [rec for rec in tx.all() if rec.remote]
        if remote and self._remote is None:
            log.warning("%d remote layers in the metadata but no remote layer provider: mounts using them will fail",
                        len(remote))
            return
        if self._remote is None:
            return
        try:
            self._remote.sweep({rec.layer_path for rec in remote if rec.layer_path})
        except Exception as e:  # noqa: BLE001 (leftovers cost disk, not correctness)
            log.error("cannot sweep remote layers no snapshot uses: %s", e)
        for rec in remote:
            try:
                self._remote.restore(rec.layer_path or "", dict(rec.labels))
                log.info("restored %s layer %s at %s", rec.layer_kind, rec.key, rec.layer_path)
            except Exception as e:  # noqa: BLE001 (one bad layer must not keep the node from serving the rest)
                log.error("cannot restore %s layer %s at %s: %s", rec.layer_kind, rec.key, rec.layer_path, e)
        if self.proofs is not None:
            self.proofs.start(remote)

    # --- reads

    def stat(self, key: str) -> Info:
        with self._db.read() as tx:
            return tx.get(key).info()

    def usage(self, key: str) -> Usage:
        with self._db.read() as tx:
            rec = tx.get(key)
        if rec.kind != Kind.ACTIVE:
            return rec.usage
        try:
            return disk_usage(self._upper(rec))
        except FileNotFoundError:
            with self._db.read() as tx:
                tx.get(key)  # removed meanwhile: NotFound
            raise

    def mounts(self, key: str) -> list[Mount]:
        with self._db.read() as tx:
            rec = tx.get(key)
            if rec.kind not in (Kind.ACTIVE, Kind.VIEW):
                raise FailedPrecondition(f"snapshot {key!r} is {rec.kind}, not active or view: it has no mounts")
            return self._mounts(rec, tx.chain(rec))

    def walk(self, filters: Sequence[str] = ()) -> list[Info]:
        match = parse_filters(filters)
        with self._db.read() as tx:
            infos = [rec.info() for rec in tx.all()]
        return [info for info in infos if match(info)]

    # --- writes

    def prepare(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        labels = dict(labels or {})
        target = labels.get(LABEL_SNAPSHOT_REF)
        if target and self._remote is not None:
            self._prepare_remote(key, parent, target, labels)  # raises AlreadyExists when it provides the layer
        return self._create(Kind.ACTIVE, key, parent, labels)

    def view(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        return self._create(Kind.VIEW, key, parent, dict(labels or {}))

    def _gate(self, key: str, parent: str, labels: dict[str, str]) -> None:
        """Before an active snapshot or view is made on `parent`: its chain's lazy layers
        must be what their chain ids say, as far as any image here can tell (chainproof.py)."""
        if self.proofs is None or not parent:
            return
        with self._db.read() as tx:
            parent_rec = tx.find(parent)
            chain = [parent_rec, *tx.chain(parent_rec)] if parent_rec is not None else []
        self.proofs.gate(key, chain, labels)  # may wait for a proof: no lock held

    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> None:
        with self._db.read() as tx:
            if tx.find(name) is not None:
                raise AlreadyExists(f"committed snapshot {name!r} already exists")
            rec = tx.get(key)
            if rec.kind != Kind.ACTIVE:
                raise FailedPrecondition(f"snapshot {key!r} is not active (it is {rec.kind})")
        try:
            usage = disk_usage(self._upper(rec))  # outside the lock: may take a while
        except FileNotFoundError:
            with self._db.read() as tx:
                tx.get(key)  # removed meanwhile: NotFound
            raise
        with self._db.write() as tx:
            tx.commit(key, name, labels, usage, expect_id=rec.id)

    def update(self, info: Info, fieldpaths: Sequence[str] = ()) -> Info:
        with self._db.write() as tx:
            return tx.update(info.name, dict(info.labels), list(fieldpaths)).info()

    def remove(self, key: str, expect_id: int | None = None) -> None:
        """Snapshotter.remove; with `expect_id`, only while `key` is still that snapshot
        (NotFound else): a removal decided earlier never takes one made since."""
        with self._db.write() as tx:
            rec = tx.remove(key, expect_id)
            # One layer (one blob) can stand in several chains: release it with the last.
            shared = rec.remote and any(r.layer_path == rec.layer_path for r in tx.all())
        # The row is gone for good; what follows only frees resources, and what it fails
        # to free, cleanup finds later.
        if rec.remote:
            if not shared:
                self._release(rec)
        else:
            self._remove_dir(self._dir(rec.id))
        if self.proofs is not None:
            self.proofs.removed(rec.parent)

    def cleanup(self) -> None:
        with self._db.write() as tx:  # no directory is being created while we list
            ids = tx.ids()
            orphans = [
                self._snapshots / name for name in os.listdir(self._snapshots)
                if not (name.isdigit() and int(name) in ids)
            ]
        if not orphans:
            return
        mounted = [point for point, _ in mounts()]
        for path in orphans:
            prefix = str(path) + "/"
            busy = [p for p in mounted if p == str(path) or p.startswith(prefix)]
            if busy:
                log.warning("not removing orphaned snapshot directory %s: %s is mounted", path, busy[0])
                continue
            log.info("removing orphaned snapshot directory %s", path)
            self._remove_dir(path)

    def close(self) -> None:
        if self.proofs is not None:
            self.proofs.stop()
        self._db.close()

    # --- internals

    def _dir(self, snapshot_id: int) -> Path:
        return self._snapshots / str(snapshot_id)

    def _upper(self, rec: Record) -> str:
        """The directory holding the snapshot's own files."""
        if rec.layer_path is not None:
            return rec.layer_path
        return str(self._dir(rec.id) / "fs")

    def _mounts(self, rec: Record, chain: list[Record]) -> list[Mount]:
        if not chain:
            flag = "ro" if rec.kind == Kind.VIEW else "rw"
            return [Mount("bind", self._upper(rec), (flag, "rbind"))]
        options = ["index=off"] if self._index_off else []
        if rec.kind == Kind.ACTIVE:
            options += [f"workdir={self._dir(rec.id) / 'work'}", f"upperdir={self._upper(rec)}"]
        elif len(chain) == 1:
            return [Mount("bind", self._upper(chain[0]), ("ro", "rbind"))]
        options.append("lowerdir=" + ":".join(self._upper(p) for p in chain))
        return [Mount("overlay", "overlay", tuple(options))]

    def _create(self, kind: Kind, key: str, parent: str, labels: dict[str, str]) -> list[Mount]:
        self._gate(key, parent, labels)
        owner = None
        if parent:
            # The new fs takes the owner of the parent's top directory (as containerd's
            # overlay does), so that a chowned root survives into the child's upper.
            with self._db.read() as tx:
                parent_rec = tx.find(parent)
            if parent_rec is not None:
                st = os.stat(self._upper(parent_rec))
                owner = (st.st_uid, st.st_gid)
        final: Path | None = None
        try:
            with self._db.write() as tx:
                tx.check_new(kind, key, parent)
                tmp = Path(tempfile.mkdtemp(prefix="new-", dir=self._snapshots))
                try:
                    fs = tmp / "fs"
                    fs.mkdir()
                    os.chmod(fs, 0o755)  # whatever our umask: containerd expects 0755 roots
                    if kind == Kind.ACTIVE:
                        (tmp / "work").mkdir()
                        os.chmod(tmp / "work", 0o711)
                    if owner is not None:
                        os.lchown(fs, *owner)
                    rec = tx.create(kind, key, parent, labels)
                    final = self._dir(rec.id)
                    os.rename(tmp, final)
                except BaseException:
                    shutil.rmtree(tmp, ignore_errors=True)
                    raise
                chain = tx.chain(rec)
        except BaseException:
            if final is not None:  # renamed, but the transaction did not commit
                shutil.rmtree(final, ignore_errors=True)
            raise
        return self._mounts(rec, chain)

    @contextmanager
    def _target_lock(self, target: str) -> Iterator[None]:
        """Serialises remote prepares of one target (two namespaces pulling one image)."""
        with self._targets_guard:
            entry = self._targets.setdefault(target, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._targets_guard:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._targets[target]

    def _prepare_remote(self, key: str, parent: str, target: str, labels: dict[str, str]) -> None:
        """Ask RemoteLayers for the layer `target`; if it provides one, commit it as
        `target` and raise AlreadyExists (the remote-snapshotter protocol). Returns when
        the Prepare should go on as an ordinary one."""
        if self._remote is None:  # (prepare asks only with a provider)
            return
        with self._target_lock(target):
            with self._db.read() as tx:
                parent_rec = tx.check_new(Kind.ACTIVE, key, parent)
                existing = tx.find(target)
            parent_chain = chain_id_of(parent_rec) if parent_rec is not None else ""
            if existing is not None:
                if (existing.kind == Kind.COMMITTED and existing.parent == parent
                        and existing.labels.get(LABEL_SNAPSHOT_REF) == target):
                    # may wait for a proof; False: it was bad and is gone, provide it anew
                    if self.proofs is None or self.proofs.check_existing(existing, labels):
                        raise AlreadyExists(f"target snapshot {target!r} already exists")
                else:
                    return
            asked = {k: v for k, v in labels.items() if k not in NODE_LABELS}
            layer = self._remote.prepare(target, parent_chain, dict(asked))
            if layer is None:
                return
            try:
                check_mountable_path(layer.path, "remote layer path")
                if layer.kind not in LAYER_KINDS:
                    raise ShoalError(f"remote layer {target}: unknown kind {layer.kind!r} (expected lazy or unpacked)")
                recorded = {**asked, **layer.info_labels, LABEL_LAYER_KIND: layer.kind}
                if self.proofs is not None:
                    recorded.update(self.proofs.labels_for(target, parent_chain, layer, asked))
                with self._db.write() as tx:
                    tx.create_committed(target, parent, recorded, layer.usage or Usage(), layer.path, layer.kind)
            except BaseException:
                with self._db.read() as tx:
                    shared = any(r.layer_path == layer.path for r in tx.all())
                if not shared:  # another chain made from the same blob still serves from it
                    self._release_layer(layer, target)
                raise
            if self.proofs is not None:
                self.proofs.provided(layer, recorded)
        log.info("layer %s: %s, served from %s", target, layer.kind, layer.path)
        raise AlreadyExists(f"target snapshot {target!r} provided as a {layer.kind} layer")

    def _release(self, rec: Record) -> None:
        layer = RemoteLayer(path=rec.layer_path or "", kind=rec.layer_kind or "", info_labels=dict(rec.labels),
                            usage=rec.usage)
        if self._remote is None:
            log.warning("removed %s layer %s at %s, but no remote layer provider is configured to release it",
                        rec.layer_kind, rec.key, rec.layer_path)
            return
        self._release_layer(layer, rec.key)

    def _release_layer(self, layer: RemoteLayer, name: str) -> None:
        if self._remote is None:
            return
        try:
            self._remote.release(layer)
        except Exception as e:  # noqa: BLE001 (the snapshot is gone either way: log, go on)
            log.error("cannot release %s layer %s at %s: %s", layer.kind, name, layer.path, e)

    @staticmethod
    def _remove_dir(path: Path) -> None:
        def warn(func, p, exc_info) -> None:
            log.warning("cannot remove %s: %s", p, exc_info[1])

        if os.path.lexists(path):
            shutil.rmtree(path, onerror=warn)
