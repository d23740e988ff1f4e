"""What a failed attempt leads to, on real files and a real journal: a retry with backoff and
history, a wait that uses up no attempt, or failed/ with a ``.error.json`` a person can read;
and the commit a crash cut short, finished with the reason already written."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from chandrad.config import EngineSettings, InboxSettings, Settings
from chandrad.document.stages import DocumentStages
from chandrad.errors import DiskFullError, InboxUnreachableError, PermanentError, TransientError
from chandrad.inbox.intake import Intake
from chandrad.inbox.watch import SettledFile
from chandrad.output.failures import MAX_WAIT_SECONDS, Failures, advice, failure_report
from chandrad.runtime import Runtime, now_iso
from chandrad.storage import folders
from chandrad.storage.journal import Document, Journal
from chandrad.testing import ManualClock
from tests.reliability.chaoslib import DrawingEngine, text_png


@dataclass
class World:
    inbox: InboxSettings
    journal: Journal
    runtime: Runtime
    failures: Failures
    clock: ManualClock

    async def take_in(self, rel: str, data: bytes) -> Document:
        path = self.inbox.path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        st = path.lstat()
        settled = SettledFile(self.inbox, path, Path(rel), st.st_size, st.st_mtime_ns, "regular")
        doc = await Intake(self.runtime, self.failures).take_in(settled)
        assert doc is not None
        return doc

    def row(self, doc: Document) -> Document:
        return self.journal.get(doc.id)


def make_world(tmp_path: Path, **settings: Any) -> World:
    inbox = InboxSettings.model_validate({"path": tmp_path / "inbox", "settle_seconds": 0})
    full = Settings.model_validate(
        {
            "state_dir": tmp_path / "state",
            "inbox": (inbox,),
            "engine": EngineSettings(kind="tesseract"),
            "metrics_address": "",
            **settings,
        }
    )
    for folder in (inbox.path, inbox.outbox, inbox.archive, full.state_dir):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    clock = ManualClock()
    journal = Journal(full.state_dir / "journal.sqlite3", clock=clock)
    runtime = Runtime(full, journal, DrawingEngine(), clock=clock)
    return World(inbox, journal, runtime, Failures(runtime), clock)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    made = make_world(tmp_path, max_attempts=3, retry_backoff_seconds=10)
    yield made
    made.journal.close()


def read_report(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.with_name(path.name + ".error.json").read_text(encoding="utf-8")))


def claimed_of(doc: Document) -> Path:
    assert doc.claimed_path is not None
    return Path(doc.claimed_path)


async def test_a_transient_error_queues_a_retry_after_the_backoff_with_the_attempt_in_its_history(
    world: World,
) -> None:
    doc = await world.take_in("scan.png", text_png("retry"))
    outcome = await world.failures.handle(doc.id, TransientError("the engine stopped answering", stage="engine"))
    assert (outcome.state, outcome.reason) == ("queued", "the engine stopped answering")
    first = world.row(doc)
    assert first.state == "queued" and first.attempts == 1
    assert first.next_attempt_at == world.clock.now + 10
    entry = {
        "reason": "the engine stopped answering",
        "kind": "transient",
        "stage": "engine",
        "attempt": 1,
        "at": now_iso(world.clock.now),
    }
    assert first.history == [entry] and first.error == entry

    world.clock.advance(100)
    await world.failures.handle(doc.id, TransientError("again", stage="engine"))
    second = world.row(doc)
    assert second.attempts == 2
    assert second.next_attempt_at == world.clock.now + 20, "the backoff doubles with each attempt"
    assert [e["attempt"] for e in second.history] == [1, 2]
    assert claimed_of(second).is_file(), "the original stays claimed for the retry"
    assert not world.inbox.failed.exists()


async def test_the_last_attempt_moves_the_original_to_failed_beside_its_report(tmp_path: Path) -> None:
    world = make_world(tmp_path, max_attempts=2, retry_backoff_seconds=0)
    try:
        data = text_png("fails twice")
        doc = await world.take_in("sub/scan.png", data)
        await world.failures.handle(doc.id, TransientError("first try", stage="prepare"))
        world.clock.advance(60)
        outcome = await world.failures.handle(doc.id, TransientError("second try", stage="engine", detail="rc=1"))
        assert outcome.state == "failed"
        moved = world.inbox.failed / "sub" / "scan.png"
        assert moved.read_bytes() == data, "the sub-folder is kept under failed/"
        report = read_report(moved)
        row = world.row(doc)
        assert report == {
            "file": "scan.png",
            "inbox": "inbox",
            "original_path": "sub/scan.png",
            "reason": "second try",
            "kind": "transient",
            "stage": "engine",
            "attempts": 2,
            "first_seen": now_iso(doc.created_at),
            "sha256": doc.sha256,
            "doc_id": doc.id,
            "failed_at": now_iso(world.clock.now),
            "history": row.history,
            "what_to_do": advice("transient"),
        }
        assert [(e["reason"], e["attempt"]) for e in row.history] == [("first try", 1), ("second try", 2)]
        assert row.history[-1]["detail"] == "rc=1"
        assert row.state == "failed" and row.attempts == 2 and row.final_path == str(moved)
        assert not folders.claim_dir(world.inbox.path, world.runtime.host_id, doc.id).exists()
    finally:
        world.journal.close()


async def test_a_permanent_error_goes_to_failed_at_its_first_attempt(world: World) -> None:
    doc = await world.take_in("broken.png", text_png("permanent"))
    outcome = await world.failures.handle(doc.id, PermanentError("the file is encrypted", stage="prepare"))
    assert outcome.state == "failed"
    report = read_report(world.inbox.failed / "broken.png")
    assert (report["kind"], report["attempts"], report["reason"]) == ("permanent", 1, "the file is encrypted")
    assert report["what_to_do"] == "Fix or replace the file and drop it into the inbox again."
    assert world.row(doc).attempts == 1


async def test_a_wait_error_uses_up_no_attempt_and_adds_nothing_to_the_history(tmp_path: Path) -> None:
    """With max_attempts = 1 any counted failure fails the document: four waits in a row leave
    it queued with no attempt used, and the next real error is its first (and last) attempt."""
    world = make_world(tmp_path, max_attempts=1, retry_backoff_seconds=1)
    try:
        doc = await world.take_in("waits.png", text_png("waits"))
        for _ in range(4):
            outcome = await world.failures.handle(doc.id, DiskFullError("the outbox's disk is full", stage="publish"))
            assert outcome.state == "queued"
        row = world.row(doc)
        assert row.state == "queued" and row.attempts == 0 and row.history == []
        assert row.error is not None and row.error["kind"] == "disk-full" and row.error["waits"] == 4
        assert (await world.failures.handle(doc.id, TransientError("engine died", stage="engine"))).state == "failed"
        assert world.row(doc).attempts == 1
    finally:
        world.journal.close()


async def test_waits_back_off_from_the_base_up_to_max_wait_seconds(tmp_path: Path) -> None:
    world = make_world(tmp_path, retry_backoff_seconds=5)
    try:
        doc = await world.take_in("waits.png", text_png("backoff"))
        delays = []
        for _ in range(6):
            await world.failures.handle(doc.id, DiskFullError("full", stage="write"))
            delays.append(world.row(doc).next_attempt_at - world.clock.now)
        assert delays == [5, 10, 20, 40, MAX_WAIT_SECONDS, MAX_WAIT_SECONDS]
    finally:
        world.journal.close()


async def test_a_wait_of_another_kind_counts_its_waits_from_one(world: World) -> None:
    doc = await world.take_in("waits.png", text_png("kinds"))
    for _ in range(3):
        await world.failures.handle(doc.id, DiskFullError("full", stage="write"))
    await world.failures.handle(doc.id, InboxUnreachableError("the share is gone", stage="resume"))
    row = world.row(doc)
    assert row.error is not None and (row.error["kind"], row.error["waits"]) == ("inbox-unreachable", 1)
    assert row.next_attempt_at == world.clock.now + 10


async def test_a_name_already_in_failed_gets_a_free_name_and_its_own_report(world: World) -> None:
    first = await world.take_in("scan.png", text_png("first scan"))
    await world.failures.handle(first.id, PermanentError("first reason", stage="prepare"))
    second = await world.take_in("scan.png", text_png("second scan"))
    await world.failures.handle(second.id, PermanentError("second reason", stage="prepare"))
    assert (world.inbox.failed / "scan.png").read_bytes() == text_png("first scan")
    assert (world.inbox.failed / "scan (2).png").read_bytes() == text_png("second scan")
    assert read_report(world.inbox.failed / "scan.png")["reason"] == "first reason"
    assert read_report(world.inbox.failed / "scan (2).png")["reason"] == "second reason"


async def test_an_unwritable_failed_folder_queues_the_document_again_and_keeps_the_original(world: World) -> None:
    doc = await world.take_in("stuck.png", text_png("stuck"))
    world.inbox.failed.write_text("a file where the failed/ folder should be")
    outcome = await world.failures.handle(doc.id, PermanentError("bad file", stage="prepare"))
    assert outcome.state == "queued" and "cannot write to failed/" in outcome.reason
    row = world.row(doc)
    assert row.state == "queued" and row.next_attempt_at > world.clock.now
    assert claimed_of(row).read_bytes() == text_png("stuck")


async def crash_after_the_move(world: World, doc: Document, error: PermanentError) -> Document:
    """``fail`` wrote the report and moved the original; the crash came before its commit: the
    journal is put back as it was then (still queued, no attempt counted, the target named)."""
    await world.failures.fail(world.row(doc), error)
    return world.journal.set_state(doc.id, "queued", attempts=0, history=[], error=None)


async def test_complete_after_crash_marks_the_document_failed_with_the_reason_already_written(world: World) -> None:
    doc = await world.take_in("crash.png", text_png("crash"))
    before = await crash_after_the_move(world, doc, PermanentError("it is not a PDF or an image", stage="sniff"))
    assert before.state == "queued" and before.final_path is not None
    outcome = await world.failures.complete_after_crash(before, world.inbox)
    assert outcome is not None and outcome.state == "failed"
    assert outcome.reason == "it is not a PDF or an image"
    row = world.row(doc)
    assert row.state == "failed" and row.attempts == 1
    assert row.error is not None
    assert (row.error["reason"], row.error["stage"]) == ("it is not a PDF or an image", "sniff")
    assert [e["reason"] for e in row.history] == ["it is not a PDF or an image"]


async def test_a_document_failed_just_before_a_crash_keeps_its_reason_when_the_stages_resume_it(
    world: World,
) -> None:
    """The whole path: the next run finds the claimed original gone, and instead of failing the
    document as "disappeared" it finishes the commit with the reason in the report."""
    doc = await world.take_in("crash.png", text_png("resumed"))
    await crash_after_the_move(world, doc, PermanentError("the file is encrypted", stage="prepare"))
    outcome = await DocumentStages(world.runtime, world.failures).run(doc.id)
    assert (outcome.state, outcome.reason) == ("failed", "the file is encrypted")
    assert read_report(world.inbox.failed / "crash.png")["reason"] == "the file is encrypted"


async def test_complete_after_crash_with_the_report_lost_says_so(world: World) -> None:
    doc = await world.take_in("lost.png", text_png("report lost"))
    before = await crash_after_the_move(world, doc, PermanentError("the real reason", stage="prepare"))
    (world.inbox.failed / "lost.png.error.json").unlink()
    outcome = await world.failures.complete_after_crash(before, world.inbox)
    assert outcome is not None and outcome.state == "failed"
    assert outcome.reason == "processing failed before a crash; the report was lost"


async def test_complete_after_crash_does_nothing_when_the_original_never_reached_failed(world: World) -> None:
    doc = await world.take_in("early.png", text_png("crash before the move"))
    target = world.inbox.failed / "early.png"
    before = world.journal.set_state(doc.id, "queued", final_path=str(target))  # named, then the crash
    assert await world.failures.complete_after_crash(before, world.inbox) is None
    assert world.row(doc).state == "queued"


async def test_report_only_writes_the_reason_to_failed_and_says_the_original_stayed_in_the_inbox(
    world: World,
) -> None:
    doc = world.journal.add_document(world.inbox.name, "sub/readonly.pdf", "", 10, 1)
    entry = {"reason": "cannot move it", "kind": "permanent", "stage": "intake", "attempt": 1, "at": "now"}
    await world.failures.report_only(doc, world.inbox, entry)
    report = json.loads((world.inbox.failed / "sub" / "readonly.pdf.error.json").read_text(encoding="utf-8"))
    assert report == failure_report(doc, world.inbox, entry, None)
    assert report["original_left_in_inbox"] is True
    assert "history" not in report and "attempts" not in report
    assert not (world.inbox.failed / "sub" / "readonly.pdf").exists()


async def test_a_document_queued_again_because_failed_was_unwritable_and_then_published_is_archived(
    tmp_path: Path,
) -> None:
    world = make_world(tmp_path, max_attempts=1, retry_backoff_seconds=0)
    try:
        data = text_png("published after all")
        doc = await world.take_in("scan.png", data)
        world.inbox.failed.write_text("a file where the failed/ folder should be")
        outcome = await world.failures.handle(doc.id, TransientError("the engine died", stage="engine"))
        assert outcome.state == "queued"  # failed/ could not take it: queued again
        world.inbox.failed.unlink()  # the disk holding failed/ is fixed; the retry goes well
        assert (await DocumentStages(world.runtime, world.failures).run(doc.id)).state == "published"
        assert world.inbox.archive is not None
        assert not (world.inbox.failed / "scan.png").exists(), "a published document's original is not a failure"
        assert (world.inbox.archive / "scan.png").read_bytes() == data
    finally:
        world.journal.close()
