"""The region's preheat service: the nodes it knows, and jobs that warm an image on them.

Mounted at PREFIX (/prefetch/v1) on the region cache (region/service.py, through the
cache's Extension seam). Two kinds of caller, each with its own secret:

The scheduler's hook (`shoal prefetch --region`), with the API token (header
API_TOKEN_HEADER; the region's `[prefetch] token_file`):

- `POST /jobs` `{"image": REF, "nodes": [NAME, ...], "mode": "profile"|"full",
  "timeout_s": N, "ready_fraction": F}` (defaults profile, 600, 1.0) -> 201 `{"id"}`.
  The image is resolved to its manifest digest at the origin here, with the caller's
  `Authorization` (the origin decides who may read it, as for blob reads): a refusal is
  the origin's status and challenge, and no job is made.
- `GET /jobs/ID` -> the job (Job.view: id, image, manifest, mode, state, nodes, ready_nodes,
  origin_bytes, ...); `DELETE /jobs/ID` cancels it; `GET /jobs` lists them; `GET /nodes`
  lists the nodes the region knows.

The nodes (prefetch/worker.py), with the region's node token (cache.region.tls.TOKEN_HEADER):

- `POST /nodes/NAME` `{"address", "version"}`: registers (again, after a restart: the
  jobs it had not finished are handed to it again);
- `DELETE /nodes/NAME`: the node stops (its worker's last call): it is down at once, and
  its held poll answers now; it is up again when it registers again;
- `GET /nodes/NAME/work`: a long poll, held up to `poll_s`, answering
  `{"jobs": [assignment...], "cancel": [ID...], "poll_s"}`; the node repeats it at once,
  so the region hands it work with no inbound port on the node. An assignment is
  `{"id", "image", "manifest", "mode", "timeout_s", "part": [I, N]}`: the node is the
  I-th (from 0) by sorted name of the job's N nodes that were up when it was made, and
  fetches that part of its target first (prefetch/warmup.py), so that the nodes fetch
  different parts from the region at first and the rest from each other through the
  swarm (a node not up then gets [0, 1]: all in order; a node before parts ignores it);
  `"held": [DIGEST...]`: the layers of a profile job the region did not hold whole when
  the job was made, which it holds to the ranges the nodes ask: the node reads the parts
  of its target that fill pieces sparsely as asked, not as whole pieces through the
  swarm (p2p/ondemand.py), so the origin serves the ranges asked and no more;
- `POST /nodes/NAME/reports` `{"job", "state": "warming"|"warm"|"failed"|"timeout",
  "warm_bytes", "target_bytes", "error", "peer_bytes"?}`: what the node measured (its
  layer file system's warmth op; peer_bytes, in its final report: the blob bytes its
  swarm took from peers during the warm-up).

A node not heard from (poll or report) for `node_timeout` seconds is down: listed so,
and in a job its state is "down" with an error saying since when (it comes back when the
node does). A job's state is worked out from the nodes' reports and the clock whenever
it is asked for or reported on (no timer): "pending" (no node has reported), "running",
"ready" (at least ceil(ready_fraction * len(nodes)) nodes warm; kept once reached),
"failed" (too many nodes failed for that to happen), "timeout" (timeout_s passed first),
"cancelled". origin_bytes: the region's origin bytes (fills and range reads, every blob)
from the job's creation to its end (ready or a final state), and region_bytes the blob
bytes the region served in that time: the whole region's, so concurrent jobs and cold
starts count in each other's. peer_bytes: the sum of what the nodes reported taking
from their swarm peers during their warm-ups.

Everything runs on the region's event loop; nothing here blocks. Bad input is a 4xx with
a one-line reason (`{"error": ...}`, text/plain for the reason too in `message`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from builder.oci.documents import parse_index, parse_manifest
from cache.region.server import RegionCache
from cache.region.tls import ANY_NODE, NODE_NAME_RE, TOKEN_HEADER
from prefetch.client import API_TOKEN_HEADER, PREFIX  # (the token on every /jobs and GET /nodes call)
from shoal.errors import FormatError, UsageError
from shoal.mediatypes import ACCEPT_MANIFESTS
from shoal.metrics import Metric

log = logging.getLogger("shoal.preheat")

MODES = ("profile", "full")
MAX_TIMEOUT_S = 7 * 86400
MAX_NODES = 100_000
MAX_JOBS = 1000  # jobs remembered; the oldest finished ones are forgotten first
MAX_MANIFEST = 8 << 20
REFRESH_EVERY = 0.25  # seconds between two scans of one job's nodes
MAX_PLATFORMS = 16  # platform manifests of an index whose layers a profile job holds (hold_fills)
HOLD_MARGIN = 30.0  # seconds a profile job's hold outlasts its timeout (a job nobody asks about ends late)
NODE_STATES = ("warming", "warm", "failed", "timeout")  # what a node may report
FINAL = ("timeout", "failed", "cancelled")


class Refused(Exception):
    """A request refused: HTTP status and a one-line reason."""

    def __init__(self, status: int, reason: str, headers: dict | None = None) -> None:
        super().__init__(reason)
        self.status, self.reason, self.headers = status, reason, headers or {}


@dataclass
class NodeRecord:
    name: str
    address: str
    version: str
    remote: str  # the address the region saw
    registered: float  # wall clock
    last_seen: float  # monotonic
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    cancels: list[str] = field(default_factory=list)  # job ids to tell it at its next poll
    left: bool = False  # the node said it stops (DELETE): down at once, until it registers again

    def up(self, now: float, timeout: float) -> bool:
        return not self.left and now - self.last_seen < timeout

    def view(self, now: float, timeout: float) -> dict:
        ago = now - self.last_seen
        return {"name": self.name, "address": self.address, "version": self.version, "remote": self.remote,
                "state": "up" if self.up(now, timeout) else "down", "last_seen_s": round(ago, 1),
                "registered": self.registered}


@dataclass
class JobNode:
    name: str
    state: str = "pending"  # pending | warming | warm | failed | timeout | down | unknown
    warm_bytes: int = 0
    target_bytes: int = 0
    error: str | None = None
    peer_bytes: int | None = None  # what the node took from swarm peers during its warm-up (its final report)
    part: tuple[int, int] = (0, 1)  # its place among the job's nodes up when it was made (sorted by name),
    # and their number: the part of the target it fetches first (0 of 1 for a node that was not up)
    delivered: bool = False
    reported: str = ""  # the last state the node reported

    def view(self) -> dict:
        return {"name": self.name, "state": self.state, "warm_bytes": self.warm_bytes,
                "target_bytes": self.target_bytes, "error": self.error, "peer_bytes": self.peer_bytes}


@dataclass
class Job:
    id: str
    image: str
    manifest: str
    mode: str
    timeout_s: float
    ready_fraction: float
    nodes: dict[str, JobNode]
    created: float  # monotonic
    created_wall: float
    origin_start: int
    served_start: int
    state: str = "pending"
    refreshed: float = -1e9  # monotonic: the last scan of its nodes (PreheatService.refresh)
    ended: float | None = None
    origin_bytes: int = 0
    region_bytes: int = 0
    held: list[str] = field(default_factory=list)  # blobs the region fills by ranges only while it runs
    cold: list[str] = field(default_factory=list)  # of them, those it did not hold whole when the job was made

    @property
    def needed(self) -> int:
        return max(1, math.ceil(self.ready_fraction * len(self.nodes) - 1e-9))

    @property
    def active(self) -> bool:
        return self.state not in FINAL and self.state != "ready"

    def view(self) -> dict:
        return {"id": self.id, "image": self.image, "manifest": self.manifest, "mode": self.mode,
                "state": self.state, "timeout_s": self.timeout_s, "ready_fraction": self.ready_fraction,
                "nodes": [n.view() for n in self.nodes.values()],
                "ready_nodes": sum(n.state == "warm" for n in self.nodes.values()), "needed_nodes": self.needed,
                "origin_bytes": self.origin_bytes, "region_bytes": self.region_bytes,
                "peer_bytes": sum(n.peer_bytes or 0 for n in self.nodes.values()),
                "warm_bytes": sum(n.warm_bytes for n in self.nodes.values()),
                "target_bytes": sum(n.target_bytes for n in self.nodes.values()),
                "age_s": round(time.monotonic() - self.created, 1)}


def _job_nodes(names: list[str], up: set[str]) -> dict[str, JobNode]:
    """A job's nodes, in the order named, each of those `up` with its part: its rank
    among their sorted names, of their number (a node down or unknown gets none, so the
    others do not wait for it: 0 of 1, it fetches the whole target in order)."""
    ranks = {n: i for i, n in enumerate(sorted(up & set(names)))}
    return {n: JobNode(n, part=(ranks[n], len(ranks)) if n in ranks else (0, 1)) for n in names}


def check_job_request(doc: object, origin_serves) -> dict:
    """The job a POST /jobs body asks for, every field checked: {"image", "host",
    "repository", "reference", "nodes", "mode", "timeout_s", "ready_fraction"}.
    Refused(400) naming the field; `origin_serves(host)` says whether the image's
    registry is this region's origin."""
    from builder.oci.refs import parse_registry_ref

    if not isinstance(doc, dict):
        raise Refused(400, "the body must be a JSON object")
    known = {"image", "nodes", "mode", "timeout_s", "ready_fraction"}
    unknown = sorted(set(doc) - known)
    if unknown:
        raise Refused(400, f"unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    image = doc.get("image")
    if not isinstance(image, str) or not image:
        raise Refused(400, "image: want a string HOST/REPO:TAG or HOST/REPO@sha256:...")
    try:
        ref = parse_registry_ref(image)
    except UsageError as e:
        raise Refused(400, f"image {image[:200]!r}: {e}") from None
    if not origin_serves(ref.host):
        raise Refused(400, f"image {image[:200]!r}: this region serves another registry, not {ref.host}")
    nodes = doc.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise Refused(400, "nodes: want a non-empty list of node names")
    if len(nodes) > MAX_NODES:
        raise Refused(400, f"nodes: {len(nodes)} names, at most {MAX_NODES}")
    seen: dict[str, None] = {}
    for n in nodes:
        if not isinstance(n, str) or not NODE_NAME_RE.match(n):
            raise Refused(400, f"nodes: {str(n)[:80]!r} is not a node name")
        seen[n] = None
    mode = doc.get("mode", "profile")
    if mode not in MODES:
        raise Refused(400, f"mode {str(mode)[:40]!r}: want one of {', '.join(MODES)}")
    timeout = doc.get("timeout_s", 600)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= MAX_TIMEOUT_S:
        raise Refused(400, f"timeout_s {_shown(timeout)}: must be more than 0 and at most {MAX_TIMEOUT_S}")
    fraction = doc.get("ready_fraction", 1.0)
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise Refused(400, f"ready_fraction {_shown(fraction)}: must be more than 0 and at most 1")
    return {"image": image.removeprefix("docker://"), "host": ref.host, "repository": ref.repository,
            "reference": ref.reference, "digest": ref.digest, "nodes": list(seen), "mode": mode,
            "timeout_s": float(timeout), "ready_fraction": float(fraction)}


def _shown(value: object) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}"
    return str(value)[:40]


