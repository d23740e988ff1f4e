"""A claimed document's journey, one step per journal state, in the order ``_journey`` shows.

    queued ─▶ preparing ─▶ inferring ─▶ publishing ─▶ published
              (prepare)    (pages.py)   (outputs)     (the original's last move)
       └─────────── any step's error ─▶ failures.py: a retry, a wait, or failed/

Every step commits its state to the journal before the filesystem move that follows it, and
every move is idempotent, so a document interrupted anywhere (crash, ``kill -9``, SIGTERM)
resumes where it was when ``run`` is called again: ``resume`` decides where that is. Blocking work
(rendering, writing, probing a share) runs in threads; the event loop only sequences.
"""

from __future__ import annotations

import asyncio
import errno
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from structlog.contextvars import bound_contextvars

from chandrad import prepare, tools
from chandrad.config import InboxSettings
from chandrad.document.archive import settle_original
from chandrad.document.pages import PageReader, check_inbox_reachable
from chandrad.document.split import Splitter
from chandrad.engine import pages_in_flight
from chandrad.errors import DiskFullError, DocumentError, PermanentError, TransientError, is_disk_full
from chandrad.hosts import claims
from chandrad.inbox.intake import duplicate_of
from chandrad.output import delivery, publish
from chandrad.output.failures import Failures
from chandrad.output.publish import SearchablePdfJob
from chandrad.runtime import Ending, Outcome, Runtime
from chandrad.scan.digital import PageText, page_texts
from chandrad.storage import naming
from chandrad.storage.durable import place_copy, rename_dir_durably
from chandrad.storage.journal import Document
from chandrad.storage.schema import DocumentState, PageRecord

log = structlog.get_logger("chandrad.document.stages")


@dataclass
class Work:
    """One document on its way: its journal row as last committed, and where its files are."""

    doc: Document
    inbox: InboxSettings
    claimed: Path
    staging: Path
    prepared: prepare.PreparedDocument | None = None
    # ocr_mode "skip"/"redo": the pages that keep their own text (scan.digital), by number.
    own_text: dict[int, PageText] = field(default_factory=dict)


