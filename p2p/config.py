"""[swarm] of the node configuration (SwarmConfig): what p2p/chain.py builds the swarm
from. Checked by shoal.config; importable without libtorrent (the node checks the table
before its file system process starts the swarm)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.config import build, host_port_check, limits, url_check

MiB = 1 << 20


@dataclass
class SwarmConfig:
    """[swarm] of the node configuration. Sizes in bytes, rates in bytes/s (0: no cap)."""

    enabled: bool = False  # the node turns the swarm on with swarm.enabled = true
    required: bool = True  # an enabled swarm that cannot start stops the node; false: it runs without (logged)
    storage: str = ""  # torrent storage folder (the node sets <root>/swarm)
    # libtorrent listen_interfaces (TCP); "" = advertise_ip (or the route to the region):6881
    listen: str = field(default="", metadata=limits(check=host_port_check))
    # where SSL torrents' peers connect (TLS); "" = the listen address, port + 1
    ssl_listen: str = field(default="", metadata=limits(check=host_port_check))
    advertise_ip: str = ""  # this node's address as peers see it; default: the route to the tracker
    metadata_url: str = field(default="", metadata=limits(check=url_check()))  # the region serving /p2p/v1/torrents; default: the node's region_url
    tracker_url: str = field(default="", metadata=limits(check=url_check()))  # announce here instead of the URL in the metadata
    upload_rate_limit: int = field(default=0, metadata=limits(min=0, size=True))  # applies to every peer, LAN included (peer class filter)
    download_rate_limit: int = field(default=0, metadata=limits(min=0, size=True))
    connections_limit: int = field(default=500, metadata=limits(min=2, max=65535))
    unchoke_slots: int = field(default=64, metadata=limits(min=1, max=65535))  # peers uploaded to at once
    peer_wait: float = field(default=1.0, metadata=limits(min=0, max=600))  # an on-demand read takes from the fallback what peers did not send by then
    settle_wait: float = field(default=0.5, metadata=limits(min=0, max=600))  # a first read of a blob waits this long at most to meet its peers
    stall_timeout: float = field(default=3.0, metadata=limits(min=0.1, max=600))  # bulk: without progress this long, fetch any piece nobody has
    fallback_extent: int = field(default=4 * MiB, metadata=limits(min=16 << 10, max=1 << 30, size=True))  # bulk: pieces fetched from the fallback per request
    fallback_threads: int = field(default=4, metadata=limits(min=1, max=256))
    storage_capacity: int = field(default=0, metadata=limits(min=0, size=True))  # bytes of torrent storage; 0: 25% of the free space at start
    verify_complete: bool = True  # check sha256 of a blob downloaded whole before seeding it
    ssrf_mitigation: bool = True  # libtorrent refuses loopback trackers not at /announce (tests turn it off)

    @classmethod
    def from_dict(cls, data: dict | None, warnings: list[str] | None = None) -> SwarmConfig:
        """Checked by shoal.config (ConfigError naming swarm.KEY); unknown keys go to
        `warnings`."""
        return build(cls, dict(data or {}), "swarm", warnings)
