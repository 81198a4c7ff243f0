"""The region cache server: registry blob API in front of an origin registry.

HTTP API (what nodes and containerd, as a hosts.toml mirror, talk to):

- `GET /v2/<name>/blobs/<digest>` and `HEAD`: the blob, whole (200) or one byte range
  (`Range: bytes=a-b`, `bytes=a-`, `bytes=-n` -> 206 with Content-Range). A range that
  starts past the end is 416; an unparsable or multi-range header is ignored (200, as
  HTTP allows). `?ns=HOST` (containerd's mirror parameter) must name the origin, else 404.
- Other `GET`/`HEAD /v2/...` (the `/v2/` ping, manifests, tags): passed through to the
  origin with the client's credentials, not cached, so that a mirror with the `resolve`
  capability works and clients see the origin's auth challenges. Other methods: 405.
- `GET /-/status`: JSON counters (see RegionCache.statistics); `GET /-/healthy` and
  `/healthz`: 200 while the server answers; `/readyz`: 200 when its backend answers too
  (503 otherwise: Kubernetes probes);
  `GET /-/metrics`: the same figures for Prometheus.
- Whatever the region's assembly mounts beside the cache (RegionCache.mount, an
  Extension: `shoal region` mounts the swarm service at /p2p, region/service.py), with
  its figures in /-/status and /-/metrics.

Blob requests, in order:
1. Access: unless `auth.check` is off, the client's credentials must be allowed for the
   repository (a HEAD of the blob at the origin with them, remembered per (credentials
   hash, repository) for `auth.ttl` seconds, refusals for `auth.negative_ttl`), and the
   blob must belong to the repository at the origin (remembered per (repository,
   digest)). So a cached private blob is served only to a client that the origin would
   have served, and never under a repository it does not belong to. When the origin
   cannot be asked and nothing is remembered, the answer is 503 (fail closed). The
   first range far into a cold blob (past `fill_window`) is its own check: its origin
   range read, with the client's credentials, tells the same as the HEAD (_probe).
2. Hit: the backend has the blob; it is streamed from there. A stored copy is proven
   once per process: at the fill that committed it, else at its first use after a
   (re)start. A whole-blob answer from an unproven copy is hashed as it goes out and
   its last block is held back until the hash matches (a bad copy is a cut response,
   never a complete bad body); a range answer from an unproven copy is served at once
   (the node verifies every chunk and asks the origin when it fails) while the whole
   copy is hashed in the background (`region-check` threads). A copy that fails is
   deleted from the backend (counted as store_verify_failures, logged), so the next
   request fills it again from the origin. `POST /-/check/<digest>` (a node whose
   bytes from here failed their check) hashes the stored copy again, at most once per
   RECHECK_EVERY seconds per blob; the answer is 202 whatever the outcome.
3. Miss: one fill per digest fetches the whole blob from the origin (with the first
   client's credentials) into a staging file while every client of that blob, however
   many, reads its range from the staging file as the bytes arrive (coalescing). The
   whole blob is checked against its digest before it is committed to the backend:
   nothing unverified is cached. A client whose range includes the blob's last byte
   gets that byte only after the check, and a small response (under one block) starts
   only then, so a bad blob is a clean 502 for it; a client already streaming when the
   check fails has its connection cut (a short body, never a complete bad one).
4. Ranges ahead of the fill: a range answer whose next byte lies more than
   `fill_window` past the fill's position does not wait for the fill. Its bytes come
   from origin range requests (with its client's credentials) that write into the
   staging file above the fill's frontier, one request per part of the blob that no
   running read brings yet, so N clients asking for one range (a TOC) cost the origin
   one range read, and overlapping ranges share what they have in common. A range
   read hands each piece on as it comes: its clients take it from the read's memory
   (its first RANGE_MEMORY bytes) while an I/O thread writes it into the staging
   file, so they wait for the origin only. These bytes are not verified as they are
   served (a range cannot be; nodes check every chunk).
   When the fill reaches a run of at least TAKE_AT_LEAST bytes that range reads hold
   (or are bringing), it closes its origin answer, reads that run back from the
   staging file into its hash (moving its frontier over it under the lock, so nothing
   writes there after: the stored copy is still exactly what the fill hashed and
   checked against the digest; a range read's bad byte fails the commit), and goes on
   with a range request from the first byte no range read holds: up to the next run of
   at least TAKE_PLANNED bytes that range reads hold or bring (or a run of any length
   that ends the blob: a TOC), and at most FILL_SEGMENT bytes once it knows the blob's
   size, so the range reads that come while it runs shape its next request and their
   runs are not read twice; else `bytes=POS-` (an origin that ignores Range sends the
   whole blob: the fill drops what it has and reads the rest). Its first request is a
   range too when range reads run before it starts, or when it knows the size.
   So a cold blob costs the origin about one copy in all. A whole-blob answer takes
   from range reads only what the fill took. Counted: `origin_bytes` (the fill's
   origin bytes), `origin_range_bytes` (range reads), `fill_reused_bytes` (what the
   fill took from range reads).

Blocking work (files, boto3, hashing) runs in a thread pool, never on the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp
from aiohttp import web

from builder.oci.ranges import ContentRangeError, check_content_range
from cache.region.backends import Backend, BackendError, BlobNotFound, InvalidRange
from cache.region.config import RegionConfig
from cache.region.tls import BACKGROUND_HEADER, TOKEN_HEADER, NodeTokens
from cache.region.upstream import Upstream, credentials_key, error_text
from shoal.digest import is_digest
from shoal.metrics import CONTENT_TYPE, Metric, render

log = logging.getLogger("shoal.region")

# distribution/reference repository grammar
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_NAME_RE = re.compile(rf"^{_COMPONENT}(?:/{_COMPONENT})*$")
_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_MAX_REMEMBERED = 100_000
RECHECK_EVERY = 300.0  # seconds: a reported blob is hashed again at most this often
_CHECK_THREADS = 2  # whole stored blobs hashed at once (apart from the serving threads)
_AHEAD_PIECE = 64 << 10  # bytes a range read hands on at a time (clients get them as they come)
RANGE_MEMORY = 4 << 20  # bytes of a running range read kept in memory for its clients (RangeRead.mem)
MAX_REUSE_REFUSED = 4096  # digests remembered whose fill must not take range reads' bytes
FILL_YIELD = 1.0  # seconds a fill waits for the range reads ahead of it, at most, before its next block
HOLD_SWEEP = 5.0  # seconds between looks for held fills whose holds ran out
TAKE_AT_LEAST = 4 << 20  # bytes range reads must hold from a fill's position on for it to take them
# ... for a run that the fill's next request stops short of (planned before it asks, a
# run costs it one more request, and no bytes in flight)
TAKE_PLANNED = 512 << 10
# ... for the fill of a held blob (hold_fills): its range reads are done before it starts, so
# a run costs it no bytes in flight, only the request for the gap before it
TAKE_HELD = 64 << 10
# the most a fill asks the origin for at once, once it knows the blob's size: the range
# reads that come meanwhile (a start's first reads, scattered over the blob) shape its
# next request, which leaves out their runs instead of reading them again
FILL_SEGMENT = 32 << 20
_PASS_HEADERS = (
    "Content-Type", "Content-Length", "Docker-Content-Digest", "Docker-Distribution-Api-Version",
    "WWW-Authenticate", "Etag", "Link", "Last-Modified",
)


class HTTPFailure(Exception):
    """An error answer: status, registry error code, one-line message, extra headers."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}

    def response(self, method: str = "GET") -> web.Response:
        body = b"" if method == "HEAD" else json.dumps(
            {"errors": [{"code": self.code, "message": self.message}]}).encode()
        resp = web.Response(status=self.status, body=body, headers=self.headers,
                            content_type="application/json")
        return resp


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """[start, end) of a single `bytes=` range in a blob of `size` bytes, or None for the
    whole blob (no header, or one this server ignores). HTTPFailure 416 if unsatisfiable."""
    if not header:
        return None
    m = _RANGE_RE.match(header.strip().replace(" ", ""))
    if not m or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    unsatisfiable = HTTPFailure(416, "RANGE_INVALID", f"range {header!r} is outside the blob's {size} bytes",
                                {"Content-Range": f"bytes */{size}"})
    if not first:  # suffix: the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            raise unsatisfiable
        return max(0, size - n), size
    start = int(first)
    if last and int(last) < start:
        return None  # invalid: ignored (RFC 9110 14.2)
    if start >= size:
        raise unsatisfiable
    end = size if not last else min(int(last) + 1, size)
    return start, end


def explicit_range(header: str | None) -> tuple[int, int] | None:
    """[start, end) of a `bytes=a-b` range with both ends given (what nodes ask), else None."""
    m = _RANGE_RE.match((header or "").strip().replace(" ", ""))
    if not m or not m.group(1) or not m.group(2) or int(m.group(2)) < int(m.group(1)):
        return None
    return int(m.group(1)), int(m.group(2)) + 1


@dataclass
class _Remembered:
    expires: float
    allowed: bool
    status: int = 200
    challenge: str = ""
    message: str = ""


