"""The zstd:chunked reader, sans I/O: file-system answers about one layer from its TOC.

A LayerReader never fetches by itself: chunks come through a ChunkLoader (the node's
cache.loader.NodeChunkLoader, or a RangeLoader over a `fetch` function), and every
chunk is verified against its sha256 (decode_chunk) before a byte of it is returned.
"""

from __future__ import annotations

import bisect
import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from builder.format.toc import Chunk, Entry, Toc, decompress_frames
from builder.tarstream import clean_name
from shoal.errors import DigestMismatch, FormatError

# fetch(ranges) -> one bytes object per [start, end) range, in order.
FetchRanges = Callable[[Sequence[tuple[int, int]]], Sequence[bytes]]


class ChunkLoader(Protocol):
    """Turns chunks into their verified, decompressed bytes (fetching as it must).

    load returns one bytes object per chunk, in order, each checked against the chunk's
    digest. Raises DigestMismatch or FormatError for bad bytes and a ShoalError naming
    `what` when they cannot be had. Called from any thread (FUSE workers): thread-safe.
    """

    def load(self, chunks: Sequence[Chunk], what: str) -> list[bytes]: ...


class RangeLoader:
    """The plain loader: fetch the compressed ranges at once, decode and verify each."""

    def __init__(self, fetch: FetchRanges):
        self._fetch = fetch

    def load(self, chunks: Sequence[Chunk], what: str) -> list[bytes]:
        raws = self._fetch([(c.start, c.end) for c in chunks])
        if len(raws) != len(chunks):
            raise FormatError(f"{what}: fetch returned {len(raws)} ranges for {len(chunks)}")
        return [decode_chunk(c, raw, what) for c, raw in zip(chunks, raws)]


class ChunkMemo(Protocol):
    """Where a LayerReader keeps decompressed, verified chunks (cache.memory.ChunkMemory
    is the node's, shared by all its layers). Keys are chunk digests or keys private to
    one reader (LayerReader.memory_key); get returns None for a chunk not kept. Called
    from any thread: implementations are thread-safe. A memo may forget anything."""

    def get(self, key: object) -> bytes | None: ...

    def put(self, key: object, data: bytes) -> None: ...

    def served(self, key: object, start: int, end: int) -> None:
        """Bytes [start, end) of the kept chunk went to a client that keeps them itself
        (the kernel's page cache): a memo may forget a chunk all of whose bytes did."""
        ...


class _RecentChunks:
    """A reader's own memo when it is given none: the chunks it decoded lately, all
    forgotten at once when they would pass `capacity` bytes (so sequential small reads
    decode each chunk once). Thread-safe."""

    def __init__(self, capacity: int = 64 << 20):
        self._data: dict[object, bytes] = {}
        self._size = 0
        self._capacity = capacity
        self._lock = threading.Lock()

    def get(self, key: object) -> bytes | None:
        with self._lock:
            return self._data.get(key)

    def put(self, key: object, data: bytes) -> None:
        with self._lock:
            if self._size + len(data) > self._capacity:
                self._data.clear()
                self._size = 0
            if len(data) <= self._capacity and key not in self._data:
                self._data[key] = data
                self._size += len(data)

    def served(self, key: object, start: int, end: int) -> None:
        pass  # (its clients read a file once: clearing at capacity is enough)


@dataclass
class Stat:
    name: str
    type: str
    mode: int  # permission bits (and setuid/setgid/sticky)
    uid: int
    gid: int
    size: int
    mtime: float
    nlink: int
    devmajor: int
    devminor: int
    ino: int


