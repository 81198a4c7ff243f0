"""Lab shortcuts past the product's front doors: give a node an image's layers without
containerd, publish an access profile that no recording made (tests, demo, benchmarks).
"""

from __future__ import annotations

from prefetch import profile
from snapshotter.pull import PulledLayer, _Containerd, _provide_layers, chain_ids


def provide_layers(address: str, name: str, manifest_digest: str, layers: list[dict], diff_ids: list[str],
                   snapshotter: str = "shoal") -> list[PulledLayer]:
    """Have the snapshotter behind `address` provide an image's layers (what `shoal pull`
    does without the content, image and lease records). `address` may be a shoal node's
    own socket, which serves the same Snapshots API: tests and tools use a node without
    containerd this way. `name` is HOST/REPO[:TAG], `layers` the manifest's descriptors."""
    ctr = _Containerd(address, "default")
    try:
        return _provide_layers(ctr, snapshotter, name, manifest_digest, layers, chain_ids(diff_ids))
    finally:
        ctr.close()


def push_profile_bytes(host: str, repository: str, manifest_digest: str, blob: bytes, plain_http: bool = False) -> str:
    """Push `blob` as the profile of the image `manifest_digest`, unchecked (tests push bad
    ones; prefetch.profile.push_profile makes good ones); the reference it was pushed as."""
    return profile._push_blob(host, repository, manifest_digest, blob, plain_http)
