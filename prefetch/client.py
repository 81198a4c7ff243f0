"""The preheat API's client (region/preheat.py): what `shoal prefetch --region` calls.

    api = PreheatClient("https://region:5080", token, ca="ca.pem")
    job_id = api.create("HOST/REPO:TAG", ["n1", "n2"], mode="profile", timeout_s=600, ready_fraction=1.0)
    job = api.get(job_id)      # the job's document (docs/prefetch.md)
    api.cancel(job_id)
    job = api.wait(job_id, deadline_s, progress)   # until its state is final or "ready"

The API token goes in API_TOKEN_HEADER; the caller's registry credentials for the image
(docker config.json, as `shoal pull` finds them) go as `Authorization`, over HTTPS only
(or plain HTTP to a loopback region): the region asks the origin with them whether the
caller may read the image. Errors: PreheatError, one line with the API's reason;
`status` is the HTTP status (0: the region could not be reached).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from urllib.parse import quote

import requests

from cache.region.client import RegionLink
from shoal.errors import ShoalError

PREFIX = "/prefetch/v1"
API_TOKEN_HEADER = "X-Shoal-Prefetch-Token"  # the preheat API's token (region/preheat.py checks it)
POLL_S = 0.5
WAITING = ("pending", "running")


class PreheatError(ShoalError):
    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class PreheatClient:
    def __init__(self, url: str, token: str, *, ca: str = "") -> None:
        self.link = RegionLink(url, ca=ca, plain_http_credentials=True)  # (credentials in clear: loopback only)
        self.token = token
        self._session = self.link.session()

    def _call(self, method: str, tail: str, **kwargs) -> dict:
        url = f"{self.link.url}{self.link.path}{PREFIX}{tail}"
        headers = {API_TOKEN_HEADER: self.token, **kwargs.pop("headers", {})}
        try:
            resp = self._session.request(method, url, headers=headers, timeout=(10, 60), **kwargs)
        except requests.exceptions.SSLError as e:
            raise PreheatError(f"region {self.link.url}: TLS refused ({str(e)[:200]}); "
                               f"trusting {self.link.ca or 'the system store'}") from None
        except requests.RequestException as e:
            raise PreheatError(f"region {self.link.url}: {type(e).__name__}: {str(e)[:200]}") from None
        try:
            doc = resp.json()
        except ValueError:
            doc = {"error": resp.text.strip()[:300]}
        if resp.status_code >= 400:
            reason = doc.get("error") if isinstance(doc, dict) else None
            raise PreheatError(f"region {self.link.url}: HTTP {resp.status_code}: {reason or resp.reason}",
                               resp.status_code)
        if not isinstance(doc, dict):
            raise PreheatError(f"region {self.link.url}: answered {str(doc)[:100]!r}, not a JSON object")
        return doc

    def create(self, image: str, nodes: list[str], *, mode: str = "profile", timeout_s: float = 600,
               ready_fraction: float = 1.0) -> str:
        from builder.oci.refs import parse_registry_ref

        ref = parse_registry_ref(image)
        headers = {}
        authorization = self.link.authorization(ref.host, ref.repository)
        if authorization:
            headers["Authorization"] = authorization
        doc = self._call("POST", "/jobs", json={"image": image.removeprefix("docker://"), "nodes": nodes,
                                                "mode": mode, "timeout_s": timeout_s,
                                                "ready_fraction": ready_fraction}, headers=headers)
        return str(doc.get("id"))

    def get(self, job_id: str) -> dict:
        return self._call("GET", f"/jobs/{quote(job_id, safe='')}")

    def cancel(self, job_id: str) -> dict:
        return self._call("DELETE", f"/jobs/{quote(job_id, safe='')}")

    def nodes(self) -> list[dict]:
        return list(self._call("GET", "/nodes").get("nodes") or [])

    def wait(self, job_id: str, deadline_s: float, progress: Callable[[dict], None] | None = None) -> dict:
        """Poll the job until it is no longer pending or running, or `deadline_s` seconds
        pass (then the job as it is: the region's own timeout comes first)."""
        end = time.monotonic() + deadline_s
        while True:
            job = self.get(job_id)
            if progress:
                progress(job)
            if job.get("state") not in WAITING or time.monotonic() >= end:
                return job
            time.sleep(POLL_S)

    def close(self) -> None:
        self._session.close()


def not_warm_line(job: dict) -> str:
    """The nodes of a job that are not warm, with their states and errors, on one line."""
    cold = [n for n in job.get("nodes") or [] if n.get("state") != "warm"]
    shown = ", ".join(f"{n['name']} ({n['state']}{': ' + n['error'] if n.get('error') else ''})" for n in cold[:20])
    more = f", and {len(cold) - 20} more" if len(cold) > 20 else ""
    return f"{len(cold)} of {len(job.get('nodes') or [])} nodes not warm: {shown}{more}"
