"""Snapshot metadata in SQLite: one row per snapshot, survives daemon restarts.

The table plays the part of containerd's snapshots/storage (a bolt MetaStore): it owns
keys, names, kinds, the parent relation, labels, times and committed usage; it knows
nothing of directories or mounts. The snapshotter keeps directories consistent with it
by ordering (see local.py): a directory is renamed into place inside the write
transaction that inserts its row, and removed only after the transaction that deletes
the row has committed, so a crash leaves at worst a directory without a row (an orphan
that cleanup removes), never a row without its directory.

Invariants kept here:
- `key` is unique across all kinds (keys and names share one namespace);
- `parent_id` refers to a committed snapshot; a snapshot with children is never deleted
  (so parent_id never dangles);
- ids are never reused (AUTOINCREMENT), so a directory named by a deleted id can never
  be mistaken for a live one's.

Thread-safe: one connection, one lock; every operation is a short transaction.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from shoal.errors import ShoalError
from shoal.fsutil import private_database
from snapshotter.snapshotter import (
    AlreadyExists,
    FailedPrecondition,
    Info,
    InvalidArgument,
    Kind,
    NotFound,
    Usage,
)

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshots (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    key        TEXT NOT NULL UNIQUE,          -- key of an active/view snapshot, name of a committed one
    kind       INTEGER NOT NULL,              -- snapshotter.Kind
    parent_id  INTEGER REFERENCES snapshots(id),
    labels     TEXT NOT NULL DEFAULT '{}',    -- JSON object of strings
    created_ns INTEGER NOT NULL,
    updated_ns INTEGER NOT NULL,
    size       INTEGER NOT NULL DEFAULT 0,    -- usage recorded at commit
    inodes     INTEGER NOT NULL DEFAULT 0,
    layer_path TEXT,                          -- remote layers: the lower directory
    layer_kind TEXT                           -- remote layers: "lazy" | "unpacked"
);
CREATE INDEX IF NOT EXISTS snapshots_parent ON snapshots(parent_id);
CREATE TABLE IF NOT EXISTS proofs (          -- what a layer blob was proven to hold (chainproof.py)
    digest     TEXT PRIMARY KEY,              -- the blob digest
    diff_id    TEXT NOT NULL,                 -- sha256 of its decompressed stream
    proven_ns  INTEGER NOT NULL
);
"""

_COLUMNS = (
    "s.id, s.key, s.kind, s.parent_id, coalesce(p.key, ''), s.labels, s.created_ns, s.updated_ns,"
    " s.size, s.inodes, s.layer_path, s.layer_kind"
)
_SELECT = f"SELECT {_COLUMNS} FROM snapshots s LEFT JOIN snapshots p ON p.id = s.parent_id"


@dataclass(frozen=True)
class Record:
    """One snapshot row."""

    id: int
    key: str
    kind: Kind
    parent_id: int | None
    parent: str  # the parent's name, "" for none
    labels: dict[str, str]
    created_ns: int
    updated_ns: int
    usage: Usage
    layer_path: str | None = None
    layer_kind: str | None = None

    @property
    def remote(self) -> bool:
        return self.layer_path is not None

    def info(self) -> Info:
        return Info(
            kind=self.kind, name=self.key, parent=self.parent, labels=dict(self.labels),
            created_ns=self.created_ns, updated_ns=self.updated_ns,
        )


def _record(row: tuple) -> Record:
    return Record(
        id=row[0], key=row[1], kind=Kind(row[2]), parent_id=row[3], parent=row[4],
        labels=json.loads(row[5]), created_ns=row[6], updated_ns=row[7],
        usage=Usage(size=row[8], inodes=row[9]), layer_path=row[10], layer_kind=row[11],
    )


