"""What a node is doing, as data: `shoal status` prints it, the node's /metrics serves it.

node_status(root) reads the node's root (the layer file system's control socket, the
snapshot metadata, the unpacked layers) and answers a dict; node_metrics(status) renders
it for Prometheus. Both are read-only and safe to call from any process on the node.
"""

from __future__ import annotations

import os

from shoal.errors import ShoalError


def node_status(root: str) -> dict:
    """What the node at root is doing: layers (lazy/unpacked), reads, cache and sources."""
    from snapshotter.fs import holder
    from snapshotter.fs.client import FSClient

    status: dict = {"root": root, "fs_server": None, "lazy_layers": [], "unpacked_layers": []}
    fs = FSClient(root)
    reply = _fs_status(fs)
    if reply is not None:
        held = holder.ping(root)  # the holder of its FUSE session (fs/holder.py): the mount survives the server
        status["fs_server"] = {"pid": fs.pid, "mount": fs.mnt, "uptime_s": reply.get("uptime_s"),
                               "version": fs.version, "session_holder": held["pid"] if held else None,
                               # FUSE requests answered so far, and the server's seconds on them, per opcode
                               "ops": reply.get("ops", {})}
        status["lazy_layers"] = reply.get("layers", [])
        status["data_path"] = reply.get("store", {})
        status["prefetch"] = reply.get("prefetch", {})
        # the repositories the fetch chain holds PullImage credentials for (no secret)
        status["credentials"] = reply.get("credentials", [])
    status["chains"] = remote_chains(root)
    for ly in status["lazy_layers"]:
        ly["proof"] = layer_proof(ly, status["chains"])
    unpacked = os.path.join(root, "unpacked")
    if os.path.isdir(unpacked):
        status["unpacked_layers"] = sorted("sha256:" + d for d in os.listdir(unpacked) if not d.startswith("."))
    from snapshotter.nodefetch import read_statistics

    status["node_fetch"] = read_statistics(root)
    status["fetch"] = fetch_figures(status.get("data_path") or {}, status["node_fetch"])
    from snapshotter.warm import warmth_records

    # each image's last measured warmth (shoal prefetch, the region's preheat jobs): compressed
    # bytes of its target (profile chunks or whole lazy layers) in the chunk store
    status["images"] = [{k: r.get(k) for k in ("image", "manifest", "mode", "warm_bytes", "target_bytes", "warm",
                                               "measured")} for r in warmth_records(root)]
    return status


STATUS_TIMEOUT = 30.0  # seconds a status waits for a busy layer file system server's answer


def _fs_status(fs) -> dict | None:
    """The layer file system server's status reply, or None when no server runs (no
    socket, or nobody listening on it, or no mount). ShoalError when one runs but does not
    answer within STATUS_TIMEOUT (a loaded node's server answers late): a status without
    its figures would read as a node whose server has served nothing."""
    try:
        answer = fs.ping(timeout=STATUS_TIMEOUT)
        if not os.path.ismount(fs.mnt):
            return None
        fs.pid, fs.version = answer["pid"], str(answer.get("version", ""))
        return fs.status(timeout=STATUS_TIMEOUT)
    except (FileNotFoundError, ConnectionRefusedError):
        return None
    except TimeoutError:
        raise ShoalError(f"the layer file system server of {fs.root} did not answer within {STATUS_TIMEOUT:g}s: "
                         "its figures are not known") from None
    except (KeyError, ValueError) as e:
        raise ShoalError(f"the layer file system server of {fs.root} answered its status badly: {e}") from None


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


def _bytes(table: object, name: str) -> int:
    row = table.get(name) if isinstance(table, dict) else None
    value = row.get("bytes", 0) if isinstance(row, dict) else 0
    return value if isinstance(value, int) else 0


def fetch_figures(data_path: dict, node: dict | None = None) -> dict:
    """Where the node's bytes came from, and what it gave its peers: the figures of
    `shoal status` and of the node's /metrics. Source bytes are compressed blob bytes
    (the region's and origin's count both paths: for the swarm, which fetches whole
    pieces of what no peer has, and around it); store bytes are decompressed chunks.
    verify_failures: per source, ranges whose bytes failed their check (a chunk's
    digest, a piece's SHA-1) and were asked of the next source. hangs: per source, calls
    that did not answer within the read deadline (the source was then skipped for a
    while, cache/source.py).
    `node`: what the node process fetched itself (snapshotter/nodefetch.py: manifests,
    configs, profiles, blobs of layers to unpack), added to the region's and origin's
    bytes; manifest_bytes and unpack_bytes say how much of them that was. A blob to
    unpack that came through the swarm's bulk path (unpack_swarm_bytes) is in the layer
    file system's figures by source (peers, and its fallback's region and origin) and
    not in the node process's own."""
    sources = data_path.get("sources") or {}
    swarm = sources.get("swarm") or {}
    node = node or {}
    own, manifests = node.get("sources") or {}, node.get("manifests") or {}
    blobs = node.get("blobs") or {}
    return {
        "bytes_from_store": (data_path.get("store") or {}).get("bytes_read", 0),
        "bytes_from_peers": swarm.get("bytes_from_peers", 0),
        "bytes_from_region": _bytes(sources, "region") + _bytes(own, "region") + _bytes(manifests, "region"),
        "bytes_from_origin": _bytes(sources, "origin") + _bytes(own, "origin") + _bytes(manifests, "origin"),
        "manifest_bytes": _bytes(manifests, "region") + _bytes(manifests, "origin"),
        "unpack_bytes": blobs.get("whole_bytes", 0),
        # of them through the swarm's bulk path (by source in the layer file system's figures: peers, region, origin)
        "unpack_swarm_bytes": blobs.get("whole_swarm_bytes", 0),
        "bytes_to_peers": swarm.get("bytes_to_peers", 0),
        "swarm": "swarm" in sources,
        "peers_connected": swarm.get("peers_connected", 0),
        "torrents": len(swarm.get("torrents") or []),
        "hash_failures": swarm.get("hash_failures", 0),
        "peers_banned": swarm.get("peers_banned", 0),
        # background reads (a preheat's) sparse over the pieces nobody had: read as asked from the region
        "sparse_reads_passed": swarm.get("sparse_reads_passed", 0),
        # bulk downloads that fetched extents other nodes own because no piece came for
        # stall_timeout (an owner gone, or slow): the region may serve those twice
        "stall_help_extents": swarm.get("stall_help_extents", 0),
        "verify_failures": {name: st.get("verify_failures", 0) for name, st in sources.items()
                            if "verify_failures" in st},
        "hangs": {name: st.get("hangs", 0) for name, st in sources.items() if "hangs" in st},
        # layers' TOCs read through the chain (their bytes are in the sources' above too)
        "tocs_loaded": (data_path.get("tocs") or {}).get("fetched", 0),
        "toc_bytes": (data_path.get("tocs") or {}).get("bytes", 0),
    }


