"""One node's lazy start of one layer through the region, as `shoal node` reads it: the
TOC range, then the chunks of every file, through a FetchChain whose only source is a
RegionSource (so nothing can come from the origin directly), decoded and verified by
the node's chunk loader (cache/loader.py). Run in a lab namespace by
tests/test_region_ranges.py:

    python -m tests.region_reader REGION_URL REGISTRY REPOSITORY DIGEST SIZE ANNOTATIONS_JSON \
        --seed N --threads N --at EPOCH

prints one JSON object: {"toc": [start, end], "files": {name: sha256 of the content},
"asked": [[start, end], ...] (the compressed ranges asked of the region), "loads":
[[start, end, before, after], ...] (the TOC's and each file's compressed span, with the
region's fill position for the blob just before and just after it was read: the
region's /-/status `filling`, the blob's size once no fill runs)}. Exit 1 with one line
on stderr when a read fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import ssl
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from builder.format.footer import location_from_annotations
from builder.format.toc import decompress_toc, parse_toc
from cache.loader import NodeChunkLoader, SingleFlight
from cache.region.client import RegionLink, RegionSource
from cache.source import BlobRef, FetchChain
from shoal.errors import ShoalError


class _Memory:
    """The loader's chunk cache: a dict (each reader process is one node)."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def get(self, digest: str) -> bytes | None:
        with self._lock:
            return self._data.get(digest)

    def contains(self, digest: str) -> bool:
        with self._lock:
            return digest in self._data

    def put(self, digest: str, data: bytes) -> None:
        with self._lock:
            self._data[digest] = data


class _Recording(RegionSource):
    """A RegionSource that notes the compressed ranges asked of it."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.asked: list[list[int]] = []
        self._asked_lock = threading.Lock()

    def read_ranges(self, blob, ranges):
        with self._asked_lock:
            self.asked += [[a, b] for a, b in ranges]
        return super().read_ranges(blob, ranges)


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("region", "registry", "repository", "digest"):
        p.add_argument(name)
    p.add_argument("size", type=int)
    p.add_argument("annotations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--at", type=float, default=0.0, help="start at this time.time()")
    p.add_argument("--ca", default="", help="the region's CA (its HTTPS certificate chains to it)")
    args = p.parse_args()

    def fill_position() -> int:
        tls = ssl.create_default_context(cafile=args.ca or None)
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=tls))
        status = json.loads(opener.open(args.region + "/-/status", timeout=10).read())
        return (status["filling"].get(args.digest) or {"written": args.size})["written"]

    def timed_load(start: int, end: int, load):
        before = fill_position()
        out = load()
        loads.append([start, end, before, fill_position()])
        return out

    loads: list[list[int]] = []
    loc = location_from_annotations(json.loads(args.annotations))
    blob = BlobRef(args.registry, args.repository, args.digest, args.size, plain_http=True)
    source = _Recording(RegionLink(args.region, ca=args.ca))
    chain = FetchChain([source])
    time.sleep(max(0.0, args.at - time.time()))
    try:
        [compressed] = timed_load(loc.toc.offset, loc.toc.end,
                                  lambda: chain.read_ranges(blob, [(loc.toc.offset, loc.toc.end)]))
        toc = parse_toc(decompress_toc(compressed, loc.toc_digest, loc.toc.uncompressed), args.size)
        loader = NodeChunkLoader(blob, chain, _Memory(), SingleFlight(), args.digest, readahead=0)
        loader.set_layout([c for e in toc.files() for c in e.chunks])
        files = [e for e in toc.files() if e.chunks]
        random.Random(args.seed).shuffle(files)

        def read(entry) -> tuple[str, str]:
            data = b"".join(timed_load(entry.chunks[0].start, entry.chunks[-1].end,
                                       lambda: loader.load(entry.chunks, f"{args.digest} {entry.name}")))
            return entry.name, "sha256:" + hashlib.sha256(data).hexdigest()

        with ThreadPoolExecutor(args.threads) as pool:
            contents = dict(pool.map(read, files))
    except ShoalError as exc:
        print(f"region_reader: {exc}", file=sys.stderr)
        return 1
    finally:
        source.close()
    print(json.dumps({"toc": [loc.toc.offset, loc.toc.end], "files": contents, "asked": source.asked,
                      "loads": loads}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
