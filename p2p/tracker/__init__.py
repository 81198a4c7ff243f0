"""The region side of the swarm: tracker, metadata service (server.py), and the node's
client for the metadata service (client.py). The peer table is pure (peers.py)."""

PREFIX = "/p2p"  # where the region mounts the swarm service
TOKEN_HEADER = "X-Shoal-Node-Token"  # the region's node token on every /p2p/v1 call (server.py make_app)
