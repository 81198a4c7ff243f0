"""The access trace: which chunks the reads of a node's layers used, once each, in the
order of their first use across layers. `shoal profile save|record` turns it into an
image's access profile (prefetch/profile.py).

    trace = AccessTrace()
    noted = trace.layer(digest)       # at a layer's load
    noted.note(chunks)                # at every read (any thread)
    trace.profile([digest, ...])      # [[layer digest, start, end], ...] in first-use order
    trace.forget(digest)              # at its unload: its trace goes

Thread-safe: reads note from the layer file system's worker threads and its event loop.
Chunks without content (no digest, or all zeros) are never noted: there is nothing to
fetch for them. A layer notes at most `limit` chunks (a 30 GB layer has ~120,000).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence

from builder.format.toc import Chunk

TRACE_LIMIT = 250_000  # chunks of one layer noted in its access trace


class LayerTrace:
    """One loaded layer's trace: chunk start -> (first-use sequence, end)."""

    def __init__(self, trace: AccessTrace) -> None:
        self._trace = trace
        self.first_use: dict[int, tuple[int, int]] = {}

    def note(self, chunks: Sequence[Chunk]) -> None:
        """Add the chunks of a read (first use only)."""
        first_use = self.first_use
        if len(first_use) >= self._trace.limit:
            return
        new = [c for c in chunks if c.start not in first_use and c.digest and not c.zeros]
        if not new:
            return
        with self._trace.lock:
            for c in new:
                if c.start not in first_use:
                    first_use[c.start] = (next(self._trace.sequence), c.end)


class AccessTrace:
    """The traces of the loaded layers, by layer digest."""

    def __init__(self, limit: int = TRACE_LIMIT) -> None:
        self.limit = limit
        self.lock = threading.Lock()
        self.sequence = itertools.count()  # orders first uses across layers
        self._layers: dict[str, LayerTrace] = {}

    def layer(self, digest: str) -> LayerTrace:
        """A new, empty trace for the layer just loaded (replacing one of an earlier load)."""
        with self.lock:
            traced = self._layers[digest] = LayerTrace(self)
        return traced

    def forget(self, digest: str) -> None:
        """The layer was unloaded: its trace goes (reads still running note into nothing kept)."""
        with self.lock:
            self._layers.pop(digest, None)

    def profile(self, digests: Iterable[str] | None = None) -> list[list]:
        """The access profile of the loaded layers (or of those named in `digests`):
        [[layer digest, start, end], ...] in order of first use across them."""
        keep = set(digests) if digests else None
        with self.lock:
            rows = [(seq, digest, start, end) for digest, traced in self._layers.items()
                    if keep is None or digest in keep
                    for start, (seq, end) in traced.first_use.items()]
        rows.sort()
        return [[d, a, b] for _, d, a, b in rows]
