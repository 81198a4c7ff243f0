"""RegionSource: the node's fetch source for the region cache (client of server.py).

- One HTTP Range request per merged span of the requested ranges (adjacent ranges, and
  gaps up to 64 KiB, are read as one), on a keep-alive session per thread.
- The node's own credentials for the blob's registry (docker config.json, as for the
  origin) are sent as Basic auth -- over HTTPS only (RegionLink): the region forwards
  them to the origin, or uses them in the origin's token dance. To an http:// region
  they are not sent (anonymous reads only, one warning), unless the region is on
  loopback and `[fetch] region_plain_http_credentials = true`.
- NotHere, fast: a 404 (the region does not know the blob or serves another origin),
  a refused or timed-out connection (connect timeout 0.5 s by default). After a
  connection failure the region is skipped (NotHere at once) for `down_for` seconds.
- TransportError for everything else (401/403, 416, 5xx, a cut or short body, a read
  timeout): the region should have served and did not; the chain moves on.
- report_bad(): bytes from the region failed the node's check; the region is asked
  (`POST /-/check/<digest>`, from a thread of its own, never waited for) to hash its
  stored copy again and drop it if it is bad.
"""

from __future__ import annotations

import base64
import logging
import re
import threading
import time
from collections.abc import Sequence
from urllib.parse import quote, urlparse

import requests
import urllib3

from builder.oci.auth import find_credentials
from builder.oci.ranges import ContentRangeError, check_content_range
from builder.oci.registry import is_loopback
from cache.origin import merge_ranges, slice_spans
from cache.region.tls import BACKGROUND_HEADER, TOKEN_HEADER
from cache.source import BACKGROUND, BlobRef, NotHere, Source
from shoal.errors import ShoalError, TransportError

log = logging.getLogger("shoal.fetch")

_CREDENTIALS_TTL = 60.0

log = logging.getLogger("shoal.fetch")


class RegionLink:
    """How a node talks to its region: the URL, the trust, the node token, and whether
    registry credentials may go along. Shared by every client of the region (blob reads,
    torrent metadata, the tracker).

    - https:// (the region's default): the server certificate must chain to `ca` (a
      pinned PEM file, `[fetch] region_ca`) or, with no `ca`, to the system trust store;
      hostnames are checked. Registry credentials are sent.
    - http://: never registry credentials (anonymous reads only; one warning), unless
      the host is loopback and `plain_http_credentials` is set.
    - `token`: the region's node token, sent (header p2p.tracker.TOKEN_HEADER) by the
      swarm's clients; blob reads do not need it.
    """

    def __init__(self, url: str, *, ca: str = "", token: str = "", plain_http_credentials: bool = False) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"region URL {url!r}: want https://HOST:PORT (or http:// with --plain-http)")
        self.url = f"{parsed.scheme}://{parsed.netloc}"
        self.path = parsed.path.rstrip("/")
        self.ca, self.token = ca, token
        self.https = parsed.scheme == "https"
        self._credentials_ok = self.https or (plain_http_credentials and is_loopback(parsed.netloc))
        self._warned = False
        self._lock = threading.Lock()
        self._credentials: dict[tuple[str, str], tuple[float, str | None]] = {}

    @classmethod
    def of(cls, url: str | RegionLink) -> RegionLink:
        return url if isinstance(url, RegionLink) else cls(url)

    @classmethod
    def from_config(cls, config: dict, url: str = "", *, with_token: bool = False) -> RegionLink:
        """From a node's [fetch] keys: region_url, region_ca, region_token_file (read only
        `with_token`: the swarm's clients need it, blob reads do not),
        region_plain_http_credentials."""
        from cache.region.tls import read_token

        token_file = config.get("region_token_file") or ""
        return cls(url or config["region_url"], ca=config.get("region_ca") or "",
                   token=read_token(token_file) if token_file and with_token else "",
                   plain_http_credentials=bool(config.get("region_plain_http_credentials")))

    def session(self, source_ip: str = "") -> requests.Session:
        """A session that trusts what this link trusts; from `source_ip` if given (the
        tracker takes a peer's address from the connection)."""
        session = requests.Session()
        session.trust_env = False  # the region is on the node's network, never behind a proxy
        session.verify = self.ca or True
        if source_ip:
            session.mount(self.url + "/", _SourceAdapter(source_ip))
        return session

    def authorization(self, registry: str, repository: str) -> str | None:
        """The Basic header of the node's credentials for the repository, or None (none
        found, or not to be sent to this region: see the class doc)."""
        key = (registry, repository)
        with self._lock:
            cached = self._credentials.get(key)
        if cached and cached[0] > time.monotonic():
            return cached[1]
        try:
            creds = find_credentials(registry, repository)
        except ShoalError:
            creds = None
        header = None
        if creds is not None and not self._credentials_ok:
            if not self._warned:
                self._warned = True
                log.warning("region %s is plain HTTP: registry credentials are not sent to it (anonymous "
                            "reads only); serve the region over HTTPS (its default)", self.url)
        elif creds is not None:
            raw = f"{creds.username}:{creds.password}".encode()
            header = "Basic " + base64.b64encode(raw).decode("ascii")
        with self._lock:
            self._credentials[key] = (time.monotonic() + _CREDENTIALS_TTL, header)
        return header


class _SourceAdapter(requests.adapters.HTTPAdapter):
    def __init__(self, source_ip: str) -> None:
        self._source = (source_ip, 0)
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = self._source
        return super().init_poolmanager(*args, **kwargs)


BACKGROUND_GAP = 4 << 10  # bytes between two ranges of a background read that one request bridges


