"""Claims another host can read, and who has a document.

Each host claims into its own folder (``claimed/<host_id>/<doc_id>/``, with a ``.claim.json`` that
says what the file is). A host taking a dead host's claim over writes a ``<doc_id>.taken`` marker
first, then renames the folder into its own claims: the marker tells the dead host, once
restarted, that the document is no longer its own (``taken_over_by``); the winner journals the
document under the same id (``journal_claim``) and processes it from the start.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import structlog

from chandrad.config import InboxSettings
from chandrad.runtime import Runtime
from chandrad.storage import folders
from chandrad.storage.durable import makedirs_durably, write_file_durably
from chandrad.storage.journal import Document
from chandrad.storage.schema import FINAL_STATES

log = structlog.get_logger("chandrad.hosts")


class ClaimLost(Exception):
    """Another host took the document over (this host's heartbeat looked dead to it): this host
    must stop working on it and never publish it."""

    def __init__(self, taker: str) -> None:
        super().__init__(f"document taken over by host {taker}")
        self.taker = taker


# -- the claim record ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ClaimRecord:
    """What a claimed file is, written beside it: the claim folder keeps only the file's name, a
    takeover needs its sub-folders and hash. ``output_dir`` is named before the outputs' rename,
    so that a host taking over a document published but not yet archived finishes it instead of
    publishing it twice."""

    rel_path: str
    sha256: str
    size: int
    mtime_ns: int
    inbox: str
    first_seen: float
    host_id: str
    output_dir: str | None = None
    # A batch scan's part: its stack's id, file and pages (``Document.split_from``).
    split_from: dict[str, Any] | None = None
    # A batch scan's stack, once every part's folder and record are written: the parts' ids. This
    # is the split's commit point on the share: a part its stack does not list is a leftover of a
    # split cut short (the stack is split again, the same ids rewritten), never a document.
    parts: list[str] | None = None
    # Where the original is about to be moved (archive/, once published), named before the name is
    # reserved there: a host taking the document over moves it onto that reservation, not beside it.
    final_path: str | None = None

    def encoded(self) -> bytes:
        return (json.dumps(asdict(self), ensure_ascii=False, indent=1) + "\n").encode("utf-8")


def claim_record_of(doc: Document, host_id: str) -> ClaimRecord:
    return ClaimRecord(doc.rel_path, doc.sha256, doc.size, doc.mtime_ns, doc.inbox, doc.created_at, host_id)


def write_claim_record(claim_folder: Path, record: ClaimRecord) -> None:
    """Blocking. Creates the claim folder (durably) if needed."""
    makedirs_durably(claim_folder)
    write_file_durably(folders.claim_record(claim_folder), record.encoded())


def read_claim_record(claim_folder: Path) -> ClaimRecord | None:
    """The record in ``claim_folder``, or None (none, or unreadable). Keys this chandrad does not
    know (written by a newer one on a shared inbox) are left out, not a reason to give up the
    document: what a takeover needs is in the keys every version writes."""
    try:
        values = json.loads(folders.claim_record(claim_folder).read_text(encoding="utf-8"))
        known = {field.name for field in dataclass_fields(ClaimRecord)}
        return ClaimRecord(**{key: value for key, value in values.items() if key in known})
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def note_output_dir(claimed: Path, output_dir: Path) -> None:
    """Add the output folder to the record of the claim ``claimed`` lies in (blocking; a claim of an
    older chandrad without a record is left so)."""
    record = read_claim_record(claimed.parent)
    if record is not None and record.output_dir != str(output_dir):
        write_claim_record(claimed.parent, ClaimRecord(**{**asdict(record), "output_dir": str(output_dir)}))


def note_final_path(claimed: Path, final_path: Path) -> None:
    """Add the original's reserved destination to the record of the claim ``claimed`` lies in
    (blocking; a claim without a record is left so)."""
    record = read_claim_record(claimed.parent)
    if record is not None and record.final_path != str(final_path):
        write_claim_record(claimed.parent, ClaimRecord(**{**asdict(record), "final_path": str(final_path)}))


def note_parts(claimed: Path, part_ids: list[str]) -> bool:
    """Name a stack's parts in the record of the claim ``claimed`` lies in (blocking), once their
    folders are written: whether the stack is still claimed here (a takeover that renamed it away
    must not have it written back into our claims). A claim without a record (``chandrad once``'s
    file where it lies) has nothing to note."""
    if not (claimed.exists() or claimed.is_symlink()):
        return False
    record = read_claim_record(claimed.parent)
    if record is not None and record.parts != part_ids:
        write_claim_record(claimed.parent, ClaimRecord(**{**asdict(record), "parts": part_ids}))
    return True


def part_listed(claim_folder: Path, record: ClaimRecord) -> bool:
    """Whether the part in ``claim_folder`` is one its stack's record (its folder beside this one,
    in the same host's claims) lists: a document, not a leftover of a split cut short (blocking)."""
    if record.split_from is None:
        return True
    stack = read_claim_record(claim_folder.parent / str(record.split_from.get("parent")))
    return stack is not None and claim_folder.name in (stack.parts or [])


def claimed_file(claim_folder: Path) -> Path | None:
    """The original in a claim folder (its record and temporary files do not count)."""
    try:
        names = os.listdir(claim_folder)
    except OSError:
        return None
    for name in names:
        if folders.is_original(name):
            return claim_folder / name
    return None


# -- who has a document -------------------------------------------------------------------------


def taken_over_by(inbox_path: Path, host_id: str, doc_id: str) -> str | None:
    """The host that took ``doc_id`` over from ``host_id``, or None (blocking). Its claim folder
    under another host's claims says so; else our ``<doc_id>.taken`` marker, which a taker writes
    just before its rename. Call it when our claimed original is gone: a marker beside a claim
    folder still here only means that the taker stopped between the two (``keep_claim``)."""
    holder = held_by_another(inbox_path, host_id, doc_id)
    if holder is not None:
        return holder
    marker = folders.taken_marker(inbox_path, host_id, doc_id)
    try:
        return str(json.loads(marker.read_text(encoding="utf-8")).get("host_id") or "another host")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        return "another host"


def held_by_another(inbox_path: Path, host_id: str, doc_id: str) -> str | None:
    """The other host whose claims hold ``doc_id``'s folder, or None (blocking)."""
    try:
        others = [entry for entry in folders.claimed_root(inbox_path).iterdir() if entry.name != host_id]
    except OSError:
        return None
    return next((other.name for other in others if (other / doc_id).is_dir()), None)


def marker_before_rename(inbox_path: Path, host_id: str, doc_id: str) -> bool:
    """Whether ``doc_id``'s ``.taken`` marker is only a taker's first one, written before its rename,
    and no other host's claims hold the document (blocking): the taker may have stopped before its
    rename. A taker whose rename succeeded says so in the marker (``renamed``)."""
    if held_by_another(inbox_path, host_id, doc_id) is not None:
        return False
    try:
        marker = json.loads(folders.taken_marker(inbox_path, host_id, doc_id).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("renamed") is not True


def claim_owner(inbox_path: Path, claimed: Path) -> str | None:
    """The host whose claims hold the original ``claimed`` (``claimed/<host>/<doc>/<name>``), or
    None for a claim of an older chandrad (``claimed/<doc>/<name>``: no host takes those over). The
    owner is read from the path, not assumed to be us: a host whose host_id changed still has
    claims under its old name, and others take those over once its old heartbeat stops."""
    if claimed.parent.parent == folders.claimed_root(inbox_path):
        return None
    return claimed.parent.parent.name


def lost_to(inbox_path: Path, claimed: Path, doc_id: str) -> str | None:
    """The host that took this claim over, if its original is gone because of a takeover (blocking)."""
    owner = claim_owner(inbox_path, claimed)
    if owner is None or claimed.exists() or claimed.is_symlink():
        return None
    return taken_over_by(inbox_path, owner, doc_id)


def keep_claim(inbox_path: Path, host_id: str, doc_id: str) -> None:
    """Our claim folder is still here: a marker left by a taker that stopped before its rename
    no longer applies (blocking)."""
    folders.taken_marker(inbox_path, host_id, doc_id).unlink(missing_ok=True)


async def forget_taken_over(runtime: Runtime, doc: Document, inbox: InboxSettings, taker: str) -> None:
    """The document is another host's now: no trace of it stays here, and nothing is reported
    (it is neither failed nor lost; the taker publishes it)."""
    journal = runtime.journal
    await journal.call(journal.forget, doc.id)

    def clean() -> None:
        shutil.rmtree(runtime.staging_dir(inbox, doc.id).parent, ignore_errors=True)
        shutil.rmtree(runtime.work_dir(doc.id), ignore_errors=True)

    owner = claim_owner(inbox.path, Path(doc.claimed_path)) if doc.claimed_path else None
    await asyncio.to_thread(clean)
    # The marker is on the share: its inbox's threads, never the default executor behind page renders.
    await runtime.on_inbox(inbox.path, folders.taken_marker(inbox.path, owner or runtime.host_id, doc.id).unlink, True)
    log.info("document taken over by another host", doc=doc.id, inbox=inbox.name, file=doc.rel_path, host=taker)


async def journal_claim(runtime: Runtime, inbox: InboxSettings, claim_folder: Path) -> Document | None:
    """A claim folder of ours the journal has not recorded (taken over just now, or before a crash
    that came before the journal's commit) becomes a document under the folder's id: queued, to be
    processed from the start, or ``publishing`` if its record names an output folder (resume then
    finishes it if those outputs are its own). None: the folder holds no file or no record, or
    the journal has it as final."""
    record = await runtime.on_inbox(inbox.path, read_claim_record, claim_folder)
    original = await runtime.on_inbox(inbox.path, claimed_file, claim_folder)
    if record is None or original is None:
        return None
    if not await runtime.on_inbox(inbox.path, part_listed, claim_folder, record):
        return None  # its stack is split again (the same part rewritten), not yet: not a document
    journal, doc_id = runtime.journal, claim_folder.name
    doc = await journal.call(journal.find, doc_id)
    if doc is None:
        doc = await journal.call(
            journal.add_document,
            inbox.name,
            record.rel_path,
            record.sha256,
            record.size,
            record.mtime_ns,
            doc_id=doc_id,
            created_at=record.first_seen,
        )
    elif doc.state in FINAL_STATES:
        log.warning("a claimed file belongs to a final document; leaving it", doc=doc_id, path=str(original))
        return None
    # A stack whose parts are listed waits for them (split), never split again.
    state = "publishing" if record.output_dir else "split" if record.parts else "queued"
    if doc.state in ("queued", "publishing", "split") and doc.claimed_path is not None:
        state = doc.state
    fields: dict[str, Any] = {"claimed_path": str(original), "next_attempt_at": 0.0}
    if record.output_dir:
        fields["output_dir"] = record.output_dir
    if record.final_path:
        fields["final_path"] = record.final_path
    if record.split_from is not None:
        fields |= {"parent_id": str(record.split_from["parent"]), "split_from": json.dumps(record.split_from)}
    return await journal.call(journal.set_state, doc_id, state, **fields)
