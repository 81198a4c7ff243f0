"""A small CRI v1 client, as the kubelet drives containerd's CRI plugin (PyPI
`container-runtime-interface-api`: cri_api.v1.api_pb2 / api_pb2_grpc), for tests.

The stubs need protobuf's pure-Python implementation like containerd's (snapshotter.wire
selects it): import snapshotter.wire before this module's stubs load.
"""

from __future__ import annotations

import contextlib
import os
import time

from snapshotter import wire  # noqa: F401  (selects the protobuf implementation first)

# isort: split
import grpc
from cri_api.v1 import api_pb2, api_pb2_grpc


class CRIError(RuntimeError):
    """A CRI call failed: `.code` (grpc.StatusCode) and the message containerd gave."""

    def __init__(self, what: str, error: grpc.RpcError) -> None:
        self.code, self.details = error.code(), error.details() or ""
        super().__init__(f"{what}: {self.code.name}: {self.details}")


class CRIClient:
    """RuntimeService on containerd's socket, ImageService on `image_address` (the kubelet's
    --image-service-endpoint; containerd's socket unless given). Pods in namespace
    `shoal-test` of containerd's k8s.io."""

    def __init__(self, address: str, timeout: float = 300.0, image_address: str = "") -> None:
        self.channel = grpc.insecure_channel(f"unix://{os.path.abspath(address)}")
        self.image_channel = (grpc.insecure_channel(f"unix://{os.path.abspath(image_address)}") if image_address
                              else self.channel)
        self.images = api_pb2_grpc.ImageServiceStub(self.image_channel)
        self.runtime = api_pb2_grpc.RuntimeServiceStub(self.channel)
        self.timeout = timeout

    def _call(self, stub, method: str, request, what: str):
        try:
            return getattr(stub, method)(request, timeout=self.timeout)
        except grpc.RpcError as e:
            raise CRIError(what, e) from None

    def version(self) -> str:
        return self._call(self.runtime, "Version", api_pb2.VersionRequest(), "version").runtime_version

    def pull_image(self, image: str, auth: dict | None = None, sandbox=None) -> str:
        """PullImage (with an AuthConfig of `auth`'s fields, as the kubelet fills it from a
        pull secret); returns the image reference containerd gives (its id)."""
        request = api_pb2.PullImageRequest(image=api_pb2.ImageSpec(image=image), sandbox_config=sandbox)
        if auth is not None:
            request.auth.CopyFrom(api_pb2.AuthConfig(**auth))
        return self._call(self.images, "PullImage", request, f"pull {image}").image_ref

    def image_status(self, image: str):
        return self._call(self.images, "ImageStatus",
                          api_pb2.ImageStatusRequest(image=api_pb2.ImageSpec(image=image)), f"status {image}").image

    def remove_image(self, image: str) -> None:
        self._call(self.images, "RemoveImage", api_pb2.RemoveImageRequest(image=api_pb2.ImageSpec(image=image)),
                   f"remove image {image}")

    def list_images(self) -> list:
        return list(self._call(self.images, "ListImages", api_pb2.ListImagesRequest(), "list images").images)

    def pods(self) -> list:
        return list(self._call(self.runtime, "ListPodSandbox", api_pb2.ListPodSandboxRequest(), "list pods").items)

    def containers(self) -> list:
        return list(self._call(self.runtime, "ListContainers", api_pb2.ListContainersRequest(),
                               "list containers").containers)

    @staticmethod
    def sandbox_config(name: str, log_dir: str, runtime_handler: str = ""):
        """A pod's sandbox: host network (no CNI); with `runtime_handler`, the annotation
        containerd 1.7 reads to pull into the handler's snapshotter."""
        host = api_pb2.NamespaceOption(network=api_pb2.NamespaceMode.NODE)
        return api_pb2.PodSandboxConfig(
            metadata=api_pb2.PodSandboxMetadata(name=name, uid=name, namespace="shoal-test"),
            log_directory=log_dir,
            annotations={"io.containerd.cri.runtime-handler": runtime_handler} if runtime_handler else {},
            linux=api_pb2.LinuxPodSandboxConfig(security_context=api_pb2.LinuxSandboxSecurityContext(
                namespace_options=host)))

    def run(self, image: str, command: list[str], log_dir: str, name: str, timeout: float = 120.0,
            runtime_handler: str = "") -> str:
        """What the kubelet does for a one-container pod: RunPodSandbox (host network: no
        CNI; on `runtime_handler`, a RuntimeClass's handler), CreateContainer of `image`
        running `command`, StartContainer, wait for its exit; returns what it wrote on
        stdout (from its CRI log file under `log_dir`). CRIError when any step fails or the
        container exits non-zero (with its log). Then, in any case, what the kubelet does
        when the pod is deleted: StopPodSandbox, RemoveContainer, RemovePodSandbox."""
        sandbox = self.sandbox_config(name, log_dir, runtime_handler)
        pod = self._call(self.runtime, "RunPodSandbox", api_pb2.RunPodSandboxRequest(
            config=sandbox, runtime_handler=runtime_handler), f"run pod {name}").pod_sandbox_id
        cid = ""
        try:
            host = api_pb2.NamespaceOption(network=api_pb2.NamespaceMode.NODE)
            config = api_pb2.ContainerConfig(
                metadata=api_pb2.ContainerMetadata(name=name), image=api_pb2.ImageSpec(image=image),
                command=command, log_path=f"{name}.log",
                linux=api_pb2.LinuxContainerConfig(security_context=api_pb2.LinuxContainerSecurityContext(
                    namespace_options=host)))
            cid = self._call(self.runtime, "CreateContainer", api_pb2.CreateContainerRequest(
                pod_sandbox_id=pod, config=config, sandbox_config=sandbox), f"create container {name}").container_id
            self._call(self.runtime, "StartContainer", api_pb2.StartContainerRequest(container_id=cid),
                       f"start container {name}")
            deadline = time.monotonic() + timeout
            while True:
                st = self._call(self.runtime, "ContainerStatus", api_pb2.ContainerStatusRequest(container_id=cid),
                                f"status of {name}").status
                if st.state == api_pb2.ContainerState.CONTAINER_EXITED:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"container {name} still running after {timeout:.0f}s")
                time.sleep(0.1)
            out = read_cri_log(os.path.join(log_dir, f"{name}.log"))
            if st.exit_code != 0:
                raise RuntimeError(f"container {name} exited with {st.exit_code}: {out}")
            return out
        finally:
            self._call(self.runtime, "StopPodSandbox", api_pb2.StopPodSandboxRequest(pod_sandbox_id=pod), "stop pod")
            if cid:
                self._call(self.runtime, "RemoveContainer", api_pb2.RemoveContainerRequest(container_id=cid),
                           "remove container")
            self._call(self.runtime, "RemovePodSandbox", api_pb2.RemovePodSandboxRequest(pod_sandbox_id=pod),
                       "remove pod")

    def close(self) -> None:
        if self.image_channel is not self.channel:
            self.image_channel.close()
        self.channel.close()


