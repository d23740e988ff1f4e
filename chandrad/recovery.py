"""At start-up: finish what a crash or stop interrupted, and sweep what it left behind.

``recover`` returns the documents to process again: a ``settled`` row whose claim was cut short
is claimed now (or forgotten, if its file is gone: it never entered); ``preparing`` and
``inferring`` go back to ``queued`` (their finished pages are kept); ``queued`` and ``publishing``
resume as they are (the stages know how). ``sweep_leftovers`` then removes the staging, work and
empty claim folders of documents that are final.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import structlog

from chandrad import folders
from chandrad.durable import move_durably
from chandrad.journal import Document, storable
from chandrad.runtime import Runtime

log = structlog.get_logger("chandrad.recovery")


async def recover(runtime: Runtime) -> list[str]:
    """After a crash: finish claims, and return the ids of documents to process again."""
    journal = runtime.journal
    resumable = []
    for doc in await journal.call(journal.unfinished):
        inbox = runtime.inboxes.get(doc.inbox)
        if inbox is None:
            log.warning("document belongs to an inbox no longer configured; leaving it", doc=doc.id)
            continue
        if doc.state == "settled":
            claimed = folders.claimed_path(inbox.path, doc.id, Path(doc.rel_path))
            if not await asyncio.to_thread(_finish_claim, inbox.path, doc, claimed):
                await journal.call(journal.forget, doc.id)  # never taken in
                continue
            await journal.call(journal.set_state, doc.id, "queued", claimed_path=str(claimed))
        elif doc.state in ("preparing", "inferring"):
            await journal.call(journal.set_state, doc.id, "queued")
        resumable.append(doc.id)
    if resumable:
        log.info("resuming documents interrupted by a stop or crash", count=len(resumable))
    await sweep_leftovers(runtime)
    return resumable


def _finish_claim(inbox_path: Path, doc: Document, claimed: Path) -> bool:
    """Move a half-claimed file into its claim folder: whether there is a claimed file now."""
    if claimed.exists():
        return True
    source = find_stored_name(inbox_path, doc.rel_path)
    if not (source.exists() or source.is_symlink()):
        return False
    move_durably(source, claimed)
    return True


async def sweep_leftovers(runtime: Runtime) -> None:
    """Remove what a crash between a document's final commit and its clean-up left behind: its
    staging and work folders and its empty claim folder. Folders of documents still in progress
    are kept (they resume from them); a claim folder that still holds a file is never touched,
    whatever the journal says, because that file may be someone's only copy."""
    journal = runtime.journal
    bases: list[tuple[str, Path]] = []
    for inbox in runtime.inboxes.values():
        bases += [("staging", folders.staging_root(inbox.outbox)), ("claimed", folders.claimed_root(inbox.path))]
    bases.append(("work", folders.work_root(runtime.settings.state_dir)))
    for kind, base in bases:
        for entry in await asyncio.to_thread(_subfolders, base):
            try:
                doc: Document | None = await journal.call(journal.get, entry.name)
            except KeyError:
                doc = None
            if doc is not None and doc.state not in ("published", "failed"):
                continue
            if kind == "claimed":
                try:
                    await asyncio.to_thread(entry.rmdir)
                except OSError:
                    log.warning("a claimed file has no unfinished document; leaving it", path=str(entry))
                continue
            await asyncio.to_thread(shutil.rmtree, entry, True)


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
