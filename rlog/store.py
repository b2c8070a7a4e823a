"""The node's SQLite database (apsw): user tables, the catalog, each shard's rlog and position.

Everything a node knows lives in one WAL-mode database file so that applying an entry's
ops, appending the entry and recording the shard's new applied tx key and digest happen in
one SQLite transaction (DESIGN invariant 4: a crash never leaves data and position
disagreeing). This module is a thin adapter: it executes what the protocol decided and
checks its own preconditions (an entry must follow the applied key) with exceptions.

Internal tables all start with ``_mnesite``:

* ``_mnesite_meta(name, value)``: database format version (``rlog.versions``: 1 is release 0.1.0's;
  a cluster version entry moves it), each shard's cluster version, the cluster id (``claim_cluster_id``)
  and node facts.
* ``_mnesite_tables(name, shard, key_column, columns)``: the catalog, written only by
  applying ``CreateTableOp`` (and ``AddColumnOp``) so that it replicates like data.
* ``_mnesite_indexes(name, table_name, columns, physical)``: the secondary indexes of the catalog's
  tables, written only by applying ``CreateIndexOp`` and ``DropIndexOp``; ``physical`` is the SQLite
  index that holds it now, NULL while it is being built (see "Online index builds").
* ``_mnesite_index_builds(table_name, after, copied, physical)``: a table being copied into
  ``_mnesite_build_TABLE`` to build indexes online.
* ``_mnesite_dropped_tables(shard, name, key_column, generation, counter)``: each table a log entry
  dropped, its key column and the drop's tx key, kept while the log holds entries before the drop.
  The changefeed's key of a write in an older entry is its own table's key column, and the catalog
  holds only the table of that name made last (``key_column_at``). Written where applied entries
  are (``_record_drops``), trimmed with the log and deleted with it by a snapshot install
  (``restart_log_at``) or a bootstrap (``reset_shard``); a drop applied by a release before 0.2.0 has none.

Online index builds
-------------------
SQLite builds an index in one statement that holds the write lock for as long as it sorts the table
(2.4 s for 1,000,000 rows here): applied inside a node's turn, that would stall its writes, reads and
heartbeats. So an index on a table larger than ``index_build_step_rows_max`` rows is built on a copy:
applying ``CreateIndexOp`` records the index (the catalog has it at once, on every node alike), makes an
empty shadow table ``_mnesite_build_TABLE`` with every wanted index, and each later turn copies the next
``index_build_step_rows_max`` rows in key order into it (``index_build_step``). Meanwhile every write and
delete applied to the table is applied to the shadow too, so rows already copied stay current and rows
not yet copied are copied as they are then. When the copy reaches the end, the table is dropped and the
shadow renamed to it, in one transaction: the swap costs the drop of the old table, not a sort. The
shadow's copies of the table's existing indexes have the other of two physical names (``NAME`` and
``_mnesite_b_NAME``), since SQLite's index names are one namespace. Progress is persisted with each
step, so a restart resumes; a drop of the table ends the build; another index change restarts it.
The build is a node's own affair: the log holds the op, and each node builds at its own pace, with the
same rows and the same schema in the end.
* ``_mnesite_shards(shard, generation, applied_*, applied_digest, voted_for, members, forced,
  trimmed_*, excluded_generation)``: per-shard position, the consensus state that must survive a crash
  (generation and vote, persisted before they are used; the forced generation that left this core out
  of the shard, NULL if none did) and the last entry retention removed (its digest is what an append
  that follows it is checked against). ``excluded_generation`` came after release 0.1.0: opening an
  older store adds it (``_ADDED_COLUMNS``).
* ``_mnesite_rlog(shard, generation, counter, prev_*, digest, request_id, ops, appended_ms)``.
* ``_mnesite_spill(shard, generation, counter, entry)``: on a bootstrapping replicant, the entries
  pushed while the tables are copied, replayed once the copy is done.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import functools
import itertools
import json
import operator
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import apsw
import msgpack
import msgspec
from mnesite.rlog.checkpoint import WalCheckpointer
from mnesite.rlog.disk import PROBE_BYTES, StorageFailedError, StorageFault
from mnesite.rlog.replication import UNKNOWN_DIGEST
from mnesite.rlog.retention import retention_floor
from mnesite.rlog.schema import (
    IndexSchema,
    NameHeld,
    SchemaError,
    TableSchema,
    check_column_addable,
    check_creatable,
    check_droppable,
    check_index_creatable,
    check_index_droppable,
    holder_elsewhere,
    lifetime_end,
    may_end_lifetime,
    name_held_elsewhere,
)
from mnesite.rlog.types import (
    GENESIS_DIGEST,
    ROW_OPS,
    ZERO_KEY,
    AddColumnOp,
    ClusterVersionOp,
    CreateIndexOp,
    CreateTableOp,
    DeleteOp,
    DropIndexOp,
    DropTableOp,
    Entry,
    MembersOp,
    Op,
    PackedEntry,
    TxKey,
    WriteOp,
    WriteRows,
    chain_break,
    entry_from_wire,
    unpack_ops,
)
from mnesite.rlog.versions import STORAGE_FORMATS_READ, storage_format_of, storage_refusal
from mnesite.rlog.wal_reserve import WalReserve, frames_end

# The format a new database starts with: release 0.1.0's, so that a node of this release can be
# rolled back until its cluster version moves (which moves the format: ``_record_cluster_version``).
FORMAT_VERSION = 1
CLUSTER_VERSION_META = "cluster_version:"
CLUSTER_ID_META = "cluster_id"  # the cluster the directory belongs to (claim_cluster_id)
# Errors of the file system that mean "no space" (a quota counts as no space): nothing was written.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
# Errors of the file system that leave what is on disk unknown (EROFS: as SQLite's SQLITE_READONLY,
# the file system was remounted read-only under the node, typically after an I/O error of its own).
_FAILED_ERRNOS = frozenset({errno.EIO, errno.EROFS})
BUILD_PREFIX = "_mnesite_build_"
PHYSICAL_PREFIX = "_mnesite_b_"
INDEX_BUILD_STEP_ROWS_MAX = 1000
# Retention counts the newest generations' entries from their first and last keys, and walks the
# entries of older ones (a log of that many generations has had that many elections in its window).
RETENTION_GENERATIONS_COUNTED = 64
SPILL_REPLAY_ENTRIES_MAX = 1000  # spilled entries a bootstrap's replay decodes at a time (``replay_spill``)
VERIFY_BATCH_ENTRIES = 1000  # rlog entries ``verify_chain`` reads and chains at a time
PAGE_CACHE_BYTES_MAX = 16 * 1024 * 1024  # the writing connection's SQLite page cache
SYNCHRONOUS_LEVELS = ("OFF", "NORMAL", "FULL", "EXTRA")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS _mnesite_meta(name TEXT PRIMARY KEY, value ANY) STRICT;
CREATE TABLE IF NOT EXISTS _mnesite_tables(
    name TEXT PRIMARY KEY, shard TEXT NOT NULL, key_column TEXT NOT NULL, columns TEXT NOT NULL
) STRICT;
CREATE TABLE IF NOT EXISTS _mnesite_shards(
    shard TEXT PRIMARY KEY,
    generation INTEGER NOT NULL,
    applied_generation INTEGER NOT NULL,
    applied_counter INTEGER NOT NULL,
    applied_digest BLOB NOT NULL,
    voted_for TEXT,
    members TEXT NOT NULL DEFAULT '[]',
    forced INTEGER NOT NULL DEFAULT 0,
    trimmed_generation INTEGER NOT NULL DEFAULT 0,
    trimmed_counter INTEGER NOT NULL DEFAULT 0,
    trimmed_digest BLOB NOT NULL DEFAULT x'0000000000000000000000000000000000000000000000000000000000000000',
    excluded_generation INTEGER
) STRICT;
CREATE TABLE IF NOT EXISTS _mnesite_rlog(
    shard TEXT NOT NULL,
    generation INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    prev_generation INTEGER NOT NULL,
    prev_counter INTEGER NOT NULL,
    digest BLOB NOT NULL,
    request_id TEXT,
    ops BLOB NOT NULL,
    appended_ms INTEGER NOT NULL,
    PRIMARY KEY (shard, generation, counter)
) STRICT, WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS _mnesite_spill(
    shard TEXT NOT NULL,
    generation INTEGER NOT NULL,
    counter INTEGER NOT NULL,
    entry BLOB NOT NULL,
    PRIMARY KEY (shard, generation, counter)
) STRICT, WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS _mnesite_indexes(
    name TEXT PRIMARY KEY, table_name TEXT NOT NULL, columns TEXT NOT NULL, physical TEXT
) STRICT;
CREATE TABLE IF NOT EXISTS _mnesite_index_builds(
    table_name TEXT PRIMARY KEY, after ANY, copied INTEGER NOT NULL, physical TEXT NOT NULL
) STRICT;
CREATE TABLE IF NOT EXISTS _mnesite_dropped_tables(
    shard TEXT NOT NULL, name TEXT NOT NULL, key_column TEXT NOT NULL,
    generation INTEGER NOT NULL, counter INTEGER NOT NULL,
    PRIMARY KEY (shard, name, generation, counter)
) STRICT, WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS _mnesite_rlog_request ON _mnesite_rlog(request_id) WHERE request_id IS NOT NULL;
"""

# Columns added to an internal table since release 0.1.0, (table, column, definition): ``CREATE TABLE IF
# NOT EXISTS`` leaves an older store's table as it was, so opening it adds them. Each is NULL or has a
# default in an older row, and release 0.1.0 names every column it reads and writes, so it still opens
# the store after a roll back (it ignores them): the storage format does not move for them.
_ADDED_COLUMNS = (("_mnesite_shards", "excluded_generation", "INTEGER"),)


RLOG_INSERT = "INSERT INTO _mnesite_rlog VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"


def rlog_row(entry: Entry, appended_ms: int) -> tuple[Any, ...]:
    """One ``_mnesite_rlog`` row: the one place its column order is written."""
    return (
        entry.shard,
        entry.tx_key.generation,
        entry.tx_key.counter,
        entry.prev.generation,
        entry.prev.counter,
        entry.digest,
        entry.request_id,
        entry.packed,
        appended_ms,
    )


