"""Unpack a layer tar into a directory the way overlayfs wants its lower layers.

For layers without a TOC (ordinary gzip/zstd layers), the node downloads the blob and
unpacks it itself, so every layer of an image is provided by the snapshotter. Like
containerd's apply for overlay: `.wh.NAME` becomes a 0/0 character device NAME,
`.wh..wh..opq` becomes `trusted.overlay.opaque=y` on its directory; owners, modes,
times, xattrs, hard links, devices and fifos are kept.

Nothing is written outside the target: names with `..` or absolute names are refused,
and no path is followed through a symlink (every parent is checked to be a real
directory created by this unpack).
"""

from __future__ import annotations

import os
import stat as statmod
from typing import BinaryIO

from builder.tarstream import TarReader, clean_name
from shoal.errors import FormatError

WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


def _safe_parent(root: str, rel: str, made: set[str]) -> str:
    """Create (or check) the parents of rel under root without following symlinks."""
    parent = os.path.dirname(rel)
    path = root
    for part in parent.split("/") if parent else []:
        path = os.path.join(path, part)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            os.mkdir(path, 0o755)
            made.add(path)
            continue
        if not statmod.S_ISDIR(st.st_mode):
            raise FormatError(f"path {rel!r} goes through {path[len(root) + 1:]!r}, which is not a directory")
    return path


def _remove(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if statmod.S_ISDIR(st.st_mode):
        import shutil

        shutil.rmtree(path)
    else:
        os.unlink(path)


def unpack(stream: BinaryIO, root: str, what: str = "layer") -> int:
    """Unpack the tar stream into root (an empty directory); returns the entry count."""
    reader = TarReader(stream)
    made: set[str] = set()
    dir_times: list[tuple[str, float]] = []
    count = 0
    while (item := reader.next()) is not None:
        _, e = item
        try:
            rel = clean_name(e.name, untrusted=True)
        except FormatError as err:
            raise FormatError(f"{what}: {err}") from None
        count += 1
        if not rel:
            os.chmod(root, e.mode & 0o7777)
            os.lchown(root, e.uid, e.gid)
            dir_times.append((root, e.mtime))
            continue
        parent = _safe_parent(root, rel, made)
        base = os.path.basename(rel)
        if base == OPAQUE:
            os.setxattr(parent, "trusted.overlay.opaque", b"y")
            continue
        if base.startswith(WHITEOUT):
            target = os.path.join(parent, base[len(WHITEOUT):])
            _remove(target)
            os.mknod(target, statmod.S_IFCHR | 0o000, os.makedev(0, 0))
            continue
        path = os.path.join(parent, base)
        if e.type != "dir" or not os.path.isdir(path) or os.path.islink(path):
            _remove(path)
        if e.type == "reg":
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                while data := reader.read_payload(1 << 20):
                    f.write(data)
        elif e.type == "dir":
            if not os.path.isdir(path):
                os.mkdir(path, 0o700)
            dir_times.append((path, e.mtime))
        elif e.type == "symlink":
            os.symlink(e.linkname, path)
        elif e.type == "hardlink":
            target_rel = clean_name(e.linkname, untrusted=True)
            target = os.path.join(_safe_parent(root, target_rel, made), os.path.basename(target_rel))
            if not os.path.lexists(target) or os.path.isdir(target):
                raise FormatError(f"{what}: hard link {rel!r} to missing {target_rel!r}")
            os.link(target, path, follow_symlinks=False)
            continue  # the link shares the target's inode and metadata
        elif e.type in ("char", "block"):
            kind = statmod.S_IFCHR if e.type == "char" else statmod.S_IFBLK
            os.mknod(path, kind | (e.mode & 0o7777), os.makedev(e.devmajor, e.devminor))
        elif e.type == "fifo":
            os.mkfifo(path, e.mode & 0o7777)
        os.lchown(path, e.uid, e.gid)
        if e.type != "symlink":
            os.chmod(path, e.mode & 0o7777)
        for key, value in e.xattrs.items():
            try:
                os.setxattr(path, key, value, follow_symlinks=False)
            except OSError as err:
                raise FormatError(f"{what}: cannot set xattr {key} on {rel!r}: {err.strerror}") from None
        if e.type != "dir":
            os.utime(path, (e.atime or e.mtime, e.mtime), follow_symlinks=False)
    for path, mtime in reversed(dir_times):
        os.utime(path, (mtime, mtime))
    return count
