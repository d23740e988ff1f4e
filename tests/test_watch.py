"""Watch: the settle tracker, ignore rules and mount detection, without sleeping."""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from pathlib import Path

import pytest

from chandrad.config import InboxSettings
from chandrad.inbox import watch
from chandrad.inbox.watch import IgnoreRules, InboxWatcher, SettleTracker, mount_fs_type, wants_polling


def test_a_file_settles_only_after_size_and_mtime_stay_unchanged_for_settle_seconds():
    tracker = SettleTracker(settle_seconds=5)
    path = Path("/inbox/scan.pdf")
    tracker.observe(path, size=100, mtime_ns=1, kind="regular", now=0)
    assert tracker.pop_settled(now=4.9) == []
    tracker.observe(path, size=200, mtime_ns=2, kind="regular", now=4.9)  # still growing: the clock restarts
    assert tracker.pop_settled(now=9.8) == []
    tracker.observe(path, size=200, mtime_ns=2, kind="regular", now=9.8)  # unchanged: the clock keeps running
    settled = tracker.pop_settled(now=9.9)
    assert [p for p, _ in settled] == [path] and settled[0][1].size == 200
    assert path not in tracker


def test_the_tracker_never_gives_up_on_a_file_that_keeps_changing():
    tracker = SettleTracker(settle_seconds=2)
    path = Path("/inbox/slow.pdf")
    for second in range(0, 3600, 1):  # an hour of a scanner adding bytes every second
        tracker.observe(path, size=second, mtime_ns=second, kind="regular", now=second)
        assert tracker.pop_settled(now=second + 0.5) == []
    assert path in tracker


def test_an_empty_file_waits_longer_since_scanners_create_the_name_before_filling_it():
    tracker = SettleTracker(settle_seconds=2, empty_settle_seconds=60)
    path = Path("/inbox/scan.pdf")
    tracker.observe(path, size=0, mtime_ns=1, kind="regular", now=0)
    assert tracker.pop_settled(now=59) == []
    tracker.observe(path, size=5000, mtime_ns=2, kind="regular", now=59)  # the scanner starts writing
    assert tracker.pop_settled(now=60) == []
    assert [p for p, _ in tracker.pop_settled(now=61)] == [path]
    tracker.observe(path, size=0, mtime_ns=3, kind="regular", now=100)
    assert [p for p, _ in tracker.pop_settled(now=160)] == [path], "a file that stays empty is taken in the end"


@pytest.mark.parametrize(
    "rel_path",
    [".DS_Store", "._scan.pdf", "Thumbs.db", "desktop.ini", "~$report.docx", ".~lock.report.odt#", "scan.pdf.part",
     "upload.tmp", "file.crdownload", ".hidden.pdf", "@eaDir/scan.pdf", ".stfolder/x.pdf", ".chandrad/claimed/a.pdf",
     "sub/.git/x.pdf"],
)
def test_junk_and_partial_names_are_ignored(rel_path):
    assert IgnoreRules().ignored(Path(rel_path))


def test_include_and_ignore_patterns_apply_case_insensitively():
    rules = IgnoreRules(include=("*.pdf", "*.tif*"), ignore=("draft-*",))
    assert not rules.ignored(Path("sub/Report.PDF"))
    assert not rules.ignored(Path("scan.TIFF"))
    assert rules.ignored(Path("notes.txt"))
    assert rules.ignored(Path("Draft-1.pdf"))


def test_the_filesystem_type_is_the_one_of_the_longest_mount_point_holding_the_path(tmp_path):
    findmnt = subprocess.run(["findmnt", "--noheadings", "--output", "FSTYPE", "--target", str(tmp_path)],
                             capture_output=True, text=True, check=True)
    assert mount_fs_type(tmp_path) == findmnt.stdout.strip()
    assert mount_fs_type(Path("/proc/self/status")) == "proc", "/proc is mounted below /: the deeper mount wins"
    assert mount_fs_type(Path("/proc")) == "proc", "a mount point itself belongs to its own mount"


def test_polling_is_chosen_for_network_mounts_and_can_be_forced(tmp_path, monkeypatch):
    local = InboxSettings(path=tmp_path / "in")
    assert wants_polling(local) is False
    assert wants_polling(InboxSettings(path=tmp_path / "in", polling=True)) is True
    monkeypatch.setattr("chandrad.inbox.watch.mount_fs_type", lambda path: "cifs")
    assert wants_polling(local) is True
    assert wants_polling(InboxSettings(path=tmp_path / "in", polling=False)) is False


async def test_watcher_finds_existing_files_at_start_and_respects_recursive(tmp_path):
    inbox_dir = tmp_path / "in"
    (inbox_dir / "sub").mkdir(parents=True)
    (inbox_dir / "top.pdf").write_bytes(b"%PDF-1.4")
    (inbox_dir / "sub" / "deep.pdf").write_bytes(b"%PDF-1.4")
    (inbox_dir / "junk.tmp").write_bytes(b"x")
    now = [0.0]
    for recursive, expected in ((True, {"top.pdf", "sub/deep.pdf"}), (False, {"top.pdf"})):
        emitted: list[str] = []

        async def emit(settled, into=emitted):
            into.append(str(settled.rel_path))

        inbox = InboxSettings(path=inbox_dir, settle_seconds=1, recursive=recursive)
        watcher = InboxWatcher(inbox, emit, clock=lambda: now[0])
        await watcher.tick(rescan=True)
        assert emitted == []
        now[0] += 1.5
        await watcher.tick()
        assert set(emitted) == expected