class LayerReader:
    """Answers file-system questions about one layer from its TOC.

    Paths are root-relative ("" is the root; leading "/" is accepted). Reads load only
    the chunks they need through `loader` (or a RangeLoader over `fetch`), which verifies
    every chunk against its sha256 before a byte of it is returned. Decompressed chunks
    are kept in `memory` (a ChunkMemo: the node passes its cache.memory.ChunkMemory; by
    default a small one of the reader's own), so sequential small reads decode each
    chunk once.
    Errors: FileNotFoundError / NotADirectoryError / IsADirectoryError / OSError for
    path problems (errno set, so FUSE can pass them on); DigestMismatch and FormatError
    when the layer's bytes are bad.
    """

    def __init__(
        self, toc: Toc, fetch: FetchRanges | None = None, layer: str = "layer",
        loader: ChunkLoader | None = None, memory: ChunkMemo | None = None,
    ):
        if loader is None:
            if fetch is None:
                raise TypeError("LayerReader needs fetch or loader")
            loader = RangeLoader(fetch)
        self._loader = loader
        self._layer = layer
        self._offsets: dict[str, list[int]] = {}  # file -> its chunks' file offsets
        self.memory: ChunkMemo = memory if memory is not None else _RecentChunks()
        self.on_read: Callable[[Sequence[Chunk]], None] | None = None  # told the chunks of every read
        self.entries: dict[str, Entry] = {}
        self.children: dict[str, dict[str, None]] = {"": {}}
        self.nlink: dict[str, int] = {}
        self.ino: dict[str, int] = {"": 1}
        root = Entry(name="", type="dir", mode=0o755)
        self.entries[""] = root
        for e in toc.entries:
            self._add(e)

    def _add(self, e: Entry) -> None:
        name = e.name
        if name in self.entries and name != "":
            # only dir-over-dir reaches here (parse_toc refuses other duplicates)
            self.entries[name] = e
            return
        if name == "":
            self.entries[""] = e
            return
        parent, _, base = name.rpartition("/")
        self._ensure_dir(parent)
        if self.entries[parent].type != "dir":
            raise FormatError(f"{self._layer}: entry {name!r} lies under non-directory {parent!r}")
        self.children[parent][base] = None
        self.entries[name] = e
        self.ino[name] = len(self.ino) + 1
        if e.type == "dir":
            self.children.setdefault(name, {})
        if e.type == "hardlink":
            target = self._resolve_link_target(e)
            self.nlink[target.name] = self.nlink.get(target.name, 1) + 1
            self.ino[name] = self.ino[target.name]

    def _ensure_dir(self, path: str) -> None:
        if path in self.entries:
            return
        parent, _, base = path.rpartition("/")
        self._ensure_dir(parent)
        self.entries[path] = Entry(name=path, type="dir", mode=0o755)
        self.children[parent][base] = None
        self.children[path] = {}
        self.ino[path] = len(self.ino) + 1

    def _resolve_link_target(self, e: Entry) -> Entry:
        target = self.entries.get(e.linkname)
        if target is None or target.type in ("dir", "hardlink"):
            raise FormatError(f"{self._layer}: hard link {e.name!r} to {e.linkname!r} cannot be resolved")
        return target

    def _lookup(self, path: str) -> Entry:
        try:
            name = clean_name(path)
        except FormatError:
            raise FileNotFoundError(2, "No such file or directory", path) from None
        e = self.entries.get(name)
        if e is None:
            raise FileNotFoundError(2, "No such file or directory", path)
        return e

    def _content(self, path: str) -> Entry:
        e = self._lookup(path)
        if e.type == "hardlink":
            e = self._resolve_link_target(e)
        return e

    def stat(self, path: str) -> Stat:
        e = self._content(path)
        name = clean_name(path)
        return Stat(
            name=name,
            type=e.type,
            mode=e.mode & 0o7777,
            uid=e.uid,
            gid=e.gid,
            size=e.size if e.type == "reg" else len(e.linkname.encode()) if e.type == "symlink" else 0,
            mtime=e.mtime,
            nlink=self.nlink.get(e.name, 1) if e.type != "dir" else 2 + sum(
                1 for c in self.children.get(name, {}) if self.entries[_join(name, c)].type == "dir"
            ),
            devmajor=e.devmajor,
            devminor=e.devminor,
            ino=self.ino.get(name, 0),
        )

    def readdir(self, path: str) -> list[str]:
        e = self._lookup(path)
        if e.type != "dir":
            raise NotADirectoryError(20, "Not a directory", path)
        return list(self.children.get(clean_name(path), {}))

    def readlink(self, path: str) -> str:
        e = self._lookup(path)
        if e.type != "symlink":
            raise OSError(22, "Invalid argument", path)
        return e.linkname

    def listxattr(self, path: str) -> list[str]:
        return list(self._content(path).xattrs)

    def getxattr(self, path: str, key: str) -> bytes:
        x = self._content(path).xattrs
        if key not in x:
            raise OSError(61, "No data available", path)  # ENODATA
        return x[key]

    def chunks_for(self, path: str, offset: int, size: int) -> list[Chunk]:
        """The chunks holding bytes [offset, offset+size) of a regular file."""
        e = self._content(path)
        if e.type == "dir":
            raise IsADirectoryError(21, "Is a directory", path)
        if e.type != "reg":
            raise OSError(22, "Invalid argument", path)
        end = min(e.size, offset + size)
        if offset >= end:
            return []
        # Chunks tile the file in order (parse_toc checks it): find the first by bisection,
        # so a read of a file with hundreds of chunks does not scan them all.
        offsets = self._offsets.get(e.name)
        if offsets is None:
            offsets = self._offsets[e.name] = [c.file_offset for c in e.chunks]
        i = bisect.bisect_right(offsets, offset) - 1
        out = []
        for c in e.chunks[max(i, 0):]:
            if c.file_offset >= end:
                break
            out.append(c)
        return out

    def read(self, path: str, offset: int, size: int) -> bytes:
        return _join_parts(self.read_parts(path, offset, size))

    def read_parts(self, path: str, offset: int, size: int, note: bool = True,
                   kept: bool = False) -> list[memoryview]:
        """Like read(), as the pieces of the answer: views into the chunks' bytes, in
        order (for a writev, without copying them; not to be kept). `note` False: not
        told to `on_read` (a read of the reader's own, not a client's). `kept`: the
        caller's client keeps these bytes (the kernel's page cache), told to `memory`
        (ChunkMemo.served)."""
        if offset < 0 or size < 0:
            raise OSError(22, "Invalid argument", path)
        chunks = self.chunks_for(path, offset, size)
        if not chunks:
            return []
        parts = _chunk_views(chunks, self.load_chunks(chunks, path), offset, size)
        if self.on_read is not None and note:
            self.on_read(chunks)
        if kept:
            self._served(chunks, parts, offset)
        return parts

    def _served(self, chunks: Sequence[Chunk], parts: list[memoryview], offset: int) -> None:
        """Tell `memory` which bytes of each chunk `parts` (its _chunk_views) hold."""
        for c, part in zip(chunks, parts):
            if not c.zeros:
                start = max(offset - c.file_offset, 0)
                self.memory.served(self.memory_key(c), start, start + len(part))

    def memory_key(self, c: Chunk) -> object:
        """The chunk's key in `memory`: its digest, or a key only this reader uses."""
        return c.digest or (id(self), c.start, c.end)

    def read_cached(self, path: str, offset: int, size: int, kept: bool = False) -> list[memoryview] | None:
        """Like read_parts(), but only from chunks already decompressed in memory; None if
        any chunk would have to be loaded (lets a FUSE reader answer without a thread)."""
        if offset < 0 or size < 0:
            raise OSError(22, "Invalid argument", path)
        chunks = self.chunks_for(path, offset, size)
        datas = []
        for c in chunks:
            data = bytes(c.size) if c.zeros else self.memory.get(self.memory_key(c))
            if data is None:
                return None
            datas.append(data)
        if self.on_read is not None and chunks:
            self.on_read(chunks)
        parts = _chunk_views(chunks, datas, offset, size)
        if kept:
            self._served(chunks, parts, offset)
        return parts

    def load_chunks(self, chunks: Sequence[Chunk], path: str = "") -> list[bytes]:
        """Decompressed, verified bytes of each chunk (fetching the missing ones at once)."""
        result: dict[int, bytes] = {}
        missing: list[tuple[int, Chunk]] = []
        for i, c in enumerate(chunks):
            data = bytes(c.size) if c.zeros else self.memory.get(self.memory_key(c))
            if data is None:
                missing.append((i, c))
            else:
                result[i] = data
        if missing:
            datas = self._loader.load([c for _, c in missing], f"{self._layer} {path!r}")
            for (i, c), data in zip(missing, datas):
                result[i] = data
                self.memory.put(self.memory_key(c), data)
        return [result[i] for i in range(len(chunks))]


