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
    fill_window = "4M"             # a range that starts at most this far past a running fill waits
                                   # for it; one farther ahead is read from the origin as a range
                                   # at once (docs/cache.md); "1T": every range waits for the fill

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
    token_file = ""                # the region's node secret (made at first start); "" = <tls_dir>/node-token.
                                   # A node presents its own token, `shoal region --node-token NAME`
                                   # (made from the secret; it speaks for NAME alone), or the secret itself
    shared_token = true            # accept the secret itself from any node (false: own tokens only)
    revoked = []                   # node names whose own tokens are refused

    [prefetch]
    token_file = ""                # the preheat API's secret (/prefetch/v1/jobs; made at first start);
                                   # "" = <tls_dir>/prefetch-token
    node_timeout = 30.0            # seconds without a word from a registered node before it is down
    hold_after_job = 30.0          # seconds a profile job's blobs stay held (ranges only) after it ends,
                                   # so that no whole-blob fill competes with the starts it lets go

Every value is checked at start (type and range; shoal/config.py): a bad one stops the
region with one line naming the key. An unknown key is a warning naming it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from builder.oci.registry import is_loopback
from shoal.config import DEFAULT_ROOT, host_port_check, limits, load, split_host_port, url_check
from shoal.errors import UsageError

log = logging.getLogger("shoal.region")

_SIZE = limits(min=0, size=True)


@dataclass
class DiskConfig:
    capacity: int | None = field(default=None, metadata=_SIZE)
    fsync: bool = True


@dataclass
class S3Config:
    bucket: str = ""
    prefix: str = "shoal/"
    endpoint_url: str = field(default="", metadata=limits(check=url_check()))
    region: str = ""
    profile: str = ""
    capacity: int | None = field(default=None, metadata=_SIZE)
    create_bucket: bool = False


@dataclass
class AuthConfig:
    check: bool = True
    ttl: float = field(default=60.0, metadata=limits(min=0, max=86400))
    negative_ttl: float = field(default=5.0, metadata=limits(min=0, max=86400))


@dataclass
class NodesConfig:
    token_file: str = ""
    shared_token: bool = True
    revoked: list[str] = field(default_factory=list)


@dataclass
class PrefetchConfig:
    token_file: str = ""
    node_timeout: float = field(default=30.0, metadata=limits(min=1, max=3600))
    hold_after_job: float = field(default=30.0, metadata=limits(min=0, max=3600))


@dataclass
class RegionConfig:
    listen: str = field(default="127.0.0.1:5080", metadata=limits(check=host_port_check))
    origin: str = field(default="", metadata=limits(check=url_check(path=False)))
    store: str = os.path.join(DEFAULT_ROOT, "region")
    backend: str = field(default="disk", metadata=limits(choices=("disk", "s3")))
    origin_timeout: float = field(default=30.0, metadata=limits(min=0.1, max=3600))
    origin_verify_tls: bool = True
    io_threads: int = field(default=32, metadata=limits(min=1, max=1024))
    block_size: int = field(default=1 << 20, metadata=limits(min=4096, max=64 << 20, size=True))
    plain_http: bool = False
    tls_cert: str = ""
    tls_key: str = ""
    tls_dir: str = ""
    tls_names: list[str] = field(default_factory=list)
    fill_window: int = field(default=4 << 20, metadata=limits(min=0, size=True))
    disk: DiskConfig = field(default_factory=DiskConfig)
    s3: S3Config = field(default_factory=S3Config)
    auth: AuthConfig = field(default_factory=AuthConfig)
    nodes: NodesConfig = field(default_factory=NodesConfig)
    # the preheat API and the nodes' work connection at /prefetch/v1/ (region/preheat.py, docs/prefetch.md)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    # The swarm's tracker and torrent metadata at /p2p/v1/ (p2p/, docs/p2p.md); metadata is
    # served only to clients the origin would serve the blob to.
    swarm: bool = True

    @property
    def listen_address(self) -> tuple[str, int]:
        try:
            return split_host_port(self.listen)
        except ValueError as e:
            raise UsageError(f"--listen {self.listen!r}: {e}") from None

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

    @property
    def prefetch_token_path(self) -> str:
        return self.prefetch.token_file or str(Path(self.state_dir) / "prefetch-token")


def load_config(path: str | None = None, **overrides: object) -> RegionConfig:
    """Defaults, then the TOML file (if any), then non-None overrides (the flags); every
    value checked (shoal/config.py), unknown keys logged as warnings."""
    config = load(RegionConfig, path, overrides, log)
    if not config.origin:
        raise UsageError("an origin registry is required (--origin URL or origin = in the config)")
    if config.plain_http and not is_loopback(config.listen_address[0]):
        raise UsageError(f"plain HTTP (--plain-http) only on a loopback address, not {config.listen}: "
                         "nodes send registry credentials to the region")
    if bool(config.tls_cert) != bool(config.tls_key):
        raise UsageError("config: tls_cert and tls_key go together")
    return config
