"""The world around the daemon changes under it: inbox and outbox removed, unmounted and
re-created; files it may not read; clocks that jump."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chandrad.config import EngineSettings, InboxSettings, Settings
from chandrad.document.pipeline import Pipeline
from chandrad.inbox.watch import SettledFile
from chandrad.storage.journal import Journal
from tests.reliability.chaoslib import (
    ChaosDaemon,
    DrawingEngine,
    Expect,
    check_accounted,
    corpus_bytes,
    drop_bytes,
    record_figures,
    simple_pdf,
    text_png,
    wait_for,
)


def test_an_inbox_unmounted_mid_document_and_mounted_again_loses_nothing(chaos_factory, tmp_path):
    """The share disappears (here: the folder is renamed away, taking the claimed original with it)
    while a six-page scan is being read, and comes back 4 s later: the document waits and is
    published once, instead of being failed as 'disappeared'."""
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", extra_config="max_documents_in_flight = 1\nmax_attempts = 2")
    inputs = {"scan.pdf": Expect(corpus_bytes("multipage.pdf"), pages=6)}
    daemon.start()
    drop_bytes(daemon.inbox, "scan.pdf", inputs["scan.pdf"].data)
    wait_for(lambda: daemon.journal_rows("SELECT 1 FROM pages"), 60, "the first page", interval=0.05)
    away = tmp_path / "tree" / "inbox.unmounted"
    os.rename(daemon.inbox, away)
    time.sleep(4)
    assert daemon.alive
    assert daemon.states()["scan.pdf"] not in ("failed", "published"), daemon.states()
    os.rename(away, daemon.inbox)
    wait_for(lambda: daemon.final_count() == 1, 120, "the scan to be published once the inbox is back")
    assert daemon.stop() == 0
    check_accounted(daemon, inputs)
    assert daemon.states() == {"scan.pdf": "published"}
    record_figures("inbox unmounted 4 s mid-document", losses=0, duplicates=0, state="published")


def test_an_inbox_removed_and_recreated_is_watched_again_at_once(chaos_factory, tmp_path):
    """rm -rf of the inbox, then mkdir: inotify's watch died with the old folder. Files dropped into
    the new folder are seen within seconds, not only at the next periodic rescan (60 s here)."""
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", inbox_config="rescan_seconds = 60")
    daemon.start()
    drop_bytes(daemon.inbox, "before.png", text_png("before removal"))
    wait_for(lambda: daemon.final_count() == 1, 60, "the first document")
    shutil.rmtree(daemon.inbox)
    time.sleep(2)
    daemon.inbox.mkdir()
    time.sleep(1)
    dropped = time.monotonic()
    drop_bytes(daemon.inbox, "after.png", text_png("after re-creation"))
    wait_for(lambda: daemon.final_count() == 2, 30, "the file dropped into the re-created inbox")
    latency = time.monotonic() - dropped
    assert daemon.stop() == 0
    assert daemon.states() == {"before.png": "published", "after.png": "published"}
    record_figures("inbox removed and re-created", seconds_to_publish_after=round(latency, 1))
    assert latency < 15, f"took {latency:.0f} s: the re-created inbox was only found by the periodic rescan"


def test_an_outbox_removed_and_recreated_while_working_still_publishes_whole_documents(chaos_factory, tmp_path):
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree", extra_config="max_documents_in_flight = 1")
    inputs = {"long.pdf": Expect(corpus_bytes("multipage.pdf"), pages=6),
              "short.png": Expect(text_png("outbox removed"), pages=1)}
    daemon.start()
    drop_bytes(daemon.inbox, "long.pdf", inputs["long.pdf"].data)
    wait_for(lambda: daemon.journal_rows("SELECT 1 FROM pages"), 60, "the first page", interval=0.05)
    shutil.rmtree(daemon.outbox)  # staging lives in the outbox: it goes too
    time.sleep(1)
    daemon.outbox.mkdir()
    drop_bytes(daemon.inbox, "short.png", inputs["short.png"].data)
    wait_for(lambda: daemon.final_count() == 2, 120, "both documents")
    assert daemon.stop() == 0
    check_accounted(daemon, inputs)
    assert daemon.states() == {"long.pdf": "published", "short.png": "published"}


async def test_page_figures_lost_from_staging_are_redone_before_publishing(tmp_path, monkeypatch):
    """The outbox (and staging with it) is wiped after page 1's figure was saved: publishing must
    not ship Markdown/HTML pointing at a figure that no longer exists."""
    inbox = InboxSettings(path=tmp_path / "inbox", settle_seconds=0)
    settings = Settings(state_dir=tmp_path / "state", inbox=(inbox,), engine=EngineSettings(kind="tesseract"),
                        retry_backoff_seconds=0, max_attempts=3)
    for folder in (inbox.path, inbox.outbox, inbox.failed, inbox.archive, settings.state_dir):
        folder.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
    source = inbox.path / "two.pdf"
    source.write_bytes(simple_pdf(2, label="figures"))
    journal = Journal(settings.state_dir / "journal.sqlite3")
    engine = DrawingEngine()
    calls = {"n": 0}
    real_ocr = engine.ocr

    async def ocr(request):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 2:  # page 2 is being read: once page 1's figure is in staging, wipe the outbox
            for _ in range(500):
                if list(inbox.outbox.glob(".chandrad/staging/*/*/doc/images/*")):
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("page 1's figure never reached staging")
            shutil.rmtree(inbox.outbox)
            inbox.outbox.mkdir()
        return await real_ocr(request)

    monkeypatch.setattr(engine, "ocr", ocr)
    pipeline = Pipeline(settings, journal, engine)
    st = source.lstat()
    doc = await pipeline.take_in(SettledFile(inbox, source, Path("two.pdf"), st.st_size, st.st_mtime_ns, "regular"))
    assert doc is not None
    first = await pipeline.process(doc.id)
    assert first.state == "queued" and "vanished" in first.reason, first  # noticed before publishing
    outcome = await pipeline.process(doc.id)  # the retry redoes page 1 only
    journal.close()
    assert calls["n"] == 3, "only the page whose figure was lost is read again"
    assert outcome.state == "published", outcome
    document = json.loads((inbox.outbox / "two" / "two.json").read_text())
    images = [image for page in document["pages"] for image in page["images"]]
    assert len(set(images)) == 2, f"each page keeps its own figure (identical HTML, different pages): {images}"
    assert all((inbox.outbox / "two" / image).is_file() for image in images), images
    markdown = (inbox.outbox / "two" / "two.md").read_text()
    assert all(image in markdown for image in images), "the Markdown points at each page's own figure"


# -- permissions -------------------------------------------------------------------------------

NOBODY = 65534


@pytest.fixture
def open_tree() -> Iterator[Path]:
    """A tree outside pytest's 0700 tmp folder, owned by nobody (the daemon's user there)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the daemon as an unprivileged user")
    root = Path(tempfile.mkdtemp(prefix="chandrad-perm-", dir="/tmp"))
    root.chmod(0o755)
    tree = root / "tree"
    tree.mkdir()
    os.chown(tree, NOBODY, NOBODY)
    try:
        yield tree
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_files_the_daemon_may_not_read_or_move_fail_with_a_reason_as_an_unprivileged_user(chaos_factory, open_tree):
    daemon: ChaosDaemon = chaos_factory(open_tree, user=NOBODY)
    for folder in (daemon.inbox, daemon.outbox, daemon.archive, daemon.failed, daemon.state):
        folder.mkdir()
        os.chown(folder, NOBODY, NOBODY)
    os.chown(daemon.config, NOBODY, NOBODY)
    daemon.start()
    probe = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
                            "--inh-caps=-all", "--bounding-set=-all", "cat", "/etc/shadow"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("an unprivileged user can read /etc/shadow here: permissions are not enforced")
    readable = text_png("readable")
    drop_bytes(daemon.inbox, "readable.png", readable)
    os.chown(daemon.inbox / "readable.png", NOBODY, NOBODY)
    secret = drop_bytes(daemon.inbox, "unreadable.png", text_png("unreadable"))  # root's, mode 0600
    secret.chmod(0o600)
    locked_dir = daemon.inbox / "locked"  # root's folder: nobody may not move files out of it
    locked_dir.mkdir(mode=0o755)
    stuck = locked_dir / "stuck.png"
    stuck.write_bytes(text_png("cannot be moved"))
    wait_for(lambda: daemon.final_count() >= 3 or not daemon.alive, 60, "all three")
    time.sleep(6)  # a rescan (5 s) must not take the unmovable file in again
    assert daemon.alive
    states = daemon.journal_rows("SELECT rel_path, state, error FROM documents")
    assert sorted((row["rel_path"], row["state"]) for row in states) == [
        ("locked/stuck.png", "failed"), ("readable.png", "published"), ("unreadable.png", "failed")]
    report = json.loads((daemon.failed / "unreadable.png.error.json").read_text())
    assert "permission denied" in report["reason"]
    assert (daemon.failed / "unreadable.png").exists() and (daemon.failed / "unreadable.png").stat().st_uid == 0
    stuck_report = json.loads((daemon.failed / "locked" / "stuck.png.error.json").read_text())
    assert "cannot move the file out of the inbox" in stuck_report["reason"]
    assert stuck.exists(), "a file that cannot be moved stays where it is"
    assert daemon.stop() == 0
    record_figures("permission denied (daemon as uid 65534)", published=1, failed=2,
                   reasons=[report["reason"], stuck_report["reason"]])


