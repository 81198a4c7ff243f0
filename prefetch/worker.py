"""The node's preheat worker: registered with its region, it takes the warm-ups the
region hands it (region/preheat.py) and reports what it measured.

    worker = PreheatWorker(link, name, address, version, run)
    worker.start()   # a thread: register, then long-poll GET /prefetch/v1/nodes/NAME/work
    worker.stop()    # running warm-ups are told to stop; the region hears the node stops
                     # (DELETE), which ends the held poll at once

The node opens every connection (a long poll it repeats at once), so it needs no inbound
port; the region hears from it at every poll and report and holds it down when it stops.
The link is the node's own to its region (cache.region.client.RegionLink: the pinned CA,
the node token on every call).

`run(assignment, progress)` is the node's warm-up (the assembly plugs in
snapshotter/preheat.py): it blocks, calls progress(Report) as it measures (at most a
report a second goes to the region; progress returns False once the job was cancelled,
and the run should then stop: raising Cancelled is fine) and returns the final Report.
An exception from run is reported as the node's failure with its one-line message.

Threads: the poll thread, one thread per running assignment. Nothing raises out of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import requests

from cache.region.client import RegionLink
from cache.region.tls import TOKEN_HEADER
from prefetch.client import PREFIX
from prefetch.warmup import check_part
from shoal.digest import is_digest
from shoal.errors import ShoalError

log = logging.getLogger("shoal.preheat")

REPORT_EVERY = 1.0  # seconds between progress reports of one assignment
RETRY_MAX = 30.0  # seconds between registration attempts, at most


@dataclass(frozen=True)
class Assignment:
    id: str
    image: str  # HOST/REPO[:TAG|@DIGEST], as the job named it
    manifest: str  # the digest the region resolved it to
    mode: str  # profile | full
    timeout_s: float  # seconds left of the job
    part: tuple[int, int] = (0, 1)  # this node's rank of the job's nodes, and their number (a region
    # before parts sends none: 0 of 1); the warm-up fetches that part of its target first
    held: tuple[str, ...] = ()  # layers the region holds to the ranges its nodes read (not filled:
    # a profile job's cold layers): the warm-up reads what its target fills sparsely as asked


@dataclass
class Report:
    state: str  # warming | warm | failed | timeout
    warm_bytes: int = 0
    target_bytes: int = 0
    error: str | None = None
    peer_bytes: int | None = None  # blob bytes the node took from its swarm peers during the warm-up (final report)


class Cancelled(Exception):
    """The region cancelled the assignment (raised by a run that learnt it from progress)."""


Run = Callable[[Assignment, Callable[[Report], bool]], Report]


class PreheatWorker:
    def __init__(self, link: RegionLink, name: str, address: str, version: str, run: Run) -> None:
        self.link, self.name, self.address, self.version, self._run = link, name, address, version, run
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._session = link.session()
        self._cancelled: set[str] = set()
        self._running: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self.poll_s = 25.0
        self.registered = False

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="shoal-preheat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._cancelled.update(self._running)
        if self.registered:
            self._leave()
        self._session.close()
        if self._thread is not None:
            self._thread.join(timeout=2)  # (a region that does not know DELETE holds the poll)

    def _leave(self) -> None:
        """Tell the region this node stops: it lists the node down at once (not its
        node_timeout later) and answers the held poll now."""
        try:
            resp = self._session.delete(self._url(""), headers=self._headers(), timeout=(2, 3))
        except requests.RequestException as e:
            log.info("preheat: could not tell region %s that node %s stops: %s", self.link.url, self.name,
                     str(e).splitlines()[0][:200] if str(e) else type(e).__name__)
            return
        if resp.status_code != 200:
            log.info("preheat: region %s answered the node's stop with HTTP %d %s", self.link.url,
                     resp.status_code, _reason(resp))

    # --- the region -----------------------------------------------------------------------

    def _url(self, tail: str) -> str:
        return f"{self.link.url}{self.link.path}{PREFIX}/nodes/{self.name}{tail}"

    def _headers(self) -> dict[str, str]:
        return {TOKEN_HEADER: self.link.token} if self.link.token else {}

    def _register(self) -> None:
        resp = self._session.post(self._url(""), json={"address": self.address, "version": self.version},
                                  headers=self._headers(), timeout=(5, 10))
        if resp.status_code != 200:
            raise ShoalError(f"region {self.link.url} refused the registration of node {self.name}: "
                             f"HTTP {resp.status_code} {_reason(resp)}")
        self.poll_s = float(resp.json().get("poll_s", self.poll_s))
        self.registered = True
        log.info("registered with region %s as node %s (address %s)", self.link.url, self.name, self.address)

    def _loop(self) -> None:
        wait, last_error = 1.0, ""
        while not self._stop.is_set():
            try:
                if not self.registered:
                    self._register()
                self._poll()
                wait, last_error = 1.0, ""
            except (requests.RequestException, ShoalError, ValueError) as e:
                self.registered = False
                text = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
                if text != last_error:
                    log.warning("preheat: region %s: %s (trying again)", self.link.url, text)
                    last_error = text
                if self._stop.wait(wait):
                    return
                wait = min(RETRY_MAX, wait * 2)

    def _poll(self) -> None:
        resp = self._session.get(self._url("/work"), headers=self._headers(), timeout=(5, self.poll_s + 15))
        if resp.status_code in (401, 404):
            raise ShoalError(f"work poll: HTTP {resp.status_code} {_reason(resp)}")
        if resp.status_code != 200:
            raise ShoalError(f"work poll: HTTP {resp.status_code} {_reason(resp)}")
        doc = resp.json()
        for job_id in doc.get("cancel") or []:
            with self._lock:
                self._cancelled.add(str(job_id))
        for item in doc.get("jobs") or []:
            try:
                a = Assignment(str(item["id"]), str(item["image"]), str(item["manifest"]), str(item["mode"]),
                               float(item["timeout_s"]), _part(item.get("part")), _held(item.get("held")))
            except (KeyError, TypeError, ValueError):
                log.warning("preheat: region %s sent an assignment without its fields: %.200r", self.link.url, item)
                continue
            with self._lock:
                if a.id in self._running:
                    continue
                t = threading.Thread(target=self._work, args=(a,), name=f"shoal-preheat-{a.id}", daemon=True)
                self._running[a.id] = t
            t.start()

    # --- one assignment ---------------------------------------------------------------------

    def _work(self, a: Assignment) -> None:
        log.info("preheat job %s: warming %s (%s, %s, part %d of %d) within %.0fs", a.id, a.image, a.manifest,
                 a.mode, a.part[0] + 1, a.part[1], a.timeout_s)
        last = [0.0]

        def progress(r: Report) -> bool:
            now = time.monotonic()
            if now - last[0] >= REPORT_EVERY:
                last[0] = now
                self._send(a, r)
            with self._lock:
                return a.id not in self._cancelled

        try:
            final = self._run(a, progress)
        except Cancelled:
            final = None
        except Exception as e:
            text = str(e).splitlines()[0][:400] if str(e) else type(e).__name__
            if not isinstance(e, (ShoalError, OSError)):
                log.exception("preheat job %s", a.id)
            final = Report("failed", error=text)
        with self._lock:
            cancelled = a.id in self._cancelled
            self._cancelled.discard(a.id)
            self._running.pop(a.id, None)
        if final is None or cancelled:
            log.info("preheat job %s: cancelled", a.id)
            return
        log.info("preheat job %s: %s, %d of %d bytes warm%s", a.id, final.state, final.warm_bytes,
                 final.target_bytes, f": {final.error}" if final.error else "")
        for attempt in range(5):
            if self._send(a, final) or self._stop.wait(1.0 + attempt):
                return

    def _send(self, a: Assignment, r: Report) -> bool:
        try:
            resp = self._session.post(self._url("/reports"), json={"job": a.id, **asdict(r)},
                                      headers=self._headers(), timeout=(5, 10))
        except requests.RequestException as e:
            log.debug("preheat job %s: report: %s", a.id, e)
            return False
        if resp.status_code == 200:
            if resp.json().get("cancelled"):
                with self._lock:
                    self._cancelled.add(a.id)
            return True
        log.warning("preheat job %s: region refused the report: HTTP %d %s", a.id, resp.status_code, _reason(resp))
        return resp.status_code < 500  # refused for good: no retry


def _part(value: object) -> tuple[int, int]:
    """The assignment's part; one the worker cannot read is 0 of 1 (the whole target in
    order: slower for the region, never wrong), logged."""
    try:
        return check_part(value)
    except ValueError as e:
        log.warning("preheat: the region sent a bad part (%s): warming the whole target in order", e)
        return 0, 1


def _held(value: object) -> tuple[str, ...]:
    """The assignment's held layers (digests); anything else is none (logged)."""
    if value is None:
        return ()
    if isinstance(value, list) and len(value) <= 4096 and all(isinstance(v, str) and is_digest(v) for v in value):
        return tuple(value)
    log.warning("preheat: the region sent a bad list of held layers: %.200r", value)
    return ()


def _reason(resp: requests.Response) -> str:
    try:
        return str(resp.json().get("error", ""))[:300]
    except ValueError:
        return resp.text[:200].strip()
