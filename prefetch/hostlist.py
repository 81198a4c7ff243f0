"""Slurm's hostlist syntax, parsed without I/O: `gpu[001-128,200],cpu7` -> host names.

The grammar, as Slurm 22.05 (`scontrol show hostnames`) expands it:

    expression := item (SEP+ item)*          SEP is ',' or white space; empty items vanish
    item       := text? (group text?)*       text: letters, digits, '.', '_', '-'
    group      := '[' range (',' range)* ']' no suffix after the last group (`n[1-2]x` is refused)
    range      := NUMBER | NUMBER '-' NUMBER  lo <= hi; NUMBER is ASCII digits

- A range keeps the zero padding of its low end: `n[09-100]` is n09, n10, ..., n100
  (the width is the low end's digit count; the high end's padding does not count).
- Several groups in one item are a cartesian product, the leftmost group varying
  slowest: `r[1-2]n[01-02]` is r1n01, r1n02, r2n01, r2n02.
- Names come out in the order written, repeats kept (as Slurm does); `unique()` drops
  repeats for callers that want a set of nodes.

Limits (each a FormatError): at most MAX_EXPRESSION characters, MAX_RANGE hosts in one
range (Slurm's own limit), MAX_HOSTS hosts in all, MAX_NAME characters per host name.
Where Slurm is laxer than this grammar (white space or '+' inside brackets, an open
range `n[1-]`, an unclosed `n[`, characters such as '=', ']' or non-ASCII letters in a
name) this parser refuses: a job's node list comes from the scheduler, which writes
the canonical form.

`expand` raises only FormatError for bad input (the fuzz rule: accepted, or our own
error), and its work is bounded by the limits before any name is made.
"""

from __future__ import annotations

import re

from shoal.errors import FormatError

MAX_EXPRESSION = 1 << 20  # characters: 100,000 names written out one by one fit
MAX_RANGE = 65536  # hosts in one range: Slurm refuses more ("Too many hosts in range")
MAX_HOSTS = 100_000  # hosts in one expression
MAX_NAME = 255  # characters in one host name

_TEXT = re.compile(r"[A-Za-z0-9._-]*")
_ITEM = re.compile(r"(?:[^,\s\[]|\[[^\]]*\]?)+")  # an item: up to a separator outside brackets
_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def _show(expr: str) -> str:
    return repr(expr if len(expr) <= 80 else expr[:77] + "...")


def _parse_group(body: str, expr: str) -> list[str]:
    """The numbers of one bracket group's body (`001-128,200`), padded as written."""
    out: list[str] = []
    for part in body.split(","):
        m = _RANGE.fullmatch(part)
        if m is None:
            raise FormatError(f"hostlist {_show(expr)}: bad range {part[:40]!r} (want N or N-M, digits only)")
        lo_text, hi_text = m.group(1), m.group(2)
        if max(len(lo_text), len(hi_text or "")) > MAX_NAME:
            raise FormatError(f"hostlist {_show(expr)}: a host name longer than {MAX_NAME} characters")
        lo = int(lo_text)
        hi = int(hi_text) if hi_text is not None else lo
        if hi < lo:
            raise FormatError(f"hostlist {_show(expr)}: range {part[:40]!r} runs backwards")
        if hi - lo + 1 > MAX_RANGE:
            raise FormatError(f"hostlist {_show(expr)}: range {part[:40]!r} has more than {MAX_RANGE} hosts")
        if len(out) + hi - lo + 1 > MAX_HOSTS:
            raise FormatError(f"hostlist {_show(expr)}: more than {MAX_HOSTS} hosts")
        width = len(lo_text)
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _parse_item(item: str, expr: str) -> list[list[str]]:
    """An item as its pieces, each a list of alternatives: [text] for plain text, the
    numbers of a bracket group for a group."""
    pieces: list[list[str]] = []
    pos = 0
    after_group = False
    while pos < len(item):
        m = _TEXT.match(item, pos)
        assert m is not None  # the pattern matches the empty string
        if m.end() > pos:
            pieces.append([m.group()])
            pos = m.end()
            if after_group and pos == len(item):
                raise FormatError(f"hostlist {_show(expr)}: text after the last ']' of {item[:40]!r}")
            continue
        if item[pos] != "[":
            raise FormatError(f"hostlist {_show(expr)}: character {item[pos]!r} is not allowed in a host name")
        close = item.find("]", pos)
        if close < 0:
            raise FormatError(f"hostlist {_show(expr)}: '[' without ']'")
        body = item[pos + 1 : close]
        if "[" in body:
            raise FormatError(f"hostlist {_show(expr)}: brackets inside brackets")
        pieces.append(_parse_group(body, expr))
        after_group = True
        pos = close + 1
    return pieces


def expand(expr: str) -> list[str]:
    """The host names of a Slurm hostlist expression, in order (repeats kept). Raises
    FormatError naming the expression and what is wrong."""
    if not isinstance(expr, str):
        raise FormatError("hostlist: not a string")
    if len(expr) > MAX_EXPRESSION:
        raise FormatError(f"hostlist of {len(expr)} characters: more than {MAX_EXPRESSION}")
    hosts: list[str] = []
    for m in _ITEM.finditer(expr):
        item = m.group()
        names, longest = [""], 0
        for piece in _parse_item(item, expr):
            if len(names) * len(piece) + len(hosts) > MAX_HOSTS:
                raise FormatError(f"hostlist {_show(expr)}: more than {MAX_HOSTS} hosts")
            longest += max(map(len, piece))
            if longest > MAX_NAME:
                raise FormatError(f"hostlist {_show(expr)}: a host name longer than {MAX_NAME} characters")
            names = [n + p for n in names for p in piece]
        hosts.extend(names)
    return hosts


def unique(names: list[str]) -> list[str]:
    """`names` without repeats, in order of first appearance."""
    return list(dict.fromkeys(names))
