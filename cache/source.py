"""The fetch interface: where a node gets the bytes of a layer blob.

Vocabulary:
- a *blob* is a layer blob named by its digest, in a repository of a registry (BlobRef,
  the one blob reference; its dict form crosses processes and disks);
- a *range* is [start, end) of its compressed bytes;
- a *source* is one place ranges can come from: the node's swarm (p2p/), the region
  cache (cache/region/client.py), the origin registry (cache/origin.py). Sources are
  tried in order by a FetchChain;
- a *check* is the caller's proof of a range: check(i, raw) returns what the caller keeps
  of range i (a chunk's decompressed, verified bytes; a piece; the raw bytes) or raises
  ShoalError when the bytes are not what the range should hold (a chunk's digest from the
  TOC, a piece's SHA-1, a TOC's digest, a whole blob's digest).

Contract for every Source:
- read_ranges(blob, ranges) returns one bytes object per requested range, each exactly
  end - start long (a Held when the source keeps the bytes on the node itself). A wrong
  count or length is a failure of the source (counted as an error, next source).
- The errors a source raises, and what the chain does with each:
  - NotHere: "this source does not have the blob (now)": the next source at once,
    counted as not_here, not logged. A source must say NotHere quickly (no long
    timeouts); a source that is down says NotHere while it retries later.
  - TransportError (or a subclass): the source should have had it but failed
    (refused, timed out, TLS refused, HTTP error, short read): logged at WARNING,
    counted as an error, next source.
  - NotFound: the source was asked and says the blob does not exist there (an origin's
    404): handled as TransportError (logged, counted, next source).
  - Any other exception propagates out of the chain at once, unchanged, and no later
    source is asked: a bug, or a ShoalError that no source can do better on (the
    origin's FormatError for a range past the blob's end: HTTP 416, a blob shorter
    than its size). The loader turns a ShoalError into EIO for the read.
  SourceHung and RangesFailed are the chain's own; a source never raises them.
- Who verifies: not the source but the chain, with the caller's check, on each
  source's answer before accepting it, so bytes are proven at the source they came
  from. An answer whose ranges fail their check counts as verify_failures of that
  source (logged once per source and blob, at WARNING, naming source, blob and the
  failing range), the source's report_bad() is told, and only the failed ranges are
  asked of the next source. A check that raises anything but ShoalError propagates.
- report_bad(blob, ranges) is a hint that the source served bytes that failed their
  check (the region re-checks its stored copy); it must not block for long and never
  raises. The default does nothing.
- health_key(blob) and describe(key) name what a hang makes unhealthy (below); close()
  releases the source's connections and threads (the chain's close() calls it).
- Threads: sources are thread-safe. The FUSE file system's worker threads call the
  chain, and a chain with a deadline calls each source from its own worker pool
  (threads named shoal-source), where a call it stopped waiting for may go on running;
  the caller's context variables go with the call (PATIENT).
- PATIENT (a context variable, default False): the caller's reads may wait a little for
  peers. A preheat job's node sets it for the parts of the target another node of the
  job fetches first (prefetch/warmup.py); the swarm source then waits (at most its
  peer_wait) for a peer to have pieces nobody has yet before it asks its fallback
  (p2p/ondemand.py). Other sources ignore it.
- BACKGROUND (a context variable, default False): nobody waits on these reads now (a
  preheat's warm-up, a background proof): the region source tells the region, which then
  has them wait for its fill of the blob instead of fetching them from the origin ahead
  of it (the fill would read those bytes again: cache/region/server.py). Other sources
  ignore it.
- TARGET (a context variable, default None): with BACKGROUND, what the whole warm-up the
  read belongs to will read, {blob digest: sorted disjoint (start, end) ranges}: the
  swarm source passes on a read of pieces nobody has that this target fills sparsely
  (p2p/ondemand.py), so that the region sends only the ranges asked. Other sources
  ignore it.

What the chain raises (read_ranges with a check, as the loader calls it):
- TransportError naming every source's failure when no source served any range that
  passed its check; RangesFailed (a TransportError carrying the results of the other
  ranges in `served`) when only some ranges failed; or what a source or the check let
  propagate (above). NotHere, NotFound, SourceHung and the check's ShoalError never
  escape it.

Deadlines and health (a chain with a `deadline`):
- One read_ranges() call of the chain returns or raises within `deadline` seconds (plus
  the caller's check), whatever its sources do: each source is asked from a worker
  thread and waited for at most the time left, less what the healthy sources after it
  keep (half of the time left, at most LATER_RESERVE seconds), so that they still have
  time. A source that has not answered by then has hung: the chain stops waiting
  (SourceHung), the source's call goes on in its worker until the source's own
  timeouts end it, and its answer is dropped. When the deadline has passed, the
  sources not asked yet are named in the TransportError ("not asked").
- A source that hung is *unhealthy* for a back-off (`backoff` seconds, doubled at each
  hang in a row up to `backoff_max`), per (source, health_key(blob)): the origin's key is
  the registry, so one hung registry does not take the others down. An unhealthy source
  is skipped at once (counted as skipped). When the back-off ends, one read probes it
  (the others go on skipping it until that probe ends); an answer makes it healthy again.
  Both changes are logged at WARNING.
- Refused connections, HTTP errors and bad bytes are failures, not hangs: they leave the
  source healthy (they are quick, and a registry that is down answers that way).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextvars
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from shoal.digest import check_digest
from shoal.errors import FormatError, NotFound, ShoalError, TransportError

PATIENT: contextvars.ContextVar[bool] = contextvars.ContextVar("shoal_patient_reads", default=False)  # (module doc)
BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("shoal_background_reads", default=False)  # (module doc)
Target = dict[str, list[tuple[int, int]]]
TARGET: contextvars.ContextVar[Target | None] = contextvars.ContextVar("shoal_read_target", default=None)  # (module doc)

log = logging.getLogger("shoal.fetch")


@dataclass(frozen=True)
class BlobRef:
    """A layer blob and where its origin is: the one blob reference of the data path.

    Its dict form (to_dict/from_dict) is what crosses processes and disks: the layer
    file system's blob.json, the swarm's completion marks, the swarm control socket."""

    registry: str  # "host[:port]"
    repository: str
    digest: str
    size: int | None = None  # compressed bytes; None: not known yet
    plain_http: bool = False  # the origin is spoken to in plain HTTP (cache.origin.use_plain_http)

    def __str__(self) -> str:
        return f"{self.registry}/{self.repository}@{self.digest}"

    def to_dict(self) -> dict[str, Any]:
        """{"registry", "repository", "digest", "size", "plain_http"} (JSON-ready)."""
        return {"registry": self.registry, "repository": self.repository, "digest": self.digest,
                "size": self.size, "plain_http": self.plain_http}

    @classmethod
    def from_dict(cls, d: object) -> BlobRef:
        """The blob of a dict written by to_dict (other keys are ignored). FormatError
        naming the key unless registry and repository are non-empty strings, digest is
        sha256:<64 hex>, size is absent, null or a whole number >= 0, and plain_http is
        absent, null or a boolean."""
        if not isinstance(d, dict):
            raise FormatError(f"blob reference: want an object, not {type(d).__name__}")
        for key in ("registry", "repository"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise FormatError(f"blob reference: {key} must be a non-empty string")
        size = d.get("size")
        if size is not None and (type(size) is not int or size < 0):
            raise FormatError(f"blob reference: size must be a whole number >= 0, not {str(size)[:40]!r}")
        plain = d.get("plain_http")
        if plain is not None and not isinstance(plain, bool):
            raise FormatError("blob reference: plain_http must be true or false")
        return cls(d["registry"], d["repository"], check_digest(d.get("digest"), "blob digest"), size, bool(plain))


class Held(bytes):
    """Bytes a source keeps on the node itself (the swarm's torrent storage): a caller
    that caches what it reads need not store a second copy."""

    __slots__ = ()


class NotHere(ShoalError):
    """This source does not have the blob; try the next one."""


class SourceHung(TransportError):
    """A source that did not answer within the time the chain had for it."""


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

    def health_key(self, blob: BlobRef) -> str:
        """What a hang of this source for `blob` says is unhealthy: "" (the whole
        source), or a part of it (the origin: one registry)."""
        return ""

    def describe(self, key: str) -> str:
        """The source (or the part of it named by a health_key) for log lines."""
        return f"{self.name} {key}".rstrip()

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
    hangs: int = 0  # calls that did not answer in time (the source then went unhealthy)
    skipped: int = 0  # calls not made: the source was unhealthy
    seconds: float = 0.0


@dataclass
class _Health:
    """An unhealthy (source, key): skipped until `until`, then probed by one read."""

    until: float
    backoff: float
    probing: bool = False


LATER_RESERVE = 5.0  # seconds of a read's deadline kept for the sources after the one asked (at most)
_WORKERS = 64  # source calls in flight at once (hung ones included, until their own timeouts end them)


@dataclass
class FetchChain:
    """Tries each source in order for a set of ranges; counts what each one served.

    With a check, each source's answer is verified range by range before it is
    accepted; the ranges that fail go on to the next source (see the module contract).
    """

    sources: list[Source]
    deadline: float | None = None  # seconds one read_ranges() may take; None: the sources' own timeouts
    backoff: float = 10.0  # seconds a source that hung is skipped (doubled per hang in a row)
    backoff_max: float = 30.0
    stats: dict[str, SourceStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _logged: set[tuple[str, str]] = field(default_factory=set, repr=False)
    _health: dict[tuple[str, str], _Health] = field(default_factory=dict, repr=False)
    _pool: concurrent.futures.ThreadPoolExecutor | None = field(default=None, repr=False)

    def read_ranges(self, blob: BlobRef, ranges: Sequence[tuple[int, int]], check: Check | None = None) -> list:
        """One result per range: check(i, raw) of the first source whose bytes pass it
        (the raw bytes without a check). TransportError when no source served a range."""
        results: list = [None] * len(ranges)
        todo = list(range(len(ranges)))
        errors = []
        end_by = None if self.deadline is None else time.monotonic() + self.deadline
        for n, source in enumerate(self.sources):
            if not todo:
                break
            if end_by is not None and time.monotonic() >= end_by:
                errors.append(f"{source.name}: not asked (the read's {self.deadline:g}s deadline passed)")
                break
            key = (source.name, source.health_key(blob))
            skip = self._skip(key)
            if skip:
                self._count(source.name, skipped=1)
                errors.append(f"{source.describe(key[1])}: {skip}")
                continue
            asked = [ranges[i] for i in todo]
            start = time.monotonic()
            try:
                out = self._ask(source, blob, asked, end_by, self.sources[n + 1:])
            except NotHere:
                self._healthy(source, key)
                self._count(source.name, not_here=1)
                continue
            except SourceHung as e:
                self._count(source.name, hangs=1)
                self._hung(source, key, str(e))
                errors.append(f"{source.describe(key[1])}: {e}")
                continue
            except (TransportError, NotFound) as e:
                self._healthy(source, key)
                self._count(source.name, errors=1)
                log.warning("%s: %s failed for %d ranges: %s", blob, source.name, len(asked), e)
                errors.append(f"{source.name}: {e}")
                continue
            except BaseException:
                self._healthy(source, key)
                raise
            self._healthy(source, key)
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

    def _ask(self, source: Source, blob: BlobRef, asked: list[tuple[int, int]], end_by: float | None,
             later: Sequence[Source]) -> list[bytes]:
        """source.read_ranges within the time left (see the module docstring)."""
        if end_by is None:
            return source.read_ranges(blob, asked)
        left = end_by - time.monotonic()
        if any(not self._unhealthy((s.name, s.health_key(blob))) for s in later):
            left -= min(left / 2, LATER_RESERVE)
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix="shoal-source")
            pool = self._pool
        fut = pool.submit(contextvars.copy_context().run, source.read_ranges, blob, asked)
        try:
            return fut.result(timeout=max(left, 0.0))
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise SourceHung(f"no answer within {left:.1f}s") from None

    def _unhealthy(self, key: tuple[str, str]) -> bool:
        with self._lock:
            h = self._health.get(key)
            return h is not None and (h.probing or time.monotonic() < h.until)

    def _skip(self, key: tuple[str, str]) -> str:
        """Why this call skips the source ("" = ask it; a read past the back-off becomes
        the one probe)."""
        with self._lock:
            h = self._health.get(key)
            if h is None:
                return ""
            now = time.monotonic()
            if now < h.until:
                return f"unhealthy (hung), skipped for {h.until - now:.0f}s more"
            if h.probing:
                return "unhealthy (hung), another read is probing it"
            h.probing = True
            return ""

    def _hung(self, source: Source, key: tuple[str, str], why: str) -> None:
        with self._lock:
            h = self._health.get(key)
            backoff = self.backoff if h is None else min(self.backoff_max, h.backoff * 2)
            self._health[key] = _Health(time.monotonic() + backoff, backoff)
        log.warning("%s: %s: unhealthy, skipped for %.0fs (then probed by one read)",
                    source.describe(key[1]), why, backoff)

    def _healthy(self, source: Source, key: tuple[str, str]) -> None:
        if not self._health:
            return
        with self._lock:
            h = self._health.pop(key, None)
        if h is not None:
            log.warning("%s answers again: healthy", source.describe(key[1]))

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
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        for s in self.sources:
            s.close()
