"""The node's swarm: one libtorrent session, and the fetch source on top of it.

Vocabulary: a node's *torrent* is one layer blob's torrent in its session (metadata from
the region, see p2p/metainfo.py); a *piece* is a [piece*plen, ...) slice of the
compressed blob; the torrent's *storage* is one sparse file per blob under
`<storage>/data/sha256-<hex>`. A torrent is in one of three modes:

- lazy: added for an on-demand read; no piece is wanted (priority 0) except those a read
  asks for. It still uploads every piece it has.
- bulk: every piece wanted (prefetch, background completion, `download()`).
- complete: every piece present and the file checked against the blob's sha256; seeded
  until evicted. Reads are pread()s of the file, with no call on the libtorrent session.

The parts, by job:
- p2p/session.py: the session, its owner thread (the only accessor of swarm state;
  others queue functions to it), torrents' lifetime, alerts, peer certificates;
- p2p/ondemand.py: the on-demand path (SwarmSource.read_ranges, a FUSE read waiting
  on it);
- p2p/bulk.py: the bulk path (whole blobs; the region fetches this node owns);
- p2p/extents.py: which node fetches which extent from the region (pure);
- p2p/fallback.py: pieces from the region and origin, SHA-1 checked, added to the torrent;
- p2p/tracker/client.py: every call to the region's swarm service (metadata,
  certificates, the tracker relay, ranks).

Swarm ties them together behind the API the node's fetch chain (p2p/chain.py), its
control socket (p2p/control.py) and the lab use.

Statistics: statistics() (per node) -- bytes from peers and to peers, bytes from the
fallback, on-demand pieces by where they came from, peers connected, hash failures and
bans, tracker replies and errors.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from cache.source import BlobRef, FetchChain
from p2p.bulk import Bulk
from p2p.config import SwarmConfig
from p2p.fallback import Fallback
from p2p.ondemand import OnDemand
from p2p.session import Session, Torrent
from p2p.tracker.client import MetadataClient


class Swarm:
    """A node's libtorrent session and its torrents (see the module doc).

    fallback: where pieces nobody has come from (a FetchChain of region and origin), or
    None. metadata: the region's metadata client. Thread-safe; close() stops everything.
    """

    def __init__(self, config: SwarmConfig, metadata: MetadataClient, fallback: FetchChain | None) -> None:
        self.config = config
        self.fallback = fallback
        self.session = Session(config, metadata)
        pieces = Fallback(self.session, fallback)
        self.ondemand = OnDemand(self.session, pieces, config)
        self.bulk = Bulk(self.session, pieces if fallback is not None else None, config)

    @property
    def metadata(self) -> MetadataClient:
        return self.session.metadata

    @metadata.setter
    def metadata(self, client: MetadataClient) -> None:
        self.session.metadata = client

    @property
    def listen_port(self) -> int:
        return self.session.listen_port

    @property
    def ssl_listen_port(self) -> int:
        return self.session.ssl_listen_port

    def start(self) -> Swarm:
        self.session.start()
        return self

    def close(self) -> None:
        self.session.close()

    def ensure(self, blob: BlobRef, bulk: bool = False) -> Torrent | None:
        """The blob's torrent, added on first use (lazy, or with every piece wanted if
        `bulk`); None when no metadata is to be had."""
        return self.session.ensure(blob, bulk)

    def read(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The on-demand path (p2p/ondemand.py). NotHere without metadata."""
        return self.ondemand.read(blob, ranges)

    def download(self, blob: BlobRef, timeout: float | None = None) -> str:
        """Bulk: the whole blob through the swarm (fallback for what no peer has);
        returns the path of the complete, verified file. NotHere without metadata."""
        return self.bulk.download(blob, timeout)

    def start_download(self, blob: BlobRef) -> Future:
        return self.bulk.start_download(blob)

    def has(self, blob: BlobRef) -> str:
        """"complete", "partial" or "" (not in the swarm)."""
        return self.session.has(blob)

    def pieces_held(self, blob: BlobRef) -> tuple[int, int]:
        """(pieces of the blob held now, pieces in all); (-1, 0): not in the swarm."""
        return self.session.pieces_held(blob)

    def drop(self, blob: BlobRef, why: str) -> None:
        """Remove the blob's torrent and its storage (not waited for); a later read adds
        it again."""
        self.session.drop(blob, why)

    def statistics(self) -> dict:
        snap = self.session.snapshot()
        return {**self.session.counts(), **self.ondemand.statistics(), **snap, "listen_port": self.listen_port,
                "ssl_listen_port": self.ssl_listen_port, "metadata": self.metadata.statistics()}
