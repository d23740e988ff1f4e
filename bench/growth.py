"""Does a year of documents cost what a day does? One run, two worlds side by side:

- ``empty``: a fresh journal and inbox;
- ``grown``: a journal with ``--documents`` final documents (published, a page and a delivered
  webhook each) and their sharded seen markers on the inbox (``seen/ab/cd/<sha256>``), written
  directly (SQLite ``executemany``, plain files), not through the daemon: minutes, not months.

Both also hold ``--old`` documents older than ``retention.days`` (rows and markers), for the prune.
In each world, through the real code on a real journal and folder, in this order:

1. intake: ``Intake.take_in`` of ``--files`` new files, seconds per file (p50, p90);
2. the duplicate check: ``take_in`` of copies of documents the journal knows, each found a
   duplicate and failed with its report (p50, p90);
3. ``chandrad status`` (its click command, in this process: an interpreter's start would hide it);
4. start-up: the journal opened and ``recovery.recover`` run, as the daemon starts;
5. the prune: one ``Pruner.prune_once`` removing the old documents (rows/s; markers: names looked
   at per second, since every marker is judged by its own mtime).

It prints each figure for both worlds and the ratio grown/empty (for the prune's rates,
empty/grown: above 1 means slower when grown). Target: ratios <= 1.5, start-up <= 10 s.
The prune's row rate misses that target at a million (2.5x, docs/architecture.md "Retention": one
random sha256-index leaf per row, a cost that saturates from ~100 000 rows on).

    .venv/bin/python bench/growth.py --documents 1000000 --out bench/results/growth-YYYYMMDD.json
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from click.testing import CliRunner

from chandrad.cli import main as cli_main
from chandrad.config import EngineSettings, InboxSettings, RetentionSettings, Settings
from chandrad.document import recovery
from chandrad.document.retention import DAY_SECONDS, Pruner
from chandrad.engine import create_engine
from chandrad.inbox.intake import Intake
from chandrad.inbox.watch import SettledFile
from chandrad.output.failures import Failures
from chandrad.runtime import Runtime
from chandrad.storage import folders
from chandrad.storage.journal import Journal

HOST = "bench-host"
DAYS = 365
CHUNK = 20_000  # rows per executemany (one transaction each)


def content(world: str, n: int) -> bytes:
    return f"%PDF-1.4 {world} document {n}\n".encode()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def settings_for(root: Path) -> Settings:
    inbox = InboxSettings.model_validate({"path": root / "inbox", "settle_seconds": 0})
    return Settings(
        state_dir=root / "state",
        inbox=(inbox,),
        engine=EngineSettings(kind="tesseract"),
        metrics_address="",
        host_id=HOST,
        retention=RetentionSettings(days=DAYS, batch_size=500),
    )


def build(root: Path, name: str, documents: int, old: int, now: float) -> Settings:
    """The world's folders, journal rows and seen markers; ``documents`` young, ``old`` past the cutoff."""
    settings = settings_for(root)
    inbox = settings.inbox[0]
    for folder in (inbox.path, inbox.outbox, inbox.failed, inbox.archive, settings.state_dir):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    (inbox.path / ".chandrad").mkdir(exist_ok=True)
    journal_path = settings.state_dir / "journal.sqlite3"
    Journal(journal_path).close()  # its schema, indexes and the triggers that keep the counts
    db = sqlite3.connect(journal_path)
    db.execute("PRAGMA synchronous = OFF")
    total = documents + old
    started = time.perf_counter()
    for first in range(0, total, CHUNK):
        docs, pages, deliveries = [], [], []
        for n in range(first, min(first + CHUNK, total)):
            at = now - (DAYS + 35) * DAY_SECONDS if n >= documents else now - (n % (300 * 86_400))
            doc_id = f"{name[0]}{n:015x}"
            rel = f"batch-{n // 1000:04d}/scan-{n}.pdf"
            data = content(name, n)
            docs.append(
                (doc_id, inbox.name, rel, sha(data), len(data), 0, "published", f"/outbox/{doc_id}", at, at)
            )
            pages.append((doc_id, 1, 1700, 2200, "<p>page</p>"))
            deliveries.append((doc_id, "webhook", "https://example.invalid/hook", "published", "{}", at, at))
        with db:
            db.executemany(
                "INSERT INTO documents (id, inbox, rel_path, sha256, size, mtime_ns, state, output_dir, "
                "created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                docs,
            )
            db.executemany("INSERT INTO pages (doc_id, page_no, width, height, html) VALUES (?, ?, ?, ?, ?)", pages)
            db.executemany(
                "INSERT INTO deliveries (doc_id, kind, target, event, payload, state, created_at, updated_at) "
                "VALUES (?, ?, ?, ?, ?, 'delivered', ?, ?)",
                deliveries,
            )
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    db.close()
    rows_s = time.perf_counter() - started
    started = time.perf_counter()
    made: set[Path] = set()
    for n in range(total):
        data = content(name, n)
        path = folders.seen_marker(inbox.path, sha(data))
        if path.parent not in made:
            path.parent.mkdir(parents=True, exist_ok=True)
            made.add(path.parent)
        body = {"host_id": HOST, "doc_id": f"{name[0]}{n:015x}", "rel_path": f"scan-{n}.pdf", "at": "2026-01-01"}
        path.write_text(json.dumps(body))
        if n >= documents:
            at = now - (DAYS + 35) * DAY_SECONDS
            os.utime(path, (at, at))
    markers_s = time.perf_counter() - started
    print(f"[{name}] built: {total} rows in {rows_s:.1f} s, {total} markers in {markers_s:.1f} s", flush=True)
    return settings


def quantiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "p50_ms": round(1000 * statistics.median(ordered), 3),
        "p90_ms": round(1000 * ordered[int(0.9 * (len(ordered) - 1))], 3),
        "n": len(ordered),
    }


async def take_in_each(intake: Intake, inbox: InboxSettings, files: list[tuple[str, bytes]]) -> list[float]:
    """Seconds of ``take_in`` per file, one file at a time (the file written before the clock starts)."""
    took = []
    for name, data in files:
        path = inbox.path / name
        path.write_bytes(data)
        st = path.lstat()
        settled = SettledFile(inbox, path, Path(name), st.st_size, st.st_mtime_ns, "regular")
        started = time.perf_counter()
        await intake.take_in(settled)
        took.append(time.perf_counter() - started)
    return took


def status_seconds(root: Path, settings: Settings, repeat: int) -> float:
    config = root / "config.toml"
    inbox = settings.inbox[0]
    config.write_text(
        f'state_dir = "{settings.state_dir}"\nhost_id = "{HOST}"\nmetrics_address = ""\n'
        f'[engine]\nkind = "tesseract"\n[[inbox]]\npath = "{inbox.path}"\n'
    )
    runner = CliRunner()
    took = []
    for _ in range(repeat):
        started = time.perf_counter()
        result = runner.invoke(cli_main, ["status", "--config", str(config)])
        took.append(time.perf_counter() - started)
        if result.exit_code != 0:
            raise SystemExit(f"chandrad status failed: {result.output}")
    return statistics.median(took)


async def measure(root: Path, name: str, settings: Settings, a: argparse.Namespace, known: list[bytes]) -> dict:
    inbox = settings.inbox[0]
    journal_path = settings.state_dir / "journal.sqlite3"
    result: dict[str, Any] = {}

    started = time.perf_counter()
    journal = Journal(journal_path)
    runtime = Runtime(settings, journal, create_engine(settings.engine, settings.state_dir))
    resumed = await recovery.recover(runtime)
    result["start_up_s"] = round(time.perf_counter() - started, 3)
    result["resumed"] = len(resumed)
    try:
        intake = Intake(runtime, Failures(runtime))
        new = [(f"new-{n}.pdf", content(name, 10_000_000 + n)) for n in range(a.files)]
        result["intake"] = quantiles(await take_in_each(intake, inbox, new))
        copies = [(f"copy-{n}.pdf", data) for n, data in enumerate(known[: a.copies])]
        before = journal.counts().get("failed", 0)
        result["duplicate"] = quantiles(await take_in_each(intake, inbox, copies))
        failed = journal.counts().get("failed", 0) - before
        if failed != len(copies):
            raise SystemExit(f"[{name}] {failed} of {len(copies)} copies were found duplicates")
        result["status_s"] = round(await asyncio.to_thread(status_seconds, root, settings, a.status_repeat), 3)
        result["journal_bytes"] = journal.size_bytes()

        report = await Pruner(lambda: settings, runtime).prune_once(time.time())
        if report.rows != a.old:
            raise SystemExit(f"[{name}] the prune removed {report.rows} rows, not the {a.old} old ones")
        result["prune"] = {
            "rows": report.rows,
            "rows_s": round(report.rows_seconds, 3),
            "rows_per_s": round(report.rows / report.rows_seconds, 1) if report.rows_seconds else None,
            "markers_removed": report.seen,
            "names_looked_at": report.examined,
            "markers_s": round(report.markers_seconds, 3),
            "names_per_s": round(report.examined / report.markers_seconds, 1) if report.markers_seconds else None,
        }
    finally:
        runtime.close()
        journal.close()
    print(f"[{name}] {json.dumps(result)}", flush=True)
    return result


