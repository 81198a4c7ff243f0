"""`shoal pull` and `shoal status`: the node's command-line clients."""

from __future__ import annotations

import argparse
import json
import os

from shoal.config import DEFAULT_ROOT
from shoal.errors import ShoalError


def cmd_pull(args: argparse.Namespace) -> int:
    from snapshotter.pull import format_summary, pull

    summary = pull(args.ref, args.address, args.namespace, args.plain_http, args.snapshotter, args.platform)
    print(json.dumps(summary) if args.json else format_summary(summary))
    return 0


def node_status(root: str) -> dict:
    """What the node at root is doing: layers (lazy/unpacked), reads, cache and sources."""
    from snapshotter.fs.client import FSClient

    status: dict = {"root": root, "fs_server": None, "lazy_layers": [], "unpacked_layers": []}
    fs = FSClient(root)
    if fs.running():
        reply = fs.status()
        status["fs_server"] = {"pid": fs.pid, "mount": fs.mnt, "uptime_s": reply.get("uptime_s")}
        status["lazy_layers"] = reply.get("layers", [])
        status["data_path"] = reply.get("store", {})
        status["prefetch"] = reply.get("prefetch", {})
    status["chains"] = remote_chains(root)
    for ly in status["lazy_layers"]:
        ly["proof"] = layer_proof(ly, status["chains"])
    unpacked = os.path.join(root, "unpacked")
    if os.path.isdir(unpacked):
        status["unpacked_layers"] = sorted("sha256:" + d for d in os.listdir(unpacked) if not d.startswith("."))
    status["fetch"] = fetch_figures(status.get("data_path") or {})
    return status


def remote_chains(root: str) -> list[dict]:
    """Every remote snapshot (a chain id the node provided) and its proof state."""
    from snapshotter.chainproof import (
        LABEL_CRI_IMAGE_REF,
        LABEL_IMAGE_REF,
        chain_id_of,
        proof_of,
    )
    from snapshotter.metadata import read_remote_records
    from snapshotter.snapshotter import LABEL_DIFF_ID, LABEL_LAYER_DIGEST, LABEL_PROOF

    return [{
        "chain": chain_id_of(rec), "parent": rec.parent, "kind": rec.layer_kind,
        "layer": rec.labels.get(LABEL_LAYER_DIGEST, ""),
        "image": rec.labels.get(LABEL_IMAGE_REF) or rec.labels.get(LABEL_CRI_IMAGE_REF, ""),
        "proof": proof_of(rec) or rec.labels.get(LABEL_PROOF, ""),
        "diff_id": rec.labels.get(LABEL_DIFF_ID, ""),
    } for rec in read_remote_records(os.path.join(root, "metadata.db"))]


def layer_proof(layer: dict, chains: list[dict]) -> str:
    """A lazy layer's proof: bad if refused or any chain made from it is bad, proven if
    every chain made from it is, else pending."""
    states = {c["proof"] for c in chains if c["layer"] == layer["digest"]}
    if layer.get("proof") == "bad" or "bad" in states:
        return "bad"
    return "proven" if states == {"proven"} else "pending"


def fetch_figures(data_path: dict) -> dict:
    """Where the node's bytes came from, and what it gave its peers: the figures of
    `shoal status` and of the node's /metrics. Source bytes are compressed blob bytes
    (the region's and origin's count both paths: for the swarm, which fetches whole
    pieces of what no peer has, and around it); store bytes are decompressed chunks.
    verify_failures: per source, ranges whose bytes failed their check (a chunk's
    digest, a piece's SHA-1) and were asked of the next source. hangs: per source, calls
    that did not answer within the read deadline (the source was then skipped for a
    while, cache/source.py)."""
    sources = data_path.get("sources") or {}
    swarm = sources.get("swarm") or {}
    return {
        "bytes_from_store": (data_path.get("store") or {}).get("bytes_read", 0),
        "bytes_from_peers": swarm.get("bytes_from_peers", 0),
        "bytes_from_region": (sources.get("region") or {}).get("bytes", 0),
        "bytes_from_origin": (sources.get("origin") or {}).get("bytes", 0),
        "bytes_to_peers": swarm.get("bytes_to_peers", 0),
        "swarm": "swarm" in sources,
        "peers_connected": swarm.get("peers_connected", 0),
        "torrents": len(swarm.get("torrents") or []),
        "hash_failures": swarm.get("hash_failures", 0),
        "peers_banned": swarm.get("peers_banned", 0),
        "verify_failures": {name: st.get("verify_failures", 0) for name, st in sources.items()
                            if "verify_failures" in st},
        "hangs": {name: st.get("hangs", 0) for name, st in sources.items() if "hangs" in st},
    }


