"""The snapshotter contract: what `shoal node` serves to containerd.

This follows containerd's snapshots.Snapshotter (core/snapshots/snapshotter.go) word for
word where it can; the gRPC edge (grpc_server.py, wire.py) only translates.

Vocabulary
----------
A *snapshot* is a file system state. Every snapshot has a *parent*, a committed snapshot
or "" (an empty directory). A diff between a snapshot and its parent is a classic layer.

- *key* names an active snapshot (Active or View). *name* names a committed snapshot.
  Keys and names share one namespace: an active snapshot may not use the name of a
  committed one, nor two snapshots the same key.
- *Kinds*: **Active** snapshots are created by `prepare`; their mounts are writable and
  capture changes relative to the parent. **View** snapshots are created by `view`; their
  mounts are read-only and they can never be committed. **Committed** snapshots are
  created by `commit` (or by a remote layer, below) and are immutable; only they may be
  parents. Active snapshots never become committed and vice versa: `commit(name, key)`
  creates the committed snapshot `name` and removes the active `key`.
- The *parent chain* of a snapshot is its parent, the parent's parent, and so on. The
  mounts of a snapshot stack the chain nearest-first below the snapshot's own directory.
- *Labels* are string pairs attached to a snapshot. `prepare`, `view` and `commit` set
  them (commit replaces them; they are not inherited), `update` changes them. A label
  set to "" is removed. containerd keeps its garbage-collection references in labels
  (`containerd.io/gc.*`) and passes remote-snapshot hints with the prefix
  `containerd.io/snapshot/` plus `containerd.io/snapshot.ref`.
- *Usage* is the disk space and inodes a snapshot uses itself, without its parents:
  computed by walking the directory for active snapshots, recorded at commit for
  committed ones.
- *Walk* filters use containerd's filter syntax (containerd/filters): each filter is a
  comma-separated list of selectors that must all match, `fieldpath[op value]` with op
  `==`, `!=` or `~=` (regular expression), or no op to test presence; field paths are
  `name`, `parent`, `kind` (active, view, committed) and `labels.KEY`, where a part may be
  double-quoted (`labels."containerd.io/gc.root"==x`). A snapshot matches if any filter
  matches; no filters match everything.

Errors (all ShoalError, each with a one-line message, mapped to gRPC codes at the edge):
- NotFound: the key, name or parent does not exist.
- AlreadyExists: the key or name is taken; for a remote layer, "the target exists now".
- FailedPrecondition: the snapshot is in the wrong state (commit of a view, mounts of a
  committed snapshot, removal of a snapshot that still has children).
- InvalidArgument: a malformed request (a parent that is not committed, an immutable
  field in update, a filter that does not parse).

Remote layers
-------------
containerd's remote-snapshotter protocol (docs/snapshotters/remote-snapshotter.md): the
unpacker calls Prepare with the label `containerd.io/snapshot.ref` = the chain id the
layer will be committed as (the *target*). A snapshotter that can provide that layer
without being sent its bytes commits a snapshot named target itself and answers
AlreadyExists; containerd then looks it up by Walk
(`labels."containerd.io/snapshot.ref"==TARGET,parent=="PARENT"`) and skips fetching and
applying the layer. The RemoteLayers seam below is where the layer comes from.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from shoal.errors import ShoalError

if TYPE_CHECKING:
    from builder.oci.auth import Credentials

# Labels with a meaning in the protocol.
LABEL_SNAPSHOT_REF = "containerd.io/snapshot.ref"  # the target chain id on Prepare
LABEL_LAYER_KIND = "shoal.io/layer-kind"  # "lazy" | "unpacked" on remote-provided layers
# The same, as snapshots committed before this label was the only one also carry it
# (set by RemoteLayers then): read by layer_kind(), never written any more.
OLD_LABEL_LAYER_KIND = "containerd.io/snapshot/shoal.layer-kind"
# The proof of a remote layer (see chainproof.py), set on its committed snapshot by the
# node alone: the same names in a Prepare's labels (which an image's layer annotations
# can set, through containerd's unpacker) are dropped. Under containerd.io/snapshot/ so
# that containerd's Stat shows them. diff-id: the diff_id the layer's bytes were hashed
# to; proof: PROVEN or BAD once known. PENDING is never written on the record itself:
# containerd copies a provided snapshot's labels into its own metadata when it records
# it, and its copy wins over the snapshotter's later labels. A lazy layer without
# LABEL_PROOF is pending; a node-unpacked layer is PROVEN at its commit.
LABEL_LAYER_DIGEST = "containerd.io/snapshot/shoal.layer-digest"  # the blob the layer was made from
LABEL_DIFF_ID = "containerd.io/snapshot/shoal.diff-id"
LABEL_PROOF = "containerd.io/snapshot/shoal.proof"
NODE_LABELS = (LABEL_DIFF_ID, LABEL_PROOF)
PENDING, PROVEN, BAD = "pending", "proven", "bad"

# The remote-snapshot labels of a Prepare (containerd's own and CRI's, and shoal's: set by
# `shoal pull`, which has the manifest already). containerd passes a snapshotter only
# labels named "containerd.io/snapshot/..." (snapshots.FilterInheritedLabels).
LABEL_TARGET = LABEL_SNAPSHOT_REF  # (the name RemoteLayers and `shoal pull` use)
LABEL_CRI_IMAGE_REF = "containerd.io/snapshot/cri.image-ref"
LABEL_CRI_LAYER_DIGEST = "containerd.io/snapshot/cri.layer-digest"
LABEL_CRI_MANIFEST_DIGEST = "containerd.io/snapshot/cri.manifest-digest"
_P = "containerd.io/snapshot/shoal."
LABEL_IMAGE_REF = _P + "image-ref"
LABEL_LAYER_SIZE = _P + "layer-size"
LABEL_LAYER_MEDIA_TYPE = _P + "layer-media-type"
LABEL_TOC_POSITION = _P + "toc-position"
LABEL_TOC_DIGEST = _P + "toc-digest"
# On a Prepare/View: {"image": NAME, "layers": {CHAIN: LAYER DIGEST}}, what the image
# being pulled names (shoal pull: its image record does not exist yet; chainproof.py).
LABEL_GATE = _P + "gate"


def layer_kind(labels: dict[str, str]) -> str:
    """"lazy" | "unpacked" for a remote-provided layer's labels, "" for any other snapshot
    (the current label, else the old one of snapshots made before)."""
    return labels.get(LABEL_LAYER_KIND) or labels.get(OLD_LABEL_LAYER_KIND) or ""


class Kind(enum.IntEnum):
    """containerd's snapshots.Kind; the values are those of the wire enum."""

    VIEW = 1
    ACTIVE = 2
    COMMITTED = 3

    def __str__(self) -> str:
        return self.name.lower()


