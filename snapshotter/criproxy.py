"""The CRI image service in front of containerd's: how lazy reads get the kubelet's pull
credentials.

The kubelet sends a private image's credentials (from the pod's pull secrets, its
credential providers or its own config) in PullImage's AuthConfig; containerd uses them
for its own pull of the manifest and config and hands them to no snapshotter. A lazy
layer is read long after, by the node's fetch chain, from the same repository. So the
node serves the CRI ImageService on a socket of its own (`[cri] image_service_socket`,
the kubelet's `--image-service-endpoint`) and forwards every call, byte for byte, to
containerd's (`[containerd] address`); the runtime service stays containerd's.

What the proxy keeps of a PullImage (docs/security.md, "Pull credentials through CRI"):
- Its AuthConfig's user and password (`username`/`password`, or `auth` = base64 of
  user:password), for the image's (registry host, repository) only: another repository
  of the same registry never gets them. An AuthConfig whose `server_address` names
  another host is ignored, as containerd ignores it; identity and registry tokens are not
  kept (one log line naming the image, never the token).
- In memory only, in this process and in the layer file system's (over the root-only
  control socket, fs.sock), never on disk and never logged; they expire `credential_ttl`
  seconds after the last PullImage that carried them, and are forgotten when RemoveImage
  removes the repository's last image.
- They are given before the call is forwarded (containerd's Prepare of lazy layers,
  during the pull, reads TOCs with them); if the pull fails, what was there before is
  put back. A PullImage without AuthConfig changes nothing.

Threads: gRPC's worker pool; `keychain` (the node's: this process's auth.provide and
the layer file system's) is called from those threads.
Errors: containerd's status codes and messages are answered as they are; an
unreadable request is forwarded unread (containerd answers it).
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import grpc

from builder.oci.auth import Credentials
from builder.oci.refs import parse_registry_ref
from shoal.errors import ShoalError

log = logging.getLogger("shoal.cri")

# the kubelet speaks v1 (1.26+); containerd 1.6/1.7 also serve v1alpha2, whose messages
# have the same fields
SERVICES = ("runtime.v1.ImageService", "runtime.v1alpha2.ImageService")
MAX_MESSAGE = 16 << 20

# keychain(registry, repository, credentials or None to forget, ttl seconds)
Keychain = Callable[[str, str, "Credentials | None", float], None]


# --- the few protobuf fields the proxy reads (pure functions over bytes) ----------------


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data) or shift > 63:
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def fields(data: bytes) -> list[tuple[int, bytes | int]]:
    """A protobuf message's (field number, value): bytes for length-delimited fields,
    int for varints and fixed-width ones. ValueError for a malformed message."""
    out: list[tuple[int, bytes | int]] = []
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            value, i = _varint(data, i)
            out.append((number, value))
        elif kind == 2:
            size, i = _varint(data, i)
            if i + size > len(data):
                raise ValueError("truncated field")
            out.append((number, data[i:i + size]))
            i += size
        elif kind in (1, 5):
            width = 8 if kind == 1 else 4
            if i + width > len(data):
                raise ValueError("truncated field")
            out.append((number, int.from_bytes(data[i:i + width], "little")))
            i += width
        else:
            raise ValueError(f"wire type {kind} not readable")
    return out


def _strings(data: bytes, number: int) -> list[str]:
    return [v.decode("utf-8", "replace") for n, v in fields(data) if n == number and isinstance(v, bytes)]


def _message(data: bytes, number: int) -> bytes:
    found = [v for n, v in fields(data) if n == number and isinstance(v, bytes)]
    return found[-1] if found else b""


@dataclass(frozen=True)
class PullAuth:
    """What a PullImageRequest says: the image, and the AuthConfig's fields."""

    image: str
    username: str = ""
    password: str = ""
    auth: str = ""
    server_address: str = ""
    tokens: bool = False  # an identity or registry token (not kept)

    def __repr__(self) -> str:  # never print a secret
        return f"PullAuth(image={self.image!r}, username={self.username!r}, ...)"


def parse_pull(data: bytes) -> PullAuth:
    """PullImageRequest {ImageSpec image = 1 {string image = 1}; AuthConfig auth = 2
    {username = 1, password = 2, auth = 3, server_address = 4, identity_token = 5,
    registry_token = 6}}. ValueError for a malformed message."""
    image = _strings(_message(data, 1), 1)
    auth = {n: v.decode("utf-8", "replace") for n, v in fields(_message(data, 2)) if isinstance(v, bytes)}
    return PullAuth(image[-1] if image else "", auth.get(1, ""), auth.get(2, ""), auth.get(3, ""), auth.get(4, ""),
                    bool(auth.get(5) or auth.get(6)))


def image_names(data: bytes) -> list[str]:
    """The repo_tags and repo_digests (fields 2, 3) of the Image messages at field 1 of
    an ImageStatusResponse (one) or ListImagesResponse (many)."""
    names = []
    for number, image in fields(data):
        if number == 1 and isinstance(image, bytes):
            names += _strings(image, 2) + _strings(image, 3)
    return names


