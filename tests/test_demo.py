"""`make demo` (scripts/demo.py) end to end, as a user runs it: a real registry, region,
two nodes with containerd and the swarm in network namespaces of their own, convert,
profile record, prefetch through the region, lazy starts. What it prints is checked, and
that it leaves nothing behind (processes by the PIDs it names, mounts, namespaces, its
directories) when it finishes and when it is stopped in the middle (SIGTERM, as Ctrl-C).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.lab import netlab
from tests.services import stop_process

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "scripts" / "demo.py"
EXPECTED = 'hello from a lazy image: {"answer": 42}'

_MISSING = netlab.lab_missing(fuse=True)
pytestmark = [pytest.mark.registry, pytest.mark.containerd,
              pytest.mark.skipif(_MISSING is not None, reason=str(_MISSING))]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


def _running(pid: int, markers: list[str]) -> bool:
    """Whether `pid` is still one of the demo's processes (its command line names one of
    its directories or namespaces; a PID used again by another process is not)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().decode(errors="replace")
        with open(f"/proc/{pid}/stat") as fh:
            if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except OSError:
        return False
    return any(m in cmdline for m in markers)


def assert_nothing_left(out: str) -> None:
    """The demo's processes (the PIDs it says it stopped), mounts, namespaces and
    directories are all gone."""
    pids = [int(p) for p in re.search(r"^stopped PIDs ([\d ]*);", out, re.MULTILINE).group(1).split()]
    assert len(pids) >= 2, out[-3000:]  # at least the registry and the region, or the nodes
    work = re.search(r"work directory (\S+)", out).group(1)
    prefix = re.search(r"^hub: (\S+)h \(", out, re.MULTILINE).group(1)
    short = {m.group(1) for m in re.finditer(r"--root (/tmp/shd-[^/]+)/", out)}
    markers = [work, prefix, *short]
    deadline = time.monotonic() + 10
    while (alive := [p for p in pids if _running(p, markers)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert alive == [], f"still running: {alive}"
    assert "still running: none; mounts left: none; directories left: none" in out
    assert netlab.mounts_under(work, *short) == []
    namespaces = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    assert [ns for ns in namespaces if ns.startswith(prefix)] == []
    assert not os.path.exists(work) and not any(os.path.exists(d) for d in short)


def test_the_demo_tells_the_whole_story_and_leaves_nothing_behind():
    proc = subprocess.run([sys.executable, str(DEMO)], capture_output=True, text=True, timeout=900, env=_env(),
                          cwd=REPO, check=False)
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-4000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in out + proc.stderr
    # every step shows its heading and the commands it ran
    for command in ("hub$ shoal convert", "hub$ shoal inspect --plain-http --verify", "hub$ shoal profile record",
                    "hub$ shoal region", "node-a$ shoal node", "$ containerd --config", "hub$ shoal prefetch",
                    "node-a$ shoal pull", "node-b$ ctr "):
        assert command in out, command
    assert out.count("\n==> ") >= 10
    assert re.search(r"job \w+ ready \(profile\): 2 of 2 nodes warm", out), out[-3000:]
    # each node's container printed what the image's command prints, after its own `ctr run`
    for name in ("node-a", "node-b"):
        after = out.split(f"{name}$ ctr ", 1)[1]
        assert after.split("\n", 2)[1] == EXPECTED, after[:500]
    # per node and phase, where its bytes came from: none from the origin
    rows = re.findall(r"^(node-[ab]) (preheat|start|proof) +([\d,]+) +([\d,]+) +([\d,]+) +([\d,]+) +([\d,]+)$",
                      out, re.MULTILINE)
    assert len(rows) == 6, out[-3000:]
    figures = {(n, p): [int(v.replace(",", "")) for v in vals] for n, p, *vals in rows}
    assert all(f[3] == 0 for f in figures.values()), figures  # from origin
    assert all(figures[(n, "preheat")][2] > 0 for n in ("node-a", "node-b")), figures  # from the region
    # the origin served the fleet (preheat, starts, proofs) about one copy of the image
    m = re.search(r"^origin bytes for the fleet: ([\d,]+) = ([\d.]+) copies of the image", out, re.MULTILINE)
    assert m is not None, out[-3000:]
    image = int(re.search(r"^the image: ([\d,]+) bytes", out, re.MULTILINE).group(1).replace(",", ""))
    fleet = int(m.group(1).replace(",", ""))
    print(f"demo: origin served {fleet} bytes for the fleet, the image is {image}; "
          f"node-b proof from peers {figures[('node-b', 'proof')][1]}")
    assert image <= fleet <= 1.05 * image
    assert_nothing_left(out)


def test_a_demo_stopped_in_the_middle_cleans_up():
    """SIGTERM (what Ctrl-C does to the process group, as a signal to the demo) while the
    nodes pull: everything it started is stopped, unmounted and removed; exit 130."""
    proc = subprocess.Popen([sys.executable, str(DEMO)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), cwd=REPO)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("node-a$ shoal pull"):  # nodes, containerds, FUSE mounts, region: all up
                proc.send_signal(signal.SIGTERM)
                break
        rest, err = proc.communicate(timeout=120)
    finally:
        stop_process(proc, 60)  # (the test failed) SIGTERM first: the demo's cleanup
    out = "".join(lines) + rest
    assert proc.returncode == 130, f"{out[-3000:]}\n{err[-3000:]}"
    assert "demo: interrupted" in err and "Traceback" not in err
    assert_nothing_left(out)
