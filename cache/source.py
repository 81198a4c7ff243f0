"""The fetch interface: where a node gets the bytes of a layer blob.

Vocabulary:
- a *blob* is a layer blob named by its digest, in a repository of a registry (BlobRef);
- a *range* is [start, end) of its compressed bytes;
- a *source* is one place ranges can come from: the node's swarm, the region cache, the
  origin registry. Sources are tried in order by a FetchChain;
- a *check* is the caller's proof of a range: check(i, raw) returns what the caller keeps
  of range i (a chunk's decompressed, verified bytes; a piece; the raw bytes) or raises
  ShoalError when the bytes are not what the range should hold (a chunk's digest from the
  TOC, a piece's SHA-1, a TOC's digest, a whole blob's digest). The chain runs it on each
  source's answer before accepting it, so bytes are proven at the source they came from.

Contract for every Source:
- read_ranges() returns one bytes object per requested range, each exactly end - start
  long, or raises one of:
  - NotHere: "this source does not have the blob (now)": the chain moves on to the next
    source at once, counted as not_here. A source must say NotHere quickly (no long
    timeouts).
  - TransportError: the source should have had it but failed (refused, timed out, short
    read); the chain logs it, counts an error and moves on.
  - NotFound: the source was asked and says the blob does not exist there (an origin's
    404); treated as TransportError (logged, counted, next source).
  Anything else escaping a source is a bug and propagates.
- A source does not verify: the chain does, with the caller's check. An answer whose
  ranges fail their check counts as verify_failures of that source (logged once per
  source and blob, at WARNING, naming source, blob and the failing range), the source's
  report_bad() is told, and only the failed ranges are asked of the next source.
- report_bad(blob, ranges) is a hint that the source served bytes that failed their
  check (the region re-checks its stored copy); it must not block for long and never
  raises. The default does nothing.
- Sources are thread-safe: the FUSE file system calls them from worker threads.

The chain raises TransportError (naming every source's failure) when, for some range,
no source served bytes that passed its check: RangesFailed, carrying the results of the
other ranges, when only some failed.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.errors import NotFound, ShoalError, TransportError

log = logging.getLogger("shoal.fetch")


@dataclass(frozen=True)
class BlobRef:
    """A layer blob and where its origin is."""

    registry: str  # "host[:port]"
    repository: str
    digest: str
    size: int | None = None
    plain_http: bool = False

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}@{self.digest}"


class Held(bytes):
    """Bytes a source keeps on the node itself (the swarm's torrent storage): a caller
    that caches what it reads need not store a second copy."""

    __slots__ = ()


class NotHere(ShoalError):
    """This source does not have the blob; try the next one."""


class RangesFailed(TransportError):
    """Some ranges could not be fetched from any source; `served` holds the results of
    the others (index of the range -> what the check returned)."""

    def __init__(self, message: str, served: dict[int, Any]) -> None:
        super().__init__(message)
        self.served = served


class Source(abc.ABC):
    """One place ranges of blobs can come from."""

    name: str = "source"

    @abc.abstractmethod
    def read_ranges(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each [start, end) range of the blob (see the module contract)."""

    def report_bad(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> None:
        """The bytes this source served for `ranges` failed their check (a hint)."""

    def close(self) -> None:
        pass


# check(index of the range, its raw bytes) -> what the caller keeps; ShoalError if bad
Check = Callable[[int, bytes], Any]

_LOGGED_MAX = 10_000  # (source, blob) pairs whose verification failure was logged


@dataclass
class SourceStats:
    requests: int = 0
    ranges: int = 0
    bytes: int = 0
    not_here: int = 0
    errors: int = 0
    verify_failures: int = 0  # ranges whose bytes failed the caller's check
    seconds: float = 0.0


@dataclass
class FetchChain:
    """Tries each source in order for a set of ranges; counts what each one served.

    With a check, each source's answer is verified range by range before it is
    accepted; the ranges that fail go on to the next source (see the module contract).
    """

    sources: list[Source]
    stats: dict[str, SourceStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _logged: set[tuple[str, str]] = field(default_factory=set, repr=False)

    def read_ranges(self, blob: BlobRef, ranges: Sequence[tuple[int, int]], check: Check | None = None) -> list:
        """One result per range: check(i, raw) of the first source whose bytes pass it
        (the raw bytes without a check). TransportError when no source served a range."""
        results: list = [None] * len(ranges)
        todo = list(range(len(ranges)))
        errors = []
        for source in self.sources:
            if not todo:
                break
            asked = [ranges[i] for i in todo]
            start = time.monotonic()
            try:
                out = source.read_ranges(blob, asked)
            except NotHere:
                self._count(source.name, not_here=1)
                continue
            except (TransportError, NotFound) as e:
                self._count(source.name, errors=1)
                log.warning("%s: %s failed for %d ranges: %s", blob, source.name, len(asked), e)
                errors.append(f"{source.name}: {e}")
                continue
            if len(out) != len(asked) or any(len(d) != b - a for d, (a, b) in zip(out, asked)):
                self._count(source.name, errors=1)
                log.warning("%s: %s returned short ranges", blob, source.name)
                errors.append(f"{source.name}: short read")
                continue
            seconds = time.monotonic() - start
            bad: list[int] = []  # in the order of todo
            first_bad = ""
            for i, raw in zip(todo, out):
                if check is None:
                    results[i] = raw
                    continue
                try:
                    results[i] = check(i, raw)
                except ShoalError as e:
                    bad.append(i)
                    first_bad = first_bad or str(e)
            served = len(todo) - len(bad)
            if served:
                failed = set(bad)
                self._count(source.name, requests=1, ranges=served,
                            bytes=sum(len(d) for i, d in zip(todo, out) if i not in failed), seconds=seconds)
            if bad:
                self._bad(source, blob, [ranges[i] for i in bad], first_bad)
                errors.append(f"{source.name}: {len(bad)} ranges failed verification ({first_bad})")
            todo = bad
        if todo:
            detail = "; ".join(errors) or "no source has it"
            message = f"{blob}: cannot fetch {len(todo)} ranges ({detail})"
            if len(todo) == len(ranges):
                raise TransportError(message)
            failed = set(todo)
            raise RangesFailed(message, {i: r for i, r in enumerate(results) if i not in failed})
        return results

    def _bad(self, source: Source, blob: BlobRef, ranges: list[tuple[int, int]], why: str) -> None:
        """A source's bytes failed their check: counted, logged once per (source, blob),
        and the source told (it may drop a bad copy)."""
        self._count(source.name, verify_failures=len(ranges))
        key = (source.name, blob.digest)
        with self._lock:
            first = key not in self._logged
            if first:
                if len(self._logged) >= _LOGGED_MAX:
                    self._logged.clear()
                self._logged.add(key)
        if first:
            log.warning("%s: bytes from %s failed verification (%d ranges, first [%d, %d)): %s; "
                        "asking the next source (logged once per source and blob)",
                        blob, source.name, len(ranges), ranges[0][0], ranges[0][1], why)
            source.report_bad(blob, ranges)
        else:
            log.debug("%s: bytes from %s failed verification again: %s", blob, source.name, why)

    def _count(self, name: str, **delta: float) -> None:
        with self._lock:
            s = self.stats.setdefault(name, SourceStats())
            for k, v in delta.items():
                setattr(s, k, getattr(s, k) + v)

    def statistics(self) -> dict[str, dict]:
        with self._lock:
            return {name: dict(s.__dict__) for name, s in self.stats.items()}

    def close(self) -> None:
        for s in self.sources:
            s.close()
