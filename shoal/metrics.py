"""Prometheus text exposition (format 0.0.4): the one formatter behind `shoal node`'s
`/metrics` and `shoal region`'s `/-/metrics`. Pure: callers gather the figures and serve
the text.

    render([("shoal_region_cache_hits_total", "counter", "Blob requests served from the cache.", 12),
            ("shoal_node_fetched_bytes_total", "counter", "Compressed bytes fetched, by source.",
             [({"source": "peers"}, 1024), ({"source": "region"}, 0)])])
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import cast

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Samples = float | int | bool | None | Sequence[tuple[Mapping[str, str], float | int | None]]
Metric = tuple[str, str, str, Samples]  # name, type (counter | gauge), help, value or labelled samples


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    return "NaN" if math.isnan(value) else repr(float(value))


def render(metrics: Iterable[Metric]) -> str:
    """The exposition text of `metrics`; a sample whose value is None is left out (a
    figure the service does not have, e.g. the size of an unbounded S3 bucket)."""
    lines = []
    for name, kind, help_text, given in metrics:
        # a value alone (not a list or tuple of samples) is one sample without labels
        listed: Sequence[tuple[Mapping[str, str], float | int | None]] = (
            given if isinstance(given, (list, tuple)) else [({}, cast("float | None", given))])
        samples = [(labels, v) for labels, v in listed if v is not None]
        if not samples:
            continue
        lines.append(f"# HELP {name} {help_text.replace(chr(92), chr(92) * 2).replace(chr(10), ' ')}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            tags = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
            lines.append(f"{name}{{{tags}}} {_number(value)}" if tags else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, float]:
    """`name{labels}` -> value of exposition text (tests, scripts; comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out
