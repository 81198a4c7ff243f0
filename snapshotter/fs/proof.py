"""The proof of a lazy layer: what its whole blob decompresses to.

A lazy layer is served from its TOC, chunk by chunk, each chunk verified against the TOC;
but the TOC is the layer's own word about its content, and the image config's diff_id
(which containerd turns into the chain id the snapshot is named by) is the image's word.
Neither is checked against the other until the whole blob has been read: the layer's
diff_id is the sha256 of its whole decompressed stream. `prove_blob` reads the blob
from start to end in large ranges, checks sha256(blob) against the blob digest and
returns sha256(decompressed stream): the diff_id the layer really has.

Errors: ProofError, with `final` True when the answer is known and bad (the verified
blob does not decompress: no diff_id can ever match), False when the proof could not
be completed now (a source failed, gave bytes that do not match the blob digest, or the
blob's size is not known) and may be tried again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import BinaryIO, cast

import zstandard

from cache.source import BlobRef
from shoal.errors import ShoalError

PROOF_RANGE = 8 << 20  # bytes per range request: few requests, bounded memory


class ProofError(ShoalError):
    def __init__(self, message: str, final: bool) -> None:
        super().__init__(message)
        self.final = final


class _BlobStream:
    """read(n) over a blob fetched in PROOF_RANGE ranges, hashing what it delivers."""

    def __init__(self, read_ranges: Callable, blob: BlobRef) -> None:
        self.read_ranges, self.blob = read_ranges, blob
        self.size = blob.size or 0  # (prove_blob checks that the size is known)
        self.offset = 0
        self.hash = hashlib.sha256()
        self._buf = b""

    def read(self, n: int = -1) -> bytes:
        if not self._buf and self.offset < self.size:
            end = min(self.offset + PROOF_RANGE, self.size)
            try:
                (self._buf,) = self.read_ranges(self.blob, [(self.offset, end)])
            except ShoalError as e:
                raise ProofError(f"cannot read bytes {self.offset}-{end}: {e}", final=False) from None
            self.offset = end
        take = self._buf if n < 0 else self._buf[:n]
        self._buf = self._buf[len(take):]
        self.hash.update(take)
        return take


def prove_blob(read_ranges: Callable, blob: BlobRef) -> str:
    """The diff_id of the zstd-compressed layer `blob` (see the module docstring).
    `read_ranges(blob, [(start, end)])` returns the bytes of each range."""
    if not isinstance(blob.size, int) or blob.size <= 0:
        raise ProofError("the blob's size is not known", final=False)
    stream = _BlobStream(read_ranges, blob)
    diff = hashlib.sha256()
    try:
        with zstandard.ZstdDecompressor().stream_reader(cast(BinaryIO, stream), read_across_frames=True, closefd=False) as z:
            while True:
                data = z.read(1 << 20)
                if not data:
                    break
                diff.update(data)
        while stream.read():  # whatever follows the last frame (zstd:chunked's footer) counts for the digest
            pass
    except zstandard.ZstdError as e:
        failure = f"does not decompress ({e})"
    else:
        failure = ""
    if stream.offset < blob.size:
        while stream.read():
            pass
    if "sha256:" + stream.hash.hexdigest() != blob.digest:
        raise ProofError(f"the bytes read do not match the blob digest (sha256:{stream.hash.hexdigest()})",
                         final=False)
    if failure:
        raise ProofError(failure, final=True)
    return "sha256:" + diff.hexdigest()
