"""The node's clients of the region's swarm service (server.py), every call it makes:
a blob's torrent and peer certificate (MetadataClient), the tracker relay libtorrent
announces and scrapes through (TrackerRelay), and the downloader rank the bulk path
asks for (RankClient, through the relay).

- One request per blob however many threads ask (the others wait for it); the answer is
  checked to name the blob (metainfo.parse_torrent) and kept on disk, so a node restart
  or a region outage does not lose it.
- Fast "no": a 404, a refused or timed-out connection (connect timeout 0.5 s) or a bad
  answer gives None, remembered for a back-off (1 s, doubling to 30 s, or the server's
  Retry-After), so a read never waits on a region that cannot answer. A 404 with
  Retry-After means "not yet": the region has started filling the blob and makes the
  metadata once the fill is verified; `waiting()` tells a caller that may wait for it
  (a whole blob to unpack, p2p/control.py `fetch_blob`) from one that should move on.
- The node's registry credentials for the blob's repository go along as Basic auth, as
  for blob reads from the region (and by the same rule: HTTPS only, see
  cache.region.client.RegionLink): metadata of a private blob is as private as its
  bytes. The region's node token goes along too (TOKEN_HEADER).
"""

from __future__ import annotations

import http.server
import json
import logging
import os
import secrets
import socket
import threading
import time
import urllib.request
from urllib.parse import quote, urlencode

import requests

from cache.region.client import RegionLink
from cache.source import BlobRef
from p2p import metainfo
from p2p.tracker import PREFIX, TOKEN_HEADER
from shoal.digest import hex_of
from shoal.errors import FormatError

log = logging.getLogger("shoal.swarm")


