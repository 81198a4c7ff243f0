"""`shoal profile`: record which chunks an image's start reads, and publish it.

    shoal profile save REF [--root ROOT] (--push | --out FILE) [--plain-http]
    shoal profile show REF [--plain-http] [--json]

`save` takes what the node at ROOT noted while containers of REF ran (every chunk their
reads used, in order of first use) and publishes it next to the image
(builder/profile.py). Nodes that prepare the image afterwards fetch those chunks first, in
large requests, while containerd prepares the layers.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from shoal.errors import ShoalError, UsageError

DEFAULT_ROOT = "/var/lib/shoal"


def _resolve(ref: str, plain_http: bool, platform: str | None):
    """(DockerRef, plain HTTP?, manifest digest, layer digests) of an image in a registry."""
    from builder.oci.documents import parse_manifest
    from builder.oci.registry import RegistrySource
    from snapshotter.pull import image_ref, resolve_manifest

    _, parsed, plain = image_ref(ref, plain_http)
    src = RegistrySource(parsed, plain_http=plain)
    try:
        _, manifest, _ = resolve_manifest(src, ref, platform)
    finally:
        src.close()
    layers = [d.digest for d in parse_manifest(manifest.data, ref).layers]
    return parsed, plain, manifest.digest, layers


def _summary(ref: str, profile, where: str) -> dict:
    per_layer = Counter(d for d, _, _ in profile.chunks)
    return {
        "image": ref, "manifest": profile.manifest, "chunks": len(profile.chunks),
        "compressed_bytes": profile.compressed_bytes,
        "layers": [{"digest": d, "chunks": n} for d, n in per_layer.items()], "where": where,
    }


def _print(summary: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(summary))
        return
    print(f"{summary['image']}  {summary['manifest']}: {summary['chunks']} chunks, "
          f"{summary['compressed_bytes'] / 1e6:.1f} MB compressed ({summary['where']})")
    for layer in summary["layers"]:
        print(f"  {layer['digest']}  {layer['chunks']} chunks")


def cmd_save(args: argparse.Namespace) -> int:
    from builder.profile import Profile, push_profile
    from snapshotter.fs.client import FSClient

    if not args.push and not args.out:
        raise UsageError("say where the profile goes: --push (next to the image) and/or --out FILE")
    parsed, plain, manifest, layers = _resolve(args.ref, args.plain_http, args.platform)
    fs = FSClient(args.root)
    if not fs.running():
        raise ShoalError(f"no layer file system runs at {args.root}: run the image on that node first")
    chunks = fs.call("profile", layers=layers)["chunks"]
    if not chunks:
        raise ShoalError(f"the node at {args.root} has read nothing of {args.ref}'s layers yet: "
                         "start a container of it there first")
    profile = Profile(manifest, [(d, int(a), int(b)) for d, a, b in chunks])
    where = []
    if args.out:
        with open(args.out, "wb") as f:
            f.write(profile.to_json(layers))
        where.append(args.out)
    if args.push:
        where.append(push_profile(parsed.host, parsed.repository, profile, layers, plain))
    _print(_summary(args.ref, profile, "saved to " + ", ".join(where)), args.json)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from builder.profile import fetch_profile, profile_tag

    parsed, plain, manifest, layers = _resolve(args.ref, args.plain_http, args.platform)
    profile = fetch_profile(parsed.host, parsed.repository, manifest, plain, layers)
    if profile is None:
        raise ShoalError(f"{args.ref}: no access profile published (tag {profile_tag(manifest)})")
    _print(_summary(args.ref, profile, f"{parsed.host}/{parsed.repository}:{profile_tag(manifest)}"), args.json)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "profile", help="record and publish which chunks an image's start reads (prefetched by nodes)",
        description=(
            "An image's access profile lists the chunks its containers read first, in order. A node notes "
            "them as containers run; `save` publishes them next to the image, as the OCI artifact "
            "HOST/REPO:sha256-<manifest hex>.shoal-profile. A node that prepares the image later fetches "
            "those chunks in large requests before the container asks for them ([fetch] prefetch_profiles)."
        ),
    )
    ps = p.add_subparsers(dest="profile_command", metavar="{save,show}", required=True)
    s = ps.add_parser("save", help="publish what a node read of an image",
                      description="Turn what the node at --root read of REF's layers (since its layer file "
                      "system started) into REF's access profile. Run REF's start on that node first.")
    s.add_argument("ref", metavar="REF", help="HOST/REPO:TAG or HOST/REPO@sha256:... (docker:// optional)")
    s.add_argument("--root", default=DEFAULT_ROOT, help=f"the node's --root (default {DEFAULT_ROOT})")
    s.add_argument("--push", action="store_true", help="push the profile next to the image in its registry")
    s.add_argument("--out", metavar="FILE", help="write the profile's JSON to FILE")
    s.add_argument("--plain-http", action="store_true", help="HTTP to the registry (default for loopback)")
    s.add_argument("--platform", help="os/arch of an index (default: this machine's)")
    s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    s.set_defaults(func=cmd_save)
    w = ps.add_parser("show", help="the access profile published for an image")
    w.add_argument("ref", metavar="REF", help="HOST/REPO:TAG or HOST/REPO@sha256:...")
    w.add_argument("--plain-http", action="store_true", help="HTTP to the registry (default for loopback)")
    w.add_argument("--platform", help="os/arch of an index (default: this machine's)")
    w.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    w.set_defaults(func=cmd_show)
