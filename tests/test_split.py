"""Batch scans split at their separator sheets (split_on): each part a document of its own through
the whole daemon (real watchdog, SQLite, PDFium, zxing-cpp, tesseract engine), the separators
nowhere, the stack's original archived once after every part is final; kill -9 mid-split and after
resumes to exactly the same three documents, once each."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import once_with_tesseract
from tests.reliability.chaoslib import ChaosDaemon, chaos_env, wait_for
from tests.test_separators import SHEETS, stack_bytes

PARTS = ["stack (part 1 of 3)", "stack (part 2 of 3)", "stack (part 3 of 3)"]


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[ChaosDaemon]]:
    made: list[ChaosDaemon] = []
    yield made
    for daemon in made:
        daemon.sampler.stop()
        if daemon.alive:
            daemon.kill9()


def _daemon(tmp_path: Path, made: list[ChaosDaemon], spec: str) -> ChaosDaemon:
    daemon = ChaosDaemon(tmp_path / "tree", env=chaos_env(tmp_path / "chaos.log"),
                         extra_config="max_documents_in_flight = 2\n",
                         inbox_config=f'split_on = ["{spec}"]\nrotate_pages = false\n')
    made.append(daemon)
    return daemon


def _settled(daemon: ChaosDaemon) -> bool:
    return daemon.final_count() == 4 and not daemon.leftovers()


def _check_three_letters(daemon: ChaosDaemon) -> None:
    folders = sorted(path.name for path in daemon.outbox.iterdir() if not path.name.startswith("."))
    assert folders == PARTS, folders
    for number, (folder, pages) in enumerate(zip(PARTS, ([1, 2], [4, 5], [7, 8]), strict=True), start=1):
        document = json.loads((daemon.outbox / folder / f"{folder}.json").read_text())
        assert document["source"] == "stack.pdf" and document["source_pages"] == pages
        assert document["num_pages"] == 2
        markdown = (daemon.outbox / folder / f"{folder}.md").read_text().lower()
        assert "tip-toeing" in markdown, f"part {number} holds its letter's second page"
    assert sorted(path.name for path in daemon.archive.rglob("*") if path.is_file()) == ["stack.pdf"]
    assert not [path for path in daemon.failed.rglob("*") if path.is_file()]
    states = {row["rel_path"]: row["state"] for row in daemon.journal_rows("SELECT rel_path, state FROM documents")}
    assert states == {"stack.pdf": "published", **{f"{part}.pdf": "published" for part in PARTS}}


@pytest.mark.parametrize("spec", list(SHEETS))
def test_a_stack_with_separator_sheets_becomes_one_published_document_per_letter(tmp_path, daemons, spec):
    daemon = _daemon(tmp_path, daemons, spec).start()
    (daemon.inbox / "stack.pdf").write_bytes(stack_bytes(SHEETS[spec]()))
    wait_for(lambda: _settled(daemon), 240, "the stack's three letters published and the stack archived")
    assert daemon.stop() == 0
    _check_three_letters(daemon)
    assert any(e.get("event") == "batch scan split at its separator sheets" and e.get("separators") == [3, 6]
               for e in daemon.events())


@pytest.mark.parametrize(
    "point",
    [
        "replace:(part 2 of 3).pdf:after:1",  # two parts written, the split not yet journaled
        "rename:stack (part 1 of 3):after:1",  # the first letter's outputs in the outbox, not yet final
        "rename:archive/stack.pdf:before:1",  # every letter final, the stack's original not yet archived
    ],
)
def test_kill_9_mid_split_resumes_to_exactly_three_letters_once_each(tmp_path, daemons, point):
    daemon = _daemon(tmp_path, daemons, "patch-t")
    daemon.inbox.mkdir(parents=True, exist_ok=True)
    (daemon.inbox / "stack.pdf").write_bytes(stack_bytes(SHEETS["patch-t"]()))
    daemon.start(env={"CHAOS_KILL": point}, wait=False)
    assert daemon.wait_dead(240) == -9, "the injected kill must fire"
    assert (tmp_path / "chaos.log").read_text().strip(), f"chaos point {point} was not reached"
    daemon.start(env={"CHAOS_KILL": ""})
    wait_for(lambda: _settled(daemon), 240, "recovery after the kill")
    assert daemon.stop() == 0
    _check_three_letters(daemon)


def test_a_multi_page_tiff_stack_is_split_like_a_pdf(tmp_path, daemons):
    """A scanner that writes TIFF: the frames between the separators become each part's PDF."""
    from tests.test_separators import LETTERS, _scan

    frames = []
    for index, name in enumerate(LETTERS):
        if index:
            frames.append(SHEETS["barcode:NEXT-LETTER"]())
        frames += [_scan(name), _scan("c02-22.pdf")]
    daemon = _daemon(tmp_path, daemons, "barcode:NEXT-LETTER").start()
    staged = tmp_path / "stack.tiff"
    frames[0].save(staged, save_all=True, append_images=frames[1:], compression="tiff_lzw", dpi=(192, 192))
    staged.rename(daemon.inbox / "stack.tiff")
    wait_for(lambda: _settled(daemon), 240, "the TIFF stack's three letters published")
    assert daemon.stop() == 0
    for folder, pages in zip(PARTS, ([1, 2], [4, 5], [7, 8]), strict=True):
        document = json.loads((daemon.outbox / folder / f"{folder}.json").read_text())
        assert document["source"] == "stack.tiff" and document["source_pages"] == pages
        assert "tip-toeing" in (daemon.outbox / folder / f"{folder}.md").read_text().lower()
    assert sorted(path.name for path in daemon.archive.rglob("*") if path.is_file()) == ["stack.tiff"]


