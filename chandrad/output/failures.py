"""What happens when a step fails: retry with backoff, wait for the environment, or failed/.

A ``WaitError`` (full disk, unreachable inbox) queues the document again without using up an
attempt; any other ``TransientError`` is retried with backoff until ``max_attempts``; a
``PermanentError`` (or the last attempt) moves the original to ``failed/`` beside
``<name>.error.json``, which says why in words and what to do. The report is written and the
original moved before the journal marks the document failed; ``complete_after_crash`` finishes
that commit when a crash came between the two.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from chandrad.backoff import backoff_seconds
from chandrad.config import InboxSettings
from chandrad.errors import DocumentError, WaitError
from chandrad.hosts import claims, seen
from chandrad.output import delivery
from chandrad.runtime import Ending, Outcome, Runtime, now_iso
from chandrad.storage import naming
from chandrad.storage.durable import makedirs_durably, move_durably, reserve_name, write_file_durably
from chandrad.storage.journal import Document

log = structlog.get_logger("chandrad.output.failures")

MAX_WAIT_SECONDS = 60.0
REPORT_SUFFIX = ".error.json"

_ADVICE = {
    "permanent": "Fix or replace the file and drop it into the inbox again.",
    "transient": "Nothing was wrong with the file itself; drop it into the inbox again to retry.",
    "duplicate": "Nothing to do: this content was already processed.",
}


def advice(kind: str) -> str:
    return _ADVICE.get(kind, "Drop the file into the inbox again to retry.")


@dataclass(frozen=True)
class FailureEntry:
    """One entry of a document's history (the journal's ``error`` and ``history``, the report in
    failed/, the webhooks' payload): what went wrong, where, at which attempt, when. Every entry is
    made as one of these (``of`` for an error); ``as_json`` is what is stored and sent."""

    reason: str
    kind: str
    stage: str
    attempt: int
    at: str  # now_iso
    detail: str | None = None
    waits: int | None = None  # a wait (no attempt used): how many in a row
    put_back_from: str | None = None  # `chandrad retry`: where in failed/ the original was

    @classmethod
    def of(cls, error: DocumentError, attempt: int, now: float, waits: int | None = None) -> FailureEntry:
        return cls(error.reason, error.kind, error.stage, attempt, now_iso(now), error.detail or None, waits)

    def as_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "reason": self.reason,
            "kind": self.kind,
            "stage": self.stage,
            "attempt": self.attempt,
            "at": self.at,
        }
        if self.detail:
            entry["detail"] = self.detail
        if self.waits is not None:
            entry["waits"] = self.waits
        if self.put_back_from is not None:
            entry["from"] = self.put_back_from
        return entry


def failure_report(
    doc: Document, inbox: InboxSettings, entry: dict[str, Any], history: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """The ``.error.json`` a person reads. Without ``history``, the original stayed in the inbox."""
    where = (
        {"attempts": entry["attempt"], "first_seen": now_iso(doc.created_at)}
        if history is not None
        else {"original_left_in_inbox": True}
    )
    return {
        "file": Path(doc.rel_path).name,
        "inbox": inbox.name,
        "original_path": doc.rel_path,
        "reason": entry["reason"],
        "kind": entry["kind"],
        "stage": entry["stage"],
        **where,
        "sha256": doc.sha256 or None,
        "doc_id": doc.id,
        "failed_at": entry["at"],
        **({"history": history} if history is not None else {}),
        "what_to_do": advice(entry["kind"]),
    }


def _report_bytes(report: dict[str, Any]) -> bytes:
    return (json.dumps(report, ensure_ascii=False, indent=2) + "\n").encode("utf-8")


def _write_report_and_move(report: dict[str, Any], claimed: Path, target: Path) -> None:
    """One thread hop: the report beside where the original goes, then the original."""
    makedirs_durably(target.parent)
    write_file_durably(target.with_name(target.name + REPORT_SUFFIX), _report_bytes(report))
    if claimed.exists() or claimed.is_symlink():
        move_durably(claimed, target)


class Failures:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    def entry(self, error: DocumentError, attempts: int, waits: int | None = None) -> dict[str, Any]:
        """One history entry (``FailureEntry``) as stored, at this runtime's clock."""
        return FailureEntry.of(error, attempts, self.runtime.clock(), waits).as_json()

    async def handle(self, doc_id: str, error: DocumentError) -> Outcome:
        """Decide what a failed attempt leads to: a wait, a retry, or failed/."""
        journal, settings = self.runtime.journal, self.runtime.settings
        doc = await journal.call(journal.get, doc_id)
        if isinstance(error, WaitError):
            return await self._wait(doc, error)
        attempts = doc.attempts + 1
        if error.permanent or attempts >= settings.max_attempts:
            return await self.fail(doc, error)
        delay = backoff_seconds(settings.retry_backoff_seconds, attempts)
        await journal.call(
            journal.record_attempt_failure,
            doc.id,
            self.entry(error, attempts),
            final=False,
            retry_at=self.runtime.clock() + delay,
        )
        log.warning(
            "document will be retried",
            reason=error.reason,
            stage=error.stage,
            attempt=attempts,
            retry_in_s=round(delay, 1),
        )
        return Outcome(doc.id, Ending.RETRYING, reason=error.reason)

    async def _wait(self, doc: Document, error: WaitError) -> Outcome:
        """Queue the document again later; its attempts and history are left as they were (a long
        outage must neither fail it nor grow its history by one entry per retry)."""
        previous = doc.error if doc.error and doc.error.get("kind") == error.kind else None
        waits = int(previous.get("waits", 0)) + 1 if previous else 1
        delay = backoff_seconds(self.runtime.settings.retry_backoff_seconds, waits, MAX_WAIT_SECONDS)
        entry = self.entry(error, doc.attempts, waits)
        journal = self.runtime.journal
        await journal.call(
            journal.set_state, doc.id, "queued", error=entry, next_attempt_at=self.runtime.clock() + delay
        )
        log.warning(
            "the document waits",
            reason=error.reason,
            kind=error.kind,
            stage=error.stage,
            waits=waits,
            retry_in_s=round(delay, 1),
        )
        return Outcome(doc.id, Ending.RETRYING, reason=error.reason)

    async def fail(self, doc: Document, error: DocumentError) -> Outcome:
        """Move the original to failed/ with ``<name>.error.json`` beside it, and mark the document failed."""
        runtime, journal = self.runtime, self.runtime.journal
        inbox = runtime.inbox_of(doc)
        attempts = doc.attempts + 1
        entry = self.entry(error, attempts)
        claimed = Path(doc.claimed_path) if doc.claimed_path else None
        target = Path(doc.final_path) if doc.final_path else None
        if runtime.move_originals and claimed is not None:
            # An original gone because another host took it over is that host's to publish or
            # fail: failing it here too would report a document that is not lost, and drop the
            # seen marker that now names the taker's copy.
            taker = await runtime.probe(inbox.path, lambda: claims.lost_to(inbox.path, claimed, doc.id))
            if taker is not None:
                await claims.forget_taken_over(runtime, doc, inbox, taker)
                return Outcome(doc.id, Ending.TAKEN_OVER)
            report = failure_report(doc, inbox, entry, [*doc.history, entry])
            try:
                if await runtime.on_inbox(inbox.path, lambda: claimed.exists() or claimed.is_symlink()):
                    # Named and reserved before the move: a crash after it finds the original
                    # there (complete_after_crash); another host's file of that name stays.
                    target = await runtime.reserve_final_path(doc, inbox.failed, doc.state)
                elif target is None:
                    rel = naming.safe_relative(Path(doc.rel_path))
                    target = await runtime.on_inbox(inbox.path, naming.free_name, inbox.failed / rel.parent, rel.name)
                await runtime.on_inbox(inbox.path, _write_report_and_move, report, claimed, target)
            except OSError as move_error:
                # Queue it again (failed/ full or unwritable): left in its old state, it would
                # only have been picked up again at the next start.
                delay = max(runtime.settings.retry_backoff_seconds, 1.0)
                log.error(
                    "cannot move the original to failed/; will try again", error=str(move_error), retry_in_s=delay
                )
                await journal.call(journal.set_state, doc.id, "queued", next_attempt_at=runtime.clock() + delay)
                return Outcome(doc.id, Ending.RETRYING, reason=f"cannot write to failed/: {move_error.strerror}")
        # The deliveries (webhooks, hooks) are committed with the state, in one transaction.
        deliveries = await delivery.planned(runtime, doc, inbox, "failed", entry)
        await journal.call(journal.fail, doc.id, entry, deliveries)
        await runtime.clear_leftovers(doc, inbox)
        await self.forget_content(doc, inbox)
        log.warning(
            "document failed",
            reason=error.reason,
            stage=error.stage,
            kind=entry["kind"],
            moved_to=str(target) if target else None,
        )
        return Outcome(doc.id, Ending.FAILED, reason=error.reason)

    async def report_only(self, doc: Document, inbox: InboxSettings, entry: dict[str, Any]) -> None:
        """The original cannot be moved (no write access to the inbox), but the reason can be
        written to failed/: without it, a person sees a file that is never processed and nothing
        saying why."""
        rel = naming.safe_relative(Path(doc.rel_path))
        report = _report_bytes(failure_report(doc, inbox, entry, None))

        def write() -> Path:
            for _ in range(1000):
                target = naming.free_name(inbox.failed / rel.parent, rel.name + REPORT_SUFFIX)
                if reserve_name(target, named_before=False):  # another host's report keeps its name
                    write_file_durably(target, report)
                    return target
            raise FileExistsError(f"no free name for {rel.name}{REPORT_SUFFIX} in {inbox.failed / rel.parent}")

        try:
            await self.runtime.on_inbox(inbox.path, write)
        except OSError as error:
            log.error("cannot write the failure report", error=str(error), folder=str(inbox.failed / rel.parent))

    async def forget_content(self, doc: Document, inbox: InboxSettings) -> None:
        """A failed document no longer stands for its content on the share: a copy dropped again
        (on any host) is processed, not refused as its duplicate."""
        if not self.runtime.move_originals or not doc.sha256:
            return
        try:
            await self.runtime.on_inbox(inbox.path, seen.forget_seen, inbox.path, doc.sha256, doc.id)
        except OSError as error:
            log.warning("cannot remove the content's seen marker", error=str(error))

    async def complete_after_crash(self, doc: Document, inbox: InboxSettings) -> Outcome | None:
        """``fail`` writes the report, moves the original to failed/, then commits; a crash after the
        move leaves the journal behind the disk. Finish the commit with the reason already written
        instead of replacing it by "the original disappeared" (the true reason would be lost)."""
        if not doc.final_path or not self.runtime.move_originals:
            return None
        final = Path(doc.final_path)
        entry = await self.runtime.on_inbox(inbox.path, self._written_entry, final, inbox, doc)
        if entry is None:
            return None
        journal = self.runtime.journal
        deliveries = await delivery.planned(self.runtime, doc, inbox, "failed", entry)
        await journal.call(journal.fail, doc.id, entry, deliveries)
        await self.runtime.clear_leftovers(doc, inbox)
        await self.forget_content(doc, inbox)
        log.warning("document failed (completed after a restart)", reason=entry.get("reason"), moved_to=str(final))
        return Outcome(doc.id, Ending.FAILED, reason=str(entry.get("reason", "")))

    def _written_entry(self, final: Path, inbox: InboxSettings, doc: Document) -> dict[str, Any] | None:
        """The last history entry of the report beside ``final`` in failed/, or None if not there."""
        if not (final.exists() or final.is_symlink()) or not final.is_relative_to(inbox.failed):
            return None
        try:
            report = json.loads(final.with_name(final.name + REPORT_SUFFIX).read_text(encoding="utf-8"))
            return dict(report["history"][-1])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            return {
                "reason": "processing failed before a crash; the report was lost",
                "kind": "permanent",
                "stage": "resume",
                "attempt": doc.attempts + 1,
                "at": now_iso(self.runtime.clock()),
            }
