"""The region's client of the origin registry (async, aiohttp), acting for its clients.

The region holds no registry credentials of its own: every origin request carries the
credentials of the client it is made for.

- A client's `Authorization: Bearer ...` (a token it got from the origin's token server
  after the region relayed the origin's challenge) is forwarded as it is.
- A client's `Authorization: Basic ...` is forwarded; if the origin answers with a Bearer
  challenge, the region fetches a token from the challenge's realm with those Basic
  credentials (the token dance, scope `repository:NAME:pull`) and retries. Tokens are
  kept per (credentials hash, scope) until shortly before they expire.
- An anonymous client gets the same dance without credentials (public repositories on
  token registries hand out anonymous tokens); if the token server refuses, the client
  gets the origin's 401 and challenge, and can authenticate itself.

Blob bytes are fetched as stored (Accept-Encoding: identity, no decompression).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from urllib.parse import urlencode, urlparse

import aiohttp

from builder.oci.auth import parse_challenge

log = logging.getLogger("shoal.region")

_TOKEN_MARGIN = 10.0  # seconds before expiry at which a cached token is dropped
_DEFAULT_TOKEN_LIFE = 60.0
_MAX_TOKENS = 10_000


def credentials_key(authorization: str | None) -> str:
    """What access decisions and tokens are cached under: a hash, never the secret."""
    if not authorization:
        return "anonymous"
    return hashlib.sha256(authorization.encode("utf-8", "surrogateescape")).hexdigest()


@dataclass
class Denied(Exception):
    """The origin (or its token server) refused these credentials."""

    status: int
    challenge: str
    message: str


class Upstream:
    """The origin registry at `url` ("http://host:port" or "https://host")."""

    def __init__(self, url: str, *, timeout: float = 30.0, connect_timeout: float = 10.0,
                 verify_tls: bool = True) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"origin {url!r}: want http://HOST[:PORT] or https://HOST[:PORT]")
        self.url = f"{parsed.scheme}://{parsed.netloc}"
        self.host = parsed.netloc
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=timeout)
        self._verify_tls = verify_tls
        self._session: aiohttp.ClientSession | None = None
        self._tokens: dict[tuple[str, str], tuple[float, str]] = {}
        self.requests = 0  # every request sent to the origin (and its token server)

    async def start(self) -> None:
        connector = aiohttp.TCPConnector(limit=256, ssl=self._verify_tls)  # True: the default checks
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=self._timeout, auto_decompress=False,
            headers={"User-Agent": "shoal-region"},
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def serves(self, ns: str) -> bool:
        """Whether a containerd mirror request's `ns` (the upstream host) is our origin."""
        aliases = {"docker.io", "index.docker.io", "registry-1.docker.io"}
        return ns == self.host or (ns in aliases and self.host in aliases)

    async def request(
        self, method: str, path: str, authorization: str | None, repository: str | None,
        headers: dict[str, str] | None = None,
    ) -> aiohttp.ClientResponse:
        """`method path` at the origin for a client with `authorization` (see module doc).

        Returns the response (the caller reads and releases it); a 401 that the token
        dance could not get past is returned as it is. Raises aiohttp.ClientError and
        asyncio.TimeoutError for transport failures.
        """
        assert self._session is not None, "start() first"
        sent = {"Accept-Encoding": "identity", **(headers or {})}
        key = credentials_key(authorization)
        scope = f"repository:{repository}:pull" if repository else ""
        token = self._cached_token(key, scope)
        use = f"Bearer {token}" if token else authorization
        resp = await self._send(method, path, sent, use)
        if resp.status != 401 or (authorization or "").lower().startswith("bearer "):
            return resp
        scheme, params = parse_challenge(resp.headers.get("WWW-Authenticate", ""))
        if scheme != "bearer" or not params.get("realm"):
            return resp
        scope = params.get("scope") or scope
        try:
            token = await self._fetch_token(params, scope, authorization, key)
        except Denied:
            return resp  # the client sees the origin's own challenge
        resp.release()
        return await self._send(method, path, sent, f"Bearer {token}")

    async def _send(self, method: str, path: str, headers: dict, authorization: str | None) -> aiohttp.ClientResponse:
        if authorization:
            headers = {**headers, "Authorization": authorization}
        self.requests += 1
        return await self._started().request(method, self.url + path, headers=headers, allow_redirects=True)

    def _started(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the origin client is not started (start() first)")
        return self._session

    def _cached_token(self, key: str, scope: str) -> str | None:
        entry = self._tokens.get((key, scope))
        if entry and entry[0] > time.monotonic():
            return entry[1]
        return None

    async def _fetch_token(self, params: dict, scope: str, authorization: str | None, key: str) -> str:
        realm = params["realm"]
        if urlparse(realm).scheme not in ("http", "https"):
            raise Denied(502, "", f"origin sent an unusable token realm {realm!r}")
        query = ([("service", params["service"])] if params.get("service") else []) + (
            [("scope", scope)] if scope else [])
        url = realm + ("&" if "?" in realm else "?") + urlencode(query)
        headers = {}
        if authorization and authorization.lower().startswith("basic "):
            headers["Authorization"] = authorization
        self.requests += 1
        async with self._started().get(url, headers=headers) as resp:
            body = await resp.content.read(1 << 20)
            if resp.status != 200:
                raise Denied(resp.status, "", f"token server answered HTTP {resp.status}")
        try:
            doc = json.loads(body)
            token = doc.get("token") or doc.get("access_token")
            life = float(doc.get("expires_in") or _DEFAULT_TOKEN_LIFE)
        except (ValueError, AttributeError, TypeError):
            token, life = None, 0.0
        if not isinstance(token, str) or not token:
            raise Denied(502, "", "token server answered without a token")
        if len(self._tokens) > _MAX_TOKENS:
            now = time.monotonic()
            self._tokens = {k: v for k, v in self._tokens.items() if v[0] > now}
        self._tokens[(key, scope)] = (time.monotonic() + max(0.0, life - _TOKEN_MARGIN), token)
        return token


async def error_text(resp: aiohttp.ClientResponse) -> str:
    """The registry's error message(s) from an error body, else the HTTP reason."""
    try:
        doc = json.loads(await resp.content.read(64 << 10) or b"null")
    except (TimeoutError, ValueError, aiohttp.ClientError):
        doc = None
    messages = []
    if isinstance(doc, dict):
        for err in doc.get("errors") or []:
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                messages.append(err["message"])
    text = "; ".join(m for m in messages if m) or resp.reason or "error"
    return " ".join(text.split())[:300]
