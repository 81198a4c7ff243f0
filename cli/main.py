"""The `shoal` command: one entry point, one subcommand per job.

Exit status: 0 success, 1 a failure the user can act on (one line on stderr naming what
and why), 2 a usage error. `--json` prints one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import time

from shoal.errors import ShoalError, UsageError

log = logging.getLogger("shoal")


class TerminalProgress:
    """A one-line progress display on stderr, redrawn at most 5 times a second."""

    def __init__(self, stream=sys.stderr):
        self.stream = stream
        self._last = 0.0
        self._label = ""
        self._start = time.monotonic()

    def __call__(self, label: str, done: int, total: int) -> None:
        now = time.monotonic()
        if label != self._label:
            self._label, self._start = label, now
        elif now - self._last < 0.2:
            return
        self._last = now
        rate = done / max(now - self._start, 1e-6) / 1e6
        text = f"{label}: {done / 1e6:,.0f} MB"
        if total:
            text += f" / {total / 1e6:,.0f} MB"
        self.stream.write(f"\r\x1b[K{text}  {rate:,.0f} MB/s")
        self.stream.flush()

    def finish(self) -> None:
        if self._label:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _print_convert(summary: dict) -> None:
    print(f"{summary['destination']}  {summary['digest']}")
    for ly in summary["layers"]:
        line = f"  {ly['source_digest'][:19]} -> {ly['digest'][:19]}  {ly['action']:<14}"
        if ly["action"] == "converted":
            ratio = ly["bytes_out"] / ly["bytes_in"] if ly["bytes_in"] else 0
            line += (
                f" {ly['files']:>6} files {ly['chunks']:>6} chunks"
                f"  {ly['bytes_in'] / 1e6:>9,.1f} MB -> {ly['bytes_out'] / 1e6:>8,.1f} MB ({ratio:.3f})"
                f"  {ly['seconds']:.1f}s"
            )
        print(line)
    d = summary["dedup"]
    print(
        f"  {d['unique_chunks']} unique chunks; {len(d['shared_between_layers'])} shared between layers"
        f" ({d['shared_between_layers_bytes'] / 1e6:,.1f} MB)"
    )
    if "shared_with_earlier_images" in d:
        print(
            f"  {len(d['shared_with_earlier_images'])} chunks already seen in earlier images"
            f" ({d['shared_with_earlier_images_bytes'] / 1e6:,.1f} MB)"
        )
    if summary.get("pieces"):
        print(f"  piece hashes of {len(summary['pieces'])} lazy layers published for the swarm "
              "(tags sha256-<layer hex>.shoal-pieces)")
    print(f"  {summary['bytes_in'] / 1e6:,.1f} MB -> {summary['bytes_out'] / 1e6:,.1f} MB in {summary['seconds']:.1f}s")


def cmd_convert(args: argparse.Namespace) -> int:
    from builder.convert import ConvertOptions, convert
    from builder.format.writer import SWITCH_INTERVAL

    if args.level < 1 or args.level > 22:
        raise UsageError("--level must be between 1 and 22")
    if not 64 << 10 <= args.chunk_size <= 4 << 20:
        raise UsageError("--chunk-size must be between 64 KiB and 4 MiB")
    opt = ConvertOptions(
        level=args.level,
        avg_chunk=args.chunk_size,
        threads=args.threads,
        platforms=args.platform or [],
        chunk_index=args.chunk_index,
        pieces=not args.no_pieces,
    )
    progress = TerminalProgress() if not args.json and sys.stderr.isatty() else None
    # the command owns its process, so it may set the interpreter's switch interval the
    # writer runs fastest with (a process-wide setting the library leaves alone)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, SWITCH_INTERVAL))
    try:
        summary = convert(args.src, args.dst, args.plain_http, opt, progress)
    finally:
        sys.setswitchinterval(switch)
        if progress:
            progress.finish()
    if args.json:
        print(json.dumps(summary))
    else:
        _print_convert(summary)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from builder.inspect import format_report, inspect

    report = inspect(args.ref, args.plain_http, args.verify)
    print(json.dumps(report) if args.json else format_report(report))
    if not report["ok"]:
        print("shoal inspect: verification failed (see the layers marked FAILED)", file=sys.stderr)
        return 1
    return 0


def cmd_pieces_push(args: argparse.Namespace) -> int:
    from builder.pieces_push import push_image_pieces

    progress = TerminalProgress() if not args.json and sys.stderr.isatty() else None
    try:
        summary = push_image_pieces(args.ref, args.plain_http, args.force, progress)
    finally:
        if progress:
            progress.finish()
    if args.json:
        print(json.dumps(summary))
        return 0
    for ly in summary["layers"]:
        if ly["action"] == "pushed":
            print(f"{ly['blob']}  pushed  {ly['pieces']} pieces of {ly['piece_length'] >> 10} KiB  {ly['reference']}")
        else:
            print(f"{ly['blob']}  present")
    return 0


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 1M, 512K)") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shoal",
        description="Container image acceleration and P2P distribution for large training fleets.",
    )
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser(
        "convert",
        help="rewrite an image's layers as lazy-loadable zstd:chunked",
        description=(
            "Convert every layer of SRC into a zstd:chunked layer (one zstd frame per file, large files "
            "cut into content-defined chunks, a table of contents at the end) and write the image to DST. "
            "The result is still a valid OCI image: decompressing a layer gives the source tar byte for byte, "
            "so diff_ids, config, history and labels are unchanged. Layers that are already zstd:chunked are "
            "kept as they are."
        ),
        epilog=(
            "references: docker://HOST/REPO:TAG, docker://HOST/REPO@sha256:..., oci:DIR[:TAG], "
            "docker-archive:FILE (SRC only). Registry credentials come from the docker config.json "
            "($DOCKER_CONFIG or ~/.docker) or $REGISTRY_AUTH_FILE."
        ),
    )
    c.add_argument("src", metavar="SRC", help="the image to convert")
    c.add_argument("dst", metavar="DST", help="where to write the converted image")
    c.add_argument("--plain-http", action="store_true", help="talk HTTP, not HTTPS, to registries")
    c.add_argument("--json", action="store_true", help="print a JSON summary on stdout (no progress bar)")
    c.add_argument(
        "--platform", action="append", metavar="OS/ARCH[/VARIANT]",
        help="convert only this platform of a multi-platform image (repeatable; default: all)",
    )
    c.add_argument("--level", type=int, default=3, help="zstd compression level (default 3)")
    c.add_argument(
        "--chunk-size", type=_size, default=1 << 20, metavar="SIZE",
        help="average content-defined chunk size of large files (default 1M)",
    )
    c.add_argument("--threads", type=int, default=max(1, os.cpu_count() or 1),
                   help="compression threads (default: the number of CPUs)")
    c.add_argument(
        "--chunk-index", metavar="FILE",
        help="SQLite file that remembers chunk digests across runs, to report chunks shared with earlier images",
    )
    c.add_argument(
        "--no-pieces", action="store_true",
        help="do not publish the layers' piece hashes (tags sha256-<layer hex>.shoal-pieces in DST's repository, "
             "so that a region offers a layer's torrent before it has the layer whole; registry DST only)",
    )
    c.set_defaults(func=cmd_convert)

    i = sub.add_parser(
        "inspect",
        help="list an image's layers and TOC statistics",
        description="Show the layers of REF and, for zstd:chunked layers, the statistics of their TOC.",
    )
    i.add_argument("ref", metavar="REF", help="docker://HOST/REPO:TAG or oci:DIR[:TAG] or docker-archive:FILE")
    i.add_argument("--plain-http", action="store_true", help="talk HTTP, not HTTPS, to registries")
    i.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    i.add_argument(
        "--verify", action="store_true",
        help="download every layer and check the blob digest, the diff_id, the TOC and every chunk digest "
        "(exit status 1 if any differs)",
    )
    i.set_defaults(func=cmd_inspect)

    pc = sub.add_parser(
        "pieces",
        help="publish the piece hashes of an image's lazy layers (for images converted without them)",
        description="Piece hashes let a region offer a layer's torrent before it holds the layer whole. "
                    "shoal convert publishes them for a registry destination; these commands do it for an "
                    "image already in a registry.",
    )
    psub = pc.add_subparsers(dest="pieces_command", metavar="COMMAND")
    psub.required = True
    pp = psub.add_parser(
        "push",
        help="hash each lazy layer of REF and push its piece hashes beside the image",
        description="Read each zstd:chunked layer of every platform of REF once (checked against its digest), "
                    "hash it in pieces and push the hashes under the tag sha256-<layer hex>.shoal-pieces in "
                    "REF's repository, as shoal convert does. Layers whose hashes are there already are "
                    "skipped.",
        epilog="REF: docker://HOST/REPO:TAG or docker://HOST/REPO@sha256:... Registry credentials come from "
               "the docker config.json ($DOCKER_CONFIG or ~/.docker) or $REGISTRY_AUTH_FILE.",
    )
    pp.add_argument("ref", metavar="REF", help="the image, in a registry")
    pp.add_argument("--plain-http", action="store_true", help="talk HTTP, not HTTPS, to the registry")
    pp.add_argument("--force", action="store_true", help="hash and push layers whose hashes are published already")
    pp.add_argument("--json", action="store_true", help="print a JSON summary on stdout (no progress bar)")
    pp.set_defaults(func=cmd_pieces_push)

    # Commands of the node and region components register themselves here; each module
    # has add_parser(subparsers). They are imported only if installed (shoal[node]).
    for module in COMMAND_MODULES:
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            if e.name and module.startswith(e.name):
                continue
            raise
        mod.add_parser(sub)
    return p


COMMAND_MODULES = ["cli.region", "cli.node", "cli.pull_status", "cli.install",
                   "cli.doctor", "cli.prefetch"]


# Subcommands that run a command of the user's: `shoal profile record REF ... -- CMD ARGS`
# gets CMD ARGS as `args.after_dashes`, whatever they look like (argparse alone would
# take their options as ours).
TAKES_COMMAND = [("profile", "record")]


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    if "--" in argv:
        i = argv.index("--")
        words = [a for a in argv[:i] if not a.startswith("-")]
        if any(tuple(words[: len(c)]) == c for c in TAKES_COMMAND):
            args = parser.parse_args(argv[:i])
            args.after_dashes = argv[i + 1 :]
            return args
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parse(parser, sys.argv[1:] if argv is None else argv)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="shoal: %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"shoal {args.command}: {e}", file=sys.stderr)
        return 2
    except ShoalError as e:
        print(f"shoal {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"shoal {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        # Local files: a destination that cannot be written, a full disk.
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"shoal {args.command}: {e.strerror or e}{where}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
