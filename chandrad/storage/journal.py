"""Durable state in SQLite (WAL): one row per document, one per finished page.

The journal is the only authority on what has been seen, what is in progress, what is a duplicate
and what must be retried: nothing of that lives in memory alone, so a crash or ``kill -9`` loses
nothing. Each state transition is one commit. Calls are blocking: the daemon runs them in a
thread (``Journal.call``), never on the event loop.

Final documents are remembered for ``retention.days`` (``prune``, driven by ``chandrad.document.retention``):
then their rows, page rows and delivery rows go, in batches, each one transaction.

A document's life: seen → settled → queued → preparing → inferring → publishing → published | failed.
``seen`` lives in the watcher's memory (a name that has not settled is not a document yet).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, TypeVar

import structlog

from chandrad.backoff import backoff_seconds
from chandrad.errors import ConfigError
from chandrad.storage.schema import (
    DELIVERY_STATES,
    FINAL_STATES,
    STATES,
    UNFINISHED_STATES,
    DeliveryState,
    Document,
    DocumentState,
    PageRecord,
    make_tables,
)

# Document and the states are the journal's vocabulary (schema.py); imported from here too.
__all__ = [
    "STATES",
    "Delivery",
    "Document",
    "DocumentState",
    "Journal",
    "NewDelivery",
    "NewFile",
    "PrunedDocument",
    "storable",
]

log = structlog.get_logger("chandrad.storage.journal")

# SQLite's primary result codes that time can clear and that leave the database unchanged (the
# statement was rolled back): BUSY, another process holds the write lock for longer than the busy
# timeout; LOCKED, a table is locked by another statement on this connection or a shared cache;
# FULL, the state directory's disk is full.
_WAIT_OUT_CODES = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED, sqlite3.SQLITE_FULL})


def _worth_waiting_out(error: sqlite3.Error) -> bool:
    """Whether ``error`` is BUSY, LOCKED or FULL, by SQLite's result code (extended codes such as
    SQLITE_BUSY_SNAPSHOT carry the primary one in their low byte). An error raised by Python code
    has no code and is not waited out."""
    code: int | None = getattr(error, "sqlite_errorcode", None)
    return code is not None and (code & 0xFF) in _WAIT_OUT_CODES


T = TypeVar("T")


def storable(text: str) -> str:
    """``text`` as SQLite can store it. Names read from a Linux directory are bytes; Python decodes
    the ones that are not UTF-8 (a Latin-1 ``café.pdf`` from an old scanner) into lone
    surrogates, which SQLite refuses: every insert of such a name raised, so the file stayed in the
    inbox forever. Those bytes are stored as visible ``\\xe9`` escapes instead; valid names are
    unchanged. ``Pipeline.recover`` finds a file again by comparing its stored form."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@dataclass(frozen=True)
class PrunedDocument:
    """A final document the retention prune removed from the journal."""

    id: str
    inbox: str
    sha256: str
    state: DocumentState
    updated_at: float


@dataclass(frozen=True)
class NewFile:
    """A settled file about to get its ``settled`` row (``Journal.add_documents``)."""

    inbox: str
    rel_path: str
    sha256: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class NewDelivery:
    """A delivery to record with a document's final state: ``kind`` "webhook" or "hook", ``target``
    the [[webhook]]/[[hook]] name, ``payload`` what is sent (the exact request body, or the hook's
    environment as JSON), fixed now so that every attempt sends the same."""

    kind: str
    target: str
    event: str
    payload: str


@dataclass(frozen=True)
class Delivery:
    id: int
    doc_id: str
    kind: str
    target: str
    event: str
    payload: str
    state: DeliveryState
    attempts: int
    next_attempt_at: float
    last_status: int | None
    last_error: str | None
    created_at: float
    updated_at: float

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Delivery:
        values = dict(row)
        values["state"] = DeliveryState(values["state"])
        return cls(**values)


