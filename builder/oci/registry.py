"""A synchronous registry client (OCI distribution API v2) as image source and destination.

- https unless `plain_http`; a TLS failure against a loopback host suggests --plain-http.
- Every request has a timeout (connect 10 s, read 60 s). Connection errors, 5xx and 429
  are retried (3 attempts in all) for idempotent requests; a blob upload is retried as a
  whole (POST + PUT) since blobs are content-addressed.
- Auth: anonymous first; on a 401 challenge, Basic with credentials from auth.py, or a
  Bearer token fetched from the challenge's realm (with Basic credentials if any) for the
  repository's pull (source) or pull,push (destination) scope.
- Manifests are verified against the requested digest, the Docker-Content-Digest header
  and their own sha256; blobs are verified by VerifyingReader when read to EOF.
- Every failure is a ShoalError with one line naming the reference, e.g.
  `docker://127.0.0.1:5000/foo:bar: manifest unknown (HTTP 404)`.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import os
import socket
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlencode, urljoin, urlparse

import requests
import urllib3

from builder.oci.auth import Credentials, auth_files, find_credentials, parse_challenge
from builder.oci.base import ImageDestination, ImageSource, Manifest
from builder.oci.documents import load_document
from builder.oci.layout import (
    MAX_MANIFEST_SIZE,
    VerifyingReader,
    declared_media_type,
    detect_media_type,
)
from builder.oci.ranges import ContentRangeError, check_content_range
from builder.oci.refs import DockerRef
from shoal import mediatypes as mt
from shoal.digest import check_digest, sha256_digest
from shoal.errors import (
    DigestMismatch,
    FormatError,
    NotFound,
    TransportError,
    UsageError,
)

CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0
ATTEMPTS = 3
BACKOFF = 0.25  # seconds before the 2nd attempt, doubled for each further one
MAX_RETRY_AFTER = 10.0
_UPLOAD_BLOCK = 1 << 20
_ERROR_BODY_LIMIT = 64 << 10
_KNOWN_MANIFEST_TYPES = mt.INDEX_TYPES + mt.MANIFEST_TYPES
# Docker Hub's API lives on another host than the name users write
_API_HOSTS = {"docker.io": "registry-1.docker.io", "index.docker.io": "registry-1.docker.io"}


class TransientError(TransportError):
    """A TransportError worth retrying later (connection failed or lost, 5xx, 429)."""


class _Adapter(requests.adapters.HTTPAdapter):
    """Sends request bodies (blob uploads) in 1 MiB blocks instead of 16 KiB."""

    def init_poolmanager(self, *args, **kwargs):
        kwargs.setdefault("blocksize", _UPLOAD_BLOCK)
        super().init_poolmanager(*args, **kwargs)


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and [::1] (with or without a port)."""
    name = host
    if name.startswith("["):
        name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def describe_connection_error(exc: BaseException) -> str:
    """A short reason ('connection refused', 'timed out', ...) from a requests error chain."""
    chain = _exception_chain(exc)
    # OS-level causes first: urllib3's NewConnectionError is itself a TimeoutError subclass
    for err in chain:
        if isinstance(err, ConnectionRefusedError):
            return "connection refused"
        if isinstance(err, ConnectionResetError):
            return "connection reset by peer"
        if isinstance(err, socket.gaierror):
            return f"cannot resolve host ({err.strerror})"
        if isinstance(err, ssl.SSLCertVerificationError):
            return f"certificate verify failed: {err.verify_message}"
        if isinstance(err, ssl.SSLError):
            return str(err.reason or err).lower().replace("_", " ")
    for err in chain:
        if isinstance(err, urllib3.exceptions.NewConnectionError):
            continue
        if isinstance(err, (TimeoutError, socket.timeout, urllib3.exceptions.TimeoutError, requests.Timeout)):
            return "timed out"
    for err in chain:
        if isinstance(err, OSError) and err.strerror:
            return err.strerror.lower()
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


