"""`shoal pull REF`: put an image into containerd with its layers provided by shoal.

1. The manifest (and index) and the config are fetched, verified and written into
   containerd's content store; layer blobs are not.
2. Each layer is prepared through containerd's Snapshots API for the `shoal` snapshotter
   with the remote-snapshot labels (target chain id, layer digest, image reference, and
   the layer's TOC position and digest). shoal's node provides the layer (lazily when it
   has a TOC, unpacked otherwise) and answers AlreadyExists; containerd records the
   committed snapshot.
3. The image record is created, and the config carries the snapshot GC reference, so
   `ctr run --snapshotter shoal REF ID` starts a container at once.
Everything happens under a lease so containerd's GC cannot remove half a pull.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass

from builder.format.footer import MANIFEST_CHECKSUM, MANIFEST_POSITION, location_from_annotations
from builder.oci.base import Manifest
from builder.oci.documents import parse_config, parse_index, parse_manifest
from builder.oci.refs import DockerRef, parse_registry_ref
from builder.oci.registry import RegistrySource
from cache.origin import use_plain_http
from shoal import mediatypes as mt
from shoal.digest import chain_id, sha256_digest
from shoal.errors import FormatError, ShoalError, TransportError, UsageError
from snapshotter import DEFAULT_CONTAINERD_ADDRESS as DEFAULT_ADDRESS
from snapshotter.snapshotter import (
    BAD,
    LABEL_CRI_IMAGE_REF,
    LABEL_CRI_LAYER_DIGEST,
    LABEL_CRI_MANIFEST_DIGEST,
    LABEL_DIFF_ID,
    LABEL_GATE,
    LABEL_IMAGE_REF,
    LABEL_LAYER_DIGEST,
    LABEL_LAYER_MEDIA_TYPE,
    LABEL_LAYER_SIZE,
    LABEL_PROOF,
    LABEL_TARGET,
    LABEL_TOC_DIGEST,
    LABEL_TOC_POSITION,
    PROVEN,
    layer_kind,
)

log = logging.getLogger("shoal.pull")

BAD_REMOVAL_WAIT = 10.0  # seconds a pull waits for the node to remove a bad chain it found


def chain_ids(diff_ids: list[str]) -> list[str]:
    """The chain id of each layer (shoal.digest.chain_id)."""
    out: list[str] = []
    for d in diff_ids:
        out.append(chain_id(out[-1] if out else "", d))
    return out


def host_platform() -> str:
    machine = os.uname().machine
    return "linux/" + {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


@dataclass
class PulledLayer:
    digest: str
    chain_id: str
    kind: str  # lazy | unpacked | present
    size: int | None


class _Containerd:
    """The few containerd gRPC calls a pull needs (the stubs live at the edge: here)."""

    def __init__(self, address: str, namespace: str):
        import grpc

        from snapshotter.stubs import containerd_stubs

        self.grpc = grpc
        self.pb = containerd_stubs()
        self.channel = grpc.insecure_channel(f"unix://{os.path.abspath(address)}")
        self.namespace = namespace
        self.lease: str | None = None
        try:
            grpc.channel_ready_future(self.channel).result(timeout=10)
        except grpc.FutureTimeoutError:
            raise TransportError(f"containerd at {address} does not answer") from None

    def _md(self) -> list[tuple[str, str]]:
        md = [("containerd-namespace", self.namespace)]
        if self.lease:
            md.append(("containerd-lease", self.lease))
        return md

    def call(self, stub_cls, method: str, request, what: str):
        stub = stub_cls(self.channel)
        try:
            return getattr(stub, method)(request, metadata=self._md(), timeout=600)
        except self.grpc.RpcError as e:
            raise _RpcFailure(e.code(), f"{what}: {e.details()}", e.details() or "") from None

    def create_lease(self, seconds: float = 3600.0, prefix: str = "shoal-pull") -> None:
        """A lease for what follows (expiring after `seconds`), made this client's lease."""
        pb = self.pb
        lease_id = f"{prefix}-{secrets.token_hex(6)}"
        expire = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds))
        req = pb.leases.CreateRequest(id=lease_id)
        pb.labels_to_pb(req.labels, {"containerd.io/gc.expire": expire})
        self.call(pb.leases_grpc.LeasesStub, "Create", req, "create lease")
        self.lease = lease_id

    def lease_snapshot(self, snapshotter: str, key: str) -> None:
        """Hold an existing snapshot under the pull's lease: a garbage collection during
        the pull (say, after the node removed a bad chain above it) must not take it."""
        if self.lease:
            pb = self.pb
            req = pb.leases.AddResourceRequest(id=self.lease, resource=pb.leases.Resource(
                id=key, type=f"snapshots/{snapshotter}"))
            self.call(pb.leases_grpc.LeasesStub, "AddResource", req, f"lease {key}")

    def delete_lease(self) -> None:
        if self.lease:
            lease, self.lease = self.lease, None
            try:
                self.call(self.pb.leases_grpc.LeasesStub, "Delete", self.pb.leases.DeleteRequest(id=lease), "lease")
            except _RpcFailure as e:
                log.warning("deleting lease %s: %s", lease, e)

    def write_content(self, data: bytes, digest: str, labels: dict[str, str]) -> None:
        pb = self.pb
        ref = f"shoal-pull-{digest}"
        commit = pb.content.WriteContentRequest(action=pb.content.COMMIT, ref=ref, total=len(data),
                                                expected=digest, offset=len(data))
        pb.labels_to_pb(commit.labels, labels)
        reqs = [
            pb.content.WriteContentRequest(action=pb.content.WRITE, ref=ref, total=len(data), expected=digest,
                                           offset=0, data=data),
            commit,
        ]
        stub = pb.content_grpc.ContentStub(self.channel)
        try:
            for _ in stub.Write(iter(reqs), metadata=self._md(), timeout=600):
                pass
        except self.grpc.RpcError as e:
            if e.code() != self.grpc.StatusCode.ALREADY_EXISTS:
                raise TransportError(f"containerd content write {digest}: {e.details()}") from None
            info = pb.content.Info(digest=digest)
            pb.labels_to_pb(info.labels, labels)
            mask = pb.field_mask(paths=[f"labels.{k}" for k in labels])
            self.call(pb.content_grpc.ContentStub, "Update", pb.content.UpdateRequest(info=info, update_mask=mask),
                      f"content labels {digest}")

    def snapshot_labels(self, snapshotter: str, key: str) -> dict[str, str] | None:
        """The labels of snapshot `key` as containerd's Stat shows them, None if it does not exist."""
        pb = self.pb
        try:
            info = self.call(pb.snapshots_grpc.SnapshotsStub, "Stat",
                             pb.snapshots.StatSnapshotRequest(snapshotter=snapshotter, key=key), "stat").info
        except _RpcFailure as e:
            if e.code == self.grpc.StatusCode.NOT_FOUND:
                return None
            raise
        return pb.labels_from_pb(info.labels)

    def remove_snapshot(self, snapshotter: str, key: str) -> None:
        self.call(self.pb.snapshots_grpc.SnapshotsStub, "Remove",
                  self.pb.snapshots.RemoveSnapshotRequest(snapshotter=snapshotter, key=key), f"remove {key}")

    def view(self, snapshotter: str, key: str, parent: str, labels: dict[str, str], what: str) -> None:
        pb = self.pb
        req = pb.snapshots.ViewSnapshotRequest(snapshotter=snapshotter, key=key, parent=parent)
        pb.labels_to_pb(req.labels, labels)
        self.call(pb.snapshots_grpc.SnapshotsStub, "View", req, what)

    def namespaces(self) -> list[str]:
        pb = self.pb
        reply = self.call(pb.namespaces_grpc.NamespacesStub, "List", pb.namespaces.ListNamespacesRequest(),
                          "list namespaces")
        return [n.name for n in reply.namespaces]

    def images(self) -> list[tuple[str, str, str]]:
        """(name, target media type, target digest) of every image in the namespace."""
        pb = self.pb
        reply = self.call(pb.images_grpc.ImagesStub, "List", pb.images.ListImagesRequest(), "list images")
        return [(i.name, i.target.media_type, i.target.digest) for i in reply.images]

    def read_content(self, digest: str) -> bytes | None:
        """A blob of the content store (verified against its digest), None if absent."""
        pb = self.pb
        stub = pb.content_grpc.ContentStub(self.channel)
        try:
            data = b"".join(r.data for r in stub.Read(pb.content.ReadContentRequest(digest=digest),
                                                         metadata=self._md(), timeout=60))
        except self.grpc.RpcError as e:
            if e.code() == self.grpc.StatusCode.NOT_FOUND:
                return None
            raise TransportError(f"containerd content {digest}: {e.details()}") from None
        if sha256_digest(data) != digest:
            raise FormatError(f"containerd content {digest}: its bytes do not match the digest")
        return data

    def prepare_remote(self, snapshotter: str, parent: str, labels: dict[str, str], what: str) -> None:
        pb = self.pb
        key = f"shoal-pull-{secrets.token_hex(8)} {labels[LABEL_TARGET]}"
        req = pb.snapshots.PrepareSnapshotRequest(snapshotter=snapshotter, key=key, parent=parent)
        pb.labels_to_pb(req.labels, labels)
        try:
            self.call(pb.snapshots_grpc.SnapshotsStub, "Prepare", req, what)
        except _RpcFailure as e:
            if e.code == self.grpc.StatusCode.ALREADY_EXISTS:
                return  # the snapshotter provided the layer: the remote-snapshot answer
            # shoal's node names the image and layer itself; containerd appends its
            # error class (": unknown") to what the snapshotter said.
            details = _ERRDEFS_SUFFIX.sub("", e.details)
            raise ShoalError(details if labels[LABEL_LAYER_DIGEST] in details else str(e)) from None
        # An ordinary active snapshot: the snapshotter could not provide this layer.
        self.call(pb.snapshots_grpc.SnapshotsStub, "Remove",
                  pb.snapshots.RemoveSnapshotRequest(snapshotter=snapshotter, key=key), "remove")
        raise ShoalError(f"{what}: the {snapshotter!r} snapshotter did not provide the layer "
                         "(is it shoal's node, and does containerd pass it the labels?)")

    def put_image(self, name: str, target: dict, labels: dict[str, str]) -> None:
        pb = self.pb
        desc = pb.descriptor.Descriptor(media_type=target["mediaType"], digest=target["digest"], size=target["size"])
        image = pb.images.Image(name=name, target=desc)
        pb.labels_to_pb(image.labels, labels)
        try:
            self.call(pb.images_grpc.ImagesStub, "Create", pb.images.CreateImageRequest(image=image), "image")
        except _RpcFailure as e:
            if e.code != self.grpc.StatusCode.ALREADY_EXISTS:
                raise ShoalError(str(e)) from None
            self.call(pb.images_grpc.ImagesStub, "Update", pb.images.UpdateImageRequest(image=image), "image")

    def close(self) -> None:
        self.channel.close()


