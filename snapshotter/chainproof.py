"""A chain id holds only what its diff_ids say: the proof of lazy layers, and the gate.

containerd names a layer's snapshot by its chain id, computed from the diff_ids of the
image config, which is the image's own (possibly hostile) word. Its unpacker Stats the
chain id first and skips the layer when a snapshot exists, and every CRI image of a
node lives in one namespace (`k8s.io`): so the first image to provide chain C decides
what every later image naming C runs on. containerd's own unpack hashes the stream
against the diff_id; a node-unpacked layer does the same (unpack.py). A lazy layer
cannot: its diff_id is the sha256 of the whole decompressed blob, which a lazy start
has not read. What holds instead:

- **Proof.** Every lazy snapshot starts pending (no LABEL_PROOF). Some time after it is
  provided (`after`), the node reads its whole blob in the background at low priority
  (RemoteLayers.prove: the layer file system, through the node's fetch chain), checks
  sha256(blob) against the layer digest and computes sha256(decompressed stream) = D.
  The snapshot is PROVEN if chain(parent chain, D) is its own name, else BAD. The answer
  is kept in the snapshot's labels (LABEL_PROOF, LABEL_DIFF_ID) and, per blob, in the
  node-wide proof table (metadata.db `proofs`): a later Prepare of a known blob is
  proven at once, or refused at once when its chain does not match.
- **Bad.** A BAD lazy layer's reads fail with EIO and a log line (unless a PROVEN chain
  uses the same blob, whose containers read exactly that blob's true content); a
  Prepare or View on a chain holding it fails with one line; it is removed (through
  containerd, in every namespace, then here) as soon as no container uses it, so that
  the next pull provides the chain again from the blob its image names.
- **The gate.** Where every path meets (containerd's CRI pull, `ctr run`, `shoal pull`):
  the Prepare or View of an active snapshot (a container's rootfs, or an unpack on top)
  whose parent chain holds pending lazy layers. For each pending chain C the gate asks
  containerd which images of the snapshot's namespace (the first part of containerd's
  key NAMESPACE/ID/KEY) name C, and the layer digest each names there (plus the claims a
  `shoal pull` passes in LABEL_GATE). If one names a blob other than the one C was
  provided from, the gate completes C's proof now (urgent, up to `timeout` seconds):
  PROVEN goes on (the same diff_id from another compression is a legitimate share),
  BAD fails the Prepare with one line naming the chain, its provider and the
  conflicting image. When no other blob is named, nothing waits: lazy starts stay lazy.

With `enabled` false, chains are trusted as containerd trusts its own snapshots (said
in the log at start).
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from shoal import mediatypes as mt
from shoal.digest import chain_id
from shoal.errors import ShoalError, TransportError
from snapshotter import DEFAULT_CONTAINERD_ADDRESS
from snapshotter.metadata import MetaStore, Record
from snapshotter.snapshotter import (
    BAD,
    LABEL_CRI_IMAGE_REF,
    LABEL_CRI_LAYER_DIGEST,
    LABEL_DIFF_ID,
    LABEL_GATE,
    LABEL_IMAGE_REF,
    LABEL_LAYER_DIGEST,
    LABEL_PROOF,
    PENDING,
    PROVEN,
    FailedPrecondition,
    Kind,
    NotFound,
    ProofFailed,
    RemoteLayer,
    RemoteLayers,
)

log = logging.getLogger("shoal.proof")

RETRY_FIRST, RETRY_MAX = 60.0, 3600.0  # seconds between failed background attempts
BAD_REMOVAL_WAIT = 5.0  # seconds a Prepare that finds a bad target waits for the worker to remove it
BAD_SWEEP = 10.0  # seconds between looks for bad chains no container uses any more
PARENT_HOLD = 600.0  # seconds containerd keeps a removed bad chain's parent for the next pull
BACKGROUND_TIMEOUT = 6 * 3600.0  # a background proof of a huge blob at low priority


@dataclass
class ProofConfig:
    enabled: bool = True
    after: float = 30.0  # seconds from a lazy layer's Prepare to its background proof
    timeout: float = 600.0  # seconds a Prepare waits for an urgent proof
    containerd_address: str = DEFAULT_CONTAINERD_ADDRESS
    snapshotter: str = "shoal"  # this node's name in containerd's configuration


def chain_id_of(rec: Record) -> str:
    """The chain id a committed snapshot stands for, from its record alone: a remote
    layer is committed under its chain id (the target it was provided, and checked,
    for); a layer containerd applied itself is committed by its unpacker under the
    backend name NAMESPACE/SEQ/CHAINID (metadata/snapshot.go createKey), after
    containerd checked its diff_id. (A snapshot committed under another name, a
    container's, yields a name no layer's chain id is made from: a remote layer on top
    of it fails its check instead of being taken for some other chain.)"""
    return rec.key if rec.remote else rec.key.split("/", 2)[-1]


def proof_of(rec: Record) -> str:
    """PENDING, PROVEN or BAD for a lazy layer; "" for a snapshot that needs no proof."""
    if rec.layer_kind != "lazy":
        return ""
    return rec.labels.get(LABEL_PROOF) or PENDING


def namespace_of(key: str) -> str | None:
    """containerd's backend keys are NAMESPACE/ID/KEY (metadata/snapshot.go createKey)."""
    parts = key.split("/", 2)
    return parts[0] if len(parts) == 3 and parts[1].isdigit() else None


