"""containerd's client-side stubs for `shoal pull` and the node's chain proofs (content,
images, leases, namespaces, snapshots).

snapshotter.wire selects protobuf's pure-Python implementation (the only one that
accepts the PyPI `containerd` package's 2021 generated code); importing it first keeps
that choice in one place. Map fields of these stubs are repeated entries under that
implementation: fill them with wire.labels_to_pb, never with a labels=... argument.
"""

# ruff: noqa: I001  (the import order is the point: convert first)
from __future__ import annotations

import types

from snapshotter import wire

from containerd.services.content.v1 import content_pb2, content_pb2_grpc
from containerd.services.images.v1 import images_pb2, images_pb2_grpc
from containerd.services.leases.v1 import leases_pb2, leases_pb2_grpc
from containerd.services.namespaces.v1 import namespace_pb2, namespace_pb2_grpc
from containerd.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc
from containerd.types import descriptor_pb2
from google.protobuf import field_mask_pb2


def containerd_stubs() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        content=content_pb2, content_grpc=content_pb2_grpc,
        images=images_pb2, images_grpc=images_pb2_grpc,
        leases=leases_pb2, leases_grpc=leases_pb2_grpc,
        namespaces=namespace_pb2, namespaces_grpc=namespace_pb2_grpc,
        snapshots=snapshots_pb2, snapshots_grpc=snapshots_pb2_grpc,
        descriptor=descriptor_pb2, field_mask=field_mask_pb2.FieldMask,
        labels_to_pb=wire.labels_to_pb, labels_from_pb=wire.labels_from_pb,
    )
