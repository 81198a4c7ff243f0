"""containerd's gRPC stubs, from the PyPI package `containerd` (1.5.3, generated in 2021).

Those generated modules import only with protobuf's pure-Python implementation under
current protobuf (checked: the upb backend refuses their descriptors), so the variable
is set here, before anything imports google.protobuf. This module is the only place
that imports the stubs; shoal's own code never imports protobuf elsewhere.
"""

from __future__ import annotations

import os
import sys
import types

os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
if "google.protobuf" in sys.modules and os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] != "python":
    raise ImportError("protobuf was imported before snapshotter.stubs could select its Python implementation")

from containerd.services.content.v1 import content_pb2, content_pb2_grpc  # noqa: E402
from containerd.services.images.v1 import images_pb2, images_pb2_grpc  # noqa: E402
from containerd.services.leases.v1 import leases_pb2, leases_pb2_grpc  # noqa: E402
from containerd.services.snapshots.v1 import snapshots_pb2, snapshots_pb2_grpc  # noqa: E402
from containerd.types import descriptor_pb2, mount_pb2  # noqa: E402
from google.protobuf import empty_pb2, field_mask_pb2, timestamp_pb2  # noqa: E402


def containerd_stubs() -> types.SimpleNamespace:
    return types.SimpleNamespace(
        content=content_pb2, content_grpc=content_pb2_grpc,
        images=images_pb2, images_grpc=images_pb2_grpc,
        leases=leases_pb2, leases_grpc=leases_pb2_grpc,
        snapshots=snapshots_pb2, snapshots_grpc=snapshots_pb2_grpc,
        descriptor=descriptor_pb2, mount=mount_pb2,
        empty=empty_pb2, field_mask=field_mask_pb2.FieldMask, timestamp=timestamp_pb2,
    )