def _exception_chain(exc: BaseException) -> list[BaseException]:
    """exc and everything it wraps (causes, contexts, args, urllib3 `reason`s)."""
    out: list[BaseException] = []
    stack: list[BaseException | None] = [exc]
    seen: set[int] = set()
    while stack:
        err = stack.pop(0)
        if err is None or id(err) in seen:
            continue
        seen.add(id(err))
        out.append(err)
        reason = getattr(err, "reason", None)
        stack.extend([err.__cause__, err.__context__, reason if isinstance(reason, BaseException) else None])
        stack.extend(a for a in getattr(err, "args", ()) if isinstance(a, BaseException))
    return out


class _Client:
    """HTTP plumbing for one repository: auth, retries, error messages."""

    def __init__(self, ref: DockerRef, plain_http: bool, push: bool, read_timeout: float = READ_TIMEOUT) -> None:
        self.ref = ref
        self.timeouts = (min(CONNECT_TIMEOUT, read_timeout), read_timeout)
        self.scheme = "http" if plain_http else "https"
        host = _API_HOSTS.get(ref.host, ref.host)
        self.base = f"{self.scheme}://{host}/v2/{ref.repository}"
        self.scope = f"repository:{ref.repository}:{'pull,push' if push else 'pull'}"
        self.session = requests.Session()
        adapter = _Adapter()
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self._authorization: str | None = None
        self._credentials: Credentials | None = None
        self._credentials_loaded = False

    def close(self) -> None:
        self.session.close()

    # --- credentials and challenges ---------------------------------------------

    def credentials(self) -> Credentials | None:
        if not self._credentials_loaded:
            self._credentials = find_credentials(self.ref.host, self.ref.repository)
            self._credentials_loaded = True
        return self._credentials

    def _auth_hint(self, status: int) -> str:
        """What the user can do about a 401/403: log in, or check the account."""
        creds = self.credentials()
        if creds is None:
            searched = ", ".join(str(p) for p in auth_files())
            return f"; no credentials for {self.ref.host} (searched {searched})"
        if status == 401:
            return f"; the credentials of user {creds.username!r} were rejected"
        return f"; user {creds.username!r} lacks access"

    def _authenticate(self, resp: requests.Response, what: str) -> bool:
        """Answer a 401 challenge; True if a retry with new credentials makes sense."""
        scheme, params = parse_challenge(resp.headers.get("WWW-Authenticate", ""))
        # the credentials as they are now: a long-lived client (a node's origin source)
        # meets credentials rotated in the file, or provided for the repository, since
        self._credentials_loaded = False
        creds = self.credentials()
        if scheme == "basic":
            header = _basic_header(creds) if creds is not None else None
            if header is None or header == self._authorization:
                return False
            self._authorization = header
            return True
        if scheme == "bearer" and params.get("realm"):
            scopes = [self.scope]
            if params.get("scope") and params["scope"] not in scopes:
                scopes.append(params["scope"])
            token = self._fetch_token(params["realm"], params.get("service"), scopes, what)
            self._authorization = f"Bearer {token}"
            return True
        return False

    def _fetch_token(self, realm: str, service: str | None, scopes: list[str], what: str) -> str:
        if urlparse(realm).scheme not in ("http", "https"):
            raise TransportError(f"{what}: registry sent an unusable token realm {realm!r}")
        query = ([("service", service)] if service else []) + [("scope", s) for s in scopes]
        url = realm + ("&" if "?" in realm else "?") + urlencode(query)
        creds = self.credentials()
        headers = {}
        if creds is not None:
            headers["Authorization"] = _basic_header(creds)
        resp = self._send("GET", url, headers, None, True, f"{what}: token server {realm}")
        if resp.status_code != 200:
            hint = self._auth_hint(resp.status_code) if resp.status_code in (401, 403) else ""
            text = _error_text(resp)
            resp.close()
            raise TransportError(f"{what}: token server {realm}: {text} (HTTP {resp.status_code}){hint}")
        try:
            body = json.loads(_read_capped(resp, 1 << 20, f"{what}: token server {realm}"))
        except (ValueError, UnicodeDecodeError):
            body = None
        # the token spec names it `token`; OAuth2-style servers answer `access_token`
        token = (body.get("token") or body.get("access_token")) if isinstance(body, dict) else None
        if not isinstance(token, str) or not token:
            raise TransportError(f"{what}: token server {realm} answered without a token")
        return token

    # --- requests -----------------------------------------------------------------

    def _send(
        self,
        method: str,
        url: str,
        headers: dict,
        body: bytes | Callable | None,
        idempotent: bool,
        what: str,
    ) -> requests.Response:
        """One streamed request with connection/5xx/429 retries (idempotent only); no auth.

        The caller reads the body (or not) and closes the response.
        """
        attempt = 0
        while True:
            attempt += 1
            retry = idempotent and attempt < ATTEMPTS
            data = body() if callable(body) else body
            try:
                resp = self.session.request(
                    method, url, headers=headers, data=data, stream=True,
                    timeout=self.timeouts,
                )
            except requests.exceptions.SSLError as exc:
                raise TransportError(self._tls_message(what, exc)) from None
            except (requests.ConnectionError, requests.Timeout) as exc:
                if retry:
                    time.sleep(BACKOFF * 2 ** (attempt - 1))
                    continue
                raise TransientError(f"{what}: {describe_connection_error(exc)}") from None
            except requests.RequestException as exc:
                raise TransportError(f"{what}: {describe_connection_error(exc)}") from None
            finally:
                close = getattr(data, "close", None)
                if close is not None:
                    close()
            if retry and (resp.status_code >= 500 or resp.status_code == 429):
                _release(resp)
                time.sleep(_retry_delay(resp, attempt))
                continue
            return resp

    def request(
        self,
        method: str,
        url: str,
        what: str,
        headers: dict | None = None,
        body: bytes | Callable | None = None,
        idempotent: bool = True,
    ) -> requests.Response:
        """A streamed request with auth: answers up to two 401 challenges.

        `body` may be a callable returning a fresh file object (re-opened on each try).
        The caller reads the body (or not) and closes the response.
        """
        for round_ in range(3):
            sent = dict(headers or {})
            if self._authorization:
                sent["Authorization"] = self._authorization
            resp = self._send(method, url, sent, body, idempotent, what)
            if resp.status_code != 401 or round_ == 2 or not self._authenticate(resp, what):
                return resp
            _release(resp)
        raise AssertionError("unreachable")

    def _tls_message(self, what: str, exc: Exception) -> str:
        reason = describe_connection_error(exc)
        if is_loopback(self.ref.host):
            return f"{what}: TLS failed ({reason}); if this registry serves plain HTTP, use --plain-http"
        return f"{what}: TLS failed ({reason})"

    def fail(self, resp: requests.Response, what: str) -> TransportError | NotFound:
        """The error for an unexpected response: NotFound for 404, else TransportError."""
        text = f"{what}: {_error_text(resp)} (HTTP {resp.status_code})"
        resp.close()
        if resp.status_code == 404:
            return NotFound(text)
        if resp.status_code in (401, 403):
            text += self._auth_hint(resp.status_code)
        if resp.status_code >= 500 or resp.status_code == 429:
            return TransientError(text)
        return TransportError(text)


