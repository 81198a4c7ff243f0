"""The end of a zstd:chunked blob: skippable frames, the footer, the TOC's location.

Pure functions over bytes and annotation strings (no I/O): every malformed input raises
shoal.errors.FormatError and nothing else (the fuzz rule, tests/test_fuzz.py).

- A skippable frame is magic `50 2A 4D 18` (0x184D2A50, LE), a u32 LE payload length,
  then the payload; decoders ignore it. Positions below point just past that 8-byte
  header.
- Readers locate the TOC from layer annotations (MANIFEST_POSITION: `off:len:ulen:1`)
  and verify it against MANIFEST_CHECKSUM (sha256 of the compressed TOC); the footer
  only makes a blob self-describing (a TocLocation from it has no digest to trust).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from shoal.digest import check_digest
from shoal.errors import FormatError

SKIPPABLE_MAGIC = b"\x50\x2a\x4d\x18"
SKIPPABLE_HEADER = 8
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"  # the start of every (non-skippable) zstd frame

# The footer: the payload of the blob's last skippable frame, FOOTER_SIZE bytes, all u64 LE:
#    0  TOC offset (of the compressed TOC, past its skippable frame header)
#    8  TOC compressed length
#   16  TOC uncompressed length
#   24  manifest type (= MANIFEST_TYPE_CRFS, 1)
#   32  tar-split offset
#   40  tar-split compressed length
#   48  tar-split uncompressed length
#   56  magic "GNUlInUx" (FOOTER_MAGIC)
# The older variant (containers/storage 1.43, Debian's skopeo 1.9), OLD_FOOTER_SIZE bytes:
#    0  TOC offset    8  TOC compressed length    16  TOC uncompressed length
#   24  manifest type (= 1)    32  magic "GnUlInUx" (OLD_FOOTER_MAGIC)
# no tar-split, and its annotations are named io.containers.zstd-chunked.*.
FOOTER_SIZE = 64
FOOTER_MAGIC = b"GNUlInUx"
OLD_FOOTER_SIZE = 40
OLD_FOOTER_MAGIC = b"GnUlInUx"  # sic: the magic changed case with the 64-byte footer
MANIFEST_TYPE_CRFS = 1

# Current annotations (containers/storage >= 1.46).
MANIFEST_CHECKSUM = "io.github.containers.zstd-chunked.manifest-checksum"
MANIFEST_POSITION = "io.github.containers.zstd-chunked.manifest-position"
TARSPLIT_POSITION = "io.github.containers.zstd-chunked.tarsplit-position"
# Older annotations (Debian's skopeo 1.9 / podman 4.3).
OLD_MANIFEST_CHECKSUM = "io.containers.zstd-chunked.manifest-checksum"
OLD_MANIFEST_POSITION = "io.containers.zstd-chunked.manifest-position"

# Bounds against hostile layers (containers/storage refuses TOCs over 150 MiB, too).
MAX_TOC_COMPRESSED = 50 << 20
MAX_TOC_UNCOMPRESSED = 150 << 20
MAX_TARSPLIT_UNCOMPRESSED = 1 << 30


def skippable_frame(payload: bytes) -> bytes:
    return SKIPPABLE_MAGIC + struct.pack("<I", len(payload)) + payload


@dataclass(frozen=True)
class Position:
    """Where a skippable frame's payload lies in the blob."""

    offset: int
    length: int
    uncompressed: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class TocLocation:
    """Everything a reader needs to fetch and trust a layer's TOC."""

    toc: Position
    toc_digest: str | None  # None when only the footer was available (trust nothing)
    tarsplit: Position | None
    variant: str  # "current" or "old"


def parse_footer(data: bytes) -> TocLocation:
    """Parse the footer at the end of a blob (pass at least the last 64 bytes)."""
    if len(data) >= FOOTER_SIZE and data[-8:] == FOOTER_MAGIC:
        tail = data[-FOOTER_SIZE:]
        off, length, ulen, mtype, ts_off, ts_len, ts_ulen = struct.unpack("<7Q", tail[:56])
        if mtype == MANIFEST_TYPE_CRFS and ts_off > off:
            return _location(off, length, ulen, None, (ts_off, ts_len, ts_ulen), "current")
        # A 64-byte tail of an old layer may still end in an old 40-byte footer.
    if len(data) >= OLD_FOOTER_SIZE and data[-8:] in (OLD_FOOTER_MAGIC, FOOTER_MAGIC):
        off, length, ulen, mtype = struct.unpack("<4Q", data[-OLD_FOOTER_SIZE:-8])
        if mtype != MANIFEST_TYPE_CRFS:
            raise FormatError(f"zstd:chunked footer: manifest type {mtype}, want {MANIFEST_TYPE_CRFS}")
        return _location(off, length, ulen, None, None, "old")
    raise FormatError("zstd:chunked footer: magic not found (not a zstd:chunked layer, or truncated)")


def _position_numbers(value: str, count: int, key: str) -> list[int]:
    parts = value.split(":")
    if len(parts) != count or not all(p.isdigit() and len(p) <= 20 for p in parts):
        raise FormatError(f"annotation {key}: malformed value {value[:80]!r}")
    return [int(p) for p in parts]


def _location(
    off: int, length: int, ulen: int, digest: str | None, tarsplit_pos: tuple | None, variant: str
) -> TocLocation:
    if length <= 0 or length > MAX_TOC_COMPRESSED:
        raise FormatError(f"TOC compressed length {length} out of range")
    if ulen <= 0 or ulen > MAX_TOC_UNCOMPRESSED:
        raise FormatError(f"TOC uncompressed length {ulen} out of range (max {MAX_TOC_UNCOMPRESSED})")
    ts = None
    if tarsplit_pos is not None:
        ts_off, ts_len, ts_ulen = tarsplit_pos
        if ts_len <= 0 or ts_ulen > MAX_TARSPLIT_UNCOMPRESSED:
            raise FormatError(f"tar-split length {ts_len}/{ts_ulen} out of range")
        ts = Position(ts_off, ts_len, ts_ulen)
    return TocLocation(Position(off, length, ulen), digest, ts, variant)


def location_from_annotations(annotations: dict | None) -> TocLocation | None:
    """The TOC location from a layer descriptor's annotations; None if not zstd:chunked."""
    if not annotations:
        return None
    for pos_key, sum_key, variant in (
        (MANIFEST_POSITION, MANIFEST_CHECKSUM, "current"),
        (OLD_MANIFEST_POSITION, OLD_MANIFEST_CHECKSUM, "old"),
    ):
        if pos_key not in annotations:
            continue
        off, length, ulen, mtype = _position_numbers(str(annotations[pos_key]), 4, pos_key)
        if mtype != MANIFEST_TYPE_CRFS:
            raise FormatError(f"annotation {pos_key}: manifest type {mtype}, want {MANIFEST_TYPE_CRFS}")
        digest = check_digest(annotations.get(sum_key), f"annotation {sum_key}")
        ts = None
        if variant == "current" and TARSPLIT_POSITION in annotations:
            ts = tuple(_position_numbers(str(annotations[TARSPLIT_POSITION]), 3, TARSPLIT_POSITION))
        return _location(off, length, ulen, digest, ts, variant)
    return None
