"""Registry credentials from the files `docker login` and `podman login` write.

Files searched, in order (the first one with an entry for the registry wins):
1. `$REGISTRY_AUTH_FILE` (podman, skopeo), if set
2. `$DOCKER_CONFIG/config.json`, if DOCKER_CONFIG is set
3. `$XDG_RUNTIME_DIR/containers/auth.json` (podman's default), if XDG_RUNTIME_DIR is set
4. `~/.docker/config.json`, if DOCKER_CONFIG is not set

An entry is `auths[KEY]` where KEY is the host (`127.0.0.1:5000`), the host with a
repository namespace (`ghcr.io/org`, most specific match wins), or a URL such as
`https://index.docker.io/v1/`. Its credentials are `auth` (base64 of `user:password`) or
the `username` / `password` fields.

Not supported: credential helpers (`credsStore`, `credHelpers`) and OAuth identity
tokens (`identitytoken`); such entries are treated as no credentials (anonymous access).

Before the files: credentials a process was given for one repository (`provide`), in
memory only, each until its expiry: on a Kubernetes node, what the kubelet passed in
PullImage's AuthConfig (snapshotter/criproxy.py). They serve that (host, repository)
alone, never another repository of the same host.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import TransportError

# Docker Hub is known under several names; docker login stores it under the v1 URL.
_DOCKER_HUB = ("docker.io", "index.docker.io", "registry-1.docker.io")


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str

    def __repr__(self) -> str:  # never print the password
        return f"Credentials(username={self.username!r}, password=***)"


def auth_files() -> list[Path]:
    """The credential files to search, in priority order (existing or not)."""
    env = os.environ
    files: list[Path] = []
    if env.get("REGISTRY_AUTH_FILE"):
        files.append(Path(env["REGISTRY_AUTH_FILE"]))
    if env.get("DOCKER_CONFIG"):
        files.append(Path(env["DOCKER_CONFIG"]) / "config.json")
    if env.get("XDG_RUNTIME_DIR"):
        files.append(Path(env["XDG_RUNTIME_DIR"]) / "containers" / "auth.json")
    if not env.get("DOCKER_CONFIG"):
        files.append(Path.home() / ".docker" / "config.json")
    return files


# (host, repository) -> (credentials, monotonic expiry): provide()'s, in memory only
_provided: dict[tuple[str, str], tuple[Credentials, float]] = {}
_provided_lock = threading.Lock()


def _hub(host: str) -> str:
    return "docker.io" if host in _DOCKER_HUB else host


def provide(host: str, repository: str, creds: Credentials | None, ttl: float = 0.0) -> None:
    """Use `creds` for `repository` on `host` (and only there) for `ttl` seconds, before
    any credential file; None forgets what was provided for it. Any thread."""
    key = (_hub(host), repository)
    with _provided_lock:
        if creds is None:
            _provided.pop(key, None)
        else:
            _provided[key] = (creds, time.monotonic() + ttl)


def provided(host: str, repository: str) -> Credentials | None:
    """What provide() gave for exactly (host, repository) and has not expired, or None."""
    key = (_hub(host), repository)
    with _provided_lock:
        entry = _provided.get(key)
        if entry is not None and entry[1] <= time.monotonic():
            del _provided[key]
            entry = None
    return entry[0] if entry is not None else None


def provided_statistics() -> list[dict]:
    """The provided credentials' scopes (no secret): [{"registry", "repository", "expires_in_s"}]."""
    now = time.monotonic()
    with _provided_lock:
        return [{"registry": h, "repository": r, "expires_in_s": round(exp - now, 1)}
                for (h, r), (_, exp) in sorted(_provided.items()) if exp > now]


def find_credentials(host: str, repository: str = "") -> Credentials | None:
    """Credentials for `host` (and optionally `repository`), or None for anonymous:
    those provided for the repository (provide()), else the files' (auth_files()).

    Raises TransportError naming the file if a credential file exists but is unreadable
    or malformed (silently ignoring it would turn a typo into a confusing 401).
    """
    if repository:
        given = provided(host, repository)
        if given is not None:
            return given
    for path in auth_files():
        auths = _load_auths(path)
        if auths is None:
            continue
        found = _best_entry(auths, host, repository)
        if found is not None:
            return _decode_entry(found[1], path, found[0])
    return None


def _load_auths(path: Path) -> dict | None:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise TransportError(f"{path}: cannot read credentials file ({exc})") from None
    try:
        data = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as exc:
        raise TransportError(f"{path}: credentials file is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise TransportError(f"{path}: credentials file is not a JSON object")
    auths = data.get("auths", {})
    if not isinstance(auths, dict):
        raise TransportError(f"{path}: 'auths' is not a JSON object")
    return auths


def _normalize_key(key: str) -> str:
    """`https://host/v1/` -> `host`; `host/ns` stays `host/ns` (a namespaced entry)."""
    for scheme in ("https://", "http://"):
        if key.startswith(scheme):
            key = key[len(scheme):]
            key = key.split("/", 1)[0]
            break
    key = key.rstrip("/")
    host, slash, rest = key.partition("/")
    if host in _DOCKER_HUB:
        host = "docker.io"
    return host + slash + rest


def _best_entry(auths: dict, host: str, repository: str) -> tuple[str, dict] | None:
    """The most specific entry whose key is host or a namespace prefix of host/repository."""
    want_host = "docker.io" if host in _DOCKER_HUB else host
    target = f"{want_host}/{repository}" if repository else want_host
    best, best_len = None, -1
    for key, entry in auths.items():
        if not isinstance(key, str) or not isinstance(entry, dict):
            continue
        norm = _normalize_key(key)
        if (norm == target or target.startswith(norm + "/")) and len(norm) > best_len:
            best, best_len = (key, entry), len(norm)
    return best


def _decode_entry(entry: dict, path: Path, key: str) -> Credentials | None:
    auth = entry.get("auth")
    if isinstance(auth, str) and auth:
        try:
            decoded = base64.b64decode(auth, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            raise TransportError(f"{path}: auths[{key}].auth is not base64 of user:password") from None
        user, colon, password = decoded.partition(":")
        if not colon or not user:
            raise TransportError(f"{path}: auths[{key}].auth is not base64 of user:password")
        return Credentials(user, password)
    username, secret = entry.get("username"), entry.get("password")
    if isinstance(username, str) and username and isinstance(secret, str):
        return Credentials(username, secret)
    return None


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """A WWW-Authenticate challenge: `Bearer realm="x",service="y",scope="z"` ->
    ("bearer", {"realm": "x", ...}); scheme and parameter names lowercased. Pure: never
    raises (an unreadable header gives a scheme no caller answers, or no parameters)."""
    scheme, _, rest = header.strip().partition(" ")
    params = {k.lower(): v for k, v in re.findall(r'(\w+)="([^"]*)"', rest)}
    return scheme.lower(), params
