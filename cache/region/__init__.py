"""The region cache tier, a server and its client side by side:

- server.py: `shoal region`'s blob cache (aiohttp), read-through from the origin registry,
  speaking the registry blob API (nodes and containerd mirrors use it);
- client.py: RegionSource, the node's fetch source (cache.source.Source) for the region;
- upstream.py: the server's client of the origin, acting with each client's credentials;
- backends/: where the region keeps blobs (disk, s3), one interface;
- config.py: the TOML configuration and its defaults; cli.py: `shoal region`.

See docs/cache.md.
"""
