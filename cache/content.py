"""A size-bounded, content-addressed directory with an LRU index.

The machinery shared by the node's ChunkStore (cache/store.py) and the region's disk
backend (cache/region/backends/disk.py). It stores files named by the sha256 digest of
their bytes; it does not read or verify their bytes itself (its users do).

Layout under `root`:

    data/<hex[:2]>/<hex>      committed content, named by the sha256 of its bytes
    tmp/<pid>.<start>.<rand>  files being written; renamed into data/ on commit
    index.db                  sqlite (WAL): `entries(digest, size, atime)`, `meta` (capacity,
                              totals), `owners` (each process that has the directory open)

Invariants (what crash safety rests on):
- A file appears under data/ only by rename() of a complete, closed temp file, so a name
  in data/ never refers to a partly written file, whatever moment a process dies at.
  (After a power loss without fsync its bytes may be wrong; users verify on read.)
- After every index transaction, the sum of the sizes of the entries is at most the
  capacity: room is made (entries evicted and their files unlinked) in the same
  transaction that adds an entry, before the file is renamed into place.
- Files under data/ are a subset of the entries, except when a process dies between the
  rename and the commit of its transaction; entries whose file is missing are harmless
  (they only over-count). Both are repaired by recover(), which runs when a directory is
  opened after a process that had it open died (its `owners` row names a dead process).

Concurrency: threads share one sqlite connection behind a lock; processes serialize
their index transactions with sqlite's write lock (BEGIN IMMEDIATE), so the capacity
bound holds across processes too. Pins and read guards are per process: a process never
evicts what it pinned or is reading; another process may unlink such a file, which an
open file descriptor survives (POSIX), but a later open in the pinning process misses.

The disk: the directory never fills the file system it lives on. It keeps
`disk_reserve(size of the file system)` bytes free there (for containerd, the node's
metadata database, the unpacked layers): a capacity larger than what the disk can hold
(free space + what the directory holds - the reserve) is clamped with a warning at open,
and before each file is written, entries are evicted (LRU) until the file fits with the
reserve still free; a file that cannot fit so is not written (counted as `rejected`).

Eviction is LRU by last access. Reads record their access time in memory; the times are
written to the index at most once a second and before every eviction, so a crash loses
at most a second of recency, never content.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from shoal.digest import check_digest
from shoal.fsutil import fsync_dir as _fsync_dir
from shoal.fsutil import private_database, private_dir

log = logging.getLogger("shoal.cache")

DEFAULT_FRACTION = 0.20  # of the free space at the root, when no capacity is given
RESERVE_FRACTION = 0.10  # of the file system, left free whatever the capacity
RESERVE_MIN = 1 << 30  # ... and at least this much, unless it is more than half the file system
_FLUSH_INTERVAL = 1.0  # seconds between writes of access times
_BUSY_TIMEOUT_MS = 60_000
_EVICT_BATCH = 256

_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    digest TEXT PRIMARY KEY,
    size INTEGER NOT NULL,
    atime REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS entries_atime ON entries(atime);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS owners (pid INTEGER NOT NULL, start INTEGER NOT NULL, token TEXT PRIMARY KEY);
"""


def disk_reserve(total: int) -> int:
    """Bytes a directory of content leaves free on a file system of `total` bytes:
    10% of it, at least 1 GiB, but never more than half of a small file system."""
    return int(max(total * RESERVE_FRACTION, min(RESERVE_MIN, total / 2)))


