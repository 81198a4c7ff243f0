"""The per-region swarm: torrent metadata per layer blob (metainfo), the region's
tracker and metadata service and the node's clients of it (tracker/), and the node's
libtorrent session with the fetch source on top of it (swarm: session, ondemand, bulk,
extents, fallback; chain puts it in a node's fetch chain). See docs/p2p.md."""
