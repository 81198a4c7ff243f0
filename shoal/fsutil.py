"""Small file-system helpers shared by the components."""

from __future__ import annotations

import os


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so a rename into it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
