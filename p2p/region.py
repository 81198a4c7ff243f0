"""The swarm service on a region cache: what `shoal region` mounts, and a process that
runs both for the swarm tests and benchmark.

    from p2p.region import mount_on_region
    mount_on_region(region_cache.app, region_cache.backend, folder)   # before the app starts

adds the tracker and metadata routes under /p2p (p2p/tracker/server.py). Metadata is
made from the region backend's copy of a blob (verified when the region filled it); a
request for a blob the region does not have yet starts a fill through the region's own
blob route (a one-byte read of its end, with the requester's credentials and repository,
so the region's access check applies) and answers 404 + Retry-After meanwhile.

    python -m p2p.region --listen HOST:PORT --origin URL --store DIR

runs cache.region's RegionCache with the service mounted and prints `ready <port>`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

import aiohttp
from aiohttp import web

from p2p.tracker.peers import PeerTable
from p2p.tracker.server import BackendTorrents, mount

log = logging.getLogger("shoal.tracker")


async def fill_through(base_url: str | None, digest: str, request: web.Request) -> None:
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
            session.get(url, headers=headers) as resp:
        await resp.read()
        if resp.status not in (200, 206):
            log.info("fill of %s for its torrent: HTTP %d", digest, resp.status)


def mount_on_region(app: web.Application, backend, folder: str, *, piece_size: int | None = None,
                    interval: int = 60, announce_url: str | None = None, self_url: str | None = None,
                    authorize=None) -> web.Application:
    """Mount the swarm service (tracker + metadata from `backend`) on the region's app.

    self_url: how the region reaches itself (for fills); default: the request's origin.
    authorize(digest, request): the region's access check for metadata (see make_app).
    """
    torrents = BackendTorrents(folder, backend, piece_size,
                               fill=lambda digest, request: fill_through(self_url, digest, request))
    return mount(app, torrents=torrents, table=PeerTable(interval=interval), announce_url=announce_url,
                 authorize=authorize)


async def _serve(args: argparse.Namespace) -> int:
    from cache.region import backends
    from cache.region.config import load_config
    from cache.region.server import RegionCache

    config = load_config(None, listen=args.listen, origin=args.origin, store=args.store)
    config.swarm = False  # mounted below with this lab's piece size and announce interval
    backend = backends.create(config.backend, **config.backend_options())
    cache = RegionCache(config, backend)
    host, port = config.listen_address
    mount_on_region(cache.app, backend, os.path.join(args.store, "torrents"), piece_size=args.piece_size,
                    interval=args.interval, self_url=f"http://{host}:{port}")
    runner = web.AppRunner(cache.app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"ready {port}", flush=True)
    await stop.wait()
    await runner.cleanup()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="p2p.region", description="region cache + swarm service (tests, bench)")
    p.add_argument("--listen", required=True)
    p.add_argument("--origin", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--piece-size", type=int, default=None)
    p.add_argument("--interval", type=int, default=60, help="tracker announce interval (s)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s region %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return asyncio.run(_serve(args))


if __name__ == "__main__":
    sys.exit(main())
