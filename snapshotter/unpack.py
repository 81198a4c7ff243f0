"""Unpack a layer tar into a directory the way overlayfs wants its lower layers.

For layers without a TOC (ordinary gzip/zstd layers), the node downloads the blob and
unpacks it itself, so every layer of an image is provided by the snapshotter. Like
containerd's apply for overlay: `.wh.NAME` becomes a 0/0 character device NAME,
`.wh..wh..opq` becomes `trusted.overlay.opaque=y` on its directory; owners, modes,
times, xattrs, hard links and fifos are kept.

Nothing is written outside the target, whatever the tar holds:
- every entry passes builder.tarstream.LayerEntries (the rules `shoal convert` applies
  too): clean relative names, whiteouts only of a name in their own directory, hard
  links only to an earlier file of this layer, no name twice;
- every parent directory is opened from the root's file descriptor one component at a
  time with O_NOFOLLOW|O_DIRECTORY, and every file is made with the *at() call on that
  descriptor: a symlink (or anything not a directory) in a parent fails the entry, it is
  never followed; nothing is ever removed recursively (the only removal is of a
  whiteout device this unpack made, when the same layer has a real entry of that name:
  the real entry wins, as in the lazy view);
- device nodes: only character devices 0/0 (overlayfs' own whiteout form). runc mounts
  a fresh /dev in every container, so a layer needs no device node of its own, and a
  shared node creates none a tenant asks for (containerd's apply would);
- `trusted.overlay.*` xattrs in a layer are dropped (overlayfs would read them as its
  own metadata: opaque, redirect, origin), as the lazy view drops them.
A refused entry raises FormatError "WHAT: entry NAME: why"; the caller removes the
half-made directory.

The decompressed stream is hashed as it is read (to its end, as containerd's apply
does): the result's diff_id is what the layer really is, for the caller to check.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat as statmod
from collections import OrderedDict
from dataclasses import dataclass
from typing import BinaryIO

from builder.tarstream import (
    LayerEntries,
    TarEntry,
    TarReader,
    clean_name,
    whiteout_target,
)
from shoal.errors import FormatError

OPAQUE_XATTR = "trusted.overlay.opaque"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Unpacked:
    entries: int
    diff_id: str  # sha256 of the whole decompressed stream


class _Refused(Exception):
    """An entry the unpack refuses (becomes FormatError naming the entry)."""


class _Tree:
    """The layer's directories, opened from the root without following links.

    Directories are only ever created here or merged with a later `dir` entry; no entry
    replaces one (LayerEntries refuses a name twice), so an open descriptor stays valid
    for the whole unpack and a small cache of them is safe."""

    def __init__(self, root: str) -> None:
        self.root_fd = os.open(root, _DIR_FLAGS)
        self._fds: OrderedDict[str, int] = OrderedDict()
        self.whiteouts: set[str] = set()  # whiteout devices made by this unpack

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        os.close(self.root_fd)

    def dir(self, rel: str, create: bool) -> int:
        """The descriptor of directory `rel` ("" = root), made (0755) if missing and
        `create`. Raises _Refused if a component is a symlink or not a directory."""
        if not rel:
            return self.root_fd
        fd = self._fds.get(rel)
        if fd is not None:
            self._fds.move_to_end(rel)
            return fd
        parent, _, base = rel.rpartition("/")
        pfd = self.dir(parent, create)
        try:
            fd = os.open(base, _DIR_FLAGS, dir_fd=pfd)
        except FileNotFoundError:
            if not create:
                raise _Refused(f"{rel!r} does not exist") from None
            os.mkdir(base, 0o700, dir_fd=pfd)
            fd = os.open(base, _DIR_FLAGS, dir_fd=pfd)
            os.fchmod(fd, 0o755)
        except (NotADirectoryError, OSError) as e:  # ENOTDIR or ELOOP: not a directory, or a symlink
            if e.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            if create and rel in self.whiteouts:  # a real entry of this layer wins over its whiteout
                os.unlink(base, dir_fd=pfd)
                self.whiteouts.discard(rel)
                return self.dir(rel, create)
            raise _Refused(f"{rel!r} is a symlink or a file, not a directory (never followed)") from None
        self._fds[rel] = fd
        if len(self._fds) > 64:
            os.close(self._fds.popitem(last=False)[1])
        return fd


def unpack(stream: BinaryIO, root: str, what: str = "layer") -> Unpacked:
    """Unpack the tar stream into root (an empty directory)."""
    sha = hashlib.sha256()
    reader = TarReader(stream, on_block=sha.update)
    rules = LayerEntries()
    tree = _Tree(root)
    dirs: list[tuple[str, float]] = []
    count = 0
    try:
        while (item := _next(reader, what)) is not None:
            e = item[1]
            try:
                rel = rules.admit(e.name, e.type, e.linkname)
                _apply(tree, reader, e, rel, dirs)
            except (_Refused, FormatError, OSError) as err:
                why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
                raise FormatError(f"{what}: entry {e.name[:200]!r}: {why}") from None
            count += 1
        for rel, mtime in reversed(dirs):
            os.utime(tree.dir(rel, create=False), (mtime, mtime))
    finally:
        tree.close()
    return Unpacked(count, "sha256:" + sha.hexdigest())


def _next(reader: TarReader, what: str) -> tuple[bytes, TarEntry] | None:
    try:
        return reader.next()
    except FormatError as e:
        if str(e).startswith(what):  # the decompressor names the layer already
            raise
        raise FormatError(f"{what}: {e}") from None


def _apply(tree: _Tree, reader: TarReader, e: TarEntry, rel: str, dirs: list[tuple[str, float]]) -> None:
    if e.type == "dir":
        fd = tree.dir(rel, create=True)
        _set_meta(fd, e)
        dirs.append((rel, e.mtime))
        return
    parent, _, base = rel.rpartition("/")
    pfd = tree.dir(parent, create=True)
    target = whiteout_target(rel)
    if target is not None:
        _whiteout(tree, pfd, base, target)
        return
    if rel in tree.whiteouts:  # a real entry of this layer wins over its whiteout
        os.unlink(base, dir_fd=pfd)
        tree.whiteouts.discard(rel)
    if e.type == "reg":
        fd = os.open(base, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=pfd)
        try:
            while data := reader.read_payload(1 << 20):
                _write_all(fd, data)
            _set_meta(fd, e)
            os.utime(fd, (e.atime or e.mtime, e.mtime))
        finally:
            os.close(fd)
        return
    if e.type == "hardlink":  # shares the target's inode and metadata
        link_parent, _, link_base = clean_name(e.linkname, untrusted=True).rpartition("/")
        os.link(link_base, base, src_dir_fd=tree.dir(link_parent, create=False), dst_dir_fd=pfd,
                follow_symlinks=False)
        return
    if e.type == "symlink":
        os.symlink(e.linkname, base, dir_fd=pfd)
    elif e.type == "fifo":
        os.mkfifo(base, 0o600, dir_fd=pfd)
    elif e.type == "char" and (e.devmajor, e.devminor) == (0, 0):
        os.mknod(base, statmod.S_IFCHR | 0o600, 0, dir_fd=pfd)
    else:
        raise _Refused(f"{e.type} device {e.devmajor}:{e.devminor}: a node creates no device nodes "
                       "but 0/0 whiteouts (runc gives every container its own /dev)")
    os.chown(base, e.uid, e.gid, dir_fd=pfd, follow_symlinks=False)
    if e.type != "symlink":  # the node was made just now by this unpack: not a link
        os.chmod(base, e.mode & 0o7777, dir_fd=pfd)
    for key, value in _xattrs(e):
        os.setxattr(f"/proc/self/fd/{pfd}/{base}", key, value, follow_symlinks=False)
    os.utime(base, (e.atime or e.mtime, e.mtime), dir_fd=pfd, follow_symlinks=False)


def _whiteout(tree: _Tree, pfd: int, base: str, target: str) -> None:
    if target == "":  # opaque marker: on the directory it sits in
        os.setxattr(pfd, OPAQUE_XATTR, b"y")
        return
    name = target.rpartition("/")[2]
    try:
        os.lstat(name, dir_fd=pfd)
        return  # a real entry of this layer (or a parent made for one) wins over its whiteout
    except FileNotFoundError:
        pass
    os.mknod(name, statmod.S_IFCHR | 0o000, 0, dir_fd=pfd)
    tree.whiteouts.add(target)


def _set_meta(fd: int, e: TarEntry) -> None:
    """Owner, mode (after the owner: chown clears set-id bits) and xattrs, by descriptor."""
    os.fchown(fd, e.uid, e.gid)
    os.fchmod(fd, e.mode & 0o7777)
    for key, value in _xattrs(e):
        os.setxattr(fd, key, value)


def _xattrs(e: TarEntry) -> list[tuple[str, bytes]]:
    return [(k, v) for k, v in e.xattrs.items() if not k.startswith("trusted.overlay.")]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