class _RpcFailure(ShoalError):
    def __init__(self, code, message: str, details: str = ""):
        super().__init__(message)
        self.code = code
        self.details = details


# What containerd's errdefs adds to an error it passes on from a snapshotter.
_ERRDEFS_SUFFIX = re.compile(
    r": (unknown|invalid argument|not found|already exists|failed precondition|unavailable|not implemented)$")


def layer_labels(name: str, layer: dict, chain: str, manifest_digest: str) -> dict[str, str]:
    """The remote-snapshot labels of one layer's Prepare (see snapshotter/remote.py)."""
    labels = {
        LABEL_TARGET: chain,
        LABEL_IMAGE_REF: name,
        LABEL_LAYER_DIGEST: layer["digest"],
        LABEL_LAYER_SIZE: str(layer.get("size", "")),
        LABEL_LAYER_MEDIA_TYPE: layer.get("mediaType", ""),
        LABEL_CRI_IMAGE_REF: name,
        LABEL_CRI_LAYER_DIGEST: layer["digest"],
        LABEL_CRI_MANIFEST_DIGEST: manifest_digest,
    }
    ann = layer.get("annotations") or {}
    loc = location_from_annotations(ann)
    if loc is not None:
        labels[LABEL_TOC_POSITION] = (
            ann.get(MANIFEST_POSITION) or f"{loc.toc.offset}:{loc.toc.length}:{loc.toc.uncompressed}:1")
        labels[LABEL_TOC_DIGEST] = ann.get(MANIFEST_CHECKSUM) or loc.toc_digest
    return labels


