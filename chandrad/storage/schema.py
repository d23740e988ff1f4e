"""The journal's vocabulary and tables: the states a document and a delivery go through (enums:
each compares equal to the text stored in SQLite), the schema, and the tallies triggers keep."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class DocumentState(StrEnum):
    """A document's life: settled → queued → preparing → inferring → publishing → published | failed
    (a batch scan: → split, until its parts are final, → published)."""

    SETTLED = "settled"
    QUEUED = "queued"
    PREPARING = "preparing"
    INFERRING = "inferring"
    PUBLISHING = "publishing"
    # A batch scan whose parts are documents of their own now: it waits for them, then its
    # original is archived (chandrad.document.split).
    SPLIT = "split"
    PUBLISHED = "published"
    FAILED = "failed"


class DeliveryState(StrEnum):
    """A delivery (webhook request or hook run) is pending until it succeeded or was given up."""

    PENDING = "pending"
    DELIVERED = "delivered"
    FAILED = "failed"


STATES = tuple(DocumentState)
FINAL_STATES = (DocumentState.PUBLISHED, DocumentState.FAILED)
UNFINISHED_STATES = tuple(state for state in STATES if state not in FINAL_STATES)
DELIVERY_STATES = tuple(DeliveryState)


@dataclass(frozen=True)
class Document:
    id: str
    inbox: str
    rel_path: str
    claimed_path: str | None
    sha256: str
    size: int
    mtime_ns: int
    state: DocumentState
    attempts: int
    next_attempt_at: float
    page_count: int | None
    output_dir: str | None
    final_path: str | None
    error: dict[str, Any] | None
    history: list[dict[str, Any]]
    created_at: float
    updated_at: float
    # A part of a batch scan split at its separator sheets (chandrad.document.split): the stack it
    # came from and its pages there, {"parent", "file", "first", "last"}; None for any other document.
    split_from: dict[str, Any] | None = None

    @property
    def parent_id(self) -> str | None:
        return str(self.split_from["parent"]) if self.split_from else None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> Document:
        values = dict(row)
        values.pop("parent_id", None)  # split_from's "parent", a column of its own for the index
        values["split_from"] = json.loads(values["split_from"]) if values.get("split_from") else None
        values["error"] = json.loads(values["error"]) if values["error"] else None
        values["history"] = json.loads(values["history"])
        values["state"] = DocumentState(values["state"])
        return cls(**values)


@dataclass(frozen=True)
class PageRecord:
    doc_id: str
    page_no: int
    width: int
    height: int
    html: str
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str = ""
    retries: int = 0
    latency_s: float = 0.0
    engine: str = ""
    model: str = ""
    image_names: tuple[str, ...] = ()
    chunks: tuple[dict[str, Any], ...] = ()
    error: str | None = None  # the page could not be read: why
    # Where each block's lines and words are on the page image (pdf.lines.page_text_lines),
    # measured while the image was in memory; None when no searchable PDF was asked for.
    text_lines: Any = None
    # What chandrad.scan decided about the page before it was read: {"orientation": {...}}.
    scan: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row: sqlite3.Row) -> PageRecord:
        values = dict(row)
        values["image_names"] = tuple(json.loads(values["image_names"]))
        values["chunks"] = tuple(json.loads(values["chunks"]))
        values["text_lines"] = json.loads(values["text_lines"]) if values["text_lines"] else None
        values["scan"] = json.loads(values["scan"]) if values.get("scan") else None
        return cls(**values)


SCHEMA = """
CREATE TABLE IF NOT EXISTS documents (
    id TEXT PRIMARY KEY,
    inbox TEXT NOT NULL,
    rel_path TEXT NOT NULL,
    claimed_path TEXT,
    sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    state TEXT NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL DEFAULT 0,
    page_count INTEGER,
    output_dir TEXT,
    final_path TEXT,
    error TEXT,
    history TEXT NOT NULL DEFAULT '[]',
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    parent_id TEXT,
    split_from TEXT
);
CREATE INDEX IF NOT EXISTS documents_sha ON documents (sha256);
-- by state (counts, unfinished) and, within one, oldest first (due_queued: the retry loop's read);
-- it replaces an index on state alone, which every state change also had to update
DROP INDEX IF EXISTS documents_state;
CREATE INDEX IF NOT EXISTS documents_state_created ON documents (state, created_at);
-- by state and last change: the retention prune's read (final rows older than the cutoff, oldest
-- first, stopping at its batch) and the latest failures (``recent``: status, recovery's sweep)
CREATE INDEX IF NOT EXISTS documents_state_updated ON documents (state, updated_at);
CREATE INDEX IF NOT EXISTS documents_path ON documents (inbox, rel_path);
CREATE TABLE IF NOT EXISTS pages (
    doc_id TEXT NOT NULL REFERENCES documents (id),
    page_no INTEGER NOT NULL,
    width INTEGER NOT NULL,
    height INTEGER NOT NULL,
    html TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    finish_reason TEXT NOT NULL DEFAULT '',
    retries INTEGER NOT NULL DEFAULT 0,
    latency_s REAL NOT NULL DEFAULT 0,
    engine TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL DEFAULT '',
    image_names TEXT NOT NULL DEFAULT '[]',
    chunks TEXT NOT NULL DEFAULT '[]',
    error TEXT,
    text_lines TEXT,
    scan TEXT,
    PRIMARY KEY (doc_id, page_no)
);
-- The transactional outbox: one row per (document, webhook or hook) for each final state, inserted
-- in the transaction that commits that state (publish, fail), sent by the delivery task.
CREATE TABLE IF NOT EXISTS deliveries (
    id INTEGER PRIMARY KEY,
    doc_id TEXT NOT NULL REFERENCES documents (id),
    kind TEXT NOT NULL,
    target TEXT NOT NULL,
    event TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    next_attempt_at REAL NOT NULL DEFAULT 0,
    last_status INTEGER,
    last_error TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS deliveries_state_due ON deliveries (state, next_attempt_at);
CREATE INDEX IF NOT EXISTS deliveries_doc ON deliveries (doc_id);
-- the latest failed or retrying deliveries (``deliveries``: status) without sorting all of them
CREATE INDEX IF NOT EXISTS deliveries_state_updated ON deliveries (state, updated_at);
"""

# How many documents and deliveries are in each state, kept by triggers in every transaction that
# changes one: ``counts`` (the watchdog's health check, ``chandrad status``) and ``delivery_counts``
# (the pending gauge) read a few rows instead of counting the whole table (58 and 80 ms with a
# million rows, on the journal's one thread, in front of intake). Created, and filled from the
# tables, once, under the write lock (``make_tables``): no row is counted twice or missed.
COUNTS_SCHEMA = (
    "CREATE TABLE state_counts (tbl TEXT NOT NULL, state TEXT NOT NULL, n INTEGER NOT NULL, "
    "PRIMARY KEY (tbl, state)) WITHOUT ROWID",
    "INSERT INTO state_counts SELECT 'documents', state, COUNT(*) FROM documents GROUP BY state",
    "INSERT INTO state_counts SELECT 'deliveries', state, COUNT(*) FROM deliveries GROUP BY state",
)


def count_triggers(table: str) -> tuple[str, ...]:
    """The triggers that keep ``table``'s row in ``state_counts`` for each state."""
    up = (
        f"INSERT INTO state_counts (tbl, state, n) VALUES ('{table}', new.state, 1) "
        "ON CONFLICT (tbl, state) DO UPDATE SET n = n + 1;"
    )
    down = f"UPDATE state_counts SET n = n - 1 WHERE tbl = '{table}' AND state = old.state;"
    return (
        f"CREATE TRIGGER IF NOT EXISTS {table}_count_insert AFTER INSERT ON {table} BEGIN {up} END",
        f"CREATE TRIGGER IF NOT EXISTS {table}_count_delete AFTER DELETE ON {table} BEGIN {down} END",
        f"CREATE TRIGGER IF NOT EXISTS {table}_count_update AFTER UPDATE OF state ON {table} "
        f"WHEN old.state IS NOT new.state BEGIN {down} {up} END",
    )


COUNT_TRIGGERS = count_triggers("documents") + count_triggers("deliveries")


def make_tables(db: sqlite3.Connection) -> None:
    """The tables, indexes, tallies and triggers, made where missing (an older chandrad's journal
    gets the columns and tallies added since), the tallies and their triggers in one transaction
    under the write lock, so that no change between the fill and the triggers goes uncounted.
    Raises ``sqlite3.OperationalError`` when another process holds the write lock."""
    db.executescript(SCHEMA)
    # Columns added after the first release.
    for table, added in (("pages", ("text_lines", "scan")), ("documents", ("parent_id", "split_from"))):
        columns = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        for column in added:
            if column not in columns:
                db.execute(f"ALTER TABLE {table} ADD COLUMN {column} TEXT")
    db.execute("CREATE INDEX IF NOT EXISTS documents_parent ON documents (parent_id) WHERE parent_id IS NOT NULL")
    db.execute("BEGIN IMMEDIATE")
    try:
        if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'state_counts'").fetchone() is None:
            for statement in COUNTS_SCHEMA:
                db.execute(statement)
        for trigger in COUNT_TRIGGERS:
            db.execute(trigger)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
