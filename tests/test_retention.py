"""Retention on a real journal and real folders: final rows, seen and takeover markers and long-dead
hosts' heartbeats older than ``retention.days`` go, younger ones stay; a copy of a pruned document
is processed again, a copy of a kept one is a duplicate (through the real intake); a kill -9 at any
point of a prune leaves nothing half removed, and the next pass finishes the job."""

from __future__ import annotations

import asyncio
import hashlib
import json
import multiprocessing
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

from chandrad.cli import main
from chandrad.config import EngineSettings, InboxSettings, RetentionSettings, Settings
from chandrad.document import retention
from chandrad.document.retention import DAY_SECONDS, Pruner
from chandrad.hosts import seen, sweep
from chandrad.inbox.intake import Intake
from chandrad.inbox.watch import SettledFile
from chandrad.output.failures import Failures
from chandrad.runtime import Runtime
from chandrad.service.daemon import Daemon
from chandrad.storage import folders
from chandrad.storage.journal import Document, Journal, NewDelivery
from chandrad.storage.schema import PageRecord
from chandrad.testing import ManualClock
from tests.reliability.chaoslib import DrawingEngine

NOW = 1_900_000_000.0  # the pass's "now" in tests that set every time themselves (2030)
OLD = NOW - 400 * DAY_SECONDS
YOUNG = NOW - DAY_SECONDS


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def aged(path: Path, at: float) -> Path:
    os.utime(path, (at, at), follow_symlinks=False)
    return path


