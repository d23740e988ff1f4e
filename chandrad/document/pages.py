"""The ``inferring`` step: a prepared document's pages through the engine into the journal.

Pages are rendered one at a time, never more than one ahead of the engine, and up to
``max_pages_in_flight`` (shared by all documents) are at the engine at once. Each page's result
(its HTML, and the figures cropped into the staging folder) is committed as it arrives, so a
document interrupted at page 400 resumes at page 400. A page the engine can never read is
recorded as failed; the document decides at publish time whether its gaps are acceptable.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import structlog
from structlog.contextvars import bound_contextvars

from chandrad import prepare
from chandrad.config import InboxSettings, PrepareSettings
from chandrad.engine.base import PageRequest
from chandrad.errors import DocumentError, InboxUnreachableError, PermanentError, TransientError
from chandrad.output import publish
from chandrad.pdf.lines import PageLines, page_text_lines
from chandrad.runtime import Runtime
from chandrad.scan.blank import Blankness, ink_share, judge_blank
from chandrad.scan.digital import PDF_TEXT_ENGINE, PageText, text_page_html
from chandrad.scan.orientation import TESSERACT_MISSING, Orientation, detect_orientation, turned_upright
from chandrad.storage.folders import inbox_reachable
from chandrad.storage.journal import Document
from chandrad.storage.schema import PageRecord

log = structlog.get_logger("chandrad.document.pages")


def check_inbox_reachable(inbox: InboxSettings) -> None:
    """Raise InboxUnreachableError when a claimed original is missing because the whole inbox is:
    the file is not lost and must not be declared so. Blocking: run in a thread."""
    if not inbox_reachable(inbox.path):
        raise InboxUnreachableError(
            f"the inbox {inbox.path} is not reachable (unmounted or removed?); waiting for it to return",
            stage="resume",
        )


def _first_document_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
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


def _page_files(
    html: str, page: prepare.PageImage, images_dir: Path, inbox: InboxSettings, engine: str, ink: float
) -> tuple[publish.RenderedPage, PageLines | None, Blankness]:
    """What is kept of a page once its image is gone (one thread hop): its figures cropped into
    staging, its chunks, for a searchable PDF where its lines and words are on the image, and
    whether it is blank (the model's label parsed here, off the loop; ``ink`` measured before)."""
    rendered = publish.save_page_images(html, page.image, images_dir, page.page_no)
    blankness = judge_blank(html, ink, engine)
    if "pdf" not in inbox.formats:
        return rendered, None, blankness
    return rendered, page_text_lines(page.image, rendered.chunks, html, words=inbox.pdf_word_boxes), blankness


def _look_at(page: prepare.PageImage, inbox: InboxSettings, settings: PrepareSettings) -> tuple[float, Orientation]:
    """A page before it is read (one thread hop): its ink (``scan.blank``), measured once for both
    the blank-page judgement and orientation, and which way it is up (``rotate_pages``)."""
    # One greyscale copy for both: converting a rendered page costs about as much as judging it.
    grey = page.image if page.image.mode == "L" else page.image.convert("L")
    ink = ink_share(grey)
    if not inbox.rotate_pages:
        return ink, Orientation(note="rotate_pages is off")
    return ink, detect_orientation(grey, page.dpi, settings, ink)


class PageReader:
    def __init__(self, runtime: Runtime, page_slots: asyncio.Semaphore) -> None:
        self.runtime = runtime
        self.page_slots = page_slots

    async def read_pages(
        self,
        doc: Document,
        inbox: InboxSettings,
        prepared: prepare.PreparedDocument,
        done: set[int],
        staging: Path,
        own_text: dict[int, PageText] | None = None,
    ) -> None:
        """Every page not in ``done`` to the engine, but those in ``own_text`` (ocr_mode), which keep
        their own text; raises if the document cannot go on."""
        own_text = own_text or {}
        for page_no in sorted(set(own_text) - done):
            await self._record_own_text(doc, page_no, own_text[page_no], self.runtime.settings.prepare.dpi)
        todo = [n for n in range(1, prepared.page_count + 1) if n not in done and n not in own_text]
        blank_pages = 0
        settings = self.runtime.settings
        await asyncio.to_thread(staging.mkdir, parents=True, exist_ok=True)
        try:
            async with asyncio.TaskGroup() as group:
                for page_no in todo:
                    # Render the next page while earlier ones are at the engine; never more than one ahead.
                    try:
                        page = await self.runtime.read_original(
                            prepared.render, page_no, settings.prepare, self.runtime.render_workers
                        )
                    except PermanentError as page_error:
                        await self._render_failed(doc, inbox, prepared, page_no, page_error)
                        continue
                    if prepared.repair_warning:
                        blank: bool = await asyncio.to_thread(prepare.is_blank, page.image)
                        blank_pages += blank
                    await self.page_slots.acquire()
                    # Released by a done-callback: it runs even for a task cancelled before it started.
                    group.create_task(self._read(doc, inbox, page, prepared.page_count, staging)).add_done_callback(
                        lambda _: self.page_slots.release()
                    )
                    del page
        except BaseExceptionGroup as group_error:
            raise _first_document_error(group_error) from None
        if prepared.repair_warning and not done and blank_pages == prepared.page_count:
            # A truncated scan "repaired" into blank pages would be published as an empty document
            # and its original archived: the person would never learn that nothing had been read.
            raise PermanentError(
                f"the PDF is damaged (cut short or corrupted?): its structure could be repaired but none of its "
                f"{prepared.page_count} page(s) has content left to read ({prepared.repair_warning})",
                stage="render",
            )

    async def _render_failed(
        self,
        doc: Document,
        inbox: InboxSettings,
        prepared: prepare.PreparedDocument,
        page_no: int,
        error: PermanentError,
    ) -> None:
        # On the inbox's threads within a deadline: the original is on the share, which may be what broke.
        if not await self.runtime.probe(inbox.path, prepared.source.exists):
            # The file went away under the renderer (inbox unmounted mid-document): not this
            # page's fault; recording it failed would fail the document.
            await self.runtime.probe(inbox.path, lambda: check_inbox_reachable(inbox))
            raise PermanentError("the claimed original disappeared while it was being read", stage="render") from None
        await self.record_failed(doc.id, page_no, error, (0, 0))

    async def _read(
        self, doc: Document, inbox: InboxSettings, page: prepare.PageImage, page_count: int, staging: Path
    ) -> None:
        engine, journal, settings = self.runtime.engine, self.runtime.journal, self.runtime.settings
        timeout = settings.engine.page_timeout_seconds
        with bound_contextvars(page=page.page_no):
            ink, orientation = await self._look_at(page, inbox)
            if orientation.turned:
                page = dataclasses.replace(page, image=turned_upright(page.image, orientation))
            request = PageRequest(doc.id, page.page_no, page.image, inbox.prompt_type)
            try:
                async with asyncio.timeout(timeout):
                    result = await engine.ocr(request)
            except PermanentError as page_error:  # this page can never be read; the others may
                await self.record_failed(doc.id, page.page_no, page_error, page.image.size)
                return
            except TimeoutError:
                raise TransientError(
                    f"page {page.page_no}: the engine did not answer within {timeout:.0f} s", stage="engine"
                ) from None
            rendered, text_lines, blankness = await asyncio.to_thread(
                _page_files, result.html, page, staging / "images", inbox, engine.name, ink
            )
            await journal.call(
                journal.record_page,
                PageRecord(
                    doc_id=doc.id,
                    page_no=page.page_no,
                    width=page.image.width,
                    height=page.image.height,
                    html=result.html,
                    prompt_tokens=result.prompt_tokens,
                    output_tokens=result.output_tokens,
                    finish_reason=result.finish_reason,
                    retries=result.retries,
                    latency_s=result.latency_s,
                    engine=engine.name,
                    model=engine.model,
                    image_names=rendered.image_names,
                    chunks=tuple(rendered.chunks),
                    text_lines=text_lines,
                    scan={
                        "path": "model",
                        "blank": blankness.as_json(),
                        **({"orientation": orientation.as_json()} if inbox.rotate_pages else {}),
                    },
                ),
            )
            log.info(
                "page done",
                page=page.page_no,
                of=page_count,
                seconds=round(result.latency_s, 2),
                tokens=result.output_tokens,
                retries=result.retries,
                engine_peak_running=engine.status().peak_running,
                **({"turned": orientation.turn} if orientation.turned else {}),
            )

    async def _look_at(self, page: prepare.PageImage, inbox: InboxSettings) -> tuple[float, Orientation]:
        """The page's ink and which way it is up, judged a core at a time beside the engine."""
        async with self.runtime.scan_slots:
            ink, orientation = await asyncio.to_thread(_look_at, page, inbox, self.runtime.settings.prepare)
        if orientation.turned:
            log.info("page turned upright", turn=orientation.turn, confidence=orientation.confidence)
        elif orientation.note.endswith(TESSERACT_MISSING):
            # Told once, as a warning, when the daemon starts (Daemon.startup): not once a page.
            log.info("page orientation not judged; read as it is", reason=orientation.note)
        elif orientation.note.startswith("orientation not detected"):
            log.warning("page orientation not detected; read as it is", reason=orientation.note)
        return ink, orientation

    async def _record_own_text(self, doc: Document, page_no: int, text: PageText, dpi: float) -> None:
        """A page that keeps its own text (ocr_mode): its text as the page's result, no engine."""
        journal = self.runtime.journal
        await journal.call(
            journal.record_page,
            PageRecord(
                doc_id=doc.id,
                page_no=page_no,
                width=round(text.width_pt * dpi / 72),
                height=round(text.height_pt * dpi / 72),
                html=text_page_html(text.text),
                engine=PDF_TEXT_ENGINE,
                scan={"path": "text", "text_chars": {"visible": text.visible, "invisible": text.invisible}},
            ),
        )
        log.info("page kept its own text", page=page_no, visible=text.visible, invisible=text.invisible)

    async def record_failed(self, doc_id: str, page_no: int, error: DocumentError, size: tuple[int, int]) -> None:
        engine, journal = self.runtime.engine, self.runtime.journal
        log.warning("page failed", page=page_no, reason=error.reason)
        await journal.call(
            journal.record_page,
            PageRecord(
                doc_id=doc_id,
                page_no=page_no,
                width=size[0],
                height=size[1],
                html="",
                error=error.reason,
                engine=engine.name,
                model=engine.model,
            ),
        )
