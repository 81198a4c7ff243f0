"""Warm-read micro-benchmark of the layer file system: the FUSE loop, not the network.

    [PYTHONPATH=TREE] .venv/bin/python bench/fs_read.py [--quick] [--json] [--repeat N] [--threads T] [--ops N]

A converted layer (random bytes: a big file and many small ones) is pushed to a local
registry, prepared on a fresh node root (RemoteLayers: shoal-fs mounts it), and read
once whole so that every chunk is decompressed in the node's memory cache (1 GiB): every
read after that is answered by shoal-fs without the store or the network (the phases
start once the chunk store has written what the warm-up fetched). The kernel's
page cache of the files is dropped (posix_fadvise DONTNEED) before every buffered pass,
so each pass reaches shoal-fs. Phases, each `--repeat` times (the median is reported):

- `seq big`: the big file read sequentially in 1 MiB read(2)s (buffered: the kernel's
  read-ahead decides the request size), one thread;
- `small files`: every small file read whole, by `--threads` threads;
- `rand 4k` / `rand 128k`: `--threads` threads doing O_DIRECT preads of 4 KiB / 128 KiB
  at random aligned offsets of the big file: each pread is one READ request, so the
  syscall's latency is the request's round trip through shoal-fs (p50/p99 reported).

- `getxattr`: trusted.overlay.metacopy of every small file, over and over (answered
  ENODATA), by one thread: what overlayfs asks of each lower file it looks up, a third of
  the requests of a container's start (bench/fleet_start.py's fs_ops);
- `open+close`: every small file opened and closed, by one thread (OPEN and RELEASE).

For each: MB/s (the read phases), the FUSE requests of the phase's kind shoal-fs counted
(`ops.read`, `ops.getxattr`, `ops.open` of its status, and the mean bytes per READ), and
the CPU seconds shoal-fs used (utime + stime from /proc/PID/stat, all its threads; the
user part apart; per request).

The same file runs against an older tree (e.g. 16b26e4, shoal-fs on pyfuse3: `git
worktree add /tmp/x 16b26e4`, then PYTHONPATH=/tmp/x): it uses only what both have
(RemoteLayers, FSClient.ping/status/stop, tests.services.start_registry,
tests.test_lazy_fs.publish_tree/layer_labels), from the tree PYTHONPATH names.

--quick: a 64 MiB file, 400 small files, 1 repetition; well under a minute.
"""

from __future__ import annotations

import errno
import mmap
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

# The code under test: the tree PYTHONPATH names first (an older commit), else this one.
_TREE = Path(os.environ["PYTHONPATH"].split(os.pathsep)[0]) if os.environ.get("PYTHONPATH") else common.REPO
sys.path.insert(0, str(_TREE))

from snapshotter.remote import RemoteLayers
from tests.services import start_registry
from tests.test_lazy_fs import layer_labels, publish_tree

MEMORY_CACHE = 1 << 30
TICK = os.sysconf("SC_CLK_TCK")


def make_tree(root: Path, big: int, small: int) -> list[Path]:
    """A big file and `small` files of 4-64 KiB, random bytes (chunks do not compress)."""
    rng = random.Random(7)
    (root / "data/small").mkdir(parents=True)
    with open(root / "data/big", "wb") as f:
        f.writelines(rng.randbytes(1 << 20) for _ in range(big >> 20))
    names = []
    for i in range(small):
        name = Path("data/small") / f"f{i:05d}"
        (root / name).write_bytes(rng.randbytes(rng.randrange(4 << 10, 64 << 10)))
        names.append(name)
    return names


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of process `pid`, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) / TICK, int(fields[12]) / TICK


def drop_pages(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_whole(path: Path) -> int:
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, 1 << 20):
            n += len(chunk)
    finally:
        os.close(fd)
    return n


