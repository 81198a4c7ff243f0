"""tar-split metadata: enough to rebuild a tar stream byte for byte from its files.

Format (vbatts/tar-split `tar/storage`, JSON packer): one JSON object per line, each
with a `position` counting from 0:
- segment  `{"type":2,"payload":"<base64 raw bytes>","position":N}`: raw tar bytes
  that are not file content (headers, padding, end-of-archive blocks, trailing data);
- file     `{"type":1,"name":"<name>","size":N,"payload":"<base64>","position":N}`:
  `size` bytes of content of the entry `name`, payload = CRC-64/ISO (Go's table) of
  the content, 8 bytes big-endian, or null for empty content. Names that are not valid
  UTF-8 go in `name_raw` (base64) instead of `name`.

zstd:chunked carries this data (zstd-compressed) in a skippable frame so that a
partial pull can rebuild the exact tar, and hence the layer's diff_id.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

import fastcrc

from shoal.errors import FormatError

FILE_TYPE = 1
SEGMENT_TYPE = 2


def crc64_update(crc: int, data: bytes | memoryview) -> int:
    """Running CRC-64/ISO as tar-split computes it (Go hash/crc64, ISO table)."""
    return fastcrc.crc64.go_iso(data, initial=crc)


_json_string = json.encoder.encode_basestring

CRC64_INIT = 0  # go_iso applies Go's ^crc on entry and exit, so a fresh hash starts at 0


class TarSplitWriter:
    """Collects tar-split lines; adjacent segments are written as they come."""

    def __init__(self) -> None:
        self._lines: list[bytes] = []
        self._position = 0

    # Lines are formatted by hand: this runs once per tar entry on the convert hot path.
    def segment(self, raw: bytes) -> None:
        if raw:
            payload = base64.b64encode(raw).decode()
            self._lines.append(f'{{"type":2,"payload":"{payload}","position":{self._position}}}\n'.encode())
            self._position += 1

    def file(self, raw_name: bytes, size: int, crc: int | None) -> None:
        try:
            name = '"name":' + _json_string(raw_name.decode("utf-8"))
        except UnicodeDecodeError:
            name = '"name_raw":"' + base64.b64encode(raw_name).decode() + '"'
        size_field = f',"size":{size}' if size else ""
        payload = '"' + base64.b64encode(crc.to_bytes(8, "big")).decode() + '"' if crc is not None else "null"
        line = f'{{"type":1,{name}{size_field},"payload":{payload},"position":{self._position}}}\n'
        self._lines.append(line.encode())
        self._position += 1

    def getvalue(self) -> bytes:
        return b"".join(self._lines)


def parse(data: bytes) -> Iterator[dict]:
    """Yield validated tar-split entries as dicts with type, name, size, payload (bytes)."""
    expected = 0
    for lineno, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            raise FormatError(f"tar-split line {lineno}: not JSON") from None
        if not isinstance(obj, dict) or obj.get("type") not in (FILE_TYPE, SEGMENT_TYPE):
            raise FormatError(f"tar-split line {lineno}: unknown entry")
        if obj.get("position") != expected:
            raise FormatError(f"tar-split line {lineno}: position {obj.get('position')!r}, want {expected}")
        expected += 1
        payload = obj.get("payload")
        try:
            obj["payload"] = base64.b64decode(payload, validate=True) if payload is not None else None
            if "name_raw" in obj:
                obj["name"] = base64.b64decode(obj["name_raw"], validate=True).decode("utf-8", "surrogateescape")
        except (ValueError, TypeError):
            raise FormatError(f"tar-split line {lineno}: bad base64") from None
        size = obj.get("size", 0)
        if not isinstance(size, int) or size < 0:
            raise FormatError(f"tar-split line {lineno}: bad size")
        obj["size"] = size
        yield obj
