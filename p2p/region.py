"""The swarm service on a region cache: what `shoal region` mounts.

    from p2p.region import mount_on_region
    mount_on_region(region_cache.app, region_cache.backend, folder)   # before the app starts

adds the tracker and metadata routes under /p2p (p2p/tracker/server.py). Metadata is
made from the region backend's copy of a blob (verified when the region filled it); a
request for a blob the region does not have yet starts a fill through the region's own
blob route (a one-byte read of its end, with the requester's credentials and repository,
so the region's access check applies) and answers 404 + Retry-After meanwhile.
"""

from __future__ import annotations

import logging

import aiohttp
from aiohttp import web

from p2p.tracker.peers import PeerTable
from p2p.tracker.server import BackendTorrents, mount

log = logging.getLogger("shoal.tracker")


async def fill_through(base_url: str | None, digest: str, request: web.Request, ssl_context=None) -> None:
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


def mount_on_region(app: web.Application, backend, folder: str, *, piece_size: int | None = None,
                    interval: int = 60, announce_url: str | None = None, self_url: str | None = None,
                    authorize=None, self_ssl=None, node_token: str = "", peer_ca=None) -> web.Application:
    """Mount the swarm service (tracker + metadata from `backend`) on the region's app.

    self_url: how the region reaches itself (for fills); default: the request's origin.
    self_ssl: the ssl.SSLContext that trusts the region's own certificate (for fills).
    authorize(digest, request): the region's access check for metadata (see make_app).
    node_token: the secret every /p2p/v1 call must carry (see make_app).
    peer_ca: the swarm CA (cache.region.tls.PeerCA): torrents are then SSL torrents.
    """
    torrents = BackendTorrents(folder, backend, piece_size,
                               fill=lambda digest, request: fill_through(self_url, digest, request, self_ssl),
                               ssl_cert=peer_ca.pem if peer_ca is not None else b"")
    return mount(app, torrents=torrents, table=PeerTable(interval=interval), announce_url=announce_url,
                 authorize=authorize, node_token=node_token, peer_ca=peer_ca)