async def test_inotify_events_feed_the_tracker(tmp_path):
    inbox_dir = tmp_path / "in"
    inbox_dir.mkdir()
    emitted = []

    async def emit(settled):
        emitted.append(settled.rel_path.name)

    watcher = InboxWatcher(InboxSettings(path=inbox_dir, settle_seconds=0.2, polling=False), emit)
    watcher.start_observer(asyncio.get_running_loop())
    try:
        (inbox_dir / "new.pdf").write_bytes(b"%PDF-1.4 hello")
        for _ in range(50):
            await asyncio.sleep(0.1)
            await watcher.tick()
            if emitted:
                break
    finally:
        watcher.stop_observer()
    assert emitted == ["new.pdf"]


async def test_inotify_announces_writes_renames_touches_and_folders_but_not_reads(tmp_path, monkeypatch):
    """The kernel is asked for what can announce a file (``watch.WATCHED_EVENTS``): the daemon's
    own reads of the inbox tree (intake's hash, every page render of a claimed original) would
    otherwise put an open and a close into watchdog's queue for each read; and what happens in the
    daemon's own ``.chandrad`` folder never reaches the event loop."""
    inbox_dir = tmp_path / "in"
    inbox_dir.mkdir()
    outside = tmp_path / "outside.pdf"
    outside.write_bytes(b"%PDF-1.4 moved in")
    (inbox_dir / "kept.pdf").write_bytes(b"%PDF-1.4 there before")

    async def emit(settled):
        return None

    seen_types: list[str] = []  # every event watchdog hands over, before the watcher's own sorting
    handed_over = watch._DirtyPaths.on_any_event

    def spy(handler, event):
        seen_types.append(event.event_type)
        handed_over(handler, event)

    monkeypatch.setattr(watch._DirtyPaths, "on_any_event", spy)
    watcher = InboxWatcher(InboxSettings(path=inbox_dir, settle_seconds=60, polling=False), emit)
    announced: list[str] = []
    watcher._candidate = lambda path, is_directory=False: announced.append(  # type: ignore[method-assign]
        str(path.relative_to(inbox_dir)) + ("/" if is_directory else "")
    )

    async def announced_after(change) -> set[str]:
        announced.clear()
        change()
        await asyncio.sleep(0.8)  # watchdog's own delay for a move's other half is 0.5 s
        return set(announced)

    watcher.start_observer(asyncio.get_running_loop())
    try:
        await asyncio.sleep(0.3)
        seen_types.clear()
        assert await announced_after(lambda: [(inbox_dir / "kept.pdf").read_bytes() for _ in range(20)]) == set()
        assert seen_types == [], "reads are not even handed over by watchdog"
        assert "written.pdf" in await announced_after(lambda: (inbox_dir / "written.pdf").write_bytes(b"%PDF"))
        assert "moved.pdf" in await announced_after(lambda: outside.rename(inbox_dir / "moved.pdf"))
        assert "kept.pdf" in await announced_after(lambda: os.utime(inbox_dir / "kept.pdf"))
        assert "sub/" in await announced_after(lambda: (inbox_dir / "sub").mkdir())
        assert "sub/deep.pdf" in await announced_after(lambda: (inbox_dir / "sub" / "deep.pdf").write_bytes(b"%PDF"))

        def claim() -> None:  # as intake claims a file: its folder, its record, the file moved in
            folder = inbox_dir / ".chandrad" / "claimed" / "host" / "doc"
            folder.mkdir(parents=True)
            (folder / ".claim.json").write_text("{}")
            (inbox_dir / "written.pdf").rename(folder / "written.pdf")

        own = [path for path in await announced_after(claim) if path.startswith(".chandrad")]
        assert own == [], "the daemon's own folder is not handed to the loop"
    finally:
        watcher.stop_observer()


async def test_a_stat_hung_on_the_inbox_holds_its_watcher_but_not_the_event_loop(tmp_path, monkeypatch):
    """A share that stops answering (a hard NFS mount, a dead SMB server) blocks every stat on it
    for minutes. The watcher's stats run in its own thread: the loop, which feeds the engine and
    every other inbox, runs on; the watcher picks up where it was once the share answers again."""
    inbox_dir = tmp_path / "share"
    inbox_dir.mkdir()
    hung, answered, valve_opened = threading.Event(), threading.Event(), threading.Event()
    real_stat = os.stat

    def stat_on_a_hung_share(path, *args, **kwargs):  # test double for a dead server behind the mount
        if str(path).startswith(str(inbox_dir)) and not answered.is_set():
            hung.set()
            if not answered.wait(timeout=5):  # a loop held by this call gets it back, and the test fails
                valve_opened.set()
                answered.set()
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat_on_a_hung_share)
    emitted: list[str] = []

    async def emit(settled):
        emitted.append(settled.rel_path.name)

    watcher = InboxWatcher(InboxSettings(path=inbox_dir, settle_seconds=0.2, polling=False), emit)
    watching = asyncio.create_task(watcher.run())
    try:
        loop_turns_while_hung = 0
        while not answered.is_set():
            if hung.is_set():
                loop_turns_while_hung += 1
                if loop_turns_while_hung == 10:
                    answered.set()  # the share answers again
            await asyncio.sleep(0.01)
        assert not valve_opened.is_set(), "the event loop was held by the watcher's stat on the hung share"
        assert loop_turns_while_hung == 10
        (inbox_dir / "after.pdf").write_bytes(b"%PDF-1.4 written once the share answered")
        for _ in range(100):
            if emitted:
                break
            await asyncio.sleep(0.05)
        assert emitted == ["after.pdf"], "the watcher went on once the share answered"
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        watcher.stop()
