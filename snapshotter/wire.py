"""The only module that knows containerd's wire types (as containerd's
core/snapshots/proxy/convert.go): protobuf messages <-> snapshotter.py's dataclasses,
one table of the Snapshots service's methods, and one error mapping to gRPC codes.

The stubs come from the PyPI package `containerd` ("containerd API for Python", 1.5.3),
generated in 2021 with the old descriptor API. Current protobuf (4.x and later) refuses
such generated code in its default C (upb) implementation and accepts it in the pure
Python one, so this module selects that implementation before protobuf is first
imported. The environment variable is process-wide: import this module (or anything
that imports it) before any other protobuf user in `shoal node`. Pure-Python protobuf is
slower, which does not matter at the snapshotter's message rates (a few small messages
per layer and per container).
"""

from __future__ import annotations

import os
import sys

_PB_ENV = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"
if "google.protobuf" not in sys.modules:
    os.environ[_PB_ENV] = "python"
else:  # too late to choose: say why the import below would fail
    from google.protobuf.internal import api_implementation as _api

    if _api.Type() != "python":
        raise ImportError(
            f"snapshotter.wire must be imported before any other protobuf user, or run with "
            f"{_PB_ENV}=python (protobuf is already loaded with its {_api.Type()!r} implementation)",
            name="snapshotter.wire",
        )

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
from containerd.services.snapshots.v1 import snapshots_pb2 as pb
from containerd.types import mount_pb2
from google.protobuf import empty_pb2

from shoal.errors import ShoalError
from snapshotter.snapshotter import (
    AlreadyExists,
    FailedPrecondition,
    Info,
    InvalidArgument,
    Kind,
    Mount,
    NotFound,
    Usage,
)

SERVICE = "containerd.services.snapshots.v1.Snapshots"
LIST_BATCH = 100  # infos per List response message, as containerd's own service sends

# --- values ---------------------------------------------------------------------------

# The stubs declare map entries the pre-4.x way (an options blob, not is_map_entry), so
# pure-Python protobuf 4+ does not see `map<string, string> labels` as a map: it exposes a
# repeated LabelsEntry message field instead. The wire format is the same (a map *is* a
# repeated entry message); these two helpers accept either shape.


def labels_from_pb(field: Any) -> dict[str, str]:
    if hasattr(field, "items"):
        return dict(field.items())
    return {entry.key: entry.value for entry in field}  # later entries win, as in a map


def labels_to_pb(field: Any, labels: dict[str, str]) -> None:
    if hasattr(field, "update"):
        field.update(labels)
    else:
        for key, value in labels.items():
            field.add(key=key, value=value)


_KIND_TO_PB = {Kind.VIEW: pb.VIEW, Kind.ACTIVE: pb.ACTIVE, Kind.COMMITTED: pb.COMMITTED}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}


def info_to_pb(info: Info) -> pb.Info:
    msg = pb.Info(name=info.name, parent=info.parent, kind=_KIND_TO_PB[info.kind])
    labels_to_pb(msg.labels, info.labels)
    msg.created_at.FromNanoseconds(info.created_ns)
    msg.updated_at.FromNanoseconds(info.updated_ns)
    return msg


def info_from_pb(msg: pb.Info) -> Info:
    return Info(
        kind=_KIND_FROM_PB.get(msg.kind, Kind.COMMITTED),  # containerd's toKind: unknown -> committed
        name=msg.name,
        parent=msg.parent,
        labels=labels_from_pb(msg.labels),
        created_ns=msg.created_at.ToNanoseconds(),
        updated_ns=msg.updated_at.ToNanoseconds(),
    )


def mounts_to_pb(mounts: Iterable[Mount]) -> list[mount_pb2.Mount]:
    return [mount_pb2.Mount(type=m.type, source=m.source, options=list(m.options)) for m in mounts]


def mounts_from_pb(msgs: Iterable[mount_pb2.Mount]) -> list[Mount]:
    return [Mount(type=m.type, source=m.source, options=tuple(m.options)) for m in msgs]