@dataclass
class Info:
    """What Stat, Update and Walk return. `name` is the key of an active snapshot or the
    name of a committed one. Times are nanoseconds since the Unix epoch (containerd keeps
    nanoseconds and compares them exactly)."""

    kind: Kind
    name: str
    parent: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    created_ns: int = 0
    updated_ns: int = 0


@dataclass(frozen=True)
class Usage:
    """Disk use of one snapshot without its parents: bytes allocated and inodes."""

    size: int = 0
    inodes: int = 0


@dataclass(frozen=True)
class Mount:
    """One mount(2) as containerd performs it: `mount -t TYPE -o OPTIONS SOURCE TARGET`."""

    type: str
    source: str
    options: tuple[str, ...] = ()


class NotFound(ShoalError):
    """The key, name or parent does not exist."""


class AlreadyExists(ShoalError):
    """The key or name is taken (for remote layers: the target exists now)."""


class FailedPrecondition(ShoalError):
    """The snapshot is in the wrong state for the operation."""


class InvalidArgument(ShoalError):
    """The request is malformed."""


# --- the remote seam -------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteLayer:
    """A layer provided by RemoteLayers: a read-only directory holding the layer's files
    (whiteouts in overlayfs form), used as a lower directory of overlay mounts.

    `kind` is "lazy" (served on demand, e.g. a FUSE mount) or "unpacked" (a directory
    filled ahead). `info_labels` are added to the committed snapshot's labels. `usage`,
    when known, is reported by Usage (the directory is never walked for it: it may be a
    lazy file system).
    """

    path: str
    kind: str
    info_labels: dict[str, str] = field(default_factory=dict)
    usage: Usage | None = None
    digest: str = ""  # the blob it was made from (LABEL_LAYER_DIGEST); proofs are per blob


class ProofFailed(ShoalError):
    """RemoteLayers.prove could not give a diff_id: `final` when none can ever come (the
    verified blob does not decompress), else a failed attempt (a source, a timeout)."""

    def __init__(self, message: str, final: bool = False) -> None:
        super().__init__(message)
        self.final = final


