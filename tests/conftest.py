"""Shared fixtures: real distribution registries on loopback, a token server, isolated
credentials.

- `registry`: an anonymous registry (plain HTTP on 127.0.0.1, fresh storage per test)
- `basic_registry`: the same with htpasswd basic auth (`.username`, `.password`)
- `token_registry`: the same with bearer-token auth from a token server in this process
- `registry_factory`: start more (`registry_factory(auth=None|"htpasswd"|"token")`)
- `docker_config`: (autouse) an empty temporary DOCKER_CONFIG; write credentials with
  `docker_config.login(host, user, password)`

Registries are Debian's /usr/bin/docker-registry; tests needing one are skipped (with
the reason) only if it is not installed. Each process is stopped by its PID on teardown,
also when the test or the start failed. Network traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from tests.services import REGISTRY_BIN

# Under pytest-xdist (make test runs files on two workers): each worker gets a temporary
# directory of its own, so that what one worker's tests look for there (an embedded
# node's leftovers) is never another's. Processes the tests start inherit it, and a
# process a test starts that imports this module (test_tenancy's token server) keeps it:
# a directory of its own would outlive it (only the worker removes its directory).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and not os.path.basename(os.environ.get("TMPDIR", "")).startswith(f"shoal-{_WORKER}-"):
    _tmp = Path("/tmp") / f"shoal-{_WORKER}-{os.getpid()}"
    _tmp.mkdir(mode=0o700, exist_ok=True)
    os.environ["TMPDIR"] = str(_tmp)
    import tempfile

    tempfile.tempdir = None  # (computed again from TMPDIR)



def pytest_unconfigure(config) -> None:
    """A worker's temporary directory goes with the worker (xdist ends workers without
    running atexit handlers)."""
    tmp = os.environ.get("TMPDIR", "")
    if os.environ.get("PYTEST_XDIST_WORKER") and os.path.basename(tmp).startswith("shoal-gw"):
        shutil.rmtree(tmp, ignore_errors=True)


TOKEN_SERVICE = "shoal-test-registry"
TOKEN_ISSUER = "shoal-test-issuer"
pytest_plugins = ["tests.fixtures_services"]


# --- credentials ---------------------------------------------------------------------


class DockerConfig:
    """A temporary $DOCKER_CONFIG directory."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def login(self, host: str, username: str, password: str, style: str = "auth") -> None:
        """Record credentials as `docker login` does (style "auth") or as fields."""
        if style == "auth":
            entry = {"auth": base64.b64encode(f"{username}:{password}".encode()).decode()}
        else:
            entry = {"username": username, "password": password}
        config = self.path / "config.json"
        data = json.loads(config.read_text()) if config.exists() else {}
        data.setdefault("auths", {})[host] = entry
        config.write_text(json.dumps(data))


@pytest.fixture(autouse=True)
def docker_config(tmp_path_factory, monkeypatch) -> DockerConfig:
    """Isolate tests from the developer's own registry credentials."""
    path = tmp_path_factory.mktemp("docker config")
    monkeypatch.setenv("DOCKER_CONFIG", str(path))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    return DockerConfig(path)


# --- the registry process ----------------------------------------------------------

from tests.services import STOP_TIMEOUT, RegistryServer, start_registry

# --- htpasswd ------------------------------------------------------------------------


