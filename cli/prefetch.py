"""`shoal prefetch` (warm nodes for an image) and `shoal profile` (record which chunks an
image's start reads, and publish it).

    shoal prefetch REF --root DIR [--mode profile|full] [--wait] [--timeout S] [--json]
    shoal prefetch REF --region URL (--nodes A,B | --nodelist EXPR | --nodes-file F) [--mode ...]
                   [--wait] [--timeout S] [--ready F] [--json] [--token-file F] [--ca F] [--plain-http]

    shoal profile record REF [--timeout S] (--push | --out FILE) [-- CMD ARGS...]
    shoal profile save REF [--root ROOT] (--push | --out FILE) [--plain-http]
    shoal profile show REF [--plain-http] [--json]

`record` runs the image once on an embedded node (snapshotter/embedded.py) and publishes
what its start read, merged with what earlier recordings published (the CI step after
`shoal convert`). `save` takes what the node at ROOT noted while containers of REF ran (every chunk their
reads used, in order of first use) and publishes it next to the image
(prefetch/profile.py). Nodes that prepare the image afterwards fetch those chunks first, in
large requests, while containerd prepares the layers.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

from shoal.config import DEFAULT_ROOT
from shoal.errors import ShoalError, UsageError


def _resolve(ref: str, plain_http: bool, platform: str | None):
    """(DockerRef, plain HTTP?, manifest digest, layer digests) of an image in a registry."""
    parsed, plain, manifest, descriptors = _resolve_descriptors(ref, plain_http, platform)
    return parsed, plain, manifest, [d.digest for d in descriptors]


def _resolve_descriptors(ref: str, plain_http: bool, platform: str | None):
    """(DockerRef, plain HTTP?, manifest digest, layer descriptors) of an image in a registry."""
    from snapshotter.warm import resolve_image

    return resolve_image(ref, plain_http, platform)


def _summary(ref: str, profile, where: str) -> dict:
    per_layer = Counter(d for d, _, _ in profile.chunks)
    return {
        "image": ref, "manifest": profile.manifest, "chunks": len(profile.chunks),
        "compressed_bytes": profile.compressed_bytes,
        "layers": [{"digest": d, "chunks": n} for d, n in per_layer.items()], "where": where,
        "commands": profile.commands,
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
    from prefetch.profile import Profile, fetch_profile
    from snapshotter.fs.client import FSClient

    if not args.push and not args.out:
        raise UsageError("say where the profile goes: --push (next to the image) and/or --out FILE")
    parsed, plain, manifest, layers = _resolve(args.ref, args.plain_http, args.platform)
    fs = FSClient(args.root)
    if not fs.running():
        raise ShoalError(f"no layer file system runs at {args.root}: run the image on that node first")
    chunks = fs.profile(layers)
    # Pages a profile prefetch put in the page cache (LayerFS.page_in) were read by the
    # kernel, not through shoal-fs: the trace lacks them, and they are the published
    # profile's chunks, so that profile goes first (a union, in first-use order).
    paged = sum(int(ly.get("paged_in_bytes") or 0) for ly in fs.status().get("layers", [])
                if ly.get("digest") in layers)
    profile = Profile(manifest, [(d, int(a), int(b)) for d, a, b in chunks])
    if paged:
        published = fetch_profile(parsed.host, parsed.repository, manifest, plain, layers)
        if published is not None:
            profile = published.merge(profile)
    if not profile.chunks:
        raise ShoalError(f"the node at {args.root} has read nothing of {args.ref}'s layers yet: "
                         "start a container of it there first")
    summary = _summary(args.ref, profile, "saved to " + _publish(args, parsed, plain, profile, layers))
    _print({**summary, "paged_in_bytes": paged}, args.json)
    return 0


def _publish(args: argparse.Namespace, parsed, plain: bool, profile, layers: list[str]) -> str:
    """Write the profile to --out and/or push it next to the image: where it went."""
    from prefetch.profile import push_profile

    where = []
    if args.out:
        with open(args.out, "wb") as f:
            f.write(profile.to_json(layers))
        where.append(args.out)
    if args.push:
        where.append(push_profile(parsed.host, parsed.repository, profile, layers, plain))
    return ", ".join(where)


def _interrupt_on_sigterm() -> None:
    import signal

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def cmd_record(args: argparse.Namespace) -> int:
    from builder.format.footer import location_from_annotations
    from prefetch.profile import Profile, fetch_profile
    from snapshotter.embedded import EmbeddedNode

    if not args.push and not args.out:
        raise UsageError("say where the profile goes: --push (next to the image) and/or --out FILE")
    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        raise UsageError(f"--timeout {args.timeout:g}: must be more than 0 and at most {MAX_TIMEOUT_S} seconds")
    command = list(args.after_dashes)
    parsed, plain, manifest, descriptors = _resolve_descriptors(args.ref, args.plain_http, args.platform)
    layers = [d.digest for d in descriptors]
    if not any(location_from_annotations(d.annotations) for d in descriptors):
        raise ShoalError(f"{args.ref}: no layer has a TOC, nothing to record: convert it first (shoal convert)")
    image = args.ref.removeprefix("docker://")
    _interrupt_on_sigterm()  # a cancelled CI job still stops what the embedded node started
    with EmbeddedNode([parsed.host] if plain else []) as node:  # its lazy reads over HTTP too
        node.pull(image, plain)
        code = node.run(image, command, args.timeout)
        if code not in (0, None):
            raise ShoalError(f"{image}: the recorded command exited with status {code}, profile not published "
                             f"(its last line: {node.container_log()})")
        if node.fs is None:
            raise ShoalError(f"{image}: the embedded node has no layer file system")
        chunks = node.fs.profile(layers)
    if not chunks:
        raise ShoalError(f"{image}: its start read nothing of its lazy layers: nothing to record")
    profile = Profile(manifest, [(d, int(a), int(b)) for d, a, b in chunks], [command])
    recorded = len(profile.chunks)
    published = fetch_profile(parsed.host, parsed.repository, manifest, plain, layers) if args.push else None
    if published is not None and not args.replace:
        profile = published.merge(profile)
    where = _publish(args, parsed, plain, profile, layers)
    summary = _summary(args.ref, profile, "saved to " + where)
    summary.update({"recorded_chunks": recorded, "merged_with": len(published.chunks) if published else 0,
                    "ran_past_timeout": code is None})
    _print(summary, args.json)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    from prefetch.profile import fetch_profile, profile_tag

    parsed, plain, manifest, layers = _resolve(args.ref, args.plain_http, args.platform)
    profile = fetch_profile(parsed.host, parsed.repository, manifest, plain, layers)
    if profile is None:
        raise ShoalError(f"{args.ref}: no access profile published (tag {profile_tag(manifest)})")
    _print(_summary(args.ref, profile, f"{parsed.host}/{parsed.repository}:{profile_tag(manifest)}"), args.json)
    return 0


MAX_TIMEOUT_S = 7 * 86400


def _node_list(args: argparse.Namespace) -> list[str]:
    """The nodes named by --nodes, --nodelist (Slurm hostlist syntax) or --nodes-file."""
    from prefetch.hostlist import expand, unique
    from shoal.errors import FormatError

    given = [o for o in ("nodes", "nodelist", "nodes_file") if getattr(args, o)]
    if len(given) != 1:
        raise UsageError("name the job's nodes once: --nodes A,B | --nodelist EXPR | --nodes-file F")
    try:
        if args.nodes:
            names = [n.strip() for n in args.nodes.split(",") if n.strip()]
            for n in names:  # plain names: the characters and length of a hostlist's
                if expand(n) != [n]:
                    raise FormatError(f"--nodes: {n[:80]!r} is not one node name (use --nodelist for ranges)")
        elif args.nodelist:
            names = expand(args.nodelist)
        else:
            with open(args.nodes_file, encoding="utf-8", errors="strict") as f:
                names = expand(" ".join(line.split("#", 1)[0] for line in f))
    except FormatError as e:
        raise UsageError(str(e)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--nodes-file {args.nodes_file}: {getattr(e, 'strerror', None) or e}") from None
    names = unique(names)
    if not names:
        raise UsageError("the node list is empty")
    return names


def _progress_line(image: str):
    import sys
    import time

    last = [0.0]

    def show(w) -> None:
        now = time.monotonic()
        if now - last[0] < 0.2:
            return
        last[0] = now
        loaded = sum(1 for r in w.layers if r["loaded"])
        sys.stderr.write(f"\r\x1b[K{image}: {w.warm_bytes / 1e6:,.1f} / {w.target_bytes / 1e6:,.1f} MB warm, "
                         f"{loaded}/{len(w.layers)} layers loaded")
        sys.stderr.flush()

    return show


def cmd_prefetch(args: argparse.Namespace) -> int:
    import sys

    from snapshotter.warm import default_node_name, warm_local

    if not 0 < args.timeout <= MAX_TIMEOUT_S:
        raise UsageError(f"--timeout {args.timeout:g}: must be more than 0 and at most {MAX_TIMEOUT_S} seconds")
    if not 0 < args.ready <= 1:
        raise UsageError(f"--ready {args.ready:g}: must be more than 0 and at most 1")
    if args.region:
        if args.root:
            raise UsageError("--root warms this node, --region the job's nodes: give one")
        return _prefetch_region(args, _node_list(args))
    if any(getattr(args, o) for o in ("nodes", "nodelist", "nodes_file")):
        raise UsageError("--nodes, --nodelist and --nodes-file go with --region; --root warms this node alone")
    if not args.root:
        raise UsageError("say which node: --root DIR (this node) or --region URL with the job's nodes")
    fetch: dict = {}
    if args.config:
        from dataclasses import asdict

        from snapshotter.node import load_config

        fetch = asdict(load_config(args.config).fetch)
    parsed, plain, manifest, descriptors = _resolve_descriptors(args.ref, args.plain_http, args.platform)
    from cache.source import BlobRef

    image = args.ref.removeprefix("docker://")
    blob = BlobRef(parsed.host, parsed.repository, manifest, None, plain)
    progress = _progress_line(image) if args.wait and not args.json and sys.stderr.isatty() else None
    try:
        result, _ = warm_local(image, blob, manifest, descriptors, args.root, args.mode, fetch,
                               args.node_name or default_node_name(), args.wait, args.timeout, progress)
    finally:
        if progress:
            sys.stderr.write("\r\x1b[K")
    node = result["nodes"][0]
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{image}  {manifest}: {result['state']} ({args.mode}): node {node['name']} {node['state']}, "
              f"{node['warm_bytes'] / 1e6:,.1f} of {node['target_bytes'] / 1e6:,.1f} MB in its chunk store"
              + ("" if result["profile_chunks"] is not None or args.mode == "full"
                 else "; the image has no access profile: only its TOCs were loaded"))
    if result["unpacked_layers"]:
        print(f"shoal prefetch: {image}: {len(result['unpacked_layers'])} layers have no TOC and are not warmed "
              f"(unpacked at prepare: {result['unpacked_layers'][0]}, ...)", file=sys.stderr)
    if result["state"] in ("timeout", "failed"):
        why = f"timed out after {args.timeout:g}s" if result["state"] == "timeout" else "failed"
        print(f"shoal prefetch: {image}: node {node['name']} not warm ({why}): {node['error']}", file=sys.stderr)
        return 1
    return 0


TOKEN_ENV = "SHOAL_PREFETCH_TOKEN_FILE"  # the preheat API token's file when --token-file is not given
CA_ENV = "SHOAL_REGION_CA"  # the region's CA when --ca is not given


def _api_token(args: argparse.Namespace) -> str:
    """The preheat API token: from --token-file, else the file $SHOAL_PREFETCH_TOKEN_FILE
    names (a copy of the region's STORE/tls/prefetch-token); never a flag's value."""
    import os

    from cache.region.tls import read_token

    path = args.token_file or os.environ.get(TOKEN_ENV, "")
    if not path:
        raise UsageError(f"--region needs the preheat API token: --token-file FILE or ${TOKEN_ENV} "
                         "(a copy of the region's STORE/tls/prefetch-token)")
    return read_token(path)


def _region_progress(image: str):
    import sys
    import time

    last = [0.0]

    def show(job: dict) -> None:
        now = time.monotonic()
        if now - last[0] < 0.2:
            return
        last[0] = now
        sys.stderr.write(f"\r\x1b[K{image}: {job['ready_nodes']}/{len(job['nodes'])} nodes warm "
                         f"(need {job['needed_nodes']}), {job['warm_bytes'] / 1e6:,.1f} / "
                         f"{job['target_bytes'] / 1e6:,.1f} MB, {job['state']}")
        sys.stderr.flush()

    return show


def _prefetch_region(args: argparse.Namespace, names: list[str]) -> int:
    """`shoal prefetch REF --region URL --nodes...`: a job of the region's preheat API."""
    import os
    import sys
    from urllib.parse import urlparse

    from prefetch.client import PreheatClient, PreheatError, not_warm_line

    url = urlparse(args.region)
    if url.scheme not in ("https", "http") or not url.netloc:
        raise UsageError(f"--region {args.region!r}: want https://HOST:PORT")
    if url.scheme == "http" and not args.plain_http:
        raise UsageError(f"--region {args.region}: plain HTTP only with --plain-http (a loopback region)")
    token = _api_token(args)
    image = args.ref.removeprefix("docker://")
    api = PreheatClient(args.region, token, ca=args.ca or os.environ.get(CA_ENV, ""))
    _interrupt_on_sigterm()  # a killed hook (Slurm's PrologEpilogTimeout) cancels its job
    job_id = ""
    try:
        try:
            job_id = api.create(image, names, mode=args.mode, timeout_s=args.timeout, ready_fraction=args.ready)
        except PreheatError as e:
            if e.status == 400:
                raise UsageError(str(e)) from None
            raise
        if not args.wait:
            job = api.get(job_id)
        else:
            progress = _region_progress(image) if not args.json and sys.stderr.isatty() else None
            try:
                job = api.wait(job_id, args.timeout + 30, progress)
            finally:
                if progress:
                    sys.stderr.write("\r\x1b[K")
    except KeyboardInterrupt:
        if job_id:
            try:
                api.cancel(job_id)
            except PreheatError:
                pass
        raise
    finally:
        api.close()
    if args.json:
        print(json.dumps(job))
    else:
        print(f"{image}  {job['manifest']}: job {job['id']} {job['state']} ({args.mode}): {job['ready_nodes']} of "
              f"{len(job['nodes'])} nodes warm, origin {job['origin_bytes'] / 1e6:,.1f} MB")
    if args.wait and job["state"] != "ready":
        print(f"shoal prefetch: {image}: job {job['id']} {job['state']}: {not_warm_line(job)}", file=sys.stderr)
        return 1
    return 0


def add_parser(sub) -> None:
    f = sub.add_parser(
        "prefetch", help="warm nodes for an image before a job starts it (the job-launch hook)",
        description=(
            "Warm nodes for REF: load the TOCs of its lazy layers into each node's layer file system and fetch "
            "the chunks its access profile names (--mode profile) or every chunk of its lazy layers (--mode full) "
            "into each node's chunk store. Warmth is measured by the node, not assumed. --root DIR warms this "
            "node alone, through its running `shoal node --root DIR` (per-node hooks such as a Slurm Prolog); "
            "--region URL with the job's nodes makes a job of the region's preheat API: the nodes registered with "
            "the region warm themselves and report how warm they are (a Slurm PrologSlurmctld)."
        ),
        epilog="exit status: 0 warm (or, without --wait, handed to the node), 1 not warm by --timeout or "
        "failed (one line naming what is not warm), 2 usage error.",
    )
    f.add_argument("ref", metavar="REF", help="HOST/REPO:TAG or HOST/REPO@sha256:... (docker:// optional)")
    f.add_argument("--root", help="warm the node whose --root this is (its layer file system must run)")
    f.add_argument("--region", metavar="URL", help="the region whose preheat API warms the job's nodes")
    f.add_argument("--token-file", metavar="FILE",
                   help=f"with --region: the preheat API token (default: the file ${TOKEN_ENV} names)")
    f.add_argument("--ca", metavar="FILE", help=f"with --region: the region's CA (default ${CA_ENV}, "
                   "else the system trust store)")
    f.add_argument("--nodes", metavar="A,B,...", help="the job's nodes (with --region)")
    f.add_argument("--nodelist", metavar="EXPR", help="the job's nodes in Slurm hostlist syntax, e.g. gpu[001-128]")
    f.add_argument("--nodes-file", metavar="FILE", help="the job's nodes, in hostlist syntax, one or more a line")
    f.add_argument("--mode", choices=("profile", "full"), default="profile",
                   help="profile: the chunks of the image's access profile (default); full: whole lazy layers")
    f.add_argument("--wait", action="store_true", help="wait until warm (progress on a terminal)")
    f.add_argument("--timeout", type=float, default=600.0, metavar="S", help="seconds to wait (default 600)")
    f.add_argument("--ready", type=float, default=1.0, metavar="F",
                   help="with --region: the fraction of nodes that must be warm (default 1)")
    f.add_argument("--node-name", help="this node's name in the result (default: the host name)")
    f.add_argument("--config", metavar="FILE", help="the node's configuration file (for [fetch] settings)")
    f.add_argument("--plain-http", action="store_true",
                   help="HTTP to the registry (default for loopback); with --region: allow an http:// region")
    f.add_argument("--platform", help="os/arch of an index (default: this machine's)")
    f.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    f.set_defaults(func=cmd_prefetch)

    p = sub.add_parser(
        "profile", help="record and publish which chunks an image's start reads (prefetched by nodes)",
        description=(
            "An image's access profile lists the chunks its containers read first, in order. A node notes "
            "them as containers run; `save` publishes them next to the image, as the OCI artifact "
            "HOST/REPO:sha256-<manifest hex>.shoal-profile. A node that prepares the image later fetches "
            "those chunks in large requests before the container asks for them ([fetch] prefetch_profiles)."
        ),
    )
    ps = p.add_subparsers(dest="profile_command", metavar="{record,save,show}", required=True)
    r = ps.add_parser(
        "record", help="run an image once on an embedded node and publish what its start read (the CI step)",
        description="Start REF once on a node of its own (shoal node and containerd under a temporary "
        "directory, removed after), with CMD if given after `--` (else the image's own command), until it "
        "exits or --timeout passes, and make what that start read REF's access profile. With --push, a "
        "profile already published for REF is merged with this recording (the union of their chunks in "
        "first-use order; --replace publishes this recording alone). The profile names the commands it "
        "was recorded with. Needs root, containerd and runc, as `shoal node` does.",
        usage="shoal profile record REF [--timeout S] [--push] [--out FILE] [--replace] [-- CMD ARGS...]")
    r.add_argument("ref", metavar="REF", help="HOST/REPO:TAG or HOST/REPO@sha256:... (a converted image)")
    r.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds the container may run; then it is stopped and what it read so far counts "
                   "(default 60)")
    r.add_argument("--push", action="store_true", help="push the profile next to the image in its registry")
    r.add_argument("--out", metavar="FILE", help="write the profile's JSON to FILE")
    r.add_argument("--replace", action="store_true", help="do not merge with the profile already published")
    r.add_argument("--plain-http", action="store_true", help="HTTP to the registry (default for loopback)")
    r.add_argument("--platform", help="os/arch of an index (default: this machine's)")
    r.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    r.set_defaults(func=cmd_record, after_dashes=[])
    s = ps.add_parser("save", help="publish what a node read of an image",
                      description="Turn what the node at --root read of REF's layers (since its layer file "
                      "system started) into REF's access profile. Run REF's start on that node first. Pages the node put "
                      "in the kernel's page cache from REF's published profile were read past that trace: the "
                      "published profile is then merged in first.")
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