# --- errors ---------------------------------------------------------------------------

_ERROR_CODES = (
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
)


def error_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status for an exception: the four contract errors keep their class
    (containerd's errdefs.FromGRPC turns them back into ErrNotFound, ...), anything else
    is UNKNOWN. The message is one line."""
    code = next((c for cls, c in _ERROR_CODES if isinstance(exc, cls)), grpc.StatusCode.UNKNOWN)
    if isinstance(exc, OSError) and exc.strerror:
        text = exc.strerror + (f": {exc.filename}" if exc.filename else "")
    else:
        text = str(exc)
    lines = text.strip().splitlines()
    message = lines[0] if lines else type(exc).__name__
    if not isinstance(exc, ShoalError) and not isinstance(exc, OSError):
        message = f"{type(exc).__name__}: {message}"  # a bug: name it
    return code, message


# --- the service's methods ---------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One RPC: its wire types, how its request becomes a Snapshotter call, and how the
    call's result becomes the response (an iterator of responses for streams)."""

    name: str
    request: Any
    response: Any
    call: Callable[[Any, Any], Any]  # (snapshotter, request) -> result
    encode: Callable[[Any], Any]  # result -> response message (or iterator of them)
    streaming: bool = False

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"


def _empty(_: Any) -> empty_pb2.Empty:
    return empty_pb2.Empty()


def _list_responses(infos: list[Info]) -> Iterator[pb.ListSnapshotsResponse]:
    for i in range(0, len(infos), LIST_BATCH):
        yield pb.ListSnapshotsResponse(info=[info_to_pb(x) for x in infos[i:i + LIST_BATCH]])


METHODS = (
    Method("Prepare", pb.PrepareSnapshotRequest, pb.PrepareSnapshotResponse,
           lambda sn, r: sn.prepare(r.key, r.parent, labels_from_pb(r.labels)),
           lambda mounts: pb.PrepareSnapshotResponse(mounts=mounts_to_pb(mounts))),
    Method("View", pb.ViewSnapshotRequest, pb.ViewSnapshotResponse,
           lambda sn, r: sn.view(r.key, r.parent, labels_from_pb(r.labels)),
           lambda mounts: pb.ViewSnapshotResponse(mounts=mounts_to_pb(mounts))),
    Method("Mounts", pb.MountsRequest, pb.MountsResponse,
           lambda sn, r: sn.mounts(r.key),
           lambda mounts: pb.MountsResponse(mounts=mounts_to_pb(mounts))),
    Method("Commit", pb.CommitSnapshotRequest, empty_pb2.Empty,
           lambda sn, r: sn.commit(r.name, r.key, labels_from_pb(r.labels)), _empty),
    Method("Remove", pb.RemoveSnapshotRequest, empty_pb2.Empty,
           lambda sn, r: sn.remove(r.key), _empty),
    Method("Stat", pb.StatSnapshotRequest, pb.StatSnapshotResponse,
           lambda sn, r: sn.stat(r.key),
           lambda info: pb.StatSnapshotResponse(info=info_to_pb(info))),
    Method("Update", pb.UpdateSnapshotRequest, pb.UpdateSnapshotResponse,
           lambda sn, r: sn.update(info_from_pb(r.info), list(r.update_mask.paths)),
           lambda info: pb.UpdateSnapshotResponse(info=info_to_pb(info))),
    Method("Usage", pb.UsageRequest, pb.UsageResponse,
           lambda sn, r: sn.usage(r.key),
           lambda usage: pb.UsageResponse(size=usage.size, inodes=usage.inodes)),
    Method("List", pb.ListSnapshotsRequest, pb.ListSnapshotsResponse,
           lambda sn, r: sn.walk(list(r.filters)), _list_responses, streaming=True),
    Method("Cleanup", pb.CleanupRequest, empty_pb2.Empty,
           lambda sn, r: sn.cleanup(), _empty),
)


def usage_from_pb(msg: pb.UsageResponse) -> Usage:
    return Usage(size=msg.size, inodes=msg.inodes)
