"""The region's swarm service: tracker and torrent metadata, as an aiohttp sub-application.

Mount it under PREFIX ("/p2p") in the region's application (or run it alone):

    app.add_subapp(PREFIX, make_app(torrents=BackendTorrents(folder, backend)))

Routes (relative to the mount point):

- `GET /v1/torrents/<digest>[?repo=NAME&ns=REGISTRY]`: the blob's .torrent file
  (application/x-bittorrent; see p2p/metainfo.py), its announce URL pointing back at
  this tracker as the client reached it (or `announce_url`). 404 while the region does
  not have the blob verified (with Retry-After when a fill was started); the metadata
  is made once per blob, from verified bytes only, in a worker thread, and kept.
- `GET /v1/announce`: HTTP tracker (BEP 3) with compact peer lists (BEP 23, IPv6 in
  `peers6` as BEP 7); `compact=0` gets the dictionary model. Failures are bencoded
  `failure reason` answers with status 200, as clients expect. A peer's address is the
  address its request came from (an `ip` parameter is ignored unless trust_ip_param),
  so one node cannot point a swarm at someone else.
- `GET /v1/scrape?info_hash=...`: BEP 48 counts.
- `GET /v1/rank?info_hash=...[&port=P]`: JSON {"rank", "of", "ttl"}: this downloader's
  rank among the nodes downloading the blob whole (see peers.py); asked again within
  `ttl` seconds to stay counted. Lets nodes split the first fetch of a blob from the
  region without seeing each other. The address is the request's; the port must be one
  that address announced for the torrent (400 otherwise), so ranks count real peers.
- `POST /v1/certs/<digest>?repo=NAME&ns=REGISTRY` (body: a PEM public key): a peer
  certificate for the blob's SSL torrent, signed by the region's swarm CA, named for the
  torrent, valid `ttl` seconds: only for a client the origin lets read the repository
  (authorize, as for metadata). JSON {"cert", "ttl"}.
- `GET /v1/status`: JSON counters (swarms, peers, announces, torrents made/served).

Every route needs the region's node token (header TOKEN_HEADER) when one is set:
401 without it. The token says "a node of this region", nothing about repositories:
metadata is also checked against the origin per client (authorize).

The tracker's table is soft state (p2p/tracker/peers.py): a restart empties it and
it refills within one announce interval; nodes never depend on it to read.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol
from urllib.parse import unquote_to_bytes

import aiohttp
from aiohttp import web

from builder.pieces import Pieces
from cache.region.tls import NodeTokens
from p2p import bencode, metainfo
from p2p.tracker import PREFIX, TOKEN_HEADER
from p2p.tracker.peers import PeerTable
from shoal.digest import hex_of, is_digest
from shoal.errors import DigestMismatch, ShoalError
from shoal.metrics import Metric

log = logging.getLogger("shoal.tracker")

TORRENT_TYPE = "application/x-bittorrent"
DEFAULT_NUMWANT = 50
UNPUBLISHED_RETRY = 30.0  # seconds a blob without published piece hashes is not asked about again

Authorize = Callable[[str, web.Request], Awaitable[None]]
_EXPIRY_KEY = web.AppKey("swarm_expiry", asyncio.Future)


class TorrentSource(Protocol):
    """Where the metadata service gets a blob's info dict.

    info() returns the bencoded info dict of `digest`, made from bytes verified against
    the digest, or None when the blob is not (yet) available; it may raise
    web.HTTPException (e.g. 403 for a client not allowed to read the blob's repository:
    metadata names a blob as well as its bytes do). `retry_after` is what a 404 asks the
    client to wait (seconds; 0: no Retry-After), when a fill is under way. close() releases
    the source's threads when the service stops.
    """

    retry_after: int

    async def info(self, digest: str, request: web.Request) -> bytes | None: ...

    def statistics(self) -> dict: ...

    def close(self) -> None: ...


class TorrentCache:
    """Info dicts on disk (`<folder>/<hex>.info`), each made once however many ask."""

    def __init__(self, folder: str | os.PathLike, piece_size: int | None = None, threads: int = 2,
                 ssl_cert: bytes = b"") -> None:
        self.folder = os.fspath(folder)
        os.makedirs(self.folder, exist_ok=True)
        self.piece_size = piece_size
        self.ssl_cert = ssl_cert  # made into every info dict: SSL torrents (metainfo)
        # info dicts made under another swarm CA (or none) are not this region's: other names
        self._suffix = f".{hashlib.sha256(ssl_cert).hexdigest()[:12]}.info" if ssl_cert else ".info"
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="torrent-make")
        self._making: dict[str, asyncio.Future] = {}
        self.stats = {"made": 0, "cached": 0, "failed": 0}

    def path(self, digest: str) -> str:
        return os.path.join(self.folder, hex_of(digest) + self._suffix)

    def load(self, digest: str) -> bytes | None:
        try:
            with open(self.path(digest), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    def store(self, digest: str, info: bytes, published: bool = False) -> None:
        """Keep `info`; `published`: made from published piece hashes, not from the blob
        (a marker beside it until the blob has been checked against them)."""
        marker = self.path(digest) + ".published"
        if published:
            with open(marker, "wb"):
                pass
        tmp = f"{self.path(digest)}.{os.getpid()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(info)
        os.replace(tmp, self.path(digest))
        if not published:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(marker)

    def unchecked(self, digest: str) -> bool:
        """The kept info dict came from published piece hashes not checked against the blob yet."""
        return os.path.exists(self.path(digest) + ".published")

    async def get(self, digest: str, make: Callable[[], bytes]) -> bytes:
        """The cached info dict, or make() it (in a thread; one run per digest)."""
        info = self.load(digest)
        if info is not None:
            self.stats["cached"] += 1
            return info
        fut = self._making.get(digest)
        if fut is None:
            loop = asyncio.get_running_loop()
            fut = self._making[digest] = loop.run_in_executor(self._pool, self._make, digest, make)
            fut.add_done_callback(lambda _: self._making.pop(digest, None))
        return await asyncio.shield(fut)

    def _make(self, digest: str, make: Callable[[], bytes]) -> bytes:
        start = time.monotonic()
        try:
            info = make()
            metainfo.parse_info(info, digest)
        except Exception:
            self.stats["failed"] += 1
            raise
        self.store(digest, info)
        self.stats["made"] += 1
        log.info("torrent of %s made in %.1fs", digest, time.monotonic() - start)
        return info

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class FileTorrents:
    """Metadata for blobs kept as local files: `blob_path(digest)` returns the path of
    a file already verified against the digest, or None. (The file is hashed again
    while the torrent is made, so a damaged file yields no metadata.)"""

    def __init__(self, folder: str | os.PathLike, blob_path: Callable[[str], str | None],
                 piece_size: int | None = None, ssl_cert: bytes = b"") -> None:
        self.cache = TorrentCache(folder, piece_size, ssl_cert=ssl_cert)
        self._blob_path = blob_path
        self.retry_after = 0  # nothing is filled: a missing blob stays missing

    async def info(self, digest: str, request: web.Request) -> bytes | None:
        path = self._blob_path(digest)
        if path is None:
            return self.cache.load(digest)
        piece = self.cache.piece_size

        def make() -> bytes:
            with open(path, "rb") as fh:
                return metainfo.make_info(fh, os.fstat(fh.fileno()).st_size, digest, piece, self.cache.ssl_cert)

        return await self.cache.get(digest, make)

    def statistics(self) -> dict:
        return dict(self.cache.stats)

    def close(self) -> None:
        self.cache.close()


class BackendTorrents:
    """Metadata for blobs in a region backend (cache.region.backends.Backend: contains,
    size, stream). `fill(digest, request)`, if given, is started when the backend does
    not have the blob: it should bring the blob in through the region's read-through
    path (with the request's credentials and its repo/ns parameters); meanwhile the
    answer is 404 with Retry-After, unless `published(digest, request)` finds the
    blob's piece hashes published beside its image (builder/pieces.py, with the
    request's credentials): then the info dict is made from them at once, so the nodes
    have a swarm for a blob the region has not filled (a profile preheat holds a cold
    blob to the ranges its nodes read). Once the backend has the blob, such an info
    dict is checked against it (the next time it is asked for) and replaced, logged,
    if the published hashes lied."""

    def __init__(self, folder: str | os.PathLike, backend, piece_size: int | None = None,
                 fill: Callable[[str, web.Request], Awaitable[object]] | None = None, retry_after: int = 2,
                 ssl_cert: bytes = b"",
                 published: Callable[[str, web.Request], Awaitable[Pieces | None]] | None = None) -> None:
        self.cache = TorrentCache(folder, piece_size, ssl_cert=ssl_cert)
        self.backend = backend
        self._fill = fill
        self._fills: dict[str, asyncio.Task] = {}
        self._published = published
        self._asking: dict[str, asyncio.Future] = {}
        self._unpublished: dict[str, float] = {}  # digest -> until when it is not asked again
        self._checking: set[str] = set()
        self._check_after: dict[str, float] = {}  # digest -> when a check that failed may run again
        self.retry_after = retry_after
        self.cache.stats.update(published=0, published_missing=0, published_lied=0)

    async def info(self, digest: str, request: web.Request) -> bytes | None:
        info = self.cache.load(digest)
        loop = asyncio.get_running_loop()
        if info is not None:
            if self.cache.unchecked(digest) and digest not in self._checking \
                    and time.monotonic() >= self._check_after.get(digest, 0.0) \
                    and await loop.run_in_executor(None, self.backend.contains, digest):
                self._checking.add(digest)
                check = loop.run_in_executor(self.cache._pool, self._check_published, digest, info)
                check.add_done_callback(lambda _: self._checking.discard(digest))
            return info
        if not await loop.run_in_executor(None, self.backend.contains, digest):
            if self._fill is not None and digest not in self._fills:
                task = asyncio.ensure_future(self._fill(digest, request))
                self._fills[digest] = task
                task.add_done_callback(lambda t: (self._fills.pop(digest, None), t.cancelled() or t.exception()))
            return await self._from_published(digest, request)
        return await self.cache.get(digest, lambda: self._make(digest))

    async def _from_published(self, digest: str, request: web.Request) -> bytes | None:
        """The info dict from the blob's published piece hashes (kept), or None: none
        published (not asked again for UNPUBLISHED_RETRY seconds), or unreadable (logged)."""
        if self._published is None or time.monotonic() < self._unpublished.get(digest, 0.0):
            return None
        fut = self._asking.get(digest)
        if fut is None:
            fut = self._asking[digest] = asyncio.ensure_future(self._read_published(digest, request))
            fut.add_done_callback(lambda _: self._asking.pop(digest, None))
        return await asyncio.shield(fut)

    async def _read_published(self, digest: str, request: web.Request) -> bytes | None:
        assert self._published is not None
        try:
            pieces = await self._published(digest, request)
            info = None if pieces is None else metainfo.info_from_pieces(pieces, self.cache.ssl_cert)
            if info is not None:
                metainfo.parse_info(info, digest)
        except (ShoalError, OSError, TimeoutError, aiohttp.ClientError) as e:
            log.warning("published piece hashes of %s unusable (its torrent waits for the whole blob): %s", digest,
                        str(e) or type(e).__name__)
            pieces = info = None
        if info is None:
            self.cache.stats["published_missing"] += 1
            if len(self._unpublished) > 65536:
                self._unpublished.clear()
            self._unpublished[digest] = time.monotonic() + UNPUBLISHED_RETRY
            return None
        assert pieces is not None
        self.cache.store(digest, info, published=True)
        self.cache.stats["published"] += 1
        log.info("torrent of %s made from its published piece hashes (%d pieces of %d KiB)", digest, pieces.count,
                 pieces.piece_length >> 10)
        return info

    def _check_published(self, digest: str, info: bytes) -> None:
        """Hash the blob the backend has now with the published piece length; keep the info
        dict if it matches, else replace it by the one made from the blob (logged)."""
        try:
            plen = metainfo.parse_info(info, digest).piece_length
            made = self._make(digest, plen)
        except (ShoalError, OSError, ValueError) as e:
            # (not again at every request: each check hashes the whole blob)
            self._check_after[digest] = time.monotonic() + UNPUBLISHED_RETRY
            log.warning("torrent of %s: cannot check its published piece hashes against the blob (again in %.0fs): %s",
                        digest, UNPUBLISHED_RETRY, e)
            return
        if made != info:
            self.cache.stats["published_lied"] += 1
            log.error("torrent of %s: the published piece hashes do not match the blob; replaced by the blob's own "
                      "(nodes that took the old one have no swarm for it)", digest)
        self.cache.store(digest, made)

    def _make(self, digest: str, piece_size: int | None = None) -> bytes:
        size = self.backend.size(digest)
        builder = metainfo.InfoBuilder(size, piece_size or self.cache.piece_size)
        stream = self.backend.stream(digest, 0, size)
        try:
            for block in stream:
                builder.update(block)
        finally:
            stream.close()
        return builder.finish(digest, self.cache.ssl_cert)[1]

    def statistics(self) -> dict:
        return {**self.cache.stats, "fills_running": len(self._fills)}

    def close(self) -> None:
        for task in self._fills.values():
            task.cancel()
        self.cache.close()


# --- HTTP ----------------------------------------------------------------------------


def parse_query(raw: str) -> dict[str, bytes]:
    """A query string with binary values (info_hash, peer_id are percent-encoded bytes)."""
    out: dict[str, bytes] = {}
    for part in raw.split("&"):
        if not part:
            continue
        key, _, value = part.partition("=")
        out.setdefault(unquote_to_bytes(key).decode("latin-1"), unquote_to_bytes(value))
    return out


def _failure(reason: str) -> web.Response:
    return web.Response(body=bencode.encode({"failure reason": reason}), content_type="text/plain")


def _int_param(q: dict[str, bytes], key: str, default: int | None = None) -> int:
    raw = q.get(key)
    if raw is None:
        if default is None:
            raise ValueError(f"missing {key}")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{key} is not a number") from None


class SwarmService:
    """The handlers; make_app() wires them into an application. Also what the region's
    /-/status and /-/metrics show of it (cache.region.server.Extension: name,
    statistics(), metrics())."""

    name = "swarm"  # its key in the region's /-/status

    def __init__(self, torrents: TorrentSource | None, table: PeerTable, announce_url: str | None,
                 trust_ip_param: bool, authorize: Authorize | None = None, peer_ca=None) -> None:
        self.torrents = torrents
        self.peer_ca = peer_ca
        self.authorize = authorize
        self.table = table
        self.announce_url = announce_url
        self.trust_ip_param = trust_ip_param
        self.stats = {"torrents_served": 0, "torrents_missing": 0, "announce_failures": 0, "unauthorized": 0,
                      "certs_issued": 0, "certs_refused": 0}

    def announce_url_for(self, request: web.Request) -> str:
        if self.announce_url:
            return self.announce_url
        prefix = request.path.rsplit("/v1/", 1)[0]  # where this application is mounted
        return f"{request.url.origin()}{prefix}/v1/announce"

    async def torrent(self, request: web.Request) -> web.Response:
        digest = request.match_info["digest"]
        if not is_digest(digest):
            raise web.HTTPBadRequest(text=f"malformed digest {digest[:80]!r}\n")
        if self.torrents is None:
            raise web.HTTPNotFound(text="no metadata service here\n")
        if self.authorize is not None:
            await self.authorize(digest, request)  # raises web.HTTPException to refuse
        try:
            info = await self.torrents.info(digest, request)
        except (DigestMismatch, ShoalError, OSError) as exc:
            log.error("torrent of %s: %s", digest, exc)
            raise web.HTTPBadGateway(text=f"cannot make the torrent of {digest}: {exc}\n") from None
        if info is None:
            self.stats["torrents_missing"] += 1
            retry = self.torrents.retry_after
            headers = {"Retry-After": str(retry)} if retry else None
            raise web.HTTPNotFound(text=f"{digest}: not in the region (yet)\n", headers=headers)
        self.stats["torrents_served"] += 1
        return web.Response(body=metainfo.torrent_file(info, self.announce_url_for(request)),
                            content_type=TORRENT_TYPE)

    async def certificate(self, request: web.Request) -> web.Response:
        """POST /v1/certs/<digest>?repo=NAME&ns=REGISTRY, body: the node's peer public key
        (PEM). A peer certificate for the blob's SSL torrent, only for a client the origin
        lets read the repository (the same check as metadata: authorize)."""
        digest = request.match_info["digest"]
        if not is_digest(digest):
            raise web.HTTPBadRequest(text=f"malformed digest {digest[:80]!r}\n")
        if self.peer_ca is None:
            raise web.HTTPNotFound(text="this region's torrents are not SSL torrents\n")
        try:
            if self.authorize is not None:
                await self.authorize(digest, request)
        except web.HTTPException:
            self.stats["certs_refused"] += 1
            raise
        body = await request.read()
        try:
            cert, ttl = self.peer_ca.issue(body, metainfo.blob_name(digest), request.remote or "")
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"not a PEM public key: {exc}\n") from None
        self.stats["certs_issued"] += 1
        log.info("peer certificate for %s issued to %s (%s)", digest, request.remote, request.query.get("repo", ""))
        return web.json_response({"cert": cert.decode("ascii"), "ttl": ttl})

    def _peer_ip(self, request: web.Request, q: dict[str, bytes]) -> str:
        if self.trust_ip_param and q.get("ip"):
            return str(ipaddress.ip_address(q["ip"].decode("ascii")))
        remote = request.remote or ""
        addr = ipaddress.ip_address(remote.split("%", 1)[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
            addr = addr.ipv4_mapped
        return str(addr)

    async def announce(self, request: web.Request) -> web.Response:
        q = parse_query(request.query_string)
        try:
            info_hash = q.get("info_hash", b"")
            if len(info_hash) != 20:
                raise ValueError("info_hash must be 20 bytes")
            port = _int_param(q, "port")
            left = _int_param(q, "left", 1)
            numwant = _int_param(q, "numwant", DEFAULT_NUMWANT)
            event = q.get("event", b"").decode("ascii", "replace")
            ip = self._peer_ip(request, q)
            answer = self.table.announce(info_hash, ip, port, left, event, numwant, time.monotonic())
        except ValueError as exc:
            self.stats["announce_failures"] += 1
            return _failure(str(exc))
        body: dict[str, object] = {
            "interval": self.table.interval,
            "min interval": self.table.min_interval,
            "complete": answer.complete,
            "incomplete": answer.incomplete,
        }
        if q.get("compact", b"1") != b"0":
            v4: list[bytes] = []
            v6: list[bytes] = []
            for peer_ip, peer_port in answer.peers:
                packed = socket.inet_pton(socket.AF_INET6 if ":" in peer_ip else socket.AF_INET, peer_ip)
                (v6 if len(packed) == 16 else v4).append(packed + peer_port.to_bytes(2, "big"))
            body["peers"] = b"".join(v4)
            if v6:
                body["peers6"] = b"".join(v6)
        else:
            body["peers"] = [{"ip": peer_ip, "port": peer_port} for peer_ip, peer_port in answer.peers]
        return web.Response(body=bencode.encode(body), content_type="text/plain")

    async def rank(self, request: web.Request) -> web.Response:
        q = parse_query(request.query_string)
        try:
            info_hash = q.get("info_hash", b"")
            port = _int_param(q, "port") if "port" in q else None  # a hint: must be an announced one
            rank, of = self.table.rank(info_hash, self._peer_ip(request, q), port, time.monotonic())
        except ValueError as exc:
            raise web.HTTPBadRequest(text=f"{exc}\n") from None
        return web.json_response({"rank": rank, "of": of, "ttl": self.table.rank_ttl})

    async def scrape(self, request: web.Request) -> web.Response:
        files = {}
        for part in request.query_string.split("&"):
            key, _, value = part.partition("=")
            if key == "info_hash":
                info_hash = unquote_to_bytes(value)
                complete, incomplete, downloaded = self.table.scrape(info_hash)
                files[info_hash] = {"complete": complete, "incomplete": incomplete, "downloaded": downloaded}
        return web.Response(body=bencode.encode({"files": files}), content_type="text/plain")

    def statistics(self) -> dict:
        out = {**self.table.statistics(), **self.stats}
        if self.torrents is not None:
            out["torrents"] = self.torrents.statistics()
        return out

    def metrics(self) -> list[Metric]:
        """The service's lines in the region's /-/metrics (shoal/metrics.py)."""
        swarm = self.statistics()
        torrents = swarm.get("torrents") or {}
        c, g = "counter", "gauge"
        return [
            ("shoal_region_tracker_torrents", g, "Blobs with at least one peer.", swarm["swarms"]),
            ("shoal_region_tracker_peers", g, "Peers the tracker knows, over all blobs.", swarm["peers"]),
            ("shoal_region_tracker_downloaders", g, "Peers downloading a blob whole (ranked).", swarm["downloading"]),
            ("shoal_region_tracker_announces_total", c, "Tracker announces.", swarm["announces"]),
            ("shoal_region_tracker_ranked_torrents", g, "Blobs with ranked downloaders.", swarm["ranked_swarms"]),
            ("shoal_region_tracker_evicted_total", c, "Swarms forgotten to keep the table bounded.",
             swarm["swarms_evicted"]),
            ("shoal_region_tracker_refused_total", c, "Announces and rank requests refused (bounds, unknown peer).",
             swarm["refused"]),
            ("shoal_region_swarm_unauthorized_total", c, "Swarm service calls without the node token.",
             swarm["unauthorized"]),
            ("shoal_region_peer_certs_total", c, "Peer certificates by outcome.",
             [({"result": "issued"}, swarm["certs_issued"]), ({"result": "refused"}, swarm["certs_refused"])]),
            ("shoal_region_torrents_served_total", c, "Torrent metadata answers.", swarm["torrents_served"]),
            ("shoal_region_torrents_made_total", c, "Torrent metadata made from a verified blob.", torrents.get("made")),
        ]

    async def status(self, request: web.Request) -> web.Response:
        return web.json_response(self.statistics())


SERVICE_KEY = web.AppKey("swarm_service", SwarmService)  # the sub-application's handlers


def make_app(torrents: TorrentSource | None = None, table: PeerTable | None = None, *,
             announce_url: str | None = None, trust_ip_param: bool = False,
             authorize: Authorize | None = None, node_token: str = "", peer_ca=None,
             node_tokens: NodeTokens | None = None) -> web.Application:
    """The swarm service as an application to mount at PREFIX (see the module doc).

    node_token: the secret every request must carry in TOKEN_HEADER ("" = none asked);
    node_tokens: instead, who may call (a node's own token or the shared one: NodeTokens).
    peer_ca: the swarm CA (cache.region.tls.PeerCA) behind POST /v1/certs/<digest>; the
    torrents must then carry its certificate (their ssl_cert).

    announce_url: the tracker URL put in served torrents; default: this service's
    announce route as the requesting client addressed it.
    authorize(digest, request): called before a torrent is served; raises an
    web.HTTPException (401/403) for a client that may not read the blob -- the region
    passes its own access check (request.query "repo" and "ns" name the repository).
    """
    service = SwarmService(torrents, table or PeerTable(), announce_url, trust_ip_param, authorize, peer_ca)
    tokens = node_tokens if node_tokens is not None else NodeTokens(node_token)

    @web.middleware
    async def require_token(request: web.Request, handler):
        if tokens.identify(request.headers.get(TOKEN_HEADER, "")) is None:
            service.stats["unauthorized"] += 1
            raise web.HTTPUnauthorized(text="the region's swarm service needs its node token "
                                            "([fetch] region_token_file on the node)\n")
        return await handler(request)

    app = web.Application(middlewares=[require_token])
    app[SERVICE_KEY] = service
    app.router.add_get("/v1/torrents/{digest}", service.torrent)
    app.router.add_post("/v1/certs/{digest}", service.certificate)
    app.router.add_get("/v1/announce", service.announce)
    app.router.add_get("/v1/scrape", service.scrape)
    app.router.add_get("/v1/rank", service.rank)
    app.router.add_get("/v1/status", service.status)

    async def expire_forever(app: web.Application) -> None:
        while True:
            await asyncio.sleep(service.table.interval)
            service.table.expire(time.monotonic())

    async def start(app: web.Application) -> None:
        app[_EXPIRY_KEY] = asyncio.ensure_future(expire_forever(app))

    async def stop(app: web.Application) -> None:
        app[_EXPIRY_KEY].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await app[_EXPIRY_KEY]
        if torrents is not None:
            torrents.close()

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    return app


def mount(app: web.Application, **kwargs) -> web.Application:
    """Add the swarm service to `app` under PREFIX; returns the sub-application."""
    sub = make_app(**kwargs)
    app.add_subapp(PREFIX, sub)
    return sub
