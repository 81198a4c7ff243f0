"""The project's error types.

Every failure a user can act on is a ShoalError whose str() is one line naming what
failed and why; the CLI prints it and exits 1. Anything else escaping is a bug.
"""


class ShoalError(Exception):
    """A failure the user can act on; str() is the one-line message."""


class UsageError(ShoalError):
    """Bad command-line usage (exit status 2)."""


class FormatError(ShoalError):
    """A layer, footer, TOC or tar stream that does not follow its format.

    Parsers raise only this for bad input (the fuzz rule: accepted, or FormatError).
    """


class DigestMismatch(FormatError):
    """Bytes whose sha256 differs from the digest that names them."""


class NotFound(ShoalError):
    """A blob, manifest or image that the source does not have."""


class TransportError(ShoalError):
    """A registry or file transport failed (unreachable, refused, unauthorized)."""
