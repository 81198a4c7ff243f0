"""One layer as overlayfs wants to see a lower directory.

A layer tar marks deletions the OCI way: `.wh.NAME` deletes NAME from the layers below,
`.wh..wh..opq` in a directory hides everything below it. overlayfs marks them its own
way: a character device 0/0 named NAME, and the xattr `trusted.overlay.opaque=y` on the
directory. LayerView presents the TOC with that translation done, so an overlay mount of
the layer views equals `tar -x` of the layers in order (what containerd's own apply does).

Inode numbers are the TOC reader's (hard links share one); whiteouts get numbers above
them. Everything here is immutable once built.
"""

from __future__ import annotations

import stat as statmod
from dataclasses import dataclass

from builder.format.reader import LayerReader, Stat

WHITEOUT_PREFIX = ".wh."
OPAQUE_MARKER = ".wh..wh..opq"
OPAQUE_XATTR = "trusted.overlay.opaque"

_TYPE_BITS = {
    "reg": statmod.S_IFREG, "dir": statmod.S_IFDIR, "symlink": statmod.S_IFLNK, "char": statmod.S_IFCHR,
    "block": statmod.S_IFBLK, "fifo": statmod.S_IFIFO,
}


@dataclass(frozen=True)
class Node:
    path: str  # path in the layer ("" = root); for a whiteout, the path it deletes
    ino: int
    whiteout: bool = False


class LayerView:
    def __init__(self, reader: LayerReader):
        self.reader = reader
        self.nodes: dict[int, Node] = {}
        self.children: dict[str, dict[str, Node]] = {}
        self.opaque: set[str] = set()
        next_ino = max(reader.ino.values(), default=1) + 1
        by_path = {path: Node(path, ino) for path, ino in reader.ino.items()}
        for node in by_path.values():
            self.nodes.setdefault(node.ino, node)
        for parent, names in reader.children.items():
            listing: dict[str, Node] = {}
            for name in names:
                child = f"{parent}/{name}" if parent else name
                if name == OPAQUE_MARKER:
                    self.opaque.add(parent)
                elif name.startswith(WHITEOUT_PREFIX) and len(name) > len(WHITEOUT_PREFIX):
                    target = name[len(WHITEOUT_PREFIX):]
                    node = Node(f"{parent}/{target}" if parent else target, next_ino, whiteout=True)
                    next_ino += 1
                    self.nodes[node.ino] = node
                    listing.setdefault(target, node)
                else:
                    listing[name] = by_path[child]  # a real entry wins over a whiteout
            self.children[parent] = listing
        self.max_ino = next_ino
        self._listings: dict[str, list[tuple[str, Node]]] = {}

    def node(self, ino: int) -> Node | None:
        return self.nodes.get(ino)

    def lookup(self, parent: Node, name: str) -> Node | None:
        return self.children.get(parent.path, {}).get(name)

    def listdir(self, node: Node) -> list[tuple[str, Node]]:
        """The directory's entries, in a stable order (readdir offsets index into it)."""
        listing = self._listings.get(node.path)
        if listing is None:
            listing = self._listings[node.path] = list(self.children.get(node.path, {}).items())
        return listing

    def stat(self, node: Node) -> Stat:
        if node.whiteout:
            return Stat(node.path, "char", 0, 0, 0, 0, 0.0, 1, 0, 0, node.ino)
        st = self.reader.stat(node.path)
        if st.type == "dir":
            st.nlink = 2 + sum(1 for n in self.children.get(node.path, {}).values()
                               if not n.whiteout and self.reader.entries[n.path].type == "dir")
        return st

    @staticmethod
    def mode(st: Stat) -> int:
        return _TYPE_BITS[st.type] | (st.mode & 0o7777)

    def xattrs(self, node: Node) -> dict[str, bytes]:
        if node.whiteout:
            return {}
        out = {k: v for k, v in self.reader_xattrs(node).items() if not k.startswith("trusted.overlay.")}
        if node.path in self.opaque:
            out[OPAQUE_XATTR] = b"y"
        return out

    def reader_xattrs(self, node: Node) -> dict[str, bytes]:
        return {k: self.reader.getxattr(node.path, k) for k in self.reader.listxattr(node.path)}