# -- clocks --------------------------------------------------------------------------------------


def test_files_with_mtimes_far_in_the_future_or_past_settle_and_publish(chaos_factory, tmp_path):
    """The watcher settles on a monotonic clock and compares mtimes only for change: a scanner
    whose clock is decades off (or a file copied with its 1970 timestamp) is processed normally."""
    daemon: ChaosDaemon = chaos_factory(tmp_path / "tree")
    inputs = {"future.png": Expect(text_png("from 2100"), pages=1), "past.png": Expect(text_png("from 1970"), pages=1)}
    daemon.start()
    for name, expect in inputs.items():
        path = daemon.inbox / name
        tmp = path.with_suffix(".part")
        tmp.write_bytes(expect.data)
        stamp = 4_102_444_800 if "future" in name else 1
        os.utime(tmp, (stamp, stamp))
        os.replace(tmp, path)
    wait_for(lambda: daemon.final_count() == 2, 60, "both files")
    assert daemon.stop() == 0
    check_accounted(daemon, inputs)


def test_duplicates_are_ordered_by_journal_insertion_not_by_a_wall_clock_that_jumped_back(tmp_path):
    """The clock steps back an hour between two identical files: the second is still the
    duplicate, and a resumed first copy is not called a duplicate of the second."""
    now = [10_000.0]
    journal = Journal(tmp_path / "journal.sqlite3", clock=lambda: now[0])
    first = journal.add_document("inbox", "first.pdf", "same-sha", 10, 1)
    journal.set_state(first.id, "queued")
    now[0] -= 3600
    second = journal.add_document("inbox", "second.pdf", "same-sha", 10, 2)
    journal.set_state(second.id, "queued")
    assert journal.find_duplicate("same-sha", second.id, True).id == first.id  # type: ignore[union-attr]
    assert journal.find_duplicate("same-sha", first.id, True) is None
    journal.close()