class AccessCache:
    """Which credentials may read which repository, and which blobs belong to which
    repository, as the origin answered recently (see the module doc, step 1)."""

    def __init__(self, upstream: Upstream, ttl: float, negative_ttl: float, stats: dict) -> None:
        self._upstream, self._ttl, self._negative_ttl, self._stats = upstream, ttl, negative_ttl, stats
        self._access: dict[tuple[str, str], _Remembered] = {}
        self._links: dict[tuple[str, str], tuple[float, int | None]] = {}
        self._inflight: dict[tuple[str, str, str], asyncio.Future] = {}

    async def check(self, repo: str, digest: str, authorization: str | None) -> int | None:
        """The blob's size if the origin told it; raises HTTPFailure when refused."""
        key = (credentials_key(authorization), repo)
        seen, link = self._remembered(key, repo, digest)
        if seen is not None and not seen.allowed:
            self._stats["denied"] += 1
            raise self._refusal(seen)
        if seen is not None and link is not None:
            self._stats["auth_cache_hits"] += 1
            return link[1]
        flight = (key[0], repo, digest)
        fut = self._inflight.get(flight)
        if fut is None:
            fut = asyncio.ensure_future(self._ask_origin(key, repo, digest, authorization))
            self._inflight[flight] = fut
            fut.add_done_callback(lambda _: self._inflight.pop(flight, None))
        else:
            self._stats["auth_coalesced"] += 1
        return await asyncio.shield(fut)

    def known(self, repo: str, digest: str, authorization: str | None) -> bool:
        """Whether check() would answer from what is remembered, without the origin."""
        seen, link = self._remembered((credentials_key(authorization), repo), repo, digest)
        return seen is not None and (not seen.allowed or link is not None)

    def _remembered(self, key: tuple[str, str], repo: str, digest: str):
        """(the unexpired access answer for key, the unexpired (repo, digest) link): each or None."""
        now = time.monotonic()
        seen = self._access.get(key)
        link = self._links.get((repo, digest))
        return (seen if seen is not None and seen.expires > now else None,
                link if link is not None and link[0] > now else None)

    async def _ask_origin(self, key: tuple[str, str], repo: str, digest: str, authorization: str | None) -> int | None:
        self._stats["auth_checks"] += 1
        try:
            resp = await self._upstream.request("HEAD", f"/v2/{repo}/blobs/{digest}", authorization, repo)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise HTTPFailure(503, "UNAVAILABLE",
                              f"cannot check access at the origin {self._upstream.host}: {_describe(exc)}") from None
        async with resp:
            length = resp.headers.get("Content-Length", "")
            return self.learn(repo, digest, authorization, resp.status,
                              int(length) if length.isdigit() else None, resp.headers.get("WWW-Authenticate", ""))

    def learn(self, repo: str, digest: str, authorization: str | None, status: int, size: int | None,
              challenge: str = "") -> int | None:
        """Remember the origin's answer to a request for the blob with these credentials
        (the HEAD of check(), or the first range read of a cold blob, which tells the same:
        status 200 or 206 and the blob's size): the size, or HTTPFailure as check() raises."""
        key = (credentials_key(authorization), repo)
        self._forget_old()
        now = time.monotonic()
        if status in (401, 403):
            seen = _Remembered(now + self._negative_ttl, False, status, challenge,
                               f"the origin refuses these credentials for {repo} (HTTP {status})")
            self._access[key] = seen
            self._stats["denied"] += 1
            raise self._refusal(seen)
        if status == 404:
            self._access[key] = _Remembered(now + self._ttl, True)
            raise HTTPFailure(404, "BLOB_UNKNOWN", f"blob {digest} is not in {repo} at the origin")
        if status not in (200, 206):
            raise HTTPFailure(502, "ORIGIN_ERROR", f"origin answered HTTP {status} for {repo}@{digest}")
        self._access[key] = _Remembered(now + self._ttl, True)
        self._links[(repo, digest)] = (now + self._ttl, size)
        return size

    @staticmethod
    def _refusal(seen: _Remembered) -> HTTPFailure:
        headers = {"WWW-Authenticate": seen.challenge} if seen.challenge else {}
        code = "UNAUTHORIZED" if seen.status == 401 else "DENIED"
        return HTTPFailure(seen.status, code, seen.message, headers)

    def _forget_old(self) -> None:
        if len(self._access) + len(self._links) < _MAX_REMEMBERED:
            return
        now = time.monotonic()
        self._access = {k: v for k, v in self._access.items() if v.expires > now}
        self._links = {k: v for k, v in self._links.items() if v[0] > now}


@dataclass
class RangeRead:
    """One origin range request ahead of a fill (module doc, 4): bytes [start, end) of
    the blob, written into the fill's staging file above the fill's frontier. `got`
    bytes from `start` are in the file; once `done`, `end` is `start + got` (a read plans
    no more than it brought), and `error` says why it stopped short, if it failed."""

    start: int
    end: int
    got: int = 0
    done: bool = False
    error: HTTPFailure | None = None
    # while it runs, its first RANGE_MEMORY bytes as they come (before they are in the
    # staging file): clients keeping up with it are served from here at once, without
    # waiting for the write or reading the file back
    mem: bytearray = field(default_factory=bytearray)

    def ready(self) -> int:
        """The end of the bytes from `start` that clients may take now: in the staging
        file (`got`) or, not yet written there, in `mem`."""
        return self.start + max(self.got, len(self.mem))

    def covers(self) -> int:
        """The end of what this read has brought or will bring."""
        return self.start + self.got if self.error is not None else self.end


