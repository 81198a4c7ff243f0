"""The region as `shoal region` serves it: the region cache with the swarm service on it.

    running = await start_region(config, backend, host, port, tls=tls, node_token=token)

is cache.region.server's RegionCache plus, with `swarm = true` (the default), the
tracker and metadata routes under /p2p (p2p/tracker/server.py) through the cache's one
seam (RegionCache.mount: a sub-application and an Extension for /-/status and
/-/metrics). Metadata is made from the region backend's copy of a blob (verified when
the region filled it); a request for a blob the region does not have yet starts a fill
through the region's own blob route (a one-byte read of its end, with the requester's
credentials and repository, so the region's access check applies) and answers 404 +
Retry-After meanwhile, unless the blob's piece hashes are published beside its image
(`shoal convert`, builder/pieces.py): read through the region's own routes with the
requester's credentials (`pieces_through`), they make the torrent at once.
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path

import aiohttp
from aiohttp import web

from builder.oci.documents import MAX_DOCUMENT_BYTES
from builder.pieces import MAX_PIECES_BYTES, Pieces, pieces_blob, pieces_tag
from cache.region.backends import Backend
from cache.region.config import RegionConfig
from cache.region.server import RegionCache, RunningServer, serve
from cache.region.tls import NodeTokens, PeerCA, client_context
from p2p.tracker import PREFIX
from p2p.tracker.peers import PeerTable
from p2p.tracker.server import SERVICE_KEY, Authorize, BackendTorrents, SwarmService, make_app
from shoal import mediatypes as mt
from shoal.digest import sha256_digest
from shoal.errors import DigestMismatch, FormatError, ShoalError

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


async def pieces_through(base_url: str | None, digest: str, request: web.Request,
                         ssl_context: ssl.SSLContext | None = None) -> Pieces | None:
    """The blob's published piece hashes (builder/pieces.py), read through the region's
    own routes with the client's credentials and repository (the origin decides who may
    read them; the document is cached as any blob), checked; None when none are
    published. Raises ShoalError (or aiohttp's errors) when they cannot be read."""
    repo = request.query.get("repo", "")
    if not repo:
        return None
    ns = request.query.get("ns", "")
    base = base_url or str(request.url.origin())
    query = f"?ns={ns}" if ns else ""
    headers = {"Accept": mt.OCI_MANIFEST}
    if request.headers.get("Authorization"):
        headers["Authorization"] = request.headers["Authorization"]
    what = f"{repo}:{pieces_tag(digest)}"
    timeout = aiohttp.ClientTimeout(total=60, sock_read=30)
    ssl_arg = ssl_context if ssl_context is not None else True
    async with aiohttp.ClientSession(timeout=timeout, trust_env=False) as session:
        async with session.get(f"{base}/v2/{repo}/manifests/{pieces_tag(digest)}{query}", headers=headers,
                               ssl=ssl_arg) as resp:
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise ShoalError(f"{what}: HTTP {resp.status}")
            manifest = await resp.content.read(MAX_DOCUMENT_BYTES + 1)
        desc = pieces_blob(manifest, digest, what)
        if desc.size > MAX_PIECES_BYTES:
            raise FormatError(f"{what}: a document of {desc.size} bytes (at most {MAX_PIECES_BYTES})")
        headers.pop("Accept")
        async with session.get(f"{base}/v2/{repo}/blobs/{desc.digest}{query}", headers=headers, ssl=ssl_arg) as resp:
            if resp.status != 200:
                raise ShoalError(f"{what}: its document {desc.digest}: HTTP {resp.status}")
            data = await resp.content.read(desc.size + 1)
    if len(data) != desc.size or sha256_digest(data) != desc.digest:
        raise DigestMismatch(f"{what}: its document does not match {desc.digest}")
    return Pieces.from_json(data, digest, what=what)


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
                               published=lambda digest, request: pieces_through(self_url, digest, request, self_ssl),
                               ssl_cert=peer_ca.pem if peer_ca is not None else b"")
    return make_app(torrents=torrents, table=PeerTable(interval=interval), announce_url=announce_url,
                    authorize=authorize, node_token=node_token, peer_ca=peer_ca, node_tokens=node_tokens)