def htpasswd_line(username: str, password: str) -> str:
    """A bcrypt htpasswd line: apache2-utils' htpasswd, else libcrypt via `crypt`."""
    if shutil.which("htpasswd"):
        out = subprocess.run(
            ["htpasswd", "-nbB", "-C", "5", username, password],
            check=True, capture_output=True, text=True,
        ).stdout
        return out.strip().splitlines()[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # Python 3.11: present, deprecated; libxcrypt knows bcrypt ($2b$)
    alphabet = "./ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    salt = "".join(secrets.choice(alphabet) for _ in range(21)) + "."
    hashed = crypt.crypt(password, f"$2b$05${salt}")
    if not hashed or not hashed.startswith("$2b$"):
        pytest.skip("no htpasswd (apache2-utils) and libcrypt lacks bcrypt")
    return f"{username}:{hashed}"


# --- bearer tokens ---------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """A docker token server (distribution's token auth spec) on 127.0.0.1.

    Signs RS256 JWTs with openssl; the registry trusts the certificate's key by its
    libtrust key ID. Grants every requested action to users in `users`, except that a
    user named in `grants` gets repository actions only for repositories under one of
    its prefixes (per repository, not all-or-nothing: other scopes are granted no
    action, and the registry then refuses); refuses anonymous requests (HTTP 401).
    `field` picks the JSON field: token or access_token.
    """

    def __init__(self, workdir: Path, users: dict[str, str], field: str = "token", host: str = "127.0.0.1",
                 grants: dict[str, list[str]] | None = None) -> None:
        self.users, self.field, self.grants = users, field, dict(grants or {})
        self.key = workdir / "token-key.pem"
        self.cert = workdir / "token-cert.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=shoal-test-token", "-keyout", str(self.key), "-out", str(self.cert)],
            check=True, capture_output=True,
        )
        der = subprocess.run(
            ["openssl", "pkey", "-in", str(self.key), "-pubout", "-outform", "DER"],
            check=True, capture_output=True,
        ).stdout
        b32 = base64.b32encode(hashlib.sha256(der).digest()[:30]).decode().rstrip("=")
        self.kid = ":".join(b32[i:i + 4] for i in range(0, len(b32), 4))
        self.issued: list[dict] = []  # {"user", "scopes"} per token handed out
        self._httpd = ThreadingHTTPServer((host, 0), self._handler())
        self.realm = f"http://{host}:{self._httpd.server_port}/token"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=STOP_TIMEOUT)

    def sign(self, claims: dict) -> str:
        header = {"typ": "JWT", "alg": "RS256", "kid": self.kid}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = subprocess.run(
            ["openssl", "dgst", "-sha256", "-sign", str(self.key)],
            input=signing_input.encode(), check=True, capture_output=True,
        ).stdout
        return f"{signing_input}.{_b64url(signature)}"

    def _user(self, header: str | None) -> str | None:
        if not header or not header.startswith("Basic "):
            return None
        try:
            user, _, password = base64.b64decode(header[6:]).decode().partition(":")
        except ValueError:
            return None
        return user if self.users.get(user) == password else None

    def _grant(self, user: str, scopes: list[str]) -> dict:
        access = []
        for scope in scopes:
            kind, _, rest = scope.partition(":")
            name, _, actions = rest.rpartition(":")
            allowed = self.grants.get(user)
            if allowed is not None and kind == "repository" and not any(
                    name == p or name.startswith(p.rstrip("/") + "/") for p in allowed):
                actions = ""
            access.append({"type": kind, "name": name, "actions": [a for a in actions.split(",") if a]})
        now = int(time.time())
        claims = {
            "iss": TOKEN_ISSUER, "sub": user, "aud": TOKEN_SERVICE, "exp": now + 300,
            "nbf": now - 10, "iat": now, "jti": secrets.token_hex(8), "access": access,
        }
        self.issued.append({"user": user, "scopes": scopes})
        return {self.field: self.sign(claims), "expires_in": 300}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = parse_qs(urlparse(self.path).query)
                user = server._user(self.headers.get("Authorization"))
                if user is None:
                    body, status = {"details": "authentication required"}, 401
                else:
                    body, status = server._grant(user, query.get("scope", [])), 200
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


_REGISTRY_FIXTURES = {"registry", "basic_registry", "token_registry", "registry_factory", "module_registry"}


# Worker seconds per file (setup, call and teardown; `pytest --durations=0`, 2026-12-04),
# for the order alone: `make test` hands whole files to two workers in collection order
# (--dist loadfile --no-loadscope-reorder), so the longest go first and the short ones fill
# in at the end (the files' makespan near half their sum; xdist's own order, by the number
# of tests in a file, had left the demo or a first build of the torch image for last, with
# the other worker idle). A file not named here goes after these, in collection order.
FILE_SECONDS = {
    "test_torch_e2e.py": 190,  # its first run builds the torch image (about 170 s)
    "test_p2p_swarm.py": 190, "test_preheat.py": 100, "test_demo.py": 82, "test_chain_poisoning.py": 80,
    "test_snapshotter.py": 76, "test_fleet.py": 74, "test_slurm.py": 62, "test_tenancy.py": 44,
    "test_documents.py": 41, "test_interop.py": 40, "test_lazy_fs.py": 40, "test_robustness.py": 40,
    "test_unpack.py": 39, "test_region_ranges.py": 37, "test_region.py": 33, "test_node_e2e.py": 33,
    "test_fs_takeover.py": 32, "test_prefetch_local.py": 32, "test_deploy.py": 28, "test_profile_record.py": 26,
    "test_cache_store.py": 25, "test_cri.py": 25, "test_verify.py": 24, "test_convert.py": 24,
}


def pytest_collection_modifyitems(items) -> None:
    """Tests that start a registry carry the `registry` marker (`-m "not registry"`); the
    files run longest first (FILE_SECONDS; a stable sort keeps each file's own order)."""
    for item in items:
        if _REGISTRY_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.registry)
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))