def write(path: Path, data: bytes = b"{}", at: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return aged(path, at) if at is not None else path


def marker(inbox: Path, doc_id: str, content_sha: str, at: float, *, flat: bool = False) -> Path:
    where = folders.flat_seen_marker if flat else folders.seen_marker
    body = {"host_id": "host-a", "doc_id": doc_id, "rel_path": f"{doc_id}.pdf", "at": "2029-01-01T00:00:00Z"}
    return write(where(inbox, content_sha), json.dumps(body).encode(), at)


# -- a world: an inbox, a journal, the real intake -------------------------------------------------


@dataclass
class World:
    inbox: InboxSettings
    settings: Settings
    journal: Journal
    runtime: Runtime
    intake: Intake
    clock: ManualClock

    def pruner(self) -> Pruner:
        return Pruner(lambda: self.settings, self.runtime, first_pass_seconds=0.0)

    async def take_in(self, name: str, data: bytes) -> Document | None:
        path = self.inbox.path / name
        path.write_bytes(data)
        st = path.lstat()
        settled = SettledFile(self.inbox, path, Path(name), st.st_size, st.st_mtime_ns, "regular")
        return await self.intake.take_in(settled)

    def state_of(self, name: str) -> str | None:
        states = {doc.rel_path: doc.state for doc in self.journal.recent(1000)}
        return states.get(name)


def make_world(tmp_path: Path, days: float = 30.0, batch_size: int = 500, interval: float = 3600.0) -> World:
    inbox = InboxSettings.model_validate({"path": tmp_path / "inbox", "settle_seconds": 0})
    settings = Settings(
        state_dir=tmp_path / "state",
        inbox=(inbox,),
        engine=EngineSettings(kind="tesseract"),
        metrics_address="",
        host_id="host-a",
        retention=RetentionSettings(days=days, batch_size=batch_size, interval_seconds=interval),
    )
    for folder in (inbox.path, inbox.outbox, inbox.failed, inbox.archive, settings.state_dir):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    (inbox.path / ".chandrad").mkdir()
    clock = ManualClock(OLD)
    journal = Journal(settings.state_dir / "journal.sqlite3", clock=clock)
    runtime = Runtime(settings, journal, DrawingEngine(), clock=clock)
    return World(inbox, settings, journal, runtime, Intake(runtime, Failures(runtime)), clock)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    made = make_world(tmp_path)
    yield made
    made.runtime.close()
    made.journal.close()


async def published(world: World, name: str, data: bytes, at: float) -> Document:
    """A document taken in at ``at`` (its seen marker made then, as the clock says) and published."""
    world.clock.now = at
    doc = await world.take_in(name, data)
    assert doc is not None
    aged(folders.seen_marker(world.inbox.path, doc.sha256), at)
    return world.journal.publish(doc.id, [])


# -- duplicates within the window ------------------------------------------------------------------


async def test_a_copy_of_a_pruned_document_is_processed_again_and_a_copy_of_a_kept_one_is_a_duplicate(world):
    old = await published(world, "old.pdf", b"old content", OLD)
    young = await published(world, "young.pdf", b"young content", YOUNG)

    report = await world.pruner().prune_once(NOW)

    assert (report.rows, report.seen) == (1, 1)
    assert world.journal.find(old.id) is None and world.journal.find(young.id) is not None
    assert not folders.seen_marker(world.inbox.path, old.sha256).exists()
    assert folders.seen_marker(world.inbox.path, young.sha256).exists()
    world.clock.now = NOW
    again = await world.take_in("old-again.pdf", b"old content")
    assert again is not None and again.state == "queued", "forgotten: taken in as new"
    assert await world.take_in("young-again.pdf", b"young content") is None
    assert world.state_of("young-again.pdf") == "failed"
    copy = next(doc for doc in world.journal.recent(10) if doc.rel_path == "young-again.pdf")
    assert copy.error is not None and copy.error["kind"] == "duplicate"


async def test_a_copy_stays_a_duplicate_while_either_its_row_or_its_seen_marker_is_left(world):
    """Intake asks the journal and the marker: both must be gone for a copy to be processed again."""
    row_left = await published(world, "row-left.pdf", b"row left", YOUNG)
    marker_left = await published(world, "marker-left.pdf", b"marker left", OLD)
    aged(folders.seen_marker(world.inbox.path, row_left.sha256), OLD)  # its marker old, its row young
    aged(folders.seen_marker(world.inbox.path, marker_left.sha256), YOUNG)  # the other way round

    await world.pruner().prune_once(NOW)

    assert world.journal.find(row_left.id) is not None
    assert not folders.seen_marker(world.inbox.path, row_left.sha256).exists()
    assert world.journal.find(marker_left.id) is None
    assert folders.seen_marker(world.inbox.path, marker_left.sha256).exists()
    world.clock.now = NOW
    assert await world.take_in("copy-1.pdf", b"row left") is None
    assert await world.take_in("copy-2.pdf", b"marker left") is None
    assert world.state_of("copy-1.pdf") == world.state_of("copy-2.pdf") == "failed"


async def test_with_days_zero_nothing_is_ever_pruned(tmp_path):
    world = make_world(tmp_path, days=0)
    try:
        old = await published(world, "old.pdf", b"kept forever", OLD)
        report = await world.pruner().prune_once(NOW + 100 * 365 * DAY_SECONDS)
        assert report.removed == 0 and report.batches == 0
        assert world.journal.find(old.id) is not None
        assert folders.seen_marker(world.inbox.path, old.sha256).exists()
    finally:
        world.runtime.close()
        world.journal.close()


# -- seen markers: sharded, the flat layout still read -----------------------------------------------


def test_a_seen_marker_is_written_sharded_and_an_older_chandrads_flat_one_still_counts(tmp_path):
    journal = Journal(tmp_path / "journal.sqlite3")
    try:
        content = sha("sharded")
        first = journal.add_document("scans", "a.pdf", content, 1, 1)
        second = journal.add_document("scans", "b.pdf", content, 1, 1)
        assert seen.mark_seen(tmp_path, content, "host-a", first) is None
        sharded = tmp_path / ".chandrad" / "seen" / content[:2] / content[2:4] / content
        assert json.loads(sharded.read_text())["doc_id"] == first.id
        assert not (tmp_path / ".chandrad" / "seen" / content).exists()

        flat_content = sha("flat")
        flat = marker(tmp_path, "0123456789abcdef", flat_content, YOUNG, flat=True)
        twin = seen.mark_seen(tmp_path, flat_content, "host-a", second)
        assert twin is not None and twin["doc_id"] == "0123456789abcdef", "the flat marker names a twin"
        assert not folders.seen_marker(tmp_path, flat_content).exists(), "no second marker beside it"

        seen.forget_seen(tmp_path, flat_content, "someone-else")
        assert flat.exists(), "only the marker of the document that failed goes"
        seen.forget_seen(tmp_path, flat_content, "0123456789abcdef")
        assert not flat.exists()
        seen.forget_seen(tmp_path, content, first.id)
        assert not sharded.exists()
    finally:
        journal.close()


async def test_a_copy_of_content_an_older_chandrad_marked_flat_is_a_duplicate_through_intake(world):
    world.clock.now = NOW
    marker(world.inbox.path, "0123456789abcdef", sha("legacy"), YOUNG, flat=True)
    assert await world.take_in("legacy.pdf", b"legacy") is None
    assert world.state_of("legacy.pdf") == "failed"


# -- the journal's prune -----------------------------------------------------------------------------


def test_the_journal_prune_takes_old_final_rows_with_their_pages_and_deliveries_in_batches(tmp_path):
    clock = ManualClock(OLD)
    journal = Journal(tmp_path / "journal.sqlite3", clock=clock)
    try:
        ids: dict[str, list[str]] = {"old": [], "pending": [], "unfinished": [], "young": []}
        for n in range(5):
            doc = journal.add_document("scans", f"old-{n}.pdf", sha(f"old-{n}"), 1, 1)
            journal.record_page(PageRecord(doc.id, 1, 10, 10, "<p>x</p>"))
            journal.publish(doc.id, [NewDelivery("webhook", "erp", "published", "{}")]) if n % 2 else journal.fail(
                doc.id, {"reason": "bad"}, [NewDelivery("hook", "dms", "failed", "{}")]
            )
            delivery = journal.deliveries(doc_id=doc.id)[0]
            journal.delivery_attempted(delivery.id, "delivered" if n % 2 else "failed", status=200, error=None)
            ids["old"].append(doc.id)
        pending = journal.add_document("scans", "pending.pdf", sha("pending"), 1, 1)
        journal.publish(pending.id, [NewDelivery("webhook", "erp", "published", "{}")])
        ids["pending"].append(pending.id)
        unfinished = journal.add_document("scans", "stuck.pdf", sha("stuck"), 1, 1)
        journal.set_state(unfinished.id, "queued", claimed_path="/claimed/stuck.pdf")
        ids["unfinished"].append(unfinished.id)
        clock.now = YOUNG
        young = journal.add_document("scans", "young.pdf", sha("young"), 1, 1)
        journal.publish(young.id, [])
        ids["young"].append(young.id)
        cutoff = NOW - 365 * DAY_SECONDS

        first = journal.prune(cutoff, 2)
        assert len(first) == 2 and {p.id for p in first} <= set(ids["old"])
        assert {(p.inbox, p.sha256) for p in first} <= {("scans", sha(f"old-{n}")) for n in range(5)}
        rest = journal.prune(cutoff, 100)
        assert {p.id for p in first + rest} == set(ids["old"])
        assert journal.prune(cutoff, 100) == []

        left = {doc.id for doc in journal.recent(100)}
        assert left == {*ids["pending"], *ids["unfinished"], *ids["young"]}
        db = journal._db
        assert db.execute("SELECT COUNT(*) FROM pages").fetchone()[0] == 0
        assert {row[0] for row in db.execute("SELECT doc_id FROM deliveries")} == set(ids["pending"])
        assert journal.counts() == {"published": 2, "queued": 1}
        assert journal.delivery_counts() == {"pending": 1}

        journal.delivery_attempted(journal.deliveries(doc_id=pending.id)[0].id, "delivered", status=200, error=None)
        assert [p.id for p in journal.prune(cutoff, 100)] == [pending.id], "delivered now: it goes"
    finally:
        journal.close()


def test_counts_kept_by_the_triggers_match_the_tables_and_an_older_journal_gets_them_filled(tmp_path):
    path = tmp_path / "journal.sqlite3"
    journal = Journal(path)
    doc = journal.add_document("scans", "a.pdf", "aa", 1, 1)
    journal.publish(doc.id, [NewDelivery("webhook", "erp", "published", "{}")])
    journal.add_document("scans", "b.pdf", "bb", 1, 1)
    journal.close()
    db = sqlite3.connect(path)  # as an older chandrad left it: no tally, no triggers
    db.executescript(
        "DROP TRIGGER documents_count_insert; DROP TRIGGER documents_count_update; "
        "DROP TRIGGER documents_count_delete; DROP TRIGGER deliveries_count_insert; "
        "DROP TRIGGER deliveries_count_update; DROP TRIGGER deliveries_count_delete; DROP TABLE state_counts;"
    )
    db.execute(
        "INSERT INTO documents (id, inbox, rel_path, sha256, size, mtime_ns, state, created_at, updated_at) "
        "VALUES ('c', 'scans', 'c.pdf', 'cc', 1, 1, 'failed', 1, 1)"
    )
    db.commit()
    db.close()
    journal = Journal(path)
    try:
        assert journal.counts() == {"published": 1, "settled": 1, "failed": 1}
        assert journal.delivery_counts() == {"pending": 1}
        journal.set_state("c", "queued")
        journal.prune(10**10, 10)
        grouped = dict(journal._db.execute("SELECT state, COUNT(*) FROM documents GROUP BY state").fetchall())
        assert journal.counts() == grouped == {"settled": 1, "queued": 1, "published": 1}
    finally:
        journal.close()


# -- markers, takeover markers and dead hosts ---------------------------------------------------------


def lay_out_markers(inbox: Path) -> dict[str, list[Path]]:
    """Old and young things of every kind a pass looks at, by what must become of them."""
    claims = folders.claimed_root(inbox)
    gone: list[Path] = []
    kept: list[Path] = []
    for n in range(6):
        gone.append(marker(inbox, f"old{n:013d}", sha(f"old-{n}"), OLD))
        kept.append(marker(inbox, f"young{n:011d}", sha(f"young-{n}"), YOUNG))
    gone.append(marker(inbox, "oldflat", sha("old-flat"), OLD, flat=True))
    kept.append(marker(inbox, "youngflat", sha("young-flat"), YOUNG, flat=True))
    seen = folders.seen_marker(inbox, sha("old-0")).parent
    gone.append(write(seen / f".{sha('x')}.host-b.123.tmp", at=OLD))  # a crash's leftover
    kept.append(write(seen / "README", at=OLD))  # not ours: never touched
    # host-b: alive; its old takeover markers go, the young one stays
    kept.append(write(claims / "host-b" / "heartbeat", at=YOUNG))
    gone.append(write(claims / "host-b" / "0000000000000001.taken", at=OLD))
    kept.append(write(claims / "host-b" / "0000000000000002.taken", at=YOUNG))
    kept.append(write(claims / "host-b" / "0000000000000003" / "scan.pdf", b"%PDF", at=OLD))
    # host-c: dead for longer than days, nothing of its claims holds a file: all of it goes
    gone.append(write(claims / "host-c" / "0000000000000004.taken", at=OLD))
    gone.append(write(claims / "host-c" / "0000000000000005" / ".claim.json", at=OLD))
    gone.append(write(claims / "host-c" / ".heartbeat.tmp", at=OLD))
    gone.append(write(claims / "host-c" / "heartbeat", at=OLD))
    aged(claims / "host-c" / "0000000000000005", OLD)
    gone.append(aged(claims / "host-c", OLD))
    # host-d: dead as long, but a claim of it holds a file: the heartbeat stays for its takeover
    kept.append(write(claims / "host-d" / "heartbeat", at=OLD))
    kept.append(write(claims / "host-d" / "0000000000000006" / "scan.pdf", b"%PDF", at=OLD))
    # our own heartbeat is never judged, however old it looks
    kept.append(write(claims / "host-a" / "heartbeat", at=OLD))
    gone.append(write(claims / "host-a" / "0000000000000007.taken", at=OLD))
    # an empty folder without a heartbeat, unchanged for long: nothing in it to keep
    (claims / "0000000000000008").mkdir(parents=True)
    gone.append(aged(claims / "0000000000000008", OLD))
    return {"gone": gone, "kept": kept}


async def test_old_markers_and_long_dead_hosts_go_and_young_ones_and_anything_holding_a_file_stay(world):
    laid = lay_out_markers(world.inbox.path)
    report = await world.pruner().prune_once(NOW)
    assert [path for path in laid["gone"] if path.exists()] == []
    assert [path for path in laid["kept"] if not path.exists()] == []
    assert (report.seen, report.taken, report.heartbeats, report.leftovers) == (7, 3, 1, 2)
    assert report.folders == 3  # host-c's empty claim folder and its own folder, the empty one


async def test_a_pass_runs_every_journal_batch_and_marker_step_off_the_event_loop(tmp_path, monkeypatch):
    world = make_world(tmp_path, batch_size=2)
    try:
        for n in range(5):
            await published(world, f"old-{n}.pdf", f"old {n}".encode(), OLD)
        lay_out_markers(world.inbox.path)
        threads: list[str] = []
        real_prune, real_step = Journal.prune, sweep.MarkerSweep.step

        def prune(self: Journal, cutoff: float, limit: int) -> object:
            threads.append(threading.current_thread().name)
            return real_prune(self, cutoff, limit)

        def step(self: sweep.MarkerSweep, limit: int) -> bool:
            threads.append(threading.current_thread().name)
            return real_step(self, limit)

        monkeypatch.setattr(Journal, "prune", prune)
        monkeypatch.setattr(sweep.MarkerSweep, "step", step)
        report = await world.pruner().prune_once(NOW)
        assert report.rows == 5 and report.batches == 3 and report.steps > 5
        assert len(threads) == report.batches + report.steps
        assert threading.main_thread().name not in threads
        assert all(name.startswith(("journal", "inbox:")) for name in threads), threads
    finally:
        world.runtime.close()
        world.journal.close()


async def eventually(predicate: Callable[[], bool], seconds: float = 10.0) -> bool:
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def test_the_pruner_passes_first_shortly_after_the_start_then_every_interval(tmp_path):
    world = make_world(tmp_path, interval=0.05)
    try:
        first = await published(world, "first.pdf", b"first", OLD)
        world.clock.now = NOW
        task = asyncio.create_task(world.pruner().run())
        try:
            assert await eventually(lambda: world.journal.find(first.id) is None), "no first pass"
            # Made at the real time, then made old by the clock: the passes running meanwhile must not
            # find its new marker (the file's own time) old before it is aged (seen once in CI).
            made_at = time.time()
            second = await published(world, "second.pdf", b"second", made_at)
            world.clock.now = made_at + 400 * DAY_SECONDS
            assert await eventually(lambda: world.journal.find(second.id) is None), "no pass after the first"
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        world.runtime.close()
        world.journal.close()


async def test_the_daemon_runs_the_pruner_as_one_of_its_loops(tmp_path, monkeypatch):
    monkeypatch.setattr(retention, "FIRST_PASS_SECONDS", 0.0)
    world = make_world(tmp_path)
    old = await published(world, "old.pdf", b"published long ago", time.time() - 400 * DAY_SECONDS)
    world.runtime.close()
    world.journal.close()
    old_marker = folders.seen_marker(world.inbox.path, old.sha256)
    daemon = Daemon(world.settings, engine=DrawingEngine())
    serving = asyncio.create_task(daemon.serve())
    try:
        assert await eventually(lambda: not old_marker.exists(), 60), "the running daemon pruned the old marker"
    finally:
        daemon.handle_exit()
        async with asyncio.timeout(60):
            await serving
    journal = Journal(world.settings.state_dir / "journal.sqlite3")
    try:
        assert journal.find(old.id) is None, "and the old row"
    finally:
        journal.close()


def test_status_shows_the_journals_size_and_its_oldest_document(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(f'state_dir = "{state}"\n[retention]\ndays = 90\n[[inbox]]\npath = "{tmp_path}/in"\n')
    clock = ManualClock(OLD)
    journal = Journal(state / "journal.sqlite3", clock=clock)
    oldest = journal.add_document("in", "first.pdf", "aa", 1, 1)
    clock.now = YOUNG
    journal.publish(oldest.id, [])
    journal.add_document("in", "second.pdf", "bb", 1, 1)
    journal.close()
    size = (state / "journal.sqlite3").stat().st_size

    result = CliRunner().invoke(main, ["status", "--config", str(config), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)["journal"]
    assert facts["size_bytes"] >= size > 0 and facts["retention_days"] == 90
    assert (facts["oldest"]["doc"], facts["oldest"]["state"]) == (oldest.id, "published")
    text = CliRunner().invoke(main, ["status", "--config", str(config)]).stdout.splitlines()
    assert text[1].startswith("journal: ") and " MB; oldest document first seen " in text[1]
    assert "(published, last change " in text[1] and text[1].endswith("final documents kept 90 days")


# -- kill -9 during a prune ---------------------------------------------------------------------------


def prune_then_maybe_die(spec: dict[str, object]) -> None:
    """In a child process: one pass over the prepared journal and inbox, SIGKILLed by itself at the
    ``spec["at"]``-th point of the kind ``spec["kill"]`` names ("none": the pass runs to its end)."""
    kill, at = spec["kill"], spec["at"]
    assert isinstance(at, int)
    hits = [0]

    def count(hit: bool) -> None:
        if hit:
            hits[0] += 1
            if hits[0] >= at:
                os.kill(os.getpid(), signal.SIGKILL)

    inbox = InboxSettings.model_validate({"path": spec["inbox"]})
    settings = Settings(
        state_dir=Path(str(spec["state"])),
        inbox=(inbox,),
        engine=EngineSettings(kind="tesseract"),
        metrics_address="",
        host_id="host-a",
        takeover_seconds=60.0,
        retention=RetentionSettings(days=365, batch_size=spec["batch"]),
    )
    journal = Journal(settings.state_dir / "journal.sqlite3")
    if kill == "statement":  # inside a batch's transaction, as its n-th document row is deleted
        journal._db.set_trace_callback(lambda sql: count(sql.startswith("DELETE FROM documents")))
    real_step, real_unlink = sweep.MarkerSweep.step, sweep._unlink

    def step(self: sweep.MarkerSweep, limit: int) -> bool:  # after n whole marker steps
        done = real_step(self, limit)
        count(kill == "step")
        return done

    def unlink(path: Path) -> bool:  # after the n-th removal in a step; or after a dead host's heartbeat
        removed = real_unlink(path)
        count(removed and (kill == "unlink" or (kill == "heartbeat" and path.name == "heartbeat")))
        return removed

    sweep.MarkerSweep.step = step  # type: ignore[method-assign]
    sweep._unlink = unlink
    runtime = Runtime(settings, journal, DrawingEngine())
    asyncio.run(Pruner(lambda: settings, runtime).prune_once(float(str(spec["now"]))))


def run_child(root: Path, kill: str, at: int, batch: int, now: float) -> int | None:
    """``prune_then_maybe_die`` in a child process (forked from a server that has chandrad imported
    already: a fresh interpreter spends 1.5 s importing it); its exit code."""
    spec = {
        "kill": kill,
        "at": at,
        "inbox": str(root / "inbox"),
        "state": str(root / "state"),
        "batch": batch,
        "now": now,
    }
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.test_retention"])
    child = context.Process(target=prune_then_maybe_die, args=(spec,))
    child.start()
    child.join(60)
    if child.exitcode is None:
        child.kill()
        child.join()
    return child.exitcode


def prepare(root: Path, batch: int) -> tuple[dict[str, set[str]], dict[str, list[Path]]]:
    """A journal with old final documents (with a page and a delivery each), old ones whose
    delivery is pending or that are not final, young ones; and the markers of ``lay_out_markers``."""
    clock = ManualClock(OLD)
    journal = Journal(root / "state" / "journal.sqlite3", clock=clock)
    docs: dict[str, set[str]] = {"gone": set(), "kept": set()}
    try:
        for n in range(4 * batch + 3):
            doc = journal.add_document("inbox", f"old-{n}.pdf", sha(f"doc-{n}"), 1, 1)
            journal.record_page(PageRecord(doc.id, 1, 10, 10, "<p>x</p>"))
            journal.publish(doc.id, [NewDelivery("webhook", "erp", "published", "{}")])
            if n % 7 == 3:
                docs["kept"].add(doc.id)  # its delivery still pending
                continue
            delivery = journal.deliveries(doc_id=doc.id)[0]
            journal.delivery_attempted(delivery.id, "delivered", status=200, error=None)
            docs["gone"].add(doc.id)
        stuck = journal.add_document("inbox", "stuck.pdf", sha("stuck"), 1, 1)
        journal.record_page(PageRecord(stuck.id, 1, 10, 10, "<p>x</p>"))
        docs["kept"].add(journal.set_state(stuck.id, "inferring", claimed_path="/c/stuck.pdf").id)
        clock.now = YOUNG
        for n in range(3):
            doc = journal.add_document("inbox", f"young-{n}.pdf", sha(f"young-doc-{n}"), 1, 1)
            docs["kept"].add(journal.publish(doc.id, [NewDelivery("hook", "dms", "published", "{}")]).id)
    finally:
        journal.close()
    return docs, lay_out_markers(root / "inbox")


def check_whole(root: Path, docs: dict[str, set[str]]) -> set[str]:
    """Each document is all there (row, page, delivery) or all gone; every kept one is there; no
    row points at a missing document; the tally matches the tables. Returns the ids still there."""
    db = sqlite3.connect(root / "state" / "journal.sqlite3")
    try:
        left = {row[0] for row in db.execute("SELECT id FROM documents")}
        pages = {row[0] for row in db.execute("SELECT doc_id FROM pages")}
        deliveries = {row[0] for row in db.execute("SELECT doc_id FROM deliveries")}
        assert docs["kept"] <= left, "a document that was to be kept is gone"
        assert left <= docs["gone"] | docs["kept"]
        assert pages <= left and deliveries <= left, "a page or delivery row outlived its document"
        gone_but_whole = {doc for doc in docs["gone"] & left if doc in pages and doc in deliveries}
        assert docs["gone"] & left == gone_but_whole, "a document half removed: its row without its page or delivery"
        assert db.execute("PRAGMA foreign_key_check").fetchall() == []
        tally = dict(db.execute("SELECT state, n FROM state_counts WHERE tbl = 'documents' AND n > 0").fetchall())
        assert tally == dict(db.execute("SELECT state, COUNT(*) FROM documents GROUP BY state").fetchall())
        return left
    finally:
        db.close()


@pytest.mark.parametrize(
    ("kill", "at"),
    [("statement", 1), ("statement", 9), ("step", 2), ("unlink", 4), ("heartbeat", 1)],
    ids=[
        "first-row-of-a-batch",
        "mid-third-batch",
        "after-two-marker-steps",
        "mid-marker-step",
        "between-a-heartbeat-and-its-folder",
    ],
)
def test_a_prune_killed_at_any_point_leaves_nothing_half_removed_and_the_next_pass_finishes_it(
    tmp_path: Path, kill: str, at: int
) -> None:
    batch = 4
    (tmp_path / "inbox" / ".chandrad").mkdir(parents=True)
    (tmp_path / "state").mkdir()
    docs, laid = prepare(tmp_path, batch)

    assert run_child(tmp_path, kill, at, batch, NOW) == -signal.SIGKILL, "the kill point was never reached"
    check_whole(tmp_path, docs)
    assert [path for path in laid["kept"] if not path.exists()] == [], "something to keep was removed"

    # Past takeover_seconds (the heartbeat-less folder's wait), well within retention.days.
    assert run_child(tmp_path, "none", 0, batch, NOW + 61) == 0
    assert check_whole(tmp_path, docs) == docs["kept"]
    assert [path for path in laid["gone"] if path.exists()] == [], "the next pass left some behind"
    assert [path for path in laid["kept"] if not path.exists()] == []