def test_an_archive_that_cannot_be_written_when_the_stack_is_done_retries_the_stack_and_the_daemon_goes_on(
    tmp_path, daemons
):
    """The stack's original is archived by the worker of its last part: a failing move goes through
    the handling every document gets (retried with backoff), not out of the worker."""
    daemon = ChaosDaemon(tmp_path / "tree", env=chaos_env(tmp_path / "chaos.log"),
                         extra_config="max_documents_in_flight = 2\nmax_attempts = 50\n",
                         inbox_config='split_on = ["patch-t"]\nrotate_pages = false\n')
    daemons.append(daemon)
    daemon.start()
    daemon.archive.rmdir()
    daemon.archive.write_text("not a folder")  # every move into it fails (root ignores permissions)
    (daemon.inbox / "stack.pdf").write_bytes(stack_bytes(SHEETS["patch-t"]()))
    wait_for(lambda: daemon.count_rows("parent_id IS NOT NULL AND state = 'published'") == 3, 240,
             "the three letters published")
    wait_for(lambda: any(e.get("event") == "unexpected error while processing" and e.get("doc") == daemon.journal_rows(
        "SELECT id FROM documents WHERE parent_id IS NULL")[0]["id"] for e in daemon.events()), 60,
        "the stack's archive move to fail")
    assert daemon.alive
    assert daemon.count_rows("parent_id IS NULL AND state IN ('published', 'failed')") == 0
    daemon.archive.unlink()
    daemon.archive.mkdir()
    wait_for(lambda: _settled(daemon), 120, "the stack archived once the archive is back")
    assert daemon.stop() == 0
    _check_three_letters(daemon)


def test_chandrad_once_gives_a_stack_one_output_folder_per_letter_and_leaves_the_original(tmp_path):
    stack = tmp_path / "stack.pdf"
    original = stack_bytes(SHEETS["patch-t"]())
    stack.write_bytes(original)
    out = once_with_tesseract(tmp_path / "once", [stack], 'split_on = ["patch-t"]\nrotate_pages = false\n')
    assert sorted(path.name for path in out.iterdir()) == PARTS
    for folder, pages in zip(PARTS, ([1, 2], [4, 5], [7, 8]), strict=True):
        document = json.loads((out / folder / f"{folder}.json").read_text())
        assert document["source"] == "stack.pdf" and document["source_pages"] == pages
        assert "tip-toeing" in (out / folder / f"{folder}.md").read_text().lower()
    assert stack.read_bytes() == original