def read_cri_log(path: str) -> str:
    """The stdout lines of a CRI log file (`TIME STREAM TAG LINE`, TAG F full or P partial)."""
    out = []
    with open(path, errors="replace") as f:
        for line in f:
            parts = line.rstrip("\n").split(" ", 3)
            if len(parts) == 4 and parts[1] == "stdout":
                out.append(parts[3] + ("\n" if parts[2] == "F" else ""))
    return "".join(out)


@contextlib.contextmanager
def cri_node(registries: list[str], sandbox_image: str, node_config: str = "", image_socket: str = "",
             prefix: str = "shoal-cri-", install: bool = True):
    """`shoal node`, and containerd with its CRI plugin pulling from the loopback
    `registries`, sandboxes from `sandbox_image`, set up by `shoal install containerd` as
    deploy/ does (`install`; else tests.services.cri_config's own settings); yields (node,
    containerd, a CRIClient whose ImageService is on `image_socket` (`@DIR@` stands for
    the private directory, as in `node_config`) when given, containerd's socket else).
    Skips the test where containerd cannot run. Pods, containers, containerd and the
    node are stopped and removed also on failure."""
    import pytest

    from tests.fixtures_services import containerd_missing
    from tests.services import shoal_node_with_containerd

    reason = containerd_missing()
    if reason:
        pytest.skip(reason)
    with shoal_node_with_containerd(prefix, node_config, registries, sandbox_image=sandbox_image,
                                    install=install) as (node, ctd):
        image_address = image_socket.replace("@DIR@", str(node.root.parent)) if image_socket else ""
        cri = CRIClient(ctd.address, image_address=image_address)
        try:
            yield node, ctd, cri
        finally:
            cri.close()