def _chunk_views(chunks: Sequence[Chunk], datas: Sequence[bytes], offset: int, size: int) -> list[memoryview]:
    """Bytes [offset, offset+size) of a file from the contents of the chunks covering it,
    as one view per chunk (no copy)."""
    end = offset + size
    return [memoryview(data)[max(offset, c.file_offset) - c.file_offset:min(end, c.file_offset + c.size) - c.file_offset]
            for c, data in zip(chunks, datas)]


def _join_parts(parts: list[memoryview]) -> bytes:
    return bytes(parts[0]) if len(parts) == 1 else b"".join(parts)


def decode_chunk(c: Chunk, raw: bytes, what: str) -> bytes:
    """Decompress one chunk's frames and verify them; raises DigestMismatch/FormatError."""
    if len(raw) != c.end - c.start:
        raise FormatError(f"{what}: got {len(raw)} bytes for chunk at {c.start}, want {c.end - c.start}")
    data = decompress_frames(raw, c.size, f"{what} chunk at {c.start}")
    if len(data) != c.size:
        raise FormatError(f"{what}: chunk at {c.start} is {len(data)} bytes, TOC says {c.size}")
    got = "sha256:" + hashlib.sha256(data).hexdigest()
    if c.digest and got != c.digest:
        raise DigestMismatch(f"{what}: chunk at {c.start} digest mismatch (want {c.digest}, got {got})")
    return data


def _join(parent: str, child: str) -> str:
    return f"{parent}/{child}" if parent else child
