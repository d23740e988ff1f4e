"""What every step of a document's journey works with, passed in (never global), and its outcome."""

from __future__ import annotations

import asyncio
import calendar
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar

from chandrad import prepare
from chandrad.config import InboxSettings, Settings
from chandrad.engine.base import Engine
from chandrad.storage import folders, naming
from chandrad.storage.durable import reserve_name
from chandrad.storage.journal import Document, Journal
from chandrad.tools import ToolWorkers

T = TypeVar("T")

# Threads for the file work on the inboxes: intake's hash, claim record and rename, every share
# probe (heartbeats, claims, outputs), and the moves of originals out of their claims (to archive/
# or failed/, a takeover's, recovery's claim checks). Not the loop's default executor: the documents in
# progress hold its threads for each page render's whole child run, so a burst of drops was taken
# in behind them (96 PDFs queued after 9.9 s instead of 2.3 on 2 cores, bench/NOTES-overhead.md), and a
# probe's deadline, meant for a share that stopped answering, could run out in that queue. Enough
# for intake's loops and the probes besides, and for a few probes stuck on a dead share. A pool for
# each inbox: the checks in flight when a share stops answering stay stuck (a busy daemon has more of
# them than a pool has threads), and in one pool for all, no other inbox's intake or heartbeat ran.
INBOX_THREADS = 16


class Ending(StrEnum):
    """How one pass over a document ended."""

    PUBLISHED = "published"
    FAILED = "failed"
    RETRYING = "queued"  # queued again: an attempt failed and another is due
    TAKEN_OVER = "taken over"  # by another host: forgotten here
    SPLIT = "split"  # a batch scan: its parts are documents of their own now

    @property
    def metric(self) -> str:
        """Its label on chandrad_documents_total."""
        return {Ending.RETRYING: "retried", Ending.TAKEN_OVER: "taken_over"}.get(self, self.value)


@dataclass(frozen=True)
class Outcome:
    doc_id: str
    state: Ending
    output_dir: Path | None = None
    reason: str = ""


ISO_UTC = "%Y-%m-%dT%H:%M:%SZ"


def now_iso(ts: float | None = None) -> str:
    return time.strftime(ISO_UTC, time.gmtime(ts if ts is not None else time.time()))


def from_iso(text: str) -> float | None:
    """The epoch seconds of a time ``now_iso`` wrote, or None for any other text."""
    try:
        return float(calendar.timegm(time.strptime(text, ISO_UTC)))
    except ValueError:
        return None