def _host(root: Path, made: list[ChaosDaemon], host_id: str, share: Path) -> ChaosDaemon:
    """A daemon of its own (state, log) on the folders ``share`` holds: one host of a shared inbox."""
    home = root / host_id
    shared = {name: share / name for name in ("inbox", "outbox", "archive", "failed")}
    daemon = ChaosDaemon(
        home, env=chaos_env(root / f"chaos-{host_id}.log"),
        extra_config=f'host_id = "{host_id}"\ntakeover_seconds = 3\nmax_documents_in_flight = 2\n',
        inbox_config=(f'outbox = "{shared["outbox"]}"\narchive = "{shared["archive"]}"\n'
                      f'failed = "{shared["failed"]}"\nsplit_on = ["patch-t"]\nrotate_pages = false\n'),
    )
    daemon.config.write_text(daemon.config.read_text().replace(f'path = "{home / "inbox"}"', f'path = "{shared["inbox"]}"'))
    daemon.inbox, daemon.outbox, daemon.archive, daemon.failed = (
        shared["inbox"], shared["outbox"], shared["archive"], shared["failed"])
    made.append(daemon)
    return daemon


def _claimed_originals(inbox: Path) -> list[Path]:
    claimed = inbox / ".chandrad" / "claimed"
    return [path for path in claimed.glob("*/*/*") if path.is_file() and not path.name.startswith(".")]


@pytest.mark.parametrize(
    "point",
    [
        "replace:(part 2 of 3).pdf:after:1",  # a part written, the split not yet committed
        "rename:stack (part 1 of 3):after:1",  # the split committed, the first letter's outputs in place
        "rename:archive/stack.pdf:before:1",  # every letter final, the stack's original not yet archived
    ],
)
def test_a_host_killed_mid_stack_on_a_shared_inbox_leaves_a_survivor_exactly_three_letters_once_each(
    tmp_path, daemons, point
):
    """host-a splits a stack and is killed at ``point``; host-b takes the stack over with its parts
    (those the stack's claim record lists) and ends it: each letter published once, the stack
    archived once, nothing in failed/ or left in the claims; host-a, restarted, does nothing twice."""
    share = tmp_path / "share"
    first, second = _host(tmp_path, daemons, "host-a", share), _host(tmp_path, daemons, "host-b", share)
    first.inbox.mkdir(parents=True)
    (first.inbox / "stack.pdf").write_bytes(stack_bytes(SHEETS["patch-t"]()))
    first.start(env={"CHAOS_KILL": point}, wait=False)
    assert first.wait_dead(240) == -9, "the injected kill must fire"
    assert (tmp_path / "chaos-host-a.log").read_text().strip(), f"chaos point {point} was not reached"
    second.start()

    def settled() -> bool:
        names = sorted(path.name for path in second.outbox.iterdir() if not path.name.startswith("."))
        archived = [path.name for path in second.archive.rglob("*") if path.is_file()]
        return names == PARTS and archived == ["stack.pdf"] and not _claimed_originals(second.inbox)

    wait_for(settled, 240, "host-b to end host-a's stack")
    taken = {e["doc"] for e in second.events() if e.get("event") == "took over a document of a host that stopped"}
    assert taken, "host-b took host-a's stack over"
    first.start(env={"CHAOS_KILL": ""})
    time.sleep(3)  # host-a's recovery and first rescan: it must neither publish nor fail anything again
    assert first.stop() == 0 and second.stop() == 0
    assert sorted(path.name for path in second.outbox.iterdir() if not path.name.startswith(".")) == PARTS
    for folder, pages in zip(PARTS, ([1, 2], [4, 5], [7, 8]), strict=True):
        document = json.loads((second.outbox / folder / f"{folder}.json").read_text())
        assert document["source"] == "stack.pdf" and document["source_pages"] == pages
        assert "tip-toeing" in (second.outbox / folder / f"{folder}.md").read_text().lower()
    assert [path.name for path in second.archive.rglob("*") if path.is_file()] == ["stack.pdf"]
    assert not [path for path in second.failed.rglob("*") if path.is_file()]
    assert not _claimed_originals(second.inbox)
    for host in (first, second):
        unfinished = host.journal_rows("SELECT id, state FROM documents WHERE state NOT IN ('published')")
        assert unfinished == [], f"{host.root.name}: {unfinished}"
