"""Configuration of the region cache: a TOML file plus command-line flags (flags win).

Every option, with its default (an empty file, or none, gives these):

    listen = "127.0.0.1:5080"      # HOST:PORT to serve on (--listen)
    origin = ""                    # the origin registry URL, http:// or https:// (--origin; required)
    store = "/var/lib/shoal/region"  # the disk backend's folder; also S3 staging (--store)
    backend = "disk"               # "disk" or "s3"
    origin_timeout = 30.0          # seconds without a byte from the origin before a fill fails
    origin_verify_tls = true       # check the origin's TLS certificate
    io_threads = 32                # worker threads for file and S3 I/O (never on the event loop)
    block_size = "1M"              # bytes per read/write when streaming blobs
    plain_http = false             # serve plain HTTP instead of HTTPS (--plain-http; loopback listen only)
    tls_cert = ""                  # PEM certificate (chain) to serve; "" = the region's own (below)
    tls_key = ""                   # its private key
    tls_dir = ""                   # the region's own CA and certificate; "" = <store>/tls
    tls_names = []                 # more names/addresses its own certificate covers (beside the listen host)

    [disk]
    capacity = ""                  # bytes ("500G"); empty: the recorded one, else 20% of free disk
    fsync = true                   # fsync each blob before committing it (range reads cannot verify)

    [s3]
    bucket = ""                    # required for backend = "s3"
    prefix = "shoal/"              # objects are <prefix>blobs/sha256/<hex>
    endpoint_url = ""              # empty: AWS; else any S3-protocol server
    region = ""                    # empty: from the AWS configuration
    profile = ""                   # empty: the default AWS profile / environment
    capacity = ""                  # bytes; empty: unbounded (expire with a lifecycle rule)
    create_bucket = false          # create the bucket at start if missing

    [auth]
    check = true                   # serve a blob only to clients the origin would serve
    ttl = 60.0                     # seconds an allowed (credentials, repository) is remembered
    negative_ttl = 5.0             # seconds a refusal is remembered

    [nodes]
    token_file = ""                # the secret nodes present to /p2p/v1/ (made at first start); "" = <tls_dir>/node-token

Tables other than these belong to other parts of `shoal region` and are ignored here;
unknown keys in these tables are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from urllib.parse import urlparse

from builder.oci.registry import is_loopback
from shoal.errors import UsageError


def parse_size(text: str | int | None) -> int | None:
    """"500G", "1.5M", "4096", 4096 -> bytes; "" or None -> None."""
    if text is None or text == "":
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = str(text).strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise UsageError(f"not a size: {text!r} (e.g. 500G, 64M, 4096)") from None


@dataclass
class DiskConfig:
    capacity: int | None = None
    fsync: bool = True


@dataclass
class S3Config:
    bucket: str = ""
    prefix: str = "shoal/"
    endpoint_url: str = ""
    region: str = ""
    profile: str = ""
    capacity: int | None = None
    create_bucket: bool = False


@dataclass
class AuthConfig:
    check: bool = True
    ttl: float = 60.0
    negative_ttl: float = 5.0


@dataclass
class NodesConfig:
    token_file: str = ""


@dataclass
class RegionConfig:
    listen: str = "127.0.0.1:5080"
    origin: str = ""
    store: str = "/var/lib/shoal/region"
    backend: str = "disk"
    origin_timeout: float = 30.0
    origin_verify_tls: bool = True
    io_threads: int = 32
    block_size: int = 1 << 20
    plain_http: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_dir: str = ""
    tls_names: list = field(default_factory=list)
    disk: DiskConfig = field(default_factory=DiskConfig)
    s3: S3Config = field(default_factory=S3Config)
    auth: AuthConfig = field(default_factory=AuthConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    # The swarm's tracker and torrent metadata at /p2p/v1/ (p2p/, docs/p2p.md); metadata is
    # served only to clients the origin would serve the blob to.
    swarm: bool = True

    @property
    def listen_address(self) -> tuple[str, int]:
        host, sep, port = self.listen.rpartition(":")
        if not sep or not port.isdigit() or not host:
            raise UsageError(f"--listen {self.listen!r}: want HOST:PORT")
        return host.strip("[]"), int(port)

    def backend_options(self) -> dict:
        if self.backend == "disk":
            return {"root": self.store, "capacity": self.disk.capacity, "fsync": self.disk.fsync}
        if self.backend == "s3":
            s3 = self.s3
            if not s3.bucket:
                raise UsageError("backend s3 needs [s3] bucket in the configuration")
            return {
                "bucket": s3.bucket, "prefix": s3.prefix, "endpoint_url": s3.endpoint_url or None,
                "region": s3.region or None, "profile": s3.profile or None, "capacity": s3.capacity,
                "create_bucket": s3.create_bucket, "staging": str(Path(self.store) / "staging"),
            }
        raise UsageError(f"unknown backend {self.backend!r} (want disk or s3)")

    @property
    def state_dir(self) -> str:
        """The region's own CA, certificate and node token (0700)."""
        return self.tls_dir or str(Path(self.store) / "tls")

    @property
    def token_path(self) -> str:
        return self.nodes.token_file or str(Path(self.state_dir) / "node-token")


