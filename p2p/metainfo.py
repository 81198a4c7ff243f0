"""Torrent metadata for layer blobs: made from the blob, bound to its sha256. Pure.

A layer blob's torrent is a BitTorrent **v1**, single-file, private torrent:

    info = {"length": <blob size>, "name": "sha256-<hex>", "piece length": <2^k>,
            "pieces": <SHA-1 of each piece, 20 bytes each>, "private": 1}

Why v1 (not hybrid, not v2): Debian's aria2 1.36 speaks only v1 (and dropped connections
on a hybrid torrent in a try here), Transmission 4 reads only the v1 part of a hybrid;
a v2 or hybrid torrent would also need libtorrent (or a SHA-256 merkle tree writer) on
the region, and buys nothing here: shoal's integrity does not rest on the torrent's own
hashes (see below). Private, so libtorrent turns off DHT, local peer discovery and peer
exchange for it: the region tracker decides who meets whom.

Trust, anchored on the blob digest:
- Metadata is made only from bytes whose sha256 was checked against the blob digest
  in the same pass (InfoBuilder.finish raises DigestMismatch otherwise): the region
  makes it from blobs it verified; a node checks that metadata names its blob
  (`name`, `length`, `private`, piece geometry) before using it.
- The SHA-1 piece hashes keep bad pieces out of a node's torrent storage and get the
  peer that sent them banned. Forging a piece means a SHA-1 second preimage.
- Whatever the swarm returns is still checked chunk by chunk against the TOC's sha256
  (NodeChunkLoader), and a blob downloaded whole is checked against its sha256 before
  it is seeded as complete. Bad metadata can cost a node its swarm, never a wrong byte.

A region's torrents are SSL torrents (libtorrent's `ssl-cert` key in the info dict: the
region's swarm CA): peers connect over TLS and each must present a certificate that CA
signed for the torrent's name, which the region issues only to nodes the origin lets
read the blob's repository (docs/p2p.md, "Who may get pieces").

The announce URL lives outside the info dict, so it is not part of the info hash: the
region serves the same info dict under whatever tracker address its clients use.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from builder.pieces import MAX_PIECE, MIN_PIECE, TARGET_PIECES, PieceHasher, Pieces, piece_size_for  # noqa: F401
from p2p import bencode
from shoal.digest import check_digest, hex_of
from shoal.errors import DigestMismatch, FormatError

_READ = 4 << 20


def blob_name(digest: str) -> str:
    """The file name inside a blob's torrent (what aria2 saves it as)."""
    return "sha256-" + hex_of(digest)


class InfoBuilder:
    """Builds a blob's info dict from its bytes, fed in order (e.g. while the region
    fills the blob from the origin: no second pass over it)."""

    def __init__(self, size: int, piece_size: int | None = None) -> None:
        if size <= 0:
            raise ValueError("a blob of 0 bytes has no torrent")
        self.size = size
        self._sha256 = hashlib.sha256()
        self._pieces = PieceHasher(size, piece_size)
        self.piece_size = self._pieces.piece_length
        self._fed = 0

    def update(self, data: bytes | memoryview) -> None:
        if self._fed + len(data) > self.size:
            raise DigestMismatch(f"blob is longer than its {self.size} bytes")
        self._fed += len(data)
        self._sha256.update(data)
        self._pieces.update(data)

    def finish(self, digest: str | None = None, ssl_cert: bytes = b"") -> tuple[str, bytes]:
        """(blob digest, bencoded info dict). With `digest`, the bytes must hash to it.
        `ssl_cert`: the PEM CA certificate of an SSL torrent (libtorrent's `ssl-cert`:
        peers talk TLS and must present a certificate it signed for the torrent's name)."""
        if self._fed != self.size:
            raise DigestMismatch(f"blob is {self._fed} bytes, want {self.size}")
        got = "sha256:" + self._sha256.hexdigest()
        if digest is not None and got != check_digest(digest):
            raise DigestMismatch(f"blob {digest}: bytes hash to {got}; no torrent made")
        return got, info_from_pieces(self._pieces.finish(got), ssl_cert)


def info_from_pieces(pieces: Pieces, ssl_cert: bytes = b"") -> bytes:
    """The bencoded info dict of a blob from its piece hashes (made from the blob, or
    published at `shoal convert`: builder/pieces.py)."""
    info: dict = {
        "length": pieces.size,
        "name": blob_name(pieces.blob),
        "piece length": pieces.piece_length,
        "pieces": pieces.hashes,
        "private": 1,
    }
    if ssl_cert:
        info["ssl-cert"] = ssl_cert
    return bencode.encode(info)


def make_info(stream: BinaryIO, size: int, digest: str | None = None, piece_size: int | None = None,
              ssl_cert: bytes = b"") -> bytes:
    """The bencoded info dict of the blob read from `stream` (checked against `digest`)."""
    builder = InfoBuilder(size, piece_size)
    left = size
    while left:
        data = stream.read(min(_READ, left))
        if not data:
            raise DigestMismatch(f"blob ends after {size - left} of {size} bytes")
        builder.update(data)
        left -= len(data)
    return builder.finish(digest, ssl_cert)[1]