@dataclass
class Fill:
    """One blob being fetched from the origin into a staging file (see module doc, 3),
    and the range reads ahead of it (4).

    The staging file's invariant, which keeps the committed copy the bytes the fill
    hashed: below `frontier` the file holds exactly the bytes the fill hashed (those it
    wrote from its origin stream, and those of range reads it read back from the file
    and hashed: module doc, 4), and a range read writes only at or above it. Range
    reads write, and the fill writes or reads back and moves `frontier`, under `lock`
    (in worker threads). `written` (on the event loop) trails `frontier`."""

    digest: str
    repo: str
    path: str
    fd: int = -1
    size: int | None = None
    written: int = 0
    verified: bool = False
    done: bool = False
    error: HTTPFailure | None = None
    readers: int = 0  # clients and range reads using fd
    ranges: list[RangeRead] = field(default_factory=list)  # running, or done and not passed yet
    ranges_refused: bool = False  # the origin ignored a Range header: readers wait for the fill
    reused: int = 0  # bytes the fill took from range reads (read back from the staging file)
    reuse: bool = True  # take range reads' bytes (off after a fill that did failed its digest check)
    whole: bool = True  # False: held (hold_fills): range reads alone, no stream of the whole blob yet
    authorization: str | None = None  # the credentials of the client that started it (a held fill's, for later)
    opening: asyncio.Future | None = None  # the staging file's opening
    take: int = TAKE_AT_LEAST  # the shortest run of range read bytes the fill takes (_worth_taking)
    frontier: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def available(self) -> int:
        """Bytes that may be served: all once verified, else all but the last byte."""
        if self.verified:
            return self.size or 0
        return min(self.written, (self.size or 0) - 1)

    def readable(self, pos: int, end: int, ahead: bool, memory: bool = True) -> int:
        """How many bytes from `pos` (up to `end`) can be served now: the fill's own
        (available()), and with `ahead` what range reads brought, in the staging file or
        (`memory`) still in their memory only (RangeRead.ready: from_memory serves those)."""
        at = pos
        while at < end:
            if at < self.available():
                at = self.available()
                continue
            if not ahead:
                break
            got = max((e for r in self.ranges if r.start <= at < (e := r.ready() if memory else r.start + r.got)),
                      default=None)
            if got is None:
                break
            at = got
        return min(at, end) - pos

    def held(self, pos: int) -> int:
        """The end of the run of bytes from `pos` that range reads have written into the
        staging file (`pos` when none has byte `pos`)."""
        at = pos
        while (got := max((r.start + r.got for r in self.ranges if r.start <= at < r.start + r.got),
                          default=None)) is not None:
            at = got
        return at

    def coming(self, pos: int) -> int:
        """The end of the run of bytes from `pos` that range reads have brought or are
        bringing (`pos` when none brings byte `pos`)."""
        at = pos
        while (read := self.bringing(at)) is not None:
            at = read.covers()
        return at

    def from_memory(self, pos: int, n: int) -> bytes | None:
        """Up to `n` bytes from `pos` that a running range read holds in memory (RangeRead.mem)."""
        for r in self.ranges:
            k = min(n, r.start + len(r.mem) - pos)
            if r.start <= pos and k > 0:
                with memoryview(r.mem) as view, view[pos - r.start:pos - r.start + k] as part:
                    return bytes(part)  # (one copy; the views are released at once: mem grows)
        return None

    def bringing(self, pos: int) -> RangeRead | None:
        """The range read that brings (or brought) byte `pos`, if any."""
        return next((r for r in self.ranges if r.start <= pos < r.covers()), None)

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of [start, end) that no range read brings."""
        out, at = [], start
        for a, b in sorted((r.start, r.covers()) for r in self.ranges):
            if b <= at or a >= end:
                continue
            if a > at:
                out.append((at, a))
            at = max(at, b)
        if at < end:
            out.append((at, end))
        return out

    def reading_ahead(self) -> bool:
        """Whether a range read is under way (clients wait for it)."""
        return any(not r.done for r in self.ranges)

    def passed(self) -> None:
        """Forget the range reads that are done and that the fill has passed."""
        self.ranges = [r for r in self.ranges if not (r.done and r.start + r.got <= self.written)]

    def notify(self) -> None:
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    async def wait_until(self, condition) -> None:
        while not condition():
            await self._changed.wait()

    def release_reader(self) -> None:
        self.readers -= 1
        self._close_if_unused()

    def _close_if_unused(self) -> None:
        if self.done and self.readers <= 0 and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


SETTLE_OPEN = 5.0  # seconds a range read's end waits for its fill's staging file to open (_StagingWrites)


class _StagingWrites:
    """A range read's writes into its fill's staging file (futures of I/O threads), in
    the order of their offsets. As each is done, and every one before it, its bytes
    count as in the file (RangeRead.got) and the fill's waiters are told. On the event
    loop only."""

    def __init__(self, fill: Fill, read: RangeRead) -> None:
        self._fill, self._read = fill, read
        self._pending: collections.deque[tuple[asyncio.Future, int]] = collections.deque()

    def add(self, write: asyncio.Future, end: int) -> None:
        """`write` writes the read's bytes up to `end` (from the end of the one before);
        its answer says whether it did (False: not, and none after it counts)."""
        self._pending.append((write, end))
        write.add_done_callback(self._advance)

    def _advance(self, _: object = None) -> None:
        moved = False
        while self._pending and (first := self._pending[0][0]).done() and not first.cancelled() \
                and first.exception() is None and first.result():
            self._read.got = self._pending.popleft()[1] - self._read.start
            moved = True
        if moved:
            self._fill.notify()

    def check(self) -> None:
        """Raise what the first write that failed raised (OSError), if one did."""
        if self._pending and self._pending[0][0].done() and not self._pending[0][0].cancelled():
            self._pending[0][0].result()

    async def drain(self) -> None:
        """Until every write is done; raises as check()."""
        await self._wait()
        self.check()

    async def settle(self) -> None:
        """At the read's end, whatever happened: until no write runs (whatever they did),
        their bytes counted. A staging file still to open (a fill that starts as its first
        range read ends: the access check's) is waited for, up to SETTLE_OPEN seconds, so
        that the fill takes these bytes instead of fetching them again; writes still
        waiting after that are dropped (a cancelled fill may never open it)."""
        if self._fill.fd < 0 and self._pending:
            await asyncio.wait([w for w, _ in self._pending], timeout=SETTLE_OPEN)
            if self._fill.fd < 0:
                for write, _ in self._pending:
                    write.cancel()
        await self._wait()

    async def _wait(self) -> None:
        if self._pending:
            await asyncio.wait([w for w, _ in self._pending])
            self._advance()


class Extension(Protocol):
    """A service mounted beside the cache (RegionCache.mount). The cache knows it only
    by this: `name`, its key in /-/status; statistics(), a JSON-able dict for that key;
    metrics(), its lines in /-/metrics (shoal.metrics.Metric). Both are called on the
    event loop and must not block."""

    name: str

    def statistics(self) -> dict: ...

    def metrics(self) -> list[Metric]: ...


class RegionCache:
    """The region cache service for one origin and one backend."""

    def __init__(self, config: RegionConfig, backend: Backend, *, tls=None, node_token: str = "") -> None:
        """tls: the cache.region.tls.RegionTLS it serves with (None: plain HTTP);
        node_token: the region's node secret, the key of node_tokens (NodeTokens: who may
        make bad-bytes reports, and call what is mounted beside the cache: the swarm and
        preheat services) ("" = none asked: in-process tests only; `shoal region` always
        has one)."""
        self.config = config
        self.tls = tls
        self.node_tokens = NodeTokens(node_token, config.nodes.shared_token, config.nodes.revoked)
        self.backend = backend
        self.upstream = Upstream(config.origin, timeout=config.origin_timeout,
                                 verify_tls=config.origin_verify_tls)
        self._pool = ThreadPoolExecutor(max_workers=config.io_threads, thread_name_prefix="region-io")
        self._block = config.block_size
        self._fills: dict[str, Fill] = {}
        self._probes: dict[str, asyncio.Future] = {}  # digest -> its first range read's answer (_probe)
        self._held: dict[str, list[float]] = {}  # digest -> when each of its holds ends (hold_fills)
        # digests whose last fill took range reads' bytes and failed its digest check: their
        # next fill fetches every byte itself (a broken range answer must not keep a blob
        # out of the cache for good); bounded, oldest forgotten first
        self._reuse_refused: dict[str, None] = {}
        self._commits = 0  # fills committed so far
        self._fill_tasks: set[asyncio.Task] = set()
        # stored copies: proven in this process (digest -> True), checks running, the
        # generation of each digest's copy (a commit replaces it: a check of the old
        # copy must not drop the new one), when a node last reported each
        self._proven: dict[str, bool] = {}
        self._checks: dict[str, asyncio.Task] = {}
        self._generation: dict[str, int] = {}
        self._reported: dict[str, float] = {}
        self._check_pool = ThreadPoolExecutor(max_workers=_CHECK_THREADS, thread_name_prefix="region-check")
        self._closing = False
        self.stats: dict[str, int] = dict.fromkeys((
            "requests", "hits", "misses", "coalesced", "fills", "fills_committed", "fills_failed",
            "origin_bytes", "bytes_served", "auth_checks", "auth_cache_hits", "auth_coalesced",
            "denied", "not_found", "errors", "aborted", "proxied",
            "store_checks", "store_verify_failures", "store_check_reports",
            "range_reads", "origin_range_bytes", "range_joins", "range_reads_failed", "fill_reused_bytes",
            "range_probes", "fills_held",
        ), 0)
        self.access = AccessCache(self.upstream, config.auth.ttl, config.auth.negative_ttl, self.stats)
        self.extensions: list[Extension] = []  # services mounted beside the cache (mount())
        self.app = self._make_app()

    # --- the application ------------------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20)  # (request bodies: a preheat job's node list, region/preheat.py)
        app.router.add_route("GET", "/-/status", self._status)
        app.router.add_route("GET", "/-/healthy", self._healthy)
        app.router.add_route("GET", "/healthz", self._healthy)  # liveness: the server answers
        app.router.add_route("GET", "/readyz", self._ready)  # readiness: and so does its backend
        app.router.add_route("GET", "/-/metrics", self._metrics)
        app.router.add_route("POST", "/-/check/{digest}", self._check_report)
        app.router.add_route("*", r"/v2/{name:.+}/blobs/{digest:[^/]+}", self._blob)
        app.router.add_route("*", "/v2/{tail:.*}", self._proxy)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    # --- the extension seam (the region's assembly, region/service.py) ---------------------

    def mount(self, prefix: str, sub: web.Application, extension: Extension) -> None:
        """Serve `sub` under `prefix` (before the application starts) and show `extension`'s
        figures in /-/status (under extension.name) and /-/metrics (after the cache's own)."""
        self.app.add_subapp(prefix, sub)
        self.extensions.append(extension)

    async def authorize(self, digest: str, request: web.Request) -> None:
        """The region's access check for a request about blob `digest` in the repository
        named by `?repo=` (the origin decides, as for the blob itself; see AccessCache):
        returns, or raises web.HTTPException (400 without ?repo=, 401/403 refused, 502
        when the origin cannot say)."""
        repo = request.query.get("repo", "")
        if not repo:
            raise web.HTTPBadRequest(text="torrent metadata needs ?repo=NAME (the blob's repository)\n")
        try:
            await self.access.check(repo, digest, request.headers.get("Authorization"))
        except HTTPFailure as f:
            raise _http_error(f) from None

    @property
    def self_url(self) -> str:
        """How this server reaches itself (scheme://host:port; a host its certificate names)."""
        host, port = self.config.listen_address
        scheme = "https" if self.tls else "http"
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)  # a name its certificate has
        if ":" in host:
            host = f"[{host}]"
        return f"{scheme}://{host}:{port}"

    async def _on_startup(self, app: web.Application) -> None:
        await self.upstream.start()
        self._start_task(self._sweep_holds())

    async def _on_cleanup(self, app: web.Application) -> None:
        self._closing = True  # stops the hashing of running checks
        for task in list(self._fill_tasks):
            task.cancel()
        if self._fill_tasks:
            await asyncio.gather(*self._fill_tasks, return_exceptions=True)
        for fill in [f for f in self._fills.values() if not f.whole]:  # no fill task of theirs unlinks them
            fill.done = True
            fill._close_if_unused()
            await self._run(_unlink, fill.path)
        await asyncio.get_running_loop().run_in_executor(None, self._check_pool.shutdown)
        await self.upstream.close()
        await self._run(self.backend.close)
        self._pool.shutdown(wait=True)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def statistics(self) -> dict:
        out: dict[str, object] = dict(self.stats)
        out["origin_requests"] = self.upstream.requests
        out["fills_running"] = sum(f.whole for f in self._fills.values())
        out["fills_holding"] = sum(not f.whole for f in self._fills.values())
        out["fill_readers"] = sum(f.readers for f in self._fills.values())
        out["filling"] = {d: {"size": f.size, "written": f.written, "range_reads": sum(not r.done for r in f.ranges)}
                          for d, f in self._fills.items()}
        return out

    async def _status(self, request: web.Request) -> web.Response:
        try:
            backend = await self._run(self.backend.statistics)
        except BackendError as exc:
            backend = {"error": str(exc)}
        out = {"origin": self.upstream.url, **self.statistics(), "backend": backend}
        for extension in self.extensions:
            out[extension.name] = extension.statistics()
        return web.json_response(out)

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            backend = await self._run(self.backend.statistics)
        except BackendError:
            backend = {}
        lines = region_metrics(self.statistics(), backend)
        for extension in self.extensions:
            lines += extension.metrics()
        return web.Response(text=render(lines), headers={"Content-Type": CONTENT_TYPE})

    async def _healthy(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def _ready(self, request: web.Request) -> web.Response:
        loop = asyncio.get_running_loop()
        try:
            await asyncio.wait_for(loop.run_in_executor(self._pool, self.backend.contains, "sha256:" + "0" * 64), 10)
        except Exception as e:  # noqa: BLE001 (a probe answers "not ready", whatever failed)
            return web.Response(status=503, text=f"backend not ready: {e or type(e).__name__}\n")
        return web.Response(text="ok\n")

    # --- blobs ------------------------------------------------------------------------

    async def _blob(self, request: web.Request) -> web.StreamResponse:
        start_time = time.monotonic()
        name, digest = request.match_info["name"], request.match_info["digest"]
        self.stats["requests"] += 1
        note = {"how": "-", "bytes": 0, "range": request.headers.get("Range", ""),
                "background": request.headers.get(BACKGROUND_HEADER) == "1"}
        status = 500
        try:
            resp = await self._serve_blob(request, name, digest, note)
            status = resp.status
            return resp
        except HTTPFailure as failure:
            status = failure.status
            if failure.status >= 500:
                self.stats["errors"] += 1
                log.warning("%s %s %s@%s: %s", request.remote, request.method, name, digest, failure.message)
            elif failure.status == 404:
                self.stats["not_found"] += 1
            return failure.response(request.method)
        except (ConnectionError, asyncio.CancelledError):
            status = 499  # (in the log only) the client went away; a fill goes on without it
            raise
        finally:
            log.info(
                "%s %s %s@%s%s -> %d %s %d bytes %.1f ms", request.remote, request.method, name, digest,
                f" [{note['range']}]" if note["range"] else "", status, note["how"], note["bytes"],
                (time.monotonic() - start_time) * 1000,
            )

    async def _serve_blob(self, request: web.Request, name: str, digest: str, note: dict) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            raise HTTPFailure(405, "UNSUPPORTED", "the region cache is read-only (GET and HEAD only)",
                              {"Allow": "GET, HEAD"})
        if not _NAME_RE.match(name) or len(name) > 255:
            raise HTTPFailure(400, "NAME_INVALID", f"invalid repository name {name!r}")
        if not is_digest(digest):
            raise HTTPFailure(400, "DIGEST_INVALID", f"invalid digest {digest[:100]!r} (want sha256:<64 hex>)")
        ns = request.query.get("ns")
        if ns and not self.upstream.serves(ns):
            raise HTTPFailure(404, "BLOB_UNKNOWN", f"this region cache serves {self.upstream.host}, not {ns}")
        authorization = request.headers.get("Authorization")
        size = None
        probed = await self._probe(request, name, digest, authorization, note)
        if probed is not None:
            return probed
        if self.config.auth.check:
            size = await self.access.check(name, digest, authorization)

        # a hit (looked up again if a fill committed while we looked, so that a blob
        # committed just then is not fetched a second time)
        for _ in range(2):
            commits = self._commits
            if digest not in self._fills:
                resp = await self._serve_stored(request, digest, note)
                if resp is not None:
                    self.stats["hits"] += 1
                    return resp
            if digest in self._fills or commits == self._commits:
                break

        if request.method == "HEAD":
            if size is None:
                size = await self._origin_size(name, digest, authorization)
            note["how"] = "origin-head"
            return web.Response(status=200, headers=_blob_headers(digest, size))

        # a miss: join or start the fill
        await self._after_probe(digest)
        fill = self._fills.get(digest)
        if fill is None and size is None and self._is_held(digest):  # range reads alone need the size first
            size = await self._origin_size(name, digest, authorization)
            fill = self._fills.get(digest)  # (a fill may have started meanwhile)
        if fill is None:
            fill = self._start_fill(name, digest, authorization, size)
            note["how"] = "miss"
        else:
            self.stats["coalesced"] += 1
            note["how"] = "coalesced"
        if not fill.whole and parse_range(request.headers.get("Range"), fill.size or 0) is None:
            self._upgrade(fill, authorization)  # a whole blob is the fill's to serve
        self.stats["misses"] += 1
        return await self._serve_fill(request, fill, note, authorization)

    async def _probe(self, request: web.Request, name: str, digest: str, authorization: str | None,
                     note: dict) -> web.StreamResponse | None:
        """A range far into a cold blob (a lazy start's TOC) when nothing tells the blob's
        size and these credentials' right to it: its origin range read, with the client's
        credentials, is the access check as well (the origin's answer to it says what its
        answer to the HEAD would: allowed or not, the blob in the repository or not, and
        the blob's size), so the client waits for one origin round trip instead of two.
        The fill starts with that size and the read is the fill's first range read; its
        answer goes to the client once the origin allowed it, as any range read's does.
        None: not that case (or the origin's answer was no range), go the usual way.
        Clients of the same blob that come meanwhile wait for it, then go the usual way
        (their credentials checked, or remembered; the range read joined). Not for a
        background read: it waits for the fill (_read_ahead)."""
        await self._after_probe(digest)
        span = explicit_range(request.headers.get("Range"))
        if (request.method != "GET" or span is None or span[0] <= self.config.fill_window or note.get("background")
                or digest in self._fills or (self.config.auth.check and self.access.known(name, digest, authorization))):
            return None
        done = asyncio.get_running_loop().create_future()
        self._probes[digest] = done
        try:
            if await self._run(self._stored, digest):
                return None
            start, end = span
            asked = f"bytes={start}-{end - 1}"
            self.stats["range_probes"] += 1
            try:
                resp = await self.upstream.request("GET", f"/v2/{name}/blobs/{digest}", authorization, name,
                                                   {"Range": asked})
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise HTTPFailure(503, "UNAVAILABLE", f"origin {self.upstream.host}: {_describe(exc)}") from None
            try:
                answered = check_content_range(resp.headers.get("Content-Range", ""), start, end) \
                    if resp.status == 206 else None
            except ContentRangeError:
                answered = None
            if answered is None or answered.total is None or answered.last != end - 1:
                # refused (remembered, and raised here), or no plain answer to this range (the
                # origin ignores Range, or the range passes the blob's end): the usual way
                try:
                    if resp.status in (401, 403, 404):
                        self.access.learn(name, digest, authorization, resp.status, None,
                                          resp.headers.get("WWW-Authenticate", ""))
                finally:
                    resp.close()
                return None
            self.access.learn(name, digest, authorization, 206, answered.total)
            fill = self._start_fill(name, digest, authorization, answered.total)
            read = RangeRead(start, end)
            fill.ranges.append(read)
            self._start_range(fill, read, authorization, resp)
            note["how"], note["ahead"] = "ahead-probe", True
            self.stats["misses"] += 1
        finally:
            del self._probes[digest]
            done.set_result(None)
        return await self._serve_fill(request, fill, note, authorization)

    async def _after_probe(self, digest: str) -> None:
        """Until no probe of `digest` runs (one starts the blob's fill: nobody else may)."""
        while (running := self._probes.get(digest)) is not None:
            await asyncio.shield(running)

    def _stored(self, digest: str) -> bool:
        """In a worker thread: whether the backend has a copy (if it cannot tell: no)."""
        try:
            return self.backend.contains(digest)
        except BackendError:
            return False

    async def _origin_size(self, name: str, digest: str, authorization: str | None) -> int:
        try:
            resp = await self.upstream.request("HEAD", f"/v2/{name}/blobs/{digest}", authorization, name)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise HTTPFailure(503, "UNAVAILABLE", f"origin {self.upstream.host}: {_describe(exc)}") from None
        async with resp:
            if resp.status == 404:
                raise HTTPFailure(404, "BLOB_UNKNOWN", f"blob {digest} is not in {name} at the origin")
            if resp.status in (401, 403):
                hdr = resp.headers.get("WWW-Authenticate")
                raise HTTPFailure(resp.status, "UNAUTHORIZED", f"the origin refuses access to {name}",
                                  {"WWW-Authenticate": hdr} if hdr else None)
            length = resp.headers.get("Content-Length", "")
            if resp.status != 200 or not length.isdigit():
                raise HTTPFailure(502, "ORIGIN_ERROR", f"origin answered HTTP {resp.status} for {name}@{digest}")
            return int(length)

    def _open_stored(self, digest: str, range_header: str | None, head: bool):
        """In a worker thread: size, range, stream and first block of a stored blob in
        one step (one thread hop for a typical chunk-sized range); None if not stored."""
        try:
            size = self.backend.size(digest)
            span = parse_range(range_header, size)
            if head:
                return size, span, None, None
            start, end = span or (0, size)
            stream = self.backend.stream(digest, start, end, self._block)
        except BlobNotFound:
            return None
        except InvalidRange as exc:  # the stored blob changed size under us
            raise HTTPFailure(416, "RANGE_INVALID", str(exc)) from None
        except BackendError as exc:
            log.warning("%s: %s; fetching from the origin instead", digest, exc)
            return None
        try:
            first = next(stream, None)
        except BackendError as exc:
            stream.close()
            log.warning("%s: %s; fetching from the origin instead", digest, exc)
            return None
        return size, span, stream, first

    async def _serve_stored(self, request: web.Request, digest: str, note: dict) -> web.StreamResponse | None:
        """The response for a blob in the backend, or None if it is not there."""
        generation = self._generation.get(digest, 0)
        opened = await self._run(self._open_stored, digest, request.headers.get("Range"), request.method == "HEAD")
        if opened is None:
            return None
        size, span, stream, data = opened
        note["how"] = "hit"
        if stream is None:  # HEAD
            return web.Response(status=200, headers=_blob_headers(digest, size))
        start, end = span or (0, size)
        hasher = None
        if not self._proven.get(digest):
            if span is None:  # the whole unproven copy: hashed on the way out (module doc, 2)
                hasher = hashlib.sha256()
            else:
                self._check_stored(digest)
        resp = web.StreamResponse(status=206 if span else 200, headers=_blob_headers(digest, size, span))
        resp.content_length = end - start
        try:
            await resp.prepare(request)
            while data is not None:
                try:
                    following = await self._run(_hash_and_next, stream, hasher, data)
                except BackendError as exc:
                    log.warning("%s: %s; cutting the response to %s", digest, exc, request.remote)
                    self.stats["aborted"] += 1
                    _abort(request)
                    return resp
                if following is None and hasher is not None:  # `data` is the last block
                    got = "sha256:" + hasher.hexdigest()
                    if got != digest:
                        await self._drop_stored(digest, generation, f"hashes to {got}")
                        self.stats["aborted"] += 1
                        _abort(request)
                        return resp
                    self._prove(digest)
                await resp.write(data)
                note["bytes"] += len(data)
                self.stats["bytes_served"] += len(data)
                data = following
            await resp.write_eof()
        finally:
            if note["bytes"] < end - start:  # not exhausted (an exhausted stream closed itself)
                await self._run(stream.close)
        return resp

    # --- proving stored copies (module doc, 2) ---------------------------------------------

    def _check_stored(self, digest: str, force: bool = False) -> None:
        """Hash the stored copy of `digest` in the background, unless it is proven (or
        `force`) or a check is running; a copy that fails is dropped."""
        if digest in self._checks or (self._proven.get(digest) and not force) or self._closing:
            return
        self._proven.pop(digest, None)
        task = asyncio.ensure_future(self._run_check(digest, self._generation.get(digest, 0)))
        self._checks[digest] = task
        self._fill_tasks.add(task)  # cancelled at cleanup, as fills are
        task.add_done_callback(lambda _: self._checks.pop(digest, None))
        task.add_done_callback(self._fill_tasks.discard)

    async def _run_check(self, digest: str, generation: int) -> None:
        self.stats["store_checks"] += 1
        loop = asyncio.get_running_loop()
        try:
            got = await loop.run_in_executor(self._check_pool, self._hash_stored, digest)
        except BackendError as exc:
            log.warning("%s: cannot check the stored copy: %s", digest, exc)
            return
        if got is None:
            return  # gone (evicted, dropped) or the server is stopping
        if got == digest:
            if self._generation.get(digest, 0) == generation:
                self._prove(digest)
            return
        await self._drop_stored(digest, generation, f"hashes to {got}")

    def _prove(self, digest: str) -> None:
        if len(self._proven) >= _MAX_REMEMBERED:
            self._proven.clear()  # forgotten copies are hashed again at their next use
        self._proven[digest] = True

    def _hash_stored(self, digest: str) -> str | None:
        """In a check thread: the digest of the stored copy; None if it is not there."""
        hasher = hashlib.sha256()
        try:
            stream = self.backend.stream(digest, 0, None, self._block)
        except BlobNotFound:
            return None
        try:
            for data in stream:
                if self._closing:
                    return None
                hasher.update(data)
        finally:
            stream.close()
        return "sha256:" + hasher.hexdigest()

    async def _drop_stored(self, digest: str, generation: int, why: str) -> None:
        """The stored copy of `generation` is bad: delete it (unless a fill has replaced
        it meanwhile), so the next request fetches the blob from the origin again."""
        if self._generation.get(digest, 0) != generation or digest in self._fills:
            return
        self._proven.pop(digest, None)
        log.error("%s: the stored copy in the %s backend %s; dropping it (the next request fetches it from "
                  "the origin)", digest, self.backend.name, why)
        try:
            await self._run(self.backend.delete, digest)
        except BackendError as exc:
            log.error("%s: cannot drop the bad stored copy: %s", digest, exc)
        self.stats["store_verify_failures"] += 1  # counted once it is gone (tests wait for it)

    async def _check_report(self, request: web.Request) -> web.Response:
        """`POST /-/check/<digest>`: a client's bytes from here failed their check."""
        digest = request.match_info["digest"]
        if not is_digest(digest):
            raise web.HTTPBadRequest(text=f"invalid digest {digest[:100]!r}\n")
        if self.node_tokens.identify(request.headers.get(TOKEN_HEADER, "")) is None:
            raise web.HTTPUnauthorized(text="a bad-bytes report needs a node token of this region\n")
        now = time.monotonic()
        if now - self._reported.get(digest, -RECHECK_EVERY) >= RECHECK_EVERY:
            if len(self._reported) >= _MAX_REMEMBERED:
                self._reported = {d: t for d, t in self._reported.items() if now - t < RECHECK_EVERY}
            self._reported[digest] = now
            self.stats["store_check_reports"] += 1
            log.warning("%s reports bad bytes of %s from this cache; checking the stored copy", request.remote, digest)
            self._check_stored(digest, force=True)
        return web.Response(status=202, text="checking\n")

    def _start_fill(self, name: str, digest: str, authorization: str | None, size: int | None) -> Fill:
        """The fill of `digest`; `size` (the origin's answer to the access check, if any)
        lets range reads start before the fill's own answer."""
        fill = Fill(digest=digest, repo=name, path=self.backend.temp_path(), size=size,
                    reuse=digest not in self._reuse_refused, whole=size is None or not self._is_held(digest),
                    authorization=authorization)
        self._fills[digest] = fill
        if fill.whole:
            self.stats["fills"] += 1
            self._start_task(self._run_fill(fill, authorization))
        else:
            self.stats["fills_held"] += 1
            self._start_task(self._open_held(fill))
        return fill

    def _start_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._fill_tasks.add(task)  # cancelled at cleanup
        task.add_done_callback(self._fill_tasks.discard)

    # --- held fills: range reads alone while a preheat job reads parts of the blob

    def hold_fills(self, digests, seconds: float) -> None:
        """For the next `seconds` (or until release_fills), a blob of `digests` that is not
        filling is not fetched whole: its range requests are answered by range reads alone
        (coalesced per range in flight, and kept in its staging file for the next client
        that asks the same bytes), so the origin serves the ranges asked and no more (a
        profile preheat: the chunks its nodes read). A request for the whole blob, or the
        hold's end, turns it into a fill of the whole blob, which takes what range reads
        brought (runs of TAKE_HELD bytes or more) and fetches the rest: one verified copy,
        committed."""
        until = time.monotonic() + seconds
        for digest in digests:
            self._held[digest] = self._held.get(digest, []) + [until]

    def release_fills(self, digests, linger: float = 0.0) -> None:
        """The end of one hold_fills of `digests` (the earliest of each), `linger` seconds
        from now (0: now; a whole-blob request still ends it at once)."""
        until = time.monotonic() + linger
        for digest in digests:
            holds = self._held.get(digest)
            if holds:
                holds.remove(min(holds))
                if linger > 0:
                    holds.append(until)
            self._end_hold(digest)

    def _is_held(self, digest: str) -> bool:
        now = time.monotonic()
        holds = [t for t in self._held.get(digest, []) if t > now]
        if holds:
            self._held[digest] = holds
        else:
            self._held.pop(digest, None)
        return bool(holds)

    def _end_hold(self, digest: str) -> None:
        if not self._is_held(digest):
            fill = self._fills.get(digest)
            if fill is not None and not fill.whole:
                self._upgrade(fill, fill.authorization)

    def _upgrade(self, fill: Fill, authorization: str | None) -> None:
        """A held fill becomes a fill of the whole blob (hold_fills)."""
        if fill.whole:
            return
        fill.whole, fill.take = True, TAKE_HELD
        self.stats["fills"] += 1
        log.info("%s@%s: fetching the whole blob (%d range reads held so far)", fill.repo, fill.digest,
                 len(fill.ranges))
        self._start_task(self._run_fill(fill, authorization))

    async def _open_staging(self, fill: Fill) -> None:
        """Open the fill's staging file, once (a held fill's opening, then its whole fill's)."""
        if fill.opening is None:
            fill.opening = asyncio.ensure_future(self._run(_open_staging, fill.path))
        fd = await asyncio.shield(fill.opening)
        if fill.fd < 0 and not fill.done:
            fill.fd = fd
            fill.notify()

    async def _open_held(self, fill: Fill) -> None:
        try:
            await self._open_staging(fill)
        except OSError as exc:
            fill.error = HTTPFailure(500, "INTERNAL", f"staging file for {fill.repo}@{fill.digest}: {exc}")
            if self._fills.get(fill.digest) is fill:
                del self._fills[fill.digest]
            fill.done = True
            fill.notify()

    async def _sweep_holds(self) -> None:
        """Held fills whose holds ran out become whole fills (nobody may have asked since)."""
        while True:
            await asyncio.sleep(HOLD_SWEEP)
            for digest in [d for d, f in self._fills.items() if not f.whole]:
                self._end_hold(digest)

    async def _run_fill(self, fill: Fill, authorization: str | None) -> None:
        """Fetch the blob from the origin into fill.path, verify it, commit it."""
        digest, name = fill.digest, fill.repo
        committed = False
        try:
            await self._open_staging(fill)
            hasher = hashlib.sha256()
            while fill.size is None or fill.written < fill.size:
                await self._take_from_ranges(fill, hasher)
                if fill.size is not None and fill.written >= fill.size:
                    break
                if not await self._stream_from_origin(fill, hasher, authorization):
                    break  # the origin's answer ended
            if fill.written != fill.size:
                raise HTTPFailure(502, "ORIGIN_ERROR",
                                  f"origin sent {fill.written} bytes of {name}@{digest}, announced {fill.size}")
            got = "sha256:" + hasher.hexdigest()
            if got != digest:
                reused = f" ({fill.reused} of them from range reads)" if fill.reused else ""
                if fill.reused:
                    self._reuse_refused[digest] = None
                    while len(self._reuse_refused) > MAX_REUSE_REFUSED:
                        del self._reuse_refused[next(iter(self._reuse_refused))]
                    reused += "; its next fill takes nothing from range reads"
                raise HTTPFailure(502, "BLOB_DIGEST_MISMATCH",
                                  f"origin served bytes for {name}@{digest} that hash to {got}{reused}; not cached")
            fill.verified = True
            fill.notify()
            try:
                committed = await self._run(self.backend.put_file, digest, fill.path)
            except BackendError as exc:
                log.warning("%s: not cached: %s", digest, exc)
            if committed:
                self._generation[digest] = self._generation.get(digest, 0) + 1
                self._prove(digest)  # the bytes just hashed are the stored copy
                self._commits += 1
                self.stats["fills_committed"] += 1
                log.info("cached %s@%s (%d bytes) from the origin", name, digest, fill.size)
            else:
                log.warning("%s@%s (%d bytes) served but not cached: no room in the backend",
                            name, digest, fill.size)
        except HTTPFailure as failure:
            fill.error = failure
            self.stats["fills_failed"] += 1
            log.warning("fill of %s@%s failed: %s", name, digest, failure.message)
        except asyncio.CancelledError:
            fill.error = HTTPFailure(503, "UNAVAILABLE", "the region cache is shutting down")
            raise
        except Exception as exc:  # a bug or a local I/O failure: fail this fill only
            fill.error = HTTPFailure(500, "INTERNAL", f"fill of {name}@{digest} failed: {exc}")
            self.stats["fills_failed"] += 1
            log.exception("fill of %s@%s failed", name, digest)
        finally:
            self._fills.pop(digest, None)
            fill.done = True
            fill.notify()
            for task in list(fill._tasks):  # verified: every byte is the fill's; failed: no use
                task.cancel()
            fill._close_if_unused()
            if not committed:
                await asyncio.shield(self._run(_unlink, fill.path))  # readers keep the open descriptor

    async def _stream_from_origin(self, fill: Fill, hasher, authorization: str | None) -> bool:
        """Append the blob from the origin to the fill from fill.written on: the whole
        blob (200) at first; once range reads are under way, or after a run taken from
        them, or once the fill knows the blob's size, a range (206): up to the next run
        of range read bytes worth taking (_next_run), and at most FILL_SEGMENT bytes
        when the size is known, else to the end (`Range: bytes=POS-`). An origin that ignores
        Range sends the whole blob: its bytes before POS are dropped, and the fill
        reads the rest of the blob from that answer. Returns True when the fill is to
        go on: its answer reached its bound, or it was cut (closed) at a run worth
        taking (_worth_taking) that appeared on the way; False when the answer ended
        (at the blob's end, or short: the caller checks). Raises HTTPFailure."""
        digest, name = fill.digest, fill.repo
        if fill.reading_ahead():
            await self._yield_to_ranges(fill)
        at, stop = fill.written, self._next_run(fill)
        if fill.size is not None and fill.reuse and not fill.ranges_refused and at + FILL_SEGMENT < fill.size:
            stop = min(stop, at + FILL_SEGMENT) if stop is not None else at + FILL_SEGMENT
        ranged = at > 0 or stop is not None
        asked = f"bytes={at}-{'' if stop is None else stop - 1}"
        try:
            resp = await self.upstream.request("GET", f"/v2/{name}/blobs/{digest}", authorization, name,
                                               {"Range": asked} if ranged else None)
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise HTTPFailure(502, "ORIGIN_ERROR", f"origin {self.upstream.host}: {_describe(exc)}") from None
        async with resp:
            drop = 0  # bytes at the answer's start that the fill has already
            if ranged and resp.status == 206:
                end = stop if stop is not None else fill.size
                try:
                    check_content_range(resp.headers.get("Content-Range", ""), at, end, fill.size)
                except ContentRangeError:
                    raise HTTPFailure(502, "ORIGIN_ERROR", f"origin answered Content-Range "
                                      f"{resp.headers.get('Content-Range')!r} for {name}@{digest} {asked}") from None
            elif resp.status != 200:
                text = await error_text(resp)
                if resp.status == 404:
                    raise HTTPFailure(404, "BLOB_UNKNOWN", f"blob {digest} is not in {name} at the origin")
                raise HTTPFailure(502, "ORIGIN_ERROR",
                                  f"origin answered HTTP {resp.status} for {name}@{digest}: {text}")
            else:
                if resp.content_length is None:
                    raise HTTPFailure(502, "ORIGIN_ERROR", f"origin sent {name}@{digest} without a Content-Length")
                if fill.size is not None and resp.content_length != fill.size:
                    raise HTTPFailure(502, "ORIGIN_ERROR", f"origin sends {resp.content_length} bytes of "
                                      f"{name}@{digest}; its HEAD said {fill.size}")
                if ranged:  # the origin ignores Range: no more range reads, nothing more to take
                    fill.ranges_refused, drop, stop = True, at, None
                    log.warning("%s: the origin ignores Range requests; the fill reads the whole blob", digest)
                fill.size = resp.content_length
                fill.notify()
            buf = bytearray()
            try:
                async for piece in resp.content.iter_chunked(self._block):
                    if drop:
                        self.stats["origin_bytes"] += min(drop, len(piece))
                        piece, drop = piece[drop:], max(0, drop - len(piece))
                        if not piece:
                            continue
                    if fill.reading_ahead():
                        await self._yield_to_ranges(fill)
                    buf += piece
                    if len(buf) >= self._block:
                        await self._append(fill, hasher, bytes(buf))
                        buf.clear()
                        if fill.written != stop and self._worth_taking(fill):
                            resp.close()  # the rest of this answer is not read: cut it
                            return True
                if buf:
                    await self._append(fill, hasher, bytes(buf))
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise HTTPFailure(502, "ORIGIN_ERROR",
                                  f"origin connection lost after {fill.written} of {fill.size} bytes of "
                                  f"{name}@{digest}: {_describe(exc)}") from None
        return stop is not None and fill.written == stop

    def _worth_taking(self, fill: Fill) -> bool:
        """Whether the range reads hold (or bring) enough of the blob from the fill's
        position on to cut the fill's origin answer for it: at least TAKE_AT_LEAST
        bytes (a shorter run costs less read again than the bytes in flight in the
        answer it cuts and the request after it), or a run of any length that ends the
        blob (a lazy start's TOC and last chunks: no request after it)."""
        if not fill.reuse or fill.ranges_refused:
            return False
        run = fill.coming(fill.written) - fill.written
        return run >= fill.take or (run > 0 and fill.written + run == fill.size)

    @staticmethod
    def _next_run(fill: Fill) -> int | None:
        """Where the first run that range reads hold or bring begins past the fill's
        position, of at least TAKE_PLANNED bytes (fill.take if less: a held fill's) or
        up to the blob's end (a lazy start's TOC: no request after it), or None (none:
        the fill's next answer is the rest of the blob, or its next segment; else it
        ends there). The fill plans this request before it asks: a run costs it a
        request, not the bytes an answer it cut would have had in flight."""
        if fill.ranges_refused or not fill.reuse:
            return None
        take = min(fill.take, TAKE_PLANNED)
        starts = sorted(r.start for r in fill.ranges if r.start > fill.written)
        return next((a for a in starts if fill.coming(a) - a >= take or fill.coming(a) == fill.size), None)

    async def _take_from_ranges(self, fill: Fill, hasher) -> None:
        """Move the fill over the run of bytes from its position that range reads have
        written (or, running, are writing) into the staging file: each block read back
        from the file into the fill's hash, and the frontier moved over it, under the
        fill's lock (_take_staged): from then on no range read writes there, so the
        committed copy is what was hashed. Returns at the first byte that no range
        read brings (or at one that a failed read did not bring); at once for a fill
        that takes nothing from range reads (`reuse` off)."""
        while fill.reuse and fill.size is not None and fill.written < fill.size:
            at = fill.written
            end = fill.held(at)
            if end > at:
                n = min(self._block, end - at)
                await self._run(_take_staged, fill, at, n, hasher)
                fill.written += n
                fill.reused += n
                self.stats["fill_reused_bytes"] += n
                fill.passed()
                fill.notify()
                continue
            read = fill.bringing(at)
            if read is None or read.done:
                return
            await fill.wait_until(lambda read=read, at=at: read.done or fill.held(at) > at)

    @staticmethod
    async def _yield_to_ranges(fill: Fill) -> None:
        """Clients wait for range reads, nobody for the rest of the fill: while a range
        read runs, the fill stops reading (its TCP window closes, so the origin's uplink
        and this process serve the ranges first), for at most FILL_YIELD seconds at a
        time. (Sending range bytes to clients does not hold the fill: a slow client
        must not stall it.)"""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(fill.wait_until(lambda: not fill.reading_ahead()), FILL_YIELD)

    async def _append(self, fill: Fill, hasher, data: bytes) -> None:
        await self._run(_write_fill, fill, data, fill.written, hasher)
        fill.written += len(data)
        self.stats["origin_bytes"] += len(data)
        fill.passed()
        fill.notify()

    async def _serve_fill(self, request: web.Request, fill: Fill, note: dict,
                          authorization: str | None) -> web.StreamResponse:
        fill.readers += 1
        try:
            return await self._serve_staged(request, fill, note, authorization)
        finally:
            fill.release_reader()

    async def _serve_staged(self, request: web.Request, fill: Fill, note: dict,
                            authorization: str | None) -> web.StreamResponse:
        await fill.wait_until(lambda: fill.size is not None or fill.error is not None)
        if fill.error is not None:
            raise fill.error
        size = fill.size
        assert size is not None  # (what the wait above waited for)
        span = parse_range(request.headers.get("Range"), size)
        start, end = span or (0, size)
        ahead = span is not None  # a whole blob is the fill's alone: checked before its last byte
        # the response starts with a first block in hand, or (small ranges, ranges
        # that end the blob, served by the fill) only after the blob is verified
        first = min(end, start + self._block)
        await self._wait_readable(fill, start, end, first - start, ahead, authorization, note)
        resp = web.StreamResponse(status=206 if span else 200, headers=_blob_headers(fill.digest, size, span))
        resp.content_length = end - start
        await resp.prepare(request)
        pos = start
        while pos < end:
            n = min(self._block, fill.readable(pos, end, ahead))
            if n == 0:
                try:
                    await self._wait_readable(fill, pos, end, 1, ahead, authorization, note)
                except HTTPFailure as failure:
                    log.warning("%s: cutting the response to %s after %d bytes: %s",
                                fill.digest, request.remote, pos - start, failure.message)
                    self.stats["aborted"] += 1
                    _abort(request)
                    return resp
                continue
            # a range answer may take a running range read's bytes from memory (maybe fewer
            # than n); a whole one is the fill's hashed bytes, read from the file
            data = fill.from_memory(pos, n) if ahead else None
            if data is None:  # (from the file: no further than what is written there)
                n = min(n, fill.readable(pos, end, ahead, memory=False))
                data = await self._run(os.pread, fill.fd, n, pos)
                if len(data) != n:
                    raise RuntimeError(f"staging file of {fill.digest} is short at {pos}")
            n = len(data)
            await resp.write(data)
            pos += n
            note["bytes"] += n
            self.stats["bytes_served"] += n
        await resp.write_eof()
        return resp

    async def _wait_readable(self, fill: Fill, pos: int, end: int, want: int, ahead: bool,
                             authorization: str | None, note: dict) -> None:
        """Until `want` bytes from `pos` are readable in the staging file, or any when the
        rest comes from a range read (its bytes go out as they arrive: the node checks
        them, and a failure later cuts the answer). A range answer (`ahead`) whose next
        byte is more than fill_window past the fill gets it from a range read (started
        here unless one brings it already); anything else waits for the fill. Raises
        the fill's failure, or that of the range read it waited for (no retry: the
        client, a node, asks its next source)."""
        while (have := fill.readable(pos, end, ahead)) < want:
            if fill.error is not None:
                raise fill.error
            read = self._read_ahead(fill, pos + have, end, authorization, note) if ahead else None
            if read is not None and have > 0:
                return
            await fill.wait_until(lambda have=have, read=read: fill.error is not None or (
                fill.readable(pos, end, ahead) > have or (read is not None and read.done)))
            if read is not None and read.error is not None and fill.readable(pos, end, ahead) <= have:
                raise read.error

    def _read_ahead(self, fill: Fill, pos: int, end: int, authorization: str | None, note: dict) -> RangeRead | None:
        """The range read that brings byte `pos`, or None when `pos` is to wait for the
        fill. A missing read is started, with reads of every other part of [pos, end)
        that none brings yet: one origin request per byte however many clients ask.
        A background read (BACKGROUND_HEADER: a preheat's warm-up, a proof) waits for a
        whole fill wherever it is: a range read ahead of the fill's open answer would
        cost the origin those bytes twice, and nobody waits on this one."""
        if fill.ranges_refused or fill.size is None or (fill.whole and (
                note.get("background") or pos <= fill.written + self.config.fill_window)):
            return None
        read = fill.bringing(pos)
        if not note.get("ahead"):
            note["ahead"], note["how"] = True, "ahead" if read is None else "ahead-joined"
            self.stats["range_joins"] += read is not None
        if read is not None:
            return read
        for a, b in fill.gaps(pos, end):
            r = RangeRead(a, b)
            fill.ranges.append(r)
            self._start_range(fill, r, authorization)
        return fill.bringing(pos)

    def _start_range(self, fill: Fill, read: RangeRead, authorization: str | None,
                     opened: aiohttp.ClientResponse | None = None) -> None:
        task = asyncio.ensure_future(self._run_range(fill, read, authorization, opened))
        fill._tasks.add(task)
        self._fill_tasks.add(task)  # cancelled at cleanup, as fills are
        task.add_done_callback(fill._tasks.discard)
        task.add_done_callback(self._fill_tasks.discard)

    async def _run_range(self, fill: Fill, read: RangeRead, authorization: str | None,
                         opened: aiohttp.ClientResponse | None = None) -> None:
        """Fetch [read.start, read.end) of the blob from the origin as a range into the
        fill's staging file (above its frontier), or read it from `opened`, the origin's
        answer to that range already (_probe). Not verified: a range cannot be; the
        node checks every chunk it reads (docs/cache.md)."""
        digest, name = fill.digest, fill.repo
        what = f"{name}@{digest} bytes {read.start}-{read.end - 1}"
        fill.readers += 1
        self.stats["range_reads"] += 1
        writing = _StagingWrites(fill, read)
        try:
            try:
                resp = opened or await self.upstream.request("GET", f"/v2/{name}/blobs/{digest}", authorization,
                                                             name, {"Range": f"bytes={read.start}-{read.end - 1}"})
            except (TimeoutError, aiohttp.ClientError) as exc:
                raise HTTPFailure(502, "ORIGIN_ERROR", f"origin {self.upstream.host}: {what}: {_describe(exc)}") from None
            async with resp:
                if resp.status == 200:
                    fill.ranges_refused = True
                    log.warning("%s: the origin ignores Range requests; ranges of this blob wait for its fill", digest)
                    return
                if resp.status != 206:
                    raise HTTPFailure(502, "ORIGIN_ERROR",
                                      f"origin answered HTTP {resp.status} for {what}: {await error_text(resp)}")
                try:
                    check_content_range(resp.headers.get("Content-Range", ""), read.start, read.end, fill.size)
                except ContentRangeError:
                    raise HTTPFailure(502, "ORIGIN_ERROR", f"origin answered Content-Range "
                                      f"{resp.headers.get('Content-Range')!r} for {what}") from None
                # pos: the end of the bytes handed on. Each piece goes to the clients from
                # memory first (RangeRead.mem), and into the staging file in an I/O thread
                # while the next pieces come (`writing`): any number in flight while their
                # bytes are in memory, past RANGE_MEMORY one at a time
                pos, buf = read.start, bytearray()
                flush = min(self._block, _AHEAD_PIECE)
                try:
                    async for piece in resp.content.iter_chunked(self._block):
                        self.stats["origin_range_bytes"] += len(piece)
                        if buf or len(piece) < flush:  # (pieces of a flush or more go on as they are)
                            buf += piece
                            if len(buf) < flush and pos + len(buf) < read.end:
                                continue
                            data = bytes(buf)
                            buf.clear()
                        else:
                            data = piece
                        if fill.done or fill.written >= read.end:
                            return  # the fill has passed it
                        if len(read.mem) == pos - read.start and pos + len(data) - read.start <= RANGE_MEMORY:
                            read.mem += data
                            fill.notify()
                            writing.check()
                        else:
                            await writing.drain()
                        writing.add(asyncio.ensure_future(self._stage(fill, data, pos)), pos + len(data))
                        pos += len(data)
                    await writing.drain()
                except (TimeoutError, aiohttp.ClientError) as exc:
                    raise HTTPFailure(502, "ORIGIN_ERROR", f"origin connection lost after {read.got} bytes of "
                                      f"{what}: {_describe(exc)}") from None
                if pos != read.end:
                    raise HTTPFailure(502, "ORIGIN_ERROR", f"origin sent {pos - read.start} bytes for {what}")
        except HTTPFailure as failure:
            read.error = failure
            self.stats["range_reads_failed"] += 1
            log.warning("range read of %s failed: %s", what, failure.message)
        except asyncio.CancelledError:
            read.error = HTTPFailure(503, "UNAVAILABLE", f"range read of {what} stopped")
            raise
        except Exception as exc:  # a bug or a local I/O failure: fail this read only
            read.error = HTTPFailure(500, "INTERNAL", f"range read of {what} failed: {exc}")
            self.stats["range_reads_failed"] += 1
            log.exception("range read of %s failed", what)
        finally:
            await writing.settle()  # (their threads write into fill.fd: the fill must not close it before)
            read.end = read.start + read.got if read.error is None else read.end
            read.done, read.mem = True, bytearray()  # (what clients still need is in the file)
            fill.notify()
            fill.release_reader()

    async def _stage(self, fill: Fill, data: bytes, pos: int) -> bool:
        """Write a range read's `data` at `pos` into the fill's staging file once it is
        open (_write_ahead, in an I/O thread): True; False when the fill ended first
        (nothing written). Raises OSError."""
        await fill.wait_until(lambda: fill.fd >= 0 or fill.done)
        if fill.done:
            return False
        await self._run(_write_ahead, fill, data, pos)
        return True

    # --- everything else under /v2/ -----------------------------------------------------

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        if request.method not in ("GET", "HEAD"):
            return HTTPFailure(405, "UNSUPPORTED", "the region cache is read-only (GET and HEAD only)",
                               {"Allow": "GET, HEAD"}).response(request.method)
        ns = request.query.get("ns")
        if ns and not self.upstream.serves(ns):
            return HTTPFailure(404, "NAME_UNKNOWN", f"this region cache serves {self.upstream.host}, not {ns}").response(
                request.method)
        self.stats["proxied"] += 1
        query = [(k, v) for k, v in request.query.items() if k != "ns"]
        path = request.path + ("?" + "&".join(f"{k}={v}" for k, v in query) if query else "")
        m = re.match(r"^/v2/(.+)/(manifests|tags)/", request.path)
        repo = m.group(1) if m else None
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("accept", "if-none-match")}
        try:
            upstream = await self.upstream.request(request.method, path, request.headers.get("Authorization"),
                                                   repo, headers)
        except (TimeoutError, aiohttp.ClientError) as exc:
            return HTTPFailure(502, "ORIGIN_ERROR", f"origin {self.upstream.host}: {_describe(exc)}").response(
                request.method)
        async with upstream:
            out = {k: upstream.headers[k] for k in _PASS_HEADERS if k in upstream.headers}
            resp = web.StreamResponse(status=upstream.status, headers=out)
            await resp.prepare(request)
            if request.method == "GET":
                async for piece in upstream.content.iter_chunked(64 << 10):
                    await resp.write(piece)
            await resp.write_eof()
        log.info("%s %s %s -> %d (origin)", request.remote, request.method, request.path, upstream.status)
        return resp


