"""The region's assembly: the region cache (cache/region/) with the swarm service
(tracker and torrent metadata, p2p/tracker/) mounted on it, as `shoal region` serves
them (region/service.py). Imports cache and p2p; imported only by cli/."""
