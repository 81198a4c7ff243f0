"""Bencoding (BEP 3), pure: no I/O, no libtorrent.

The region serves torrent metadata and tracker answers without libtorrent (it runs only
on nodes), so shoal carries its own small codec.

- encode(): int, bytes, str (UTF-8), list/tuple, dict with str or bytes keys, written in
  sorted raw-byte key order as BEP 3 requires (so the info hash is canonical).
- decode(): the whole input must be one value. Strings decode to bytes, dict keys to
  bytes. Non-canonical input (leading zeros, "-0", unsorted or repeated keys) is
  rejected: torrent metadata is hashed, so only one encoding of a value may be accepted.
  Malformed input raises FormatError, never any other exception (the fuzz rule).
"""

from __future__ import annotations

from shoal.errors import FormatError

MAX_DEPTH = 64


def encode(value: object) -> bytes:
    out: list[bytes] = []
    _encode(value, out)
    return b"".join(out)


def _encode(value: object, out: list[bytes]) -> None:
    if isinstance(value, bool):
        raise TypeError("bencode: booleans have no encoding")
    if isinstance(value, int):
        out.append(b"i%de" % value)
    elif isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        out.append(b"%d:" % len(data))
        out.append(data)
    elif isinstance(value, str):
        _encode(value.encode("utf-8"), out)
    elif isinstance(value, (list, tuple)):
        out.append(b"l")
        for item in value:
            _encode(item, out)
        out.append(b"e")
    elif isinstance(value, dict):
        items = sorted(((k.encode("utf-8") if isinstance(k, str) else bytes(k)), v) for k, v in value.items())
        out.append(b"d")
        for i, (k, v) in enumerate(items):
            if i and items[i - 1][0] == k:
                raise ValueError(f"bencode: duplicate key {k!r}")
            _encode(k, out)
            _encode(v, out)
        out.append(b"e")
    else:
        raise TypeError(f"bencode: cannot encode {type(value).__name__}")


def decode(data: bytes) -> object:
    value, end = decode_prefix(data, 0)
    if end != len(data):
        raise FormatError(f"bencode: {len(data) - end} bytes of trailing data")
    return value


def decode_prefix(data: bytes, pos: int = 0) -> tuple[object, int]:
    """One value starting at `pos`: (value, position after it)."""
    try:
        return _decode(memoryview(data), pos, 0)
    except (IndexError, ValueError, TypeError) as e:
        raise FormatError(f"bencode: malformed at byte {pos}: {e}") from None


def span_of(data: bytes, key: bytes) -> tuple[int, int]:
    """[start, end) of the raw bytes of the value under `key` in the top-level dict
    (the info hash is the SHA-1 of exactly those bytes)."""
    if not data.startswith(b"d"):
        raise FormatError("bencode: not a dictionary")
    view = memoryview(data)
    pos = 1
    while pos < len(data) and data[pos:pos + 1] != b"e":
        k, pos = _decode(view, pos, 1)
        start = pos
        _, pos = _decode(view, pos, 1)
        if k == key:
            return start, pos
    raise FormatError(f"bencode: no key {key!r}")


def _int(view: memoryview, start: int, end: int) -> int:
    text = bytes(view[start:end])
    if not text or text == b"-0" or (text.lstrip(b"-").startswith(b"0") and text.lstrip(b"-") != b"0") \
            or text.startswith(b"-") and len(text) == 1:
        raise ValueError(f"non-canonical integer {text[:30]!r}")
    if not text.lstrip(b"-").isdigit():
        raise ValueError(f"bad integer {text[:30]!r}")
    return int(text)


def _find(view: memoryview, byte: int, pos: int, limit: int = 32) -> int:
    end = min(len(view), pos + limit)
    for i in range(pos, end):
        if view[i] == byte:
            return i
    raise ValueError("unterminated number")


def _decode(view: memoryview, pos: int, depth: int) -> tuple[object, int]:
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    c = view[pos]
    if c == ord("i"):
        end = _find(view, ord("e"), pos + 1)
        return _int(view, pos + 1, end), end + 1
    if ord("0") <= c <= ord("9"):
        colon = _find(view, ord(":"), pos)
        length = _int(view, pos, colon)
        start = colon + 1
        if start + length > len(view):
            raise ValueError("string runs past the end")
        return bytes(view[start:start + length]), start + length
    if c == ord("l"):
        pos += 1
        items = []
        while view[pos] != ord("e"):
            item, pos = _decode(view, pos, depth + 1)
            items.append(item)
        return items, pos + 1
    if c == ord("d"):
        pos += 1
        out: dict[bytes, object] = {}
        last: bytes | None = None
        while view[pos] != ord("e"):
            key, pos = _decode(view, pos, depth + 1)
            if not isinstance(key, bytes):
                raise TypeError("dictionary key is not a string")
            if last is not None and key <= last:
                raise ValueError(f"dictionary keys unsorted or repeated at {key[:40]!r}")
            last = key
            out[key], pos = _decode(view, pos, depth + 1)
        return out, pos + 1
    raise ValueError(f"unexpected byte {bytes([c])!r}")