def process_start(pid: int) -> int | None:
    """The start time (clock ticks since boot) of a live, non-zombie process, else None.

    (pid, start) names a process without the risk of PID reuse.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ")"
    fields = stat[stat.rfind(")") + 2:].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])  # field 22 of stat(5): starttime
    except (IndexError, ValueError):
        return None


class ContentDir:
    """Files named by digest under `root`, bounded by `capacity` bytes (see module doc).

    capacity: bytes; None keeps the capacity recorded in the index, or on first use picks
    DEFAULT_FRACTION of the free space at the root and records it. A smaller capacity than
    what is stored evicts at once.
    fsync: fsync each file before its rename and the directory after it (durability across
    power loss; not needed for kill -9 safety).
    """

    def __init__(self, root: str | os.PathLike, capacity: int | None = None, *, fsync: bool = False) -> None:
        self.root = Path(root)
        self.data = self.root / "data"
        self.tmp = self.root / "tmp"
        self.fsync = fsync
        # the owner's alone, whatever the umask (directories 0700, files 0600): a node's
        # chunks are its tenants' images
        for d in (self.root, self.tmp, self.data, *(self.data / f"{i:02x}" for i in range(256))):
            private_dir(d)
        self._lock = threading.RLock()
        self._pins: collections.Counter[str] = collections.Counter()
        self._reading: collections.Counter[str] = collections.Counter()
        self._touched: dict[str, float] = {}
        self._last_flush = time.monotonic()
        self._closed = False
        self.counters = collections.Counter(evictions=0, rejected=0, recovered=0)
        self._pid = os.getpid()
        self._start = process_start(self._pid) or 0
        self._token = f"{self._pid}.{self._start}.{secrets.token_hex(4)}"
        self._db = self._open_db()
        try:
            self._register(capacity)
        except BaseException:
            self._db.close()
            raise

    # --- opening, recovery ---------------------------------------------------------

    def _open_db(self) -> sqlite3.Connection:
        path = self.root / "index.db"
        try:
            db = self._connect(path)
            db.execute("SELECT count(*) FROM entries").fetchone()
            return db
        except sqlite3.DatabaseError as exc:
            # the index is only a cache of what data/ holds: set it aside and rebuild it
            aside = path.with_name(f"index.db.corrupt-{int(time.time())}")
            log.warning("%s: unreadable index (%s); moved to %s, rebuilding", self.root, exc, aside.name)
            with contextlib.suppress(NameError, sqlite3.Error):
                db.close()
            os.replace(path, aside)
            for suffix in ("-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(str(path) + suffix)
            return self._connect(path)

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        db = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=_BUSY_TIMEOUT_MS / 1000)
        db.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
        db.execute("PRAGMA journal_mode=WAL")
        private_database(path)
        # NORMAL in WAL mode: a commit survives a process crash; a power loss may lose
        # the last commits, which recover() reconciles with data/ like any other crash
        db.execute("PRAGMA synchronous=NORMAL")
        db.executescript(_SCHEMA)
        return db

    def _register(self, capacity: int | None) -> None:
        with self._txn():
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
            fresh = "capacity" not in meta
            if capacity is None:
                capacity = meta.get("capacity")
            if capacity is None:
                st = os.statvfs(self.root)
                capacity = int(st.f_bavail * st.f_frsize * DEFAULT_FRACTION)
            if capacity < 0:
                raise ValueError(f"capacity must be >= 0, not {capacity}")
            capacity = self._clamp(capacity)
            self._set_meta("capacity", capacity)
            self.capacity = capacity
            owners = self._db.execute("SELECT pid, start, token FROM owners").fetchall()
            dead = [t for pid, start, t in owners if process_start(pid) != start]
            if dead or fresh:
                self._recover(dead)
            self._db.execute("INSERT INTO owners VALUES (?, ?, ?)", (self._pid, self._start, self._token))
            used, _ = self._usage()
            if used > capacity:
                self._evict(used - capacity)

    def _free(self) -> tuple[int, int]:
        """(bytes free for us on the file system, its reserve)."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize, disk_reserve(st.f_blocks * st.f_frsize)

    def _clamp(self, capacity: int) -> int:
        """`capacity`, or what the disk can hold beside the reserve if that is less (logged)."""
        free, reserve = self._free()
        used, _ = self._usage()
        room = max(0, free + used - reserve)
        if capacity > room:
            log.warning("%s: capacity %d bytes is more than the disk holds (%d free, %d in the store, %d kept "
                        "free for containerd and the node's database): using %d", self.root, capacity, free, used,
                        reserve, room)
            return room
        return capacity

    def make_room(self, size: int) -> bool:
        """Whether a file of `size` bytes can be written now with the file system's
        reserve still free, after evicting entries (LRU) if needed."""
        free, reserve = self._free()
        short = size + reserve - free
        if short <= 0:
            return True
        with self._txn():
            self._evict(short)
        free, reserve = self._free()
        if size + reserve > free:
            self.counters["rejected"] += 1
            return False
        return True

    def _recover(self, dead_tokens: list[str]) -> None:
        """After a crash (or on a new index): drop dead processes' temp files and make the
        index and data/ agree. Runs inside the write transaction."""
        start = time.monotonic()
        live = {f"{pid}.{st}." for pid, st, _ in self._db.execute("SELECT pid, start, token FROM owners")
                if process_start(pid) == st}
        for entry in os.scandir(self.tmp):
            if not any(entry.name.startswith(p) for p in live):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
        if dead_tokens:
            self._db.executemany("DELETE FROM owners WHERE token = ?", [(t,) for t in dead_tokens])
        rows = dict(self._db.execute("SELECT digest, size FROM entries").fetchall())
        adopted = dropped = 0
        seen: set[str] = set()
        for sub in os.scandir(self.data):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                digest = "sha256:" + entry.name
                if len(entry.name) != 64 or not entry.name.startswith(sub.name) or not _is_hex(entry.name):
                    os.unlink(entry.path)  # not ours: nothing may sit in data/ unindexed
                    continue
                size = entry.stat(follow_symlinks=False).st_size
                seen.add(digest)
                if digest not in rows:
                    self._db.execute(
                        "INSERT INTO entries VALUES (?, ?, ?)", (digest, size, entry.stat().st_mtime)
                    )
                    adopted += 1
                elif rows[digest] != size:
                    # a content-addressed file whose size changed is damaged
                    os.unlink(entry.path)
                    self._db.execute("DELETE FROM entries WHERE digest = ?", (digest,))
                    seen.discard(digest)
                    dropped += 1
        missing = [(d,) for d in rows if d not in seen]
        self._db.executemany("DELETE FROM entries WHERE digest = ?", missing)
        total, count = self._db.execute("SELECT coalesce(sum(size), 0), count(*) FROM entries").fetchone()
        self._set_meta("bytes", total)
        self._set_meta("entries", count)
        self.counters["recovered"] += 1
        log.info(
            "%s: recovered index in %.2fs: %d entries, %d adopted, %d dropped, %d rows without file",
            self.root, time.monotonic() - start, count, adopted, dropped, len(missing),
        )

    # --- transactions ----------------------------------------------------------------

    @contextlib.contextmanager
    def _txn(self) -> Iterator[None]:
        """One write transaction (this process's lock, then sqlite's write lock)."""
        with self._lock:
            if self._closed:
                raise ValueError(f"{self.root}: closed")
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._flush_touched()
                yield
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _set_meta(self, key: str, value: int) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    def _add_usage(self, size: int, count: int) -> None:
        self._db.execute(
            "INSERT INTO meta VALUES ('bytes', ?) ON CONFLICT(key) DO UPDATE SET value = value + ?", (size, size)
        )
        self._db.execute(
            "INSERT INTO meta VALUES ('entries', ?) ON CONFLICT(key) DO UPDATE SET value = value + ?", (count, count)
        )

    def _usage(self) -> tuple[int, int]:
        meta = dict(self._db.execute("SELECT key, value FROM meta WHERE key IN ('bytes', 'entries')").fetchall())
        return meta.get("bytes", 0), meta.get("entries", 0)

    def _flush_touched(self) -> None:
        if self._touched:
            items = [(t, d) for d, t in self._touched.items()]
            self._touched.clear()
            self._db.executemany("UPDATE entries SET atime = max(atime, ?) WHERE digest = ?", items)
        self._last_flush = time.monotonic()

    def _evict(self, need: int) -> bool:
        """Evict least recently used entries (not pinned, not being read) until `need`
        bytes are freed. Inside a transaction. False if not enough could be freed."""
        freed, offset = 0, 0
        while freed < need:
            batch = self._db.execute(
                "SELECT digest, size FROM entries ORDER BY atime, rowid LIMIT ? OFFSET ?",
                (_EVICT_BATCH, offset),
            ).fetchall()
            if not batch:
                return False
            victims = []
            for digest, size in batch:
                if self._pins[digest] or self._reading[digest]:
                    offset += 1
                    continue
                victims.append((digest,))
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path(digest))
                freed += size
                self._add_usage(-size, -1)
                self.counters["evictions"] += 1
                if freed >= need:
                    break
            self._db.executemany("DELETE FROM entries WHERE digest = ?", victims)
        return True

    # --- the API -----------------------------------------------------------------

    def path(self, digest: str) -> Path:
        hexa = digest[7:] if digest.startswith("sha256:") else check_digest(digest)
        return self.data / hexa[:2] / hexa

    def temp_path(self) -> Path:
        """A fresh path in tmp/ (same file system as data/) to write a file to commit."""
        return self.tmp / f"{self._token}.{secrets.token_hex(8)}"

    def write_temp(self, data: bytes | bytearray | memoryview) -> Path:
        """Write `data` to a new temp file (fsync'ed if configured); return its path."""
        path = self.temp_path()
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600), "wb") as fh:
            fh.write(data)
            if self.fsync:
                fh.flush()
                os.fsync(fh.fileno())
        return path

    def commit(self, digest: str, temp: str | os.PathLike, size: int | None = None) -> bool:
        """Move the complete file `temp` into the directory under `digest`.

        Idempotent: if the digest is already there, `temp` is discarded. The caller has
        checked that the bytes match the digest. Returns False (and removes `temp`) if no
        room can be made (the file is larger than the capacity, or everything else is
        pinned or being read).
        """
        return self.commit_many([(digest, temp, size)])[0]

    def commit_many(self, items: list[tuple[str, str | os.PathLike, int | None]]) -> list[bool]:
        """commit() for several (digest, temp, size) in one transaction (a writer that
        stores many small chunks pays for one sqlite commit, not one each)."""
        temps = [Path(t) for _, t, _ in items]
        try:
            todo = []
            for (digest, _, size), temp in zip(items, temps):
                check_digest(digest)
                if size is None:
                    size = os.stat(temp).st_size
                if self.fsync:
                    with open(temp, "rb") as fh:
                        os.fsync(fh.fileno())
                todo.append((digest, temp, size, self.path(digest)))
            results = []
            with self._txn():
                for digest, temp, size, final in todo:
                    results.append(self._commit_one(digest, temp, size, final))
            if self.fsync:
                for final in {final.parent for _, _, _, final in todo}:
                    _fsync_dir(final)
            return results
        finally:
            for temp in temps:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temp)

    def _commit_one(self, digest: str, temp: Path, size: int, final: Path) -> bool:
        """One entry of commit_many, inside its transaction."""
        row = self._db.execute("SELECT size FROM entries WHERE digest = ?", (digest,)).fetchone()
        if row is not None and final.exists():
            self._db.execute("UPDATE entries SET atime = ? WHERE digest = ?", (time.time(), digest))
            return True
        if row is not None:  # an entry whose file was lost: account it anew
            self._db.execute("DELETE FROM entries WHERE digest = ?", (digest,))
            self._add_usage(-row[0], -1)
        if size > self.capacity:
            self.counters["rejected"] += 1
            return False
        used, _ = self._usage()
        if used + size > self.capacity and not self._evict(used + size - self.capacity):
            self.counters["rejected"] += 1
            return False
        self._db.execute("INSERT INTO entries VALUES (?, ?, ?)", (digest, size, time.time()))
        self._add_usage(size, 1)
        # inside the transaction: no other process can evict the entry before the file
        # is in place (a crash right here leaves a file that recover() adopts)
        os.rename(temp, final)
        return True

    def exists(self, digest: str) -> bool:
        return self.path(digest).exists()

    def touch(self, digest: str) -> None:
        """Record a read (LRU); written to the index at most once a second."""
        with self._lock:
            self._touched[digest] = time.time()
            if time.monotonic() - self._last_flush < _FLUSH_INTERVAL or self._closed:
                return
        try:
            with self._txn():
                pass  # _txn flushes the access times
        except sqlite3.OperationalError as exc:  # busy: try again with the next read
            log.debug("%s: access times not written yet: %s", self.root, exc)

    @contextlib.contextmanager
    def reading(self, digest: str) -> Iterator[None]:
        """Guard a read: this process does not evict `digest` meanwhile."""
        with self._lock:
            self._reading[digest] += 1
        try:
            yield
        finally:
            with self._lock:
                self._reading[digest] -= 1
                if not self._reading[digest]:
                    del self._reading[digest]

    def pin(self, digests: Iterable[str]) -> None:
        """Keep `digests` (present or future) from eviction until unpinned (counted)."""
        with self._lock:
            for d in digests:
                self._pins[d] += 1

    def unpin(self, digests: Iterable[str]) -> None:
        with self._lock:
            for d in digests:
                if self._pins[d] <= 1:
                    self._pins.pop(d, None)
                else:
                    self._pins[d] -= 1

    def remove(self, digest: str) -> bool:
        """Delete `digest` (pinned or not); False if it was not there."""
        path = self.path(digest)
        with self._txn():
            row = self._db.execute("SELECT size FROM entries WHERE digest = ?", (digest,)).fetchone()
            if row is not None:
                self._db.execute("DELETE FROM entries WHERE digest = ?", (digest,))
                self._add_usage(-row[0], -1)
            try:
                os.unlink(path)
                return True
            except FileNotFoundError:
                return row is not None

    def set_capacity(self, capacity: int) -> None:
        with self._txn():
            self._set_meta("capacity", capacity)
            self.capacity = capacity
            used, _ = self._usage()
            if used > capacity:
                self._evict(used - capacity)

    def usage(self) -> tuple[int, int]:
        """(bytes, entries) as the index counts them (all processes)."""
        with self._lock:
            return self._usage()

    def check(self) -> dict:
        """Compare the index with data/ (for tests and `fsck`-style checks; reads no bytes)."""
        with self._lock:
            rows = dict(self._db.execute("SELECT digest, size FROM entries").fetchall())
            used, count = self._usage()
        files = {}
        for sub in os.scandir(self.data):
            for entry in os.scandir(sub.path):
                files["sha256:" + entry.name] = entry.stat().st_size
        return {
            "entries": len(rows), "files": len(files), "bytes": sum(rows.values()),
            "counted_bytes": used, "counted_entries": count,
            "files_without_entry": sorted(set(files) - set(rows)),
            "entries_without_file": sorted(set(rows) - set(files)),
            "size_mismatch": sorted(d for d in files.keys() & rows.keys() if files[d] != rows[d]),
            "temp_files": len(os.listdir(self.tmp)),
        }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                with self._txn():
                    self._db.execute("DELETE FROM owners WHERE token = ?", (self._token,))
            finally:
                self._closed = True
                self._db.close()


def _is_hex(text: str) -> bool:
    return all(c in "0123456789abcdef" for c in text)