def _image_of(rec: Record) -> str:
    return rec.labels.get(LABEL_IMAGE_REF) or rec.labels.get(LABEL_CRI_IMAGE_REF) or "?"


def _as_layer(rec: Record) -> RemoteLayer:
    return RemoteLayer(rec.layer_path or "", rec.layer_kind or "", dict(rec.labels), rec.usage,
                       rec.labels.get(LABEL_LAYER_DIGEST, ""))


class ChainProofs:
    """The proofs of one node's lazy snapshots (see the module docstring). Thread-safe.

    `remove(name, id)` removes a snapshot from the snapshotter if it still has that id
    (LocalSnapshotter.remove);
    containerd's images and metadata are reached at `config.containerd_address`."""

    def __init__(self, db: MetaStore, remote: RemoteLayers, config: ProofConfig,
                 remove: Callable[[str, int], None]) -> None:
        self.db, self.remote, self.config, self._remove = db, remote, config, remove
        self._containerd = ContainerdImages(config.containerd_address, config.snapshotter)
        self._dropping = threading.local()
        self._cond = threading.Condition()
        self._queue: list[tuple[float, str]] = []  # (due, blob digest), a heap
        self._retry: dict[str, float] = {}
        self._stopped = False
        self._sweep_now = False
        self._thread: threading.Thread | None = None

    # --- lifecycle

    def start(self, records: list[Record]) -> None:
        if not self.config.enabled:
            log.warning("lazy layers are not proven ([fetch] prove_lazy = false): chain ids of lazy layers are "
                        "trusted, and an image whose config claims another image's diff_id can make it run on "
                        "its layer")
            return
        self._thread = threading.Thread(target=self._run, name="shoal-proofs", daemon=True)
        self._thread.start()
        for rec in records:
            if proof_of(rec) == PENDING:
                self.schedule(rec.labels.get(LABEL_LAYER_DIGEST, ""), self.config.after)
        self.request_sweep()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def schedule(self, digest: str, delay: float) -> None:
        if not digest or not self.config.enabled:
            return
        with self._cond:
            heapq.heappush(self._queue, (time.monotonic() + delay, digest))
            self._cond.notify_all()

    # --- at a remote layer's Prepare

    def labels_for(self, target: str, parent_chain: str, layer: RemoteLayer, labels: dict[str, str]) -> dict[str, str]:
        """The proof labels of a lazy layer about to be committed as `target` on the
        chain `parent_chain` ("" for a base layer), for a Prepare with `labels`: PROVEN
        when its blob's diff_id is known and gives `target`; FailedPrecondition when it
        is known and does not; none (pending) when unknown."""
        if not self.config.enabled or layer.kind != "lazy" or not layer.digest:
            return {}
        with self.db.read() as tx:
            diff_id = tx.proof(layer.digest)
        if diff_id is None:
            return {}
        expected = chain_id(parent_chain, diff_id)
        if expected != target:
            raise FailedPrecondition(
                f"{_image_of_labels(labels)}: layer {layer.digest} cannot be chain {target}: its content "
                f"is diff_id {diff_id} (proven on this node), which gives chain {expected}")
        return {LABEL_PROOF: PROVEN, LABEL_DIFF_ID: diff_id}

    def check_existing(self, existing: Record, labels: dict[str, str]) -> bool:
        """A remote Prepare finds its target committed already (another namespace, or
        containerd lost its record): the layer it names must be the one the target was
        provided from, or the target's proof must say the content is the same. True:
        use it. False: it was bad and the worker removed it meanwhile (a few seconds at
        most when no container uses it): provide it anew. FailedPrecondition when it is
        bad and stays, or cannot be proven now."""
        if not self.config.enabled:
            return True
        key = labels.get(LABEL_IMAGE_REF) or labels.get(LABEL_CRI_IMAGE_REF) or "a pull"
        named = labels.get(LABEL_LAYER_DIGEST) or labels.get(LABEL_CRI_LAYER_DIGEST)
        blob = existing.labels.get(LABEL_LAYER_DIGEST)
        if proof_of(existing) == PENDING and named and named != blob:
            try:
                self._require_proof(existing, key, named, "")
                return True
            except FailedPrecondition:
                with self.db.read() as tx:
                    existing = tx.find(existing.key) or existing
                if proof_of(existing) != BAD:
                    raise
        if proof_of(existing) != BAD:
            return True
        self.request_sweep()
        deadline = time.monotonic() + BAD_REMOVAL_WAIT
        while time.monotonic() < deadline:
            with self.db.read() as tx:
                if tx.find(existing.key) is None:
                    return False
            time.sleep(0.1)
        raise FailedPrecondition(self._bad_line(existing, key))

    def _require_proof(self, rec: Record, image: str, named: str, doing: str) -> None:
        """`image` names layer `named` for pending chain `rec`, which was provided from
        another blob: complete its proof now. Returns when it is proven, else
        FailedPrecondition with one line naming the chain, its provider and `image`."""
        blob = rec.labels.get(LABEL_LAYER_DIGEST, "")
        log.info("chain %s was provided from layer %s of %s, %s names layer %s there: proving it now",
                 chain_id_of(rec), blob, _image_of(rec), image, named)
        state, detail = self.prove_now(rec)
        if state == PROVEN:
            return
        if state == BAD:
            raise FailedPrecondition(
                f"chain {chain_id_of(rec)} was provided from layer {blob} of {_image_of(rec)}, whose content is not "
                f"that chain ({detail}); {image} names layer {named} there{doing}")
        raise FailedPrecondition(f"chain {chain_id_of(rec)} (layer {blob} of {_image_of(rec)}) could not be proven "
                                 f"for {image}, which names layer {named} there: {detail}")

    def provided(self, layer: RemoteLayer, labels: dict[str, str]) -> None:
        if layer.kind == "lazy" and LABEL_PROOF not in labels:
            self.schedule(layer.digest, self.config.after)

    # --- the gate

    def gate(self, key: str, chain: list[Record], labels: dict[str, str]) -> None:
        """Called before an active snapshot or view `key` is created on `chain` (its
        parent chain, nearest first). Returns when it may be; FailedPrecondition else."""
        if not self.config.enabled:
            return
        for rec in chain:
            if proof_of(rec) == BAD:
                raise FailedPrecondition(self._bad_line(rec, key))
        pending = [rec for rec in chain if proof_of(rec) == PENDING]
        if not pending:
            return
        claims, unknown = self._claims_for(key, labels)
        for rec in reversed(pending):  # the base first: a bad base fails before upper layers are read
            blob = rec.labels.get(LABEL_LAYER_DIGEST, "")
            others = [(image, digest) for image, digest in claims.get(chain_id_of(rec), []) if digest != blob]
            if unknown:  # not knowing what else is named there, a pending chain is proven before use
                others.append(("an image containerd could not list", "unknown"))
            if not others:
                continue
            image, digest = others[0]
            self._require_proof(rec, image, digest, f": not creating {key} on it")

    def prove_now(self, rec: Record) -> tuple[str, str]:
        """Complete the proof of lazy snapshot `rec` (urgent): (state, detail)."""
        digest = rec.labels.get(LABEL_LAYER_DIGEST, "")
        try:
            diff_id = self.remote.prove(_as_layer(rec), True, self.config.timeout)
        except ProofFailed as e:
            if e.final:
                self.record_failure(digest, str(e))
                return BAD, str(e)
            return PENDING, str(e)
        self.record(digest, diff_id)
        with self.db.read() as tx:
            now = tx.find(rec.key)
        if now is None:
            return BAD, "removed as bad meanwhile"
        return proof_of(now), f"its diff_id is {diff_id}"

    def _claims_for(self, key: str, labels: dict[str, str]) -> tuple[dict[str, list[tuple[str, str]]], bool]:
        """({chain: [(image, layer digest)]} named in the snapshot's namespace and by its
        LABEL_GATE, whether containerd could not be asked)."""
        out: dict[str, list[tuple[str, str]]] = {}
        hint = labels.get(LABEL_GATE)
        if hint:
            try:
                doc = json.loads(hint)
                for chain, digest in (doc.get("layers") or {}).items():
                    out.setdefault(str(chain), []).append((str(doc.get("image", "?")), str(digest)))
            except (ValueError, AttributeError):
                raise FailedPrecondition(f"{key}: label {LABEL_GATE} is not a JSON object of layers") from None
        namespace = namespace_of(key)
        if namespace is not None:
            try:
                for chain, named in self._containerd.claims(namespace).items():
                    out.setdefault(chain, []).extend(named)
            except (ShoalError, OSError) as e:
                log.warning("%s: cannot list the images of namespace %s in containerd (%s): proving every "
                            "pending layer of its chain before use", key, namespace, e)
                return out, True
        return out, False

    # --- results

    def record(self, digest: str, diff_id: str) -> None:
        """The content of blob `digest` is diff_id: decide every lazy snapshot made from it."""
        decided: list[tuple[Record, bool, str]] = []
        with self.db.write() as tx:
            tx.record_proof(digest, diff_id)
            for rec in tx.all():
                if proof_of(rec) != PENDING or rec.labels.get(LABEL_LAYER_DIGEST) != digest:
                    continue
                parent = tx.find(rec.parent) if rec.parent else None
                expected = chain_id(chain_id_of(parent) if parent else "", diff_id)
                ok = expected == chain_id_of(rec)
                tx.update(rec.key, {LABEL_PROOF: PROVEN if ok else BAD, LABEL_DIFF_ID: diff_id},
                          [f"labels.{LABEL_PROOF}", f"labels.{LABEL_DIFF_ID}"])
                decided.append((rec, ok, expected))
        for rec, ok, expected in decided:
            if ok:
                log.info("chain %s (layer %s of %s): proven, diff_id %s", chain_id_of(rec), digest, _image_of(rec),
                         diff_id)
            else:
                self._declare_bad(rec, f"{_image_of(rec)}: layer {digest} was provided as chain {chain_id_of(rec)}"
                                       f"{_claimed(rec)}, but its content is diff_id {diff_id}, which gives chain "
                                       f"{expected}")

    def record_failure(self, digest: str, reason: str) -> None:
        """The verified blob `digest` can have no diff_id (it does not decompress)."""
        bad = []
        with self.db.write() as tx:
            for rec in tx.all():
                if proof_of(rec) == PENDING and rec.labels.get(LABEL_LAYER_DIGEST) == digest:
                    tx.update(rec.key, {LABEL_PROOF: BAD}, [f"labels.{LABEL_PROOF}"])
                    bad.append(rec)
        for rec in bad:
            self._declare_bad(rec, f"{_image_of(rec)}: layer {digest} of chain {chain_id_of(rec)}: {reason}")

    def _declare_bad(self, rec: Record, reason: str) -> None:
        log.error("BAD lazy layer: %s", reason)
        with self.db.read() as tx:
            shared_proven = any(r.layer_path == rec.layer_path and proof_of(r) == PROVEN for r in tx.all())
        if not shared_proven:
            try:
                self.remote.mark_bad(_as_layer(rec), reason)
            except (OSError, ShoalError) as e:
                log.error("cannot mark layer %s bad in the layer file system: %s", rec.layer_path, e)
        self.request_sweep()

    def _bad_line(self, rec: Record, key: str) -> str:
        return (f"chain {chain_id_of(rec)} (layer {rec.labels.get(LABEL_LAYER_DIGEST, '?')} of {_image_of(rec)}) is bad: "
                f"its content is diff_id {rec.labels.get(LABEL_DIFF_ID, '?')}, not what the chain id says: "
                f"not creating {key} on it")

    # --- removal of bad snapshots (on the worker thread alone: it writes to containerd's
    # metadata, which must never wait on a snapshotter call containerd is making, such as
    # the Removes of its garbage collection, which holds containerd's metadata lock)

    def request_sweep(self) -> None:
        """Have the worker look for bad chains to remove, now."""
        with self._cond:
            self._sweep_now = True
            self._cond.notify_all()

    def drop_bad_when_unused(self, name: str) -> None:
        """Remove bad committed snapshot `name` and the committed snapshots above it,
        unless an active snapshot or view (a container) stands on any of them. Worker
        thread only (see above)."""
        if getattr(self._dropping, "active", False):
            return  # removed() of a snapshot this very call removes
        with self.db.read() as tx:
            rec = tx.find(name)
            if rec is None or proof_of(rec) != BAD:
                return  # gone, or provided anew (and pending) since the caller looked
            subtree, stack = [], [rec]
            while stack:
                r = stack.pop()
                subtree.append(r)
                stack.extend(c for c in tx.all() if c.parent_id == r.id)
        # containerd removes a container's snapshot from its own metadata at once and
        # from the snapshotter at its next garbage collection: one it no longer knows is unused
        if any(r.kind != Kind.COMMITTED and self._containerd.knows(r.key) for r in subtree):
            log.info("bad chain %s stays until no container uses it", chain_id_of(rec))
            return
        self._dropping.active = True
        try:
            for r in reversed(subtree):  # children before parents
                with self.db.read() as tx:
                    now = tx.find(r.key)
                if now is None or now.id != r.id:
                    continue  # removed meanwhile (containerd's garbage collection), perhaps provided anew
                try:
                    if r.kind == Kind.COMMITTED:
                        with self.db.read() as tx:
                            parent = tx.find(r.parent) if r.parent else None
                        self._containerd.forget(r.key, chain_id_of(parent) if parent else "")
                except (ShoalError, OSError) as e:
                    # removed here alone, containerd would go on listing it, and the next pull
                    # would find it and stack on a snapshot that is not there: it stays (bad,
                    # refused) until the next sweep removes it from both
                    log.warning("bad chain %s stays for now: cannot remove it from containerd (%s); trying again "
                                "in %.0fs", chain_id_of(r), e, BAD_SWEEP)
                    return
                try:
                    self._remove(r.key, r.id)
                    log.warning("removed %s (%s): it stands on a bad lazy layer", chain_id_of(r), r.key)
                except NotFound:
                    continue  # containerd's garbage collection removed it first (it forgot it just now)
                except ShoalError as e:
                    log.error("cannot remove bad chain %s: %s", r.key, e)
                    return
        finally:
            self._dropping.active = False

    def removed(self, parent: str) -> None:
        """A snapshot on `parent` was removed: a bad chain below it may be unused now."""
        if not self.config.enabled or not parent or getattr(self._dropping, "active", False):
            return
        with self.db.read() as tx:
            rec = tx.find(parent)
            chain = [rec, *tx.chain(rec)] if rec else []
        if any(proof_of(r) == BAD for r in chain):
            self.request_sweep()

    # --- the background worker

    def _run(self) -> None:
        swept = time.monotonic()
        while True:
            digest = None
            with self._cond:
                while not self._stopped and (not self._queue or self._queue[0][0] > time.monotonic()):
                    if self._sweep_now or time.monotonic() - swept >= BAD_SWEEP:
                        break
                    due = self._queue[0][0] - time.monotonic() if self._queue else BAD_SWEEP
                    self._cond.wait(max(0.0, min(due, BAD_SWEEP - (time.monotonic() - swept))))
                if self._stopped:
                    return
                if self._queue and self._queue[0][0] <= time.monotonic():
                    _, digest = heapq.heappop(self._queue)
            if digest is not None:
                self._prove_background(digest)
            if self._sweep_now or time.monotonic() - swept >= BAD_SWEEP:
                swept, self._sweep_now = time.monotonic(), False
                self._sweep_bad()

    def _sweep_bad(self) -> None:
        """Bad chains whose last container is gone from containerd (which tells the
        snapshotter only at its next garbage collection) are removed."""
        with self.db.read() as tx:
            bad = [r.key for r in tx.all() if proof_of(r) == BAD]
        for key in bad:
            try:
                self.drop_bad_when_unused(key)
            except Exception:
                log.exception("removal of bad chain %s", key)

    def _prove_background(self, digest: str) -> None:
        with self.db.read() as tx:
            pending = [r for r in tx.all() if proof_of(r) == PENDING and r.labels.get(LABEL_LAYER_DIGEST) == digest]
        if not pending:
            return
        try:
            diff_id = self.remote.prove(_as_layer(pending[0]), False, BACKGROUND_TIMEOUT)
        except ProofFailed as e:
            if e.final:
                self.record_failure(digest, str(e))
                return
            delay = self._retry[digest] = min(RETRY_MAX, self._retry.get(digest, RETRY_FIRST / 2) * 2)
            log.warning("proof of layer %s: %s (again in %.0fs)", digest, e, delay)
            self.schedule(digest, delay)
            return
        except Exception:
            log.exception("proof of layer %s", digest)
            self.schedule(digest, RETRY_MAX)
            return
        self._retry.pop(digest, None)
        self.record(digest, diff_id)


