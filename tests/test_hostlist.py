"""Slurm hostlist expressions (prefetch/hostlist.py) against Slurm's own expansion.

Slurm's answer comes from `scontrol show hostnames EXPR` of Debian's slurm-client
(22.05), run with a slurm.conf of the test's own (scontrol reads one, talks to no
daemon for this). Tests needing it are skipped, with the reason, only if it is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefetch.hostlist import MAX_HOSTS, MAX_NAME, MAX_RANGE, expand, unique
from shoal.errors import FormatError

SCONTROL = shutil.which("scontrol") or "/usr/bin/scontrol"

# (expression, what Slurm does): "same" = both expand it alike, "refused" = both refuse
# it, "stricter" = Slurm accepts it and we refuse it on purpose (see the module's doc).
TABLE = [
    ("gpu[001-128,200],cpu7", "same"),
    ("r[1-2]n[01-02]", "same"),
    ("n[1-2][3-4]", "same"),
    ("n[1-2,4][01-02]", "same"),
    ("rack[1-2]-node[1-3]", "same"),
    ("n[1-2]x[3-4]", "same"),
    ("x1y[1-2]", "same"),
    ("n1[1-2]", "same"),
    ("[1-2]", "same"),
    ("n[09-100]", "same"),
    ("n[001-1000]", "same"),
    ("n[8-010]", "same"),
    ("n[1-03]", "same"),
    ("n[010-11]", "same"),
    ("n[00-10]", "same"),
    ("n[1-3,02]", "same"),
    ("n[2,1]", "same"),
    ("n[1,1]", "same"),
    ("n[1-2],n[1-2]", "same"),
    ("n[3-3]", "same"),
    ("n[000]", "same"),
    ("n[18446744073709551615]", "same"),
    ("n[0-65535]", "same"),
    ("a,b c\td", "same"),
    ("a,,b", "same"),
    ("n[1-2],", "same"),
    (",n1", "same"),
    ("n-[1-2]", "same"),
    ("n.[1-2]", "same"),
    ("A[1-2],node_7", "same"),
    ("", "same"),
    ("n[1-2]x", "refused"),
    ("n[1-2]y[3]z", "refused"),
    ("a[1-3]-b", "refused"),
    ("n[2-1]", "refused"),
    ("n[]", "refused"),
    ("n[a-b]", "refused"),
    ("n[-1]", "refused"),
    ("n[1-2-3]", "refused"),
    ("n[1,,2]", "refused"),
    ("n[,1]", "refused"),
    ("n[1,]", "refused"),
    ("n[1-2]]", "refused"),
    ("n[1-2,[3-4]]", "refused"),
    ("n[1-2];x", "refused"),
    ("n[0-65536]", "refused"),
    ("n[0-100000]", "refused"),
    ("n[ 1-2]", "stricter"),
    ("n[+1-2]", "stricter"),
    ("n[1-]", "stricter"),
    ("n[1-3", "stricter"),
    ("n]", "stricter"),
    ("a=b", "stricter"),
    ("\u00e9[1-2]", "stricter"),
    ("n[0-99]m[0-999]p[0-9]", "stricter"),  # a million hosts: more than MAX_HOSTS
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """expand(EXPR) by Slurm: the list of names, or None if Slurm refuses it."""
    if not os.access(SCONTROL, os.X_OK):
        pytest.skip(f"{SCONTROL} is not installed (Debian package slurm-client)")
    conf = tmp_path_factory.mktemp("slurm") / "slurm.conf"
    conf.write_text("ClusterName=shoaltest\nSlurmctldHost=localhost\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}

    def run(expr: str) -> list[str] | None:
        proc = subprocess.run([SCONTROL, "show", "hostnames", "--", expr], capture_output=True, text=True,
                              env=env, timeout=30, check=False)
        if "Invalid hostlist" in proc.stdout + proc.stderr or "Too many hosts" in proc.stderr:
            return None
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.split()

    return run


def ours(expr: str) -> list[str] | None:
    try:
        return expand(expr)
    except FormatError:
        return None


@pytest.mark.parametrize(("expr", "kind"), TABLE, ids=[repr(e) for e, _ in TABLE])
def test_table_against_slurm(slurm, expr, kind):
    theirs, mine = slurm(expr), ours(expr)
    if kind == "same":
        assert theirs is not None and mine == theirs
    elif kind == "refused":
        assert theirs is None and mine is None
    else:
        assert theirs is not None and mine is None  # the table stays honest about Slurm


def test_examples_without_slurm():
    hosts = expand("gpu[001-128,200],cpu7")
    assert len(hosts) == 130 and hosts[:2] == ["gpu001", "gpu002"] and hosts[-2:] == ["gpu200", "cpu7"]
    assert expand("r[1-2]n[01-02]") == ["r1n01", "r1n02", "r2n01", "r2n02"]
    assert unique(expand("n[1-2],n[2-3]")) == ["n1", "n2", "n3"]


@pytest.mark.parametrize("expr", [
    f"n[0-{MAX_RANGE}]",  # one range too many
    "a[0-999]b[0-999]",  # a product past MAX_HOSTS
    ",".join(f"a[0-{MAX_RANGE - 1}]" for _ in range(2)),  # items adding up past it
    "x" * (MAX_NAME + 1),
    "x" * MAX_NAME + "[1-2]",
    "n[" + "9" * 5000 + "]",  # a number Python's int() would refuse to parse
    "n" * ((1 << 20) + 1),
])
def test_limits(expr):
    with pytest.raises(FormatError) as e:
        expand(expr)
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


def test_limit_is_reachable():
    assert len(expand(f"a[0-{MAX_RANGE - 1}],b[0-{MAX_HOSTS - MAX_RANGE - 1}]")) == MAX_HOSTS


@settings(max_examples=2000, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(alphabet="n[]-,0123456789 \t.", max_size=40) | st.text(max_size=40))
def test_fuzz_accepted_or_format_error(expr):
    try:
        hosts = expand(expr)
    except FormatError:
        return
    assert len(hosts) <= MAX_HOSTS and all(0 < len(h) <= MAX_NAME for h in hosts)


_number = st.integers(0, 300).map(str) | st.integers(0, 300).map(lambda n: str(n).zfill(3))


@st.composite
def _ranges(draw):
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        lo = draw(_number)
        if draw(st.booleans()):
            hi = int(lo) + draw(st.integers(0, 12))
            parts.append(f"{lo}-{draw(st.sampled_from([str(hi), str(hi).zfill(4)]))}")
        else:
            parts.append(lo)
    return "[" + ",".join(parts) + "]"


@st.composite
def _items(draw):
    text = st.text(alphabet="abgpu-._0123456789", min_size=0, max_size=4)
    item = ""
    for _ in range(draw(st.integers(1, 2))):
        item += draw(text) + draw(_ranges())
    return item if draw(st.booleans()) else draw(st.text(alphabet="abcn01-", min_size=1, max_size=6))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(_items(), min_size=1, max_size=3), st.sampled_from([",", " ", ",,"]))
def test_generated_against_slurm(slurm, items, sep):
    expr = sep.join(items)
    assert ours(expr) == slurm(expr), expr