def _check_present(ctr: _Containerd, snapshotter: str, name: str, layer: dict, chain: str,
                   labels: dict[str, str], what: str) -> bool:
    """A chain this image names exists already: it must hold what the chain id says
    (snapshotter/chainproof.py). Bad: refused here. A lazy layer not proven yet, made
    from another blob than this image names: the node proves it now, through a View
    whose gate label names this image's claim (its image record does not exist yet).
    True: use it; False: it proved bad and the node removed it (provide it anew)."""
    if labels.get(LABEL_PROOF) == BAD:
        raise ShoalError(f"{what}: chain {chain} on this node holds a bad lazy layer (layer "
                         f"{labels.get(LABEL_LAYER_DIGEST, '?')}: its content is diff_id "
                         f"{labels.get(LABEL_DIFF_ID, '?')}); it is removed once no container uses it")
    provided_from = labels.get(LABEL_LAYER_DIGEST) or labels.get(LABEL_CRI_LAYER_DIGEST)
    lazy = layer_kind(labels) == "lazy"
    if not lazy or labels.get(LABEL_PROOF) == PROVEN or provided_from in (None, layer["digest"]):
        return True
    log.info("%s: chain %s was provided from layer %s: waiting for its proof", what, chain, provided_from)
    key = f"shoal-pull-gate-{secrets.token_hex(8)}"
    gate = {LABEL_GATE: json.dumps({"image": name, "layers": {chain: layer["digest"]}})}
    try:
        ctr.view(snapshotter, key, chain, gate, what)
    except _RpcFailure as e:
        # a bad chain no container uses is removed by the node at once (in the background)
        deadline = time.monotonic() + BAD_REMOVAL_WAIT
        while time.monotonic() < deadline:
            if ctr.snapshot_labels(snapshotter, chain) is None:
                log.warning("%s: chain %s was bad, the node removed it: providing it from this image's layer",
                            what, chain)
                return False
            time.sleep(0.2)
        raise ShoalError(str(e)) from None
    ctr.remove_snapshot(snapshotter, key)
    return True