def _claimed(rec: Record) -> str:
    return "" if rec.parent else f" (its image's config claims diff_id {chain_id_of(rec)})"


def _image_of_labels(labels: dict[str, str]) -> str:
    return labels.get(LABEL_IMAGE_REF) or labels.get(LABEL_CRI_IMAGE_REF) or "?"


# --- what containerd's images name ----------------------------------------------------------


class ContainerdImages:
    """What containerd's images name: claims(namespace) = {chain: [(image, layer digest)]},
    from their manifests and configs in containerd's content store (read once per
    manifest); forget(key) removes a snapshot from containerd's metadata."""

    def __init__(self, address: str, snapshotter: str) -> None:
        self.address, self.snapshotter = address, snapshotter
        self._lock = threading.Lock()
        self._by_target: dict[str, list[tuple[str, str]]] = {}  # image target digest -> [(chain, layer)]

    def _connect(self, namespace: str):
        from snapshotter.pull import _Containerd

        if not os.path.exists(self.address):  # not a wait for a containerd that is not there
            raise TransportError(f"no containerd socket at {self.address} ([containerd] address)")
        return _Containerd(self.address, namespace)

    def claims(self, namespace: str) -> dict[str, list[tuple[str, str]]]:
        out: dict[str, list[tuple[str, str]]] = {}
        ctr = self._connect(namespace)
        try:
            for name, media_type, digest in ctr.images():
                layers = self._layers(ctr, media_type, digest)
                for chain, layer in layers:
                    out.setdefault(chain, []).append((name, layer))
        finally:
            ctr.close()
        return out

    def knows(self, key: str) -> bool:
        """Whether containerd still has the active snapshot or view `key` (NS/ID/NAME);
        True when it cannot say."""
        from snapshotter.pull import _RpcFailure

        namespace = namespace_of(key)
        if namespace is None:
            return True
        try:
            ctr = self._connect(namespace)
        except ShoalError:
            return True
        try:
            return ctr.snapshot_labels(self.snapshotter, key.split("/", 2)[2]) is not None
        except _RpcFailure:
            return True
        finally:
            ctr.close()

    def forget(self, key: str, parent: str) -> None:
        """Remove snapshot `key` from containerd's metadata in every namespace that has it
        (so that its next pull prepares it again instead of finding it). Its parent chain
        `parent` is held there for PARENT_HOLD seconds first: with `key` gone, no image
        may reference it, and containerd's garbage collection would take it while the
        next pull's unpacker, which found it, stacks on it. TransportError when a namespace
        that has it could not be told (the others are)."""
        from snapshotter.pull import _RpcFailure

        ctr = self._connect("default")
        try:
            namespaces = ctr.namespaces()
        finally:
            ctr.close()
        failed = []
        for namespace in namespaces:
            ctr = self._connect(namespace)
            try:
                if ctr.snapshot_labels(self.snapshotter, key) is not None:
                    if parent and ctr.snapshot_labels(self.snapshotter, parent) is not None:
                        ctr.create_lease(PARENT_HOLD, "shoal-proof-parent")
                        ctr.lease_snapshot(self.snapshotter, parent)
                        ctr.lease = None  # it expires by itself
                    ctr.remove_snapshot(self.snapshotter, key)
                    log.info("removed snapshot %s from containerd's namespace %s", key, namespace)
            except _RpcFailure as e:
                failed.append(f"namespace {namespace}: {e}")
            finally:
                ctr.close()
        if failed:
            raise TransportError("; ".join(failed))

    def _layers(self, ctr, media_type: str, digest: str) -> list[tuple[str, str]]:
        """[(chain, layer digest)] of the image whose target is `digest` (this machine's
        platform of an index); [] when its content is not all there (yet)."""
        with self._lock:
            if digest in self._by_target:
                return self._by_target[digest]
        from builder.oci.documents import parse_config, parse_index, parse_manifest
        from snapshotter.pull import chain_ids, host_platform

        what = f"image {digest} in containerd"
        try:
            data = ctr.read_content(digest)
            if data is not None and media_type in mt.INDEX_TYPES:
                platform = host_platform()
                entry = next((m for m in parse_index(data, what).manifests
                              if m.platform is not None and str(m.platform).startswith(platform)), None)
                data = ctr.read_content(entry.digest) if entry is not None else None
            if data is None:
                return []
            manifest = parse_manifest(data, what)
            config_data = ctr.read_content(manifest.config.digest)
            if config_data is None:
                return []
            config = parse_config(config_data, what, len(manifest.layers))
        except ShoalError as e:
            log.warning("%s", e)
            return []
        layers = [(c, d.digest) for c, d in zip(chain_ids(config.diff_ids), manifest.layers)]
        with self._lock:
            if len(self._by_target) > 4096:
                self._by_target.clear()
            self._by_target[digest] = layers
        return layers
