"""The fetch interface: where a node gets the bytes of a layer blob.

Vocabulary:
- a *blob* is a layer blob named by its digest, in a repository of a registry (BlobRef);
- a *range* is [start, end) of its compressed bytes; the layer reader turns the ranges of
  chunks into verified file content, so no source needs to verify a range itself;
- a *source* is one place ranges can come from: the node's swarm, the region cache, the
  origin registry. Sources are tried in order by a FetchChain.

Contract for every Source:
- read_ranges() returns one bytes object per requested range, each exactly end - start
  long, or raises.
- NotHere means "this source does not have the blob (now)": the chain moves on to the
  next source at once. A source must say NotHere quickly (no long timeouts).
- TransportError means the source should have had it but failed (refused, timed out,
  short read); the chain logs it and moves on too, and counts the error.
- Sources are thread-safe: the FUSE file system calls them from worker threads.
"""

from __future__ import annotations

import abc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

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


class Source(abc.ABC):
    """One place ranges of blobs can come from."""

    name: str = "source"

    @abc.abstractmethod
    def read_ranges(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each [start, end) range of the blob (see the module contract)."""

    def close(self) -> None:
        pass


@dataclass
class SourceStats:
    requests: int = 0
    ranges: int = 0
    bytes: int = 0
    not_here: int = 0
    errors: int = 0
    seconds: float = 0.0


@dataclass
class FetchChain:
    """Tries each source in order for a set of ranges; counts what each one served."""

    sources: list[Source]
    stats: dict[str, SourceStats] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def read_ranges(self, blob: BlobRef, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        errors = []
        for source in self.sources:
            start = time.monotonic()
            try:
                out = source.read_ranges(blob, ranges)
            except NotHere:
                self._count(source.name, not_here=1)
                continue
            except (TransportError, NotFound) as e:
                self._count(source.name, errors=1)
                log.warning("%s: %s failed for %d ranges: %s", blob, source.name, len(ranges), e)
                errors.append(f"{source.name}: {e}")
                continue
            if len(out) != len(ranges) or any(len(d) != b - a for d, (a, b) in zip(out, ranges)):
                self._count(source.name, errors=1)
                log.warning("%s: %s returned short ranges", blob, source.name)
                errors.append(f"{source.name}: short read")
                continue
            self._count(source.name, requests=1, ranges=len(ranges), bytes=sum(map(len, out)),
                        seconds=time.monotonic() - start)
            return out
        detail = "; ".join(errors) or "no source has it"
        raise TransportError(f"{blob}: cannot fetch {len(ranges)} ranges ({detail})")

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
