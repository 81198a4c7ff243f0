"""The origin registry as the last fetch source: HTTP range requests with registry auth.

Adjacent ranges are merged into one request (a gap of up to MERGE_GAP bytes is read and
dropped); each request is a single range, so registries that refuse multi-range
requests work. Authentication (basic, bearer tokens) and bounded retries come from the
registry client in builder.oci.registry; credentials from the docker config.json.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

from builder.oci.refs import DockerRef
from builder.oci.registry import RegistrySource, is_loopback
from cache.source import BlobRef, Source

MERGE_GAP = 64 << 10


def use_plain_http(registry: str, listed: Collection[str] = (), *, asked: bool = False, loopback: bool = True) -> bool:
    """The one rule for whether a node speaks plain HTTP to a registry ("host[:port]"):
    when `asked` (--plain-http; a blob pulled so), when the registry is `listed` (the
    node's [fetch] plain_http_hosts), or, unless `loopback` is false, when it is on
    loopback. Else HTTPS. The node's configuration and flags decide, never an image's
    labels (remote layers pass only the configuration)."""
    return asked or registry in listed or (loopback and is_loopback(registry))


def merge_ranges(ranges: Sequence[tuple[int, int]], gap: int = MERGE_GAP) -> list[tuple[int, int]]:
    """Sorted, merged [start, end) spans covering every range (gaps up to `gap` bridged)."""
    spans: list[list[int]] = []
    for start, end in sorted(ranges):
        if spans and start <= spans[-1][1] + gap:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([start, end])
    return [(a, b) for a, b in spans]


def slice_spans(spans: list[tuple[int, int]], datas: list[bytes], ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    out = []
    for start, end in ranges:
        for (a, b), data in zip(spans, datas):
            if a <= start and end <= b:
                out.append(data[start - a : end - a])
                break
    return out


class OriginSource(Source):
    """Reads ranges of blobs from the registry that holds them.

    Plain HTTP or HTTPS by use_plain_http: the blob's plain_http, `plain_http_hosts`, and
    loopback registries unless `plain_http_loopback` is false.
    """

    name = "origin"

    def __init__(self, plain_http_hosts: Sequence[str] = (), plain_http_loopback: bool = True,
                 read_timeout: float | None = None):
        """`read_timeout`: the registry client's per-request timeout (its default when
        None); a chain with a deadline passes its deadline, so a call it gave up on ends
        soon after."""
        self._read_timeout = read_timeout
        self._plain_hosts = set(plain_http_hosts)
        self._plain_loopback = plain_http_loopback
        self._local = threading.local()  # one client per thread: sessions are not shared

    def _plain(self, blob: BlobRef) -> bool:
        return use_plain_http(blob.registry, self._plain_hosts, asked=blob.plain_http, loopback=self._plain_loopback)

    def _client(self, blob: BlobRef) -> RegistrySource:
        clients = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        key = (blob.registry, blob.repository, self._plain(blob))
        client = clients.get(key)
        if client is None:
            ref = DockerRef(blob.registry, blob.repository, digest=blob.digest)
            extra = {} if self._read_timeout is None else {"read_timeout": self._read_timeout}
            client = clients[key] = RegistrySource(ref, plain_http=key[2], **extra)
        return client

    def health_key(self, blob: BlobRef) -> str:
        return blob.registry  # one registry hanging says nothing of the others

    def read_ranges(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        spans = merge_ranges(ranges)
        client = self._client(blob)
        datas = [client.read_range(blob.digest, a, b) for a, b in spans]
        return slice_spans(spans, datas, ranges)
