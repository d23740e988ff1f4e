"""Batch scans cut at their separator sheets (``split_on``): each part a document of its own.

    prepare ─▶ find the separators ─▶ each part's PDF into a claim folder of its own ─▶ journal:
    the parts queued and the stack ``split``, in one transaction ─▶ the parts go the whole way
    (own outputs, deliveries, failed/) ─▶ the last one final: the stack's original archived once

A part's PDF holds the stack's own page objects (pikepdf: nothing re-encoded) and is written
durably before the journal names it. A crash before the transaction leaves the stack as it was
(prepared again, split again: the parts' ids and names are the same, their files rewritten); a
crash after it leaves the parts queued, each resumed like any document. A part's original is its
PDF: deleted when the part is published (the stack's original is what is archived), moved to
failed/ with its reason when it fails. The stack is published (without outputs of its own) when
its last part is final, by that part's worker or by recovery at the next start.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import io
from pathlib import Path

import pikepdf
import structlog

from chandrad import prepare
from chandrad.config import InboxSettings, PrepareSettings
from chandrad.document.archive import settle_original
from chandrad.errors import PermanentError
from chandrad.hosts import claims
from chandrad.pdf.images import image_document
from chandrad.runtime import Ending, Outcome, Runtime, remove_claim_folder
from chandrad.scan.separators import SplitRule, parts, separator_kind
from chandrad.storage import folders
from chandrad.storage.durable import makedirs_durably, write_file_durably
from chandrad.storage.journal import Document
from chandrad.storage.schema import FINAL_STATES, DocumentState
from chandrad.tools import ToolWorkers

log = structlog.get_logger("chandrad.document.split")

# Separator sheets are told at this resolution: a barcode's bars and a blank page's ink need no more,
# and each page of a stack is rendered once more for it.
SEPARATOR_DPI = 100


def find_separators(
    prepared: prepare.PreparedDocument, settings: PrepareSettings, rule: SplitRule, workers: ToolWorkers | None = None
) -> list[int]:
    """The page numbers of ``prepared`` that are separator sheets under ``rule`` (its PDF pages
    rendered by ``workers``' kept renderers, when given). Blocking."""
    light = settings.model_copy(update={"dpi": SEPARATOR_DPI, "min_short_side_px": 0})
    return [
        page_no
        for page_no in range(1, prepared.page_count + 1)
        if separator_kind(prepared.render(page_no, light, workers).image, rule) is not None
    ]


def part_name(rel_path: str, number: int, count: int) -> str:
    """``letters/stack.pdf``'s part 2 of 3: ``letters/stack (part 2 of 3).pdf`` (its outputs' name too)."""
    path = Path(rel_path)
    return str(path.with_name(f"{path.stem} (part {number} of {count}).pdf"))


def part_bytes(source: Path, doc_type: str, password: str | None, first: int, last: int) -> bytes:
    """Pages ``first``..``last`` of ``source`` as a PDF of their own: a PDF's page objects as they
    are; an image's frames (a multi-page TIFF stack) as the searchable PDF embeds them, each as its
    own bytes where PDF can hold them (``pdf.images``)."""
    opened = image_document(source) if doc_type == "image" else pikepdf.open(source, password=password or "")
    with opened as pdf, pikepdf.new() as part:
        for index in range(first - 1, last):
            part.pages.append(pdf.pages[index])
        buffer = io.BytesIO()
        part.save(buffer, deterministic_id=True)
    return buffer.getvalue()


def write_part(claimed: Path, data: bytes, record: claims.ClaimRecord) -> None:
    """A part's PDF and its claim record into its claim folder, durably (blocking: on the inbox's
    threads). The record lets a host that takes the stack over take its parts with it."""
    makedirs_durably(claimed.parent)
    write_file_durably(claimed, data)
    claims.write_claim_record(claimed.parent, record)


def remove_parts(claimed_parts: list[Path]) -> None:
    """The part folders of a split that is not ours to finish (blocking)."""
    for claimed in claimed_parts:
        claimed.unlink(missing_ok=True)  # a copy of the stack's own pages: the stack keeps them
        remove_claim_folder(claimed.parent)


class Splitter:
    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._completing: set[str] = set()

    async def split(self, doc: Document, inbox: InboxSettings, prepared: prepare.PreparedDocument) -> Outcome | None:
        """Cut ``doc`` at its separator sheets into parts queued as documents of their own; None when
        it has none (it goes on as one document)."""
        if not inbox.split_on or doc.parent_id is not None or prepared.page_count < 2:
            return None
        rule = SplitRule.parse(inbox.split_on)
        runtime = self.runtime
        if await runtime.journal.call(runtime.journal.parts_of, doc.id):
            # Split before (its parts are documents already): it only waits for them again.
            await runtime.journal.call(runtime.journal.split, doc, [])
            done = await self.complete(doc.id)
            return Outcome(doc.id, Ending.PUBLISHED if done else Ending.SPLIT)
        separators = await asyncio.to_thread(
            find_separators, prepared, runtime.settings.prepare, rule, runtime.render_workers
        )
        if not separators:
            return None
        ranges = parts(prepared.page_count, separators)
        if not ranges:
            raise PermanentError(
                f"every one of its {prepared.page_count} page(s) is a separator sheet ({', '.join(inbox.split_on)}): "
                f"nothing to read",
                stage="split",
            )
        made: list[Document] = []
        for number, (first, last) in enumerate(ranges, start=1):
            part_id = f"{doc.id}-{number}"
            rel_path = part_name(doc.rel_path, number, len(ranges))
            claimed = folders.claimed_path(inbox.path, runtime.host_id, part_id, Path(rel_path))
            data = await asyncio.to_thread(
                part_bytes, prepared.source, prepared.doc_type, prepared.password, first, last
            )
            part = dataclasses.replace(
                doc,
                id=part_id,
                rel_path=rel_path,
                claimed_path=str(claimed),
                sha256=hashlib.sha256(data).hexdigest(),
                size=len(data),
                split_from={"parent": doc.id, "file": doc.rel_path, "first": first, "last": last},
            )
            part_record = dataclasses.replace(claims.claim_record_of(part, runtime.host_id), split_from=part.split_from)
            await runtime.on_inbox(inbox.path, write_part, claimed, data, part_record)
            made.append(part)
        # The split's commit point on the share (every part written first); then the journal's.
        stack_claimed = Path(str(doc.claimed_path))
        if not await runtime.on_inbox(inbox.path, claims.note_parts, stack_claimed, [part.id for part in made]):
            await runtime.on_inbox(inbox.path, remove_parts, [Path(str(part.claimed_path)) for part in made])
            taker = await runtime.on_inbox(inbox.path, claims.lost_to, inbox.path, stack_claimed, doc.id)
            raise claims.ClaimLost(taker or "another host")
        await runtime.journal.call(runtime.journal.split, doc, made)
        log.info(
            "batch scan split at its separator sheets",
            separators=separators,
            parts=[f"{first}-{last}" for first, last in ranges],
        )
        return Outcome(doc.id, Ending.SPLIT)

    async def complete(self, parent_id: str) -> bool:
        """If every part of the stack ``parent_id`` is final: its original archived (deleted, kept)
        and the stack published. Whether it is (now or before)."""
        journal = self.runtime.journal
        if parent_id in self._completing:
            return False  # another part's worker is at it
        self._completing.add(parent_id)
        try:
            parent = await journal.call(journal.find, parent_id)
            if parent is None or parent.state in FINAL_STATES:
                return True
            if parent.state != DocumentState.SPLIT:
                return False
            pending = [
                part for part in await journal.call(journal.parts_of, parent_id) if part.state not in FINAL_STATES
            ]
            if pending:
                return False
            await self._finish_parent(parent)
            return True
        finally:
            self._completing.discard(parent_id)

    async def _finish_parent(self, parent: Document) -> None:
        runtime, journal = self.runtime, self.runtime.journal
        inbox = runtime.inbox_of(parent)
        await settle_original(runtime, parent, inbox)
        await journal.call(journal.publish, parent.id, [])
        await runtime.clear_leftovers(parent, inbox)
        log.info("batch scan done: every part is final; its original settled", doc=parent.id, file=parent.rel_path)