class Journal:
    def __init__(self, path: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self._clock = clock
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="journal")
        try:
            self._db = sqlite3.connect(path, timeout=10, check_same_thread=False, isolation_level=None)
            self._db.row_factory = sqlite3.Row
            self._db.execute("PRAGMA journal_mode=WAL")
            # FULL: a commit that returned survives a power cut (NORMAL may lose the last ones in WAL mode).
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
            # Take the write lock at once: another process holding it (a second daemon on this
            # state_dir, a `sqlite3` shell left in a transaction) otherwise went unnoticed until
            # the first document, whose every commit then failed after the busy timeout.
            make_tables(self._db)
        except sqlite3.OperationalError as error:
            raise ConfigError(
                f"cannot open the journal {path}: {error}. If another chandrad uses this state_dir, stop it "
                f"or give this instance its own state_dir"
            ) from None

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run a journal method off the event loop, one at a time."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: fn(*args, **kwargs))

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            self._db.close()
        self._executor.shutdown(wait=False)

    def _execute(self, sql: str, params: tuple[Any, ...] | dict[str, Any] = ()) -> sqlite3.Cursor:
        """One statement, one commit; waited out while the database is locked or its disk full
        (``_waiting_out``). A statement that got SQLITE_BUSY changed nothing, so running it again is safe."""
        return self._waiting_out(lambda: self._db.execute(sql, params))

    def _transaction(self, work: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``work``'s statements in one transaction: all of them are committed, or none. Waited
        out like ``_execute`` (rolled back, then run again from the start)."""

        def whole() -> T:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                result = work(self._db)
                self._db.execute("COMMIT")
                return result
            except BaseException:
                if self._db.in_transaction:
                    self._db.execute("ROLLBACK")
                raise

        return self._waiting_out(whole)

    def _waiting_out(self, run: Callable[[], T]) -> T:
        """``run()`` under the lock; while another process holds the database locked for longer than
        the busy timeout, or its disk is full, wait (``backoff_seconds``, 0.5 s doubling to 10 s)
        and run it again instead of raising: an error here used to escape the document's error
        handling (which itself needs the journal) and end the worker, and with it the daemon.
        Nothing can progress without the journal; waiting is what is left."""
        attempt = 0
        while True:
            with self._lock:
                try:
                    return run()
                except sqlite3.OperationalError as error:
                    if not _worth_waiting_out(error) or self._closing.is_set():
                        raise
                    why = str(error)
            attempt += 1
            delay = backoff_seconds(0.5, attempt, cap=10.0)
            log.warning("the journal cannot be written; waiting", error=why, journal=str(self.path), retry_in_s=delay)
            if self._closing.wait(delay):
                raise sqlite3.OperationalError("database is locked (journal closing)")

    def _update(self, db: sqlite3.Connection, doc_id: str, state: str, fields: dict[str, Any]) -> None:
        if state not in STATES:
            raise ValueError(f"unknown state {state!r}")
        assignments = ["state = :state", "updated_at = :now"]
        params: dict[str, Any] = {"state": state, "now": self._clock(), "id": doc_id}
        for key, value in fields.items():
            if key in ("error", "history") and value is not None:
                value = json.dumps(value)
            elif isinstance(value, str):
                value = storable(value)
            assignments.append(f"{key} = :{key}")
            params[key] = value
        db.execute(f"UPDATE documents SET {', '.join(assignments)} WHERE id = :id", params)

    def _insert_deliveries(self, db: sqlite3.Connection, doc_id: str, deliveries: Sequence[NewDelivery]) -> None:
        now = self._clock()
        db.executemany(
            "INSERT INTO deliveries (doc_id, kind, target, event, payload, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            [(doc_id, d.kind, d.target, d.event, d.payload, now, now) for d in deliveries],
        )

    # -- documents -------------------------------------------------------------------------------

    def add_document(
        self,
        inbox: str,
        rel_path: str,
        sha256: str,
        size: int,
        mtime_ns: int,
        *,
        doc_id: str | None = None,
        created_at: float | None = None,
    ) -> Document:
        """A new ``settled`` row. ``doc_id`` and ``created_at`` are given for a document taken over
        from another host: it keeps the id (its claim folder, seen marker and outputs name it) and
        the time it was first seen."""
        now = self._clock()
        doc_id = doc_id or uuid.uuid4().hex[:16]
        rel_path = storable(rel_path)
        self._execute(
            "INSERT INTO documents (id, inbox, rel_path, sha256, size, mtime_ns, state, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, ?, ?, 'settled', ?, ?)",
            (doc_id, inbox, rel_path, sha256, size, mtime_ns, now if created_at is None else created_at, now),
        )
        return self.get(doc_id)

    def add_documents(self, files: Sequence[NewFile]) -> list[Document]:
        """A new ``settled`` row for each of ``files``, in one transaction (a burst taken in at
        once: one commit, not one each). Every row is durable before any of the files is claimed."""
        now = self._clock()
        rows = [
            (uuid.uuid4().hex[:16], f.inbox, storable(f.rel_path), f.sha256, f.size, f.mtime_ns, now, now)
            for f in files
        ]

        def work(db: sqlite3.Connection) -> None:
            db.executemany(
                "INSERT INTO documents (id, inbox, rel_path, sha256, size, mtime_ns, state, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, ?, 'settled', ?, ?)",
                rows,
            )

        self._transaction(work)
        return [self.get(row[0]) for row in rows]

    def set_states(self, changes: Sequence[tuple[str, str, dict[str, Any]]]) -> list[Document]:
        """Each ``(doc_id, state, fields)`` of ``changes``, in one transaction: all or none."""

        def work(db: sqlite3.Connection) -> None:
            for doc_id, state, values in changes:
                self._update(db, doc_id, state, values)

        self._transaction(work)
        return [self.get(doc_id) for doc_id, _, _ in changes]

    def split(self, parent: Document, parts: Sequence[Document]) -> None:
        """In one transaction: each of ``parts`` a queued document of its own (a part a crash left
        adopted is only given its ``split_from``), and ``parent`` ``split``, waiting for them."""
        now = self._clock()
        rows = [
            (part.id, part.inbox, storable(part.rel_path), part.claimed_path, part.sha256, part.size, part.mtime_ns,
             parent.id, json.dumps(part.split_from), parent.created_at, now)
            for part in parts
        ]  # fmt: skip

        def work(db: sqlite3.Connection) -> None:
            db.executemany(
                "INSERT INTO documents (id, inbox, rel_path, claimed_path, sha256, size, mtime_ns, state, parent_id, "
                "split_from, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, 'queued', ?, ?, ?, ?) "
                "ON CONFLICT (id) DO UPDATE SET parent_id = excluded.parent_id, split_from = excluded.split_from",
                rows,
            )
            self._update(db, parent.id, DocumentState.SPLIT, {})

        self._transaction(work)

    def parts_of(self, parent_id: str) -> list[Document]:
        """The documents a batch scan was split into, in page order."""
        rows = self._execute("SELECT * FROM documents WHERE parent_id = ?", (parent_id,)).fetchall()
        return sorted((Document.from_row(row) for row in rows), key=lambda doc: (doc.split_from or {}).get("first", 0))

    def find(self, doc_id: str) -> Document | None:
        try:
            return self.get(doc_id)
        except KeyError:
            return None

    def get(self, doc_id: str) -> Document:
        row = self._execute("SELECT * FROM documents WHERE id = ?", (doc_id,)).fetchone()
        if row is None:
            raise KeyError(doc_id)
        return Document.from_row(row)

    def set_state(self, doc_id: str, state: str, **fields: Any) -> Document:
        self._transaction(lambda db: self._update(db, doc_id, state, fields))
        return self.get(doc_id)

    def record_attempt_failure(
        self, doc_id: str, error: dict[str, Any], *, final: bool, retry_at: float = 0.0
    ) -> Document:
        """Append to the document's history; ``final`` marks it failed, else it is queued for ``retry_at``."""
        if final:
            return self.fail(doc_id, error, ())
        doc = self.get(doc_id)
        history = [*doc.history, error]
        return self.set_state(
            doc_id, "queued", error=error, history=history, attempts=doc.attempts + 1, next_attempt_at=retry_at
        )

    def publish(self, doc_id: str, deliveries: Sequence[NewDelivery]) -> Document:
        """Mark the document published and record its deliveries, in one transaction: a crash
        leaves both or neither (the transactional outbox the delivery task sends from)."""

        def work(db: sqlite3.Connection) -> None:
            self._update(db, doc_id, "published", {"error": None})
            self._insert_deliveries(db, doc_id, deliveries)

        self._transaction(work)
        return self.get(doc_id)

    def fail(self, doc_id: str, error: dict[str, Any], deliveries: Sequence[NewDelivery]) -> Document:
        """Mark the document failed (``error`` appended to its history, one more attempt counted)
        and record its deliveries, in one transaction."""

        def work(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT attempts, history FROM documents WHERE id = ?", (doc_id,)).fetchone()
            if row is None:
                raise KeyError(doc_id)
            history = [*json.loads(row["history"]), error]
            fields = {"error": error, "history": history, "attempts": row["attempts"] + 1}
            self._update(db, doc_id, "failed", fields)
            self._insert_deliveries(db, doc_id, deliveries)

        self._transaction(work)
        return self.get(doc_id)

    def requeue_failed(self, doc_id: str, claimed_path: str, entry: dict[str, Any]) -> Document:
        """A failed document whose original is back in its claim folder (``chandrad retry``):
        queued now, its attempts counted from zero, ``entry`` appended to its history (which keeps
        every earlier error). Raises ValueError if the document is not failed (any more)."""

        def work(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT state, history FROM documents WHERE id = ?", (doc_id,)).fetchone()
            if row is None:
                raise KeyError(doc_id)
            if row["state"] != "failed":
                raise ValueError(f"document {doc_id} is {row['state']}, not failed")
            fields = {
                "claimed_path": claimed_path,
                "final_path": None,
                "output_dir": None,
                "error": None,
                "history": [*json.loads(row["history"]), entry],
                "attempts": 0,
                "next_attempt_at": 0.0,
            }
            self._update(db, doc_id, "queued", fields)

        self._transaction(work)
        return self.get(doc_id)

    def find_duplicate(self, sha256: str, exclude_id: str, taken_before: bool = False) -> Document | None:
        """A document with the same content that is published or still in progress.

        ``taken_before``: only documents journaled before this one count (by insertion order, not
        by the wall clock, which can jump back). A document resumed after a crash must not be
        called a duplicate of a later copy of itself (then both copies would fail); only the later
        copy is. An unclaimed ``settled`` row of this document's own name (an intake that broke
        off before its claim) is no twin: that file is this very document, taken in again. A
        claimed one (in its duplicate check) is.
        """
        order = "AND rowid < (SELECT rowid FROM documents WHERE id = :id) " if taken_before else ""
        row = self._execute(
            "SELECT * FROM documents WHERE sha256 = :sha AND id != :id AND state != 'failed' "
            "AND NOT (state = 'settled' AND claimed_path IS NULL "
            "AND inbox = (SELECT inbox FROM documents WHERE id = :id) "
            "AND rel_path = (SELECT rel_path FROM documents WHERE id = :id)) "
            f"{order}ORDER BY rowid LIMIT 1",
            {"sha": sha256, "id": exclude_id},
        ).fetchone()
        return Document.from_row(row) if row else None

    def forget(self, doc_id: str) -> None:
        """Remove a row for a file that vanished before it was claimed: nothing of it was taken in."""
        self._execute("DELETE FROM pages WHERE doc_id = ?", (doc_id,))
        self._execute("DELETE FROM documents WHERE id = ?", (doc_id,))

    def find_same_file(self, inbox: str, rel_path: str, size: int, mtime_ns: int, path: str) -> Document | None:
        """A document already accounted for that still sits at this name, unchanged: an original put
        back after publishing (on_success = "keep"), or one chandrad could not move out of the inbox.
        A document recorded as vanished does not count: if its name is there again, it is new."""
        row = self._execute(
            "SELECT * FROM documents WHERE inbox = ? AND rel_path = ? AND size = ? AND mtime_ns = ? "
            "AND ((state = 'published' AND final_path = ?) OR (state = 'failed' AND claimed_path IS NULL "
            "AND COALESCE(json_extract(error, '$.kind'), '') != 'vanished')) "
            "ORDER BY created_at DESC LIMIT 1",
            (inbox, storable(rel_path), size, mtime_ns, storable(path)),
        ).fetchone()
        return Document.from_row(row) if row else None

    def find_same_files(self, files: Sequence[tuple[str, str, int, int, str]]) -> list[Document | None]:
        """``find_same_file`` for each of ``files`` (its arguments), in one call."""
        return [self.find_same_file(*file) for file in files]

    def unfinished(self) -> list[Document]:
        """Every document not final, oldest first. The states are named (IN, not NOT IN): SQLite
        reads each from the state index, where NOT IN read every row, final ones included (a
        million of them at start-up and in ``chandrad status``)."""
        placeholders = ", ".join("?" for _ in UNFINISHED_STATES)
        rows = self._execute(
            f"SELECT * FROM documents WHERE state IN ({placeholders}) ORDER BY created_at", UNFINISHED_STATES
        ).fetchall()
        return [Document.from_row(row) for row in rows]

    def due_queued(self, now: float, horizon: float, limit: int) -> list[str]:
        """Ids of the oldest ``limit`` queued documents whose next attempt is due, or is more than
        ``horizon`` seconds away (a wall clock that stepped back: then it is due too).

        Read every second by the retry loop, so it reads ids, not whole rows, and stops at ``limit``:
        ``unfinished()`` took ~1 s with 100 000 documents waiting (bench/retry_scan.py)."""
        rows = self._execute(
            "SELECT id FROM documents WHERE state = 'queued' AND claimed_path IS NOT NULL "
            "AND (next_attempt_at <= ? OR next_attempt_at > ?) ORDER BY created_at LIMIT ?",
            (now, now + horizon, limit),
        ).fetchall()
        return [row["id"] for row in rows]

    def counts(self) -> dict[str, int]:
        """How many documents are in each state (those with any), from the triggers' tally."""
        return self._state_counts("documents")

    def _state_counts(self, table: str) -> dict[str, int]:
        rows = self._execute("SELECT state, n FROM state_counts WHERE tbl = ? AND n > 0", (table,)).fetchall()
        return {row["state"]: row["n"] for row in rows}

    def recent(self, limit: int = 20, state: str | None = None) -> list[Document]:
        if state:
            rows = self._execute(
                "SELECT * FROM documents WHERE state = ? ORDER BY updated_at DESC LIMIT ?", (state, limit)
            ).fetchall()
        else:
            rows = self._execute("SELECT * FROM documents ORDER BY updated_at DESC LIMIT ?", (limit,)).fetchall()
        return [Document.from_row(row) for row in rows]

    def find_failed(self, path: str) -> Document | None:
        """The failed document whose original lies at ``path`` in failed/, or else the latest
        failed one that came in under the name ``path`` (relative to its inbox)."""
        row = self._execute(
            "SELECT * FROM documents WHERE state = 'failed' AND (final_path = ? OR rel_path = ?) "
            "ORDER BY final_path = ? DESC, updated_at DESC LIMIT 1",
            (storable(path), storable(path), storable(path)),
        ).fetchone()
        return Document.from_row(row) if row else None

    # -- retention -------------------------------------------------------------------------------

    def prune(self, cutoff: float, limit: int) -> list[PrunedDocument]:
        """Remove up to ``limit`` final documents last changed before ``cutoff`` (oldest first),
        with their page rows and delivery rows, in one transaction: a kill leaves all of a batch
        or none of it. A document with a delivery still pending is kept until it is delivered or
        given up (its webhook must still get it).

        Each state is read from the (state, updated_at) index, which stops at ``limit``: a batch
        costs the same with a million rows as with a thousand. Returns what was removed."""

        def work(db: sqlite3.Connection) -> list[PrunedDocument]:
            # Each state's oldest, then the oldest of both. The delivery check reads this
            # document's own rows (by doc_id), never every pending delivery.
            candidates: list[sqlite3.Row] = []
            for state in FINAL_STATES:
                candidates += db.execute(
                    "SELECT id, inbox, sha256, state, updated_at FROM documents AS d "
                    "WHERE state = ? AND updated_at < ? AND NOT EXISTS (SELECT 1 FROM deliveries "
                    "INDEXED BY deliveries_doc WHERE doc_id = d.id AND state = 'pending') "
                    "ORDER BY updated_at LIMIT ?",
                    (state, cutoff, limit),
                ).fetchall()
            picked = sorted(candidates, key=lambda row: float(row["updated_at"]))[:limit]
            ids = [(row["id"],) for row in picked]
            db.executemany("DELETE FROM deliveries WHERE doc_id = ?", ids)
            db.executemany("DELETE FROM pages WHERE doc_id = ?", ids)
            db.executemany("DELETE FROM documents WHERE id = ?", ids)
            return [
                PrunedDocument(row["id"], row["inbox"], row["sha256"], DocumentState(row["state"]), row["updated_at"])
                for row in picked
            ]

        return self._transaction(work)

    def size_bytes(self) -> int:
        """The journal's size on disk: the database file and its write-ahead log. Pruned rows leave
        free pages that new rows reuse; the file does not shrink."""
        total = 0
        for path in (self.path, self.path.with_name(self.path.name + "-wal")):
            try:
                total += path.stat().st_size
            except FileNotFoundError:
                pass
        return total

    def oldest(self) -> Document | None:
        """The document first seen longest ago (its ``created_at``, and ``updated_at``: for a final
        one, when retention may prune it), or None in an empty journal. Read as each state's
        first row by the (state, created_at) index, not by a scan."""
        firsts = " UNION ALL ".join(
            "SELECT * FROM (SELECT * FROM documents WHERE state = ? ORDER BY created_at LIMIT 1)" for _ in STATES
        )
        row = self._execute(f"SELECT * FROM ({firsts}) ORDER BY created_at LIMIT 1", STATES).fetchone()
        return Document.from_row(row) if row else None

    # -- deliveries ------------------------------------------------------------------------------

    def due_deliveries(self, now: float, horizon: float, limit: int) -> list[Delivery]:
        """The ``limit`` pending deliveries due soonest whose time has come, or is more than
        ``horizon`` seconds away (a wall clock that stepped back)."""
        rows = self._execute(
            "SELECT * FROM deliveries WHERE state = 'pending' AND (next_attempt_at <= ? OR next_attempt_at > ?) "
            "ORDER BY next_attempt_at, id LIMIT ?",
            (now, now + horizon, limit),
        ).fetchall()
        return [Delivery.from_row(row) for row in rows]

    def delivery_attempted(
        self, delivery_id: int, state: str, *, next_attempt_at: float = 0.0, status: int | None, error: str | None
    ) -> None:
        """One attempt's outcome: ``state`` delivered, failed (given up) or pending (to retry at
        ``next_attempt_at``), with the HTTP status or exit code and what went wrong."""
        if state not in DELIVERY_STATES:
            raise ValueError(f"unknown delivery state {state!r}")
        self._execute(
            "UPDATE deliveries SET state = ?, attempts = attempts + 1, next_attempt_at = ?, last_status = ?, "
            "last_error = ?, updated_at = ? WHERE id = ?",
            (state, next_attempt_at, status, error, self._clock(), delivery_id),
        )

    def delivery_counts(self) -> dict[str, int]:
        """How many deliveries are in each state (those with any), from the triggers' tally."""
        return self._state_counts("deliveries")

    def deliveries(self, *, state: str | None = None, doc_id: str | None = None, limit: int = 20) -> list[Delivery]:
        """Deliveries, latest change first; only those in ``state`` or of ``doc_id`` if given."""
        clauses, params = [], []
        if state is not None:
            clauses.append("state = ?")
            params.append(state)
        if doc_id is not None:
            clauses.append("doc_id = ?")
            params.append(doc_id)
        where = f"WHERE {' AND '.join(clauses)} " if clauses else ""
        rows = self._execute(
            f"SELECT * FROM deliveries {where}ORDER BY updated_at DESC, id DESC LIMIT ?", (*params, limit)
        ).fetchall()
        return [Delivery.from_row(row) for row in rows]

    # -- pages -----------------------------------------------------------------------------------

    def record_page(self, page: PageRecord) -> None:
        row: dict[str, Any] = {field.name: getattr(page, field.name) for field in fields(page)}
        row |= {
            "image_names": json.dumps(list(page.image_names)),
            "chunks": json.dumps(list(page.chunks)),
            "text_lines": json.dumps(page.text_lines) if page.text_lines is not None else None,
            "scan": json.dumps(page.scan) if page.scan is not None else None,
        }
        names = ", ".join(row)
        self._execute(f"INSERT OR REPLACE INTO pages ({names}) VALUES ({', '.join(':' + n for n in row)})", row)

    def pages(self, doc_id: str) -> list[PageRecord]:
        rows = self._execute("SELECT * FROM pages WHERE doc_id = ? ORDER BY page_no", (doc_id,)).fetchall()
        return [PageRecord.from_row(row) for row in rows]

    def done_page_numbers(self, doc_id: str) -> set[int]:
        rows = self._execute("SELECT page_no FROM pages WHERE doc_id = ?", (doc_id,)).fetchall()
        return {row["page_no"] for row in rows}

    def drop_pages(self, doc_id: str, page_nos: list[int] | None = None) -> None:
        """Page results are only needed until the document is published or failed; ``page_nos``
        drops only those (to redo them)."""
        if page_nos is None:
            self._execute("DELETE FROM pages WHERE doc_id = ?", (doc_id,))
            return
        for page_no in page_nos:
            self._execute("DELETE FROM pages WHERE doc_id = ? AND page_no = ?", (doc_id, page_no))
