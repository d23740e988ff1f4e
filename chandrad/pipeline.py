"""Where a file goes after it settles: intake → prepare → engine → publish, one document at a time.

``Pipeline.intake`` turns a settled name into a journal row and claims the file (an atomic rename
into the inbox's ``.chandrad/claimed/``), so a scanner re-using the name cannot touch it and no
second daemon takes it. ``Pipeline.process`` carries a claimed document through the stages; every
step is recorded in the journal before the filesystem move that follows it, and every move is
idempotent, so a document interrupted anywhere (crash, ``kill -9``, SIGTERM) resumes where it was
when ``process`` runs again. A document ends in exactly one place: its directory in the outbox (and
the original in archive/, deleted or kept), or the original in failed/ beside ``<name>.error.json``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from structlog.contextvars import bound_contextvars

from chandrad import prepare, publish
from chandrad.config import InboxSettings, Settings
from chandrad.engine.base import Engine, PageRequest
from chandrad.errors import DocumentError, PermanentError, TransientError
from chandrad.journal import Document, Journal, PageRecord, storable
from chandrad.watch import DAEMON_DIR, SettledFile

log = structlog.get_logger("chandrad.pipeline")


@dataclass(frozen=True)
class Outcome:
    doc_id: str
    state: str  # "published" | "failed" | "queued" (will be retried) | "skipped"
    output_dir: Path | None = None
    reason: str = ""


class WaitError(TransientError):
    """The environment is not ready (a full disk, an unreachable inbox). Not the document's fault
    and not worth giving up on: the document waits (retried with backoff up to
    ``MAX_WAIT_SECONDS``) without using up its ``max_attempts``, and resumes when the condition
    clears. Before, three quick retries sent every document that met a full outbox to failed/."""

    wait_kind = "waiting"

    @property
    def kind(self) -> str:
        return self.wait_kind


class DiskFullError(WaitError):
    wait_kind = "disk-full"


class InboxUnreachableError(WaitError):
    """The inbox (and the claimed originals in it) is gone: unmounted share, folder removed."""

    wait_kind = "inbox-unreachable"


MAX_WAIT_SECONDS = 60.0


def _disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)


def _now_iso(ts: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts if ts is not None else time.time()))


class Pipeline:
    def __init__(
        self,
        settings: Settings,
        journal: Journal,
        engine: Engine,
        *,
        move_originals: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.journal = journal
        self.engine = engine
        # False for ``chandrad once``: files given on the command line are read where they are.
        self.move_originals = move_originals
        self._clock = clock
        self.inboxes: dict[str, InboxSettings] = {inbox.name: inbox for inbox in settings.inbox}
        self.page_slots = asyncio.Semaphore(settings.engine.pages_in_flight(engine.name))
        self.prepare_slots = asyncio.Semaphore(settings.prepare.workers)
        # Names being taken in right now. The daemon runs several intakes at once, and a name can
        # be queued twice (a rescan re-announces it while intake is slow): the second would hash
        # it, lose the race to claim it, and journal a phantom "vanished" document.
        self._taking_in: set[Path] = set()

    def update_settings(self, settings: Settings) -> None:
        """After a reload: documents of an inbox that vanished from the config keep its old settings."""
        self.settings = settings
        self.inboxes.update({inbox.name: inbox for inbox in settings.inbox})

    # -- paths ---------------------------------------------------------------------------------

    def claimed_path(self, inbox: InboxSettings, doc_id: str, rel_path: Path) -> Path:
        return inbox.path / DAEMON_DIR / "claimed" / doc_id / publish.safe_component(rel_path.name)

    def staging_dir(self, inbox: InboxSettings, doc_id: str) -> Path:
        return inbox.outbox / publish.STAGING / doc_id / "doc"

    def work_dir(self, doc_id: str) -> Path:
        return self.settings.state_dir / "work" / doc_id

    # -- intake --------------------------------------------------------------------------------

    async def intake(self, settled: SettledFile) -> Document | None:
        """Journal and claim a settled file. Returns the queued document, or None if nothing is to do."""
        if settled.path in self._taking_in:
            return None  # another intake has this very name in hand
        self._taking_in.add(settled.path)
        try:
            return await self._intake(settled)
        finally:
            self._taking_in.discard(settled.path)

    async def _intake(self, settled: SettledFile) -> Document | None:
        inbox, rel = settled.inbox, settled.rel_path
        bound = log.bind(inbox=inbox.name, file=str(rel))
        known = await self.journal.call(
            self.journal.find_same_file, inbox.name, str(rel), settled.size, settled.mtime_ns, str(settled.path)
        )
        if known is not None:
            return None  # a kept original, or a file we could not move: already accounted for
        sha256 = ""
        refusal: DocumentError | None = None
        if settled.kind == "symlink":
            refusal = PermanentError("it is a symbolic link; chandrad never follows links", stage="intake")
        elif settled.kind == "special":
            refusal = PermanentError("it is not a regular file (a pipe, socket or device)", stage="intake")
        else:
            try:
                sha256 = await asyncio.to_thread(prepare.hash_file, settled.path)
                st = settled.path.lstat()
            except FileNotFoundError:
                return None  # gone again before we got to it: nothing entered
            except DocumentError as error:
                refusal = error
            else:
                if (st.st_size, st.st_mtime_ns) != (settled.size, settled.mtime_ns):
                    bound.info("file changed while it was read; waiting for it to settle again")
                    return None
        doc = await self.journal.call(
            self.journal.add_document, inbox.name, str(rel), sha256, settled.size, settled.mtime_ns
        )
        claimed = self.claimed_path(inbox, doc.id, rel)
        try:
            await asyncio.to_thread(publish.move_durably, settled.path, claimed)
        except FileNotFoundError:
            await self.journal.call(self.journal.forget, doc.id)  # gone before it was taken in: no document
            return None
        except OSError as error:
            reason = (f"chandrad cannot move the file out of the inbox: {error.strerror}; give its user write "
                      f"access to the folder and drop the file again (it was left where it is)")
            bound.error("cannot claim file", error=str(error))
            entry = {"reason": reason, "kind": "permanent", "stage": "intake", "attempt": 1, "at": _now_iso(self._clock())}
            # The original cannot go to failed/, but the reason can: without it, a person sees a
            # file that is never processed and nothing saying why.
            await asyncio.to_thread(self._write_report_only, doc, inbox, entry)
            await self.journal.call(self.journal.set_state, doc.id, "failed", error=entry, history=[entry])
            return None
        doc = await self.journal.call(self.journal.set_state, doc.id, "queued", claimed_path=str(claimed))
        bound.info("document queued", doc=doc.id, size=settled.size)
        if refusal is not None:
            await self.fail(doc, refusal)
            return None
        duplicate = await self._duplicate_of(doc, inbox)
        if duplicate is not None:
            await self.fail(doc, duplicate, kind="duplicate")
            return None
        return doc

    async def _duplicate_of(self, doc: Document, inbox: InboxSettings) -> PermanentError | None:
        """Why ``doc`` is a copy of a document taken in before it, or None."""
        if inbox.duplicates != "skip" or not doc.sha256:
            return None
        twin = await self.journal.call(self.journal.find_duplicate, doc.sha256, doc.id, True)
        if twin is None:
            return None
        where = f"published to {twin.output_dir}" if twin.output_dir and twin.state == "published" else (
            "still being processed"
        )
        return PermanentError(
            f"it is identical to {twin.rel_path} (first seen {_now_iso(twin.created_at)}, {where}); "
            f"set duplicates = \"reprocess\" to process copies again",
            stage="dedupe",
        )

    # -- one document --------------------------------------------------------------------------

    async def process(self, doc_id: str) -> Outcome:
        """Carry one claimed document as far as it goes: published, failed, or queued for a retry."""
        doc = await self.journal.call(self.journal.get, doc_id)
        inbox = self.inboxes[doc.inbox]
        tools: set[Any] = set()
        token = prepare.running_tools.set(tools)
        with bound_contextvars(doc=doc.id, inbox=inbox.name, file=doc.rel_path):
            try:
                return await self._process(doc, inbox)
            except DocumentError as error:
                return await self._handle_error(doc_id, error)
            except asyncio.CancelledError:
                # Stopping (drain deadline passed): the worker thread cannot be cancelled, but the
                # program it waits for can; then the daemon exits now, and the document resumes
                # at the next start.
                if killed := prepare.kill_tools(tools):
                    log.info("stopped the document's running programs", count=killed)
                raise
            except Exception as error:  # a bug must not kill the daemon; it is retried, then failed
                if _disk_full(error):  # a page image, the staging folder, a work file: wherever it hit
                    return await self._handle_error(
                        doc_id, DiskFullError(f"a disk is full: {error.filename or error}", stage="write")
                    )
                log.exception("unexpected error while processing")
                return await self._handle_error(
                    doc_id, TransientError(f"internal error: {type(error).__name__}: {error}", stage="internal")
                )
            finally:
                prepare.running_tools.reset(token)

    async def _process(self, doc: Document, inbox: InboxSettings) -> Outcome:
        started = time.monotonic()
        assert doc.claimed_path is not None
        claimed = Path(doc.claimed_path)
        staging = self.staging_dir(inbox, doc.id)
        if (doc.state == "publishing" and doc.output_dir and not staging.exists()
                and _published_by(Path(doc.output_dir), doc.id)):
            return await self._finish(doc, inbox)  # renamed into place before a crash: only the original is left
        if not claimed.exists():
            finished = await self._failure_already_on_disk(doc, inbox)
            if finished is not None:
                return finished
            self._check_inbox_reachable(inbox)
            raise PermanentError("the claimed original disappeared from the inbox's .chandrad folder", stage="resume")
        if doc.state == "queued" and doc.attempts == 0:
            # A crash between intake's claim and its duplicate check (or the check's move to
            # failed/) leaves a copy queued: check again, or the copy would be published twice.
            duplicate = await self._duplicate_of(doc, inbox)
            if duplicate is not None:
                return await self.fail(doc, duplicate, kind="duplicate")

        doc = await self.journal.call(self.journal.set_state, doc.id, "preparing")
        async with self.prepare_slots:
            prepared = await asyncio.to_thread(
                prepare.prepare_document, claimed, self.work_dir(doc.id), inbox.compress,
                self.settings.prepare, inbox.pdf_password,
            )
        doc = await self.journal.call(self.journal.set_state, doc.id, "inferring", page_count=prepared.page_count)
        done = await self.journal.call(self.journal.done_page_numbers, doc.id)
        log.info("document prepared", pages=prepared.page_count, done_before=len(done), kind=prepared.doc_type)
        await self._infer_pages(doc, inbox, prepared, done, staging)

        pages = await self.journal.call(self.journal.pages, doc.id)
        await self._check_page_images(doc, pages, staging)
        self._check_failed_pages(pages, prepared.page_count)
        stem = publish.safe_component(Path(doc.rel_path).stem)
        files = publish.render_document(
            stem,
            [
                publish.PageOutput(
                    page_no=page.page_no, html=page.html, width=page.width, height=page.height,
                    chunks=list(page.chunks), image_names=page.image_names, error=page.error,
                    stats={
                        "prompt_tokens": page.prompt_tokens, "output_tokens": page.output_tokens,
                        "finish_reason": page.finish_reason, "retries": page.retries,
                        "latency_s": round(page.latency_s, 3), "engine": page.engine, "model": page.model,
                    },
                )
                for page in pages
            ],
            inbox.formats,
            publish.document_metadata(doc.id, Path(doc.rel_path).name, inbox.name, self.engine.name, self.engine.model),
        )
        await self._publish(doc, inbox, staging, files, stem)
        outcome = await self._finish(await self.journal.call(self.journal.get, doc.id), inbox)
        log.info("document published", pages=len(pages), seconds=round(time.monotonic() - started, 2),
                 output=str(outcome.output_dir))
        return outcome

    def _check_inbox_reachable(self, inbox: InboxSettings) -> None:
        """Raise InboxUnreachableError when the claimed original is missing because the whole
        inbox is (an unmounted share leaves an empty mount point; a removed folder nothing): the
        file is not lost and must not be declared so. Once the inbox's ``.chandrad`` is back, a
        missing original is really gone."""
        if not (inbox.path / DAEMON_DIR).is_dir():
            raise InboxUnreachableError(
                f"the inbox {inbox.path} is not reachable (unmounted or removed?); waiting for it to return",
                stage="resume",
            )

    async def _infer_pages(
        self, doc: Document, inbox: InboxSettings, prepared: prepare.PreparedDocument, done: set[int], staging: Path
    ) -> None:
        """Render pages one at a time and keep up to ``max_pages_in_flight`` of them at the engine."""
        todo = [n for n in range(1, prepared.page_count + 1) if n not in done]
        blank_pages = 0

        async def infer(page: prepare.PageImage) -> None:
            with bound_contextvars(page=page.page_no):
                request = PageRequest(doc.id, page.page_no, page.image, inbox.prompt_type)
                try:
                    result = await asyncio.wait_for(
                        self.engine.ocr(request), self.settings.engine.page_timeout_seconds
                    )
                except PermanentError as page_error:  # this page can never be read; the others may
                    await self._record_failed_page(doc.id, page.page_no, page_error, page.image.size)
                    return
                except TimeoutError:
                    raise TransientError(
                        f"page {page.page_no}: the engine did not answer within "
                        f"{self.settings.engine.page_timeout_seconds:.0f} s", stage="engine",
                    ) from None
                rendered = await asyncio.to_thread(
                    publish.save_page_images, result.html, page.image, staging / "images", page.page_no
                )
                await self.journal.call(
                    self.journal.record_page,
                    PageRecord(
                        doc_id=doc.id, page_no=page.page_no, width=page.image.width, height=page.image.height,
                        html=result.html, prompt_tokens=result.prompt_tokens, output_tokens=result.output_tokens,
                        finish_reason=result.finish_reason, retries=result.retries, latency_s=result.latency_s,
                        engine=self.engine.name, model=self.engine.model, image_names=rendered.image_names,
                        chunks=tuple(rendered.chunks),
                    ),
                )
                engine_stats = getattr(self.engine, "stats", None)
                log.info("page done", page=page.page_no, of=prepared.page_count,
                         seconds=round(result.latency_s, 2), tokens=result.output_tokens, retries=result.retries,
                         engine_peak_running=getattr(engine_stats, "peak_running", None))

        staging.mkdir(parents=True, exist_ok=True)
        try:
            async with asyncio.TaskGroup() as group:
                for page_no in todo:
                    # Render the next page while earlier ones are at the engine; never more than one ahead.
                    try:
                        page = await asyncio.to_thread(prepared.render, page_no, self.settings.prepare)
                    except PermanentError as page_error:
                        if not prepared.source.exists():
                            # The file went away under the renderer (inbox unmounted mid-document):
                            # not this page's fault; recording it failed would fail the document.
                            self._check_inbox_reachable(inbox)
                            raise PermanentError(
                                "the claimed original disappeared while it was being read", stage="render"
                            ) from None
                        await self._record_failed_page(doc.id, page_no, page_error, (0, 0))
                        continue
                    if prepared.repair_warning and await asyncio.to_thread(prepare.is_blank, page.image):
                        blank_pages += 1
                    await self.page_slots.acquire()
                    # Released by a done-callback: it runs even for a task cancelled before it started.
                    group.create_task(infer(page)).add_done_callback(lambda _: self.page_slots.release())
                    del page
        except BaseExceptionGroup as group_error:
            raise _first_document_error(group_error) from None
        if prepared.repair_warning and not done and blank_pages == prepared.page_count:
            # A truncated scan "repaired" into blank pages was published as an empty document and
            # its original archived: the person never learnt that nothing had been read.
            raise PermanentError(
                f"the PDF is damaged (cut short or corrupted?): its structure could be repaired but none of its "
                f"{prepared.page_count} page(s) has content left to read ({prepared.repair_warning})",
                stage="render",
            )

    async def _check_page_images(self, doc: Document, pages: list[PageRecord], staging: Path) -> None:
        """Pages' cropped figures live in staging (on the outbox's disk) until publish. If they
        vanished (outbox removed or re-created while the document was in progress), publishing
        would write Markdown/HTML pointing at images that do not exist: redo those pages instead."""
        lost = [page.page_no for page in pages
                if any(not (staging / "images" / name).is_file() for name in page.image_names)]
        if not lost:
            return
        await self.journal.call(self.journal.drop_pages, doc.id, lost)
        raise TransientError(
            f"the figures of page(s) {', '.join(map(str, lost[:10]))} vanished from the outbox's staging "
            f"folder (outbox removed while working?); redoing them", stage="publish",
        )

    async def _record_failed_page(
        self, doc_id: str, page_no: int, error: DocumentError, size: tuple[int, int]
    ) -> None:
        log.warning("page failed", page=page_no, reason=error.reason)
        await self.journal.call(
            self.journal.record_page,
            PageRecord(doc_id=doc_id, page_no=page_no, width=size[0], height=size[1], html="", error=error.reason,
                       engine=self.engine.name, model=self.engine.model),
        )

    def _check_failed_pages(self, pages: list[PageRecord], page_count: int) -> None:
        """Fail the document if more of its pages failed than max_page_error_rate allows."""
        failed = [page for page in pages if page.error]
        if not failed or len(failed) / page_count <= self.settings.max_page_error_rate:
            return
        if page_count == 1:
            raise PermanentError(failed[0].error or "the page could not be read", stage="engine")
        details = "; ".join(f"page {page.page_no}: {page.error}" for page in failed[:10])
        raise PermanentError(
            f"{len(failed)} of {page_count} pages could not be read ({details}); "
            f"max_page_error_rate = {self.settings.max_page_error_rate} allows publishing with gaps",
            stage="engine",
        )

    async def _publish(
        self, doc: Document, inbox: InboxSettings, staging: Path, files: dict[str, bytes], stem: str
    ) -> None:
        rel_dir = publish.safe_relative(Path(doc.rel_path)).parent
        base = inbox.outbox
        if inbox.date_prefix:
            base = base / time.strftime("%Y/%m", time.localtime(doc.created_at))
        for _ in range(100):
            target = publish.free_name(publish.output_folder(base, rel_dir), stem, is_dir=True)
            await self.journal.call(self.journal.set_state, doc.id, "publishing", output_dir=str(target))
            try:
                await asyncio.to_thread(publish.publish_directory, staging, files, target)
                return
            except OSError as error:
                if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    continue  # another document took the name a moment ago: pick the next free one
                if _disk_full(error):
                    raise DiskFullError("the outbox's disk is full", stage="publish") from None
                raise TransientError(f"cannot write to the outbox: {error.strerror}", stage="publish") from None
        raise TransientError("no free output name found", stage="publish")

    async def _finish(self, doc: Document, inbox: InboxSettings) -> Outcome:
        """The outputs are in place: archive, delete or keep the original, then mark the document published."""
        claimed = Path(doc.claimed_path) if doc.claimed_path else None
        if self.move_originals and claimed is not None:
            if inbox.on_success == "delete":
                claimed.unlink(missing_ok=True)
            else:
                folder = inbox.archive if inbox.on_success == "archive" else inbox.path
                assert folder is not None
                target = Path(doc.final_path) if doc.final_path else None
                if target is None:
                    rel = publish.safe_relative(Path(doc.rel_path))
                    target = publish.free_name(folder / rel.parent, rel.name)
                    await self.journal.call(self.journal.set_state, doc.id, "publishing", final_path=str(target))
                if claimed.exists():
                    await asyncio.to_thread(publish.move_durably, claimed, target)
        await self.journal.call(self.journal.set_state, doc.id, "published", error=None)
        await self._cleanup(doc, inbox)
        return Outcome(doc.id, "published", Path(doc.output_dir) if doc.output_dir else None)

    # -- failure -------------------------------------------------------------------------------

    async def _handle_error(self, doc_id: str, error: DocumentError) -> Outcome:
        doc = await self.journal.call(self.journal.get, doc_id)
        if isinstance(error, WaitError):
            return await self._wait(doc, error)
        attempts = doc.attempts + 1
        if error.permanent or attempts >= self.settings.max_attempts:
            return await self.fail(doc, error)
        delay = self.settings.retry_backoff_seconds * (2 ** (attempts - 1))
        entry = self._error_entry(doc, error, attempts)
        await self.journal.call(
            self.journal.record_attempt_failure, doc.id, entry, final=False, retry_at=self._clock() + delay
        )
        log.warning("document will be retried", reason=error.reason, stage=error.stage, attempt=attempts,
                    retry_in_s=round(delay, 1))
        return Outcome(doc.id, "queued", reason=error.reason)

    async def _wait(self, doc: Document, error: WaitError) -> Outcome:
        """Queue the document again later; its attempts and history are left as they were (a long
        outage must neither fail it nor grow its history by one entry per retry)."""
        previous = doc.error if doc.error and doc.error.get("kind") == error.kind else None
        waits = int(previous.get("waits", 0)) + 1 if previous else 1
        delay = min(self.settings.retry_backoff_seconds * (2 ** min(waits - 1, 20)), MAX_WAIT_SECONDS)
        entry = {**self._error_entry(doc, error, doc.attempts), "waits": waits}
        await self.journal.call(
            self.journal.set_state, doc.id, "queued", error=entry, next_attempt_at=self._clock() + delay
        )
        log.warning("the document waits", reason=error.reason, kind=error.kind, stage=error.stage,
                    waits=waits, retry_in_s=round(delay, 1))
        return Outcome(doc.id, "queued", reason=error.reason)

    def _error_entry(self, doc: Document, error: DocumentError, attempts: int, kind: str | None = None) -> dict[str, Any]:
        return {
            "reason": error.reason,
            "kind": kind or error.kind,
            "stage": error.stage,
            "attempt": attempts,
            "at": _now_iso(self._clock()),
            **({"detail": error.detail} if error.detail else {}),
        }

    async def fail(self, doc: Document, error: DocumentError, kind: str | None = None) -> Outcome:
        """Move the original to failed/ with ``<name>.error.json`` beside it, and mark the document failed."""
        inbox = self.inboxes[doc.inbox]
        attempts = doc.attempts + 1
        entry = self._error_entry(doc, error, attempts, kind)
        history = [*doc.history, entry]
        claimed = Path(doc.claimed_path) if doc.claimed_path else None
        target = Path(doc.final_path) if doc.final_path else None
        if self.move_originals and claimed is not None:
            if target is None:
                rel = publish.safe_relative(Path(doc.rel_path))
                target = publish.free_name(inbox.failed / rel.parent, rel.name)
                await self.journal.call(self._record_final_path, doc.id, str(target))
            report = {
                "file": Path(doc.rel_path).name,
                "inbox": inbox.name,
                "original_path": doc.rel_path,
                "reason": error.reason,
                "kind": entry["kind"],
                "stage": error.stage,
                "attempts": attempts,
                "sha256": doc.sha256 or None,
                "doc_id": doc.id,
                "first_seen": _now_iso(doc.created_at),
                "failed_at": entry["at"],
                "history": history,
                "what_to_do": _advice(entry["kind"]),
            }
            try:
                publish.makedirs_durably(target.parent)
                publish.write_file_durably(
                    target.with_name(target.name + ".error.json"),
                    (json.dumps(report, ensure_ascii=False, indent=2) + "\n").encode("utf-8"),
                )
                if claimed.exists() or claimed.is_symlink():
                    await asyncio.to_thread(publish.move_durably, claimed, target)
            except OSError as move_error:
                # Queue it again (failed/ full or unwritable): left in its old state, it would
                # only have been picked up again at the next start.
                delay = max(self.settings.retry_backoff_seconds, 1.0)
                log.error("cannot move the original to failed/; will try again", error=str(move_error),
                          retry_in_s=delay)
                await self.journal.call(
                    self.journal.set_state, doc.id, "queued", next_attempt_at=self._clock() + delay
                )
                return Outcome(doc.id, "queued", reason=f"cannot write to failed/: {move_error.strerror}")
        await self.journal.call(
            self.journal.record_attempt_failure, doc.id, entry, final=True
        )
        await self._cleanup(doc, inbox)
        log.warning("document failed", reason=error.reason, stage=error.stage, kind=entry["kind"],
                    moved_to=str(target) if target else None)
        return Outcome(doc.id, "failed", reason=error.reason)

    async def _failure_already_on_disk(self, doc: Document, inbox: InboxSettings) -> Outcome | None:
        """``fail`` writes the report, moves the original to failed/, then commits; a crash after the
        move leaves the journal behind the disk. Finish the commit with the reason already written
        instead of replacing it by "the original disappeared" (the true reason would be lost)."""
        if not doc.final_path or not self.move_originals:
            return None
        final = Path(doc.final_path)
        report_path = final.with_name(final.name + ".error.json")
        if not (final.exists() or final.is_symlink()) or not final.is_relative_to(inbox.failed):
            return None
        try:
            report = json.loads(report_path.read_text(encoding="utf-8"))
            entry = dict(report["history"][-1])
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            entry = {"reason": "processing failed before a crash; the report was lost", "kind": "permanent",
                     "stage": "resume", "attempt": doc.attempts + 1, "at": _now_iso(self._clock())}
        await self.journal.call(self.journal.record_attempt_failure, doc.id, entry, final=True)
        await self._cleanup(doc, inbox)
        log.warning("document failed (completed after a restart)", reason=entry.get("reason"), moved_to=str(final))
        return Outcome(doc.id, "failed", reason=str(entry.get("reason", "")))

    def _write_report_only(self, doc: Document, inbox: InboxSettings, entry: dict[str, Any]) -> None:
        rel = publish.safe_relative(Path(doc.rel_path))
        target = publish.free_name(inbox.failed / rel.parent, rel.name + ".error.json")
        report = {
            "file": Path(doc.rel_path).name, "inbox": inbox.name, "original_path": doc.rel_path,
            "original_left_in_inbox": True, "reason": entry["reason"], "kind": entry["kind"],
            "stage": entry["stage"], "sha256": doc.sha256 or None, "doc_id": doc.id, "failed_at": entry["at"],
            "what_to_do": _advice(entry["kind"]),
        }
        try:
            publish.makedirs_durably(target.parent)
            publish.write_file_durably(
                target, (json.dumps(report, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
            )
        except OSError as error:
            log.error("cannot write the failure report", error=str(error), report=str(target))

    def _record_final_path(self, doc_id: str, final_path: str) -> None:
        doc = self.journal.get(doc_id)
        self.journal.set_state(doc_id, doc.state, final_path=final_path)

    async def _cleanup(self, doc: Document, inbox: InboxSettings) -> None:
        await self.journal.call(self.journal.drop_pages, doc.id)
        staging_root = self.staging_dir(inbox, doc.id).parent
        await asyncio.to_thread(shutil.rmtree, staging_root, True)
        await asyncio.to_thread(prepare.cleanup, self.work_dir(doc.id))
        if doc.claimed_path and self.move_originals:
            try:
                os.rmdir(Path(doc.claimed_path).parent)
            except OSError:
                pass

    # -- recovery ------------------------------------------------------------------------------

    async def recover(self) -> list[str]:
        """After a crash: finish claims, and return the ids of documents to process again."""
        resumable = []
        for doc in await self.journal.call(self.journal.unfinished):
            inbox = self.inboxes.get(doc.inbox)
            if inbox is None:
                log.warning("document belongs to an inbox no longer configured; leaving it", doc=doc.id)
                continue
            if doc.state == "settled":
                source = _find_stored_name(inbox.path, doc.rel_path)
                claimed = self.claimed_path(inbox, doc.id, Path(doc.rel_path))
                if not claimed.exists():
                    if source.exists() or source.is_symlink():
                        await asyncio.to_thread(publish.move_durably, source, claimed)
                    else:
                        await self.journal.call(self.journal.forget, doc.id)  # never taken in
                        continue
                await self.journal.call(self.journal.set_state, doc.id, "queued", claimed_path=str(claimed))
            elif doc.state in ("preparing", "inferring"):
                await self.journal.call(self.journal.set_state, doc.id, "queued")
            resumable.append(doc.id)
        if resumable:
            log.info("resuming documents interrupted by a stop or crash", count=len(resumable))
        await self._sweep_leftovers()
        return resumable

    async def _sweep_leftovers(self) -> None:
        """Remove what a crash between a document's final commit and its ``_cleanup`` left behind:
        its staging and work folders and its empty claim folder. Folders of documents still in
        progress are kept (they resume from them); a claim folder that still holds a file is never
        touched, whatever the journal says, because that file may be someone's only copy."""
        folders: list[tuple[str, Path]] = []
        for inbox in self.inboxes.values():
            folders += [("staging", inbox.outbox / publish.STAGING), ("claimed", inbox.path / DAEMON_DIR / "claimed")]
        folders.append(("work", self.settings.state_dir / "work"))
        for kind, base in folders:
            try:
                entries = [entry for entry in base.iterdir() if entry.is_dir() and not entry.is_symlink()]
            except OSError:
                continue
            for entry in entries:
                try:
                    doc = await self.journal.call(self.journal.get, entry.name)
                except KeyError:
                    doc = None
                if doc is not None and doc.state not in ("published", "failed"):
                    continue
                if kind == "claimed":
                    try:
                        entry.rmdir()
                    except OSError:
                        log.warning("a claimed file has no unfinished document; leaving it", path=str(entry))
                    continue
                await asyncio.to_thread(shutil.rmtree, entry, True)