def region_metrics(stats: dict, backend: dict) -> list[Metric]:
    """The cache's lines of `GET /-/metrics`: RegionCache.statistics() and the backend's."""
    c, g = "counter", "gauge"
    out = [
        ("shoal_region_requests_total", c, "Blob requests.", stats["requests"]),
        ("shoal_region_cache_hits_total", c, "Blob requests served from the cache.", stats["hits"]),
        ("shoal_region_cache_misses_total", c, "Blob requests that started a fill from the origin.", stats["misses"]),
        ("shoal_region_coalesced_total", c, "Blob requests that joined a fill under way.", stats["coalesced"]),
        ("shoal_region_served_bytes_total", c, "Blob bytes sent to clients.", stats["bytes_served"]),
        ("shoal_region_origin_bytes_total", c, "Blob bytes read from the origin by fills (whole blobs).",
         stats["origin_bytes"]),
        ("shoal_region_origin_range_bytes_total", c, "Blob bytes read from the origin as ranges ahead of fills.",
         stats["origin_range_bytes"]),
        ("shoal_region_fill_reused_bytes_total", c,
         "Blob bytes fills took from range reads (from the staging file) instead of the origin.",
         stats["fill_reused_bytes"]),
        ("shoal_region_range_reads_total", c, "Origin range requests ahead of fills.", stats["range_reads"]),
        ("shoal_region_range_joins_total", c, "Range answers that joined a range read another request started.",
         stats["range_joins"]),
        ("shoal_region_fills_total", c, "Fills by outcome.",
         [({"result": "committed"}, stats["fills_committed"]), ({"result": "failed"}, stats["fills_failed"])]),
        ("shoal_region_errors_total", c, "Blob requests answered 5xx.", stats["errors"]),
        ("shoal_region_store_verify_failures_total", c, "Stored copies that failed their digest and were dropped.",
         stats["store_verify_failures"]),
        ("shoal_region_stored_bytes", g, "Bytes in the backend.", backend.get("size_bytes")),
        ("shoal_region_capacity_bytes", g, "The backend's capacity.", backend.get("capacity_bytes")),
        ("shoal_region_stored_blobs", g, "Blobs in the backend.", backend.get("blobs")),
    ]
    return out