def node_metrics(s: dict) -> str:
    """The node's /metrics text (Prometheus) from node_status()."""
    from shoal.metrics import render

    f = s["fetch"]
    counter, gauge = "counter", "gauge"
    swarm = f if f["swarm"] else {}  # no swarm figures from a node without one
    return render([
        ("shoal_node_fetched_bytes_total", counter,
         "Bytes read, by source (store: decompressed chunks; others: compressed blob bytes).",
         [({"source": k}, f[f"bytes_from_{k}"]) for k in ("store", "peers", "region", "origin")]),
        ("shoal_node_fetch_verify_failures_total", counter,
         "Ranges whose bytes failed their check (chunk digest, piece SHA-1), by source; the next source was asked.",
         [({"source": k}, v) for k, v in sorted(f["verify_failures"].items())]),
        ("shoal_node_fetch_hangs_total", counter,
         "Source calls without an answer within the read deadline, by source; the source was then skipped a while.",
         [({"source": k}, v) for k, v in sorted(f.get("hangs", {}).items())]),
        ("shoal_node_uploaded_bytes_total", counter, "Bytes sent to swarm peers.", swarm.get("bytes_to_peers")),
        ("shoal_node_swarm_peers_connected", gauge, "Distinct peers connected.", swarm.get("peers_connected")),
        ("shoal_node_swarm_torrents", gauge, "Blobs in the swarm session.", swarm.get("torrents")),
        ("shoal_node_swarm_hash_failures_total", counter, "Pieces from peers that failed their hash.",
         swarm.get("hash_failures")),
        ("shoal_node_swarm_peers_banned_total", counter, "Peers banned for bad pieces.", swarm.get("peers_banned")),
        ("shoal_node_layers", gauge, "Layers provided by the node, by kind.",
         [({"kind": "lazy"}, len(s["lazy_layers"])), ({"kind": "unpacked"}, len(s["unpacked_layers"]))]),
        ("shoal_node_chains", gauge, "Chain ids the node provided, by proof state (lazy layers: pending|proven|bad).",
         [({"proof": p}, sum(c["proof"] == p for c in s.get("chains", []))) for p in ("pending", "proven", "bad")]),
        ("shoal_node_layer_fs_up", gauge, "1 when the layer file system server answers.", s["fs_server"] is not None),
    ])


def format_status(s: dict) -> str:
    lines = [f"shoal node at {s['root']}"]
    fs = s["fs_server"]
    lines.append(f"  layer file system: pid {fs['pid']} at {fs['mount']}" if fs else "  layer file system: not running")
    lines.append(f"  lazy layers: {len(s['lazy_layers'])}")
    for ly in s["lazy_layers"]:
        lines.append(
            f"    {ly['digest']}  {ly['image']}  {ly.get('proof', 'pending')}  reads {ly['reads']} ({ly['read_bytes']:,} B)"
            f"  fetched {ly['fetched_chunks']} chunks ({ly['fetched_bytes']:,} B;"
            f" {ly.get('prefetched_chunks', 0)} by prefetch)  errors {ly['errors']}"
            f"  waited {ly.get('fetch_seconds', 0):.2f}s on sources, {ly.get('decode_seconds', 0):.2f}s decoding"
        )
    pf = s.get("prefetch") or {}
    if pf.get("queued_chunks"):
        lines.append(f"  prefetch (access profiles): {pf['queued_chunks']} chunks queued,"
                     f" {pf.get('jobs_pending', 0)} jobs pending, {pf.get('layers_waiting', 0)} layers not loaded yet")
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
    if f["swarm"]:
        lines.append(
            f"  swarm: {f['peers_connected']} peers connected, {f['torrents']} blobs, {f['bytes_to_peers']:,} B to"
            f" peers, {f['hash_failures']} hash failures, {f['peers_banned']} peers banned"
        )
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
