"""Small file-system helpers shared by the components."""

from __future__ import annotations

import os
import re


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory, so a rename into it survives a power loss."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def mounts() -> list[tuple[str, str]]:
    """(mount point, device "major:minor") of every mount of this mount namespace, from
    /proc/self/mountinfo, which writes space, tab, newline and backslash as \\ooo."""
    out = []
    with open("/proc/self/mountinfo", "rb") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) > 4:
                raw = re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), fields[4])
                out.append((os.fsdecode(raw), fields[2].decode()))
    return out
