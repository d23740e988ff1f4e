#!/usr/bin/env python
"""Benchmark the retry loop's journal read with a large backlog (not a test: numbers and a ratio).

The retry loop asks the journal every second which queued documents are due. It used to read every
unfinished row as a whole ``Document`` (``Journal.unfinished``); it now reads the ids of the oldest
due ones, up to what keeps the workers busy (``Journal.due_queued``). Both are timed here on the same
journal, a backlog of N queued documents (a scanner's dump, or a long outage), in the same run.

Usage: python bench/retry_scan.py [--backlog 100000] [--in-flight 768] [--repeat 5]
Last line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from chandrad.service.daemon import RETRY_QUEUE_DEPTH  # noqa: E402
from chandrad.storage.journal import Journal  # noqa: E402


def fill(journal: Journal, backlog: int) -> None:
    """``backlog`` queued documents in one transaction (the daemon adds them one by one)."""
    now = time.time()
    rows = [(f"{i:016x}", "inbox", f"scan-{i}.pdf", f"/srv/inbox/.chandrad/claimed/{i:016x}/scan-{i}.pdf",
             f"{i:064x}", 100_000, i, "queued", now + i * 1e-6, now + i * 1e-6) for i in range(backlog)]
    db = journal._db  # noqa: SLF001 - a bench may reach in to build a big journal quickly
    db.execute("BEGIN")
    db.executemany(
        "INSERT INTO documents (id, inbox, rel_path, claimed_path, sha256, size, mtime_ns, state, created_at, "
        "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    db.execute("COMMIT")


def timed(call, repeat: int) -> tuple[float, int]:
    seconds, count = [], 0
    for _ in range(repeat):
        start = time.perf_counter()
        count = len(call())
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backlog", type=int, default=100_000)
    ap.add_argument("--in-flight", type=int, default=768, help="documents in flight (the bench's GPU setting)")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        journal = Journal(Path(tmp) / "journal.sqlite3")
        t = time.perf_counter()
        fill(journal, a.backlog)
        print(f"{a.backlog} queued documents written in {time.perf_counter() - t:.1f} s", flush=True)
        depth = RETRY_QUEUE_DEPTH * a.in_flight
        now = time.time() + 1
        old_s, old_rows = timed(journal.unfinished, a.repeat)
        # A full in-memory queue is the worst case: the window then covers it and ``depth`` more.
        new_s, new_rows = timed(lambda: journal.due_queued(now, 3600.0, 2 * depth), a.repeat)
        journal.close()
    result = {
        "backlog": a.backlog, "in_flight": a.in_flight, "window": 2 * depth,
        "unfinished_ms": round(old_s * 1e3, 2), "unfinished_rows": old_rows,
        "due_queued_ms": round(new_s * 1e3, 2), "due_queued_rows": new_rows,
        "speedup": round(old_s / new_s, 1),
        "journal_busy_per_poll_before": f"{old_s:.0%} of each 1 s poll",
    }
    print(f"retry loop's journal read with {a.backlog} queued: unfinished() {old_s * 1e3:.1f} ms "
          f"({old_rows} rows) vs due_queued() {new_s * 1e3:.1f} ms ({new_rows} ids): {old_s / new_s:.0f}x")
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