class DocumentStages:
    def __init__(self, runtime: Runtime, failures: Failures) -> None:
        self.runtime = runtime
        self.failures = failures
        settings = runtime.settings
        self.pages = PageReader(runtime, asyncio.Semaphore(pages_in_flight(settings.engine, runtime.engine.name)))
        self.prepare_slots = asyncio.Semaphore(settings.prepare.workers)
        self.splitter = Splitter(runtime)

    async def run(self, doc_id: str) -> Outcome:
        """Carry one claimed document as far as it goes: published, failed, queued for a retry, or
        split into parts; a part that ends final may be its batch scan's last (``split``)."""
        journal = self.runtime.journal
        doc = await journal.call(journal.get, doc_id)
        outcome = await self._run(doc)
        if doc.parent_id is not None and outcome.state in (Ending.PUBLISHED, Ending.FAILED):
            # Its stack's turn (archived once every part is final), through the same handling of
            # errors as any document: an archive that cannot be written fails or retries the stack,
            # it does not end this worker.
            stack = await journal.call(journal.find, doc.parent_id)
            if stack is not None and stack.state == DocumentState.SPLIT:
                await self._run(stack)
        return outcome

    async def _run(self, doc: Document) -> Outcome:
        doc_id = doc.id
        inbox = self.runtime.inbox_of(doc)
        programs: set[subprocess.Popen[bytes]] = set()
        token = tools.running_tools.set(programs)
        with bound_contextvars(doc=doc.id, inbox=inbox.name, file=doc.rel_path):
            try:
                return await self._journey(doc, inbox)
            except claims.ClaimLost as lost:
                # Another host has the original now and publishes it: nothing is reported here.
                await claims.forget_taken_over(self.runtime, doc, inbox, lost.taker)
                return Outcome(doc_id, Ending.TAKEN_OVER)
            except DocumentError as error:
                return await self.failures.handle(doc_id, error)
            except asyncio.CancelledError:
                # Stopping (drain deadline passed): the worker thread cannot be cancelled, but the
                # program it waits for can; the document resumes at the next start.
                if killed := tools.kill_tools(programs):
                    log.info("stopped the document's running programs", count=killed)
                raise
            except Exception as error:  # a bug must not kill the daemon; it is retried, then failed
                if isinstance(error, OSError) and is_disk_full(error):  # wherever it hit: a page image, staging
                    where = error.filename or error
                    return await self.failures.handle(doc_id, DiskFullError(f"a disk is full: {where}", stage="write"))
                log.exception("unexpected error while processing")
                return await self.failures.handle(
                    doc_id, TransientError(f"internal error: {type(error).__name__}: {error}", stage="internal")
                )
            finally:
                tools.running_tools.reset(token)

    async def _journey(self, doc: Document, inbox: InboxSettings) -> Outcome:
        """The steps in their order; each returns once its state is committed."""
        started = time.monotonic()
        assert doc.claimed_path is not None
        work = Work(doc, inbox, Path(doc.claimed_path), self.runtime.staging_dir(inbox, doc.id))
        resumed = await self.resume(work)
        if resumed is not None:
            return resumed
        await self.prepare(work)  # → preparing, then inferring: the working copy and the page count
        assert work.prepared is not None
        split = await self.splitter.split(work.doc, inbox, work.prepared)  # → split: its parts queued
        if split is not None:
            return split
        await self.infer(work)  # pages through the engine, each committed as it arrives
        await self.publish(work)  # → publishing: the outputs renamed into the outbox
        outcome = await self.finish(work)  # → published: the original archived, deleted or kept
        log.info(
            "document published",
            pages=work.doc.page_count,
            seconds=round(time.monotonic() - started, 2),
            output=str(outcome.output_dir),
        )
        return outcome

    async def resume(self, work: Work) -> Outcome | None:
        """Where an interrupted document stands: done but for its last move, failed already on
        disk, a copy whose duplicate check a crash cut short, or (None) to be carried on."""
        doc, inbox = work.doc, work.inbox
        if doc.state == DocumentState.SPLIT:  # its parts are on their way: done when they all are
            done = await self.splitter.complete(doc.id)
            return Outcome(doc.id, Ending.PUBLISHED if done else Ending.SPLIT)
        if doc.state == DocumentState.PUBLISHING and doc.output_dir:
            output_dir = Path(doc.output_dir)
            if await self.runtime.probe(
                inbox.outbox, lambda: not work.staging.exists() and _published_by(output_dir, doc.id)
            ):
                return await self.finish(work)  # renamed into place before a crash: only the original is left
        if not await self.runtime.probe(inbox.path, work.claimed.exists):
            finished = await self.failures.complete_after_crash(doc, inbox)
            if finished is not None:
                return finished
            await self.check_still_ours(work)
            await self.runtime.probe(inbox.path, lambda: check_inbox_reachable(inbox))
            raise PermanentError("the claimed original disappeared from the inbox's .chandrad folder", stage="resume")
        if doc.state == DocumentState.QUEUED and doc.attempts == 0 and doc.parent_id is None:
            # A crash between intake's claim and its duplicate check (or the check's move to
            # failed/) leaves a copy queued: check again, or the copy would be published twice.
            duplicate = await duplicate_of(self.runtime, doc, inbox)
            if duplicate is not None:
                return await self.failures.fail(doc, duplicate)
        return None

    async def check_still_ours(self, work: Work) -> None:
        """Raise ``ClaimLost`` if another host took the document over (its claimed original gone
        from our claims): checked before publishing, so that a host whose heartbeat stalled, and
        whose claim was taken, never publishes the document too."""
        if not self.runtime.move_originals:
            return
        inbox, doc_id = work.inbox.path, work.doc.id
        taker = await self.runtime.probe(inbox, lambda: claims.lost_to(inbox, work.claimed, doc_id))
        if taker is not None:
            raise claims.ClaimLost(taker)

    async def prepare(self, work: Work) -> None:
        journal, settings = self.runtime.journal, self.runtime.settings
        work.doc = await journal.call(journal.set_state, work.doc.id, "preparing")
        # Most originals are read as they are: their probe runs at once (a reader thread: a core's
        # worth), not behind the few slots that bound Ghostscript's rewrites (a burst of one-page
        # scans was prepared at ~19 a second through 2 slots on a 16-core GPU host, while the
        # engine waited for pages).
        args = (work.claimed, self.runtime.work_dir(work.doc.id), work.inbox.compress, settings.prepare)
        work.prepared = await self.runtime.read_original(prepare.prepare_as_is, *args, work.inbox.pdf_password)
        if work.prepared is None:
            async with self.prepare_slots:
                work.prepared = await asyncio.to_thread(prepare.rewrite_document, *args, work.inbox.pdf_password)
        if work.inbox.ocr_mode != "force" and work.prepared.doc_type == "pdf":
            # Every page's text read in one child, like a probe: a reader thread, not a Ghostscript slot
            # (behind 2 slots, the text reads of 192 dropped one-page PDFs took 3.3 s on an H100 host).
            try:
                texts = await self.runtime.read_original(
                    page_texts, work.prepared.source, settings.prepare, work.prepared.password
                )
            except PermanentError as error:  # every page goes to the model, as with "force"
                log.warning("the PDF's own text could not be read; every page is read", reason=error.reason)
                texts = []
            work.own_text = {
                number: text for number, text in enumerate(texts, start=1) if text.path(work.inbox.ocr_mode) == "text"
            }
        work.doc = await journal.call(journal.set_state, work.doc.id, "inferring", page_count=work.prepared.page_count)

    async def infer(self, work: Work) -> None:
        journal = self.runtime.journal
        assert work.prepared is not None
        done = await journal.call(journal.done_page_numbers, work.doc.id)
        log.info(
            "document prepared", pages=work.prepared.page_count, done_before=len(done), kind=work.prepared.doc_type
        )
        await self.pages.read_pages(work.doc, work.inbox, work.prepared, done, work.staging, work.own_text)

    async def publish(self, work: Work) -> None:
        """Page rows → the document's files, rendered and written in one thread hop, then renamed."""
        doc, inbox, journal = work.doc, work.inbox, self.runtime.journal
        pages = await journal.call(journal.pages, doc.id)
        lost = await asyncio.to_thread(_pages_missing_figures, pages, work.staging)
        if lost:
            # The outbox was removed or re-created while the document was in progress: publishing
            # would point at figures that do not exist. Those pages are read again.
            await journal.call(journal.drop_pages, doc.id, lost)
            raise TransientError(
                f"the figures of page(s) {', '.join(map(str, lost[:10]))} vanished from the outbox's staging "
                f"folder (outbox removed while working?); redoing them",
                stage="publish",
            )
        self._check_failed_pages(pages, doc.page_count or len(pages))
        stem = _output_stem(doc)
        engine = self.runtime.engine
        metadata = publish.document_metadata(doc.id, Path(doc.rel_path).name, inbox.name, engine.name, engine.model)
        if doc.split_from:  # a part of a batch scan: where its pages come from
            first, last = int(doc.split_from["first"]), int(doc.split_from["last"])
            metadata |= {"source": doc.split_from["file"], "source_pages": list(range(first, last + 1))}
        outputs = [_page_output(page) for page in pages]
        dropped = _blank_pages(pages) if inbox.blank_pages == "drop" else ()
        try:
            await asyncio.to_thread(
                publish.stage_document,
                work.staging,
                stem,
                outputs,
                inbox.formats,
                metadata,
                self._pdf_job(work, dropped),
                dropped,
            )
        except OSError as error:
            raise _outbox_error(error) from None
        await self.check_still_ours(work)
        await self._rename_into_outbox(work, stem)

    def _pdf_job(self, work: Work, dropped: tuple[int, ...] = ()) -> SearchablePdfJob | None:
        """What the searchable PDF is made from, when the inbox asks for one."""
        inbox, prepared = work.inbox, work.prepared
        if "pdf" not in inbox.formats or prepared is None:
            return None
        return SearchablePdfJob(
            original=work.claimed,
            rendered_from=prepared.source,
            doc_type=prepared.doc_type,
            lossless=inbox.compress == "lossless",
            pdfa=inbox.pdfa,
            # "redo" reads another OCR's pages again: their old invisible layer gives way to the new one.
            replace_text=inbox.pdf_replace_text or inbox.ocr_mode == "redo",
            password=inbox.pdf_password,
            rotate_pages=inbox.rotate_pdf_pages,
            drop_pages=dropped if inbox.drop_blank_pdf_pages else (),
        )

    def _check_failed_pages(self, pages: list[PageRecord], page_count: int) -> None:
        """Fail the document if more of its pages failed than max_page_error_rate allows."""
        rate = self.runtime.settings.max_page_error_rate
        failed = [page for page in pages if page.error]
        if not failed or len(failed) / page_count <= rate:
            return
        if page_count == 1:
            raise PermanentError(failed[0].error or "the page could not be read", stage="engine")
        details = "; ".join(f"page {page.page_no}: {page.error}" for page in failed[:10])
        raise PermanentError(
            f"{len(failed)} of {page_count} pages could not be read ({details}); "
            f"max_page_error_rate = {rate} allows publishing with gaps",
            stage="engine",
        )

    async def _rename_into_outbox(self, work: Work, stem: str) -> None:
        doc, inbox, journal = work.doc, work.inbox, self.runtime.journal
        rel_dir = naming.safe_relative(Path(doc.rel_path)).parent
        base = inbox.outbox
        if inbox.date_prefix:
            base = base / time.strftime("%Y/%m", time.localtime(doc.created_at))
        for _ in range(100):
            target = await asyncio.to_thread(
                lambda: naming.free_name(naming.output_folder(base, rel_dir), stem, is_dir=True)
            )
            # Named before the rename: after a crash, resume finds the outputs there (_published_by).
            work.doc = await journal.call(journal.set_state, doc.id, "publishing", output_dir=str(target))
            if self.runtime.move_originals:
                # And beside the claimed original: a host taking this document over after a crash
                # right after the rename finishes it instead of publishing it a second time.
                await self.runtime.on_inbox(inbox.path, claims.note_output_dir, work.claimed, target)
            try:
                await asyncio.to_thread(rename_dir_durably, work.staging, target)
                return
            except OSError as error:
                if error.errno in (errno.ENOTEMPTY, errno.EEXIST):
                    continue  # another document took the name a moment ago: pick the next free one
                raise _outbox_error(error) from None
        raise TransientError("no free output name found", stage="publish")

    async def finish(self, work: Work) -> Outcome:
        """The outputs are in place: archive, delete or keep the original, then mark the document published."""
        runtime, journal = self.runtime, self.runtime.journal
        doc = await journal.call(journal.get, work.doc.id)
        inbox = work.inbox
        if inbox.pdf_to is not None and "pdf" in inbox.formats and doc.output_dir:
            await self._place_pdf_copy(Path(doc.output_dir) / f"{_output_stem(doc)}.pdf", inbox.pdf_to)
        await settle_original(runtime, doc, inbox)
        # The deliveries (webhooks, hooks) are committed with the state, in one transaction.
        deliveries = await delivery.planned(runtime, doc, inbox, "published")
        await journal.call(journal.publish, doc.id, deliveries)
        await runtime.clear_leftovers(doc, inbox)
        return Outcome(doc.id, Ending.PUBLISHED, Path(doc.output_dir) if doc.output_dir else None)

    async def _place_pdf_copy(self, pdf: Path, pdf_to: Path) -> None:
        """The searchable PDF also into ``pdf_to`` (a document system's consume folder), before the
        document is final: a crash in between places it at the next start (once: an identical copy
        there counts as placed)."""
        if not await asyncio.to_thread(pdf.is_file):
            return  # the PDF could not be made: the JSON says why
        try:
            placed = await asyncio.to_thread(place_copy, pdf, pdf_to, pdf.name, naming.free_name)
        except OSError as error:
            if is_disk_full(error):
                raise DiskFullError(f"pdf_to {pdf_to}: the disk is full", stage="publish") from None
            raise TransientError(
                f"cannot place the PDF in pdf_to {pdf_to}: {error.strerror}", stage="publish"
            ) from None
        log.info("searchable PDF placed", pdf_to=str(placed))