def free_bytes(directory: str) -> int | None:
    """Bytes this process may still write on ``directory``'s file system (root may use the blocks
    reserved for it, others not); None when the file system does not say."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    return (stat.f_bfree if os.geteuid() == 0 else stat.f_bavail) * stat.f_frsize


def fsync_directory(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_FAILED_SQLITE_ERRORS = (apsw.CorruptError, apsw.NotADBError, apsw.ReadOnlyError)


def storage_fault(error: BaseException, system_errno: int = 0) -> StorageFault | None:
    """What a write's exception says about the disk (``rlog.disk``): FULL, FAILED or None (not the disk).

    ``system_errno``: the OS error of the connection that raised ``error`` (``Store.fault`` passes
    ``sqlite3_system_errno``), which an ``apsw.IOError`` does not carry itself. SQLite reports only
    ``ENOSPC`` from a write as ``SQLITE_FULL``: a write refused for a quota (``EDQUOT``) is
    ``SQLITE_IOERR_WRITE``, and without its errno a node on a file system with quotas stopped as
    for a failed disk (exit status 4) where the documented answer is the full-disk state."""
    if isinstance(error, StorageFailedError):
        return StorageFault.FAILED
    if isinstance(error, apsw.FullError):
        return StorageFault.FULL
    if isinstance(error, apsw.IOError):
        extended = getattr(error, "extendedresult", None)
        # SQLite cannot grow the -shm file when the disk is full (a 32 KiB region per 4,096 WAL
        # frames): that is a full disk too.
        if extended == apsw.SQLITE_IOERR_SHMSIZE:
            return StorageFault.FULL
        # A write (or SQLite's preallocation, also SQLITE_IOERR_WRITE) refused for want of space or
        # quota wrote nothing durable. Only a write's: a sync that fails, whatever its errno, may
        # have lost pages the kernel dropped (``rlog.disk``).
        if extended == apsw.SQLITE_IOERR_WRITE and system_errno in _FULL_ERRNOS:
            return StorageFault.FULL
        # Every other I/O error (a failed fsync, write or read) leaves the disk's contents unknown.
        return StorageFault.FAILED
    if isinstance(error, _FAILED_SQLITE_ERRORS):
        # The database is not what this node wrote (a malformed image; a header that no longer says
        # SQLite), or the file system went read-only under it: no write can be made durable, and
        # the node's statements are its own, not an entry's. (At the open, ``Store`` says "not a
        # mnesite database" for NotADBError first: a file at the wrong path is no failed disk.)
        return StorageFault.FAILED
    if isinstance(error, OSError) and error.errno is not None:
        if error.errno in _FULL_ERRNOS:
            return StorageFault.FULL
        if error.errno in _FAILED_ERRNOS:
            return StorageFault.FAILED
    return None


def read_fault(error: BaseException) -> StorageFault | None:
    """What a query's read (on its own read-only connection, ``rlog.query``) says about the disk:
    FAILED as for a write (``storage_fault``: a malformed image, a file that is no longer SQLite's, an
    I/O error), so that the node stops instead of serving from a damaged database; None otherwise. A
    full disk is no read's fault (a query's sort spilling to a temporary file failed for want of space:
    the query's error), nor is a read-only error (the query's connection is read-only by design)."""
    if isinstance(error, apsw.ReadOnlyError):
        return None
    fault = storage_fault(error)
    return fault if fault is StorageFault.FAILED else None


def _apply_failure(entry: Entry, error: BaseException) -> BaseException:
    """What to raise when applying ``entry`` failed: the disk's own error as it is (a full disk is
    not the entry's fault, ``rlog.disk``), anything else as the entry's ``EntryApplyError``."""
    if storage_fault(error) is not None:
        return error
    return EntryApplyError(entry, error)


def _open_refusal(path: str, error: apsw.Error) -> str:
    """Why the database at ``path`` did not open: what the disk did (``storage_fault``, so that nobody
    "repairs" a database for a full disk), or, for a file that is no SQLite database or a database
    that is not a store, "not a mnesite database" (a data directory's path or contents to check)."""
    if isinstance(error, apsw.NotADBError):
        return f"{path}: not a mnesite database ({error})"
    fault = storage_fault(error)
    if fault is StorageFault.FULL:
        return f"{path}: cannot open: the disk is full ({error}); free space"
    if isinstance(error, apsw.CorruptError):
        return f"{path}: cannot open: the database is damaged ({error}); check the disk, then restore it from a backup"
    if isinstance(error, apsw.ReadOnlyError):
        return (
            f"{path}: cannot open: the database cannot be written ({error}); check the file's permissions "
            "and that its file system is mounted read-write"
        )
    if fault is StorageFault.FAILED:
        return f"{path}: cannot open: the disk failed ({error}); check the disk"
    return f"{path}: not a mnesite database ({error})"


class StoreError(RuntimeError):
    """The database is not a mnesite database, or a store precondition was violated."""


class EntryApplyError(StoreError):
    """A committed entry cannot be applied here. The node must stop: its state machines believe it applied.

    The message names the shard, the entry's tx key and request id, and why, so that an operator can
    find the entry (``mnesite rlog tail``) and the node never crash-loops with a bare traceback.
    """

    def __init__(self, entry: Entry, error: BaseException) -> None:
        super().__init__(
            f"shard {entry.shard}: committed entry {entry.tx_key} (request {entry.request_id!r}) cannot be applied "
            f"on this node: {type(error).__name__}: {str(error)[:300]}"
        )
        self.entry = entry


# How far a shard whose apply waits at a name (``_before_name_wait``) reads on from the waiting entry in
# its log, looking for the end of that name's lifetime in the shard (``rlog.schema.lifetime_end``): as many
# entries as the core keeps of an unapplied tail by default (``core.guard_tail``). A lifetime longer than
# that is not skipped: the shard waits (``status`` shows ``name_wait``), however long the log grows.
LOOK_AHEAD_ENTRIES_MAX = 10_000
READ_BATCH_ENTRIES = 1000  # entries ``apply_committed`` reads back from the log at a time
LOOK_AHEAD_BYTES_MAX = 64 * 1024 * 1024


@dataclass(frozen=True)
class NameWait:
    """A shard's apply waits at a committed entry whose new name another shard holds here
    (``rlog.schema.name_held_elsewhere``): the entries before it are applied, it and the later ones
    stay committed but unapplied until an apply of another shard lets the name go."""

    shard: str
    tx_key: TxKey  # the waiting entry's
    request_id: str | None
    held: NameHeld
    changes_elsewhere: int  # the other shards' schema changes applied when it was found: retried once they move
    looked_to: TxKey  # the last committed entry looked at for the end of the name's lifetime (``name_wait_may_end``)
    # A name created later inside the lifetime of ``held``'s while another shard holds it, whose own
    # lifetime is not closed yet (``rlog.schema.lifetime_end``): tried again once either is let go.
    unclosed: NameHeld | None = None
    # The look-ahead stopped at its bound (``LOOK_AHEAD_ENTRIES_MAX``) before the lifetime's end: later
    # commits cannot end this wait (``name_wait_may_end``), only another shard letting the name go.
    look_ahead_cut: bool = False

    def describe(self) -> str:
        held = self.held
        holder = f"table {held.holder!r}" if held.index is None else f"index {held.index!r} of {held.holder!r}"
        why = (
            f"its drop in shard {self.shard} lies more than {LOOK_AHEAD_ENTRIES_MAX} entries on, beyond what "
            "a node reads ahead: drop the name in the other shard, or rebuild this node from a backup"
            if self.look_ahead_cut
            else f"a create of the same name in both shards at about the same time: drop it in shard "
            f"{held.holder_shard}, or in shard {self.shard}"
        )
        return (
            f"shard {self.shard}: committed entry {self.tx_key} (request {self.request_id!r}) creates "
            f"{held.name!r}, held here by {holder} of shard {held.holder_shard}: applying waits until "
            f"shard {held.holder_shard} drops it, or shard {self.shard}'s own drop of it commits (the "
            f"entries between are then applied without it) ({why})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "tx_key": list(self.tx_key),
            "request_id": self.request_id,
            "name": self.held.name,
            "held_by": self.held.holder if self.held.index is None else self.held.index,
            "held_by_shard": self.held.holder_shard,
            "remedy": f"none if shard {self.held.holder_shard} dropped {self.held.name!r} (its drop applies, then "
            f"this entry) or shard {self.shard} drops it (once that drop commits, within "
            f"{LOOK_AHEAD_ENTRIES_MAX} entries of this one); if both shards created it, drop it in shard "
            f"{self.held.holder_shard} or in shard {self.shard}",
            "look_ahead_cut": self.look_ahead_cut,
        }


@dataclass(frozen=True)
class ShardPosition:
    shard: str
    generation: int
    applied: TxKey
    digest: bytes


def quote(name: str) -> str:
    """Quote an identifier; names are validated by ``rlog.schema`` before they get here."""
    return '"' + name.replace('"', '""') + '"'


class Store:
    def __init__(
        self,
        path: str,
        synchronous: str = "FULL",
        create: bool = True,
        readonly: bool = False,
        formats_read: tuple[int, ...] = STORAGE_FORMATS_READ,
        file_mode: int | None = None,
    ) -> None:
        """``formats_read``: the storage formats this release opens (a test passes fewer to play an
        older release); anything else is refused with one clear error (``rlog.versions``).
        ``file_mode``: the mode the database file and its -wal and -shm files are given once the file
        is known to be a store (or empty), before the WAL is switched on; a file refused as another
        application's keeps its own (``rlog.data_dir``)."""
        if synchronous.upper() not in SYNCHRONOUS_LEVELS:
            raise StoreError(f"synchronous must be one of {', '.join(SYNCHRONOUS_LEVELS)}")
        if not create and not os.path.exists(path):
            raise StoreError(f"{path}: no such database")
        self._wal_synced_here = False  # until the connection is set up (``commit``)
        self.wal_reserve: WalReserve | None = None  # at synchronous=FULL, once set up
        self._wal_fd: int | None = None
        self._wal_directory_synced = False  # the directory, once the WAL is synced here (``commit``)
        self.checkpointer: WalCheckpointer | None = None
        if readonly:
            # Offline checks (rlog verify of a data directory or a backup file): leave it exactly as
            # it is (no WAL switch, no schema, no checkpointer, no checkpoint at the close).
            flags, create = apsw.SQLITE_OPEN_READONLY, False
        else:
            flags = apsw.SQLITE_OPEN_READWRITE | (apsw.SQLITE_OPEN_CREATE if create else 0)
        try:
            self.connection = apsw.Connection(path, flags=flags)
            self.connection.set_busy_timeout(5000)
            if create:
                foreign = self._foreign_tables()
                if foreign:
                    self.connection.close()
                    raise StoreError(
                        f"{path}: not a mnesite database: it holds another application's tables "
                        f"({', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); it was left as it is. "
                        "Give the node a data directory of its own"
                    )
                if file_mode is not None:
                    # A -wal or -shm the read above created has the file's old mode for this moment,
                    # and so did the file's contents: nothing is written before they are narrowed.
                    for suffix in ("", "-wal", "-shm"):
                        if os.path.exists(path + suffix):
                            self._narrow(path + suffix, file_mode)
            if not readonly:
                self.connection.execute("PRAGMA journal_mode=WAL")
                self.connection.execute(f"PRAGMA synchronous={synchronous.upper()}")
            if create:
                with self.write_transaction():
                    self.connection.execute(_SCHEMA)
                    self._add_columns()
                    self.connection.execute(
                        "INSERT OR IGNORE INTO _mnesite_meta(name, value) VALUES ('format_version', ?)",
                        (FORMAT_VERSION,),
                    )
            version = self._format_version()
        except apsw.Error as error:
            refusal = _open_refusal(path, error)
            raise StoreError(refusal) from None
        refusal = storage_refusal(version, path, formats_read)
        if refusal is not None:
            raise StoreError(refusal)
        self.path = path
        self.synchronous = synchronous.upper()
        # FULL: commit at NORMAL and sync the WAL file here when durable (see ``commit``).
        self._wal_synced_here = self.synchronous == "FULL" and not readonly
        if self._wal_synced_here:
            self.connection.execute("PRAGMA synchronous=NORMAL")
            # The descriptor ``commit`` syncs the WAL on, open before any commit: Linux reports a
            # writeback error once to each descriptor open on the file, never to one opened after
            # another's fsync saw it (the reservation thread's, a first commit's own durable=False
            # frames among the pages it dropped); opened later, a durable commit's sync could succeed
            # over a hole in the WAL.
            try:
                self._wal_fd = os.open(path + "-wal", os.O_RDONLY | os.O_CLOEXEC)
            except OSError as error:
                self.connection.close()
                raise StoreError(f"{path}-wal: cannot open: {error.strerror or error}") from None
        if not readonly:
            # WAL checkpoints run in a background thread, not inside a commit (rlog.checkpoint).
            self.checkpointer = WalCheckpointer(
                path, self.connection.execute("PRAGMA synchronous").fetchone()[0], fault_of=storage_fault
            )
            self.connection.execute("PRAGMA wal_autocheckpoint=0")
            # Sub-journals (a statement or savepoint inside the turn's transaction keeps copies of
            # the pages it changes, to undo them) spill to a temporary file past 64 KiB: when the
            # apply ran in a savepoint, about one apply in five opened, wrote and closed one at 64
            # clients (benchmarks/PROFILE.md). In memory they hold at most the pages of one turn's
            # transaction; no durable file changes (the WAL and its fsyncs are as before), and this
            # connection's other temporary structures are small (an index created at once is made
            # only on a table of at most ``index_build_step_rows_max`` rows; queries run on
            # connections of their own, rlog.query).
            self.connection.execute("PRAGMA temp_store=MEMORY")
            # SQLite's default page cache (2 MiB) is smaller than what a core's commits touch (the
            # log's request-id index takes a random page per entry): a follower at 64 clients read
            # 0.78 pages per write back from the OS, 0.23 with this bound (benchmarks/PROFILE.md).
            self.connection.execute(f"PRAGMA cache_size=-{PAGE_CACHE_BYTES_MAX // 1024}")
            self.connection.set_wal_hook(self._on_wal)
        # The WAL's space reserved ahead of its frames, so that a durable commit's fsync need not grow
        # the file (rlog.wal_reserve): up to about where the background checkpoint starts it over.
        if self._wal_synced_here:
            page_size = self.connection.execute("PRAGMA page_size").fetchone()[0]
            pages = self.checkpointer.pages_background + self.checkpointer.pages_background // 4
            self.wal_reserve = WalReserve(path + "-wal", page_size, frames_end(pages, page_size))
        self._catalog: dict[str, TableSchema] | None = None
        # Tables dropped by the ops of the entries being applied, (the op, table, its key column), until
        # ``_record_drops`` finds each one's entry (batched applies flatten the ops of many entries).
        # The op itself, not its id: a freed op's id is the next one's made at its address. Emptied
        # when an apply of entries begins: drops applied outside any entry (a copy's schema ops) are
        # no position of the log and must not be taken for the next entry's.
        self._drops_pending: list[tuple[DropTableOp, str, str]] = []
        # Shards whose apply waits at an entry creating a name another shard holds (``NameWait``):
        # in memory only, since a restart meets the same entry again. ``catalog_changes`` counts the
        # schema changes applied, in all and per shard, so that a waiting shard's name is looked up
        # again only once another shard's changed the catalog (its own change no other shard's name),
        # and the shard retried only once that name is let go (``name_wait_due``).
        self.name_waits: dict[str, NameWait] = {}
        self.catalog_changes = 0
        self._catalog_changes_of: dict[str, int] = {}
        # The newest log entry's (key, digest) per shard, as this connection last wrote or read it: a
        # sequencer appends every proposal on its own, and the SELECT that found the log's end cost
        # more than the INSERT. Kept by ``append_entries``/``log_and_apply_verified``; forgotten by
        # every other change of the log and by any rollback (see ``_forget_log_ends``).
        self._log_ends: dict[str, tuple[TxKey, bytes]] = {}
        # Rows an index build copies per step, and the tables being built (table -> shadow).
        self.index_build_step_rows_max = INDEX_BUILD_STEP_ROWS_MAX
        self._builds: dict[str, str] | None = None

    def _add_columns(self) -> None:
        """Add the columns of ``_ADDED_COLUMNS`` that an older store's tables lack (inside the opening
        transaction: a crash leaves the store as it was, opened again the same way)."""
        for table, column, definition in _ADDED_COLUMNS:
            present = {row[1] for row in self.connection.execute(f"PRAGMA table_info({quote(table)})")}
            if column not in present:
                self.connection.execute(f"ALTER TABLE {quote(table)} ADD COLUMN {quote(column)} {definition}")

    def _narrow(self, path: str, file_mode: int) -> None:
        """Give ``path`` (the database, its -wal or -shm) ``file_mode``; a file that refuses it (``EPERM``:
        another user owns it) closes the connection and says which file, and what to do."""
        try:
            os.chmod(path, file_mode)
        except OSError as error:
            self.connection.close()
            raise StoreError(
                f"{path}: cannot narrow its mode to {oct(file_mode)}: {error.strerror or error}; "
                "give it to the user that runs the node (chown), or run the node as its owner"
            ) from None

    def _foreign_tables(self) -> list[str]:
        """The tables of a database that is not empty and not a mnesite store (its ``_mnesite_meta``
        missing), read before anything is written: creating a store there would write mnesite's
        schema into a file of someone else's (a user's own database at the data directory's path).
        An empty file, or a store whose creation was cut short before its schema, holds none."""
        names = [row[0] for row in self.connection.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")]
        return [] if not names or "_mnesite_meta" in names else sorted(names)

    def _format_version(self) -> Any:
        try:
            row = self.connection.execute("SELECT value FROM _mnesite_meta WHERE name = 'format_version'").fetchone()
        except apsw.SQLError:
            return None
        return row[0] if row else None

    def _on_wal(self, _connection: apsw.Connection, _name: str, pages: int) -> int:
        if self.checkpointer is not None:
            self.checkpointer.on_wal(pages)
        if self.wal_reserve is not None:
            self.wal_reserve.on_wal(pages)
        return apsw.SQLITE_OK

    def fault(self, error: BaseException) -> StorageFault | None:
        """``storage_fault`` of an error this store's connection raised, with the OS error SQLite kept
        for it (an ``apsw.IOError`` does not say whether its write failed for a quota or the disk)."""
        return storage_fault(error, self.connection.system_errno)

    def disk_failed(self) -> None:
        """The disk failed a write or a sync (``rlog.disk``): write nothing more, not even the
        checkpoint SQLite runs when the last connection closes; a restart recovers from the WAL."""
        self.connection.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)
        if self.checkpointer is not None:
            self.checkpointer.stop()
        if self.wal_reserve is not None:
            self.wal_reserve.stop()

    def close(self) -> None:
        if self.wal_reserve is not None:
            self.wal_reserve.stop()  # before SQLite may delete the file, at the connection's close
        if self.checkpointer is not None:
            self.checkpointer.stop()
            if self.checkpointer.fatal is not None:
                # A background checkpoint's sync failed (the node may stop before a turn reads it):
                # no second checkpoint at the close, which could succeed over pages the kernel dropped.
                self.connection.config(apsw.SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, 1)
        if self._wal_fd is not None:
            os.close(self._wal_fd)
            self._wal_fd = None
        self.connection.close()

    # -- transactions -------------------------------------------------------------------------

    @contextlib.contextmanager
    def write_transaction(self) -> Iterator[None]:
        """One SQLite write transaction: one commit, one fsync (at ``synchronous=FULL``)."""
        self.connection.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            # SQLite may have rolled back already (after SQLITE_FULL, for one): a ROLLBACK would then
            # fail and hide the error that matters.
            self.rollback()
            raise
        try:
            self.commit(durable=True)
        except BaseException:
            self.rollback()  # a COMMIT that failed (a full disk) leaves the transaction open
            raise

    def commit(self, durable: bool = True) -> None:
        """COMMIT the open transaction; ``durable=False`` skips its fsync.

        At ``synchronous=FULL`` the connection runs at NORMAL (WAL: a commit writes its frames but does
        not sync them; checkpoints still sync) and a durable commit syncs the WAL file itself, which is
        what FULL does at each commit. The level cannot change inside a transaction, and a driver only
        knows at the end of its turn whether the turn wrote something that must be durable. For a
        transaction whose loss a restart repairs (applying entries already durable in the log): the WAL
        is append-only, so a later durable commit makes it durable too, and a power loss can only drop
        a suffix of such commits, never reorder them.
        """
        try:
            self.connection.execute("COMMIT")
        except BaseException as error:
            self._forget_log_ends()  # SQLite may have rolled the transaction back
            if self.fault(error) is StorageFault.FAILED:
                self.disk_failed()  # a sync of SQLite's own (synchronous=EXTRA) failed: see below
            raise
        try:
            if durable and self._wal_synced_here:
                self._sync_wal()
            if self.checkpointer is not None and self.checkpointer.inline_due:
                self.checkpointer.checkpoint_inline(self.connection)
        except StorageFailedError:
            # The store marks its own disk failed, not only the node's loop (``NodeServer.turn``): a
            # caller that closes it after this error (a core whose start failed, a restore) would
            # otherwise have SQLite checkpoint at the close, copying pages whose sync failed into
            # the database file and starting the WAL over (``rlog.disk``: never a second sync).
            self.disk_failed()
            raise

    def _sync_wal(self) -> None:
        """The durable commit's sync of the WAL (and, the first time, of its directory)."""
        if self._wal_fd is None:
            self._wal_fd = os.open(self.path + "-wal", os.O_RDONLY)
        try:
            os.fdatasync(self._wal_fd)
        except OSError as error:
            # Whatever errno (EIO, or ENOSPC on file systems that allocate at writeback): the
            # kernel may have dropped the pages it could not write, so a retry proves nothing.
            raise StorageFailedError(f"fdatasync of {self.path}-wal failed: {error}") from error
        if not self._wal_directory_synced:
            # SQLite at FULL syncs the directory once after it creates the -wal file (so the file
            # itself survives a power failure, not only its contents); so does this.
            directory = os.path.dirname(os.path.abspath(self.path))
            try:
                fsync_directory(directory)
            except OSError as error:
                raise StorageFailedError(f"fsync of {directory} (holding {self.path}-wal) failed: {error}") from error
            self._wal_directory_synced = True

    def rollback(self) -> None:
        """Roll back the open transaction, if SQLite has not already (it may after SQLITE_FULL)."""
        self._catalog = None  # a rolled-back CREATE TABLE must not linger in the cache
        self._drops_pending = []  # nor a rolled-back drop
        self._builds = None  # nor a rolled-back index build (rlog.store's online builds)
        self._forget_log_ends()  # nor rolled-back appends
        if self.connection.in_transaction:
            self.connection.execute("ROLLBACK")

    def probe_space(self) -> None:
        """Write ``PROBE_BYTES`` durably and remove them: raises what a full disk raises (``rlog.disk``).

        The file system must first report ``PROBE_BYTES`` free: SQLite writes a WAL that a checkpoint
        emptied over its old frames, so a probe could succeed on a file system with no byte free, and
        the node resume only to fill again at once (seen with a replicant under load: it left NORMAL to
        resynchronise and refused reads while it did)."""
        if self.connection.in_transaction:
            raise StoreError("probe_space needs no open transaction")
        free = free_bytes(os.path.dirname(os.path.abspath(self.path)))
        if free is not None and free < PROBE_BYTES:
            message = f"{free} bytes free where {self.path} lives, fewer than a probe's {PROBE_BYTES}: still full"
            raise OSError(errno.ENOSPC, message)
        with self.write_transaction():
            self.connection.execute(
                "INSERT OR REPLACE INTO _mnesite_meta(name, value) VALUES ('disk_probe', zeroblob(?))",
                (PROBE_BYTES,),
            )
        with self.write_transaction():
            self.connection.execute("DELETE FROM _mnesite_meta WHERE name = 'disk_probe'")

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        """A nested all-or-nothing unit inside a write transaction (one client transaction)."""
        self.connection.execute("SAVEPOINT mnesite_tx")
        try:
            yield
        except BaseException:
            # SQLite may have rolled back the whole transaction, savepoint included (after SQLITE_FULL,
            # for one): undoing it then would fail and hide the error that matters.
            if self.connection.in_transaction:
                self.connection.execute("ROLLBACK TO mnesite_tx")
                self.connection.execute("RELEASE mnesite_tx")
            self._catalog = None
            self._builds = None
            self._forget_log_ends()
            raise
        self.connection.execute("RELEASE mnesite_tx")

    def _forget_log_ends(self, shard: str | None = None) -> None:
        """Drop the cached end of ``shard``'s log (of every shard's if None): the next
        ``last_entry`` reads it from SQLite."""
        if shard is None:
            self._log_ends.clear()
        else:
            self._log_ends.pop(shard, None)

    # -- catalog ------------------------------------------------------------------------------

    def catalog(self) -> dict[str, TableSchema]:
        if self._catalog is None:
            indexes: dict[str, list[IndexSchema]] = {}
            for name, table_name, columns in self.connection.execute(
                "SELECT name, table_name, columns FROM _mnesite_indexes ORDER BY name"
            ):
                indexes.setdefault(table_name, []).append(IndexSchema(name, tuple(json.loads(columns))))
            catalog = {}
            for name, shard, key_column, columns in self.connection.execute(
                "SELECT name, shard, key_column, columns FROM _mnesite_tables ORDER BY name"
            ):
                definition = tuple((c[0], c[1]) for c in json.loads(columns))
                catalog[name] = TableSchema(name, shard, key_column, definition, tuple(indexes.get(name, ())))
            self._catalog = catalog
        return self._catalog

    def key_column_at(self, shard: str, table: str, tx_key: TxKey) -> str | None:
        """The key column of ``table`` as the entry at ``tx_key`` wrote it: that of the first drop of
        the table at or after the entry (the table it wrote was that one), else the catalog's (it is
        the table there now); None if neither knows it. At, not only after: an entry may write a table
        and then drop it; one that drops a table and makes it again names the new key in its own
        ``CreateTableOp``, which a reader of the entry meets before the writes after it."""
        row = self.connection.execute(
            "SELECT key_column FROM _mnesite_dropped_tables WHERE shard = ? AND name = ? "
            "AND (generation, counter) >= (?, ?) ORDER BY generation, counter LIMIT 1",
            (shard, table, tx_key[0], tx_key[1]),
        ).fetchone()
        if row is not None:
            return row[0]
        schema = self.catalog().get(table)
        return schema.key_column if schema is not None else None

    def _record_drops(self, entries: Sequence[Entry]) -> None:
        """Record the tables the ops of ``entries`` dropped (``_drops_pending``) under their entry's key,
        in the apply's transaction. Costs nothing unless a table was dropped; a drop no entry holds
        (schema ops a copy brought, not from the log) is no position of the log and is not recorded."""
        pending, self._drops_pending = self._drops_pending, []
        if not pending:
            return
        # By id, the pending ops alive (held in ``pending``): no other op can have one of their ids.
        entry_of = {id(op): entry for entry in entries for op in entry.ops if type(op) is DropTableOp}
        rows = [
            (entry.shard, table, key_column, entry.tx_key.generation, entry.tx_key.counter)
            for op, table, key_column in pending
            if (entry := entry_of.get(id(op))) is not None
        ]
        # OR IGNORE: an entry that drops a table twice (made again between) keeps its first drop's key,
        # the table its earlier writes wrote.
        self.connection.executemany("INSERT OR IGNORE INTO _mnesite_dropped_tables VALUES (?, ?, ?, ?, ?)", rows)

    # -- shards -------------------------------------------------------------------------------

    def shards(self) -> dict[str, ShardPosition]:
        return {
            row[0]: ShardPosition(row[0], row[1], TxKey(row[2], row[3]), row[4])
            for row in self.connection.execute(
                "SELECT shard, generation, applied_generation, applied_counter, applied_digest "
                "FROM _mnesite_shards ORDER BY shard"
            )
        }

    def shard(self, shard: str) -> ShardPosition | None:
        row = self.connection.execute(
            "SELECT shard, generation, applied_generation, applied_counter, applied_digest "
            "FROM _mnesite_shards WHERE shard = ?",
            (shard,),
        ).fetchone()
        return ShardPosition(row[0], row[1], TxKey(row[2], row[3]), row[4]) if row else None

    def ensure_shard(self, shard: str, generation: int) -> ShardPosition:
        self.connection.execute(
            "INSERT OR IGNORE INTO _mnesite_shards(shard, generation, applied_generation, applied_counter, "
            "applied_digest) VALUES (?, ?, 0, 0, ?)",
            (shard, generation, GENESIS_DIGEST),
        )
        position = self.shard(shard)
        if position is None:
            raise StoreError(f"shard {shard} could not be created")
        return position

    def set_generation(self, shard: str, generation: int) -> None:
        """Persist a new generation; generations only grow (a node never restarts its clock in the past)."""
        position = self.shard(shard)
        if position is None:
            raise StoreError(f"unknown shard {shard}")
        if generation <= position.generation:
            raise StoreError(f"shard {shard}: generation {generation} does not exceed {position.generation}")
        self.connection.execute("UPDATE _mnesite_shards SET generation = ? WHERE shard = ?", (generation, shard))

    def consensus_state(self, shard: str) -> tuple[int, str | None, tuple[str, ...], bool]:
        """(generation, voted_for, members, forced) as last persisted."""
        row = self.connection.execute(
            "SELECT generation, voted_for, members, forced FROM _mnesite_shards WHERE shard = ?", (shard,)
        ).fetchone()
        if row is None:
            raise StoreError(f"unknown shard {shard}")
        return row[0], row[1], tuple(json.loads(row[2])), bool(row[3])

    def persist_consensus_state(
        self, shard: str, generation: int, voted_for: str | None, members: tuple[str, ...], forced: bool
    ) -> None:
        current = self.consensus_state(shard)[0]
        if generation < current:
            raise StoreError(f"shard {shard}: generation {generation} would go back from {current}")
        self.connection.execute(
            "UPDATE _mnesite_shards SET generation = ?, voted_for = ?, members = ?, forced = ? WHERE shard = ?",
            (generation, voted_for, json.dumps(sorted(members)), int(forced), shard),
        )

    def excluded_generation(self, shard: str) -> int | None:
        """The forced generation that left this core out of ``shard`` as last persisted (None: none did)."""
        row = self.connection.execute(
            "SELECT excluded_generation FROM _mnesite_shards WHERE shard = ?", (shard,)
        ).fetchone()
        if row is None:
            raise StoreError(f"unknown shard {shard}")
        return row[0]

    def persist_excluded_generation(self, shard: str, generation: int | None) -> None:
        """Persist (None: clear) the forced generation that left this core out of ``shard``."""
        self.connection.execute(
            "UPDATE _mnesite_shards SET excluded_generation = ? WHERE shard = ?", (generation, shard)
        )

    # -- rlog ---------------------------------------------------------------------------------

    def last_entry(self, shard: str) -> tuple[TxKey, bytes]:
        """Key and digest of the newest persisted entry (or of the last trimmed one, or genesis)."""
        cached = self._log_ends.get(shard)
        if cached is not None:
            return cached
        row = self.connection.execute(
            "SELECT generation, counter, digest FROM _mnesite_rlog WHERE shard = ? "
            "ORDER BY generation DESC, counter DESC LIMIT 1",
            (shard,),
        ).fetchone()
        end = (TxKey(row[0], row[1]), row[2]) if row is not None else self.trimmed(shard)
        self._log_ends[shard] = end
        return end

    def trimmed(self, shard: str) -> tuple[TxKey, bytes]:
        """Key and digest of the last entry removed by retention (ZERO_KEY and genesis if none)."""
        row = self.connection.execute(
            "SELECT trimmed_generation, trimmed_counter, trimmed_digest FROM _mnesite_shards WHERE shard = ?",
            (shard,),
        ).fetchone()
        if row is None:
            return ZERO_KEY, GENESIS_DIGEST
        return TxKey(row[0], row[1]), row[2]

    def count_between(self, shard: str, after: TxKey, up_to: TxKey, limit: int) -> int:
        """How many entries of ``shard`` have a tx key in (``after``, ``up_to``], counted up to ``limit``."""
        row = self.connection.execute(
            "SELECT count(*) FROM (SELECT 1 FROM _mnesite_rlog WHERE shard = ? AND (generation, counter) > (?, ?) "
            "AND (generation, counter) <= (?, ?) LIMIT ?)",
            (shard, after.generation, after.counter, up_to.generation, up_to.counter, limit),
        ).fetchone()
        return row[0]

    def digest_at(self, shard: str, key: TxKey) -> bytes | None:
        if key == ZERO_KEY:
            return GENESIS_DIGEST
        row = self.connection.execute(
            "SELECT digest FROM _mnesite_rlog WHERE shard = ? AND generation = ? AND counter = ?",
            (shard, key.generation, key.counter),
        ).fetchone()
        if row is not None:
            return row[0]
        trimmed_key, trimmed_digest = self.trimmed(shard)
        return trimmed_digest if key == trimmed_key else None

    def append_entries(
        self, entries: tuple[Entry, ...] | list[Entry], appended_ms: int, chain_verified: bool = False
    ) -> None:
        """Persist entries that must follow the newest persisted one (checked: no gaps, same chain).

        ``chain_verified``: the caller (the consensus state machine) already checked each digest
        against its predecessor, so only the links are checked here; apply checks digests again.
        """
        if not entries:
            return
        shard = entries[0].shard
        last_key, last_digest = self.last_entry(shard)
        for entry in entries:
            if entry.shard != shard or entry.prev != last_key:
                raise StoreError(
                    f"shard {entry.shard}: entry {entry.tx_key} follows {entry.prev}, log ends at {last_key}"
                )
            if not chain_verified and chain_break(last_key, last_digest, entry) is not None:
                raise StoreError(f"shard {entry.shard}: digest mismatch at {entry.tx_key}")
            last_key, last_digest = entry.tx_key, entry.digest
        # Links checked for the whole batch, then one prepared statement for all its rows.
        self._forget_log_ends(shard)
        self.connection.executemany(RLOG_INSERT, [rlog_row(entry, appended_ms) for entry in entries])
        self._log_ends[shard] = (last_key, last_digest)

    def truncate_after(self, shard: str, key: TxKey) -> int:
        """Remove the uncommitted tail after ``key``; refuses to remove an applied (committed) entry."""
        position = self.shard(shard)
        if position is None:
            raise StoreError(f"unknown shard {shard}")
        if key < position.applied:
            raise StoreError(f"shard {shard}: truncating after {key} would remove applied entry {position.applied}")
        self._forget_log_ends(shard)
        self.connection.execute(
            "DELETE FROM _mnesite_rlog WHERE shard = ? AND (generation, counter) > (?, ?)",
            (shard, key.generation, key.counter),
        )
        return self.connection.changes()

    def apply_committed(
        self, shard: str, up_to: TxKey, held: Sequence[Entry] = (), healing: bool = False
    ) -> list[Entry]:
        """Apply every persisted entry after the applied key up to ``up_to``, in order; return them.

        ``held``: the caller's copy of the log's unapplied tail, in order (the core's driver keeps
        it). When it covers the range, the entries are applied from it without being read back, and
        without recomputing their digests: they were verified when appended (the consensus machine
        checks a sequencer's chain; a sequencer made its own), so only the links are checked here.
        Otherwise they are read from the log and checked entry by entry.
        ``healing``: these entries follow a dirty copy (see ``apply_ops``).
        """
        position = self.shard(shard)
        if position is None:
            raise StoreError(f"unknown shard {shard}")
        chain = _chain_within(held, position.applied, up_to)
        if chain is not None:
            chain = self._before_name_wait(shard, chain)
            if chain:
                self._apply_chain(shard, chain, healing)
            return chain
        applied: list[Entry] = []
        after = position.applied
        unapplied: list[Entry] = []  # from a waiting entry on: read on, the end of its name's lifetime may follow
        while after < up_to:
            batch = self.entries_after(shard, after, READ_BATCH_ENTRIES, up_to=up_to)
            if not batch:
                raise StoreError(f"shard {shard}: cannot apply up to {up_to}, the log ends at {after}")
            unapplied.extend(batch)
            ready = self._before_name_wait(shard, unapplied)
            for entry in ready:
                try:
                    self.apply_entry(entry, healing)
                except (apsw.Error, StoreError) as error:
                    raise _apply_failure(entry, error) from None
                applied.append(entry)
            del unapplied[: len(ready)]
            if unapplied and (
                len(unapplied) >= LOOK_AHEAD_ENTRIES_MAX
                or sum(entry.size_bytes for entry in unapplied) >= LOOK_AHEAD_BYTES_MAX
            ):
                # Memory stays bounded: a lifetime that ends further on is not skipped, the shard waits.
                self.name_waits[shard] = replace(self.name_waits[shard], look_ahead_cut=True)
                break
            after = batch[-1].tx_key
        return applied

    def _before_name_wait(self, shard: str, entries: list[Entry]) -> list[Entry]:
        """Of ``entries`` (the next committed ones of ``shard`` to apply, in order), those to apply now:
        all of them but from the first that must wait (``rlog.schema.name_held_elsewhere``), whose wait
        is recorded in ``name_waits``. An entry whose name's lifetime in the shard ends within
        ``entries`` (``rlog.schema.lifetime_end``) waits not: it and the entries through that end are
        given as copies without the lifetime's ops (the log keeps them whole; ``packed``, which the
        digest covers, is the original's), and the skipped drops recorded as applied ones are
        (``_record_drops``), in the caller's transaction, which applies them next. Another shard's names
        do not change while this shard's entries apply, so the catalog before them decides for all;
        entries of rows only are not looked at, and the list is given as it is when none waits."""
        catalog = None
        ready: list[Entry] | None = None  # made once an entry is skipped or waits
        index = 0
        while index < len(entries):
            entry = entries[index]
            if ROW_OPS.issuperset(map(type, entry.ops)):
                if ready is not None:
                    ready.append(entry)
                index += 1
                continue
            catalog = self.catalog() if catalog is None else catalog
            held = name_held_elsewhere(catalog, shard, entry.ops)
            if held is None:
                if ready is not None:
                    ready.append(entry)
                index += 1
                continue
            ready = entries[:index] if ready is None else ready
            skip = lifetime_end(catalog, shard, entries, index)
            if isinstance(skip, NameHeld):  # a lifetime not closed yet: ``held``'s, or one opened after it
                changes = self._changes_elsewhere(shard)
                unclosed = None if skip.name.lower() == held.name.lower() else skip
                self.name_waits[shard] = NameWait(
                    shard, entry.tx_key, entry.request_id, held, changes, entries[-1].tx_key, unclosed
                )
                return ready
            span = entries[index : skip.end + 1]
            ready.extend(msgspec.structs.replace(e, ops=ops) for e, ops in zip(span, skip.ops, strict=True))
            self.connection.executemany(
                "INSERT OR IGNORE INTO _mnesite_dropped_tables VALUES (?, ?, ?, ?, ?)",
                [(shard, table, key_column, *entries[at].tx_key) for at, table, key_column in skip.dropped],
            )
            index = skip.end + 1
        if entries:
            self.name_waits.pop(shard, None)
        return entries if ready is None else ready

    def _changes_elsewhere(self, shard: str) -> int:
        return self.catalog_changes - self._catalog_changes_of.get(shard, 0)

    def _catalog_changed(self, shard: str) -> None:
        """A schema change of ``shard`` was applied: a name another shard's apply waits for may be free."""
        self.catalog_changes += 1
        self._catalog_changes_of[shard] = self._catalog_changes_of.get(shard, 0) + 1

    def name_wait_due(self, shard: str) -> bool:
        """Whether ``shard`` waits and another shard changed the catalog since so that the name its
        entry waits for is no longer held by what held it: it is tried again. A change that leaves the
        name held (another shard's writes of schema, or the name taken over by a third shard's table)
        costs no try, whose read of the shard's entries would only find the same wait: the wait is
        brought up to date here instead (what holds the name now, the changes it has seen)."""
        wait = self.name_waits.get(shard)
        if wait is None:
            return False
        changes = self._changes_elsewhere(shard)
        if wait.changes_elsewhere == changes:
            return False
        held = holder_elsewhere(self.catalog(), shard, wait.held.name)
        unclosed = None if wait.unclosed is None else holder_elsewhere(self.catalog(), shard, wait.unclosed.name)
        if held is None or (wait.unclosed is not None and unclosed is None):
            return True
        # The entry still waits at this name: a try would only record a wait again.
        self.name_waits[shard] = replace(wait, held=held, unclosed=unclosed, changes_elsewhere=changes)
        return False

    def name_waits_due(self) -> list[str]:
        """The waiting shards to try again (``name_wait_due``)."""
        return [shard for shard in self.name_waits if self.name_wait_due(shard)]

    def name_wait_may_end(self, shard: str, committed: TxKey, held: Sequence[Entry] = ()) -> bool:
        """Whether ``shard``'s apply is worth trying up to ``committed``: it does not wait, or its wait
        is due (``name_wait_due``), or entries committed since the wait looked ahead (``NameWait.looked_to``)
        may end the lifetime of its name (``rlog.schema.may_end_lifetime``: a drop). ``held``: the
        caller's copy of the unapplied tail, to look at the new entries in; else they are read from
        the log (only those: a long wait costs no read of all it waits with)."""
        wait = self.name_waits.get(shard)
        if wait is None or self.name_wait_due(shard):
            return True
        if wait.look_ahead_cut:
            return False  # its lifetime's end lies beyond what a look-ahead reads (``apply_committed``)
        after = wait.looked_to
        new = _chain_within(held, after, committed)
        while after < committed:
            batch = self.entries_after(shard, after, 1000, up_to=committed) if new is None else new
            if not batch:
                return True  # the log does not hold them: the apply says why
            if any(may_end_lifetime(entry.ops) for entry in batch):
                return True
            after, new = batch[-1].tx_key, None
        self.name_waits[shard] = replace(wait, looked_to=max(after, wait.looked_to))
        return False

    def _apply_chain(self, shard: str, chain: list[Entry], healing: bool) -> None:
        """Apply linked, verified entries and move the applied key once (one UPDATE for the batch).

        Set-based: the ops of the whole batch go through ``apply_ops_batched`` (one prepared
        ``executemany`` per run of writes, or deletes, of one table). Not inside a savepoint: SQLite
        copies each page a savepoint's statements first change, about 5% of a follower's CPU, for a
        failure that stops the node anyway (``EntryApplyError``). If the batch fails for another
        reason than the disk, the whole open transaction is rolled back (none of the turn's work is
        committed or acknowledged; the node stops) and ``_entry_at_fault`` names the entry.
        """
        self._drops_pending = []  # none of a copy's (``_record_drops``)
        try:
            self.apply_ops_batched([op for entry in chain for op in entry.ops], healing)
        except (apsw.Error, StoreError) as error:
            if storage_fault(error) is not None:
                raise  # not an entry's fault (rlog.disk); SQLite may have rolled back already
            self.rollback()
            raise self._entry_at_fault(chain, error, healing) from None
        self._record_drops(chain)
        last = chain[-1]
        self.connection.execute(
            "UPDATE _mnesite_shards SET applied_generation = ?, applied_counter = ?, applied_digest = ?, "
            "generation = max(generation, ?) WHERE shard = ?",
            (last.tx_key.generation, last.tx_key.counter, last.digest, last.tx_key.generation, shard),
        )

    def _entry_at_fault(self, chain: list[Entry], error: BaseException, healing: bool) -> BaseException:
        """After a failed batch apply (and its rollback): the ``EntryApplyError`` of the first entry of
        ``chain`` that fails applied alone, in order, in a transaction rolled back afterwards; else (the
        batch failed only together) of the batch's first entry, with the batch's error. The entries are
        applied over the last committed state, without what the failed turn did before them."""
        self.connection.execute("BEGIN")
        try:
            for entry in chain:
                try:
                    self.apply_ops(entry.ops, healing)
                except (apsw.Error, StoreError) as entry_error:
                    return _apply_failure(entry, entry_error)  # a disk's error as it is
        finally:
            self.rollback()
        return _apply_failure(chain[0], error)

    def last_entry_key(self, shard: str) -> TxKey:
        row = self.connection.execute(
            "SELECT generation, counter FROM _mnesite_rlog WHERE shard = ? "
            "ORDER BY generation DESC, counter DESC LIMIT 1",
            (shard,),
        ).fetchone()
        return TxKey(row[0], row[1]) if row else ZERO_KEY

    def append_entry(self, entry: Entry, appended_ms: int) -> None:
        self._forget_log_ends(entry.shard)
        self.connection.execute(RLOG_INSERT, rlog_row(entry, appended_ms))

    def apply_entry(self, entry: Entry, healing: bool = False) -> None:
        """Apply a committed entry's ops and move the shard's applied key, inside the caller's transaction.

        Refuses an entry that does not follow the applied key (DESIGN invariant 5: no gaps).
        """
        position = self.shard(entry.shard)
        if position is None:
            raise StoreError(f"unknown shard {entry.shard}")
        if entry.prev != position.applied:
            raise StoreError(
                f"shard {entry.shard}: entry {entry.tx_key} follows {entry.prev}, applied is {position.applied}"
            )
        if chain_break(position.applied, position.digest, entry) is not None:
            raise StoreError(f"shard {entry.shard}: digest mismatch at {entry.tx_key}")
        self._drops_pending = []  # none of a copy's (``_record_drops``)
        self.apply_ops(entry.ops, healing)
        self._record_drops((entry,))
        self.connection.execute(
            "UPDATE _mnesite_shards SET applied_generation = ?, applied_counter = ?, applied_digest = ?, "
            "generation = max(generation, ?) WHERE shard = ?",
            (entry.tx_key.generation, entry.tx_key.counter, entry.digest, entry.tx_key.generation, entry.shard),
        )

    def log_and_apply_verified(
        self, entries: tuple[Entry, ...] | list[Entry], appended_ms: int, healing: bool = False
    ) -> None:
        """Append and apply entries whose digest chain the caller already verified, set-based.

        For a replicant's ``ApplyEntries`` (``replicant.replica`` checks every digest against its
        predecessor before it emits them) and its spill replay: inside the caller's transaction,
        one prepared ``executemany`` for the log rows and one per run of consecutive writes (or
        deletes) of one table, and one update of the position at the end. The links are still
        checked here (each entry follows the one before, the first follows the applied key and the
        newest logged entry), so a gap can never be applied (invariant 5); digests are not computed
        again, which is what made applying 2-3 times the cost of checking.
        """
        if not entries:
            return
        shard = entries[0].shard
        position = self.shard(shard)
        if position is None:
            raise StoreError(f"unknown shard {shard}")
        last_key, _ = self.last_entry(shard)
        waiting = shard in self.name_waits  # its log goes on past the applied key (``_before_name_wait``)
        if entries[0].prev != last_key or (last_key != position.applied and not waiting):
            raise StoreError(
                f"shard {shard}: entry {entries[0].tx_key} follows {entries[0].prev}, "
                f"applied is {position.applied}, the log ends at {last_key}"
            )
        previous = entries[0].prev
        for entry in entries:
            if entry.shard != shard or entry.prev != previous:
                raise StoreError(f"shard {shard}: entry {entry.tx_key} of {entry.shard} does not follow {previous}")
            previous = entry.tx_key
        self._forget_log_ends(shard)
        self.connection.executemany(RLOG_INSERT, [rlog_row(entry, appended_ms) for entry in entries])
        self._log_ends[shard] = (entries[-1].tx_key, entries[-1].digest)
        if waiting:
            # Logged; applied when the wait ends (``name_waits_due``) or these entries may end the
            # lifetime of its name (``name_wait_may_end``), read back from the log.
            self._retry_wait(shard, entries, healing)
            return
        entries = self._before_name_wait(shard, list(entries))
        if not entries:
            return
        self._drops_pending = []  # none of a copy's (``_record_drops``)
        try:
            self.apply_ops_batched([op for entry in entries for op in entry.ops], healing)
        except (apsw.Error, StoreError) as error:
            if storage_fault(error) is not None:
                raise  # not an entry's fault (rlog.disk)
            # As ``_apply_chain``: the turn is rolled back and the node stops, naming the entry.
            self.rollback()
            raise self._entry_at_fault(list(entries), error, healing) from None
        self._record_drops(entries)
        last = entries[-1]
        self.connection.execute(
            "UPDATE _mnesite_shards SET applied_generation = ?, applied_counter = ?, applied_digest = ?, "
            "generation = max(generation, ?) WHERE shard = ?",
            (last.tx_key.generation, last.tx_key.counter, last.digest, last.tx_key.generation, shard),
        )

    def _retry_wait(self, shard: str, logged: Sequence[Entry], healing: bool) -> None:
        """``logged``, committed entries of a waiting ``shard`` just logged after its committed end:
        applied with what waits before them if they may end its name's lifetime (``name_wait_may_end``)."""
        if self.name_wait_may_end(shard, logged[-1].tx_key, logged):
            self.apply_committed(shard, logged[-1].tx_key, healing=healing)

    def apply_ops_batched(self, ops: list[Op], healing: bool = False) -> None:
        """``apply_ops`` with one prepared ``executemany`` per run of consecutive writes (or deletes)
        of one table; the order of the ops is kept, so a later op on a key still wins. ``healing`` as
        in ``apply_ops``: writes and deletes of a table the (later) copy no longer has are skipped."""
        run_ends = _row_op_run_ends(ops)
        index = 0
        while index < len(ops):
            op = ops[index]
            if isinstance(op, CreateTableOp):
                self._create_table(op)
                index += 1
                continue
            if isinstance(op, (DropTableOp, CreateIndexOp, DropIndexOp, AddColumnOp)):
                self._change_schema(op, healing)
                index += 1
                continue
            if isinstance(op, MembersOp):
                index += 1  # a membership entry (core.membership) changes no table
                continue
            if isinstance(op, ClusterVersionOp):
                self._record_cluster_version(op)
                index += 1
                continue
            kind, table_name = type(op), op.table
            if run_ends is not None:
                end = run_ends[bisect.bisect_right(run_ends, index)]
            else:
                end = index + 1
                while end < len(ops) and type(ops[end]) is kind and ops[end].table == table_name:
                    end += 1
            if healing and kind in (WriteOp, WriteRows, DeleteOp) and table_name not in self.catalog():
                index = end
                continue
            table = self._table(table_name)
            if kind is WriteOp:
                names = tuple(name for name, _ in table.columns)
                rows = _row_tuples(names, ops[index:end])
                for target in (table.name, self._mirror(table.name)):
                    if target is not None:
                        self.connection.executemany(_write_sql(target, names), rows)
            elif kind is WriteRows:  # entries decoded as runs (a replicant's): their tuples bound as they are
                for columns, runs in itertools.groupby(ops[index:end], _COLUMNS_OF):
                    columns, rows = _write_rows(tuple(name for name, _ in table.columns), columns, list(runs))
                    for target in (table.name, self._mirror(table.name)):
                        if target is not None:
                            self.connection.executemany(_write_sql(target, columns), rows)
            elif kind is DeleteOp:
                keys = [(delete.key,) for delete in ops[index:end]]
                for target in (table.name, self._mirror(table.name)):
                    if target is not None:
                        self.connection.executemany(_delete_sql(target, table.key_column), keys)
            else:
                raise StoreError(f"unknown op {op!r}")
            index = end

    def apply_ops(self, ops: tuple[Op, ...], healing: bool = False) -> None:
        """Apply result ops. ``healing``: the entries replayed over a dirty copy (a bootstrap's spill, a
        snapshot install's catch-up, up to its read fence). A copy made after a table was dropped lacks
        the table that earlier entries of the replay still write to; those ops are skipped, since the
        replay's own drop entry ends with no such table anyway. Outside healing such an op is an error:
        validation before proposal makes it impossible."""
        for op in ops:
            if healing and isinstance(op, (WriteOp, WriteRows, DeleteOp)) and op.table not in self.catalog():
                continue
            if isinstance(op, WriteRows):
                self.apply_ops_batched([op])
            elif isinstance(op, WriteOp):
                table = self._table(op.table)
                names = tuple(name for name, _ in table.columns)
                for target in (table.name, self._mirror(table.name)):
                    if target is not None:
                        self.connection.execute(_write_sql(target, names), tuple(op.row.get(n) for n in names))
            elif isinstance(op, DeleteOp):
                table = self._table(op.table)
                for target in (table.name, self._mirror(table.name)):
                    if target is not None:
                        self.connection.execute(_delete_sql(target, table.key_column), (op.key,))
            elif isinstance(op, CreateTableOp):
                self._create_table(op)
            elif isinstance(op, MembersOp):
                pass  # a membership entry (core.membership) changes no table; its position still advances
            elif isinstance(op, ClusterVersionOp):
                self._record_cluster_version(op)
            elif isinstance(op, (DropTableOp, CreateIndexOp, DropIndexOp, AddColumnOp)):
                self._change_schema(op, healing)
            else:
                raise StoreError(f"unknown op {op!r}")

    def _record_cluster_version(self, op: ClusterVersionOp) -> None:
        """A cluster version entry (``core.versions``): record it, and move the storage format with it.

        Inside the apply's transaction, like the position: a crash leaves either the old format and
        the entry not applied, or both moved (the migration is this one row). From then on an older
        release refuses the directory (``rlog.versions.storage_refusal``) instead of misreading it."""
        if op.cluster_version <= self.cluster_version(op.shard):
            return  # forward only (a snapshot install records the version its copy holds)
        self.set_meta(f"{CLUSTER_VERSION_META}{op.shard}", op.cluster_version)
        storage_format = storage_format_of(op.cluster_version)
        if storage_format > (self._format_version() or 0):
            self.set_meta("format_version", storage_format)

    def cluster_version(self, shard: str) -> int:
        """The cluster version the shard's applied log recorded (1, release 0.1.0's, before any entry)."""
        return int(self.meta(f"{CLUSTER_VERSION_META}{shard}", 1))

    def storage_format(self) -> int:
        return int(self._format_version())

    def _create_table(self, op: CreateTableOp) -> None:
        # The same rule the sequencer checked before proposing; a replay of the same definition heals.
        try:
            if not check_creatable(self.catalog(), op):
                return
        except SchemaError as error:
            raise StoreError(f"cannot create table {op.table!r}: {error}") from None
        self._create_sqlite_table(op.table, op.key_column, op.columns)
        self.connection.execute(
            "INSERT INTO _mnesite_tables VALUES (?, ?, ?, ?)",
            (op.table, op.shard, op.key_column, json.dumps([list(c) for c in op.columns])),
        )
        self._catalog = None
        self._catalog_changed(op.shard)

    def _create_sqlite_table(self, name: str, key_column: str, columns: Sequence[tuple[str, str]]) -> None:
        definitions = []
        for column, column_type in columns:
            suffix = " PRIMARY KEY NOT NULL" if column == key_column else ""
            definitions.append(f"{quote(column)} {column_type}{suffix}")
        self.connection.execute(f"CREATE TABLE {quote(name)} ({', '.join(definitions)}) STRICT")

    def _change_schema(
        self, op: DropTableOp | CreateIndexOp | DropIndexOp | AddColumnOp, healing: bool = False
    ) -> None:
        """Apply a schema change; the same rule (rlog.schema) the sequencer checked before proposing
        decides, and a change already made (a replay over a copy made after it) changes nothing.

        ``healing`` (a replay over a copy made later, see ``apply_ops``): a change the copy contradicts
        was superseded by a later entry of the same replay (the table was dropped, the index dropped and
        made again on other columns), which ends in the copy's state anyway: it is skipped."""
        catalog = self.catalog()
        try:
            if isinstance(op, DropTableOp):
                if check_droppable(catalog, op):
                    self._drops_pending.append((op, op.table, catalog[op.table].key_column))
                    self._end_build(op.table)
                    self.connection.execute(f"DROP TABLE {quote(op.table)}")  # its indexes go with it
                    self.connection.execute("DELETE FROM _mnesite_tables WHERE name = ?", (op.table,))
                    self.connection.execute("DELETE FROM _mnesite_indexes WHERE table_name = ?", (op.table,))
            elif isinstance(op, CreateIndexOp):
                if check_index_creatable(catalog, op):
                    self.connection.execute(
                        "INSERT INTO _mnesite_indexes VALUES (?, ?, ?, NULL)",
                        (op.index, op.table, json.dumps(op.columns)),
                    )
                    self._catalog = None
                    self._build_indexes(op.table)
            elif isinstance(op, DropIndexOp):
                if check_index_droppable(catalog, op):
                    physical = self._physical_indexes(op.table).get(op.index)
                    if physical is not None:
                        self.connection.execute(f"DROP INDEX {quote(physical)}")
                    self.connection.execute("DELETE FROM _mnesite_indexes WHERE name = ?", (op.index,))
                    self._catalog = None
                    if op.table in self.index_builds():
                        self._build_indexes(op.table)  # the shadow holds it too: start again without it
            elif check_column_addable(catalog, op):
                # Nullable, no default: SQLite changes only the schema, not the rows.
                for name in (op.table, self.index_builds().get(op.table)):
                    if name is not None:
                        self.connection.execute(
                            f"ALTER TABLE {quote(name)} ADD COLUMN {quote(op.column)} {op.column_type}"
                        )
                changed = catalog[op.table].changed_by(op)
                self.connection.execute(
                    "UPDATE _mnesite_tables SET columns = ? WHERE name = ?",
                    (json.dumps([list(c) for c in changed.columns]), op.table),
                )
        except SchemaError as error:
            if healing:
                return
            what = {DropTableOp: "drop table", CreateIndexOp: "create index", DropIndexOp: "drop index"}
            raise StoreError(f"cannot {what.get(type(op), 'add a column to')} {op.table!r}: {error}") from None
        self._catalog = None
        self._catalog_changed(op.shard)

    # -- online index builds (see the module's opening) ----------------------------------------

    def index_builds(self) -> dict[str, str]:
        """Tables being built: table -> its shadow table."""
        if self._builds is None:
            self._builds = {
                table: BUILD_PREFIX + table
                for (table,) in self.connection.execute("SELECT table_name FROM _mnesite_index_builds")
            }
        return self._builds

    def _physical_indexes(self, table: str) -> dict[str, str]:
        """The table's indexes that exist on it now: name -> SQLite index name."""
        return dict(
            self.connection.execute(
                "SELECT name, physical FROM _mnesite_indexes WHERE table_name = ? AND physical IS NOT NULL", (table,)
            )
        )

    def _build_indexes(self, table_name: str) -> None:
        """(Re)start making the table's indexes exist: at once on a small table, else on a shadow copy."""
        self._end_build(table_name)
        table = self.catalog()[table_name]
        existing = self._physical_indexes(table_name)
        missing = [index for index in table.indexes if index.name not in existing]
        if not missing:
            return
        small = self.connection.execute(
            f"SELECT 1 FROM {quote(table_name)} LIMIT 1 OFFSET ?", (self.index_build_step_rows_max,)
        ).fetchone()
        if small is None:
            for index in missing:
                self._create_sqlite_index(index.name, table_name, index.columns)
                self.connection.execute("UPDATE _mnesite_indexes SET physical = ? WHERE name = ?", (index.name,) * 2)
            return
        shadow = BUILD_PREFIX + table_name
        self._create_sqlite_table(shadow, table.key_column, table.columns)
        # Every wanted index on the shadow, under the physical name the table does not use now.
        physical = {}
        for index in table.indexes:
            current = existing.get(index.name)
            physical[index.name] = PHYSICAL_PREFIX + index.name if current == index.name else index.name
            self._create_sqlite_index(physical[index.name], shadow, index.columns)
        self.connection.execute(
            "INSERT INTO _mnesite_index_builds VALUES (?, NULL, 0, ?)", (table_name, json.dumps(physical))
        )
        self._builds = None

    def _create_sqlite_index(self, physical: str, table: str, columns: Sequence[str]) -> None:
        listed = ", ".join(quote(column) for column in columns)
        self.connection.execute(f"CREATE INDEX {quote(physical)} ON {quote(table)} ({listed})")

    def _end_build(self, table_name: str) -> None:
        if table_name in self.index_builds():
            self.connection.execute(f"DROP TABLE IF EXISTS {quote(BUILD_PREFIX + table_name)}")
            self.connection.execute("DELETE FROM _mnesite_index_builds WHERE table_name = ?", (table_name,))
            self._builds = None

    def index_build_step(self) -> list[str]:
        """Copy the next ``index_build_step_rows_max`` rows of each build (inside the caller's write
        transaction); swap the tables whose copy is complete. Returns the tables whose build finished."""
        finished = []
        for table_name, shadow in list(self.index_builds().items()):
            table = self.catalog()[table_name]
            after, copied, physical = self.connection.execute(
                "SELECT after, copied, physical FROM _mnesite_index_builds WHERE table_name = ?", (table_name,)
            ).fetchone()
            names = ", ".join(quote(name) for name, _ in table.columns)
            key = quote(table.key_column)
            bound = "" if after is None else f"WHERE {key} > ?"
            rows = self.connection.execute(
                f"INSERT OR REPLACE INTO {quote(shadow)} ({names}) SELECT {names} FROM {quote(table_name)} {bound} "
                f"ORDER BY {key} LIMIT ? RETURNING {key}",
                ((after,) if after is not None else ()) + (self.index_build_step_rows_max,),
            ).fetchall()
            if len(rows) == self.index_build_step_rows_max:
                self.connection.execute(
                    "UPDATE _mnesite_index_builds SET after = ?, copied = ? WHERE table_name = ?",
                    (max(row[0] for row in rows), copied + len(rows), table_name),
                )
                continue
            # The copy is complete (writes were mirrored all along): the shadow becomes the table.
            self.connection.execute(f"DROP TABLE {quote(table_name)}")
            self.connection.execute(f"ALTER TABLE {quote(shadow)} RENAME TO {quote(table_name)}")
            for name, index_physical in json.loads(physical).items():
                self.connection.execute(
                    "UPDATE _mnesite_indexes SET physical = ? WHERE name = ?", (index_physical, name)
                )
            self.connection.execute("DELETE FROM _mnesite_index_builds WHERE table_name = ?", (table_name,))
            self._builds = None
            finished.append(table_name)
        return finished

    def index_build_status(self) -> dict[str, dict[str, Any]]:
        """Per table being built: the rows copied so far and the indexes being built."""
        status = {}
        for table_name, copied in self.connection.execute("SELECT table_name, copied FROM _mnesite_index_builds"):
            building = [
                name
                for (name,) in self.connection.execute(
                    "SELECT name FROM _mnesite_indexes WHERE table_name = ? AND physical IS NULL", (table_name,)
                )
            ]
            status[table_name] = {"rows_copied": copied, "indexes": building}
        return status

    def tables_json(self) -> list[dict[str, Any]]:
        """The catalog as ``list_tables`` answers it; a table whose indexes are being built says so."""
        builds = self.index_build_status() if self.index_builds() else {}
        described = []
        for table in self.catalog().values():
            value = table.to_json()
            if table.name in builds:
                value["building"] = builds[table.name]
            described.append(value)
        return described

    def _mirror(self, table_name: str) -> str | None:
        """The shadow a write to ``table_name`` must also go to (a build is under way), if any."""
        builds = self.index_builds()
        return builds.get(table_name) if builds else None

    def _table(self, name: str) -> TableSchema:
        table = self.catalog().get(name)
        if table is None:
            raise StoreError(f"unknown table {name}")
        return table

    def find_request(self, request_id: str) -> tuple[str, TxKey] | None:
        row = self.connection.execute(
            "SELECT shard, generation, counter FROM _mnesite_rlog WHERE request_id = ? LIMIT 1", (request_id,)
        ).fetchone()
        return (row[0], TxKey(row[1], row[2])) if row else None

    def entries_after(self, shard: str, after: TxKey, limit: int, up_to: TxKey | None = None) -> list[Entry]:
        """At most ``limit`` entries after ``after`` (and at or before ``up_to``), in tx-key order."""
        high = up_to if up_to is not None else TxKey(2**63 - 1, 2**63 - 1)
        rows = self.connection.execute(
            "SELECT shard, generation, counter, prev_generation, prev_counter, digest, ops, request_id "
            "FROM _mnesite_rlog WHERE shard = ? AND (generation, counter) > (?, ?) AND (generation, counter) <= (?, ?) "
            "ORDER BY generation, counter LIMIT ?",
            (shard, after.generation, after.counter, high.generation, high.counter, limit),
        )
        return [_entry(row) for row in rows]

    def packed_entries_after(self, shard: str, after: TxKey, limit: int) -> list[PackedEntry]:
        """``entries_after`` without decoding the ops (what an agent pushes; see ``PackedEntry``)."""
        rows = self.connection.execute(
            "SELECT shard, generation, counter, prev_generation, prev_counter, digest, ops, request_id "
            "FROM _mnesite_rlog WHERE shard = ? AND (generation, counter) > (?, ?) "
            "ORDER BY generation, counter LIMIT ?",
            (shard, after.generation, after.counter, limit),
        )
        return [
            PackedEntry(shard_, TxKey(generation, counter), TxKey(prev_generation, prev_counter), digest, ops, rid)
            for shard_, generation, counter, prev_generation, prev_counter, digest, ops, rid in rows
        ]

    def tail(self, shard: str, count: int, up_to: TxKey | None = None) -> list[Entry]:
        """The last ``count`` entries (at or before ``up_to``), in tx-key order."""
        high = up_to if up_to is not None else TxKey(2**63 - 1, 2**63 - 1)
        rows = list(
            self.connection.execute(
                "SELECT shard, generation, counter, prev_generation, prev_counter, digest, ops, request_id "
                "FROM _mnesite_rlog WHERE shard = ? AND (generation, counter) <= (?, ?) "
                "ORDER BY generation DESC, counter DESC LIMIT ?",
                (shard, high.generation, high.counter, count),
            )
        )
        return [_entry(row) for row in reversed(rows)]

    def rlog_statistics(self, shard: str) -> dict[str, Any]:
        count, first_generation, first_counter = self.connection.execute(
            "SELECT count(*), min(generation), (SELECT counter FROM _mnesite_rlog WHERE shard = ?1 "
            "ORDER BY generation, counter LIMIT 1) FROM _mnesite_rlog WHERE shard = ?1",
            (shard,),
        ).fetchone()
        first = [first_generation, first_counter] if count else None
        return {"entries": count, "first": first}

    def trim(self, shard: str, entries_max: int, before_ms: int | None, keep_from: TxKey | None = None) -> int:
        """Delete the oldest entries beyond ``entries_max``, and those appended before ``before_ms``.

        Only applied (committed) entries are ever removed, and none at or after ``keep_from`` (what
        a follower still needs). The newest entry is always kept: it carries the digest a watcher
        resumes from. The key and digest of the last removed entry are recorded, so an append that
        follows it can still be checked. Returns how many entries were deleted.
        """
        position = self.shard(shard)
        if position is None:
            raise StoreError(f"unknown shard {shard}")
        # The rule (count, age, followers, applied, newest kept) is rlog.retention's, pure.
        newest_removed = retention_floor(
            _RetentionView(self, shard), entries_max, before_ms, position.applied, keep_from
        )
        if newest_removed is None:
            return 0
        digest = self.digest_at(shard, newest_removed)
        if digest is None:
            return 0
        self._forget_log_ends(shard)
        # All or nothing: entries deleted without the record of the last one would leave a log that
        # no longer chains from its trimmed key, and a caller may go on with its turn after a failure.
        with self.savepoint():
            self.connection.execute(
                "DELETE FROM _mnesite_rlog WHERE shard = ? AND (generation, counter) <= (?, ?)",
                (shard, newest_removed.generation, newest_removed.counter),
            )
            deleted = self.connection.changes()
            # The entries left all come after these drops: none is keyed by them (``key_column_at``).
            self.connection.execute(
                "DELETE FROM _mnesite_dropped_tables WHERE shard = ? AND (generation, counter) <= (?, ?)",
                (shard, newest_removed.generation, newest_removed.counter),
            )
            self.connection.execute(
                "UPDATE _mnesite_shards SET trimmed_generation = ?, trimmed_counter = ?, trimmed_digest = ? "
                "WHERE shard = ?",
                (newest_removed.generation, newest_removed.counter, digest, shard),
            )
        return deleted

    def _newest_key(self, condition: str, parameters: tuple[Any, ...], offset: int = 0) -> TxKey | None:
        """The newest rlog key matching ``condition`` (SQL over the rlog's columns), skipping ``offset``."""
        row = self.connection.execute(
            f"SELECT generation, counter FROM _mnesite_rlog WHERE {condition} "
            "ORDER BY generation DESC, counter DESC LIMIT 1 OFFSET ?",
            (*parameters, offset),
        ).fetchone()
        return TxKey(row[0], row[1]) if row else None

    def _key_before(self, shard: str, key: TxKey) -> TxKey | None:
        return self._newest_key("shard = ? AND (generation, counter) < (?, ?)", (shard, key.generation, key.counter))

    def _generation_spans(self, shard: str) -> list[tuple[int, int, int]] | None:
        """``(generation, first counter, last counter)`` of each generation the log holds, newest first,
        two index seeks each; None beyond ``RETENTION_GENERATIONS_COUNTED`` generations. A generation's
        counters are consecutive (``rlog.types.next_key``, checked on every entry taken from elsewhere),
        so these spans name every key the log holds: retention counts and bisects over them instead of
        walking the entries (an OFFSET walk cost every run about 13 ms at 100,000 entries)."""
        spans: list[tuple[int, int, int]] = []
        condition, parameters = "shard = ?", (shard,)
        while (newest := self._newest_key(condition, parameters)) is not None:
            if len(spans) == RETENTION_GENERATIONS_COUNTED:
                return None
            (first,) = self.connection.execute(
                "SELECT counter FROM _mnesite_rlog WHERE shard = ? AND generation = ? ORDER BY counter LIMIT 1",
                (shard, newest.generation),
            ).fetchone()
            spans.append((newest.generation, first, newest.counter))
            condition, parameters = "shard = ? AND generation < ?", (shard, newest.generation)
        return spans

    def _newest_key_at(self, shard: str, offset: int) -> TxKey | None:
        """The key with ``offset`` newer entries after it (``_generation_spans``; else an OFFSET walk)."""
        spans = self._generation_spans(shard)
        if spans is None:
            return self._newest_key("shard = ?", (shard,), offset)
        for generation, first, last in spans:
            if offset <= last - first:
                return TxKey(generation, last - offset)
            offset -= last - first + 1
        return None

    def _newest_appended_before(self, shard: str, before_ms: int) -> TxKey | None:
        """The last key of the entries appended before ``before_ms``, by bisection over the log's keys
        (``_generation_spans``; else a walk from the newest entry). Appended times follow the log (one
        clock per node); after that clock stepped back, the bisection stops at one of the places where
        the times cross ``before_ms``, and the retention rule's other bounds still hold."""
        spans = self._generation_spans(shard)
        if spans is None:
            return self._newest_key("shard = ? AND appended_ms < ?", (shard, before_ms))
        oldest_first = spans[::-1]
        ends = list(itertools.accumulate(last - first + 1 for _, first, last in oldest_first))

        def key_at(position: int) -> TxKey:
            index = bisect.bisect_right(ends, position)
            generation, first, _ = oldest_first[index]
            return TxKey(generation, first + position - (ends[index - 1] if index else 0))

        def appended_before(position: int) -> bool:
            key = key_at(position)
            row = self.connection.execute(
                "SELECT appended_ms FROM _mnesite_rlog WHERE shard = ? AND generation = ? AND counter = ?",
                (shard, key.generation, key.counter),
            ).fetchone()
            return row is not None and row[0] < before_ms

        low, high = 0, ends[-1] if ends else 0  # the first position appended at or after before_ms
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if appended_before(middle) else (low, middle)
        return key_at(low - 1) if low else None

    def verify_chain(
        self,
        shard: str,
        on_batch: Callable[[int, TxKey], None] | None = None,
        batch_entries: int = VERIFY_BATCH_ENTRIES,
    ) -> TxKey:
        """Check that the retained rlog is one digest chain from the last trimmed entry (or genesis),
        and that the applied position is on it. Returns the applied key; raises ``StoreError``
        naming the first break. ``on_batch(entries, last tx key)`` is called after each batch found on
        the chain (a restore shows it as progress)."""
        position = self.shard(shard)
        if position is None:
            raise StoreError(f"unknown shard {shard}")
        previous_key, previous_digest = self.trimmed(shard)
        applied_seen = position.applied == previous_key and position.digest == previous_digest
        while batch := self.entries_after(shard, previous_key, batch_entries):
            for entry in batch:
                if entry.prev != previous_key:
                    raise StoreError(f"shard {shard}: entry {entry.tx_key} follows {entry.prev}, not {previous_key}")
                if entry.shard != shard or chain_break(previous_key, previous_digest, entry) is not None:
                    raise StoreError(f"shard {shard}: digest mismatch at {entry.tx_key}")
                if entry.tx_key == position.applied:
                    if entry.digest != position.digest:
                        raise StoreError(f"shard {shard}: applied digest differs from the rlog at {entry.tx_key}")
                    applied_seen = True
                previous_key, previous_digest = entry.tx_key, entry.digest
            if on_batch is not None:
                on_batch(len(batch), previous_key)
        if not applied_seen:
            raise StoreError(f"shard {shard}: the applied position {position.applied} is not on the rlog")
        return position.applied

    def verify_chains(
        self,
        on_batch: Callable[[str, int, TxKey, TxKey], None] | None = None,
        batch_entries: int | None = None,
    ) -> dict[str, TxKey]:
        """``verify_chain`` of every shard, in name order; returns each one's applied key. ``on_batch(shard,
        entries verified in every shard so far, last tx key, the shard's applied key)`` is called after
        each batch of ``batch_entries`` (``VERIFY_BATCH_ENTRIES`` by default) found on its chain: what
        ``mnesite rlog verify`` and a restore show as progress."""
        entries_verified = 0
        applied = {}
        for shard, position in self.shards().items():

            def chained(entries: int, tx_key: TxKey, shard: str = shard, applied: TxKey = position.applied) -> None:
                nonlocal entries_verified
                entries_verified += entries
                if on_batch is not None:
                    on_batch(shard, entries_verified, tx_key, applied)

            applied[shard] = self.verify_chain(shard, chained, batch_entries or VERIFY_BATCH_ENTRIES)
        return applied

    # -- replicant: bootstrap ------------------------------------------------------------------

    def reset_shard(self, shard: str) -> None:
        """A bootstrap starts (``ResetShard``): forget a shard's rows, rlog and spill; keep its table
        definitions and its applied key, a floor the replica must never watch a core behind, even
        after a restart. The position's digest becomes ``UNKNOWN_DIGEST`` (no watch resumes from it;
        the log restarts there, so ``verify_chain`` still finds the position)."""
        self.name_waits.pop(shard, None)  # the position moves: its next apply looks again
        self.clear_rows(shard)
        self._forget_log_ends(shard)
        self.connection.execute("DELETE FROM _mnesite_rlog WHERE shard = ?", (shard,))
        # No entry is left before any drop: none is keyed by them (``key_column_at``), as ``trim`` says.
        self.connection.execute("DELETE FROM _mnesite_dropped_tables WHERE shard = ?", (shard,))
        self.connection.execute("DELETE FROM _mnesite_spill WHERE shard = ?", (shard,))
        self.ensure_shard(shard, 0)
        self.connection.execute(
            "UPDATE _mnesite_shards SET applied_digest = ?, trimmed_generation = applied_generation, "
            "trimmed_counter = applied_counter, trimmed_digest = ? WHERE shard = ?",
            (UNKNOWN_DIGEST, UNKNOWN_DIGEST, shard),
        )

    def write_rows(self, table_name: str, rows: tuple[dict[str, Any], ...] | list[dict[str, Any]]) -> None:
        """Write full rows of one table (a bootstrap batch): one prepared statement for all of them."""
        table = self._table(table_name)
        names = tuple(name for name, _ in table.columns)
        values = [tuple(map(row.get, names)) for row in rows]
        for target in (table.name, self._mirror(table.name)):
            if target is not None:
                self.connection.executemany(_write_sql(target, names), values)

    def clear_rows(self, shard: str) -> None:
        """Delete the rows of every table of ``shard`` (a snapshot install starts); log and position stay."""
        for table in self.catalog().values():
            if table.shard == shard:
                for target in (table.name, self._mirror(table.name)):
                    if target is not None:
                        self.connection.execute(f"DELETE FROM {quote(target)}")
                self.connection.execute(
                    "UPDATE _mnesite_index_builds SET after = NULL, copied = 0 WHERE table_name = ?", (table.name,)
                )

    def restart_log_at(self, shard: str, key: TxKey, digest: bytes) -> None:
        """A snapshot install ends: the shard's log is trimmed at ``key`` and applied there. It keeps its
        entries after ``key`` when it holds ``key`` with ``digest`` (the same history, Raft's rule for
        snapshots: an entry this core acknowledged is never dropped); otherwise it is emptied."""
        self.name_waits.pop(shard, None)  # the position moves: its next apply looks again
        same_history = self.digest_at(shard, key) == digest
        self._forget_log_ends(shard)
        # The drops recorded go with the entries (``trim``'s rule): those of the entries kept stay.
        for table in ("_mnesite_rlog", "_mnesite_dropped_tables"):
            if same_history:
                self.connection.execute(
                    f"DELETE FROM {table} WHERE shard = ? AND (generation, counter) <= (?, ?)",
                    (shard, key.generation, key.counter),
                )
            else:
                self.connection.execute(f"DELETE FROM {table} WHERE shard = ?", (shard,))
        self.connection.execute(
            "UPDATE _mnesite_shards SET applied_generation = ?, applied_counter = ?, applied_digest = ?, "
            "trimmed_generation = ?, trimmed_counter = ?, trimmed_digest = ?, generation = max(generation, ?) "
            "WHERE shard = ?",
            (key.generation, key.counter, digest, key.generation, key.counter, digest, key.generation, shard),
        )

    def spill(self, entries: tuple[Entry, ...] | list[Entry]) -> None:
        for entry in entries:
            self.connection.execute(
                "INSERT OR REPLACE INTO _mnesite_spill VALUES (?, ?, ?, ?)",
                (
                    entry.shard,
                    entry.tx_key.generation,
                    entry.tx_key.counter,
                    msgpack.packb(entry.to_wire(), use_bin_type=True),
                ),
            )

    def spilled(self, shard: str) -> int:
        return self.connection.execute("SELECT count(*) FROM _mnesite_spill WHERE shard = ?", (shard,)).fetchone()[0]

    def spilled_bytes(self, shard: str) -> int:
        """The bytes of the entries in ``shard``'s spill, as stored."""
        sql = "SELECT coalesce(sum(length(entry)), 0) FROM _mnesite_spill WHERE shard = ?"
        return self.connection.execute(sql, (shard,)).fetchone()[0]

    def replay_spill(self, shard: str, start_key: TxKey, start_digest: bytes, appended_ms: int) -> TxKey:
        """End of a bootstrap: the position becomes K0, then every spilled entry is logged and applied
        in order (the ops are results, so the replay heals what the dirty reads saw)."""
        self.name_waits.pop(shard, None)  # the position moves: its next apply looks again
        self.connection.execute(
            "UPDATE _mnesite_shards SET applied_generation = ?, applied_counter = ?, applied_digest = ?, "
            "trimmed_generation = ?, trimmed_counter = ?, trimmed_digest = ?, generation = max(generation, ?) "
            "WHERE shard = ?",
            (*start_key, start_digest, *start_key, start_digest, start_key.generation, shard),
        )
        # Read and applied SPILL_REPLAY_ENTRIES_MAX at a time: the spill may hold spill_bytes_max
        # (1 GiB by default) of entries, many times that once decoded. One transaction all the same (the caller's).
        last_key = start_key
        while True:
            rows = self.connection.execute(
                "SELECT generation, counter, entry FROM _mnesite_spill "
                "WHERE shard = ? AND (generation, counter) > (?, ?) ORDER BY generation, counter LIMIT ?",
                (shard, *last_key, SPILL_REPLAY_ENTRIES_MAX),
            ).fetchall()
            if not rows:
                break
            entries = [entry_from_wire(msgpack.unpackb(row[2], raw=False)) for row in rows]
            self.append_entries(entries, appended_ms)
            # A wait logs the rest: applied as ``log_and_apply_verified`` says, read back from the log.
            if shard in self.name_waits:
                self._retry_wait(shard, entries, True)
            else:
                for entry in self._before_name_wait(shard, entries):
                    self.apply_entry(entry, healing=True)
            last_key = TxKey(rows[-1][0], rows[-1][1])
        self.connection.execute("DELETE FROM _mnesite_spill WHERE shard = ?", (shard,))
        return last_key

    def meta(self, name: str, default: Any = None) -> Any:
        row = self.connection.execute("SELECT value FROM _mnesite_meta WHERE name = ?", (name,)).fetchone()
        return row[0] if row else default

    def set_meta(self, name: str, value: Any) -> None:
        self.connection.execute("INSERT OR REPLACE INTO _mnesite_meta VALUES (?, ?)", (name, value))

    def claim_cluster_id(self, configured: str | None) -> str | None:
        """The cluster this data directory belongs to (``rlog.versions``), checked against the node's
        ``[cluster] cluster_id`` at its start: recorded (durably) if the directory names none yet (a new
        one, or one of a release before it), kept if the config names none; a directory of another cluster
        (a restored backup of it, a copy) raises ``StoreError`` naming both."""
        recorded = self.meta(CLUSTER_ID_META)
        if recorded is not None and configured is not None and recorded != configured:
            raise StoreError(
                f"{self.path}: this data directory belongs to cluster {recorded}, but [cluster] cluster_id is "
                f"{configured}: a node of one cluster is never started on another's data (a restored backup, "
                "a copied directory); start it with that cluster's config, or on an empty data directory"
            )
        if recorded is None and configured is not None:
            with self.write_transaction():
                self.set_meta(CLUSTER_ID_META, configured)
            return configured
        return recorded

    # -- reads --------------------------------------------------------------------------------

    def read_row(self, table: TableSchema, key: Any) -> dict[str, Any] | None:
        names = [name for name, _ in table.columns]
        row = self.connection.execute(
            f"SELECT {', '.join(quote(n) for n in names)} FROM {quote(table.name)} WHERE {quote(table.key_column)} = ?",
            (key,),
        ).fetchone()
        return dict(zip(names, row, strict=True)) if row is not None else None

    def count_rows(self, table: TableSchema, limit: int | None = None) -> int:
        """The table's rows, or ``min(rows, limit)``: SQLite reads every row it counts."""
        if limit is None:
            return self.connection.execute(f"SELECT count(*) FROM {quote(table.name)}").fetchone()[0]
        sql = f"SELECT count(*) FROM (SELECT 1 FROM {quote(table.name)} LIMIT ?)"
        return self.connection.execute(sql, (limit,)).fetchone()[0]

    def scan(self, table: TableSchema, after: Any, limit: int) -> list[dict[str, Any]]:
        """Rows in key order, strictly after ``after`` (None: from the start), at most ``limit``."""
        names = [name for name, _ in table.columns]
        columns = ", ".join(quote(n) for n in names)
        key = quote(table.key_column)
        if after is None:
            cursor = self.connection.execute(
                f"SELECT {columns} FROM {quote(table.name)} ORDER BY {key} LIMIT ?", (limit,)
            )
        else:
            cursor = self.connection.execute(
                f"SELECT {columns} FROM {quote(table.name)} WHERE {key} > ? ORDER BY {key} LIMIT ?", (after, limit)
            )
        return [dict(zip(names, row, strict=True)) for row in cursor]


def _row_tuples(names: Sequence[str], writes: list[Op]) -> list[tuple[Any, ...]]:
    """The rows of ``writes`` as tuples in the order of ``names``, a column a row lacks as NULL.

    A row of a write holds every declared column but those added since (``AddColumnOp``): one C
    ``itemgetter`` for the rows does it unless a row lacks one, then ``dict.get`` per column."""
    if len(names) > 1:
        try:
            return list(map(operator.itemgetter(*names), map(_ROW_OF, writes)))
        except KeyError:
            pass
    return [tuple(map(write.row.get, names)) for write in writes]  # type: ignore[union-attr]


def _write_rows(names: tuple[str, ...], columns: tuple[str, ...], runs: list[WriteRows]) -> tuple[tuple[str, ...], Any]:
    """The column list to bind and the rows of ``runs`` (one table's, all of ``columns``): their own
    tuples when they hold the table's columns (``names``: in any order, the statement names them); else
    as ``_row_tuples`` makes them, a column a row lacks as NULL, one it has that the table lacks left out."""
    rows = runs[0].rows if len(runs) == 1 else list(itertools.chain.from_iterable(map(_ROWS_OF, runs)))
    if set(columns) == set(names):
        return columns, rows
    positions = {column: position for position, column in enumerate(columns)}
    getters = [operator.itemgetter(positions[name]) if name in positions else (lambda _row: None) for name in names]
    return names, [tuple(getter(row) for getter in getters) for row in rows]


_ROW_OF, _TABLE_OF = operator.attrgetter("row"), operator.attrgetter("table")
_ROWS_OF, _COLUMNS_OF = operator.attrgetter("rows"), operator.attrgetter("columns")
_KIND_AND_TABLE = operator.attrgetter("__class__", "table")


def _row_op_run_ends(ops: list[Op]) -> list[int] | None:
    """Where each run of writes (or deletes) of one table ends, found in C loops, when ``ops`` holds
    only writes and deletes (a replicant's push of 100,000 rows spent 0.7 us a row scanning in Python);
    None otherwise (the caller scans)."""
    kinds = set(map(type, ops))
    if not kinds <= {WriteOp, WriteRows, DeleteOp}:
        return None
    if len(kinds) == 1 and len(set(map(_TABLE_OF, ops))) == 1:  # one run (a push of one table's writes)
        return [len(ops)]
    return list(itertools.accumulate(len(list(run)) for _, run in itertools.groupby(ops, _KIND_AND_TABLE)))


@functools.lru_cache(maxsize=1024)  # per table and column list: made once, not per applied batch
def _write_sql(table: str, names: tuple[str, ...]) -> str:
    columns = ", ".join(quote(name) for name in names)
    return f"INSERT OR REPLACE INTO {quote(table)} ({columns}) VALUES ({', '.join('?' for _ in names)})"


@functools.lru_cache(maxsize=1024)
def _delete_sql(table: str, key_column: str) -> str:
    return f"DELETE FROM {quote(table)} WHERE {quote(key_column)} = ?"


def _chain_within(held: Sequence[Entry], after: TxKey, up_to: TxKey) -> list[Entry] | None:
    """The entries of ``held`` in (``after``, ``up_to``] if they link from ``after`` to ``up_to``
    without a gap; None if ``held`` does not cover that range (or up_to is not after ``after``)."""
    if not held or up_to <= after:
        return None
    chain: list[Entry] = []
    previous = after
    for entry in held:  # the unapplied tail: normally its first entry already follows ``after``
        if entry.tx_key <= after:
            continue
        if entry.tx_key > up_to:
            break
        if entry.prev != previous:
            return None
        chain.append(entry)
        previous = entry.tx_key
    return chain if previous == up_to else None


def _entry(row: tuple[Any, ...]) -> Entry:
    shard, generation, counter, prev_generation, prev_counter, digest, ops, request_id = row
    key, prev = TxKey(generation, counter), TxKey(prev_generation, prev_counter)
    return Entry(shard, key, prev, digest, unpack_ops(ops), request_id, ops)


class _RetentionView:
    """``rlog.retention.RetentionView`` over one shard of the store."""

    def __init__(self, store: Store, shard: str) -> None:
        self.store = store
        self.shard = shard

    def last_key(self) -> TxKey:
        return self.store.last_entry(self.shard)[0]

    def trimmed_key(self) -> TxKey:
        return self.store.trimmed(self.shard)[0]

    def key_before(self, key: TxKey) -> TxKey | None:
        return self.store._key_before(self.shard, key)

    def newest_key_at(self, offset: int) -> TxKey | None:
        return self.store._newest_key_at(self.shard, offset)

    def newest_appended_before(self, before_ms: int) -> TxKey | None:
        return self.store._newest_appended_before(self.shard, before_ms)