class PreheatService:
    """The preheat service on one RegionCache (its origin client and counters). The
    cache's Extension: name, statistics(), metrics()."""

    name = "prefetch"

    def __init__(self, cache: RegionCache, api_token: str, node_timeout: float = 30.0,
                 hold_after_job: float = 30.0) -> None:
        """api_token: what callers of /jobs present ("" = none asked: in-process tests);
        node_timeout: seconds without a word from a node before it is down;
        hold_after_job: seconds a profile job's blobs stay held after its end."""
        self.cache = cache
        self.api_token = api_token
        self.node_timeout = node_timeout
        self.hold_after_job = hold_after_job
        self.poll_s = max(0.5, min(25.0, node_timeout / 3))
        self.nodes: dict[str, NodeRecord] = {}
        self.jobs: dict[str, Job] = {}
        self.counts = dict.fromkeys(("jobs_created", "jobs_refused", "reports", "registrations"), 0)
        self.app = web.Application(client_max_size=8 << 20)
        r = self.app.router
        r.add_post("/jobs", self._create)
        r.add_get("/jobs", self._list)
        r.add_get("/jobs/{id}", self._get)
        r.add_delete("/jobs/{id}", self._cancel)
        r.add_get("/nodes", self._list_nodes)
        r.add_post("/nodes/{name}", self._register)
        r.add_delete("/nodes/{name}", self._leave)
        r.add_get("/nodes/{name}/work", self._work)
        r.add_post("/nodes/{name}/reports", self._report)
        self.closing = False
        self.app.on_shutdown.append(self._on_shutdown)

    async def _on_shutdown(self, app: web.Application) -> None:
        """The region stops: the held polls answer now (their nodes poll again, elsewhere or later)."""
        self.closing = True
        for node in self.nodes.values():
            node.wake.set()

    # --- the Extension seam -------------------------------------------------------------

    def statistics(self) -> dict:
        now = time.monotonic()
        up = sum(n.up(now, self.node_timeout) for n in self.nodes.values())
        states: dict[str, int] = {}
        for job in self.jobs.values():
            states[job.state] = states.get(job.state, 0) + 1
        return {"nodes": len(self.nodes), "nodes_up": up, "jobs": states, **self.counts}

    def metrics(self) -> list[Metric]:
        s = self.statistics()
        return [
            ("shoal_region_prefetch_nodes", "gauge", "Nodes registered for preheat work, by state.",
             [({"state": "up"}, s["nodes_up"]), ({"state": "down"}, s["nodes"] - s["nodes_up"])]),
            ("shoal_region_prefetch_jobs", "gauge", "Preheat jobs remembered, by state.",
             [({"state": k}, v) for k, v in sorted(s["jobs"].items())]),
            ("shoal_region_prefetch_jobs_created_total", "counter", "Preheat jobs made.", s["jobs_created"]),
        ]

    # --- helpers ---------------------------------------------------------------------

    def _check_token(self, request: web.Request, header: str, expected: str, what: str) -> None:
        if expected and not hmac.compare_digest(request.headers.get(header, "").encode(), expected.encode()):
            raise Refused(401, f"{what} needs {header}")

    def _api(self, request: web.Request) -> None:
        self._check_token(request, API_TOKEN_HEADER, self.api_token, "the preheat API")

    def _node(self, request: web.Request) -> str:
        """The node a call is for, once its token may speak for it: a node's own token
        (cache/region/tls.py NodeTokens) only for its own name, the shared one for any."""
        who = self.cache.node_tokens.identify(request.headers.get(TOKEN_HEADER, ""))
        if who is None:
            raise Refused(401, f"a node's call needs {TOKEN_HEADER} (a node token of this region, not revoked)")
        name = request.match_info["name"]
        if not NODE_NAME_RE.match(name):
            raise Refused(400, f"{name[:80]!r} is not a node name")
        if who not in (ANY_NODE, name):
            log.warning("%s: a call for node %s with node %s's token refused", request.remote, name, who)
            raise Refused(403, f"this node token is node {who}'s: it cannot speak for node {name}")
        return name

    @staticmethod
    async def _body(request: web.Request) -> object:
        try:
            return json.loads(await request.read())
        except (ValueError, UnicodeDecodeError):
            raise Refused(400, "the body is not JSON") from None
        except web.HTTPRequestEntityTooLarge:
            raise Refused(413, "the body is too large") from None

    def _up(self) -> set[str]:
        """The names of the nodes up: heard from within node_timeout, and not stopped (DELETE)."""
        now = time.monotonic()
        return {name for name, node in self.nodes.items() if node.up(now, self.node_timeout)}

    def _origin_counters(self) -> tuple[int, int]:
        st = self.cache.stats
        return st["origin_bytes"] + st["origin_range_bytes"], st["bytes_served"]

    def refresh(self, job: Job, force: bool = False) -> None:
        """Work out the job's state and its nodes' from the reports and the clock: a scan
        of its nodes, at most every REFRESH_EVERY seconds per job unless forced (a job of
        100,000 nodes and their reports must not cost a scan each)."""
        if not job.active:
            return
        now = time.monotonic()
        if not force and now - job.refreshed < REFRESH_EVERY:
            return
        job.refreshed = now
        for jn in job.nodes.values():
            node = self.nodes.get(jn.name)
            if jn.state in ("warm", "failed", "timeout"):
                continue
            if node is None:
                jn.state, jn.error = "unknown", "not registered with the region (no shoal node of that name)"
            elif node.left:
                jn.state = "down"
                jn.error = f"its shoal node stopped ({now - node.last_seen:.0f}s ago; it said so)"
            elif now - node.last_seen >= self.node_timeout:
                jn.state = "down"
                jn.error = f"stopped answering (last heard {now - node.last_seen:.0f}s ago)"
            elif jn.state in ("down", "unknown"):
                jn.state, jn.error = ("warming" if jn.reported else "pending"), None
        warm = sum(n.state == "warm" for n in job.nodes.values())
        lost = sum(n.state in ("failed", "timeout") for n in job.nodes.values())
        if warm >= job.needed:
            self._end(job, "ready")
        elif len(job.nodes) - lost < job.needed:
            self._end(job, "failed")
        elif now - job.created >= job.timeout_s:
            for jn in job.nodes.values():
                if jn.state in ("pending", "warming"):
                    jn.state = "timeout"
                    jn.error = jn.error or (f"{jn.warm_bytes} of {jn.target_bytes} bytes warm after "
                                            f"{job.timeout_s:g}s" if jn.reported else "never started its warm-up")
            self._end(job, "timeout")
        else:
            job.state = "running" if any(n.reported for n in job.nodes.values()) else "pending"
            origin, served = self._origin_counters()
            job.origin_bytes, job.region_bytes = origin - job.origin_start, served - job.served_start

    def _end(self, job: Job, state: str) -> None:
        job.state, job.ended = state, time.monotonic()
        origin, served = self._origin_counters()
        job.origin_bytes, job.region_bytes = origin - job.origin_start, served - job.served_start
        # their fills fetch the rest once the job's starts are under way (hold_after_job), or
        # when a node asks for a whole blob (a layer proof): one copy in the region, and no
        # whole-blob fill competing with the starts the job's end lets go
        self.cache.release_fills(job.held, self.hold_after_job)
        job.held = []
        log.info("preheat job %s (%s, %s): %s, %d of %d nodes warm, origin bytes %d", job.id, job.image,
                 job.mode, state, sum(n.state == "warm" for n in job.nodes.values()), len(job.nodes),
                 job.origin_bytes)

    def _job(self, request: web.Request) -> Job:
        job = self.jobs.get(request.match_info["id"])
        if job is None:
            raise Refused(404, f"no preheat job {request.match_info['id'][:40]!r}")
        self.refresh(job, force=len(job.nodes) <= 1000)
        return job

    def _forget_old(self) -> None:
        while len(self.jobs) >= MAX_JOBS:
            done = [j for j in self.jobs.values() if not j.active] or list(self.jobs.values())
            del self.jobs[min(done, key=lambda j: j.created).id]

    async def _resolve(self, want: dict, authorization: str | None) -> tuple[str, bytes]:
        """The image's manifest digest at the origin, and its bytes, read with the
        caller's credentials (the origin's refusal is the answer); the bytes checked
        against their digest."""
        digest, data = await self._manifest(want["repository"], want["reference"], want["image"], authorization)
        if want["digest"] and want["digest"] != digest:
            raise Refused(502, f"the origin's manifest of {want['image']} has digest {digest}")
        return digest, data

    async def _layers(self, repo: str, data: bytes, image: str, authorization: str | None) -> list[str]:
        """The layer digests the image's manifest names (every platform's, for an index:
        the nodes pick theirs), or [] when they cannot be read (the job goes on, its
        blobs filled whole)."""
        try:
            doc = json.loads(data)
            if isinstance(doc, dict) and "manifests" in doc:
                out: list[str] = []
                for entry in parse_index(data, image).manifests[:MAX_PLATFORMS]:
                    digest, child = await self._manifest(repo, entry.digest, image, authorization)
                    if digest != entry.digest:
                        raise FormatError(f"manifest {entry.digest} of {image} has digest {digest}")
                    out += [d.digest for d in parse_manifest(child, image).layers]
                return out
            return [d.digest for d in parse_manifest(data, image).layers]
        except (ValueError, FormatError, Refused) as exc:
            log.warning("preheat of %s: cannot read its layers (%s): its blobs are filled whole", image, exc)
            return []

    async def _manifest(self, repo: str, reference: str, image: str, authorization: str | None) -> tuple[str, bytes]:
        """(digest, bytes) of manifest `reference` of `repo` at the origin (Refused: the
        origin's refusal, or a manifest that is not one)."""
        upstream = self.cache.upstream
        try:
            resp = await upstream.request("GET", f"/v2/{repo}/manifests/{reference}", authorization, repo,
                                          {"Accept": ACCEPT_MANIFESTS})
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise Refused(502, f"origin {upstream.host}: {exc or type(exc).__name__}") from None
        async with resp:
            if resp.status in (401, 403):
                hdr = resp.headers.get("WWW-Authenticate")
                raise Refused(resp.status, f"the origin refuses access to {repo} (HTTP {resp.status})",
                              {"WWW-Authenticate": hdr} if hdr else None)
            if resp.status == 404:
                raise Refused(404, f"image {image} is not at the origin (HTTP 404)")
            if resp.status != 200:
                raise Refused(502, f"origin answered HTTP {resp.status} for {image}")
            data = b""
            async for piece in resp.content.iter_chunked(64 << 10):
                data += piece
                if len(data) > MAX_MANIFEST:
                    raise Refused(502, f"the origin's manifest of {image} is over {MAX_MANIFEST} bytes")
        return "sha256:" + hashlib.sha256(data).hexdigest(), data

    # --- the API -----------------------------------------------------------------------

    async def _create(self, request: web.Request) -> web.Response:
        self._api(request)
        want = check_job_request(await self._body(request), self.cache.upstream.serves)
        try:
            manifest, data = await self._resolve(want, request.headers.get("Authorization"))
        except Refused:
            self.counts["jobs_refused"] += 1
            raise
        held: list[str] = []
        if want["mode"] == "profile":  # the origin serves the ranges the nodes read, not whole blobs
            held = await self._layers(want["repository"], data, want["image"], request.headers.get("Authorization"))
            self.cache.hold_fills(held, want["timeout_s"] + HOLD_MARGIN)
        cold = [d for d in held if not await self.cache._run(self.cache._stored, d)]
        self._forget_old()
        origin, served = self._origin_counters()
        job = Job(secrets.token_hex(8), want["image"], manifest, want["mode"], want["timeout_s"],
                  want["ready_fraction"], _job_nodes(want["nodes"], self._up()),
                  time.monotonic(), time.time(),
                  origin, served, held=held, cold=cold)
        self.jobs[job.id] = job
        self.counts["jobs_created"] += 1
        for name in job.nodes:
            if name in self.nodes:
                self.nodes[name].wake.set()
        self.refresh(job, force=True)
        log.info("preheat job %s: %s (%s) on %d nodes, ready at %d, timeout %gs", job.id, job.image, manifest,
                 len(job.nodes), job.needed, job.timeout_s)
        return web.json_response({"id": job.id, "manifest": manifest}, status=201)

    async def _get(self, request: web.Request) -> web.Response:
        self._api(request)
        return web.json_response(self._job(request).view())

    async def _list(self, request: web.Request) -> web.Response:
        self._api(request)
        for job in self.jobs.values():
            self.refresh(job)
        return web.json_response({"jobs": [{"id": j.id, "image": j.image, "state": j.state, "nodes": len(j.nodes)}
                                           for j in self.jobs.values()]})

    async def _cancel(self, request: web.Request) -> web.Response:
        self._api(request)
        job = self._job(request)
        if job.active:
            self._end(job, "cancelled")
            for jn in job.nodes.values():
                node = self.nodes.get(jn.name)
                if node is not None and jn.delivered and jn.state not in ("warm", "failed", "timeout"):
                    node.cancels.append(job.id)
                    node.wake.set()
        return web.json_response(job.view())

    async def _list_nodes(self, request: web.Request) -> web.Response:
        self._api(request)
        now = time.monotonic()
        return web.json_response({"nodes": [n.view(now, self.node_timeout) for n in self.nodes.values()]})

    # --- the nodes ---------------------------------------------------------------------

    async def _register(self, request: web.Request) -> web.Response:
        name = self._node(request)
        doc = await self._body(request)
        if not isinstance(doc, dict) or not all(isinstance(doc.get(k, ""), str) for k in ("address", "version")):
            raise Refused(400, "want {\"address\": STR, \"version\": STR}")
        if name not in self.nodes and len(self.nodes) >= MAX_NODES:
            raise Refused(429, f"the region knows {MAX_NODES} nodes already")
        old = self.nodes.get(name)
        node = NodeRecord(name, str(doc.get("address", ""))[:255], str(doc.get("version", ""))[:64],
                          request.remote or "", time.time(), time.monotonic())
        if old is not None:
            old.wake.set()  # its old poll (a restarted node's) ends
        self.nodes[name] = node
        self.counts["registrations"] += 1
        for job in self.jobs.values():  # a (re)started node gets what it had not finished
            jn = job.nodes.get(name)
            if jn is not None and job.active and jn.state not in ("warm", "failed", "timeout"):
                jn.delivered = False
        log.info("node %s registered (%s, version %s, from %s)%s", name, node.address, node.version, node.remote,
                 " again" if old else "")
        return web.json_response({"name": name, "poll_s": self.poll_s, "node_timeout": self.node_timeout})

    def _registered(self, name: str) -> NodeRecord:
        node = self.nodes.get(name)
        if node is None:
            raise Refused(404, f"node {name} is not registered: register first")
        node.last_seen = time.monotonic()
        return node

    def _assignments(self, node: NodeRecord) -> list[dict]:
        out = []
        now = time.monotonic()
        for job in self.jobs.values():
            jn = job.nodes.get(node.name)
            if jn is None or jn.delivered or not job.active or now - job.created >= job.timeout_s:
                continue
            jn.delivered = True
            out.append({"id": job.id, "image": job.image, "manifest": job.manifest, "mode": job.mode,
                        "timeout_s": max(1.0, job.timeout_s - (now - job.created)),
                        "part": list(jn.part), "held": job.cold})
        return out

    async def _work(self, request: web.Request) -> web.Response:
        name = self._node(request)
        node = self._registered(name)
        deadline = time.monotonic() + self.poll_s
        while True:
            node.wake.clear()
            jobs, cancels = self._assignments(node), node.cancels
            node.cancels = []
            if jobs or cancels or self.closing or node.left or self.nodes.get(name) is not node:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(node.wake.wait(), left)
        if not node.left:
            node.last_seen = time.monotonic()
        return web.json_response({"jobs": jobs, "cancel": cancels, "poll_s": self.poll_s})

    async def _leave(self, request: web.Request) -> web.Response:
        """The node stops (its worker's last call): down at once, in the list and in its
        jobs, not node_timeout later; its held poll answers now, so the node's stop does
        not wait for it."""
        name = self._node(request)
        node = self.nodes.get(name)
        if node is None:
            raise Refused(404, f"node {name} is not registered")
        node.left = True
        node.last_seen = time.monotonic()
        node.wake.set()
        for job in self.jobs.values():
            if name in job.nodes:
                self.refresh(job, force=True)
        log.info("node %s stopped (it said so)", name)
        return web.json_response({"name": name, "state": "down"})

    async def _report(self, request: web.Request) -> web.Response:
        name = self._node(request)
        node = self._registered(name)
        doc = await self._body(request)
        if not isinstance(doc, dict):
            raise Refused(400, "the body must be a JSON object")
        job = self.jobs.get(str(doc.get("job", "")))
        if job is None:
            raise Refused(404, f"no preheat job {str(doc.get('job'))[:40]!r}")
        jn = job.nodes.get(node.name)
        if jn is None:
            raise Refused(409, f"node {name} is not one of job {job.id}'s nodes")
        state = doc.get("state")
        warm, target = doc.get("warm_bytes"), doc.get("target_bytes")
        error = doc.get("error")
        if state not in NODE_STATES or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                               for v in (warm, target)) \
                or not (error is None or isinstance(error, str)):
            raise Refused(400, f"want state in {NODE_STATES}, warm_bytes and target_bytes >= 0, error null or text")
        self.counts["reports"] += 1
        if job.active or job.state == "ready":
            jn.state, jn.warm_bytes, jn.target_bytes = state, int(warm), int(target)  # type: ignore[arg-type]
            jn.error = error[:500] if isinstance(error, str) and error else None
            jn.reported = state
            peers = doc.get("peer_bytes")
            if isinstance(peers, int) and not isinstance(peers, bool) and peers >= 0:
                jn.peer_bytes = peers
            self.refresh(job)
        return web.json_response({"job": job.id, "state": job.state, "cancelled": job.state == "cancelled"})


@web.middleware
async def _one_line_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except Refused as r:
        return web.json_response({"error": r.reason}, status=r.status, headers=r.headers)


def mount_preheat(cache: RegionCache, api_token: str, node_timeout: float = 30.0,
                  hold_after_job: float = 30.0) -> PreheatService:
    """Mount the preheat service on the region cache (before it starts) at PREFIX."""
    service = PreheatService(cache, api_token, node_timeout, hold_after_job)
    service.app.middlewares.append(_one_line_errors)
    cache.mount(PREFIX, service.app, service)
    return service