def _basic_header(creds: Credentials) -> str:
    # UTF-8 like the docker CLI (requests' own helper would encode latin-1)
    raw = f"{creds.username}:{creds.password}".encode()
    return "Basic " + base64.b64encode(raw).decode("ascii")


def _retry_delay(resp: requests.Response, attempt: int) -> float:
    delay = BACKOFF * 2 ** (attempt - 1)
    after = resp.headers.get("Retry-After", "")
    if after.isdigit():
        delay = max(delay, min(float(after), MAX_RETRY_AFTER))
    return delay


def _release(resp: requests.Response) -> None:
    """Drain a small body so the connection goes back to the pool, then close."""
    try:
        resp.raw.read(_ERROR_BODY_LIMIT, decode_content=False)
    except Exception:  # noqa: BLE001, S110 (any failure: the connection is discarded instead; nothing is lost)
        pass
    resp.close()


def _error_text(resp: requests.Response) -> str:
    """The registry's error message(s) from an error body, else the HTTP reason."""
    messages: list[str] = []
    try:
        raw = resp.raw.read(_ERROR_BODY_LIMIT, decode_content=True)
        doc = json.loads(raw or b"null")
    except Exception:  # noqa: BLE001 (an unreadable error body, however it fails, only costs the detail)
        doc = None
    if isinstance(doc, dict):
        for err in doc.get("errors") or []:
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                messages.append(err["message"] or str(err.get("code", "")))
        detail = doc.get("details") or doc.get("error")
        if not messages and isinstance(detail, str):
            messages.append(detail)
    text = "; ".join(m for m in messages if m) or resp.reason or "error"
    return " ".join(text.split())[:300]


