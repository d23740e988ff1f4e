"""Start-up recovery on a real journal and real folders, set up as a crash leaves them: claims
cut short are finished or forgotten, interrupted steps go back to ``queued``, and what final
documents left behind is swept, but a claim folder holding a file is never touched."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from chandrad.config import EngineSettings, InboxSettings, Settings
from chandrad.document.recovery import find_stored_name, recover, sweep_leftovers
from chandrad.runtime import Runtime
from chandrad.storage import folders
from chandrad.storage.journal import Document, Journal
from chandrad.storage.schema import PageRecord
from chandrad.testing import ManualClock
from tests.reliability.chaoslib import DrawingEngine


@dataclass
class World:
    inbox: InboxSettings
    settings: Settings
    journal: Journal
    runtime: Runtime

    def add(self, rel: str, state: str = "settled", **fields: object) -> Document:
        doc = self.journal.add_document(self.inbox.name, rel, os.urandom(8).hex(), 4, 1)
        if state != "settled" or fields:
            doc = self.journal.set_state(doc.id, state, **fields)
        return doc

    def claimed(self, doc: Document, data: bytes | None = b"scan") -> Path:
        """The document's claimed original (written when ``data`` is given; the folder only if None)."""
        path = folders.claimed_path(self.inbox.path, self.settings.host_id, doc.id, Path(doc.rel_path))
        path.parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            path.write_bytes(data)
        return path

    def leftovers(self, doc: Document) -> tuple[Path, Path]:
        """A staging and a work folder with a file in each, as a document in progress has them."""
        staging = folders.staging_dir(self.inbox.outbox, self.settings.host_id, doc.id)
        work = folders.work_dir(self.settings.state_dir, doc.id)
        for folder in (staging, work):
            folder.mkdir(parents=True)
            (folder / "part").write_bytes(b"x")
        return staging.parent, work


def write_raw_name(folder: Path, name: bytes, data: bytes) -> Path:
    """A file whose name is the bytes ``name`` (not necessarily UTF-8), as an old scanner writes it."""
    raw = os.path.join(os.fsencode(folder), name)
    with open(raw, "wb") as handle:
        handle.write(data)
    return Path(os.fsdecode(raw))


def claimed_of(doc: Document) -> Path:
    assert doc.claimed_path is not None
    return Path(doc.claimed_path)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    inbox = InboxSettings.model_validate({"path": tmp_path / "inbox", "settle_seconds": 0})
    settings = Settings(
        state_dir=tmp_path / "state", inbox=(inbox,), engine=EngineSettings(kind="tesseract"), metrics_address=""
    )
    for folder in (inbox.path, inbox.outbox, settings.state_dir):
        folder.mkdir(parents=True)
    clock = ManualClock(tick=1)
    journal = Journal(settings.state_dir / "journal.sqlite3", clock=clock)
    yield World(inbox, settings, journal, Runtime(settings, journal, DrawingEngine(), clock=clock))
    journal.close()


async def test_a_settled_row_whose_file_is_still_at_its_name_is_claimed_and_queued(world: World) -> None:
    (world.inbox.path / "sub").mkdir()
    source = world.inbox.path / "sub" / "scan.pdf"
    source.write_bytes(b"%PDF-1.4 not moved yet")
    doc = world.add("sub/scan.pdf")
    assert await recover(world.runtime) == [doc.id]
    row = world.journal.get(doc.id)
    claimed = folders.claimed_path(world.inbox.path, world.settings.host_id, doc.id, Path("sub/scan.pdf"))
    assert row.state == "queued" and row.claimed_path == str(claimed)
    assert claimed.read_bytes() == b"%PDF-1.4 not moved yet" and not source.exists()


async def test_a_settled_row_whose_file_already_reached_its_claim_folder_is_queued(world: World) -> None:
    doc = world.add("scan.pdf")
    claimed = world.claimed(doc)  # moved, then the crash came before the row said "queued"
    assert await recover(world.runtime) == [doc.id]
    row = world.journal.get(doc.id)
    assert row.state == "queued" and row.claimed_path == str(claimed)
    assert claimed.read_bytes() == b"scan"


async def test_a_claimed_settled_row_whose_original_went_to_failed_is_queued_not_forgotten(world: World) -> None:
    """Intake journals the claim (``claimed_path``) and keeps the row ``settled`` through its
    duplicate check; a crash after a copy's move to failed/ leaves no file in the claim folder.
    Forgetting the row would lose its failure; queued, the stages' resume completes it."""
    doc = world.add("copy.pdf")
    claimed = world.claimed(doc, data=None)
    failed = world.inbox.failed / "copy.pdf"
    failed.parent.mkdir(parents=True)
    failed.write_bytes(b"scan")
    doc = world.journal.set_state(doc.id, "settled", claimed_path=str(claimed), final_path=str(failed))
    assert await recover(world.runtime) == [doc.id]
    row = world.journal.get(doc.id)
    assert row.state == "queued" and row.claimed_path == str(claimed) and row.final_path == str(failed)


async def test_a_settled_row_whose_file_is_gone_is_forgotten(world: World) -> None:
    doc = world.add("vanished.pdf")
    assert await recover(world.runtime) == []
    with pytest.raises(KeyError):
        world.journal.get(doc.id)