@dataclass
class Runtime:
    """The settings, the journal and the engine; and the inboxes documents belong to.

    ``move_originals`` is False for ``chandrad once``: files given on the command line are read
    where they are and never moved.
    """

    settings: Settings
    journal: Journal
    engine: Engine
    move_originals: bool = True
    clock: Callable[[], float] = time.time
    inboxes: dict[str, InboxSettings] = field(default_factory=dict)
    # Pages judged before they are read (orientation: a tesseract each) at once, a core each.
    scan_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(os.cpu_count() or 1))
    # By inbox path; each started lazily, a thread at a time: a runtime that never touches an inbox starts none.
    _inbox_threads: dict[Path, ThreadPoolExecutor] = field(default_factory=dict, repr=False)
    _reader_threads: ThreadPoolExecutor | None = field(default=None, repr=False)
    # The PDF page renderers the reader threads keep between pages, one a thread at most: starting
    # one for every page cost as much CPU as the render (bench/NOTES-overhead.md).
    render_workers: ToolWorkers = field(default_factory=lambda: ToolWorkers(keep=os.cpu_count() or 1), repr=False)

    def __post_init__(self) -> None:
        self.inboxes = {**self.inboxes, **{inbox.name: inbox for inbox in self.settings.inbox}}
        self._probes = folders.ShareProbes(self.inbox_threads)

    def inbox_threads(self, inbox_path: Path) -> ThreadPoolExecutor:
        """The threads for the file work on the inbox at ``inbox_path``."""
        threads = self._inbox_threads.get(inbox_path)
        if threads is None:
            threads = ThreadPoolExecutor(max_workers=INBOX_THREADS, thread_name_prefix=f"inbox:{inbox_path.name}")
            self._inbox_threads[inbox_path] = threads
        return threads

    def close(self) -> None:
        """Let the inbox and reader threads end once idle (one blocked on a dead share ends when it
        returns), and the idle page renderers now."""
        for threads in self._inbox_threads.values():
            threads.shutdown(wait=False)
        if self._reader_threads is not None:
            self._reader_threads.shutdown(wait=False)
        self.render_workers.close()

    async def read_original(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the reader threads: the work of reading an original (its probe, its own
        text, each page's render), which waits on a child or decodes, a core's worth each.

        Not the loop's default executor: that one also carries every page's short steps on its way
        to the engine (its ink and orientation, its scaling, its files), and a burst queued there
        put each of them behind every render still to come. On an H100 host, 192 dropped one-page
        PDFs were all prepared 4.6 s after the drop, yet their pages reached the engine over the
        next 15 s (half of them after 14 s), and the daemon read at 0.84 of a bare engine's pace.
        One thread per core: the renders are children, and more of them than cores only share them.
        """
        if self._reader_threads is None:
            self._reader_threads = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="reader")
        return await folders.in_thread(self._reader_threads, fn, *args)

    async def on_inbox(self, inbox_path: Path, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the threads of the inbox at ``inbox_path``, never queued behind page
        renders (no deadline: use ``probe`` for a check on a share that may hang)."""
        return await folders.in_thread(self.inbox_threads(inbox_path), fn, *args)

    async def probe(self, inbox_path: Path, check: Callable[[], T]) -> T:
        """``check()`` on the inbox's threads within a deadline that measures the share, not a queue
        (``folders.ShareProbes``: while one check of the inbox is stuck, the next fail at once)."""
        return await self._probes.run(inbox_path, check)

    def update_settings(self, settings: Settings) -> None:
        """After a reload: documents of an inbox that vanished from the config keep its old settings."""
        self.settings = settings
        self.inboxes.update({inbox.name: inbox for inbox in settings.inbox})

    def inbox_of(self, doc: Document) -> InboxSettings:
        """The settings that apply to ``doc``: its inbox's, with the first ``[[inbox.rule]]``
        matching its path in the inbox applied (``InboxSettings.effective``)."""
        return self.inboxes[doc.inbox].effective(doc.rel_path)

    @property
    def host_id(self) -> str:
        return self.settings.host_id

    def staging_dir(self, inbox: InboxSettings, doc_id: str) -> Path:
        return folders.staging_dir(inbox.outbox, self.host_id, doc_id)

    def work_dir(self, doc_id: str) -> Path:
        return folders.work_dir(self.settings.state_dir, doc_id)

    async def reserve_final_path(
        self, doc: Document, folder: Path, state: str, note: Callable[[Path], Awaitable[object]] | None = None
    ) -> Path:
        """Where ``doc``'s original goes in ``folder`` (archive/, failed/, back into the inbox): its
        free name, journaled (in ``state``) and then reserved on disk (``durable.reserve_name``)
        before the move, so that neither a crash nor another host publishing the same name at the
        same moment makes the move replace a file. ``note``: told each name before it is reserved
        (the claim record, for a host that takes the document over). Call it only while the
        original is still claimed (after the move, ``final_path`` is where it went)."""
        rel = naming.safe_relative(Path(doc.rel_path))
        # archive/ and failed/ sit beside the inbox, often on its share: its threads, not the
        # default executor behind page renders.
        share = self.inboxes[doc.inbox].path
        named = Path(doc.final_path) if doc.final_path and Path(doc.final_path).is_relative_to(folder) else None
        for _ in range(1000):
            if named is not None:
                target = named
            else:
                target = await self.on_inbox(share, naming.free_name, folder / rel.parent, rel.name)
                await self.journal.call(self.journal.set_state, doc.id, state, final_path=str(target))
            if note is not None:
                await note(target)
            if await self.on_inbox(share, reserve_name, target, named is not None):
                return target
            named = None  # taken by another host between our look and our reservation: the next name
        raise FileExistsError(f"no free name for {rel.name} in {folder / rel.parent}")

    async def clear_leftovers(self, doc: Document, inbox: InboxSettings) -> None:
        """A document is final: its page rows, staging and work folders and empty claim folder go."""
        await self.journal.call(self.journal.drop_pages, doc.id)
        await asyncio.to_thread(self._remove_folders, doc, inbox)
        if doc.claimed_path and self.move_originals:  # on the share: its threads
            await self.on_inbox(inbox.path, remove_claim_folder, Path(doc.claimed_path).parent)

    def _remove_folders(self, doc: Document, inbox: InboxSettings) -> None:
        shutil.rmtree(self.staging_dir(inbox, doc.id).parent, ignore_errors=True)
        # A document begun by an older chandrad staged without the host level.
        shutil.rmtree(folders.staging_root(inbox.outbox) / doc.id, ignore_errors=True)
        prepare.cleanup(self.work_dir(doc.id))


def remove_claim_folder(folder: Path) -> bool:
    """Remove a claim folder that holds no file but its ``.claim.json``: whether it is gone. One
    that still holds a file (someone's only copy, whatever the journal says) is left."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if any(folders.is_original(name) for name in names):
        return False
    for name in names:  # the record, and a temporary file a crash left while writing it
        try:
            os.unlink(folder / name)
        except OSError:
            pass
    try:
        os.rmdir(folder)
    except OSError:
        return False  # a file arrived meanwhile
    return True