def _read_capped(resp: requests.Response, limit: int, what: str) -> bytes:
    """The whole (decoded) body; FormatError past `limit`, TransportError if cut off."""
    chunks, total = [], 0
    try:
        for chunk in resp.iter_content(64 << 10):
            total += len(chunk)
            if total > limit:
                raise FormatError(f"{what}: larger than {limit} bytes")
            chunks.append(chunk)
    except requests.RequestException as exc:
        raise TransportError(f"{what}: connection lost ({describe_connection_error(exc)})") from None
    finally:
        resp.close()
    return b"".join(chunks)


def _raw_reader(resp: requests.Response, what: str) -> Callable[[int], bytes]:
    """read(n) on the undecoded body, turning socket errors into TransportError."""

    def read(n: int) -> bytes:
        try:
            return resp.raw.read(n, decode_content=False)
        except (urllib3.exceptions.HTTPError, OSError, requests.RequestException) as exc:
            raise TransportError(f"{what}: connection lost ({describe_connection_error(exc)})") from None

    return read


class RegistrySource(ImageSource):
    """Reads `docker://HOST/REPO:TAG` or `@sha256:...` from a registry."""

    def __init__(self, ref: DockerRef, plain_http: bool = False, read_timeout: float = READ_TIMEOUT) -> None:
        """`read_timeout`: seconds a request may wait for the registry's next byte (and
        at most that to connect)."""
        self._ref = ref
        self._client = _Client(ref, plain_http, push=False, read_timeout=read_timeout)
        self.reference = str(ref)

    def get_root(self) -> Manifest:
        return self._fetch_manifest(self._ref.reference, self.reference)

    def get_manifest(self, digest: str) -> Manifest:
        digest = check_digest(digest)
        return self._fetch_manifest(digest, f"{self.reference}: manifest {digest}")

    def _fetch_manifest(self, reference: str, what: str) -> Manifest:
        url = f"{self._client.base}/manifests/{reference}"
        resp = self._client.request("GET", url, what, {"Accept": mt.ACCEPT_MANIFESTS})
        if resp.status_code != 200:
            raise self._client.fail(resp, what)
        header_digest = resp.headers.get("Docker-Content-Digest", "")
        content_type = resp.headers.get("Content-Type", "").split(";")[0].strip()
        data = _read_capped(resp, MAX_MANIFEST_SIZE, what)
        digest = sha256_digest(data)
        if reference.startswith("sha256:") and digest != reference:
            raise DigestMismatch(f"{what}: digest mismatch (want {reference}, got {digest})")
        if header_digest.startswith("sha256:") and header_digest != digest:
            raise DigestMismatch(
                f"{what}: Docker-Content-Digest {header_digest} differs from the bytes' {digest}"
            )
        return Manifest(data=data, media_type=_manifest_type(content_type, data, what), digest=digest)

    def open_blob(self, digest: str, size: int | None = None):
        digest = check_digest(digest)
        what = f"{self.reference}: blob {digest}"
        resp = self._blob_request(digest, what, {})
        if resp.status_code != 200:
            raise self._client.fail(resp, what)
        length = resp.headers.get("Content-Length", "")
        if size is not None and length.isdigit() and int(length) != size:
            resp.close()
            raise DigestMismatch(f"{what}: registry serves {length} bytes, want {size}")
        return VerifyingReader(_raw_reader(resp, what), digest, size, what, close_fn=resp.close)

    def read_range(self, digest: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a blob via an HTTP Range request.

        The bytes are not digest-checked (a range cannot be); callers verify them against
        their own chunk digests. A registry that ignores Range (200 with the whole blob)
        is handled by skipping to `start`. Raises FormatError if the blob ends before
        `end`, NotFound if the blob is unknown.
        """
        digest = check_digest(digest)
        if not 0 <= start < end:
            raise ValueError(f"bad range [{start}, {end})")
        what = f"{self.reference}: blob {digest} bytes {start}-{end - 1}"
        resp = self._blob_request(digest, what, {"Range": f"bytes={start}-{end - 1}"})
        if resp.status_code == 416:
            resp.close()
            raise FormatError(f"{what}: range not satisfiable (HTTP 416)")
        if resp.status_code not in (200, 206):
            raise self._client.fail(resp, what)
        read = _raw_reader(resp, what)
        try:
            if resp.status_code == 206:
                _check_content_range(resp.headers.get("Content-Range", ""), start, end, what)
            else:
                _skip(read, start, what)
            data = _read_exact(read, end - start)
        finally:
            resp.close()
        if len(data) != end - start:
            raise FormatError(f"{what}: blob ends after {start + len(data)} bytes")
        return data

    def _blob_request(self, digest: str, what: str, headers: dict) -> requests.Response:
        # blob bytes must arrive as stored: no transfer compression
        headers = {"Accept-Encoding": "identity", **headers}
        url = f"{self._client.base}/blobs/{digest}"
        return self._client.request("GET", url, what, headers)

    def close(self) -> None:
        self._client.close()


def _manifest_type(content_type: str, data: bytes, what: str) -> str:
    """The manifest's media type: a known Content-Type, else its own field or shape."""
    try:
        declared = declared_media_type(data)
        if load_document(data, "manifest").get("schemaVersion") == 1:
            raise FormatError("Docker schema 1 manifests are not supported")
    except FormatError as exc:
        raise FormatError(f"{what}: {exc}") from None
    if content_type in _KNOWN_MANIFEST_TYPES:
        return content_type
    kind = declared or detect_media_type(data)
    if kind not in _KNOWN_MANIFEST_TYPES:
        raise FormatError(f"{what}: unsupported manifest type {kind or content_type!r}")
    return kind


def _check_content_range(header: str, start: int, end: int, what: str) -> None:
    try:
        check_content_range(header, start, end)
    except ContentRangeError:
        raise TransportError(f"{what}: registry answered with Content-Range {header!r}") from None


def _read_exact(read: Callable[[int], bytes], n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = read(min(n - got, 1 << 20))
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _skip(read: Callable[[int], bytes], n: int, what: str) -> None:
    while n > 0:
        chunk = read(min(n, 1 << 20))
        if not chunk:
            raise FormatError(f"{what}: blob ends before the range starts")
        n -= len(chunk)


class RegistryDestination(ImageDestination):
    """Pushes to `docker://HOST/REPO:TAG` (or `@sha256:...`, which must match the root)."""

    def __init__(self, ref: DockerRef, plain_http: bool = False) -> None:
        self._ref = ref
        self.plain_http = plain_http
        self._client = _Client(ref, plain_http, push=True)
        self.reference = str(ref)

    @property
    def ref(self) -> DockerRef:
        return self._ref

    def has_blob(self, digest: str) -> bool:
        digest = check_digest(digest)
        what = f"{self.reference}: blob {digest}"
        resp = self._client.request("HEAD", f"{self._client.base}/blobs/{digest}", what)
        if resp.status_code in (200, 404):
            _release(resp)
            return resp.status_code == 200
        raise self._client.fail(resp, what)

    def put_blob(self, path: str, digest: str, size: int) -> None:
        """Monolithic upload (POST, then PUT streaming the file); skipped if present."""
        digest = check_digest(digest)
        what = f"{self.reference}: blob {digest}"
        _check_file_size(path, size, what)
        if self.has_blob(digest):
            return
        for attempt in range(1, ATTEMPTS + 1):
            try:
                self._upload(path, digest, size, what)
                return
            except TransientError as exc:
                if attempt == ATTEMPTS:
                    raise TransportError(str(exc)) from None
                time.sleep(BACKOFF * 2 ** (attempt - 1))

    def _upload(self, path: str, digest: str, size: int, what: str) -> None:
        client = self._client
        resp = client.request("POST", f"{client.base}/blobs/uploads/", what, {"Content-Length": "0"})
        if resp.status_code != 202 or not resp.headers.get("Location"):
            raise client.fail(resp, f"{what}: starting upload")
        location = urljoin(resp.url, resp.headers["Location"])
        _release(resp)
        # the upload URL may carry its own query (state); add the digest to it
        url = location + ("&" if "?" in location else "?") + urlencode({"digest": digest})
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        resp = client.request(
            "PUT", url, what, headers, body=lambda: _open_for_upload(path, what), idempotent=False
        )
        if resp.status_code not in (201, 204):
            raise client.fail(resp, what)
        _release(resp)
        _check_digest_header(resp, digest, what)

    def put_manifest(self, manifest: Manifest) -> None:
        self._put_manifest(manifest, manifest.digest)

    def put_root(self, manifest: Manifest) -> None:
        pinned = self._ref.digest
        if pinned and pinned != manifest.digest:
            raise UsageError(f"{self.reference}: the image's digest is {manifest.digest}, not {pinned}")
        self._put_manifest(manifest, pinned or self._ref.reference)

    def _put_manifest(self, manifest: Manifest, reference: str) -> None:
        digest = check_digest(manifest.digest)
        what = f"{self.reference}: manifest {digest}"
        if sha256_digest(manifest.data) != digest:
            raise DigestMismatch(f"{what}: bytes hash to {sha256_digest(manifest.data)}")
        url = f"{self._client.base}/manifests/{reference}"
        headers = {"Content-Type": manifest.media_type}
        resp = self._client.request("PUT", url, what, headers, body=manifest.data)
        if resp.status_code not in (200, 201, 204):
            raise self._client.fail(resp, what)
        _release(resp)
        _check_digest_header(resp, digest, what)

    def close(self) -> None:
        self._client.close()


def _check_file_size(path: str, size: int, what: str) -> None:
    try:
        actual = os.stat(path).st_size
    except OSError as exc:
        raise TransportError(f"{what}: cannot read {path} ({exc.strerror})") from None
    if actual != size:
        raise DigestMismatch(f"{what}: {path} has {actual} bytes, want {size}")


def _open_for_upload(path: str, what: str):
    try:
        return open(path, "rb")
    except OSError as exc:
        raise TransportError(f"{what}: cannot read {path} ({exc.strerror})") from None


def _check_digest_header(resp: requests.Response, digest: str, what: str) -> None:
    header = resp.headers.get("Docker-Content-Digest", "")
    if header.startswith("sha256:") and header != digest:
        raise DigestMismatch(f"{what}: registry stored it as {header}")