def _provide_layers(ctr: _Containerd, snapshotter: str, name: str, manifest_digest: str, layers: list[dict],
                    chains: list[str]) -> list[PulledLayer]:
    pulled: list[PulledLayer] = []
    for i, (layer, chain) in enumerate(zip(layers, chains)):
        what = f"{name}: layer {i + 1}/{len(layers)} {layer['digest']}"
        present = ctr.snapshot_labels(snapshotter, chain)
        if present is not None:
            ctr.lease_snapshot(snapshotter, chain)
        if present is not None and _check_present(ctr, snapshotter, name, layer, chain, present, what):
            pulled.append(PulledLayer(layer["digest"], chain, "present", layer.get("size")))
            continue
        labels = layer_labels(name, layer, chain, manifest_digest)
        ctr.prepare_remote(snapshotter, chains[i - 1] if i else "", labels, what)
        kind = "lazy" if LABEL_TOC_POSITION in labels else "unpacked"
        log.info("%s: %s", what, kind)
        pulled.append(PulledLayer(layer["digest"], chain, kind, layer.get("size")))
    return pulled


def _select_manifest(src: RegistrySource, root: Manifest, platform: str, ref: str) -> tuple[Manifest, dict | None]:
    if root.media_type in mt.MANIFEST_TYPES:
        return root, None
    if root.media_type not in mt.INDEX_TYPES:
        raise FormatError(f"{ref}: unsupported manifest type {root.media_type}")
    for d in parse_index(root.data, ref).manifests:
        p = d.platform
        if p is not None and (f"{p.os}/{p.architecture}" == platform or (p.variant and str(p) == platform)):
            return src.get_manifest(d.digest), d.raw
    raise UsageError(f"{ref}: no manifest for platform {platform}")