class RegionSource(Source):
    """Ranges of blobs from the region cache at `url` (e.g. "https://region:5080", or a
    RegionLink)."""

    name = "region"

    def __init__(self, url: str | RegionLink, *, connect_timeout: float = 0.5, read_timeout: float = 30.0,
                 down_for: float = 5.0, send_credentials: bool = True) -> None:
        self.link = RegionLink.of(url)
        self.url = self.link.url
        self._timeouts = (connect_timeout, read_timeout)
        self._down_for = down_for
        self._down_until = 0.0
        self._send_credentials = send_credentials
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = self.link.session()
            with self._lock:
                self._sessions.append(session)
        return session

    def _authorization(self, blob: BlobRef) -> str | None:
        if not self._send_credentials:
            return None
        return self.link.authorization(blob.registry, blob.repository)

    def read_ranges(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if time.monotonic() < self._down_until:
            raise NotHere(f"region cache {self.url} is down (retrying later)")
        if not ranges:
            return []
        # a background read (a preheat's) bridges small gaps only (the tar headers between
        # one file's chunks and the next's): a region that holds the blob to the ranges
        # asked fetches the gaps from the origin too
        spans = merge_ranges(ranges, gap=BACKGROUND_GAP) if BACKGROUND.get() else merge_ranges(ranges)
        datas = [self._read_span(blob, a, b) for a, b in spans]
        return slice_spans(spans, datas, ranges)

    def describe(self, key: str) -> str:
        return f"region cache {self.url}"

    def report_bad(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> None:
        url = f"{self.url}/-/check/{blob.digest}"
        headers = {TOKEN_HEADER: self.link.token} if self.link.token else {}

        def send() -> None:
            try:
                self._session().post(url, headers=headers, timeout=self._timeouts)
            except requests.RequestException as exc:
                log.debug("region %s: cannot report %s: %s", self.url, blob, exc)

        threading.Thread(target=send, name="region-report", daemon=True).start()

    def _read_span(self, blob: BlobRef, start: int, end: int) -> bytes:
        what = f"region {self.url}: {blob} bytes {start}-{end - 1}"
        url = f"{self.url}/v2/{blob.repository}/blobs/{blob.digest}?ns={quote(blob.registry, safe='')}"
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        authorization = self._authorization(blob)
        if authorization:
            headers["Authorization"] = authorization
        if BACKGROUND.get():
            headers[BACKGROUND_HEADER] = "1"
        try:
            resp = self._session().get(url, headers=headers, timeout=self._timeouts, stream=True)
        except requests.exceptions.SSLError as exc:
            self._down_until = time.monotonic() + self._down_for
            raise TransportError(f"{what}: TLS refused ({_tls_reason(exc)}); "
                                 f"trusting {self.link.ca or 'the system store'}") from None
        except requests.ReadTimeout:
            # no answer at all (a hung region: its TLS handshake, or its headers, never
            # came): skip it for a while, as an unreachable one, so the reads that follow
            # go to the next source at once
            self._down_until = time.monotonic() + self._down_for
            log.warning("region cache %s is unhealthy (no answer in time): skipped for %.0f s", self.url,
                        self._down_for)
            raise TransportError(f"{what}: timed out") from None
        except (requests.ConnectionError, requests.ConnectTimeout) as exc:
            self._down_until = time.monotonic() + self._down_for
            raise NotHere(f"region cache {self.url} unreachable: {type(exc).__name__}") from None
        except requests.RequestException as exc:
            raise TransportError(f"{what}: {exc}") from None
        try:
            if resp.status_code == 404:
                raise NotHere(f"{what}: not in the region cache (HTTP 404)")
            if resp.status_code not in (200, 206):
                raise TransportError(f"{what}: HTTP {resp.status_code} {_message(resp)}".rstrip())
            skip = 0
            if resp.status_code == 206:
                try:
                    check_content_range(resp.headers.get("Content-Range", ""), start)
                except ContentRangeError:
                    header = resp.headers.get("Content-Range")
                    raise TransportError(f"{what}: unexpected Content-Range {header!r}") from None
            else:
                skip = start  # a whole blob (the region ignored the range)
            data = self._read_body(resp, skip, end - start, what)
        finally:
            resp.close()
        if len(data) != end - start:
            raise TransportError(f"{what}: short read ({len(data)} of {end - start} bytes)")
        return data

    @staticmethod
    def _read_body(resp: requests.Response, skip: int, want: int, what: str) -> bytes:
        parts, got = [], 0
        try:
            while skip > 0:
                chunk = resp.raw.read(min(skip, 1 << 20))
                if not chunk:
                    return b""
                skip -= len(chunk)
            while got < want:
                chunk = resp.raw.read(min(want - got, 1 << 20))
                if not chunk:
                    break
                parts.append(chunk)
                got += len(chunk)
        except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransportError(f"{what}: connection lost ({type(exc).__name__})") from None
        return b"".join(parts)

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for s in sessions:
            s.close()


def _message(resp: requests.Response) -> str:
    try:
        doc = resp.json()
        return "; ".join(e.get("message", "") for e in doc.get("errors", []) if isinstance(e, dict))
    except (ValueError, AttributeError):
        return ""


def _tls_reason(exc: BaseException) -> str:
    """The innermost TLS reason ("certificate verify failed: ...") of a requests error."""
    seen = exc
    while (inner := seen.__cause__ or seen.__context__) is not None:
        seen = inner
    text = str(seen)
    m = re.search(r"certificate verify failed: ([^(]*)", str(exc)) or re.search(r"certificate verify failed: ([^(]*)", text)
    return ("certificate verify failed: " + m.group(1).strip()) if m else (text or type(seen).__name__)[:200]
