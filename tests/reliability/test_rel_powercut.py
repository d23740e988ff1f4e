"""Power cut: after a crash of the whole machine, a reader never sees a partial document and the
original is never lost. Proved from the order of the filesystem calls chandrad makes.

The model is POSIX's, stricter than ext4's: written data is durable only after ``fsync`` of the
file; a new directory entry (create, ``mkdir``, ``rename`` target) only after ``fsync`` of the
directory holding it; a removal likewise. Under that model:

1. Publish is atomic: when the staging directory is renamed into the outbox, every file in it,
   and every directory's list of entries, was already fsynced: a rename that survives a power cut
   shows a complete document; one that does not leaves the staging copy to redo it from.
2. Outputs are durable before the original leaves: the outbox folder holding the document (and
   every folder created on the way to it) is fsynced before the original is moved out of claimed/.
3. Moves never lose the file: every entry on the new path is fsynced before the old directory
   (which records the removal) is; a cut in between shows the file twice, never zero times.
4. The journal follows the disk: ``publishing`` + the output path are committed before the rename,
   ``published`` after everything above.

The run is in-process (the real ``Pipeline`` with a stand-in engine that draws a figure, so the
``images/`` folder is exercised) with ``os.fsync``/``os.rename``/``os.mkdir`` recorded. The
kill -9 at each of these calls, with the real daemon, is in ``test_rel_kill.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from chandrad.config import EngineSettings, InboxSettings, Settings
from chandrad.document.pipeline import Pipeline
from chandrad.inbox.watch import SettledFile
from chandrad.storage import durable
from chandrad.storage.journal import Journal
from tests.reliability.chaoslib import DrawingEngine, record_figures, simple_pdf, text_png


class Trace:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, object]] = []

    def add(self, op: str, path: str, extra: object = None) -> None:
        self.events.append((op, os.path.normpath(path), extra))

    def index(self, op: str, path: Path | str, after: int = -1) -> int | None:
        path = os.path.normpath(str(path))
        for i, (o, p, _) in enumerate(self.events):
            if i > after and o == op and p == path:
                return i
        return None

    def last_index(self, op: str, path: Path | str, before: int) -> int | None:
        path = os.path.normpath(str(path))
        found = None
        for i, (o, p, _) in enumerate(self.events[:before]):
            if o == op and p == path:
                found = i
        return found


@pytest.fixture
def trace(monkeypatch: pytest.MonkeyPatch) -> Trace:
    recorded = Trace()
    real_fsync, real_rename, real_mkdir = os.fsync, os.rename, os.mkdir

    def fsync(fd: int) -> None:
        real_fsync(fd)
        recorded.add("fsync", os.readlink(f"/proc/self/fd/{fd}"))

    def rename(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        src_path = Path(os.fsdecode(src))
        snapshot = None
        if src_path.is_dir():  # what a reader will see under the new name
            snapshot = sorted(str(p) for p in src_path.rglob("*"))
        real_rename(src, dst, *args, **kwargs)
        recorded.add("rename", os.fsdecode(dst), (os.path.normpath(os.fsdecode(src)), snapshot))

    def mkdir(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_mkdir(path, *args, **kwargs)
        recorded.add("mkdir", os.fsdecode(path))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "mkdir", mkdir)
    real_set_state = Journal.set_state

    def set_state(self, doc_id, state, **fields):  # type: ignore[no-untyped-def]
        result = real_set_state(self, doc_id, state, **fields)
        recorded.add("journal", state, fields)
        return result

    monkeypatch.setattr(Journal, "set_state", set_state)
    # The final states are committed with their deliveries, by publish and fail.
    real_publish, real_fail = Journal.publish, Journal.fail

    def publish(self, doc_id, deliveries):  # type: ignore[no-untyped-def]
        result = real_publish(self, doc_id, deliveries)
        recorded.add("journal", "published", {})
        return result

    def fail(self, doc_id, error, deliveries):  # type: ignore[no-untyped-def]
        result = real_fail(self, doc_id, error, deliveries)
        recorded.add("journal", "failed", {"error": error})
        return result

    monkeypatch.setattr(Journal, "publish", publish)
    monkeypatch.setattr(Journal, "fail", fail)
    return recorded


async def run_one(trace: Trace, tmp_path: Path, rel: str, data: bytes) -> tuple[Pipeline, Path, dict[str, Path]]:
    inbox_path = tmp_path / "inbox"
    inbox = InboxSettings(path=inbox_path, settle_seconds=0)
    settings = Settings(state_dir=tmp_path / "state", inbox=(inbox,), engine=EngineSettings(kind="tesseract"),
                        retry_backoff_seconds=0)
    for folder in (inbox_path, inbox.outbox, inbox.failed, inbox.archive, settings.state_dir):
        assert folder is not None
        folder.mkdir(parents=True, exist_ok=True)
    source = inbox_path / rel
    source.parent.mkdir(parents=True, exist_ok=True)
    source.write_bytes(data)
    journal = Journal(settings.state_dir / "journal.sqlite3")
    trace.events.clear()  # the daemon's own calls only (prepare_folders made the top folders)
    pipeline = Pipeline(settings, journal, DrawingEngine())
    st = source.lstat()
    doc = await pipeline.take_in(SettledFile(inbox, source, Path(rel), st.st_size, st.st_mtime_ns, "regular"))
    assert doc is not None
    outcome = await pipeline.process(doc.id)
    journal.close()
    folders = {"inbox": inbox_path, "outbox": inbox.outbox, "archive": inbox.archive, "failed": inbox.failed}  # type: ignore[dict-item]
    return pipeline, Path(outcome.output_dir) if outcome.output_dir else Path(), folders


def new_dirs_durable_before(trace: Trace, under: Path, deadline: int) -> list[str]:
    """Folders created under ``under`` whose entry in their parent was not fsynced before ``deadline``."""
    problems = []
    for i, (op, path, _) in enumerate(trace.events[:deadline]):
        if op == "mkdir" and Path(path).is_relative_to(under) and ".chandrad" not in Path(path).parts:
            synced = trace.index("fsync", Path(path).parent, after=i)
            if synced is None or synced > deadline:
                problems.append(path)
    return problems


def move_is_durable(trace: Trace, target: Path, deadline: int) -> list[str]:
    """A rename into ``target``: every entry on its new path (the file's, and those of folders
    created for it) is durable before the old folder is fsynced (which makes the removal durable)
    and before ``deadline``. Returns what is out of order."""
    problems = []
    moved = trace.index("rename", target)
    assert moved is not None, f"no rename into {target}"
    source = Path(trace.events[moved][2][0])  # type: ignore[index]
    new_entry = trace.index("fsync", target.parent, after=moved)
    old_entry = trace.index("fsync", source.parent, after=moved)
    limit = min(deadline, old_entry if old_entry is not None else deadline)
    if new_entry is None or new_entry > limit:
        problems.append(f"{target.parent} not fsynced after the rename, before the removal and the journal")
    ancestors = {os.path.normpath(str(p)) for p in target.parents}
    for i, (op, path, _) in enumerate(trace.events[:moved]):
        if op == "mkdir" and path in ancestors:
            synced = trace.index("fsync", Path(path).parent, after=i)
            if synced is None or synced > limit:
                problems.append(f"folder {path}, created for the move, not durable before the removal")
    return problems


@pytest.mark.parametrize(("rel", "kind"), [("report.pdf", "pdf"), ("scans/2026/q3/report.png", "png")],
                         ids=["top-level PDF", "PNG three folders deep"])
async def test_publish_is_atomic_and_durable_under_a_power_cut(trace, tmp_path, rel, kind):
    data = simple_pdf(2, label="power cut") if kind == "pdf" else text_png("power cut")
    pipeline, output_dir, folders = await run_one(trace, tmp_path, rel, data)
    assert output_dir.is_dir()
    events = trace.events

    # 1. Atomic publish: everything under staging fsynced (files, then their folders) before the rename.
    published = trace.index("rename", output_dir)
    assert published is not None
    staging, snapshot = events[published][2]  # type: ignore[misc]
    assert snapshot, "the staging folder had content"
    staged = [Path(staging)] + [Path(p) for p in snapshot]
    files = [p for p in staged if not Path(str(p).replace(staging, str(output_dir), 1)).is_dir()]
    folders_in = [p for p in staged if p not in files]
    assert any(p.parent.name == "images" for p in files), "the figure was cropped into images/"
    for file in files:
        synced = trace.last_index("fsync", file, before=published)
        assert synced is not None, f"{file} was not fsynced before the publish rename"
    for folder in folders_in:
        synced = trace.last_index("fsync", folder, before=published)
        assert synced is not None, f"folder {folder} was not fsynced before the publish rename"
        children = [trace.last_index("fsync", f, before=published) for f in files if f.parent == folder]
        children += [trace.index("mkdir", d) for d in folders_in if d.parent == folder]
        assert all(c is None or c < synced for c in children), f"{folder} fsynced before its last entry"

    # 4. The journal names the output before the rename and says published after everything.
    named = next(i for i, (op, state, fields) in enumerate(events)
                 if op == "journal" and state == "publishing" and fields and fields.get("output_dir"))  # type: ignore[union-attr]
    done = next(i for i, (op, state, _) in enumerate(events) if op == "journal" and state == "published")
    assert named < published < done

    # 2. Outputs durable (with every folder created on the way) before the original leaves claimed/.
    archived = next(i for i, (op, path, extra) in enumerate(events)
                    if op == "rename" and Path(path).is_relative_to(folders["archive"]))
    parent_synced = trace.index("fsync", output_dir.parent, after=published)
    assert parent_synced is not None and parent_synced < archived, "outbox folder fsynced before archiving"
    assert new_dirs_durable_before(trace, folders["outbox"], archived) == [], "new outbox folders durable"

    # 3. The claim (inbox → claimed/) and the archive move never lose the file.
    claimed = next(i for i, (op, path, _) in enumerate(events) if op == "rename" and "/.chandrad/claimed/" in path)
    assert move_is_durable(trace, Path(events[claimed][1]), deadline=named) == []
    assert move_is_durable(trace, Path(events[archived][1]), deadline=done) == []
    assert new_dirs_durable_before(trace, folders["archive"], archived) == [], "new archive folders durable"
    record_figures(f"power-cut ordering ({rel})", fs_calls=len(events),
                   fsyncs=sum(op == "fsync" for op, _, _ in events), renames=sum(op == "rename" for op, _, _ in events),
                   violations=0)


async def test_a_failure_report_and_the_moved_original_are_durable_in_order(trace, tmp_path):
    """failed/: the report is complete (written, fsynced, renamed, folder fsynced) before the
    original moves beside it, and the move is durable before the journal says failed."""
    _, _, folders = await run_one(trace, tmp_path, "deep/er/broken.pdf", b"%PDF-1.4\n%%EOF\n")
    events = trace.events
    report = folders["failed"] / "deep" / "er" / "broken.pdf.error.json"
    original = folders["failed"] / "deep" / "er" / "broken.pdf"
    assert report.exists() and original.exists()
    report_written = trace.index("fsync", report.parent / f".{report.name}.tmp")
    # (The folder's first fsync is the original's name reserved, before the report: after it, the report's.)
    report_named = trace.index("fsync", report.parent, after=report_written)
    moved = trace.index("rename", original)
    failed_at = next(i for i, (op, state, _) in enumerate(events) if op == "journal" and state == "failed")
    assert report_written is not None and report_named is not None and moved is not None
    assert report_written < report_named < moved < failed_at
    assert move_is_durable(trace, original, deadline=failed_at) == []
    assert new_dirs_durable_before(trace, folders["failed"], moved) == []


def test_makedirs_durably_fsyncs_each_new_folder_into_its_parent(trace, tmp_path):
    trace.events.clear()
    durable.makedirs_durably(tmp_path / "a" / "b" / "c")
    durable.makedirs_durably(tmp_path / "a" / "b" / "c")  # nothing new: nothing to do
    ops = [(op, Path(path).relative_to(tmp_path).as_posix() if path != str(tmp_path) else ".")
           for op, path, _ in trace.events]
    assert ops == [("mkdir", "a"), ("fsync", "."), ("mkdir", "a/b"), ("fsync", "a"), ("mkdir", "a/b/c"),
                   ("fsync", "a/b")]