def image_ref(ref: str, plain_http: bool = False) -> tuple[str, DockerRef, bool]:
    """(HOST/REPO[:TAG], the parsed reference, plain HTTP?) of a registry image reference
    (docker:// optional; plain HTTP when asked or for a loopback registry)."""
    parsed = parse_registry_ref(ref)
    return ref.removeprefix("docker://"), parsed, use_plain_http(parsed.host, asked=plain_http)


def resolve_manifest(src: RegistrySource, ref: str, platform: str | None = None) -> tuple[Manifest, Manifest, dict | None]:
    """(root manifest or index, the platform's manifest, its index entry or None)."""
    root = src.get_root()
    manifest, index_entry = _select_manifest(src, root, platform or host_platform(), ref)
    return root, manifest, index_entry


def pull(ref: str, address: str = DEFAULT_ADDRESS, namespace: str = "default", plain_http: bool = False,
         snapshotter: str = "shoal", platform: str | None = None) -> dict:
    """Pull ref into containerd with shoal-provided layers; returns a summary."""
    name, parsed, plain = image_ref(ref, plain_http)
    platform = platform or host_platform()
    start = time.monotonic()
    src = RegistrySource(parsed, plain_http=plain)
    ctr = _Containerd(address, namespace)
    try:
        root, manifest, index_entry = resolve_manifest(src, ref, platform)
        doc = parse_manifest(manifest.data, ref)
        config_desc = doc.config.raw
        config_bytes = src.read_small_blob(doc.config.digest, doc.config.size, f"{ref}: config")
        diff_ids = parse_config(config_bytes, ref, len(doc.layers)).diff_ids
        layers = [ly.raw for ly in doc.layers]
        chains = chain_ids(diff_ids)
        ctr.create_lease()
        pulled = _provide_layers(ctr, snapshotter, name, manifest.digest, layers, chains)
        # content: config (holding the snapshot GC reference), manifest, index
        gc = f"containerd.io/gc.ref.snapshot.{snapshotter}"
        ctr.write_content(config_bytes, config_desc["digest"], {gc: chains[-1]} if chains else {})
        ctr.write_content(manifest.data, manifest.digest, {"containerd.io/gc.ref.content.config": config_desc["digest"]})
        target = {"mediaType": manifest.media_type, "digest": manifest.digest, "size": len(manifest.data)}
        if index_entry is not None:
            ctr.write_content(root.data, root.digest, {"containerd.io/gc.ref.content.m.0": manifest.digest})
            target = {"mediaType": root.media_type, "digest": root.digest, "size": len(root.data)}
        ctr.put_image(name, target, {})
    finally:
        ctr.delete_lease()
        ctr.close()
        src.close()
    return {
        "image": name,
        "digest": root.digest,
        "manifest": manifest.digest,
        "platform": platform,
        "snapshotter": snapshotter,
        "layers": [p.__dict__ for p in pulled],
        "lazy": sum(p.kind == "lazy" for p in pulled),
        "unpacked": sum(p.kind == "unpacked" for p in pulled),
        "seconds": round(time.monotonic() - start, 3),
    }


def format_summary(s: dict) -> str:
    lines = [f"{s['image']}  {s['digest']}  ({s['platform']}, snapshotter {s['snapshotter']})"]
    for i, ly in enumerate(s["layers"], 1):
        size = f"{ly['size']:,} B" if isinstance(ly["size"], int) else "?"
        lines.append(f"  {i:>3}  {ly['digest']}  {size:>16}  {ly['kind']}")
    lines.append(f"  {s['lazy']} lazy, {s['unpacked']} unpacked, in {s['seconds']:.1f}s")
    return "\n".join(lines)
