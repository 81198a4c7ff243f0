"""`shoal pull` and `shoal status`: the node's command-line clients."""

from __future__ import annotations

import argparse
import json
import os

from shoal.config import DEFAULT_ROOT
from shoal.errors import ShoalError
from snapshotter.status import fetch_figures, node_status


def cmd_pull(args: argparse.Namespace) -> int:
    from snapshotter.pull import format_summary, pull

    summary = pull(args.ref, args.address, args.namespace, args.plain_http, args.snapshotter, args.platform)
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


def format_status(s: dict) -> str:
    lines = [f"shoal node at {s['root']}"]
    fs = s["fs_server"]
    if fs:
        held = fs.get("session_holder")
        lines.append(f"  layer file system: pid {fs['pid']} at {fs['mount']}"
                     + (f" (its FUSE session held by pid {held})" if held else " (no session holder: a crash ends the mount)"))
    else:
        lines.append("  layer file system: not running")
    lines.append(f"  lazy layers: {len(s['lazy_layers'])}")
    for ly in s["lazy_layers"]:
        lines.append(
            f"    {ly['digest']}  {ly['image']}  {ly.get('proof', 'pending')}  reads {ly['reads']} ({ly['read_bytes']:,} B)"
            f"  fetched {ly['fetched_chunks']} chunks ({ly['fetched_bytes']:,} B;"
            f" {ly.get('prefetched_chunks', 0)} by prefetch, {ly.get('readahead_chunks', 0)} read ahead of which"
            f" {ly.get('readahead_used', 0)} read since)  errors {ly['errors']}"
            f"  waited {ly.get('fetch_seconds', 0):.2f}s on sources, {ly.get('decode_seconds', 0):.2f}s decoding"
        )
    pf = s.get("prefetch") or {}
    if pf.get("queued_chunks"):
        lines.append(f"  prefetch (access profiles): {pf['queued_chunks']} chunks queued,"
                     f" {pf.get('jobs_pending', 0)} jobs pending, {pf.get('layers_waiting', 0)} layers not loaded yet")
    images = s.get("images") or []
    if images:
        lines.append(f"  images warmed (shoal prefetch; last measure): {len(images)}")
    for im in images:
        lines.append(f"    {im['manifest']}  {im['image']}  {im['mode']}: {im['warm_bytes']:,} of"
                     f" {im['target_bytes']:,} B warm{' (warm)' if im.get('warm') else ''}")
    for c in s.get("chains", []):
        if c["proof"] == "bad":
            lines.append(f"    BAD chain {c['chain']}: layer {c['layer']} of {c['image']} holds diff_id {c['diff_id']}")
    lines.append(f"  unpacked layers: {len(s['unpacked_layers'])}")
    for d in s["unpacked_layers"]:
        lines.append(f"    {d}")
    dp = s.get("data_path") or {}
    memory = dp.get("memory")
    if memory:
        lines.append(
            f"  chunk memory: {memory['memory_chunks']} chunks, {memory['memory_bytes']:,} of"
            f" {memory['memory_capacity']:,} B; hits {memory['memory_hits']}, misses {memory['memory_misses']}"
        )
    store = dp.get("store")
    if store:
        lines.append(
            f"  chunk store: {store.get('chunks', 0)} chunks, {store.get('size_bytes', 0):,} of"
            f" {store.get('capacity_bytes', 0):,} B; hits {store.get('hits', 0)}, misses {store.get('misses', 0)},"
            f" evictions {store.get('evictions', 0)}; {store.get('pending_writes', 0)} chunks waiting to be written"
        )
    for name, st in (dp.get("sources") or {}).items():
        lines.append(f"  source {name}: {st.get('requests', 0)} requests, {st.get('bytes', 0):,} B,"
                     f" {st.get('errors', 0)} errors, {st.get('verify_failures', 0)} verify failures,"
                     f" {st.get('hangs', 0)} hangs ({st.get('skipped', 0)} calls skipped while unhealthy)")
    f = s.get("fetch") or fetch_figures(dp)
    lines.append(
        f"  bytes from: store {f['bytes_from_store']:,}, peers {f['bytes_from_peers']:,},"
        f" region {f['bytes_from_region']:,}, origin {f['bytes_from_origin']:,}"
    )
    if f.get("manifest_bytes") or f.get("unpack_bytes"):  # the node process's own (counted by source above)
        lines.append(f"  of them: manifests {f.get('manifest_bytes', 0):,} B, layers to unpack"
                     f" {f.get('unpack_bytes', 0):,} B ({f.get('unpack_swarm_bytes', 0):,} B through the swarm)")
    if f["swarm"]:
        lines.append(
            f"  swarm: {f['peers_connected']} peers connected, {f['torrents']} blobs, {f['bytes_to_peers']:,} B to"
            f" peers, {f['hash_failures']} hash failures, {f['peers_banned']} peers banned"
        )
    creds = s.get("credentials") or []
    if creds:  # the CRI image service's (no secret)
        lines.append(f"  pull credentials from CRI: {len(creds)} repositories")
        lines += [f"    {c['registry']}/{c['repository']}  expires in {c['expires_in_s']:.0f}s" for c in creds]
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.root):
        raise ShoalError(f"{args.root}: no shoal node state here (use --root)")
    s = node_status(args.root)
    print(json.dumps(s) if args.json else format_status(s))
    return 0


def add_parser(sub) -> None:
    from snapshotter import DEFAULT_CONTAINERD_ADDRESS as DEFAULT_ADDRESS

    p = sub.add_parser(
        "pull", help="pull an image into containerd with lazy layers",
        description=(
            "Pull REF into containerd: manifest and config into its content store, and every layer prepared "
            "by shoal's snapshotter (lazily if the layer has a zstd:chunked TOC, else downloaded and unpacked "
            "by the node). Afterwards `ctr run --snapshotter shoal REF ID` starts at once."
        ),
    )
    p.add_argument("ref", metavar="REF", help="HOST/REPO:TAG or HOST/REPO@sha256:... (docker:// optional)")
    p.add_argument("--address", default=DEFAULT_ADDRESS, help=f"containerd's socket (default {DEFAULT_ADDRESS})")
    p.add_argument("--namespace", default="default", help="containerd namespace (default: default)")
    p.add_argument("--plain-http", action="store_true", help="HTTP to the registry (default for loopback)")
    p.add_argument("--snapshotter", default="shoal", help="the proxy snapshotter's name in containerd's config")
    p.add_argument("--platform", help="os/arch of an index to pull (default: this machine's)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_pull)

    s = sub.add_parser("status", help="what a node is doing: lazy and unpacked layers, cache and fetch figures")
    s.add_argument("--root", default=DEFAULT_ROOT, help=f"the node's --root (default {DEFAULT_ROOT})")
    s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    s.set_defaults(func=cmd_status)
