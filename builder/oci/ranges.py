"""HTTP range reads: the one check of a `206 Partial Content` answer's Content-Range.

Every ranged GET in shoal (the registry client, the region client, the region server's
origin reads) asks `Range: bytes=START-LAST` for bytes [start, end) (LAST = end - 1) and
passes the answer's Content-Range header here. Pure (no I/O, no logging): a header that
is malformed or answers another range raises ContentRangeError and nothing else; each
caller maps that to its own error (TransportError, HTTP 502) with its own message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# RFC 9110 14.4: `bytes FIRST-LAST/COMPLETE-LENGTH`, the length "*" when unknown
_CONTENT_RANGE = re.compile(r"bytes ([0-9]+)-([0-9]+)/([0-9]+|\*)")


class ContentRangeError(ValueError):
    """A Content-Range header that is malformed or does not answer the range asked."""


@dataclass(frozen=True)
class ContentRange:
    first: int
    last: int  # inclusive, as on the wire
    total: int | None  # the blob's length; None for "*"


def parse_content_range(header: str) -> ContentRange:
    """`bytes a-b/n` (surrounding blanks allowed) -> ContentRange(a, b, n)."""
    match = _CONTENT_RANGE.fullmatch(header.strip())
    if match is None:
        raise ContentRangeError(f"malformed Content-Range {header[:100]!r}")
    first, last, total = match.groups()
    return ContentRange(int(first), int(last), None if total == "*" else int(total))


def check_content_range(header: str, start: int, end: int | None = None, size: int | None = None) -> ContentRange:
    """The Content-Range of an answer to a request for bytes [start, end).

    It must begin at `start`. With `end`, it may stop short of it (the caller's length
    check then sees a short body) but not run past it. With `size` too, it must be
    exactly [start, end) of a blob of `size` bytes.
    """
    got = parse_content_range(header)
    if got.first != start:
        raise ContentRangeError(f"Content-Range starts at {got.first}, want {start}")
    if end is not None and got.last > end - 1:
        raise ContentRangeError(f"Content-Range ends at {got.last}, want at most {end - 1}")
    if size is not None and (end is None or got.last != end - 1 or got.total != size):
        raise ContentRangeError(f"Content-Range {got.first}-{got.last}/{got.total}, want {start}-{end}/{size}")
    return got
