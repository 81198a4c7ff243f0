"""The region as `shoal region` serves it: the region cache with the swarm service on it.

    running = await start_region(config, backend, host, port, tls=tls, node_token=token)

is cache.region.server's RegionCache plus, with `swarm = true` (the default), the
tracker and metadata routes under /p2p (p2p/tracker/server.py) through the cache's one
seam (RegionCache.mount: a sub-application and an Extension for /-/status and
/-/metrics). Metadata is made from the region backend's copy of a blob (verified when
the region filled it); a request for a blob the region does not have yet starts a fill
through the region's own blob route (a one-byte read of its end, with the requester's
credentials and repository, so the region's access check applies) and answers 404 +
Retry-After meanwhile.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import aiohttp
from aiohttp import web

from cache.region.backends import Backend
from cache.region.config import RegionConfig
from cache.region.server import RegionCache, RunningServer, serve
from cache.region.tls import NodeTokens, PeerCA, client_context
from p2p.tracker import PREFIX
from p2p.tracker.peers import PeerTable
from p2p.tracker.server import SERVICE_KEY, Authorize, BackendTorrents, SwarmService, make_app

log = logging.getLogger("shoal.tracker")


async def start_region(config: RegionConfig, backend: Backend, host: str, port: int, *, tls=None,
                       node_token: str = "", prefetch_token: str = "") -> RunningServer:
    """The assembled region serving on host:port (0: any free port), over HTTPS with
    `tls` (a cache.region.tls.RegionTLS), else plain HTTP. The backend is closed on stop()."""
    return await serve(make_region(config, backend, tls=tls, node_token=node_token,
                                   prefetch_token=prefetch_token), host, port)


def make_region(config: RegionConfig, backend: Backend, *, tls=None, node_token: str = "",
                prefetch_token: str = "") -> RegionCache:
    """The region cache, with the swarm service mounted when config.swarm, and the
    preheat service (region/preheat.py: the nodes it knows, jobs on them) always;
    prefetch_token: the preheat API's secret (\"\" = none asked: in-process tests only)."""
    from region.preheat import mount_preheat

    cache = RegionCache(config, backend, tls=tls, node_token=node_token)
    if config.swarm:
        mount_swarm(cache)
    mount_preheat(cache, prefetch_token, config.prefetch.node_timeout, config.prefetch.hold_after_job)
    return cache


def mount_swarm(cache: RegionCache) -> SwarmService:
    """Mount the swarm service on the region cache (before it starts): torrents made
    from its backend, metadata and certificates only for clients its access check lets
    read the blob, peer certificates from the region's swarm CA (when cryptography is
    there), its node token on every call."""
    try:
        peer_ca: PeerCA | None = PeerCA(cache.config.state_dir)
    except ImportError:
        peer_ca = None
        log.warning("the cryptography package is missing: the swarm runs without peer certificates "
                    "(any peer that knows a torrent can get its pieces)")
    sub = swarm_app(cache.backend, str(Path(cache.config.store) / "torrents"), self_url=cache.self_url,
                    authorize=cache.authorize, self_ssl=client_context(cache.tls.ca) if cache.tls else None,
                    node_tokens=cache.node_tokens, peer_ca=peer_ca)
    service = sub[SERVICE_KEY]
    cache.mount(PREFIX, sub, service)
    return service


async def fill_through(base_url: str | None, digest: str, request: web.Request,
                       ssl_context: ssl.SSLContext | None = None) -> None:
    """Ask the region's own blob route for the blob's last byte, with the client's
    credentials: the region fills the whole blob from the origin (access checked) and
    answers only once the blob is verified and committed."""
    repo = request.query.get("repo", "")
    if not repo:
        return
    ns = request.query.get("ns", "")
    base = base_url or str(request.url.origin())
    url = f"{base}/v2/{repo}/blobs/{digest}" + (f"?ns={ns}" if ns else "")
    headers = {"Range": "bytes=-1"}
    if request.headers.get("Authorization"):
        headers["Authorization"] = request.headers["Authorization"]
    timeout = aiohttp.ClientTimeout(total=None, sock_read=60)
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session, \
            session.get(url, headers=headers, ssl=ssl_context if ssl_context is not None else True) as resp:
        await resp.read()
        if resp.status not in (200, 206):
            log.info("fill of %s for its torrent: HTTP %d", digest, resp.status)


def swarm_app(backend: Backend, folder: str, *, piece_size: int | None = None, interval: int = 60,
              announce_url: str | None = None, self_url: str | None = None, authorize: Authorize | None = None,
              self_ssl: ssl.SSLContext | None = None, node_token: str = "",
              peer_ca: PeerCA | None = None, node_tokens: NodeTokens | None = None) -> web.Application:
    """The swarm service (tracker + metadata from `backend`) as a sub-application to
    mount at PREFIX.

    self_url: how the region reaches itself (for fills); default: the request's origin.
    self_ssl: the ssl.SSLContext that trusts the region's own certificate (for fills).
    authorize(digest, request): the region's access check for metadata (see make_app).
    node_token: the secret every /p2p/v1 call must carry; node_tokens: instead, who may
    call (see make_app).
    peer_ca: the swarm CA: torrents are then SSL torrents.
    """
    torrents = BackendTorrents(folder, backend, piece_size,
                               fill=lambda digest, request: fill_through(self_url, digest, request, self_ssl),
                               ssl_cert=peer_ca.pem if peer_ca is not None else b"")
    return make_app(torrents=torrents, table=PeerTable(interval=interval), announce_url=announce_url,
                    authorize=authorize, node_token=node_token, peer_ca=peer_ca, node_tokens=node_tokens)
