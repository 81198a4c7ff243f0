"""OCI digests (only sha256 is accepted)."""

from __future__ import annotations

import hashlib
import re

from shoal.errors import DigestMismatch, FormatError

DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")


def is_digest(value: object) -> bool:
    return isinstance(value, str) and bool(DIGEST_RE.match(value))


def check_digest(value: object, what: str = "digest") -> str:
    """Return value if it is a well-formed sha256 digest, else raise FormatError."""
    if not is_digest(value):
        shown = value if isinstance(value, str) and len(value) < 100 else type(value).__name__
        raise FormatError(f"malformed {what}: {shown!r} (want sha256:<64 hex>)")
    return value  # type: ignore[return-value]


def sha256_digest(data: bytes | bytearray | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def verify(data: bytes | bytearray | memoryview, expected: str, what: str) -> None:
    """Raise DigestMismatch naming `what` unless sha256(data) == expected."""
    got = sha256_digest(data)
    if got != expected:
        raise DigestMismatch(f"{what}: digest mismatch (want {expected}, got {got})")


def hex_of(digest: str) -> str:
    return check_digest(digest).split(":", 1)[1]


def chain_id(parent_chain: str, diff_id: str) -> str:
    """containerd's (OCI image-spec's) ChainID of a layer with diff_id on top of the
    chain parent_chain ("" for the base): ChainID(L0) = DiffID(L0),
    ChainID(Ln) = sha256(ChainID(Ln-1) + " " + DiffID(Ln))."""
    return diff_id if not parent_chain else sha256_digest(f"{parent_chain} {diff_id}".encode())
