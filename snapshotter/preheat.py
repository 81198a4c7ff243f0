"""The node's side of the region's preheat service: its preheat worker
(prefetch/worker.py) with the node's own warm-up plugged in (snapshotter/warm.py, as
`shoal prefetch --root` runs it), started by `shoal node` when `[fetch] region_url` is set.

    worker = start_worker(root, config)   # None without a region or lazy layers
    ...; worker.stop()

The node registers as `[node] name` (default: the host name) with `[node] address`
(default: the address it reaches the region from) and its version, over the node's link
to its region (`[fetch] region_url`, `region_ca`, and `region_token_file`: the region's node
token, without which the region refuses the node's calls).

A job's image is read again here, by the manifest digest the region resolved, with the
node's own registry credentials and plain-HTTP rule (a job cannot make the node speak
HTTP to a registry); the warm-up and its measure are LocalPrefetch's, with the node's
part of the job (its rank of the job's nodes: it fetches that part of the target first,
the rest mostly from the peers that did; prefetch/warmup.py).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import asdict
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from cache.region.client import RegionLink
from cache.source import BlobRef
from prefetch.worker import Assignment, Cancelled, PreheatWorker, Report, Run
from snapshotter.warm import LocalPrefetch, default_node_name, resolve_image

if TYPE_CHECKING:
    from snapshotter.node import NodeConfig

log = logging.getLogger("shoal.preheat")


def node_runner(root: str, fetch: dict) -> Run:
    """The warm-up the worker runs for an assignment, on the node at `root`."""

    def run(a: Assignment, progress) -> Report:
        from builder.oci.refs import parse_registry_ref

        named = parse_registry_ref(a.image)
        plain_hosts = fetch.get("plain_http_hosts") or []  # (the node's rule: loopback, or these hosts)
        _, plain, manifest, descriptors = resolve_image(f"{named.host}/{named.repository}@{a.manifest}",
                                                        named.host in plain_hosts)
        job = LocalPrefetch(a.image, BlobRef(named.host, named.repository, manifest, None, plain), manifest,
                            descriptors, root, a.mode, fetch, a.part, a.held)

        def measured(w) -> None:
            if not progress(Report("warming", w.warm_bytes, w.target_bytes)):
                raise Cancelled(a.id)

        before = job.peer_bytes()
        job.start()
        state, w, error = job.wait_warm(a.timeout_s, measured)
        after = job.peer_bytes()
        peers = after - before if after is not None and before is not None else None
        return Report(state, w.warm_bytes, w.target_bytes, error or None, peers)

    return run


def local_address(url: str) -> str:
    """The address this host reaches `url`'s host from (no packet is sent)."""
    parsed = urlparse(url)
    try:
        infos = socket.getaddrinfo(parsed.hostname, parsed.port or 443, type=socket.SOCK_DGRAM)
        family, _, _, _, address = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(address)
            return str(s.getsockname()[0])
    except OSError:
        return ""


def start_worker(root: str, config: NodeConfig) -> PreheatWorker | None:
    """The node's preheat worker, started; None when the node has no region or no lazy layers."""
    from importlib.metadata import PackageNotFoundError, version

    fetch = config.fetch
    if not fetch.region_url or not fetch.lazy:
        return None
    data_path = asdict(fetch)
    link = RegionLink.from_config(data_path, with_token=True)
    if not link.token:
        log.warning("[fetch] region_token_file is not set: the region refuses this node's preheat calls")
    try:
        ver = version("shoal")
    except PackageNotFoundError:
        ver = "unknown"
    name = config.node.name or default_node_name()
    worker = PreheatWorker(link, name, config.node.address or local_address(link.url), ver,
                           node_runner(root, data_path))
    worker.start()
    return worker
