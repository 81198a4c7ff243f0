"""Piece hashes of a layer blob: made where the whole blob is read anyway (`shoal convert`)
and published beside the image, so that a region can offer the blob's torrent before it
has the blob whole (p2p/metainfo.py `info_from_pieces`; p2p/tracker/server.py).

Without them a region makes a blob's torrent only from the whole blob, and while a
profile preheat job holds a cold blob to the ranges its nodes read, the nodes have no
swarm for it: each takes its chunks from the region, one copy per node.

A blob's pieces are an artifact (builder/oci/artifact.py) in the image's repository,
tagged `sha256-<blob hex>.shoal-pieces`:

    manifest: config {mediaType CONFIG_MEDIA_TYPE}, one layer {mediaType PIECES_MEDIA_TYPE},
              annotation BLOB_ANNOTATION: the blob's digest
    blob:     {"schemaVersion": 1, "blob": "sha256:...", "size": N,
               "piece_length": P, "pieces": "<base64 of the SHA-1 of each piece>"}

P is a power of two from 16 KiB to MAX_PIECE (`piece_size_for(size)` by default, which
is what a region uses for blobs it hashes itself).

Trust: anyone who can push to the repository can publish pieces, and a region serves
them before it can check them. That costs at most the swarm of that blob, never a wrong
byte: a piece that does not match its hash is refused by the node that fetched it, and
every chunk is checked against the TOC's sha256 as always. So a document is bounded
(MAX_PIECES) and bound to one blob (tag, annotation and "blob" field), and a region that
fills the blob later checks the hashes against it and replaces a torrent that lied.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from builder.oci.artifact import artifact_blob, push_artifact
from builder.oci.documents import Descriptor, load_document
from builder.oci.refs import DockerRef
from shoal.digest import check_digest
from shoal.errors import FormatError

PIECES_MEDIA_TYPE = "application/vnd.shoal.pieces.v1+json"
CONFIG_MEDIA_TYPE = "application/vnd.shoal.pieces.config.v1+json"
BLOB_ANNOTATION = "io.github.shoal.pieces.blob"

MIN_PIECE = 256 << 10  # BitTorrent needs >= 16 KiB; smaller pieces cost hashes and requests
MAX_PIECE = 16 << 20
TARGET_PIECES = 16384  # at most 320 KB of piece hashes per torrent (up to 256 GiB blobs)
MAX_PIECES = 1 << 20  # pieces a published document may list (20 MiB of hashes)
MAX_PIECES_BYTES = 32 << 20  # a published document's JSON
_READ = 4 << 20


def piece_size_for(size: int) -> int:
    """The default piece size: the smallest power of two >= MIN_PIECE that keeps the
    blob within TARGET_PIECES pieces (1 GB: 256 KiB; 8 GiB: 512 KiB; 30 GB: 2 MiB).
    Small pieces keep on-demand reads close to the chunk sizes they serve."""
    piece = MIN_PIECE
    while piece < MAX_PIECE and -(-size // piece) > TARGET_PIECES:
        piece *= 2
    return piece


def check_piece_size(piece: object) -> int:
    if not isinstance(piece, int) or isinstance(piece, bool) or piece < 16 << 10 or piece > MAX_PIECE \
            or piece & (piece - 1):
        raise ValueError(f"piece size {piece!r}: want a power of two between 16 KiB and {MAX_PIECE >> 20} MiB")
    return piece


def pieces_tag(blob_digest: str) -> str:
    """The tag of the published pieces of blob `blob_digest`."""
    algo, _, hexpart = check_digest(blob_digest).partition(":")
    return f"{algo}-{hexpart}.shoal-pieces"


@dataclass(frozen=True)
class Pieces:
    """The SHA-1 of each `piece_length` bytes of blob `blob` (`size` bytes), joined."""

    blob: str
    size: int
    piece_length: int
    hashes: bytes

    @property
    def count(self) -> int:
        return -(-self.size // self.piece_length)

    def to_json(self) -> bytes:
        return json.dumps({"schemaVersion": 1, "blob": self.blob, "size": self.size,
                           "piece_length": self.piece_length,
                           "pieces": base64.b64encode(self.hashes).decode()}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes, blob: str, size: int | None = None, what: str = "pieces") -> Pieces:
        """A published document, checked: bound to `blob` (and of `size` bytes, when
        given), a piece length in range, one 20-byte hash per piece. FormatError naming
        `what` otherwise."""
        doc = load_document(data, what, MAX_PIECES_BYTES)
        if doc.get("schemaVersion") != 1:
            raise FormatError(f"{what}: schemaVersion {str(doc.get('schemaVersion'))[:20]!r}, want 1")
        if doc.get("blob") != blob:
            raise FormatError(f"{what}: names blob {str(doc.get('blob'))[:80]!r}, not {blob}")
        n = doc.get("size")
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0 or (size is not None and n != size):
            raise FormatError(f"{what}: size {str(n)[:30]!r}, want {size if size is not None else 'a positive size'}")
        try:
            plen = check_piece_size(doc.get("piece_length"))
        except ValueError as e:
            raise FormatError(f"{what}: {e}") from None
        count = -(-n // plen)
        text = doc.get("pieces")
        if not isinstance(text, str) or count > MAX_PIECES:
            raise FormatError(f"{what}: no piece hashes, or more than {MAX_PIECES} pieces")
        try:
            hashes = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            raise FormatError(f"{what}: pieces are not base64") from None
        if len(hashes) != 20 * count:
            raise FormatError(f"{what}: {len(hashes)} bytes of piece hashes for {count} pieces of {plen} bytes")
        return cls(blob, n, plen, hashes)


class PieceHasher:
    """The piece hashes of a blob fed in order."""

    def __init__(self, size: int, piece_length: int | None = None) -> None:
        if size <= 0:
            raise ValueError("a blob of 0 bytes has no pieces")
        self.size = size
        self.piece_length = check_piece_size(piece_length or piece_size_for(size))
        self._piece = hashlib.sha1()
        self._in_piece = 0
        self._hashes: list[bytes] = []
        self._fed = 0

    def update(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        if self._fed + len(view) > self.size:
            raise FormatError(f"blob is longer than its {self.size} bytes")
        self._fed += len(view)
        while view:
            take = min(len(view), self.piece_length - self._in_piece)
            self._piece.update(view[:take])
            self._in_piece += take
            view = view[take:]
            if self._in_piece == self.piece_length:
                self._hashes.append(self._piece.digest())
                self._piece, self._in_piece = hashlib.sha1(), 0

    def finish(self, blob: str) -> Pieces:
        """The pieces, as those of blob `blob` (its digest, not checked here)."""
        if self._fed != self.size:
            raise FormatError(f"blob {blob} is {self._fed} bytes, want {self.size}")
        if self._in_piece:
            self._hashes.append(self._piece.digest())
            self._in_piece = 0
        return Pieces(check_digest(blob), self.size, self.piece_length, b"".join(self._hashes))


def hash_file(path: str, blob: str, piece_length: int | None = None) -> Pieces:
    """The pieces of the blob in file `path` (its digest `blob`, not checked here: the
    caller wrote or checked the file)."""
    with open(path, "rb") as f:
        return hash_stream(f, os.fstat(f.fileno()).st_size, blob, piece_length)


def hash_stream(f, size: int, blob: str, piece_length: int | None = None,
                progress: Callable[[int], None] | None = None) -> Pieces:
    """The pieces of the `size` bytes of blob `blob` read from `f` (anything with read(n));
    `progress(bytes so far)` after each read. Checking the bytes against `blob` is the
    reader's (a VerifyingReader raises at its end) or the caller's."""
    hasher = PieceHasher(size, piece_length)
    done = 0
    while data := f.read(_READ):
        hasher.update(data)
        done += len(data)
        if progress:
            progress(done)
    return hasher.finish(blob)


def push_pieces(host: str, repository: str, pieces: Pieces, plain_http: bool = False) -> str:
    """Publish `pieces` beside the image in `repository`; the reference pushed."""
    ref = DockerRef(host, repository, tag=pieces_tag(pieces.blob))
    return push_artifact(ref, CONFIG_MEDIA_TYPE, PIECES_MEDIA_TYPE, pieces.to_json(), {BLOB_ANNOTATION: pieces.blob},
                         plain_http)


def pieces_blob(manifest: bytes, blob: str, what: str) -> Descriptor:
    """The document's descriptor in a published pieces manifest bound to `blob`."""
    return artifact_blob(manifest, what, PIECES_MEDIA_TYPE, BLOB_ANNOTATION, blob)
