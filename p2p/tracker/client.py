"""The node's client of the region's metadata service (server.py): a blob's torrent.

- One request per blob however many threads ask (the others wait for it); the answer is
  checked to name the blob (metainfo.parse_torrent) and kept on disk, so a node restart
  or a region outage does not lose it.
- Fast "no": a 404, a refused or timed-out connection (connect timeout 0.5 s) or a bad
  answer gives None, remembered for a back-off (1 s, doubling to 30 s, or the server's
  Retry-After), so a read never waits on a region that cannot answer.
- The node's registry credentials for the blob's repository go along as Basic auth, as
  for blob reads from the region: metadata of a private blob is as private as its bytes.
"""

from __future__ import annotations

import base64
import logging
import os
import threading
import time
from urllib.parse import quote, urlparse

import requests

from builder.oci.auth import find_credentials
from cache.source import BlobRef
from p2p import metainfo
from p2p.tracker import PREFIX
from shoal.digest import hex_of
from shoal.errors import FormatError, ShoalError

log = logging.getLogger("shoal.swarm")


class MetadataClient:
    def __init__(self, url: str, cache_dir: str | os.PathLike, *, connect_timeout: float = 0.5,
                 read_timeout: float = 10.0, min_retry: float = 1.0, max_retry: float = 30.0) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"metadata URL {url!r}: want http://HOST:PORT")
        self.url = f"{parsed.scheme}://{parsed.netloc}{parsed.path.rstrip('/')}"
        self.cache_dir = os.fspath(cache_dir)
        os.makedirs(self.cache_dir, exist_ok=True)
        self._timeouts = (connect_timeout, read_timeout)
        self._min_retry, self._max_retry = min_retry, max_retry
        self._lock = threading.Lock()
        self._inflight: dict[str, threading.Lock] = {}
        self._failed: dict[str, tuple[float, float]] = {}  # digest -> (retry at, back-off)
        self._local = threading.local()
        self.stats = {"fetched": 0, "from_disk": 0, "missing": 0, "errors": 0}

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
            session = self._local.session = requests.Session()
            session.trust_env = False  # the region is on the node's network
        return session

    def _fail(self, digest: str, retry_after: float | None = None) -> None:
        with self._lock:
            previous = self._failed.get(digest, (0.0, self._min_retry / 2))[1]
            backoff = min(self._max_retry, max(self._min_retry, previous * 2))
            if retry_after is not None:
                backoff = min(self._max_retry, max(self._min_retry, retry_after))
            self._failed[digest] = (time.monotonic() + backoff, backoff)

    def _fetch(self, blob: BlobRef):
        digest = blob.digest
        url = f"{self.url}{PREFIX}/v1/torrents/{digest}?repo={quote(blob.repository, safe='')}" \
              f"&ns={quote(blob.registry, safe='')}"
        headers = {}
        try:
            creds = find_credentials(blob.registry, blob.repository)
        except ShoalError:
            creds = None
        if creds is not None:
            raw = f"{creds.username}:{creds.password}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(raw).decode("ascii")
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
        self.stats["fetched"] += 1
        return meta, announce

    def forget(self, digest: str) -> None:
        """Drop the cached metadata (it proved wrong: the blob did not hash to its digest)."""
        try:
            os.unlink(self._path(digest))
        except FileNotFoundError:
            pass
        self._fail(digest)

    def statistics(self) -> dict:
        return dict(self.stats)
