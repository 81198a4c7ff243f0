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


def push_files_profile(layout: str, host: str, repository: str, names: list[str], plain_http: bool = True) -> str:
    """Publish, as the access profile of the one-layer image in OCI layout `layout` (pushed
    as HOST/REPOSITORY), the chunks of its files `names`, in that order: what a recording
    that read them would publish, with no node reading anything (the region stays cold)."""
    import json

    from builder.inspect import read_toc
    from builder.oci.refs import open_source

    with open_source(f"oci:{layout}") as src:
        root = src.get_root()
        (layer,) = json.loads(root.data)["layers"]
        _, toc = read_toc(src, layer, "layer")
    by_name = {e.name.lstrip("./"): e for e in toc.files()}
    chunks = [(layer["digest"], c.start, c.end) for name in names for c in by_name[name].chunks]
    return profile.push_profile(host, repository, profile.Profile(root.digest, chunks), [layer["digest"]], plain_http)


def publish_layout_pieces(layout: str, tag: str, host: str, repository: str, plain_http: bool = True) -> int:
    """Publish the piece hashes of every lazy layer of the image tagged `tag` in OCI layout
    `layout`, pushed unchanged as HOST/REPOSITORY (what `shoal convert` to a registry does
    for the layers it writes); the number published."""
    import json
    import os

    from builder.format.footer import location_from_annotations
    from builder.oci.refs import open_source
    from builder.pieces import hash_file, push_pieces

    with open_source(f"oci:{layout}:{tag}") as src:
        layers = json.loads(src.get_root().data)["layers"]
    lazy = [ly for ly in layers if location_from_annotations(ly.get("annotations")) is not None]
    for ly in lazy:
        path = os.path.join(layout, "blobs", *ly["digest"].split(":"))
        push_pieces(host, repository, hash_file(path, ly["digest"]), plain_http)
    return len(lazy)