def credentials_of(pull: PullAuth, host: str) -> Credentials | None:
    """The user and password a pull of an image on `host` carries, as containerd's
    ParseAuth reads them; None when there are none, or when server_address is another
    host's."""
    if pull.server_address:
        address = pull.server_address if "://" in pull.server_address else f"https://{pull.server_address}"
        if urlparse(address).netloc != host:
            return None
    if pull.username:
        return Credentials(pull.username, pull.password)
    if pull.auth:
        try:
            user, colon, password = base64.b64decode(pull.auth, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        if colon and user:
            return Credentials(user, password)
    return None


def _repository(name: str) -> tuple[str, str] | None:
    try:
        ref = parse_registry_ref(name, short_names=True)
    except ShoalError:
        return None
    return ref.host, ref.repository


# --- the proxy --------------------------------------------------------------------------


class ImageServiceProxy:
    """The CRI ImageService on `socket_path` (mode 0600), forwarded to containerd at
    `upstream` (its socket path). start() / stop(grace)."""

    def __init__(self, socket_path: str | Path, upstream: str, keychain: Keychain, ttl: float,
                 threads: int = 8) -> None:
        from snapshotter.grpc_server import PrivateServer

        self._keychain, self._ttl = keychain, ttl
        self._server = PrivateServer(socket_path, [_Forward(self)], "the CRI image service (to containerd's)",
                                     threads, "cri-images")
        self.socket_path = self._server.socket_path
        self._channel = grpc.insecure_channel(f"unix:{os.path.abspath(upstream)}", options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)])

    def start(self) -> None:
        self._server.start()

    def stop(self, grace: float = 5.0) -> None:
        self._server.stop(grace)
        self._channel.close()

    # --- calls

    def upstream(self, method: str, request: bytes, context: grpc.ServicerContext | None) -> bytes:
        """`request` forwarded to containerd's `method` (a full "/SERVICE/NAME")."""
        timeout = context.time_remaining() if context is not None else 60.0
        call = self._channel.unary_unary(method)
        return call(request, timeout=timeout)

    def call(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        service, _, name = method.lstrip("/").partition("/")
        try:
            if name == "PullImage":
                return self._pull(method, request, context)
            if name == "RemoveImage":
                return self._remove(service, method, request, context)
            return self.upstream(method, request, context)
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or "")
            raise  # (abort raises)

    def _pull(self, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        try:
            pull = parse_pull(request)
        except ValueError:
            return self.upstream(method, request, context)
        scope = _repository(pull.image)
        creds = credentials_of(pull, scope[0]) if scope else None
        if pull.tokens and creds is None:
            log.warning("PullImage %s: its AuthConfig holds a token, which lazy reads cannot use "
                        "(only user and password are kept)", pull.image)
        if scope is None or creds is None:
            return self.upstream(method, request, context)
        from builder.oci.auth import provided

        before = provided(*scope)
        self._give(scope, creds, self._ttl)
        try:
            return self.upstream(method, request, context)
        except grpc.RpcError:
            self._give(scope, before, self._ttl)  # a failed pull keeps nothing of its own
            raise

    def _remove(self, service: str, method: str, request: bytes, context: grpc.ServicerContext) -> bytes:
        # RemoveImageRequest and ImageStatusRequest both hold the ImageSpec at field 1
        try:
            names = image_names(self.upstream(f"/{service}/ImageStatus", request, context))
        except (grpc.RpcError, ValueError):
            names = []
        reply = self.upstream(method, request, context)
        scopes = {s for s in map(_repository, names) if s is not None}
        if scopes:
            try:
                listed = image_names(self.upstream(f"/{service}/ListImages", b"", context))
                left = {s for s in map(_repository, listed) if s is not None}
            except (grpc.RpcError, ValueError):
                left = scopes  # unknown: keep them (they expire)
            for scope in scopes - left:
                self._give(scope, None, 0.0)
        return reply

    def _give(self, scope: tuple[str, str], creds: Credentials | None, ttl: float) -> None:
        try:
            self._keychain(scope[0], scope[1], creds, ttl)
        except (OSError, ShoalError) as e:
            log.warning("credentials for %s/%s: not handed to the layer file system: %s", scope[0], scope[1], e)


class _Forward(grpc.GenericRpcHandler):
    """Every unary call of the ImageService (v1, v1alpha2), as bytes; other services
    are not here (UNIMPLEMENTED)."""

    def __init__(self, proxy: ImageServiceProxy) -> None:
        self._proxy = proxy

    def service(self, handler_call_details):
        method = handler_call_details.method
        if method.lstrip("/").partition("/")[0] not in SERVICES:
            return None
        return grpc.unary_unary_rpc_method_handler(lambda request, context: self._proxy.call(method, request, context))
