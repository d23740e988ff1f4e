"""At start-up: finish what a crash or stop interrupted, and sweep what it left behind.

``recover`` returns the documents to process again: a ``settled`` row whose claim was cut short
is claimed now (or forgotten, if its file is gone: it never entered), one claimed already (cut
short in intake's duplicate check) is queued, where the stages check it again; ``preparing`` and
``inferring`` go back to ``queued`` (their finished pages are kept); ``queued`` and ``publishing``
resume as they are (the stages know how); a document another host took over while this one was
down is forgotten (``hosts.claims.taken_over_by``), and a claim folder of ours the journal never recorded
is adopted. ``sweep_leftovers`` then removes the staging, work and empty claim folders of
documents that are final.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import structlog

from chandrad.errors import InboxUnreachableError
from chandrad.hosts import claims, seen
from chandrad.runtime import Runtime, remove_claim_folder
from chandrad.storage import folders
from chandrad.storage.durable import move_durably
from chandrad.storage.journal import Document, storable
from chandrad.storage.schema import FINAL_STATES

T = TypeVar("T")

log = structlog.get_logger("chandrad.document.recovery")


async def recover(runtime: Runtime) -> list[str]:
    """After a crash: finish claims, and return the ids of documents to process again."""
    journal = runtime.journal
    resumable = []
    unreachable = await _unreachable_inboxes(runtime)
    for doc in await journal.call(journal.unfinished):
        inbox = runtime.inboxes.get(doc.inbox)
        if inbox is None:
            log.warning("document belongs to an inbox no longer configured; leaving it", doc=doc.id)
            continue
        if inbox.path in unreachable:
            if doc.state in ("preparing", "inferring"):
                # Resumed like any other: its stages check the share again, within their deadlines.
                await journal.call(journal.set_state, doc.id, "queued")
                resumable.append(doc.id)
            elif doc.state != "settled":
                resumable.append(doc.id)
            # A half-claimed one needs the share to be finished: it waits for the next start.
            continue
        claimed = folders.claimed_path(inbox.path, runtime.host_id, doc.id, Path(doc.rel_path))
        taker = await runtime.on_inbox(inbox.path, _taken_over, inbox.path, doc, claimed)
        if taker is not None:
            await claims.forget_taken_over(runtime, doc, inbox, taker)
            continue
        if doc.state == "settled" and doc.claimed_path:
            # Claimed, then cut short in intake's duplicate check or while failing as a copy: the
            # stages' resume checks it again, or completes the failure already on disk.
            await journal.call(journal.set_state, doc.id, "queued")
        elif doc.state == "settled":
            if not await runtime.on_inbox(inbox.path, _finish_claim, inbox.path, doc, claimed, runtime.host_id):
                await journal.call(journal.forget, doc.id)  # never taken in (or another host took it in)
                continue
            await journal.call(journal.set_state, doc.id, "queued", claimed_path=str(claimed))
        elif doc.state in ("preparing", "inferring"):
            await journal.call(journal.set_state, doc.id, "queued")
        resumable.append(doc.id)
    resumable += await _adopt_unrecorded_claims(runtime, unreachable)
    if resumable:
        log.info("resuming documents interrupted by a stop or crash", count=len(resumable))
    await sweep_leftovers(runtime, unreachable)
    return resumable


async def _unreachable_inboxes(runtime: Runtime) -> set[Path]:
    """Inboxes whose share does not answer a check within its deadline: the start
    goes on without their claims and sweeps, instead of waiting for them without end."""
    unreachable = set()
    for inbox in {inbox.path: inbox for inbox in runtime.inboxes.values()}.values():
        # Any answer will do (an unmounted share's empty mount point answers, and the claims'
        # own checks tell that case); only silence past the probe's deadline counts here.
        try:
            await runtime.probe(inbox.path, inbox.path.exists)
        except InboxUnreachableError:
            log.warning(
                "an inbox does not answer at start (a hung network share?); its claims are looked at "
                "when it does, or at the next start",
                inbox=inbox.name,
                path=str(inbox.path),
            )
            unreachable.add(inbox.path)
    return unreachable


def _finish_claim(inbox_path: Path, doc: Document, claimed: Path, host_id: str) -> bool:
    """Move a half-claimed file into its claim folder: whether there is a claimed file now."""
    if claimed.exists():
        return True
    source = find_stored_name(inbox_path, doc.rel_path)
    if not (source.exists() or source.is_symlink()):
        remove_claim_folder(claimed.parent)
        return False
    if claims.read_claim_record(claimed.parent) is None:
        claims.write_claim_record(claimed.parent, claims.claim_record_of(doc, host_id))
    try:
        move_durably(source, claimed)
    except FileNotFoundError:  # another host claimed it a moment ago
        remove_claim_folder(claimed.parent)
        return False
    return True


def _taken_over(inbox_path: Path, doc: Document, claimed_here: Path) -> str | None:
    """The host that took this document over while we were down, or None (blocking).
    ``claimed_here``: where it would be claimed now (a ``settled`` row has no ``claimed_path``)."""
    claimed = Path(doc.claimed_path) if doc.claimed_path else claimed_here
    owner = claims.claim_owner(inbox_path, claimed)
    if owner is None:
        return None  # claimed by an older chandrad (no host level): no other host takes those
    if claimed.exists() or claimed.is_symlink():
        claims.keep_claim(inbox_path, owner, doc.id)
        return None
    taker = claims.taken_over_by(inbox_path, owner, doc.id)
    if taker is not None and _moved_by_us(doc) and claims.marker_before_rename(inbox_path, owner, doc.id):
        # A taker that stopped before its rename, then our own publish and move, then a crash
        # before the journal said so: the document is ours (and published).
        claims.keep_claim(inbox_path, owner, doc.id)
        return None
    return taker


def _moved_by_us(doc: Document) -> bool:
    """The original is at the document's journaled ``final_path`` (archive/, failed/) with its
    size: our own move was done before the crash (our reservation there before the move is empty).
    Only together with a marker from before its taker's rename is that proof: a taker that did
    rename may have moved the original onto the same name (we journal the name before we reserve it)."""
    if not doc.final_path or doc.size <= 0:
        return False
    try:
        return Path(doc.final_path).stat().st_size == doc.size
    except OSError:
        return False


async def _adopt_unrecorded_claims(runtime: Runtime, unreachable: set[Path]) -> list[str]:
    """Claim folders of ours that the journal does not know (a crash between a takeover's rename
    and its journal commit) become documents again."""
    adopted = []
    for inbox in {inbox.path: inbox for inbox in runtime.inboxes.values()}.values():
        if inbox.path in unreachable:
            continue
        for entry in await runtime.on_inbox(inbox.path, _subfolders, folders.host_claims(inbox.path, runtime.host_id)):
            if await runtime.journal.call(runtime.journal.find, entry.name) is not None:
                continue
            doc = await claims.journal_claim(runtime, inbox, entry)
            if doc is not None:
                log.info("adopted a claimed document the journal had not recorded", doc=doc.id, file=doc.rel_path)
                adopted.append(doc.id)
    return adopted


# How many of the latest failed documents the start-up sweep checks for a seen marker left behind.
FAILED_MARKERS_CHECKED = 200


async def sweep_leftovers(runtime: Runtime, unreachable: frozenset[Path] | set[Path] = frozenset()) -> None:
    """Remove what a crash between a document's final commit and its clean-up left behind: its
    staging and work folders, its empty claim folder, and the seen marker of a failed one. Folders
    of documents still in progress are kept (they resume from them); a claim folder that still
    holds a file is never touched, whatever the journal says, because that file may be someone's
    only copy. Of the folders without a host level (an older chandrad's, or another host's own
    folder), only those of documents this journal knows are touched."""
    me = runtime.host_id
    bases: list[tuple[str, Path, bool]] = []
    share_of: dict[Path, Path] = {}  # a claims folder: its inbox, whose threads look at it
    for inbox in runtime.inboxes.values():
        if inbox.path in unreachable:
            continue
        bases += [
            ("staging", folders.host_staging(inbox.outbox, me), False),
            ("staging", folders.staging_root(inbox.outbox), True),
            ("claimed", folders.host_claims(inbox.path, me), False),
            ("claimed", folders.claimed_root(inbox.path), True),
        ]
        share_of[folders.claimed_root(inbox.path)] = inbox.path
    bases.append(("work", folders.work_root(runtime.settings.state_dir), False))
    for kind, base, only_known in bases:
        inbox_path = next((share_of[root] for root in share_of if base.is_relative_to(root)), None)
        await _sweep(runtime, kind, base, only_known, inbox_path)
    journal = runtime.journal
    for doc in await journal.call(journal.recent, FAILED_MARKERS_CHECKED, "failed"):
        failed_in = runtime.inboxes.get(doc.inbox)
        if failed_in is not None and doc.sha256 and runtime.move_originals:
            await runtime.on_inbox(failed_in.path, seen.forget_seen, failed_in.path, doc.sha256, doc.id)


async def _sweep(runtime: Runtime, kind: str, base: Path, only_known: bool, inbox_path: Path | None) -> None:
    journal = runtime.journal

    async def on_its_share(fn: Callable[..., T], *args: Any) -> T:
        # Claims live on the inbox (maybe a share that stops answering): its own threads, never the
        # default executor behind page renders. Staging and work folders are ours, local.
        if inbox_path is not None:
            return await runtime.on_inbox(inbox_path, fn, *args)
        return await asyncio.to_thread(fn, *args)

    for entry in await on_its_share(_subfolders, base):
        doc = await journal.call(journal.find, entry.name)
        if doc is None and only_known:
            continue  # another host's folder, or not ours to judge
        if doc is not None and doc.state not in FINAL_STATES:
            continue
        if kind == "claimed":
            if not await on_its_share(remove_claim_folder, entry):
                log.warning("a claimed file has no unfinished document; leaving it", path=str(entry))
            continue
        await on_its_share(shutil.rmtree, entry, True)


def _subfolders(base: Path) -> list[Path]:
    try:
        return [entry for entry in base.iterdir() if entry.is_dir() and not entry.is_symlink()]
    except OSError:
        return []


def find_stored_name(folder: Path, rel_path: str) -> Path:
    """The inbox file a journal ``rel_path`` was recorded from. Names that are not UTF-8 are
    stored escaped (``journal.storable``), so look for the entry whose stored form matches."""
    path = folder / rel_path
    if path.exists() or path.is_symlink():
        return path
    current = folder
    for part in Path(rel_path).parts:
        candidate = current / part
        if not (candidate.exists() or candidate.is_symlink()):
            try:
                names = os.listdir(current)
            except OSError:
                return path
            match = next((name for name in names if storable(name) == part), None)
            if match is None:
                return path
            candidate = current / match
        current = candidate
    return current