def _http_error(f: HTTPFailure) -> web.HTTPException:
    cls = {401: web.HTTPUnauthorized, 403: web.HTTPForbidden, 404: web.HTTPNotFound}.get(f.status, web.HTTPBadGateway)
    return cls(text=f.message + "\n", headers=f.headers)


def _blob_headers(digest: str, size: int, span: tuple[int, int] | None = None) -> dict[str, str]:
    headers = {
        "Content-Type": "application/octet-stream",
        "Docker-Content-Digest": digest,
        "Docker-Distribution-Api-Version": "registry/2.0",
        "Accept-Ranges": "bytes",
        "Etag": f'"{digest}"',
        "Content-Length": str(size),
    }
    if span is not None:
        headers["Content-Range"] = f"bytes {span[0]}-{span[1] - 1}/{size}"
        headers["Content-Length"] = str(span[1] - span[0])
    return headers


def _open_staging(path: str) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)


def _unlink(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _write_at(fd: int, data, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_fill(fill: Fill, data: bytes, offset: int, hasher) -> None:
    """In a worker thread: the fill's own bytes at `offset`, moving its frontier."""
    hasher.update(data)
    with fill.lock:
        _write_at(fill.fd, data, offset)
        fill.frontier = offset + len(data)


def _take_staged(fill: Fill, offset: int, n: int, hasher) -> None:
    """In a worker thread: the `n` bytes at `offset` (the fill's frontier) that range
    reads wrote, read back from the staging file and hashed as the fill's own, the
    frontier moved over them under the lock (so no range read writes there after)."""
    with fill.lock:
        if fill.frontier != offset:
            raise RuntimeError(f"staging file of {fill.digest}: frontier at {fill.frontier}, taking from {offset}")
        data = os.pread(fill.fd, n, offset)
        if len(data) != n:
            raise RuntimeError(f"staging file of {fill.digest} is short at {offset}")
        fill.frontier = offset + n
    hasher.update(data)


def _write_ahead(fill: Fill, data: bytes, offset: int) -> None:
    """In a worker thread: a range read's bytes at `offset`, only those at or above the
    fill's frontier (below it the file holds the fill's own, hashed bytes)."""
    with fill.lock:
        skip = max(0, fill.frontier - offset)
        if skip < len(data):
            _write_at(fill.fd, memoryview(data)[skip:], offset + skip)


def _hash_and_next(stream, hasher, data: bytes) -> bytes | None:
    """In a worker thread: hash `data` (when hashing) and read the stream's next block."""
    if hasher is not None:
        hasher.update(data)
    return next(stream, None)


def _abort(request: web.Request) -> None:
    """Cut the connection: the client sees a short body, never a complete bad one."""
    if request.transport is not None:
        request.transport.close()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "timed out"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    return str(exc) or type(exc).__name__


@dataclass
class RunningServer:
    """A started region cache: `port` is the bound port, `cache` the RegionCache."""

    runner: web.AppRunner
    port: int
    cache: RegionCache

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_server(config: RegionConfig, backend: Backend, host: str, port: int, *, tls=None,
                       node_token: str = "") -> RunningServer:
    """Start serving the cache alone on host:port (0: any free port), over HTTPS with
    `tls` (a cache.region.tls.RegionTLS), else plain HTTP. The backend is closed on
    stop(). (`shoal region` serves the assembled region: region/service.py.)"""
    return await serve(RegionCache(config, backend, tls=tls, node_token=node_token), host, port)


async def serve(cache: RegionCache, host: str, port: int) -> RunningServer:
    """Serve `cache` (and whatever is mounted on it) on host:port (0: any free port)."""
    runner = web.AppRunner(cache.app, access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=True,
                           ssl_context=cache.tls.server_context() if cache.tls else None)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return RunningServer(runner, runner.addresses[0][1], cache)