def _output_stem(doc: Document) -> str:
    """The name of a document's output folder and files (``report`` for ``report.pdf``)."""
    return naming.safe_component(Path(doc.rel_path).stem)


def _blank_pages(pages: list[PageRecord]) -> tuple[int, ...]:
    """The pages judged blank when they were read (``scan.blank``)."""
    return tuple(page.page_no for page in pages if ((page.scan or {}).get("blank") or {}).get("blank"))


def _page_output(page: PageRecord) -> publish.PageOutput:
    return publish.PageOutput(
        page_no=page.page_no,
        html=page.html,
        width=page.width,
        height=page.height,
        chunks=list(page.chunks),
        image_names=page.image_names,
        error=page.error,
        text_lines=page.text_lines,
        scan=page.scan,
        stats={
            "prompt_tokens": page.prompt_tokens,
            "output_tokens": page.output_tokens,
            "finish_reason": page.finish_reason,
            "retries": page.retries,
            "latency_s": round(page.latency_s, 3),
            "engine": page.engine,
            "model": page.model,
        },
    )


def _outbox_error(error: OSError) -> DocumentError:
    if is_disk_full(error):
        return DiskFullError("the outbox's disk is full", stage="publish")
    return TransientError(f"cannot write to the outbox: {error.strerror}", stage="publish")


def _pages_missing_figures(pages: list[PageRecord], staging: Path) -> list[int]:
    """Pages whose cropped figures are no longer in the staging folder."""
    return [
        page.page_no for page in pages if any(not (staging / "images" / name).is_file() for name in page.image_names)
    ]


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
            return bool(json.loads(candidate.read_text(encoding="utf-8")).get("doc_id") == doc_id)
        except (OSError, ValueError, AttributeError):
            return False
    return True