async def test_a_settled_row_with_a_name_that_is_not_utf8_finds_its_file(world: World) -> None:
    """A Latin-1 ``café.png`` is journaled escaped (``caf\\xe9.png``); recovery finds the real
    name by comparing stored forms, and claims it."""
    raw = write_raw_name(world.inbox.path, b"caf\xe9.png", b"latin-1 name")
    doc = world.add(os.fsdecode(b"caf\xe9.png"))
    assert doc.rel_path == "caf\\xe9.png"
    assert find_stored_name(world.inbox.path, doc.rel_path) == raw
    assert await recover(world.runtime) == [doc.id]
    assert claimed_of(world.journal.get(doc.id)).read_bytes() == b"latin-1 name"
    assert not raw.exists()


async def test_preparing_and_inferring_documents_go_back_to_queued_keeping_their_finished_pages(
    world: World,
) -> None:
    preparing = world.add("a.pdf")
    world.journal.set_state(preparing.id, "preparing", claimed_path=str(world.claimed(preparing)))
    inferring = world.add("b.pdf")
    world.journal.set_state(inferring.id, "inferring", claimed_path=str(world.claimed(inferring)), page_count=3)
    world.journal.record_page(PageRecord(inferring.id, 1, 10, 10, "<div>page one</div>"))
    assert await recover(world.runtime) == [preparing.id, inferring.id]
    assert world.journal.get(preparing.id).state == "queued"
    resumed = world.journal.get(inferring.id)
    assert resumed.state == "queued" and resumed.page_count == 3
    assert world.journal.done_page_numbers(inferring.id) == {1}


async def test_queued_and_publishing_documents_resume_as_they_are_oldest_first(world: World) -> None:
    publishing = world.add("old.pdf")
    world.journal.set_state(publishing.id, "publishing", claimed_path=str(world.claimed(publishing)), output_dir="/o")
    queued = world.add("new.pdf")
    world.journal.set_state(queued.id, "queued", claimed_path=str(world.claimed(queued)), attempts=2)
    assert await recover(world.runtime) == [publishing.id, queued.id]
    assert (world.journal.get(publishing.id).state, world.journal.get(publishing.id).output_dir) == ("publishing", "/o")
    assert (world.journal.get(queued.id).state, world.journal.get(queued.id).attempts) == ("queued", 2)


async def test_final_documents_and_those_of_an_inbox_no_longer_configured_are_not_resumed(world: World) -> None:
    world.add("done.pdf", "published")
    world.add("bad.pdf", "failed")
    orphan = world.journal.add_document("removed-inbox", "scan.pdf", "sha", 4, 1)
    world.journal.set_state(orphan.id, "inferring", claimed_path="/elsewhere/scan.pdf")
    assert await recover(world.runtime) == []
    assert world.journal.get(orphan.id).state == "inferring", "left as it was, for when its inbox returns"


async def test_recovery_sweeps_the_staging_work_and_empty_claim_folders_of_final_documents(world: World) -> None:
    published = world.add("done.pdf", "published")
    failed = world.add("bad.pdf", "failed")
    swept = [*world.leftovers(published), *world.leftovers(failed)]
    claim_folders = [world.claimed(published, None).parent, world.claimed(failed, None).parent]
    await recover(world.runtime)
    assert [folder for folder in [*swept, *claim_folders] if folder.exists()] == []


async def test_the_sweep_keeps_the_folders_of_documents_still_in_progress(world: World) -> None:
    doc = world.add("busy.pdf")
    claimed = world.claimed(doc)
    world.journal.set_state(doc.id, "inferring", claimed_path=str(claimed))
    staging, work = world.leftovers(doc)
    await sweep_leftovers(world.runtime)
    assert (staging / "doc" / "part").is_file() and (work / "part").is_file() and claimed.is_file()


async def test_a_claim_folder_holding_a_file_is_never_touched_whatever_the_journal_says(world: World) -> None:
    """Published, or unknown to the journal: the file in its claim folder may be someone's only
    copy, so it stays. In this host's folders, ids the journal does not know are otherwise swept as
    final; outside them (another host's folder, or an older chandrad's), they are left alone."""
    published = world.add("done.pdf", "published")
    kept_published = world.claimed(published, b"only copy")
    own = folders.host_claims(world.inbox.path, world.settings.host_id)
    unknown = own / "0123456789abcdef" / "mystery.pdf"
    unknown.parent.mkdir(parents=True)
    unknown.write_bytes(b"another only copy")
    empty_unknown = own / "fedcba9876543210"
    empty_unknown.mkdir()
    other_host = folders.claimed_root(world.inbox.path) / "fedcba9876543211"
    other_host.mkdir()
    unknown_staging = folders.staging_dir(world.inbox.outbox, world.settings.host_id, "fedcba9876543210")
    unknown_staging.mkdir(parents=True)
    other_staging = folders.staging_root(world.inbox.outbox) / "fedcba9876543211" / "doc"
    other_staging.mkdir(parents=True)
    await sweep_leftovers(world.runtime)
    assert kept_published.read_bytes() == b"only copy"
    assert unknown.read_bytes() == b"another only copy"
    assert not empty_unknown.exists() and not unknown_staging.parent.exists()
    assert other_host.is_dir() and other_staging.is_dir(), "not ours: left alone"
