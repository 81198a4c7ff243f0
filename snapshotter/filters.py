"""Walk filters: containerd's filter syntax (containerd/filters), parsed without I/O.

    match = parse_filters(['labels."containerd.io/snapshot.ref"==sha256:...,parent==P'])
    match(info)  # -> bool

The syntax is the contract's (snapshotter/snapshotter.py, "Walk filters"). Pure: a filter
either parses or raises InvalidArgument (one line naming the filter and the offset),
never any other exception; matching never raises.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from snapshotter.snapshotter import Info, InvalidArgument

# The grammar, from containerd's filters/parser.go:
#   selectors := selector ("," selector)*
#   selector  := fieldpath (operator value)
#   fieldpath := field ('.' field)*
#   field     := quoted | [A-Za-z0-9_]+
#   operator  := "==" | "!=" | "~="
#   value     := quoted | [^\s,]+
#   quoted    := <go string syntax>; fields take "..." only, values of ~= also /.../ and |...|

_PRESENT, _EQ, _NE, _MATCH = "?", "==", "!=", "~="
_QUOTES = '"/|'
_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v", "\\": "\\"}


@dataclass(frozen=True)
class _Selector:
    fieldpath: tuple[str, ...]
    op: str
    value: str = ""
    regex: re.Pattern | None = None


class _FilterParser:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def fail(self, message: str) -> InvalidArgument:
        return InvalidArgument(f"filter {self.text!r}: {message} at offset {self.pos}")

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        self.skip_space()
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def parse(self) -> list[_Selector]:
        selectors = [self.selector()]
        while True:
            ch = self.peek()
            if ch == "":
                return selectors
            if ch != ",":
                raise self.fail(f"unexpected input {ch!r}")
            self.pos += 1
            selectors.append(self.selector())

    def selector(self) -> _Selector:
        path = [self.field()]
        while self.peek() == ".":
            self.pos += 1
            path.append(self.field())
        if self.peek() in ("", ","):
            return _Selector(tuple(path), _PRESENT)
        op = self.operator()
        value = self.value(alt_quotes=op == _MATCH)
        regex = None
        if op == _MATCH:
            try:
                regex = re.compile(value)
            except re.error as e:
                raise self.fail(f"bad regular expression {value!r}: {e}") from None
        return _Selector(tuple(path), op, value, regex)

    def field(self) -> str:
        ch = self.peek()
        if ch == '"':
            return self.quoted()
        start = self.pos
        while self.pos < len(self.text) and (self.text[self.pos].isascii() and (
                self.text[self.pos].isalnum() or self.text[self.pos] == "_")):
            self.pos += 1
        if self.pos == start:
            raise self.fail("expected a field or a quoted string")
        return self.text[start:self.pos]

    def operator(self) -> str:
        self.skip_space()
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in "=!~":
            self.pos += 1
        op = self.text[start:self.pos]
        if op not in (_EQ, _NE, _MATCH):
            self.pos = start
            raise self.fail('expected an operator ("==", "!=" or "~=")')
        return op

    def value(self, alt_quotes: bool) -> str:
        ch = self.peek()
        if ch == "":
            raise self.fail("expected a value")
        if ch == '"' or (alt_quotes and ch in _QUOTES):
            return self.quoted()
        if ch in _QUOTES or ch in ",.":
            raise self.fail(f"unexpected {ch!r}")
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] != "," and not self.text[self.pos].isspace():
            self.pos += 1
        return self.text[start:self.pos]

    def quoted(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        out: list[str] = []
        while True:
            if self.pos >= len(self.text) or self.text[self.pos] == "\n":
                raise self.fail("quoted literal not terminated")
            ch = self.text[self.pos]
            self.pos += 1
            if ch == quote:
                return "".join(out)
            if ch != "\\":
                out.append(ch)
                continue
            esc = self.text[self.pos:self.pos + 1]
            self.pos += 1
            if esc in _ESCAPES:
                out.append(_ESCAPES[esc])
            elif esc == quote:
                out.append(quote)
            elif esc in ("x", "u", "U") or esc.isdigit():
                width, base = {"x": (2, 16), "u": (4, 16), "U": (8, 16)}.get(esc, (3, 8))
                digits = self.text[self.pos:self.pos + width] if esc in "xuU" else esc + self.text[self.pos:self.pos + 2]
                try:
                    out.append(chr(int(digits, base)))
                except ValueError:
                    raise self.fail("illegal escape sequence") from None
                self.pos += width if esc in "xuU" else 2
            else:
                raise self.fail("illegal escape sequence")


def _field(info: Info, path: tuple[str, ...]) -> tuple[str, bool]:
    """containerd's snapshot filter adaptor: (value, present)."""
    head = path[0]
    if head == "kind":
        return str(info.kind), True
    if head == "name":
        return info.name, True
    if head == "parent":
        return info.parent, True
    if head == "labels":
        if not info.labels:
            return "", False
        key = ".".join(path[1:])
        return (info.labels[key], True) if key in info.labels else ("", False)
    return "", False


def _matches(selectors: list[_Selector], info: Info) -> bool:
    for s in selectors:
        value, present = _field(info, s.fieldpath)
        if s.op == _PRESENT:
            ok = present
        elif s.op == _EQ:
            ok = present and value == s.value
        elif s.op == _NE:
            ok = value != s.value
        else:
            ok = s.regex is not None and s.regex.search(value) is not None
        if not ok:
            return False
    return True


def parse_filters(filters: Iterable[str]) -> Callable[[Info], bool]:
    """A predicate over Info for Walk filters (any filter matches; "" matches all).
    InvalidArgument when a filter does not parse."""
    parsed = []
    for text in filters:
        if text == "":
            return lambda info: True
        parsed.append(_FilterParser(text).parse())
    if not parsed:
        return lambda info: True
    return lambda info: any(_matches(selectors, info) for selectors in parsed)