# --- fixtures --------------------------------------------------------------------------


@pytest.fixture
def registry_factory(tmp_path_factory):
    """start(auth=None|"htpasswd"|"token", token_field="token") -> RegistryServer."""
    if not os.access(REGISTRY_BIN, os.X_OK):
        pytest.skip(f"{REGISTRY_BIN} is not installed (Debian package docker-registry)")
    started: list[RegistryServer] = []
    token_servers: list[TokenServer] = []

    def start(auth: str | None = None, token_field: str = "token") -> RegistryServer:
        workdir = tmp_path_factory.mktemp("registry")
        username, password = "shoal-user", "pässword with spaces:and:colons"
        auth_config, token_server = None, None
        if auth == "htpasswd":
            htpasswd = workdir / "htpasswd"
            htpasswd.write_text(htpasswd_line(username, password) + "\n")
            auth_config = {"htpasswd": {"realm": "shoal-test", "path": str(htpasswd)}}
        elif auth == "token":
            if not shutil.which("openssl"):
                pytest.skip("openssl is needed to sign test tokens")
            token_server = TokenServer(workdir, {username: password}, token_field)
            token_servers.append(token_server)
            auth_config = {"token": {
                "realm": token_server.realm, "service": TOKEN_SERVICE,
                "issuer": TOKEN_ISSUER, "rootcertbundle": str(token_server.cert),
            }}
        elif auth is not None:
            raise ValueError(f"unknown auth {auth!r}")
        server = start_registry(workdir, auth_config)
        started.append(server)
        if auth:
            server.username, server.password = username, password
        server.token_server = token_server
        return server

    try:
        yield start
    finally:
        for server in started:
            server.stop()
        for token_server in token_servers:
            token_server.stop()


@pytest.fixture
def registry(registry_factory) -> RegistryServer:
    return registry_factory()


@pytest.fixture(scope="module")
def module_registry(tmp_path_factory) -> RegistryServer:
    """One plain registry for a whole test module (its images are built once)."""
    if not os.access(REGISTRY_BIN, os.X_OK):
        pytest.skip(f"{REGISTRY_BIN} is not installed (Debian package docker-registry)")
    server = start_registry(tmp_path_factory.mktemp("registry"), None)
    yield server
    server.stop()


@pytest.fixture
def basic_registry(registry_factory) -> RegistryServer:
    return registry_factory("htpasswd")


@pytest.fixture
def token_registry(registry_factory) -> RegistryServer:
    return registry_factory("token")