async def test_a_retry_scheduled_before_the_clock_steps_back_an_hour_still_runs_on_time(tmp_path, monkeypatch):
    import chandrad.service.daemon as daemon_module
    from chandrad.service.daemon import Daemon

    settings = Settings(state_dir=tmp_path / "state", inbox=(InboxSettings(path=tmp_path / "inbox"),),
                        retry_backoff_seconds=1, metrics_address="")
    (tmp_path / "state").mkdir()
    journal = Journal(settings.state_dir / "journal.sqlite3")
    scheduled_at = time.time()
    doc = journal.add_document("inbox", "retry.pdf", "sha", 1, 1)
    journal.set_state(doc.id, "queued", claimed_path="/x", next_attempt_at=scheduled_at + 1)  # 1 s backoff
    real_time = time.time
    monkeypatch.setattr(daemon_module.time, "time", lambda: real_time() - 3600)  # then NTP steps back 1 h
    daemon = Daemon(settings)
    daemon.journal = journal
    loop_task = asyncio.create_task(daemon._retry_loop())
    try:
        for _ in range(40):
            if doc.id in daemon.work.waiting:
                break
            await asyncio.sleep(0.1)
    finally:
        loop_task.cancel()
        journal.close()
    assert doc.id in daemon.work.waiting, "the retry is due 1 s after it was scheduled, whatever the wall clock says"


async def test_a_large_backlog_is_fed_to_the_workers_oldest_first_a_bounded_window_at_a_time(tmp_path):
    """With thousands of documents queued, the retry loop keeps only a few per worker in memory
    (RETRY_QUEUE_DEPTH × documents in flight) and takes the next ones as the workers take theirs."""
    from chandrad.service.daemon import RETRY_QUEUE_DEPTH, Daemon

    settings = Settings(state_dir=tmp_path / "state", inbox=(InboxSettings(path=tmp_path / "inbox"),),
                        max_documents_in_flight=2, metrics_address="")
    (tmp_path / "state").mkdir()
    now = [1_000.0]
    journal = Journal(settings.state_dir / "journal.sqlite3", clock=lambda: now[0])
    backlog = []
    for i in range(3000):
        now[0] += 1
        doc = journal.add_document("inbox", f"scan-{i}.pdf", f"sha{i}", 1, i)
        journal.set_state(doc.id, "queued", claimed_path=f"/x/{i}")
        backlog.append(doc.id)
    daemon = Daemon(settings)
    daemon.journal = journal
    depth = RETRY_QUEUE_DEPTH * 2
    loop_task = asyncio.create_task(daemon._retry_loop())
    try:
        await asyncio.sleep(0.2)
        assert daemon.work.waiting == set(backlog[:depth]), "the oldest, and no more than the window"
        for _ in range(depth):  # the workers take everything that was waiting
            doc_id = await daemon.work.take()
            assert doc_id is not None
            journal.set_state(doc_id, "preparing")
        for _ in range(30):
            if daemon.work.waiting:
                break
            await asyncio.sleep(0.1)
        assert daemon.work.waiting == set(backlog[depth:2 * depth])
    finally:
        loop_task.cancel()
        journal.close()

