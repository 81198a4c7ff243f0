"""The region side of the swarm: tracker, metadata service (server.py), and the node's
client for the metadata service (client.py). The peer table is pure (peers.py)."""

PREFIX = "/p2p"  # where the region mounts the swarm service
from cache.region.tls import TOKEN_HEADER  # noqa: F401 (the region's node token on every /p2p/v1 call)
