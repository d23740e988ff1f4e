"""Intake on real files and a real journal: a settled name becomes a claimed, queued row, or is
refused with a reason in failed/ (a link, a device, a copy of content already taken in), or is
left alone (changed while it was read, gone, already accounted for, already being taken in)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from chandrad.config import EngineSettings, InboxSettings, Settings
from chandrad.errors import DuplicateError
from chandrad.inbox.intake import Intake, duplicate_of
from chandrad.inbox.watch import FileKind, SettledFile
from chandrad.output.failures import Failures
from chandrad.runtime import Runtime
from chandrad.storage import folders
from chandrad.storage.journal import Journal
from chandrad.testing import ManualClock
from tests.reliability.chaoslib import DrawingEngine, text_png


@dataclass
class World:
    inbox: InboxSettings
    journal: Journal
    runtime: Runtime
    intake: Intake

    def drop(self, name: str, data: bytes) -> Path:
        path = self.inbox.path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return path

    def settled(self, path: Path, kind: FileKind = "regular") -> SettledFile:
        st = path.lstat()
        return SettledFile(self.inbox, path, path.relative_to(self.inbox.path), st.st_size, st.st_mtime_ns, kind)

    def rows(self) -> list[tuple[str, str]]:
        return [(doc.rel_path, doc.state) for doc in self.journal.recent(100)]


def make_world(tmp_path: Path, **inbox_settings: object) -> World:
    inbox = InboxSettings.model_validate({"path": tmp_path / "inbox", "settle_seconds": 0, **inbox_settings})
    settings = Settings(
        state_dir=tmp_path / "state", inbox=(inbox,), engine=EngineSettings(kind="tesseract"), metrics_address=""
    )
    for folder in (inbox.path, inbox.outbox, inbox.failed, inbox.archive, settings.state_dir):
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
    clock = ManualClock()
    journal = Journal(settings.state_dir / "journal.sqlite3", clock=clock)
    runtime = Runtime(settings, journal, DrawingEngine(), clock=clock)
    return World(inbox, journal, runtime, Intake(runtime, Failures(runtime)))


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    made = make_world(tmp_path)
    yield made
    made.runtime.close()
    made.journal.close()


def report_beside(path: Path) -> dict[str, object]:
    return dict(json.loads(path.with_name(path.name + ".error.json").read_text(encoding="utf-8")))


async def test_a_settled_file_is_moved_into_its_claim_folder_and_queued(world: World) -> None:
    data = text_png("intake")
    source = world.drop("sub/scan.png", data)
    doc = await world.intake.take_in(world.settled(source))
    assert doc is not None
    assert doc.state == "queued"
    assert doc.rel_path == "sub/scan.png"
    assert doc.sha256 == hashlib.sha256(data).hexdigest()
    claimed = folders.claimed_path(world.inbox.path, world.runtime.host_id, doc.id, Path("sub/scan.png"))
    assert doc.claimed_path == str(claimed)
    assert claimed.read_bytes() == data
    assert not source.exists(), "the name in the inbox is free again: a scanner re-using it cannot touch ours"
    assert world.journal.get(doc.id).state == "queued"


@contextlib.asynccontextmanager
async def default_executor_held() -> AsyncIterator[None]:
    """The loop's default executor with every thread held, as the page renders of the documents in
    progress hold them (a child each), until the block ends."""
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=2, thread_name_prefix="busy-render"))
    release = threading.Event()
    renders = [loop.run_in_executor(None, release.wait) for _ in range(2)]
    try:
        yield
    finally:
        release.set()
        await asyncio.gather(*renders)


async def test_a_file_is_taken_in_while_every_thread_of_the_default_executor_is_busy(world: World) -> None:
    """The documents in progress hold the loop's default threads while their pages render (a child
    each); a burst of drops must not wait behind them (bench/intake.py: 48 files were all queued
    6.3 s after the drop on two cores instead of 1.7; NOTES-gpu §12: ~19 files a second on an H200)."""
    async with default_executor_held():
        source = world.drop("scan.png", text_png("burst"))
        doc = await asyncio.wait_for(world.intake.take_in(world.settled(source)), timeout=20)
        assert doc is not None and doc.state == "queued"
        assert not source.exists()


async def test_a_symbolic_link_is_refused_into_failed_with_its_reason_and_never_followed(
    world: World, tmp_path: Path
) -> None:
    target = tmp_path / "elsewhere.png"
    target.write_bytes(text_png("the target"))
    link = world.inbox.path / "link.png"
    link.symlink_to(target)
    assert await world.intake.take_in(world.settled(link, "symlink")) is None
    assert world.rows() == [("link.png", "failed")]
    doc = world.journal.recent(1)[0]
    assert doc.error is not None
    assert doc.error["kind"] == "permanent" and doc.error["stage"] == "intake"
    assert "symbolic link" in doc.error["reason"]
    moved = world.inbox.failed / "link.png"
    assert moved.is_symlink() and not link.is_symlink(), "the link itself went to failed/"
    assert target.read_bytes() == text_png("the target"), "what the link points at is untouched"
    assert report_beside(moved)["reason"] == doc.error["reason"]


async def test_a_pipe_is_refused_into_failed_as_not_a_regular_file(world: World) -> None:
    fifo = world.inbox.path / "pipe.pdf"
    os.mkfifo(fifo)
    assert await world.intake.take_in(world.settled(fifo, "special")) is None
    assert world.rows() == [("pipe.pdf", "failed")]
    report = report_beside(world.inbox.failed / "pipe.pdf")
    assert "not a regular file" in str(report["reason"])
    assert report["kind"] == "permanent"


async def test_a_copy_of_content_taken_in_before_fails_as_a_duplicate_naming_the_original(world: World) -> None:
    data = text_png("the same content")
    first = await world.intake.take_in(world.settled(world.drop("original.png", data)))
    assert first is not None
    assert await world.intake.take_in(world.settled(world.drop("copy.png", data))) is None
    states = dict(world.rows())
    assert states == {"original.png": "queued", "copy.png": "failed"}
    copy = next(doc for doc in world.journal.recent(10) if doc.rel_path == "copy.png")
    assert copy.error is not None
    assert copy.error["kind"] == "duplicate" and copy.error["stage"] == "dedupe"
    assert "original.png" in copy.error["reason"] and "still being processed" in copy.error["reason"]
    report = report_beside(world.inbox.failed / "copy.png")
    assert report["kind"] == "duplicate"
    assert report["what_to_do"] == "Nothing to do: this content was already processed."
    assert (world.inbox.failed / "copy.png").read_bytes() == data


async def test_a_copy_is_not_due_for_the_workers_while_its_duplicate_check_runs(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The retry loop hands every due queued row to a worker: a copy queued before its check ended
    was failed twice, by intake and by a worker (21 reports for 19 copies in CI, 2026-12-02)."""
    import chandrad.inbox.intake

    due_during_check: list[list[str]] = []
    real_check = chandrad.inbox.intake.duplicate_of

    async def check_and_look(*args: object) -> DuplicateError | None:
        due_during_check.append(world.journal.due_queued(world.runtime.clock() + 1, 3600, 100))
        return await real_check(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(chandrad.inbox.intake, "duplicate_of", check_and_look)
    data = text_png("copied while checked")
    first = await world.intake.take_in(world.settled(world.drop("first.png", data)))
    assert first is not None
    assert await world.intake.take_in(world.settled(world.drop("copy.png", data))) is None
    assert due_during_check == [[], [first.id]], "only the original, and only once its check had passed"
    assert world.journal.due_queued(world.runtime.clock() + 1, 3600, 100) == [first.id]


async def test_duplicate_of_returns_a_duplicate_error_saying_where_the_original_was_published(
    world: World,
) -> None:
    data = text_png("published once")
    first = await world.intake.take_in(world.settled(world.drop("first.png", data)))
    assert first is not None
    world.journal.set_state(first.id, "published", output_dir="/outbox/first")
    later = world.journal.add_document(world.inbox.name, "later.png", first.sha256, 1, 1)
    duplicate = await duplicate_of(world.runtime, later, world.inbox)
    assert isinstance(duplicate, DuplicateError)
    assert duplicate.kind == "duplicate" and duplicate.permanent
    assert "first.png" in duplicate.reason and "published to /outbox/first" in duplicate.reason
    assert await duplicate_of(world.runtime, first, world.inbox) is None, "the original is nobody's copy"


async def test_a_copy_of_content_that_failed_before_is_taken_in_again(world: World) -> None:
    data = text_png("failed once")
    first = await world.intake.take_in(world.settled(world.drop("first.png", data)))
    assert first is not None
    world.journal.set_state(first.id, "failed")
    again = await world.intake.take_in(world.settled(world.drop("again.png", data)))
    assert again is not None and again.state == "queued"


async def test_copies_are_taken_in_when_duplicates_is_reprocess(tmp_path: Path) -> None:
    world = make_world(tmp_path, duplicates="reprocess")
    try:
        data = text_png("reprocess me")
        first = await world.intake.take_in(world.settled(world.drop("a.png", data)))
        second = await world.intake.take_in(world.settled(world.drop("b.png", data)))
        assert first is not None and second is not None
        assert dict(world.rows()) == {"a.png": "queued", "b.png": "queued"}
    finally:
        world.journal.close()


async def test_a_file_changed_since_it_settled_is_not_taken_in(world: World) -> None:
    """The size and mtime the watcher saw settle are compared with the file's after it was hashed:
    a scanner still writing (here: the file grew between settling and intake) makes them differ."""
    source = world.drop("growing.png", text_png("first half"))
    settled = world.settled(source)
    with source.open("ab") as handle:
        handle.write(b"more bytes from a scanner that was not done")
    assert await world.intake.take_in(settled) is None
    assert world.rows() == [], "no document: the file must settle again"
    assert source.exists(), "the file stays in the inbox"
    assert not folders.claimed_root(world.inbox.path).exists()


async def test_a_file_replaced_between_its_hash_and_its_claim_is_journaled_with_the_claimed_files_hash(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another host's claim of the first file, then the scanner's next file under the same name,
    can come between our hash and our rename: the document is what we claimed, not what we read."""
    import chandrad.inbox.intake as intake_module
    from chandrad import prepare
    from chandrad.hosts import claims

    first, second = text_png("the first scan"), text_png("the next scan under the same name")
    source = world.drop("scan.png", first)
    settled = world.settled(source)
    hashed: list[Path] = []
    real_hash, real_move = prepare.hash_file, intake_module.move_durably

    def counting_hash(path: Path) -> str:
        hashed.append(path)
        return real_hash(path)

    def replaced_then_moved(src: Path, dst: Path) -> None:
        staged = src.with_name(".next-scan")
        staged.write_bytes(second)
        os.utime(staged, ns=(settled.mtime_ns + 10**9, settled.mtime_ns + 10**9))
        os.replace(staged, src)
        real_move(src, dst)

    monkeypatch.setattr(prepare, "hash_file", counting_hash)
    monkeypatch.setattr(intake_module, "move_durably", replaced_then_moved)
    doc = await world.intake.take_in(settled)
    assert doc is not None and doc.state == "queued"
    assert doc.sha256 == hashlib.sha256(second).hexdigest() != hashlib.sha256(first).hexdigest()
    assert doc.size == len(second)
    record = claims.read_claim_record(Path(doc.claimed_path).parent)
    assert record is not None and record.sha256 == doc.sha256
    assert len(hashed) == 2, "hashed again, once, from the claim"

    monkeypatch.setattr(intake_module, "move_durably", real_move)
    hashed.clear()
    again = await world.intake.take_in(world.settled(world.drop("plain.png", text_png("nothing replaced"))))
    assert again is not None and len(hashed) == 1, "an unchanged file is hashed once"


async def test_a_file_replaced_by_a_link_between_its_hash_and_its_claim_fails_with_a_reason_not_a_crash(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    import chandrad.inbox.intake as intake_module

    source = world.drop("scan.png", text_png("the first scan"))
    settled = world.settled(source)
    elsewhere = world.inbox.path.parent / "elsewhere.png"
    elsewhere.write_bytes(text_png("not in the inbox"))
    real_move = intake_module.move_durably

    def replaced_by_a_link_then_moved(src: Path, dst: Path) -> None:
        src.unlink()
        src.symlink_to(elsewhere)
        real_move(src, dst)

    monkeypatch.setattr(intake_module, "move_durably", replaced_by_a_link_then_moved)
    assert await world.intake.take_in(settled) is None
    assert world.rows() == [("scan.png", "failed")]
    (doc,) = world.journal.recent(1)
    assert doc.error is not None and "not a regular file" in doc.error["reason"]
    assert elsewhere.read_bytes() == text_png("not in the inbox"), "the link's target is never touched"


async def test_a_file_gone_before_intake_leaves_no_document(world: World) -> None:
    source = world.drop("gone.png", text_png("gone"))
    settled = world.settled(source)
    source.unlink()
    assert await world.intake.take_in(settled) is None
    assert world.rows() == []


async def test_a_name_already_being_taken_in_is_refused_at_once_by_a_second_take_in(world: World) -> None:
    """A rescan re-announces a name while its intake is under way: the second call returns before
    touching the file or the journal (the file is still in the inbox when it returns, because the
    first intake has not got as far as the claim), and the name is taken in once."""
    source = world.drop("twice.png", text_png("announced twice"))
    settled = world.settled(source)
    first = asyncio.create_task(world.intake.take_in(settled))
    await asyncio.sleep(0)  # the first intake is now waiting on the journal
    assert not first.done()
    assert await world.intake.take_in(settled) is None
    assert source.exists(), "the second call returned without waiting for, or racing, the first"
    doc = await first
    assert doc is not None and doc.state == "queued"
    assert world.rows() == [("twice.png", "queued")]
    assert await world.intake.take_in(world.settled(world.drop("twice.png", text_png("new content")))) is not None, (
        "once the first intake is over, the name can be taken in again"
    )


async def test_an_original_put_back_after_publishing_is_not_taken_in_again(world: World) -> None:
    """With on_success = "keep" the original goes back to its name; the journal knows it there
    (same size and mtime), so the watcher seeing it settle again starts nothing."""
    source = world.drop("kept.png", text_png("kept"))
    settled = world.settled(source)
    doc = world.journal.add_document(world.inbox.name, "kept.png", "sha", settled.size, settled.mtime_ns)
    world.journal.set_state(doc.id, "published", final_path=str(source))
    assert await world.intake.take_in(settled) is None
    assert world.rows() == [("kept.png", "published")]
    assert source.exists()
    os.utime(source, ns=(settled.mtime_ns, settled.mtime_ns + 1_000_000_000))  # changed since: a new document
    assert await world.intake.take_in(world.settled(source)) is not None


async def test_a_name_that_became_a_link_after_it_settled_is_refused_without_being_followed(
    world: World, tmp_path: Path
) -> None:
    """The watcher saw a regular file; by intake the name is a link to someone else's file. The
    file is opened without following links, so the target is never read, hashed or moved."""
    target = tmp_path / "private.png"
    target.write_bytes(text_png("private"))
    name = world.drop("swapped.png", text_png("innocent"))
    settled = world.settled(name)
    name.unlink()
    name.symlink_to(target)
    assert await world.intake.take_in(settled) is None
    doc = world.journal.recent(1)[0]
    assert doc.state == "failed" and doc.sha256 == ""
    assert doc.error is not None and "symbolic link" in doc.error["reason"]
    assert (world.inbox.failed / "swapped.png").is_symlink()
    assert target.read_bytes() == text_png("private")


def block_claims(inbox: InboxSettings) -> None:
    """Make the claim folder impossible to create (a file where ``.chandrad`` should be): as a
    read-only inbox does for a daemon not running as root, the move out of the inbox fails."""
    (inbox.path / folders.DAEMON_DIR).write_text("in the way")


async def test_a_file_that_cannot_be_moved_out_of_the_inbox_is_failed_with_a_report_and_left_where_it_is(
    world: World,
) -> None:
    data = text_png("stuck in the inbox")
    source = world.drop("stuck.png", data)
    block_claims(world.inbox)
    settled = world.settled(source)
    assert await world.intake.take_in(settled) is None
    assert source.read_bytes() == data, "the original is left where it is"
    doc = world.journal.recent(1)[0]
    assert doc.state == "failed" and doc.claimed_path is None
    assert doc.error is not None and "cannot move the file out of the inbox" in doc.error["reason"]
    report = json.loads((world.inbox.failed / "stuck.png.error.json").read_text(encoding="utf-8"))
    assert report["original_left_in_inbox"] is True and report["reason"] == doc.error["reason"]
    assert not (world.inbox.failed / "stuck.png").exists()
    assert await world.intake.take_in(settled) is None, "seen settling again, it is not taken in twice"
    assert len(world.rows()) == 1


async def test_the_reason_for_a_file_that_cannot_be_moved_has_no_doubled_space(world: World) -> None:
    source = world.drop("stuck.png", text_png("stuck"))
    block_claims(world.inbox)
    await world.intake.take_in(world.settled(source))
    doc = world.journal.recent(1)[0]
    assert doc.error is not None
    assert "  " not in doc.error["reason"]
