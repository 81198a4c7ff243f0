"""Small helpers shared by the benchmarks in bench/ (see DESIGN.md, "Measuring").

Every benchmark runs as `.venv/bin/python bench/NAME.py [--quick] [--json]`: progress on
stderr, a table for people on stdout, or with --json one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

REPO = Path(__file__).resolve().parent.parent
VENV_BIN = REPO / ".venv" / "bin"
SHOAL = VENV_BIN / "shoal"

T = TypeVar("T")


def parser(description: str) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark has."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a small version that finishes in about a minute")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures on stdout")
    return p


def say(message: str) -> None:
    """A progress line on stderr (stdout is kept for the table or the JSON)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def cache_dir() -> Path:
    """Where benchmarks keep expensive inputs between runs: $SHOAL_BENCH_CACHE or ~/.cache/shoal-bench."""
    path = Path(os.environ.get("SHOAL_BENCH_CACHE") or Path.home() / ".cache" / "shoal-bench")
    path.mkdir(parents=True, exist_ok=True)
    return path


def machine_speed() -> dict:
    """How fast this machine is now, by four fixed pieces of work on one core: seconds
    for 10^7 Python additions (the interpreter, cache-resident), MB/s of sha256, seconds
    to fault in 256 MiB of fresh anonymous memory (page faults, the kernel zeroing
    pages), and GB/s of copying a 64 MiB buffer that is already mapped (memory
    bandwidth). Machines of one kind differ by several times, one machine drifts within a
    run, and the interpreter's figure alone can stay put while the memory-bound ones move
    (a start is a memory-heavy mix); figures of two runs compare only through these."""
    import hashlib
    import mmap

    t0 = time.perf_counter()
    total = 0
    for i in range(10_000_000):
        total += i
    t1 = time.perf_counter()
    hashlib.sha256(bytes(64 << 20)).digest()
    t2 = time.perf_counter()
    area = mmap.mmap(-1, 256 << 20)
    for at in range(0, 256 << 20, mmap.PAGESIZE):
        area[at] = 1
    t3 = time.perf_counter()
    area.close()
    src, dst = bytearray(64 << 20), bytearray(64 << 20)
    dst[:] = src  # (both mapped before the timed copies)
    t4 = time.perf_counter()
    for _ in range(8):
        dst[:] = src
    t5 = time.perf_counter()
    return {"python_loop_s": round(t1 - t0, 3), "sha256_mb_s": round(64 * 1.048576 / (t2 - t1)),
            "fault_256mib_s": round(t3 - t2, 3), "copy_gb_s": round(8 * 64 * 1.048576 / 1000 / (t5 - t4), 2)}


def speed_line(m: dict) -> str:
    """machine_speed()'s figures in one line (a report's header)."""
    line = f"{m['python_loop_s']} s for the fixed Python loop, sha256 {m['sha256_mb_s']} MB/s"
    if "fault_256mib_s" in m:  # (runs recorded before these were measured lack them)
        line += f", {m['fault_256mib_s']} s to fault in 256 MiB, copies at {m['copy_gb_s']} GB/s"
    return line


def cores() -> int:
    return max(1, os.cpu_count() or 1)


def run(cmd: Sequence[str | os.PathLike], **kwargs) -> subprocess.CompletedProcess:
    """Run a command; on failure, exit the benchmark with its stderr."""
    kwargs.setdefault("capture_output", True)
    proc = subprocess.run([str(c) for c in cmd], check=False, **kwargs)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace") if isinstance(proc.stderr, bytes) else (proc.stderr or "")
        sys.exit(f"bench: {' '.join(map(str, cmd))} failed (exit {proc.returncode}): {err.strip()[-2000:]}")
    return proc


def timed(fn: Callable[[], T], repeat: int, before: Callable[[], None] | None = None) -> tuple[float, list[float], T]:
    """Call fn `repeat` times (after `before`, untimed, each time); (median seconds, all seconds, last result)."""
    times: list[float] = []
    result: T
    for _ in range(max(1, repeat)):
        if before:
            before()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times, result


def read_through(path: str | os.PathLike) -> None:
    """Read a file once, so every measurement starts with it in the page cache."""
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells[1:]]
    return "\n".join(out)


def emit_json(figures: dict) -> None:
    """The one JSON object a benchmark prints with --json."""
    print(json.dumps(figures, indent=2, sort_keys=True))


def emit(figures: dict, report, as_json: bool) -> None:
    """A benchmark's figures: the JSON object with --json, else report(figures)'s text."""
    if as_json:
        emit_json(figures)
    else:
        print(report(figures))


# --- network namespaces with a rate-limited loopback (bench/lazy_start.py) ---------------

from typing import Self