def node_metrics(s: dict) -> str:
    """The node's /metrics text (Prometheus) from node_status()."""
    from shoal.metrics import render

    f = s["fetch"]
    counter, gauge = "counter", "gauge"
    swarm = f if f["swarm"] else {}  # no swarm figures from a node without one
    fuse_ops = sorted(((s["fs_server"] or {}).get("ops") or {}).items())  # (opcode, {count, seconds})
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
        ("shoal_node_tocs_fetched_total", counter, "Layer TOCs read through the fetch chain.", f.get("tocs_loaded")),
        ("shoal_node_toc_bytes_total", counter,
         "Compressed bytes of the layer TOCs read through the fetch chain (counted by source above too).",
         f.get("toc_bytes")),
        ("shoal_node_manifest_bytes_total", counter,
         "Manifest bytes the node fetched itself (counted by source above too).", f.get("manifest_bytes")),
        ("shoal_node_unpack_bytes_total", counter,
         "Compressed bytes of layers the node downloaded to unpack (counted by source above too).",
         f.get("unpack_bytes")),
        ("shoal_node_unpack_swarm_bytes_total", counter,
         "Of the bytes of layers to unpack, those that came through the swarm's bulk path (by source above too).",
         f.get("unpack_swarm_bytes")),
        ("shoal_node_uploaded_bytes_total", counter, "Bytes sent to swarm peers.", swarm.get("bytes_to_peers")),
        ("shoal_node_swarm_peers_connected", gauge, "Distinct peers connected.", swarm.get("peers_connected")),
        ("shoal_node_swarm_torrents", gauge, "Blobs in the swarm session.", swarm.get("torrents")),
        ("shoal_node_swarm_hash_failures_total", counter, "Pieces from peers that failed their hash.",
         swarm.get("hash_failures")),
        ("shoal_node_swarm_peers_banned_total", counter, "Peers banned for bad pieces.", swarm.get("peers_banned")),
        ("shoal_node_swarm_stall_help_extents_total", counter,
         "Extents of a bulk download fetched from the region for other nodes, the swarm having stalled.",
         swarm.get("stall_help_extents")),
        ("shoal_node_layers", gauge, "Layers provided by the node, by kind.",
         [({"kind": "lazy"}, len(s["lazy_layers"])), ({"kind": "unpacked"}, len(s["unpacked_layers"]))]),
        ("shoal_node_chains", gauge, "Chain ids the node provided, by proof state (lazy layers: pending|proven|bad).",
         [({"proof": p}, sum(c["proof"] == p for c in s.get("chains", []))) for p in ("pending", "proven", "bad")]),
        ("shoal_node_image_warm_bytes", gauge,
         "Compressed bytes of an image's prefetch target in the chunk store, at its last measure, by manifest digest.",
         [({"manifest": im["manifest"]}, im["warm_bytes"]) for im in s.get("images", [])]),
        ("shoal_node_image_target_bytes", gauge,
         "Compressed bytes of an image's prefetch target (profile chunks or whole lazy layers), by manifest digest.",
         [({"manifest": im["manifest"]}, im["target_bytes"]) for im in s.get("images", [])]),
        ("shoal_node_layer_fs_up", gauge, "1 when the layer file system server answers.", s["fs_server"] is not None),
        ("shoal_node_fuse_requests_total", counter,
         "FUSE requests the layer file system answered, by opcode (since the server started).",
         [({"op": op}, v.get("count")) for op, v in fuse_ops]),
        ("shoal_node_fuse_request_seconds_total", counter,
         ("Seconds the layer file system spent answering FUSE requests, by opcode (a READ's wait for its chunks "
          "is not in it: a worker thread answers those)."),
         [({"op": op}, v.get("seconds")) for op, v in fuse_ops]),
    ])