def ratios(empty: dict, grown: dict) -> dict[str, float | None]:
    def over(a: float | None, b: float | None) -> float | None:
        return round(a / b, 2) if a and b else None

    return {
        "intake_p50": over(grown["intake"]["p50_ms"], empty["intake"]["p50_ms"]),
        "intake_p90": over(grown["intake"]["p90_ms"], empty["intake"]["p90_ms"]),
        "duplicate_p50": over(grown["duplicate"]["p50_ms"], empty["duplicate"]["p50_ms"]),
        "duplicate_p90": over(grown["duplicate"]["p90_ms"], empty["duplicate"]["p90_ms"]),
        "status": over(grown["status_s"], empty["status_s"]),
        "start_up": over(grown["start_up_s"], empty["start_up_s"]),
        # rates: empty over grown, so that above 1 means slower when grown, like the others
        "prune_rows_rate": over(empty["prune"]["rows_per_s"], grown["prune"]["rows_per_s"]),
        "prune_names_rate": over(empty["prune"]["names_per_s"], grown["prune"]["names_per_s"]),
    }


async def run(a: argparse.Namespace, workdir: Path) -> dict:
    now = time.time()
    worlds = {"empty": 0, "grown": a.documents}
    built = {name: build(workdir / name, name, documents, a.old, now) for name, documents in worlds.items()}
    results = {}
    for name, settings in built.items():
        # Copies of what the journal knows: in the grown world, documents of the million (spread
        # over it); in the empty one, its own old ones (all it has until intake adds more).
        count = worlds[name] or a.old
        step = max(count // a.copies, 1)
        known = [content(name, n) for n in range(0, count, step)][: a.copies]
        results[name] = await measure(workdir / name, name, settings, a, known)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--documents", type=int, default=1_000_000, help="final documents in the grown world")
    parser.add_argument("--old", type=int, default=20_000, help="documents past retention.days in each world")
    parser.add_argument("--files", type=int, default=200, help="new files taken in, in each world")
    parser.add_argument("--copies", type=int, default=100, help="copies taken in (the duplicate check)")
    parser.add_argument("--status-repeat", type=int, default=5)
    parser.add_argument("--workdir", type=Path, default=None, help="kept after the run (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args()
    started = time.perf_counter()
    if a.workdir is not None:
        a.workdir.mkdir(parents=True, exist_ok=False)
        results = asyncio.run(run(a, a.workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="chandrad-growth-", dir=os.environ.get("TMPDIR")) as tmp:
            results = asyncio.run(run(a, Path(tmp)))
    summary = {
        "bench": "growth",
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "documents": a.documents,
        "old": a.old,
        "files": a.files,
        "copies": a.copies,
        "results": results,
        "ratios_grown_over_empty": ratios(results["empty"], results["grown"]),
        "targets": {"ratios_at_most": 1.5, "start_up_s_at_most": 10.0},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    worst = max(value for value in summary["ratios_grown_over_empty"].values() if value is not None)
    ok = worst <= 1.5 and results["grown"]["start_up_s"] <= 10.0
    print(f"worst ratio {worst}; start-up at {a.documents}: {results['grown']['start_up_s']} s: "
          f"{'within' if ok else 'OUTSIDE'} the targets")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
