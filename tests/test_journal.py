"""The journal on real SQLite: state changes, dedupe, retries, pages, and waiting out a lock."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog.testing

from chandrad.errors import ConfigError
from chandrad.storage.journal import STATES, Document, Journal
from chandrad.storage.schema import PageRecord
from chandrad.testing import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1_000.0)


@pytest.fixture
def journal(tmp_path: Path, clock: ManualClock) -> Iterator[Journal]:
    opened = Journal(tmp_path / "journal.sqlite3", clock=clock)
    yield opened
    opened.close()


def add(
    journal: Journal, rel_path: str, sha256: str = "sha-a", inbox: str = "scans", size: int = 10, mtime_ns: int = 1
) -> Document:
    return journal.add_document(inbox, rel_path, sha256, size, mtime_ns)


def queued(journal: Journal, rel_path: str, clock: ManualClock, next_attempt_at: float = 0.0) -> str:
    """A claimed document waiting for its (next) attempt; each one a second younger than the last."""
    clock.advance(1)
    doc = add(journal, rel_path, sha256=f"sha-{rel_path}")
    journal.set_state(doc.id, "queued", claimed_path=f"/claimed/{rel_path}", next_attempt_at=next_attempt_at)
    return doc.id


def page(doc_id: str, page_no: int, html: str = "<div>text</div>", **fields: Any) -> PageRecord:
    return PageRecord(doc_id=doc_id, page_no=page_no, width=100, height=200, html=html, **fields)


def twin(journal: Journal, doc: Document, taken_before: bool = False) -> str | None:
    """The id of the document ``doc`` is a duplicate of, if any."""
    found = journal.find_duplicate(doc.sha256, doc.id, taken_before=taken_before)
    return found.id if found else None


# -- documents and their states ------------------------------------------------------------------


def test_a_new_document_is_settled_with_no_attempts_and_stamped_by_the_clock(journal, clock):
    doc = add(journal, "in/scan.pdf", size=1234, mtime_ns=99)
    assert (doc.inbox, doc.rel_path, doc.sha256, doc.size, doc.mtime_ns) == ("scans", "in/scan.pdf", "sha-a", 1234, 99)
    assert doc.state == "settled" and doc.attempts == 0 and doc.next_attempt_at == 0
    assert doc.error is None and doc.history == [] and doc.claimed_path is None and doc.page_count is None
    assert doc.created_at == doc.updated_at == clock.now
    assert len(doc.id) == 16 and add(journal, "in/scan.pdf").id != doc.id, "each intake gets its own id"


def test_a_state_change_sets_its_fields_and_the_update_time_and_keeps_the_creation_time(journal, clock):
    doc = add(journal, "scan.pdf")
    clock.advance(30)
    changed = journal.set_state(
        doc.id, "queued", claimed_path="/inbox/.chandrad/claimed/x/scan.pdf", next_attempt_at=1_234.5, page_count=3
    )
    assert changed.state == "queued" and changed.claimed_path == "/inbox/.chandrad/claimed/x/scan.pdf"
    assert changed.next_attempt_at == 1_234.5 and changed.page_count == 3
    assert changed.created_at == doc.created_at and changed.updated_at == doc.created_at + 30
    assert journal.get(doc.id) == changed


def test_every_state_of_a_documents_life_is_committed_at_once_for_another_reader(journal, tmp_path):
    doc = add(journal, "scan.pdf")
    reader = sqlite3.connect(tmp_path / "journal.sqlite3")
    try:
        for state in STATES:
            journal.set_state(doc.id, state)
            assert reader.execute("SELECT state FROM documents WHERE id = ?", (doc.id,)).fetchone() == (state,)
    finally:
        reader.close()


def test_an_unknown_state_is_refused_and_the_document_is_left_as_it_was(journal):
    doc = add(journal, "scan.pdf")
    with pytest.raises(ValueError, match="unknown state 'done'"):
        journal.set_state(doc.id, "done")
    assert journal.get(doc.id) == doc


def test_an_unknown_document_id_is_a_key_error(journal):
    with pytest.raises(KeyError):
        journal.get("0123456789abcdef")


def test_the_error_and_history_are_stored_as_json_and_read_back_as_python_values(journal):
    doc = add(journal, "scan.pdf")
    error = {"reason": "the PDF is password-protected", "kind": "permanent", "stage": "inspect"}
    history = [{"reason": "gs took longer than 3 s", "kind": "transient"}, error]
    failed = journal.set_state(doc.id, "failed", error=error, history=history)
    assert failed.error == error and failed.history == history


def test_a_document_survives_closing_and_reopening_the_journal(tmp_path, clock):
    first = Journal(tmp_path / "journal.sqlite3", clock=clock)
    doc = first.set_state(add(first, "scan.pdf").id, "inferring", page_count=6)
    first.close()
    again = Journal(tmp_path / "journal.sqlite3", clock=clock)
    try:
        assert again.get(doc.id) == doc
    finally:
        again.close()


def test_names_that_are_not_utf8_are_stored_as_visible_escapes_and_found_by_their_raw_name(journal):
    raw = "caf\udce9.pdf"  # a Latin-1 name from a Linux directory, as Python decodes it
    doc = add(journal, raw, size=5, mtime_ns=7)
    assert doc.rel_path == "caf\\xe9.pdf"
    claimed = journal.set_state(
        doc.id,
        "failed",
        claimed_path=None,
        final_path="/inbox/" + raw,
        error={"reason": "cannot move the file out of the inbox", "kind": "permanent"},
    )
    assert claimed.final_path == "/inbox/caf\\xe9.pdf"
    found = journal.find_same_file("scans", raw, 5, 7, "/inbox/" + raw)
    assert found is not None and found.id == doc.id


def test_a_field_the_journal_does_not_have_is_an_error_at_once_not_a_wait(journal):
    doc = add(journal, "scan.pdf")
    started = time.monotonic()
    with pytest.raises(sqlite3.OperationalError, match="no such column"):
        journal.set_state(doc.id, "queued", colour="blue")
    assert time.monotonic() - started < 1, "only a busy, locked or full database is waited out"
    assert journal.get(doc.id).state == "settled"


# -- attempts and retries ------------------------------------------------------------------------


def test_a_transient_failure_queues_the_document_for_its_retry_time_and_appends_to_its_history(journal):
    doc = journal.set_state(add(journal, "scan.pdf").id, "inferring", claimed_path="/claimed/scan.pdf")
    first = {"reason": "the engine died", "kind": "transient"}
    second = {"reason": "gs took longer than 3 s", "kind": "transient"}
    after_one = journal.record_attempt_failure(doc.id, first, final=False, retry_at=2_000.0)
    assert after_one.state == "queued" and after_one.attempts == 1 and after_one.next_attempt_at == 2_000.0
    assert after_one.error == first and after_one.history == [first]
    after_two = journal.record_attempt_failure(doc.id, second, final=False, retry_at=3_000.0)
    assert after_two.attempts == 2 and after_two.next_attempt_at == 3_000.0
    assert after_two.error == second and after_two.history == [first, second], "oldest first, none lost"
    assert after_two.claimed_path == "/claimed/scan.pdf"


def test_a_final_failure_marks_the_document_failed_with_every_attempt_in_its_history(journal):
    doc = add(journal, "scan.pdf")
    transient = {"reason": "the engine died", "kind": "transient"}
    journal.record_attempt_failure(doc.id, transient, final=False, retry_at=5.0)
    last = {"reason": "the engine died again", "kind": "transient"}
    failed = journal.record_attempt_failure(doc.id, last, final=True)
    assert failed.state == "failed" and failed.attempts == 2
    assert failed.error == last and failed.history == [transient, last]


def test_due_queued_gives_the_oldest_due_documents_first_and_no_more_than_the_limit(journal, clock):
    ids = [queued(journal, f"scan{n}.pdf", clock) for n in range(5)]
    assert journal.due_queued(now=clock.now, horizon=60, limit=3) == ids[:3]
    assert journal.due_queued(now=clock.now, horizon=60, limit=10) == ids


def test_due_queued_leaves_out_retries_not_yet_due_and_documents_not_queued_or_not_claimed(journal, clock):
    due = queued(journal, "due.pdf", clock, next_attempt_at=5_000.0)
    later = queued(journal, "later.pdf", clock, next_attempt_at=5_030.0)
    unclaimed = add(journal, "unclaimed.pdf", sha256="sha-u")
    journal.set_state(unclaimed.id, "queued")  # its claim (the rename out of the inbox) is not recorded yet
    journal.set_state(queued(journal, "inferring.pdf", clock), "inferring")
    assert journal.due_queued(now=5_000.0, horizon=60, limit=10) == [due], "due at exactly its time"
    assert journal.due_queued(now=4_999.0, horizon=60, limit=10) == []
    assert journal.due_queued(now=5_030.0, horizon=60, limit=10) == [due, later]


def test_a_retry_further_away_than_the_horizon_is_due_since_the_wall_clock_stepped_back(journal, clock):
    scheduled = queued(journal, "scan.pdf", clock, next_attempt_at=5_005.0)
    # Scheduled 5 s ahead at 5 000; NTP then stepped the clock back an hour: it looks 3 605 s away.
    assert journal.due_queued(now=1_400.0, horizon=600, limit=10) == [scheduled]
    assert journal.due_queued(now=1_400.0, horizon=7200, limit=10) == []


def test_unfinished_lists_every_document_not_yet_published_or_failed_oldest_first(journal, clock):
    made = {}
    for state in STATES:
        clock.advance(1)
        made[state] = journal.set_state(add(journal, f"{state}.pdf").id, state).id
    assert [doc.id for doc in journal.unfinished()] == [made[state] for state in STATES[:-2]]


def test_counts_give_the_number_of_documents_in_each_state(journal):
    assert journal.counts() == {}
    for name, state in (("a.pdf", "queued"), ("b.pdf", "queued"), ("c.pdf", "failed"), ("d.pdf", "published")):
        journal.set_state(add(journal, name).id, state)
    add(journal, "e.pdf")
    assert journal.counts() == {"settled": 1, "queued": 2, "failed": 1, "published": 1}


def test_recent_lists_the_last_updated_first_up_to_the_limit_optionally_of_one_state(journal, clock):
    ids = []
    for n in range(4):
        clock.advance(1)
        ids.append(journal.set_state(add(journal, f"{n}.pdf").id, "failed" if n % 2 else "published").id)
    clock.advance(1)
    journal.set_state(ids[0], "published")  # touched last: comes first
    assert [doc.id for doc in journal.recent(3)] == [ids[0], ids[3], ids[2]]
    assert [doc.id for doc in journal.recent(10, state="failed")] == [ids[3], ids[1]]


def test_forget_removes_the_document_and_its_pages_and_nothing_else(journal):
    gone, kept = add(journal, "gone.pdf"), add(journal, "kept.pdf")
    journal.record_page(page(gone.id, 1))
    journal.record_page(page(kept.id, 1))
    journal.forget(gone.id)
    with pytest.raises(KeyError):
        journal.get(gone.id)
    assert journal.pages(gone.id) == [] and [p.doc_id for p in journal.pages(kept.id)] == [kept.id]
    assert journal.counts() == {"settled": 1}


# -- duplicates ----------------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["settled", "queued", "preparing", "inferring", "publishing", "published"])
def test_the_same_content_in_progress_or_published_under_another_name_is_a_duplicate(journal, state):
    first = journal.set_state(add(journal, "first.pdf").id, state)
    assert twin(journal, add(journal, "second.pdf")) == first.id


def test_a_failed_document_other_content_or_the_document_itself_is_no_duplicate(journal):
    journal.set_state(add(journal, "failed.pdf").id, "failed")
    journal.set_state(add(journal, "other.pdf", sha256="sha-other").id, "published")
    doc = journal.set_state(add(journal, "scan.pdf").id, "queued")
    assert twin(journal, doc) is None


def test_a_settled_row_of_the_same_name_is_that_file_taken_in_again_not_a_twin(journal):
    # An intake that broke off before its claim left a settled row: the same file settles again.
    broken_off = add(journal, "scan.pdf")
    again = add(journal, "scan.pdf")
    assert twin(journal, again) is None and twin(journal, broken_off) is None
    elsewhere = add(journal, "scan.pdf", inbox="other-inbox")
    assert twin(journal, elsewhere) == broken_off.id, "the same name in another inbox is another file"


def test_a_claimed_settled_row_of_the_same_name_is_a_twin(journal):
    # Intake keeps a claimed row settled through its duplicate check: the scanner's next file of
    # that name and content, settling meanwhile, is another file, a copy of it.
    in_check = add(journal, "scan.pdf")
    journal.set_state(in_check.id, "settled", claimed_path="/inbox/.chandrad/claimed/h/x/scan.pdf")
    next_scan = add(journal, "scan.pdf")
    assert twin(journal, next_scan) == in_check.id


def test_the_first_journaled_copy_is_the_one_a_duplicate_names(journal):
    first, second, third = add(journal, "first.pdf"), add(journal, "second.pdf"), add(journal, "third.pdf")
    assert twin(journal, third) == first.id
    assert twin(journal, first) == second.id


def test_taken_before_counts_only_copies_journaled_earlier_even_when_the_clock_stepped_back(journal, clock):
    first = journal.set_state(add(journal, "first.pdf").id, "inferring")
    clock.advance(-3600)
    second = journal.set_state(add(journal, "second.pdf").id, "queued")
    assert twin(journal, second, taken_before=True) == first.id
    assert twin(journal, first, taken_before=True) is None, "a resumed first copy is no duplicate of the later one"
    assert twin(journal, first) == second.id


# -- the same file again -------------------------------------------------------------------------


def test_a_published_original_put_back_unchanged_at_its_name_is_the_same_file(journal):
    doc = journal.set_state(add(journal, "scan.pdf", size=10, mtime_ns=5).id, "published", final_path="/inbox/scan.pdf")
    found = journal.find_same_file("scans", "scan.pdf", 10, 5, "/inbox/scan.pdf")
    assert found is not None and found.id == doc.id


@pytest.mark.parametrize(
    ("inbox", "rel_path", "size", "mtime_ns", "path"),
    [
        ("scans", "scan.pdf", 11, 5, "/inbox/scan.pdf"),
        ("scans", "scan.pdf", 10, 6, "/inbox/scan.pdf"),
        ("other", "scan.pdf", 10, 5, "/inbox/scan.pdf"),
        ("scans", "scan.pdf", 10, 5, "/archive/scan.pdf"),
    ],
    ids=["size changed", "mtime changed", "another inbox", "original archived elsewhere"],
)
def test_a_changed_file_or_another_place_is_not_the_same_file(journal, inbox, rel_path, size, mtime_ns, path):
    journal.set_state(add(journal, "scan.pdf", size=10, mtime_ns=5).id, "published", final_path="/inbox/scan.pdf")
    assert journal.find_same_file(inbox, rel_path, size, mtime_ns, path) is None


def test_a_failed_file_that_never_left_the_inbox_is_the_same_file_unless_it_vanished(journal):
    stuck = journal.set_state(
        add(journal, "stuck.pdf").id,
        "failed",
        error={"reason": "cannot move the file out of the inbox", "kind": "permanent"},
    )
    found = journal.find_same_file("scans", "stuck.pdf", 10, 1, "/inbox/stuck.pdf")
    assert found is not None and found.id == stuck.id
    journal.set_state(add(journal, "vanished.pdf").id, "failed", error={"reason": "gone", "kind": "vanished"})
    assert journal.find_same_file("scans", "vanished.pdf", 10, 1, "/inbox/vanished.pdf") is None
    journal.set_state(
        add(journal, "claimed.pdf").id,
        "failed",
        claimed_path="/claimed/claimed.pdf",
        error={"reason": "the PDF is password-protected", "kind": "permanent"},
    )
    assert journal.find_same_file("scans", "claimed.pdf", 10, 1, "/inbox/claimed.pdf") is None, (
        "a claimed file was moved to failed/: what sits at its name now is new"
    )


def test_the_latest_record_of_the_same_file_is_the_one_found(journal, clock):
    for _ in range(2):
        clock.advance(1)
        latest = journal.set_state(add(journal, "scan.pdf").id, "published", final_path="/inbox/scan.pdf")
    found = journal.find_same_file("scans", "scan.pdf", 10, 1, "/inbox/scan.pdf")
    assert found is not None and found.id == latest.id


# -- pages ---------------------------------------------------------------------------------------


def test_a_page_is_read_back_with_every_field_and_pages_come_in_page_order(journal):
    doc = add(journal, "scan.pdf")
    full = page(
        doc.id,
        2,
        html="<div>two</div>",
        prompt_tokens=1651,
        output_tokens=48,
        finish_reason="repetition",
        retries=2,
        latency_s=1.5,
        engine="vllm",
        model="chandra",
        image_names=("p2-0.png",),
        chunks=({"label": "Text", "bbox": [0, 0, 10, 10]},),
    )
    unreadable = page(doc.id, 1, html="", error="the page image could not be decoded")
    journal.record_page(full)
    journal.record_page(unreadable)
    assert journal.pages(doc.id) == [unreadable, full]
    assert journal.done_page_numbers(doc.id) == {1, 2}


def test_recording_a_page_again_replaces_it(journal):
    doc = add(journal, "scan.pdf")
    journal.record_page(page(doc.id, 1, html="<div>first read</div>"))
    journal.record_page(page(doc.id, 1, html="<div>redone</div>"))
    assert [p.html for p in journal.pages(doc.id)] == ["<div>redone</div>"]


def test_a_page_of_a_document_the_journal_does_not_know_is_refused(journal):
    with pytest.raises(sqlite3.IntegrityError):
        journal.record_page(page("0123456789abcdef", 1))


def test_dropping_pages_removes_the_named_ones_or_all_of_one_document_and_no_others(journal):
    doc, other = add(journal, "scan.pdf"), add(journal, "other.pdf")
    for page_no in (1, 2, 3):
        journal.record_page(page(doc.id, page_no))
    journal.record_page(page(other.id, 1))
    journal.drop_pages(doc.id, [2])
    assert journal.done_page_numbers(doc.id) == {1, 3}
    journal.drop_pages(doc.id)
    assert journal.pages(doc.id) == [] and journal.done_page_numbers(other.id) == {1}


# -- off the event loop --------------------------------------------------------------------------


async def test_call_runs_a_journal_method_in_the_journals_own_thread(journal):
    threads = []

    def add_and_note(rel_path: str) -> Document:
        threads.append(threading.current_thread().name)
        return add(journal, rel_path)

    doc = await journal.call(add_and_note, "scan.pdf")
    assert doc.rel_path == "scan.pdf" and journal.get(doc.id) == doc
    assert threads and threads[0].startswith("journal") and threads[0] != threading.main_thread().name


# -- another process holds the write lock --------------------------------------------------------


@pytest.fixture
def lock_holder(tmp_path: Path, journal: Journal) -> Iterator[sqlite3.Connection]:
    """A second connection to the journal's file, as a ``sqlite3`` shell left in a write
    transaction would be. Usable from any thread (a timer releases it)."""
    holder = sqlite3.connect(tmp_path / "journal.sqlite3", isolation_level=None, check_same_thread=False)
    yield holder
    if holder.in_transaction:
        holder.execute("ROLLBACK")
    holder.close()


def give_up_waiting_for_the_lock_after(journal: Journal, milliseconds: int) -> None:
    """SQLite's own wait for a lock is 10 s in the journal; what these tests prove is the journal's
    waiting after SQLite gives up, so they let SQLite give up sooner."""
    journal._db.execute(f"PRAGMA busy_timeout = {milliseconds}")


def test_a_write_waits_while_another_connection_holds_the_lock_and_succeeds_once_it_is_released(journal, lock_holder):
    doc = add(journal, "scan.pdf")
    give_up_waiting_for_the_lock_after(journal, 100)
    lock_holder.execute("BEGIN IMMEDIATE")
    release = threading.Timer(1.5, lambda: lock_holder.execute("COMMIT"))
    release.start()
    started = time.monotonic()
    try:
        with structlog.testing.capture_logs() as events:
            changed = journal.set_state(doc.id, "queued", claimed_path="/claimed/scan.pdf")
    finally:
        release.join()
    assert time.monotonic() - started >= 1.4, "the write went through while the lock was held"
    assert changed.state == "queued" and journal.get(doc.id).claimed_path == "/claimed/scan.pdf"
    waits = [event for event in events if event["event"] == "the journal cannot be written; waiting"]
    assert waits and waits[0]["log_level"] == "warning" and waits[0]["journal"] == str(journal.path)


def test_closing_the_journal_ends_a_wait_for_the_lock_with_an_error_instead_of_hanging(journal, lock_holder):
    doc = add(journal, "scan.pdf")
    give_up_waiting_for_the_lock_after(journal, 100)
    lock_holder.execute("BEGIN IMMEDIATE")  # held until the test ends
    outcome: list[BaseException | Document] = []

    def write() -> None:
        try:
            outcome.append(journal.set_state(doc.id, "queued"))
        except BaseException as error:  # whatever it is, the test inspects it
            outcome.append(error)

    with structlog.testing.capture_logs() as events:
        writer = threading.Thread(target=write)
        writer.start()
        deadline = time.monotonic() + 10
        while not events and time.monotonic() < deadline:
            time.sleep(0.05)
        assert events, "the write never started waiting for the lock"
        journal.close()
        writer.join(5)
    assert not writer.is_alive(), "the write still waits after close"
    assert len(outcome) == 1 and isinstance(outcome[0], sqlite3.OperationalError), outcome


def test_a_journal_another_connection_holds_locked_is_refused_at_open_naming_the_way_out(tmp_path, lock_holder):
    # SQLite's busy timeout (10 s) runs out first: this test takes that long.
    lock_holder.execute("BEGIN IMMEDIATE")
    with pytest.raises(ConfigError, match=r"cannot open the journal .*another chandrad uses this state_dir"):
        Journal(tmp_path / "journal.sqlite3")
