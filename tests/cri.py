"""A small CRI v1 client, as the kubelet drives containerd's CRI plugin (PyPI
`container-runtime-interface-api`: cri_api.v1.api_pb2 / api_pb2_grpc), for tests.

The stubs need protobuf's pure-Python implementation like containerd's (snapshotter.convert
selects it): import snapshotter.convert before this module's stubs load.
"""

from __future__ import annotations

import os

from snapshotter import convert  # noqa: F401  (selects the protobuf implementation first)

# isort: split
import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc


class CRIError(RuntimeError):
    """A CRI call failed: `.code` (grpc.StatusCode) and the message containerd gave."""

    def __init__(self, what: str, error: grpc.RpcError) -> None:
        self.code, self.details = error.code(), error.details() or ""
        super().__init__(f"{what}: {self.code.name}: {self.details}")


class CRIClient:
    """ImageService and RuntimeService on containerd's socket (namespace k8s.io)."""

    def __init__(self, address: str, timeout: float = 300.0) -> None:
        self.channel = grpc.insecure_channel(f"unix://{os.path.abspath(address)}")
        self.images = api_pb2_grpc.ImageServiceStub(self.channel)
        self.runtime = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.timeout = timeout

    def _call(self, stub, method: str, request, what: str):
        try:
            return getattr(stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise CRIError(what, e) from None

    def version(self) -> str:
        return self._call(self.runtime, "Version", api_pb2.VersionRequest(), "version").runtime_version

    def pull_image(self, image: str) -> str:
        """PullImage; returns the image reference containerd gives (its id)."""
        reply = self._call(self.images, "PullImage",
                           api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image)), f"pull {image}")
        return reply.image_ref

    def image_status(self, image: str):
        return self._call(self.images, "ImageStatus",
                          api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=image)), f"status {image}").image

    def close(self) -> None:
        self.channel.close()
