"""Retention: final documents are remembered for ``retention.days``, then forgotten.

A pass (``Pruner.prune_once``) removes, each judged by its own age against one cutoff: final journal
rows (published, failed; never one whose delivery is still pending) with their page and delivery
rows (``Journal.prune``), then on each inbox the seen markers, takeover markers, leftovers of
crashes and the heartbeats and empty folders of hosts dead that long
(``hosts.sweep.MarkerSweep``). A copy of a document is a duplicate while its journal row or its
seen marker is there (``intake.duplicate_of`` asks both), so a copy is processed again once both
are gone: duplicates are recognised within ``retention.days``.

Crash safety. Every removal is atomic on its own: a batch of rows is one transaction, a marker one
unlink. None is decided by another's presence (a marker is not removed because its row went, nor
a row kept because its marker is there), so a kill between any two leaves nothing that the next
pass would judge otherwise than this one: whatever a killed pass left is removed by the next, and
nothing dangles for ever. The rows go first only because they are local and cheap: a share that
does not answer holds up its own markers, not the journal's prune. Either order keeps a copy a
duplicate until both are gone: with the row gone and its marker left, intake finds the marker,
and its document unknown to the journal counts as a twin; with the marker gone first, the row.

Nothing here runs on the event loop: the journal's batches on its thread (``Journal.call``), the
markers' steps on their inbox's threads (``Runtime.on_inbox``), with the loop free between them.
"""

from __future__ import annotations

import asyncio
import functools
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from chandrad.config import Settings
from chandrad.errors import InboxUnreachableError
from chandrad.hosts.sweep import MarkerSweep
from chandrad.runtime import Runtime
from chandrad.storage import folders

log = structlog.get_logger("chandrad.document.retention")

DAY_SECONDS = 86_400.0
# The first pass, this long after the start: recovery, the first heartbeats and the start-up scan's
# intake go first.
FIRST_PASS_SECONDS = 60.0


@dataclass
class PruneReport:
    """What one pass removed: journal rows (documents, with their pages and deliveries) and, on
    every reachable inbox, markers and dead hosts' leftovers."""

    rows: int = 0
    seen: int = 0
    taken: int = 0
    heartbeats: int = 0
    folders: int = 0
    leftovers: int = 0
    examined: int = 0  # names looked at on the inboxes
    batches: int = 0  # journal transactions
    steps: int = 0  # marker steps, all inboxes
    unreachable: list[str] = field(default_factory=list)  # inboxes whose markers waited for the next pass
    rows_seconds: float = 0.0
    markers_seconds: float = 0.0

    @property
    def removed(self) -> int:
        return self.rows + self.seen + self.taken + self.heartbeats + self.folders + self.leftovers


class Pruner:
    """The retention task: a pass ``FIRST_PASS_SECONDS`` after the start, then every
    ``retention.interval_seconds``; none while ``retention.days`` is 0. Settings are read at each
    pass (``settings_fn``), so a reload applies to the next one."""

    def __init__(
        self, settings_fn: Callable[[], Settings], runtime: Runtime, *, first_pass_seconds: float | None = None
    ) -> None:
        self.settings_fn = settings_fn
        self.runtime = runtime
        self.first_pass_seconds = first_pass_seconds

    async def run(self) -> None:
        """Loop for ever (until cancelled)."""
        first = FIRST_PASS_SECONDS if self.first_pass_seconds is None else self.first_pass_seconds
        await asyncio.sleep(first)
        while True:
            retention = self.settings_fn().retention
            if retention.days > 0:
                try:
                    report = await self.prune_once(self.runtime.clock())
                except (OSError, sqlite3.Error) as error:
                    log.warning("the retention pass stopped; the next one goes on", error=str(error))
                else:
                    if report.removed or report.unreachable:
                        log.info(
                            "retention pass",
                            rows=report.rows,
                            seen_markers=report.seen,
                            taken_markers=report.taken,
                            heartbeats=report.heartbeats,
                            folders=report.folders,
                            leftovers=report.leftovers,
                            names_looked_at=report.examined,
                            unreachable=report.unreachable,
                            seconds=round(report.rows_seconds + report.markers_seconds, 2),
                        )
            await asyncio.sleep(retention.interval_seconds)

    async def prune_once(self, now: float) -> PruneReport:
        """One whole pass for the cutoff ``now - retention.days``, in batches of
        ``retention.batch_size`` rows or names."""
        settings = self.settings_fn()
        retention = settings.retention
        report = PruneReport()
        if retention.days <= 0:
            return report
        cutoff = now - retention.days * DAY_SECONDS
        batch = retention.batch_size
        journal = self.runtime.journal
        started = time.monotonic()
        # The rows first, then the markers: each judged by its own age, so a kill between (or
        # within) them leaves nothing half removed and nothing the next pass would not find.
        while True:
            # One transaction each, on the journal's thread: intake's and the workers' calls queue
            # between two batches, never behind the whole prune.
            pruned = await journal.call(journal.prune, cutoff, batch)
            report.batches += 1
            report.rows += len(pruned)
            if len(pruned) < batch:
                break
        report.rows_seconds = time.monotonic() - started
        started = time.monotonic()
        for inbox_path in dict.fromkeys(inbox.path for inbox in settings.inbox):
            if not await self._reachable(inbox_path):
                report.unreachable.append(str(inbox_path))
                continue
            sweep = MarkerSweep(
                inbox_path, settings.host_id, cutoff, now=now, takeover_seconds=settings.takeover_seconds
            )
            # No deadline on a step (it may take a few seconds on a slow share, and a probe left
            # stuck would fail the inbox's heartbeats meanwhile): one inbox thread, one step at a time.
            while True:
                report.steps += 1
                if await self.runtime.on_inbox(inbox_path, sweep.step, batch):
                    break
            tally = sweep.tally
            report.seen += tally.seen
            report.taken += tally.taken
            report.heartbeats += tally.heartbeats
            report.folders += tally.folders
            report.leftovers += tally.leftovers
            report.examined += tally.examined
        report.markers_seconds = time.monotonic() - started
        return report

    async def _reachable(self, inbox_path: Path) -> bool:
        """Whether the inbox's ``.chandrad`` is there within the probe's deadline: an unmounted
        share's empty mount point has no markers to judge, and a hung one is left for the next pass."""
        try:
            return await self.runtime.probe(inbox_path, functools.partial(folders.inbox_reachable, inbox_path))
        except (OSError, InboxUnreachableError):
            return False