def _clean_labels(labels: dict[str, str] | None) -> dict[str, str]:
    """Labels as stored: strings only, "" means absent (as containerd's boltutil)."""
    out = {}
    for k, v in (labels or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidArgument(f"label {k!r}: keys and values must be strings")
        if v != "":
            out[k] = v
    return out


def now_ns() -> int:
    return time.time_ns()


def _inserted(cur: sqlite3.Cursor) -> int:
    """The id of the row an INSERT made (sqlite sets it for every successful INSERT)."""
    if cur.lastrowid is None:
        raise ShoalError("metadata: an insert made no row")
    return cur.lastrowid


class Tx:
    """Operations inside one transaction (MetaStore.read() / MetaStore.write())."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    # --- reads

    def find(self, key: str) -> Record | None:
        row = self._conn.execute(f"{_SELECT} WHERE s.key = ?", (key,)).fetchone()
        return _record(row) if row else None

    def get(self, key: str) -> Record:
        rec = self.find(key)
        if rec is None:
            raise NotFound(f"snapshot {key!r} does not exist")
        return rec

    def chain(self, rec: Record) -> list[Record]:
        """The parent chain of `rec`, nearest first."""
        out = []
        parent_id = rec.parent_id
        while parent_id is not None:
            row = self._conn.execute(f"{_SELECT} WHERE s.id = ?", (parent_id,)).fetchone()
            if row is None:  # the invariants forbid it; say so rather than mount half a stack
                raise ShoalError(f"snapshot {rec.key!r}: metadata is missing parent id {parent_id}")
            parent = _record(row)
            out.append(parent)
            parent_id = parent.parent_id
        return out

    def all(self) -> list[Record]:
        return [_record(row) for row in self._conn.execute(f"{_SELECT} ORDER BY s.id")]

    def ids(self) -> set[int]:
        return {row[0] for row in self._conn.execute("SELECT id FROM snapshots")}

    def proof(self, digest: str) -> str | None:
        """The diff_id blob `digest` was proven to decompress to, None if not known."""
        row = self._conn.execute("SELECT diff_id FROM proofs WHERE digest = ?", (digest,)).fetchone()
        return row[0] if row else None

    def has_children(self, rec: Record) -> bool:
        return self._conn.execute(
            "SELECT 1 FROM snapshots WHERE parent_id = ? LIMIT 1", (rec.id,)
        ).fetchone() is not None

    # --- writes

    def _committed_parent(self, parent: str) -> Record | None:
        if not parent:
            return None
        rec = self.find(parent)
        if rec is None:
            raise NotFound(f"parent snapshot {parent!r} does not exist")
        if rec.kind != Kind.COMMITTED:
            raise InvalidArgument(f"parent {parent!r} is not a committed snapshot")
        return rec

    def check_new(self, kind: Kind, key: str, parent: str) -> Record | None:
        """What create() would refuse, without writing; returns the parent record."""
        if kind not in (Kind.ACTIVE, Kind.VIEW):
            raise InvalidArgument(f"snapshot kind {kind} cannot be created; only active or view")
        if not key:
            raise InvalidArgument("snapshot key must not be empty")
        parent_rec = self._committed_parent(parent)
        if self.find(key) is not None:
            raise AlreadyExists(f"snapshot {key!r} already exists")
        return parent_rec

    def create(self, kind: Kind, key: str, parent: str, labels: dict[str, str] | None) -> Record:
        """Insert an active or view snapshot."""
        parent_rec = self.check_new(kind, key, parent)
        t = now_ns()
        cur = self._conn.execute(
            "INSERT INTO snapshots (key, kind, parent_id, labels, created_ns, updated_ns)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (key, int(kind), parent_rec.id if parent_rec else None, json.dumps(_clean_labels(labels)), t, t),
        )
        return self._by_id(_inserted(cur))

    def create_committed(
        self, name: str, parent: str, labels: dict[str, str] | None, usage: Usage,
        layer_path: str, layer_kind: str,
    ) -> Record:
        """Insert a committed snapshot provided by a remote layer."""
        parent_rec = self._committed_parent(parent)
        if self.find(name) is not None:
            raise AlreadyExists(f"snapshot {name!r} already exists")
        t = now_ns()
        cur = self._conn.execute(
            "INSERT INTO snapshots (key, kind, parent_id, labels, created_ns, updated_ns, size, inodes,"
            " layer_path, layer_kind) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (name, int(Kind.COMMITTED), parent_rec.id if parent_rec else None,
             json.dumps(_clean_labels(labels)), t, t, usage.size, usage.inodes, layer_path, layer_kind),
        )
        return self._by_id(_inserted(cur))

    def commit(self, key: str, name: str, labels: dict[str, str] | None, usage: Usage, expect_id: int) -> Record:
        """Turn active `key` into committed `name` (same id, same parent, new labels and
        times). `expect_id` guards against the key having been replaced meanwhile."""
        if not name:
            raise InvalidArgument("snapshot name must not be empty")
        if self.find(name) is not None:
            raise AlreadyExists(f"committed snapshot {name!r} already exists")
        rec = self.find(key)
        if rec is None or rec.id != expect_id:
            raise NotFound(f"active snapshot {key!r} does not exist")
        if rec.kind != Kind.ACTIVE:
            raise FailedPrecondition(f"snapshot {key!r} is not active (it is {rec.kind})")
        t = now_ns()
        self._conn.execute(
            "UPDATE snapshots SET key = ?, kind = ?, labels = ?, created_ns = ?, updated_ns = ?,"
            " size = ?, inodes = ? WHERE id = ?",
            (name, int(Kind.COMMITTED), json.dumps(_clean_labels(labels)), t, t, usage.size, usage.inodes, rec.id),
        )
        return self._by_id(rec.id)

    def update(self, key: str, labels: dict[str, str], fieldpaths: list[str]) -> Record:
        """containerd's storage.UpdateInfo: only labels are mutable."""
        rec = self.get(key)
        new = dict(rec.labels)
        if not fieldpaths:
            new = dict(labels)
        for path in fieldpaths:
            if path.startswith("labels."):
                name = path[len("labels."):]
                new[name] = labels.get(name, "")
            elif path == "labels":
                new = dict(labels)
            else:
                raise InvalidArgument(f"cannot update {path!r} field on snapshot {key!r}")
        self._conn.execute(
            "UPDATE snapshots SET labels = ?, updated_ns = ? WHERE id = ?",
            (json.dumps(_clean_labels(new)), now_ns(), rec.id),
        )
        return self._by_id(rec.id)

    def record_proof(self, digest: str, diff_id: str) -> None:
        """A blob's content is a fact: the first proof stays (a second one computes the same)."""
        self._conn.execute("INSERT OR IGNORE INTO proofs (digest, diff_id, proven_ns) VALUES (?, ?, ?)",
                           (digest, diff_id, now_ns()))

    def remove(self, key: str, expect_id: int | None = None) -> Record:
        rec = self.get(key)
        if expect_id is not None and rec.id != expect_id:
            raise NotFound(f"snapshot {key!r} was replaced")
        if self.has_children(rec):
            raise FailedPrecondition(f"cannot remove snapshot {key!r}: other snapshots use it as their parent")
        self._conn.execute("DELETE FROM snapshots WHERE id = ?", (rec.id,))
        return rec

    def _by_id(self, snapshot_id: int) -> Record:
        return _record(self._conn.execute(f"{_SELECT} WHERE s.id = ?", (snapshot_id,)).fetchone())


def read_remote_records(path: Path | str) -> list[Record]:
    """The remote snapshots in a node's metadata file, read-only from another process
    (`shoal status`); [] when there is no file."""
    if not os.path.exists(path):
        return []
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            rows = conn.execute(f"{_SELECT} WHERE s.layer_path IS NOT NULL ORDER BY s.id").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        raise ShoalError(f"{path}: cannot read the snapshot metadata: {e}") from None
    return [_record(row) for row in rows]


class MetaStore:
    """The SQLite file (WAL, synchronous=FULL) and its transactions."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._conn = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False, timeout=30)
            self._conn.execute("PRAGMA journal_mode=WAL")
            private_database(self.path)  # the node's snapshots and their labels: root's alone
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            version = self._conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise ShoalError(
                    f"{self.path}: metadata schema version {version} is newer than this shoal ({SCHEMA_VERSION})"
                )
            self._conn.executescript(_SCHEMA)
            self._conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        except sqlite3.DatabaseError as e:
            raise ShoalError(f"{self.path}: cannot open the snapshot metadata: {e}") from None
        self._closed = False

    def _failure(self, e: sqlite3.Error) -> ShoalError:
        """What a user reads when the database cannot do its work: one line (a full
        disk names the file system to free space on)."""
        if getattr(e, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL or "disk is full" in str(e):
            return ShoalError(f"node metadata database: disk full at {self.path.parent} ({self.path.name}: {e}); "
                              "free space on that file system")
        return ShoalError(f"node metadata database {self.path}: {e}")

    def _rollback(self) -> None:
        if self._conn.in_transaction:
            with suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")

    @contextmanager
    def read(self) -> Iterator[Tx]:
        with self._lock:
            self._check_open()
            try:
                self._conn.execute("BEGIN")
                yield Tx(self._conn)
            except sqlite3.Error as e:
                raise self._failure(e) from None
            finally:
                self._rollback()

    @contextmanager
    def write(self) -> Iterator[Tx]:
        """A write transaction: committed when the block ends, rolled back if it raises.
        Work done inside the block (a directory rename) is part of the transaction's
        critical section: no other transaction runs meanwhile."""
        with self._lock:
            self._check_open()
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                yield Tx(self._conn)
                self._conn.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                raise self._failure(e) from None
            except BaseException:
                self._rollback()
                raise

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition("the snapshotter is closed")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._conn.close()