class MetadataClient:
    def __init__(self, url: str | RegionLink, cache_dir: str | os.PathLike, *, connect_timeout: float = 0.5,
                 read_timeout: float = 10.0, min_retry: float = 1.0, max_retry: float = 30.0) -> None:
        self.link = RegionLink.of(url)
        self.url = self.link.url + self.link.path
        self.cache_dir = os.fspath(cache_dir)
        os.makedirs(self.cache_dir, exist_ok=True)
        self._timeouts = (connect_timeout, read_timeout)
        self._min_retry, self._max_retry = min_retry, max_retry
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Lock] = {}
        self._failed: dict[str, tuple[float, float]] = {}  # digest -> (retry at, back-off)
        self._pending: set[str] = set()  # digests whose last answer was 404 with Retry-After (a fill)
        self._local = threading.local()
        self.stats = {"fetched": 0, "from_disk": 0, "missing": 0, "refused": 0, "errors": 0}

    def _path(self, digest: str) -> str:
        return os.path.join(self.cache_dir, hex_of(digest) + ".torrent")

    def get(self, blob: BlobRef) -> tuple[metainfo.TorrentMeta, str | None] | None:
        """(metadata, announce URL) of the blob, or None (now; ask again later)."""
        digest = blob.digest
        with self._lock:
            failed = self._failed.get(digest)
            if failed and failed[0] > time.monotonic():
                return None
            flight = self._inflight.setdefault(digest, threading.Lock())
        with flight:
            cached = self._load(blob)
            if cached is not None:
                return cached
            with self._lock:
                failed = self._failed.get(digest)
                if failed and failed[0] > time.monotonic():
                    return None  # the thread before us just failed
            return self._fetch(blob)

    def _load(self, blob: BlobRef):
        try:
            with open(self._path(blob.digest), "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            return None
        try:
            out = metainfo.parse_torrent(data, blob.digest, blob.size)
        except FormatError as exc:
            log.warning("%s: dropping cached torrent: %s", blob.digest, exc)
            os.unlink(self._path(blob.digest))
            return None
        self.stats["from_disk"] += 1
        return out

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = self.link.session()
        return session

    def waiting(self, digest: str) -> float | None:
        """Seconds until the region may have the blob's metadata, when its last answer was
        "not yet" (404 with Retry-After: a fill under way); None when it said no otherwise
        (or nothing yet), so waiting would not help."""
        with self._lock:
            if digest not in self._pending:
                return None
            return max(0.0, self._failed.get(digest, (0.0, 0.0))[0] - time.monotonic())

    def _fail(self, digest: str, retry_after: float | None = None) -> None:
        with self._lock:
            if retry_after is None:
                self._pending.discard(digest)
            else:
                self._pending.add(digest)
            previous = self._failed.get(digest, (0.0, self._min_retry / 2))[1]
            backoff = min(self._max_retry, max(self._min_retry, previous * 2))
            if retry_after is not None:
                backoff = min(self._max_retry, max(self._min_retry, retry_after))
            self._failed[digest] = (time.monotonic() + backoff, backoff)

    def _request(self, route: str, blob: BlobRef) -> tuple[str, dict[str, str]]:
        """URL and headers of a per-blob call: the node token, and the node's registry
        credentials for the repository (the region checks them with the origin)."""
        url = f"{self.url}{PREFIX}/v1/{route}/{blob.digest}?repo={quote(blob.repository, safe='')}" \
              f"&ns={quote(blob.registry, safe='')}"
        headers = {TOKEN_HEADER: self.link.token} if self.link.token else {}
        authorization = self.link.authorization(blob.registry, blob.repository)
        if authorization:
            headers["Authorization"] = authorization
        return url, headers

    def _fetch(self, blob: BlobRef):
        digest = blob.digest
        url, headers = self._request("torrents", blob)
        try:
            resp = self._session().get(url, headers=headers, timeout=self._timeouts)
        except requests.RequestException as exc:
            self.stats["errors"] += 1
            log.info("%s: no torrent metadata from %s: %s", digest, self.url, type(exc).__name__)
            self._fail(digest)
            return None
        if resp.status_code == 404:
            self.stats["missing"] += 1
            retry = resp.headers.get("Retry-After", "")
            self._fail(digest, float(retry) if retry.isdigit() else None)
            return None
        if resp.status_code in (401, 403):
            self.stats["refused"] += 1
            log.warning("%s: torrent metadata refused by %s: HTTP %d %s", digest, self.url, resp.status_code,
                        resp.text.strip()[:200])
            self._fail(digest)
            return None
        if resp.status_code != 200:
            self.stats["errors"] += 1
            log.warning("%s: torrent metadata: HTTP %d from %s", digest, resp.status_code, self.url)
            self._fail(digest)
            return None
        try:
            meta, announce = metainfo.parse_torrent(resp.content, digest, blob.size)
        except FormatError as exc:
            self.stats["errors"] += 1
            log.error("%s: bad torrent metadata from %s: %s", digest, self.url, exc)
            self._fail(digest)
            return None
        tmp = f"{self._path(digest)}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(resp.content)
        os.replace(tmp, self._path(digest))
        with self._lock:
            self._failed.pop(digest, None)
            self._pending.discard(digest)
        self.stats["fetched"] += 1
        return meta, announce

    def certificate(self, blob: BlobRef, public_key: bytes) -> tuple[bytes, float] | None:
        """(PEM peer certificate, seconds valid) for the blob's SSL torrent, or None (the
        region refused: this node's registry credentials do not cover the repository,
        or the region cannot be asked); logged."""
        url, headers = self._request("certs", blob)
        try:
            resp = self._session().post(url, data=public_key, headers=headers, timeout=self._timeouts)
        except requests.RequestException as exc:
            self.stats["errors"] += 1
            log.info("%s: no peer certificate from %s: %s", blob.digest, self.url, type(exc).__name__)
            return None
        if resp.status_code != 200:
            self.stats["refused" if resp.status_code in (401, 403) else "errors"] += 1
            log.warning("%s: peer certificate refused by %s: HTTP %d %s", blob.digest, self.url,
                        resp.status_code, resp.text.strip()[:200])
            return None
        try:
            answer = resp.json()
            return answer["cert"].encode("ascii"), float(answer["ttl"])
        except (ValueError, KeyError, AttributeError, TypeError):
            self.stats["errors"] += 1
            log.error("%s: bad peer certificate answer from %s", blob.digest, self.url)
            return None

    def forget(self, digest: str) -> None:
        """Drop the cached metadata (it proved wrong: the blob did not hash to its digest)."""
        try:
            os.unlink(self._path(digest))
        except FileNotFoundError:
            pass
        self._fail(digest)

    def statistics(self) -> dict:
        return dict(self.stats)


class TrackerRelay:
    """libtorrent's way to the region's tracker: a plain-HTTP server on the node's
    loopback that forwards announce, scrape and rank calls to the region over the node's
    RegionLink (HTTPS with the pinned CA, the node token), which libtorrent cannot do
    itself (it has no per-session CA, and no way to add a header).

    url_for(tracker) gives `http://BIND_IP:PORT/announce?relay=<secret>` for the
    region's announce URL `tracker` (libtorrent's SSRF mitigation accepts a loopback
    tracker only at /announce): the random secret is the capability (a local process
    that does not know it gets 404), so the relay lends the node token to no one but
    this process's session. The region sees the relay's connection, i.e. this node's
    address, as the peer's address, as it would libtorrent's own.
    """

    def __init__(self, link: RegionLink, bind_ip: str = "127.0.0.1", source_ip: str = "",
                 timeout: float = 10.0) -> None:
        """bind_ip: where the relay listens: libtorrent's listen address (it binds its
        outgoing connections there, so a relay on 127.0.0.1 would be out of its reach
        when it listens on the node's address); source_ip: the address the relay
        connects to the region from (the address peers reach this node at); "" = the
        route's."""
        self.link = link
        self._source_ip = source_ip
        self.host = bind_ip
        # secret -> the region's tracker base (without /announce); written by the swarm's owner
        # thread (url_for), read by the relay's threads: single dict operations only
        self._routes: dict[str, str] = {}
        self._local = threading.local()
        self._timeout = timeout
        relay = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                relay._handle(self)

            def log_message(self, format: str, *args) -> None:
                log.debug("tracker relay: " + format, *args)

        family = socket.AF_INET6 if ":" in bind_ip else socket.AF_INET

        class Server(http.server.ThreadingHTTPServer):
            address_family = family

        self._server = Server((bind_ip, 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="tracker-relay", daemon=True)
        self._thread.start()

    def url_for(self, tracker: str) -> str:
        """The relay's announce URL for the region's announce URL `tracker`."""
        if not tracker.endswith("/announce"):
            return tracker
        base = tracker[: -len("/announce")]
        secret = next((k for k, known in self._routes.items() if known == base), None)
        if secret is None:
            secret = secrets.token_hex(16)
            self._routes[secret] = base
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/announce?relay={secret}"

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = self.link.session(self._source_ip)
        return session

    def _handle(self, req: http.server.BaseHTTPRequestHandler) -> None:
        path, _, query = req.path.partition("?")
        op = path.strip("/")
        secret = ""
        if query.startswith("relay="):  # ours comes first: libtorrent appends its parameters
            secret, _, query = query[len("relay="):].partition("&")
        base = self._routes.get(secret)
        if base is None or op not in ("announce", "scrape", "rank"):
            self._answer(req, 404, b"not found\n", "text/plain")
            return
        headers = {TOKEN_HEADER: self.link.token} if self.link.token else {}
        try:
            resp = self._session().get(f"{base}/{op}?{query}", headers=headers, timeout=(2.0, self._timeout))
            body, status, ctype = resp.content, resp.status_code, resp.headers.get("Content-Type", "text/plain")
        except requests.RequestException as exc:
            log.info("tracker relay: %s %s: %s", op, base, type(exc).__name__)
            body, status, ctype = f"region tracker unreachable: {type(exc).__name__}\n".encode(), 502, "text/plain"
        if status == 401:
            log.warning("tracker %s refuses this node: %s", base, body.decode("utf-8", "replace").strip()[:200])
        self._answer(req, status, body, ctype)

    @staticmethod
    def _answer(req: http.server.BaseHTTPRequestHandler, status: int, body: bytes, ctype: str) -> None:
        try:
            req.send_response(status)
            req.send_header("Content-Type", ctype)
            req.send_header("Content-Length", str(len(body)))
            req.end_headers()
            req.wfile.write(body)
        except OSError:
            pass  # libtorrent hung up

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def rank_url(tracker: str) -> str | None:
    """The rank route beside a tracker's announce route (.../announce[?query]), or None."""
    path, sep, query = tracker.partition("?")
    if not path.endswith("/announce"):
        return None
    return path[: -len("/announce")] + "/rank" + sep + query


class RankClient:
    """GET <tracker>/rank?info_hash=&port= (server.py): this node's rank among the
    downloaders of a blob. `tracker` is the announce URL libtorrent uses (the relay's,
    TrackerRelay.url_for), so the call goes out as announces do. Blocking (any thread
    but the swarm's owner); a failure is None (logged at debug): the caller decides
    by its own view then."""

    def __init__(self, timeout: float = 0.5) -> None:
        self.timeout = timeout
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # the relay is local

    def rank(self, tracker: str, info_hash: bytes, port: int, what: str = "") -> tuple[int, int] | None:
        """(rank, of) of this node (announced at `port`) among the info hash's downloaders,
        or None: the tracker has no rank route or did not answer. `what` names the blob
        in the log."""
        url = rank_url(tracker)
        if url is None:
            return None
        query = urlencode({"info_hash": info_hash, "port": port})
        try:
            with self._opener.open(f"{url}{'&' if '?' in url else '?'}{query}", timeout=self.timeout) as resp:
                answer = json.loads(resp.read())
            return int(answer["rank"]), int(answer["of"])
        except (OSError, ValueError, KeyError) as exc:
            log.debug("%s: no rank from %s: %s", what, url, exc)
            return None
