"""RegionSource: the node's fetch source for the region cache (client of server.py).

- One HTTP Range request per merged span of the requested ranges (adjacent ranges, and
  gaps up to 64 KiB, are read as one), on a keep-alive session per thread.
- The node's own credentials for the blob's registry (docker config.json, as for the
  origin) are sent as Basic auth; the region forwards them to the origin, or uses them
  in the origin's token dance.
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
from cache.origin import merge_ranges, slice_spans
from cache.source import BlobRef, NotHere, Source
from shoal.errors import ShoalError, TransportError

_CREDENTIALS_TTL = 60.0

log = logging.getLogger("shoal.fetch")


class RegionSource(Source):
    """Ranges of blobs from the region cache at `url` (e.g. "http://region:5080")."""

    name = "region"

    def __init__(self, url: str, *, connect_timeout: float = 0.5, read_timeout: float = 30.0,
                 down_for: float = 5.0, send_credentials: bool = True) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"region cache URL {url!r}: want http://HOST:PORT")
        self.url = f"{parsed.scheme}://{parsed.netloc}"
        self._timeouts = (connect_timeout, read_timeout)
        self._down_for = down_for
        self._down_until = 0.0
        self._send_credentials = send_credentials
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()
        self._credentials: dict[tuple[str, str], tuple[float, str | None]] = {}

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.trust_env = False  # the region is on the node's network, never behind a proxy
            with self._lock:
                self._sessions.append(session)
        return session

    def _authorization(self, blob: BlobRef) -> str | None:
        if not self._send_credentials:
            return None
        key = (blob.registry, blob.repository)
        with self._lock:
            cached = self._credentials.get(key)
        if cached and cached[0] > time.monotonic():
            return cached[1]
        try:
            creds = find_credentials(blob.registry, blob.repository)
        except ShoalError:
            creds = None
        header = None
        if creds is not None:
            raw = f"{creds.username}:{creds.password}".encode()
            header = "Basic " + base64.b64encode(raw).decode("ascii")
        with self._lock:
            self._credentials[key] = (time.monotonic() + _CREDENTIALS_TTL, header)
        return header

    def read_ranges(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        if time.monotonic() < self._down_until:
            raise NotHere(f"region cache {self.url} is down (retrying later)")
        if not ranges:
            return []
        spans = merge_ranges(ranges)
        datas = [self._read_span(blob, a, b) for a, b in spans]
        return slice_spans(spans, datas, ranges)

    def describe(self, key: str) -> str:
        return f"region cache {self.url}"

    def report_bad(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> None:
        url = f"{self.url}/-/check/{blob.digest}"

        def send() -> None:
            with requests.Session() as session:
                session.trust_env = False
                try:
                    session.post(url, timeout=self._timeouts)
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
        try:
            resp = self._session().get(url, headers=headers, timeout=self._timeouts, stream=True)
        except (requests.ConnectionError, requests.ConnectTimeout) as exc:
            if isinstance(exc, requests.ReadTimeout):
                raise TransportError(f"{what}: timed out") from None
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
                m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", resp.headers.get("Content-Range", "").strip())
                if not m or int(m.group(1)) != start:
                    raise TransportError(f"{what}: unexpected Content-Range {resp.headers.get('Content-Range')!r}")
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
