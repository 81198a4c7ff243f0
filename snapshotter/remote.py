"""Remote snapshots: layers the node provides itself instead of containerd unpacking them.

containerd's unpacker calls Prepare with `containerd.io/snapshot.ref` (the target chain
id) and, from CRI or `shoal pull`, the layer digest and the image reference. For a layer
whose descriptor carries a zstd:chunked TOC, the layer file system fetches the TOC
through the node's fetch chain (swarm, region, origin), verifies it against the digest
in the layer annotation at each source, and serves the layer lazily. Any other layer is downloaded, verified and unpacked by the node
(snapshotter/unpack.py), and committed only if the unpacked stream's sha256 makes the
target chain id on top of the parent's (the diff_id check, see _unpacked).
Either way the snapshot is committed under the target name and containerd skips the
layer. Which layers are lazy and which were unpacked is recorded in the snapshot labels
(`shoal.io/layer-kind`), the log, and `shoal status`.

Where the layer annotations come from: `shoal pull` passes them as labels
(LABEL_TOC_POSITION / LABEL_TOC_DIGEST); otherwise (CRI) the manifest named by
`cri.manifest-digest` is fetched from the registry and verified by its digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

from builder.format.footer import (
    MANIFEST_CHECKSUM,
    MANIFEST_POSITION,
    OLD_MANIFEST_CHECKSUM,
    OLD_MANIFEST_POSITION,
    location_from_annotations,
)
from builder.oci.documents import MAX_DOCUMENT_BYTES, parse_config, parse_manifest
from builder.oci.refs import parse_registry_ref
from builder.tarstream import Decompressing
from cache.origin import use_plain_http
from cache.source import BlobRef
from prefetch.profile import Profile
from prefetch.warmup import published_profile
from shoal import mediatypes as mt
from shoal.digest import chain_id, check_digest, hex_of
from shoal.errors import DigestMismatch, FormatError, ShoalError
from shoal.fsutil import private_dir
from snapshotter.fs.client import FSClient
from snapshotter.nodefetch import BlobReader, NodeFetch, SwarmCopyBad, node_fetch
from snapshotter.snapshotter import (
    LABEL_CRI_IMAGE_REF,
    LABEL_CRI_LAYER_DIGEST,
    LABEL_CRI_MANIFEST_DIGEST,
    LABEL_DIFF_ID,
    LABEL_IMAGE_REF,
    LABEL_LAYER_DIGEST,
    LABEL_LAYER_MEDIA_TYPE,
    LABEL_LAYER_SIZE,
    LABEL_PROOF,
    LABEL_TOC_DIGEST,
    LABEL_TOC_POSITION,
    PROVEN,
    ProofFailed,
    RemoteLayer,
)
from snapshotter.unpack import unpack

log = logging.getLogger("shoal.remote")


class RemoteLayers:
    """The node's RemoteLayers (see snapshotter.snapshotter): lazy and node-unpacked layers."""

    def __init__(self, root: str, config: dict | None = None, fs: FSClient | None = None):
        self.root = os.path.abspath(root)
        self.config = config or {}
        self.fs = fs or FSClient(self.root, self.config)
        self.unpacked_dir = os.path.join(self.root, "unpacked")
        # root alone may enter (an unpacked layer's content keeps its tar modes inside)
        private_dir(self.unpacked_dir)
        private_dir(os.path.join(self.root, "layers"))
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._warmed: set[str] = set()  # manifests whose layers were warmed
        self._warm_pool = ThreadPoolExecutor(4, thread_name_prefix="shoal-warm")
        self.warmed_layers = 0
        self.prefetched_images = 0  # images whose access profile was handed to the layer fs
        self.warm_errors: dict[str, str] = {}  # layer digest -> why its last warm-up failed
        self._diff_ids: dict[str, str] = {}  # unpacked folder -> the diff_id its unpack computed
        self._fetch: NodeFetch | None = None

    @property
    def fetch(self) -> NodeFetch:
        """What this process fetches itself (manifests, configs, profiles, blobs to
        unpack) goes through the node's fetch chain (snapshotter/nodefetch.py)."""
        with self._locks_lock:
            if self._fetch is None:
                self._fetch = node_fetch(self.root, self.config)
            return self._fetch

    # --- the seam -------------------------------------------------------------------------

    def prepare(self, target: str, parent_chain: str, labels: dict[str, str]) -> RemoteLayer | None:
        # What to fetch, from where and how is decided by labels an image cannot forge
        # where a pull path sets them: containerd's unpacker turns an image's layer
        # annotations named containerd.io/snapshot/... into Prepare labels, and CRI then
        # sets its own cri.* labels over them, but not shoal.* ones. So CRI's image and
        # layer win over shoal.*, and plain HTTP is the node's configuration alone
        # ([fetch] plain_http_hosts, loopback), never a label: an image cannot send the
        # node's registry credentials in clear or to another repository.
        digest = labels.get(LABEL_CRI_LAYER_DIGEST) or labels.get(LABEL_LAYER_DIGEST)
        image = labels.get(LABEL_CRI_IMAGE_REF) or labels.get(LABEL_IMAGE_REF)
        if not digest or not image:
            return None
        check_digest(digest, "layer digest label")
        parsed = parse_registry_ref(image, short_names=True)
        registry, repository = parsed.host, parsed.repository
        plain = use_plain_http(registry, self.config.get("plain_http_hosts", []))
        size = int(labels[LABEL_LAYER_SIZE]) if labels.get(LABEL_LAYER_SIZE, "").isdigit() else None
        blob = BlobRef(registry, repository, digest, size, plain)
        desc = self._descriptor(blob, labels)
        if blob.size is None and isinstance(desc.get("size"), int):  # CRI's labels carry no size; its manifest does
            blob = dataclasses.replace(blob, size=desc["size"])
        self._warm_image(blob, labels.get(LABEL_CRI_MANIFEST_DIGEST), image)
        info = {LABEL_LAYER_DIGEST: digest}
        with self._lock_for(digest):
            if location_from_annotations(desc.get("annotations")) is not None:
                path = self._lazy(blob, desc, image)
                kind = "lazy"
            else:
                path, diff_id = self._unpacked(blob, desc, image, target, parent_chain, labels)
                kind = "unpacked"
                info.update({LABEL_DIFF_ID: diff_id, LABEL_PROOF: PROVEN})
        log.info("%s: layer %s provided %s (%s)", image, digest, kind, path)
        return RemoteLayer(path, kind, info, digest=digest)  # the snapshotter labels the kind (LABEL_LAYER_KIND)

    # --- warm-up of an image's other layers ---------------------------------------------------

    def _warm_image(self, blob: BlobRef, manifest_digest: str | None, image: str) -> None:
        """At the first prepare of an image's layer: fetch and load the TOCs of the
        image's other lazy layers in the background. containerd prepares layers one after
        the other, each waiting for the one below; this way their TOCs come in parallel
        and each prepare finds its layer ready. A layer warmed whose prepare never comes
        is removed at the next start (sweep)."""
        if not manifest_digest:
            return
        with self._locks_lock:
            if manifest_digest in self._warmed:
                return
            self._warmed.add(manifest_digest)
        self._warm_pool.submit(self._warm_layers, blob, manifest_digest, image)

    def _warm_layers(self, blob: BlobRef, manifest_digest: str, image: str,
                     part: tuple[int, int] = (0, 1), background: bool = False,
                     sparse: tuple[str, ...] = ()) -> Profile | None:
        """Load the TOCs of the image's lazy layers other than `blob` (on the warm-up
        pool) and hand its access profile to the layer fs (`part`: a preheat job's node
        I of N, FSClient.prefetch: then once the loads are done, on warm_image's own
        thread alone; `background`: a preheat's, FSClient.prefetch); returns that profile."""
        try:
            layers = self._manifest_layers(blob, manifest_digest)
        except (ShoalError, OSError, ValueError) as e:
            log.info("%s: no warm-up of the image's layers: %s", image, e)
            return None
        for desc in layers:
            if not isinstance(desc, dict) or desc.get("digest") == blob.digest:
                continue
            try:
                if location_from_annotations(desc.get("annotations")) is None:
                    continue  # a layer to unpack: downloaded when it is prepared
                other = BlobRef(blob.registry, blob.repository, check_digest(desc.get("digest")),
                                desc.get("size") if isinstance(desc.get("size"), int) else None, blob.plain_http)
            except ShoalError:
                continue  # its prepare reports it
            self._warm_pool.submit(self._warm_layer, other, desc, image)
        if part[1] > 1:  # a preheat job's part: the rotation spans every layer, so they load first
            self._warm_pool.shutdown(wait=True)
        return self._prefetch_profile(blob, manifest_digest, image, layers, part, background, sparse)

    def _prefetch_profile(self, blob: BlobRef, manifest_digest: str, image: str, layers: list,
                          part: tuple[int, int] = (0, 1), background: bool = False,
                          sparse: tuple[str, ...] = ()) -> Profile | None:
        """If the image has a published access profile (prefetch/profile.py), hand it to
        the layer file system, which fetches its chunks in its order as each layer is
        loaded: while containerd still prepares the layers, before the container's
        first read. Returns the profile handed over (bounded), or None."""
        if not self.config.get("prefetch_profiles", True):
            return None
        digests = [d.get("digest") for d in layers if isinstance(d, dict)]
        def read_blob(digest: str, size: int | None, what: str, limit: int) -> bytes:
            return self.fetch.small_blob(dataclasses.replace(blob, digest=digest, size=size), what, limit)

        profile = published_profile(blob.registry, blob.repository, manifest_digest, blob.plain_http, digests,
                                    int(self.config.get("prefetch_max_bytes", 8 << 30)), image, read_blob)
        if profile is None:
            return None
        try:
            self.fs.ensure_running()
            queued = self.fs.prefetch(profile.chunks, part=part, background=background, sparse=sparse)
        except (ShoalError, OSError) as e:
            log.warning("%s: prefetch of its access profile: %s", image, e)
            return None
        with self._locks_lock:
            self.prefetched_images += 1
        log.info("%s: access profile: %d chunks (%.1f MB), %d of them queued now, the rest as their layers load",
                 image, len(profile.chunks), profile.compressed_bytes / 1e6, queued)
        return profile

    def warm_image(self, blob: BlobRef, manifest_digest: str, image: str,
                   part: tuple[int, int] = (0, 1), sparse: tuple[str, ...] = ()) -> Profile | None:
        """Load the TOCs of the image's lazy layers (all of them, unless `blob` is one) and
        hand its access profile to the layer fs, waiting for the loads: `shoal prefetch
        --root` (snapshotter/warm.py); `part`: node I of a preheat job's N fetches its own
        part of the profile first (prefetch/warmup.py). This RemoteLayers warms nothing after."""
        profile = self._warm_layers(blob, manifest_digest, image, part, background=True, sparse=sparse)
        self._warm_pool.shutdown(wait=True)
        return profile

    def _warm_layer(self, blob: BlobRef, desc: dict, image: str) -> None:
        lock = self._lock_for(blob.digest)
        if not lock.acquire(blocking=False):
            return  # its prepare is at it
        try:
            self._lazy(blob, desc, image)
            with self._locks_lock:
                self.warmed_layers += 1
                self.warm_errors.pop(blob.digest, None)
        except (ShoalError, OSError) as e:
            self.warm_errors[blob.digest] = str(e)
            log.info("%s: warm-up of layer %s: %s (its prepare will try again)", image, blob.digest, e)
        finally:
            lock.release()

    def release(self, layer: RemoteLayer) -> None:
        """The last snapshot using the layer was removed: stop serving it, drop its files."""
        path = layer.path
        layer_id = os.path.basename(path)
        if path.startswith(self.fs.mnt + os.sep):
            try:
                self.fs.unload(layer_id)
            except (OSError, ShoalError) as e:
                log.warning("unloading layer %s: %s", layer_id, e)
            shutil.rmtree(os.path.join(self.root, "layers", layer_id), ignore_errors=True)
        elif path.startswith(self.unpacked_dir + os.sep):
            self._diff_ids.pop(path, None)
            shutil.rmtree(path, ignore_errors=True)

    def start(self) -> None:
        """At node start: have the layer file system server running, so that the first
        lazy layer does not wait for it to start. ShoalError (one line) if it cannot
        start: the node does not run without it unless told to ([fetch] lazy = false)."""
        try:
            self.fs.supervise()  # (restarts it if it dies; an older version's hands its session over)
        except ShoalError as e:
            raise ShoalError(f"{e} (with [fetch] lazy = false the node runs without lazy layers)") from None

    def stop_if_idle(self) -> None:
        """At node stop: a layer file system server that serves no layer has nothing a
        container could use; stop it (one that serves layers keeps running, and is no
        longer supervised: the next node's start supervises it again)."""
        self.fs.release()  # (a server stopped after this, by hand or by a test, stays stopped)
        try:
            if self.fs.running() and not self.fs.status().get("layers"):
                self.fs.stop()
        except (OSError, ShoalError) as e:
            log.warning("layer file system server: %s", e)

    def sweep(self, keep: set[str]) -> list[str]:
        """At node start, before restoring: remove the layers no snapshot uses any more
        (a crash between a snapshot's removal and its layer's release leaves them) and
        half-made ones (a crash during a prepare). `keep`: the layer paths recorded in
        the snapshot metadata. Returns what was removed (also logged)."""
        removed = []
        layers = os.path.join(self.root, "layers")
        loaded: set[str] | None = None
        for name in sorted(os.listdir(layers)):
            if os.path.join(self.fs.mnt, name) in keep:
                continue
            if not name.startswith("."):
                if loaded is None:
                    loaded = {ly["id"] for ly in self.fs.status().get("layers", [])} if self.fs.running() else set()
                if name in loaded:
                    self.fs.unload(name)
            shutil.rmtree(os.path.join(layers, name), ignore_errors=True)
            removed.append(os.path.join(layers, name))
        for name in sorted(os.listdir(self.unpacked_dir)):
            path = os.path.join(self.unpacked_dir, name)
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
        for path in removed:
            log.warning("removed %s: no snapshot uses it (left by a crash)", path)
        return removed

    def restore(self, path: str, labels: dict[str, str] | None = None) -> None:
        """At start: make sure a lazy layer recorded in metadata is served again."""
        if path.startswith(self.fs.mnt + os.sep):
            self.fs.ensure_running()
            self.fs.load(os.path.basename(path))

    def prove(self, layer: RemoteLayer, urgent: bool, timeout: float) -> str:
        """The layer file system reads the whole blob through the node's fetch chain and
        answers its diff_id (snapshotter/fs/proof.py)."""
        if not layer.path.startswith(self.fs.mnt + os.sep):
            raise ProofFailed(f"{layer.path}: not a lazy layer of this node", final=False)
        layer_id = os.path.basename(layer.path)
        try:
            self.fs.ensure_running()
            self.fs.load(layer_id)
            reply = self.fs.prove(layer_id, urgent, timeout)
        except TimeoutError:
            raise ProofFailed(f"layer {layer.digest}: its proof did not complete within {timeout:.0f}s") from None
        except (OSError, ShoalError) as e:
            raise ProofFailed(f"layer {layer.digest}: {e}") from None
        if reply.get("diff_id"):
            return str(reply["diff_id"])
        raise ProofFailed(str(reply.get("error")), final=bool(reply.get("final")))

    def mark_bad(self, layer: RemoteLayer, reason: str) -> None:
        if layer.path.startswith(self.fs.mnt + os.sep):
            self.fs.ensure_running()
            self.fs.mark_bad(os.path.basename(layer.path), reason)

    def provide_credentials(self, registry: str, repository: str, creds, ttl: float) -> None:
        self.fs.ensure_running()
        self.fs.provide_credentials(registry, repository, creds, ttl)

    def _lock_for(self, digest: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(digest, threading.Lock())

    # --- the layer descriptor ----------------------------------------------------------------

    def _manifest(self, blob: BlobRef, manifest_digest: str):
        """The manifest (fetched by digest through the node's chain, so verified), parsed."""
        data = self.fetch.manifest(blob.registry, blob.repository, manifest_digest, blob.plain_http)
        return parse_manifest(data, f"{blob.registry}/{blob.repository}@{manifest_digest}")

    def _manifest_layers(self, blob: BlobRef, manifest_digest: str) -> list:
        """The layer descriptors of the manifest."""
        return [ly.raw for ly in self._manifest(blob, manifest_digest).layers]

    def _descriptor(self, blob: BlobRef, labels: dict[str, str]) -> dict:
        """The layer's descriptor: from shoal pull's labels, or the verified manifest."""
        if LABEL_TOC_POSITION in labels and LABEL_TOC_DIGEST in labels:
            ann = {
                MANIFEST_POSITION: labels[LABEL_TOC_POSITION], MANIFEST_CHECKSUM: labels[LABEL_TOC_DIGEST],
                OLD_MANIFEST_POSITION: labels[LABEL_TOC_POSITION], OLD_MANIFEST_CHECKSUM: labels[LABEL_TOC_DIGEST],
            }
            return {"digest": blob.digest, "size": blob.size, "annotations": ann,
                    "mediaType": labels.get(LABEL_LAYER_MEDIA_TYPE, mt.OCI_LAYER_ZSTD)}
        manifest_digest = labels.get(LABEL_CRI_MANIFEST_DIGEST)
        if manifest_digest and labels.get(LABEL_LAYER_MEDIA_TYPE) is None:
            for layer in self._manifest_layers(blob, manifest_digest):
                if isinstance(layer, dict) and layer.get("digest") == blob.digest:
                    return layer
            raise FormatError(f"{blob}: manifest {manifest_digest} does not list this layer")
        return {"digest": blob.digest, "size": blob.size, "mediaType": labels.get(LABEL_LAYER_MEDIA_TYPE, "")}

    # --- lazy layers -----------------------------------------------------------------------------

    def _lazy(self, blob: BlobRef, desc: dict, image: str) -> str:
        """The layer served by the layer file system: blob.json (with where the TOC is)
        written here, the TOC read, verified and kept by the file system through the
        node's fetch chain (swarm, region, origin) at its `load`."""
        layer_id = hex_of(blob.digest)
        d = os.path.join(self.root, "layers", layer_id)
        toc_path = os.path.join(d, "toc.json")
        fresh = False
        if not os.path.exists(toc_path):
            loc = location_from_annotations(desc.get("annotations"))
            assert loc is not None
            toc = {"offset": loc.toc.offset, "end": loc.toc.end, "digest": loc.toc_digest,
                   "uncompressed": loc.toc.uncompressed}
            tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.join(self.root, "layers"))
            with open(os.path.join(tmp, "blob.json"), "w") as f:
                json.dump({**blob.to_dict(), "image": image, "toc": toc}, f)
            try:
                os.rename(tmp, d)
                fresh = True
            except OSError:
                shutil.rmtree(tmp, ignore_errors=True)  # an earlier prepare's folder: its blob.json names the TOC
        self.fs.ensure_running()
        try:
            # The file system server fetches the TOC, checks its digest, parses it and
            # refuses a bad one: nothing is mounted, and the layer's folder goes.
            return self.fs.load(layer_id)
        except ShoalError as e:
            if fresh or not os.path.exists(toc_path):
                shutil.rmtree(d, ignore_errors=True)
            raise type(e)(f"{image}: layer {blob.digest}: {e}") from None

    # --- unpacked layers ---------------------------------------------------------------------------

    def _unpacked(self, blob: BlobRef, desc: dict, image: str, target: str, parent_chain: str,
                  labels: dict[str, str]) -> tuple[str, str]:
        """(path, diff_id) of the layer unpacked, after checking that its bytes are the
        chain's: chain_id(parent_chain, sha256 of the decompressed tar) == target. The
        image's config (its diff_ids) is the attacker's to write, the bytes are not: a
        mismatch fails with nothing committed, as containerd's unpacker refuses "wrong
        diff id calculated on extraction". One unpacked folder per blob serves every
        chain the blob is in; its diff_id is known from the unpack (or, for a folder
        unpacked before this process started, from hashing the blob once more)."""
        what = f"{image}: layer {blob.digest}"
        path = os.path.join(self.unpacked_dir, hex_of(blob.digest))
        compression = mt.LAYER_COMPRESSION.get(desc.get("mediaType") or "")
        if compression is None:
            raise FormatError(f"{what}: unsupported media type {desc.get('mediaType')!r}")
        if os.path.isdir(path):
            diff_id = self._diff_ids.get(path) or self._with_tar(blob, compression, what, _hash_stream)
            self._diff_ids[path] = diff_id  # what the folder is, whichever chain asks
            self._check_chain(blob, image, target, parent_chain, diff_id, labels)
            return path, diff_id
        made: list[str] = []  # the folders unpacked into (a second one if the swarm's copy proved bad)

        def unpack_into_new(tar: BinaryIO) -> str:
            made.append(tempfile.mkdtemp(prefix=".tmp-", dir=self.unpacked_dir))
            return unpack(tar, made[-1], what).diff_id

        try:
            diff_id = self._with_tar(blob, compression, what, unpack_into_new)
            self._check_chain(blob, image, target, parent_chain, diff_id, labels)
            os.rename(made.pop(), path)
        finally:
            for tmp in made:
                shutil.rmtree(tmp, ignore_errors=True)
        self._diff_ids[path] = diff_id
        return path, diff_id

    def _with_tar(self, blob: BlobRef, compression: str, what: str, use: Callable[[BinaryIO], str]) -> str:
        """use(the blob's decompressed tar stream), the blob read through the node's fetch
        (the swarm's bulk path, or the node's own chain: NodeFetch.read_whole); the blob is
        read to its end after, so its digest is checked before the result counts. When
        the swarm's copy proves bad (SwarmCopyBad, logged), use() runs once more on the
        blob from the node's own chain."""
        def on_tar(stream: BlobReader) -> str:
            return use(Decompressing(stream, compression, what))  # type: ignore[arg-type]

        try:
            return self.fetch.read_whole(blob, what, on_tar)
        except SwarmCopyBad:
            return self.fetch.read_whole(blob, what, on_tar, swarm=False)

    def _check_chain(self, blob: BlobRef, image: str, target: str, parent_chain: str, diff_id: str,
                     labels: dict[str, str]) -> None:
        if chain_id(parent_chain, diff_id) == target:
            return
        claimed = self._claimed_diff_id(blob, labels.get(LABEL_CRI_MANIFEST_DIGEST), parent_chain, target)
        claim = f"diff_id {claimed}" if claimed else f"chain id {target} on parent chain {parent_chain or '(none)'}"
        raise DigestMismatch(f"{image}: layer {blob.digest}: the image claims {claim}, but the layer's bytes "
                             f"have diff_id {diff_id}: refused (the image's config does not describe this layer)")

    def _claimed_diff_id(self, blob: BlobRef, manifest_digest: str | None, parent_chain: str,
                         target: str) -> str | None:
        """For the error message only: the diff_id in the image's config that makes
        `target` on `parent_chain` (the target alone is what is checked)."""
        if not parent_chain:
            return target
        if not manifest_digest:
            return None
        try:
            man = self._manifest(blob, manifest_digest)
            config = self.fetch.small_blob(dataclasses.replace(blob, digest=man.config.digest, size=man.config.size),
                                           f"{blob}: config", MAX_DOCUMENT_BYTES)
            diff_ids = parse_config(config, str(blob)).diff_ids
            return next((d for d in diff_ids if chain_id(parent_chain, d) == target), None)
        except (ShoalError, OSError):
            return None


def _hash_stream(stream: BinaryIO) -> str:
    sha = hashlib.sha256()
    while data := stream.read(1 << 20):
        sha.update(data)
    return "sha256:" + sha.hexdigest()