def torrent_file(info: bytes, announce: str | None = None) -> bytes:
    """A .torrent file around an info dict (keys in bencode order: announce < info)."""
    head = b"d"
    if announce:
        head += bencode.encode("announce") + bencode.encode(announce)
    head += bencode.encode("created by") + bencode.encode("shoal")
    return head + b"4:info" + info + b"e"


def make_torrent(blob_path: str | os.PathLike, piece_size: int | None = None, announce: str | None = None,
                 *, digest: str | None = None) -> bytes:
    """The .torrent file of the blob at `blob_path`. With `digest` (the blob's name) the
    file must hash to it: metadata is only made from verified bytes."""
    with open(blob_path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        return torrent_file(make_info(fh, size, digest, piece_size), announce)


# --- reading metadata --------------------------------------------------------------------


@dataclass(frozen=True)
class TorrentMeta:
    """A blob's torrent, checked to name that blob."""

    digest: str
    info: bytes  # the bencoded info dict, as served
    info_hash: bytes  # SHA-1 of `info` (v1 info hash)
    length: int
    piece_length: int
    hashes: bytes  # 20 bytes per piece
    ssl_cert: bytes = b""  # an SSL torrent's CA certificate (PEM); b"": peers talk plain BitTorrent

    @property
    def num_pieces(self) -> int:
        return len(self.hashes) // 20

    @property
    def name(self) -> str:
        return blob_name(self.digest)

    def piece_hash(self, piece: int) -> bytes:
        return self.hashes[piece * 20:piece * 20 + 20]

    def piece_span(self, piece: int) -> tuple[int, int]:
        start = piece * self.piece_length
        return start, min(start + self.piece_length, self.length)

    def pieces_for(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        """Sorted indices of the pieces that hold any byte of the ranges."""
        out: set[int] = set()
        for start, end in ranges:
            if not 0 <= start < end <= self.length:
                raise ValueError(f"range [{start}, {end}) outside the blob's {self.length} bytes")
            out.update(range(start // self.piece_length, (end - 1) // self.piece_length + 1))
        return sorted(out)

    def torrent(self, announce: str | None = None) -> bytes:
        return torrent_file(self.info, announce)


def parse_info(info: bytes, digest: str, size: int | None = None) -> TorrentMeta:
    """Check that `info` is the v1 private single-file info dict of blob `digest`."""
    check_digest(digest)
    d = bencode.decode(info)
    if not isinstance(d, dict):
        raise FormatError("torrent info: not a dictionary")
    what = f"torrent of {digest}"
    if d.get(b"name") != blob_name(digest).encode():
        raise FormatError(f"{what}: names {d.get(b'name')!r}, not this blob")
    if d.get(b"private") != 1:
        raise FormatError(f"{what}: not a private torrent")
    if b"files" in d or b"meta version" in d:
        raise FormatError(f"{what}: not a v1 single-file torrent")
    length, plen, pieces = d.get(b"length"), d.get(b"piece length"), d.get(b"pieces")
    if not isinstance(length, int) or length <= 0 or (size is not None and length != size):
        raise FormatError(f"{what}: length {length!r}, want {size if size is not None else 'a positive size'}")
    if not isinstance(plen, int) or plen < 16 << 10 or plen > MAX_PIECE or plen & (plen - 1):
        raise FormatError(f"{what}: piece length {plen!r} is not a power of two in range")
    if not isinstance(pieces, bytes) or len(pieces) != 20 * -(-length // plen):
        raise FormatError(f"{what}: {len(pieces) if isinstance(pieces, bytes) else '?'} bytes of piece hashes "
                          f"for {-(-length // plen)} pieces")
    ssl_cert = d.get(b"ssl-cert", b"")
    if not isinstance(ssl_cert, bytes) or (ssl_cert and b"-----BEGIN CERTIFICATE-----" not in ssl_cert):
        raise FormatError(f"{what}: ssl-cert is not a PEM certificate")
    return TorrentMeta(digest, info, hashlib.sha1(info).digest(), length, plen, pieces, ssl_cert)


def parse_torrent(data: bytes, digest: str, size: int | None = None) -> tuple[TorrentMeta, str | None]:
    """(checked metadata, announce URL or None) from a .torrent file."""
    top = bencode.decode(data)
    if not isinstance(top, dict) or b"info" not in top:
        raise FormatError(f"torrent of {digest}: no info dictionary")
    start, end = bencode.span_of(data, b"info")
    announce = top.get(b"announce")
    url = announce.decode("utf-8", "replace") if isinstance(announce, bytes) else None
    return parse_info(data[start:end], digest, size), url


def slice_pieces(meta: TorrentMeta, pieces: dict[int, bytes], ranges: Sequence[tuple[int, int]]) -> list[bytes]:
    """The bytes of each range, cut from whole pieces (every covering piece present)."""
    out = []
    plen = meta.piece_length
    for start, end in ranges:
        first, last = start // plen, (end - 1) // plen
        if first == last:
            base = first * plen
            out.append(pieces[first][start - base:end - base])
            continue
        parts = []
        for p in range(first, last + 1):
            base = p * plen
            parts.append(pieces[p][max(start - base, 0):min(end - base, plen)])
        out.append(b"".join(parts))
    return out