class RemoteLayers(Protocol):
    """Where layers that containerd need not download come from (lazy FUSE layers).

    Lifecycle: at node start sweep() and restore() (recovery), then start(); while the
    node serves prepare/release/prove/mark_bad; stop_if_idle() when it stops.
    prepare and the calls after it come from gRPC worker threads, possibly concurrently for
    different targets, never concurrently for the same target. May block (fetch a TOC,
    mount); the snapshotter holds no lock meanwhile.
    """

    def start(self) -> None:
        """At node start, after recovery: have what serves the layers running. ShoalError
        (one line) if it cannot: the node does not start."""
        ...

    def sweep(self, keep: set[str]) -> list[str]:
        """At node start, before restore: drop the layers no snapshot uses (left by a
        crash). `keep`: the layer paths in the snapshot metadata. Returns what was removed.
        Errors are logged by the caller: leftovers cost disk, not correctness."""
        ...

    def prepare(self, target: str, parent_chain: str, labels: dict[str, str]) -> RemoteLayer | None:
        """Called on Prepare when the labels carry `containerd.io/snapshot.ref` (= target,
        the chain id the layer is to be committed as: a claim, made from the image's
        config). `parent_chain` is the chain id of the committed parent as the
        snapshotter's own records know it ("" for the base layer), never a label: a
        provider that can hash the layer checks chain_id(parent_chain, diff_id) == target.

        Return None when this is not a layer it can provide: the Prepare goes on as an
        ordinary one and containerd unpacks the layer. Return a RemoteLayer to have the
        snapshotter commit it as `target`. Raise ShoalError on failure: the Prepare fails
        with that message. If it returns a layer that the snapshotter then cannot record,
        release() is called for it.
        """
        ...

    def release(self, layer: RemoteLayer) -> None:
        """The committed snapshot of this layer was removed: unmount, forget. Errors are
        logged, not returned to containerd (the snapshot is gone either way)."""
        ...

    def restore(self, layer_path: str, labels: dict[str, str]) -> None:
        """At start-up, for every remote snapshot in the metadata: make `layer_path`
        serve the layer again after a daemon restart (labels as recorded at prepare)."""
        ...

    def prove(self, layer: RemoteLayer, urgent: bool, timeout: float) -> str:
        """The diff_id of a lazy layer's whole content (sha256 of its decompressed blob,
        the blob checked against its digest), blocking up to `timeout` seconds; `urgent`
        when a caller waits for it (else at low priority). ProofFailed."""
        ...

    def mark_bad(self, layer: RemoteLayer, reason: str) -> None:
        """Every read of the lazy layer fails from now on (EIO, a log line with reason)."""
        ...

    def provide_credentials(self, registry: str, repository: str, creds: Credentials | None, ttl: float) -> None:
        """The layers' reads of `repository` on `registry` (and of no other repository)
        use `creds` for `ttl` seconds, in memory only; None forgets them. From the CRI
        proxy's threads (snapshotter/criproxy.py). ShoalError or OSError if what serves
        the layers cannot take them."""
        ...

    def stop_if_idle(self) -> None:
        """At node stop: stop what serves the layers if no layer is served (one serving
        layers keeps running for the containers that use them). Never raises."""
        ...


# --- the contract ------------------------------------------------------------------------


class Snapshotter(Protocol):
    """containerd's Snapshotter (plus Cleanup), in Python. Thread-safe."""

    def stat(self, key: str) -> Info:
        """Info of the active or committed snapshot `key`. NotFound."""
        ...

    def update(self, info: Info, fieldpaths: Sequence[str] = ()) -> Info:
        """Change the mutable fields of snapshot `info.name`: only labels. No fieldpaths:
        replace all labels; "labels": the same; "labels.KEY": set (or, to "", remove) one
        label. Other paths: InvalidArgument. Updates the update time. NotFound."""
        ...

    def usage(self, key: str) -> Usage:
        """Usage of snapshot `key` without its parents. NotFound."""
        ...

    def mounts(self, key: str) -> list[Mount]:
        """The mounts of active or view snapshot `key` (the same as Prepare/View
        returned). NotFound; FailedPrecondition for a committed snapshot."""
        ...

    def prepare(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        """Create the active snapshot `key` on `parent` ("" = empty) and return its
        writable mounts. AlreadyExists (key taken, or a remote layer was committed as the
        target), NotFound (parent), InvalidArgument (parent not committed)."""
        ...

    def view(self, key: str, parent: str = "", labels: dict[str, str] | None = None) -> list[Mount]:
        """Like prepare, but read-only mounts and never committable."""
        ...

    def commit(self, name: str, key: str, labels: dict[str, str] | None = None) -> None:
        """Commit active `key` as `name` (same parent, these labels) and remove `key`.
        AlreadyExists (name), NotFound (key), FailedPrecondition (key is not active)."""
        ...

    def remove(self, key: str) -> None:
        """Remove snapshot `key` and its resources. NotFound; FailedPrecondition while
        it has children."""
        ...

    def walk(self, filters: Sequence[str] = ()) -> list[Info]:
        """Every snapshot matching any of `filters` (all when none). InvalidArgument for
        a filter that does not parse."""
        ...

    def cleanup(self) -> None:
        """Reclaim disk resources that no snapshot owns (left by crashes)."""
        ...

    def close(self) -> None:
        """Release resources; idempotent."""
        ...