def in_threads(threads: int, work: list, fn) -> list:
    """fn(item) for every item, `threads` threads taking items in turn; their results."""
    results: list = []
    lock = threading.Lock()
    it = iter(work)

    def loop() -> None:
        own = []
        while True:
            with lock:
                item = next(it, None)
            if item is None:
                break
            own.append(fn(item))
        with lock:
            results.extend(own)

    ts = [threading.Thread(target=loop) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return results


def direct_reads(path: Path, size: int, count: int, threads: int, seed: int) -> tuple[int, list[float]]:
    """`count` O_DIRECT preads of `size` bytes at random aligned offsets; (bytes, latencies)."""
    file_size = os.path.getsize(path)
    rng = random.Random(seed)
    offsets = [rng.randrange(0, file_size // size) * size for _ in range(count)]
    local = threading.local()

    def one(offset: int) -> tuple[int, float]:
        if not hasattr(local, "fd"):
            local.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            local.buf = mmap.mmap(-1, size)  # page-aligned
            fds.append(local.fd)
        start = time.perf_counter()
        n = os.preadv(local.fd, [local.buf], offset)
        return n, time.perf_counter() - start

    fds: list[int] = []
    try:
        out = in_threads(threads, offsets, one)
    finally:
        for fd in fds:
            os.close(fd)
    return sum(n for n, _ in out), [t for _, t in out]


def fs_requests(layers: RemoteLayers, op: str = "read") -> int:
    """How many requests of kind `op` (read, getxattr, open) shoal-fs has answered."""
    return int(layers.fs.status().get("ops", {}).get(op, {}).get("count", 0))


def getxattrs(paths: list[Path], passes: int) -> tuple[int, list]:
    """What overlayfs asks of a lower file at its lookup, `passes` times over `paths`."""
    for _ in range(passes):
        for path in paths:
            try:
                os.getxattr(path, "trusted.overlay.metacopy")
            except OSError as e:
                if e.errno != errno.ENODATA:
                    raise
    return 0, []


def opens(paths: list[Path], passes: int) -> tuple[int, list]:
    for _ in range(passes):
        for path in paths:
            os.close(os.open(path, os.O_RDONLY))
    return 0, []


def measure(quick: bool, repeat: int, threads: int, ops: int = 0) -> dict:
    big, small, rand_ops = (64 << 20, 400, 2000) if quick else (256 << 20, 2000, 8000)
    rand_ops = ops or rand_ops
    work = Path(tempfile.mkdtemp(prefix="shoal-bench-fsread-"))
    registry = None
    layers = None
    try:
        common.say(f"tree under test: {_TREE}")
        names = make_tree(work / "tree", big, small)
        (work / "registry").mkdir()
        registry = start_registry(work / "registry", None)
        ref, layer = publish_tree(registry.host, "bench/fsread", work / "tree", work)
        layers = RemoteLayers(str(work / "root"), {"memory_cache": MEMORY_CACHE})
        prepared = layers.prepare("bench", "", layer_labels(ref, layer))
        assert prepared is not None
        mount = Path(prepared.path)
        big_path, small_paths = mount / "data/big", [mount / n for n in names]
        pid = int(layers.fs.ping()["pid"])
        common.say(f"shoal-fs pid {pid}; warming: every chunk into memory")
        read_whole(big_path)
        in_threads(threads, small_paths, read_whole)
        # the fetched chunks go to the store behind the reads (a thread of shoal-fs): let it
        # finish, or its CPU and disk writes land in the first phases' figures
        give_up = time.monotonic() + 300
        while layers.fs.status().get("store", {}).get("pending_writes", 0) and time.monotonic() < give_up:
            time.sleep(0.5)
        time.sleep(1.0)

        phases = {
            "seq big": (lambda: drop_pages([big_path]), lambda: (read_whole(big_path), [])),
            "small files": (lambda: drop_pages(small_paths),
                            lambda: (sum(in_threads(threads, small_paths, read_whole)), [])),
            "rand 4k": (None, lambda: direct_reads(big_path, 4096, rand_ops, threads, 1)),
            "rand 128k": (None, lambda: direct_reads(big_path, 128 << 10, rand_ops // 4, threads, 2)),
            "getxattr": (None, lambda: getxattrs(small_paths, max(1, 4 * rand_ops // small))),
            "open+close": (None, lambda: opens(small_paths, max(1, rand_ops // small))),
        }
        counted = {"getxattr": "getxattr", "open+close": "open"}
        figures: dict = {"tree": str(_TREE), "threads": threads, "repeat": repeat, "big_bytes": big,
                         "small_files": small, "phases": {}}
        for name, (before, fn) in phases.items():
            runs = []
            op = counted.get(name, "read")
            for _ in range(repeat):
                if before:
                    before()
                requests, (user, system) = fs_requests(layers, op), cpu_seconds(pid)
                start = time.perf_counter()
                nbytes, latencies = fn()
                seconds = time.perf_counter() - start
                user_after, system_after = cpu_seconds(pid)
                requests = fs_requests(layers, op) - requests
                user, system = user_after - user, system_after - system
                cpu = user + system
                run = {"seconds": seconds, "bytes": nbytes, "mb_s": nbytes / seconds / 1e6, "requests": requests,
                       "bytes_per_request": nbytes // requests if requests and nbytes else None, "fs_cpu_s": cpu,
                       "fs_user_s": user, "fs_cpu_us_per_request": cpu / requests * 1e6 if requests else None}
                if latencies:
                    q = statistics.quantiles(latencies, n=100)
                    run |= {"p50_us": q[49] * 1e6, "p99_us": q[98] * 1e6}
                runs.append(run)
                common.say(f"{name}: {run['mb_s']:.0f} MB/s, {requests} {op} requests, shoal-fs {cpu:.2f} CPU s")
            # the median run: by MB/s, or for a phase of metadata requests by CPU per request
            key = "mb_s" if name not in counted else "fs_cpu_us_per_request"
            best = sorted(runs, key=lambda r: r[key] or 0)[len(runs) // 2]
            figures["phases"][name] = {**best, "runs": [r[key] or 0 for r in runs]}
        return figures
    finally:
        if layers is not None:
            layers.fs.stop()
        if registry is not None:
            registry.stop()
        shutil.rmtree(work, ignore_errors=True)


def report(f: dict) -> str:
    rows = []
    for name, ph in f["phases"].items():
        rows.append([name, f"{ph['mb_s']:.0f}" if ph["bytes"] else "-", ph["requests"], ph["bytes_per_request"] or "-",
                     f"{ph['p50_us']:.0f}" if "p50_us" in ph else "-", f"{ph['p99_us']:.0f}" if "p99_us" in ph else "-",
                     f"{ph['fs_cpu_s']:.2f}", f"{ph['fs_user_s']:.2f}",
                     f"{ph['fs_cpu_us_per_request']:.0f}" if ph["fs_cpu_us_per_request"] else "-",
                     " ".join(f"{r:.0f}" for r in ph["runs"])])
    head = f"tree {f['tree']}, {f['threads']} threads, median of {f['repeat']}\n"
    return head + common.table(["phase", "MB/s", "requests", "B/READ", "p50 us", "p99 us", "fs CPU s", "user s",
                                      "CPU us/req", "runs (MB/s; us/req)"],
                               rows)


def main() -> int:
    p = common.parser(__doc__.split("\n", 1)[0])
    p.add_argument("--repeat", type=int, default=0, help="passes of each phase (default 3, --quick 1)")
    p.add_argument("--threads", type=int, default=4, help="reader threads of the parallel phases")
    p.add_argument("--ops", type=int, default=0, help="preads of the rand 4k phase (default 8000, --quick 2000; "
                   "rand 128k does a quarter)")
    args = p.parse_args()
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        sys.exit("bench/fs_read.py: needs root and /dev/fuse")
    figures = measure(args.quick, args.repeat or (1 if args.quick else 3), args.threads, args.ops)
    common.emit(figures, report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