def _published_by(output_dir: Path, doc_id: str) -> bool:
    """Whether ``output_dir`` holds this document's outputs. The journal names the output folder
    before the rename; if the rename never happened and the staging copy is gone too (outbox
    wiped), another document may have taken that name since, and calling it ours would mark this
    document published with someone else's outputs and archive its original unread. The JSON
    names its document; without a JSON (formats without "json") the folder is trusted."""
    if not output_dir.is_dir():
        return False
    for candidate in output_dir.glob("*.json"):
        try:
            return json.loads(candidate.read_text(encoding="utf-8")).get("doc_id") == doc_id
        except (OSError, ValueError, AttributeError):
            return False
    return True


def _find_stored_name(folder: Path, rel_path: str) -> Path:
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


def _first_document_error(group: BaseExceptionGroup) -> BaseException:
    """The most telling error of a failed page group: a DocumentError, else whatever broke first."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            return _first_document_error(error)
        if isinstance(error, DocumentError):
            return error
    for error in group.exceptions:
        if not isinstance(error, asyncio.CancelledError):
            return error
    return group.exceptions[0]


def _advice(kind: str) -> str:
    return {
        "permanent": "Fix or replace the file and drop it into the inbox again.",
        "transient": "Nothing was wrong with the file itself; drop it into the inbox again to retry.",
        "duplicate": "Nothing to do: this content was already processed.",
    }.get(kind, "Drop the file into the inbox again to retry.")
