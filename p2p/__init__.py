"""The per-region swarm: torrent metadata per layer blob (metainfo), the region's
tracker and metadata service (tracker/), and the node's libtorrent session with the fetch
source on top of it (swarm, node). See docs/p2p.md."""