_SIZES = {"capacity", "block_size"}
_TABLES = {"disk": DiskConfig, "s3": S3Config, "auth": AuthConfig, "nodes": NodesConfig}


def _apply(obj: object, values: dict, where: str) -> None:
    known = {f.name: f for f in fields(obj)}
    for key, value in values.items():
        if key in _TABLES and where == "":
            if not isinstance(value, dict):
                raise UsageError(f"config: [{key}] must be a table")
            _apply(getattr(obj, key), value, key)
            continue
        if isinstance(value, dict) and where == "":
            continue  # another component's table
        if key not in known:
            raise UsageError(f"config: unknown option {where + '.' if where else ''}{key}")
        current = getattr(obj, key)
        if key in _SIZES:
            value = parse_size(value)
        elif isinstance(current, bool):
            if not isinstance(value, bool):
                raise UsageError(f"config: {where + '.' if where else ''}{key} must be true or false")
        elif isinstance(current, (int, float)) and not isinstance(value, (int, float)):
            raise UsageError(f"config: {where + '.' if where else ''}{key} must be a number")
        elif isinstance(current, str) and not isinstance(value, str):
            raise UsageError(f"config: {where + '.' if where else ''}{key} must be a string")
        elif isinstance(current, list) and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise UsageError(f"config: {where + '.' if where else ''}{key} must be a list of strings")
        setattr(obj, key, type(current)(value) if isinstance(current, float) else value)


def load_config(path: str | None = None, **overrides: object) -> RegionConfig:
    """Defaults, then the TOML file (if any), then non-None overrides (the flags)."""
    config = RegionConfig()
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as exc:
            raise UsageError(f"config {path}: {exc.strerror or exc}") from None
        except tomllib.TOMLDecodeError as exc:
            raise UsageError(f"config {path}: {exc}") from None
        _apply(config, data, "")
    for key, value in overrides.items():
        if value is not None:
            setattr(config, key, value)
    if not config.origin:
        raise UsageError("an origin registry is required (--origin URL or origin = in the config)")
    parsed = urlparse(config.origin)
    if parsed.scheme not in ("http", "https") or not parsed.netloc or parsed.path not in ("", "/"):
        raise UsageError(f"origin {config.origin!r}: want http://HOST[:PORT] or https://HOST[:PORT]")
    if config.plain_http and not is_loopback(config.listen_address[0]):
        raise UsageError(f"plain HTTP (--plain-http) only on a loopback address, not {config.listen}: "
                         "nodes send registry credentials to the region")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise UsageError("config: tls_cert and tls_key go together")
    if config.io_threads < 1 or config.block_size < 4096:
        raise UsageError("config: io_threads must be >= 1 and block_size >= 4K")
    return config