class NetNamespace:
    """A network namespace of the benchmark's own, with `lo` up and optionally a tbf rate
    limit on it: traffic between processes on 127.0.0.1 inside is limited (unix sockets
    are not, and no veth or outside address is involved).

    `.prefix` runs a command inside: `nsenter --net=/run/netns/NAME` enters the network
    namespace only. (`ip netns exec` also gives each command a new mount namespace, so a
    FUSE mount made by one process would not be seen by another: containerd could not
    stack overlays on shoal's mounts.) nsenter execs, so a Popen's pid is the command's.

    `.delete()` kills (by PID) whatever still runs inside and deletes the namespace;
    idempotent. Use as a context manager.
    """

    def __init__(self, name: str, rate: str | None = None, burst: str = "512kb", latency: str = "50ms") -> None:
        self.name, self.rate, self.burst, self.latency = name, rate, burst, latency
        self.created = False

    @property
    def path(self) -> str:
        return f"/run/netns/{self.name}"

    @property
    def prefix(self) -> list[str]:
        return ["nsenter", f"--net={self.path}", "--"]

    def create(self) -> Self:
        run(["ip", "netns", "add", self.name])
        self.created = True
        run(["ip", "-n", self.name, "link", "set", "lo", "up"])
        if self.rate:
            run(["tc", "-n", self.name, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", self.rate,
                 "burst", self.burst, "latency", self.latency])
        return self

    def qdisc(self) -> str:
        return run(["tc", "-n", self.name, "qdisc", "show", "dev", "lo"], text=True).stdout.strip()

    def pids(self) -> list[int]:
        proc = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False)
        return [int(p) for p in proc.stdout.split() if p.isdigit()]

    def delete(self) -> None:
        if not self.created:
            return
        kill_pids(self.pids())
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
        self.created = False

    def __enter__(self) -> Self:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.delete()


def kill_pids(pids: Sequence[int], grace: float = 5.0) -> None:
    """SIGTERM each pid, SIGKILL those still alive after `grace` seconds."""
    import signal

    alive = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            alive.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap our own children
    except ChildProcessError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def pids_mentioning(text: str) -> list[int]:
    """Processes (other than this one) whose command line contains `text`, e.g. a private
    work directory: everything the benchmark started there, daemons' children included."""
    needle, own, out = text.encode(), os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                if needle in fh.read():
                    out.append(int(entry))
        except OSError:
            continue
    return out


class CpuGroups:
    """CPU seconds by role, from cgroup v1 `cpuacct` groups of the benchmark's own
    (/sys/fs/cgroup/cpuacct/shoal-bench-cpu-PID/ROLE; root and a v1 cpuacct hierarchy
    needed, else `available` is False and every figure is empty).

    `add(role, pids)` moves running processes and all their descendants into ROLE's group
    (what they start later is born there); `path(role, leaf)` is a cgroup path for runc
    (`ctr run --cgroup`): a container's group nested in ROLE's, whose usage stays counted in
    ROLE's after the container's group is gone (v1 charges every ancestor). `prefix(role)`
    wraps a command so that it starts inside ROLE's group. `usage()`: role -> CPU seconds
    so far. `close()` moves what is left to the root group and removes the groups, in
    every hierarchy runc made them in."""

    BASE = Path("/sys/fs/cgroup")

    def __init__(self) -> None:
        self.name = f"shoal-bench-cpu-{os.getpid()}"
        self.root = self.BASE / "cpuacct" / self.name
        try:
            self.root.mkdir(exist_ok=True)
            self.available = True
        except OSError:
            self.available = False

    def _group(self, role: str) -> Path:
        d = self.root / role
        d.mkdir(exist_ok=True)
        return d

    def add(self, role: str, pids: Sequence[int]) -> None:
        if not self.available:
            return
        procs = self._group(role) / "cgroup.procs"
        for pid in self._with_descendants(pids):
            try:
                procs.write_text(f"{pid}\n")
            except OSError:
                pass  # gone meanwhile

    def path(self, role: str, leaf: str) -> str | None:
        if not self.available:
            return None
        self._group(role)
        return f"/{self.name}/{role}/{leaf}"

    def prefix(self, role: str) -> list[str]:
        if not self.available:
            return []
        procs = self._group(role) / "cgroup.procs"
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(procs)]

    def usage(self) -> dict[str, float]:
        if not self.available:
            return {}
        out = {}
        for d in sorted(self.root.iterdir()):
            try:
                out[d.name] = int((d / "cpuacct.usage").read_text()) / 1e9
            except (OSError, ValueError):
                pass
        return out

    @staticmethod
    def _with_descendants(pids: Sequence[int]) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
        out, todo = [], list(pids)
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo.extend(children.get(pid, []))
        return out

    def close(self) -> None:
        if not self.available:
            return
        deadline = time.monotonic() + 10  # processes killed just before may still be exiting
        while True:
            left = []
            for hierarchy in self.BASE.iterdir():
                top = hierarchy / self.name
                if not top.is_dir():
                    continue
                for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                    try:
                        for pid in (d / "cgroup.procs").read_text().split():
                            (hierarchy / "cgroup.procs").write_text(f"{pid}\n")
                        d.rmdir()
                    except OSError:
                        left.append(d)
            if not left:
                return
            if time.monotonic() > deadline:
                say(f"cleanup: cannot remove cgroups {[str(d) for d in left]}")
                return
            time.sleep(0.2)


def cpu_table(before: dict[str, float], after: dict[str, float], busy_s: float) -> dict[str, float]:
    """CPU seconds per role between two CpuGroups.usage() readings, and "other": the rest of
    the machine's busy seconds `busy_s` (the benchmark's own tools, the kernel's network)."""
    out = {role: round(after[role] - before.get(role, 0.0), 2) for role in after}
    out["other"] = round(max(0.0, busy_s - sum(out.values())), 2)
    return out
