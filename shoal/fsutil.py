"""Small file-system helpers shared by the components."""

from __future__ import annotations

import os
import re

PRIVATE_UMASK = 0o077  # the node's daemons create what they make under ROOT for root alone


def private_dir(path: str | os.PathLike) -> str:
    """`path` as a directory only its owner may enter: made 0700, or set to 0700 if it
    was there already (a root made by an older version or another umask)."""
    path = os.fspath(path)
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path


def private_database(path: str | os.PathLike) -> None:
    """An sqlite database and its WAL and shared-memory files (once they exist; sqlite
    gives new ones the database's mode): the owner's alone."""
    path = os.fspath(path)
    for p in (path, f"{path}-wal", f"{path}-shm"):
        try:
            os.chmod(p, 0o600)
        except FileNotFoundError:
            pass


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


def replace_file(path: str | os.PathLike, data: bytes, new_mode: int = 0o644) -> None:
    """Write `data` to `path` atomically (a temporary file beside it, fsynced, renamed over
    it, the directory fsynced): a reader sees the old bytes or the new, never a mix. An
    existing file's mode and owner are kept; a new one gets `new_mode`."""
    path = os.fspath(path)
    try:
        st = os.stat(path)
        mode, owner = st.st_mode & 0o7777, (st.st_uid, st.st_gid)
    except FileNotFoundError:
        mode, owner = new_mode, None
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        if owner is not None:
            os.chown(tmp, *owner)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
