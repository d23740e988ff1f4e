"""``chandrad once``: given files through the pipeline, without a daemon, into an output folder.

A scratch inbox, journal and failed folder live in a temporary directory; each file is journaled
as already claimed where it lies (``move_originals=False``: originals stay where they are), then
``Pipeline.process`` runs it, a transient failure or a wait again after a pause (up to
``max_attempts`` attempts; a wait uses none, so ``ONCE_ROUNDS`` bounds both). A batch scan cut at
its separator sheets (the first inbox's ``split_on``) gives one output folder per part: its parts
are converted like the given files once the stack is split.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

from chandrad.backoff import backoff_seconds
from chandrad.config import InboxSettings, Settings, prepare_folders
from chandrad.document.pipeline import Pipeline
from chandrad.engine import create_engine, pages_in_flight
from chandrad.runtime import Ending, Outcome
from chandrad.storage.folders import host_staging, staging_root
from chandrad.storage.journal import Journal

# How many times `once` takes a document up again before it gives up (each transient failure or
# wait), and the longest pause between two: about four minutes of a full disk in all.
ONCE_ROUNDS = 12
ONCE_PAUSE_CAP_SECONDS = 30.0


async def convert_once(
    settings: Settings,
    files: tuple[Path, ...],
    output_dir: Path,
    overrides: dict[str, object],
    on_published: Callable[[Path, Path | None], None],
) -> list[tuple[str, str]]:
    """Convert ``files`` into ``output_dir`` (a sub-folder each) with ``settings``' engine and the
    first inbox's output settings (``overrides`` win): the (file, reason) of each that failed.
    ``on_published(file, its output folder)`` as each is published."""
    template = settings.inbox[0] if settings.inbox else None
    failures: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory(prefix="chandrad-once-") as scratch:
        scratch_path = Path(scratch)
        inherited_keys = (
            *("prompt_type", "formats", "compress", "pdf_password", "pdfa", "pdf_replace_text", "pdf_word_boxes"),
            *("rotate_pages", "rotate_pdf_pages", "blank_pages", "drop_blank_pdf_pages", "ocr_mode", "split_on"),
        )
        inherited = {key: getattr(template, key) for key in inherited_keys} if template else {}
        inbox = InboxSettings.model_validate(
            {
                "path": scratch_path / "inbox",
                "outbox": output_dir,
                "failed": scratch_path / "failed",
                "name": "once",
                "on_success": "keep",
                "duplicates": "reprocess",
                **inherited,
                **overrides,
            }
        )
        once_settings = settings.model_copy(
            update={"state_dir": scratch_path / "state", "inbox": (inbox,), "retry_backoff_seconds": 0.0}
        )
        prepare_folders(once_settings)
        journal = Journal(once_settings.state_dir / "journal.sqlite3")
        engine = create_engine(once_settings.engine, once_settings.state_dir)
        await engine.start()
        pipeline = Pipeline(once_settings, journal, engine, move_originals=False)
        try:
            doc_ids = []
            for file in files:
                if not file.exists() and not file.is_symlink():
                    failures.append((str(file), "no such file"))
                    continue
                stat = file.lstat()
                doc = await journal.call(journal.add_document, "once", file.name, "", stat.st_size, stat.st_mtime_ns)
                await journal.call(journal.set_state, doc.id, "queued", claimed_path=str(file.absolute()))
                doc_ids.append((file, doc.id))

            sem = asyncio.Semaphore(settings.documents_in_flight(pages_in_flight(settings.engine, engine.name)))

            async def convert(group: asyncio.TaskGroup, file: Path, doc_id: str) -> None:
                async with sem:
                    outcome = await convert_one(pipeline, doc_id)
                if outcome.state is Ending.FAILED:
                    failures.append((str(file), outcome.reason))
                elif outcome.state is Ending.SPLIT:
                    # A batch scan cut into parts, each a document of its own in the journal now: the
                    # last one to be final completes the stack (the pipeline does).
                    for part in await journal.call(journal.parts_of, doc_id):
                        span = part.split_from or {}
                        label = file.with_name(f"{file.name} pages {span.get('first')}-{span.get('last')}")
                        group.create_task(convert(group, label, part.id))
                else:
                    on_published(file, outcome.output_dir)

            async with asyncio.TaskGroup() as group:
                for file, doc_id in doc_ids:
                    group.create_task(convert(group, file, doc_id))
        finally:
            await engine.aclose()
            pipeline.close()
            journal.close()
            # Leave the output folder holding only outputs: the staging folders are empty now.
            staging = staging_root(output_dir)
            for leftover in (host_staging(output_dir, settings.host_id), staging, staging.parent):
                try:
                    leftover.rmdir()
                except OSError:  # absent, or not empty (another chandrad's): leave it
                    pass
    return failures


async def convert_one(pipeline: Pipeline, doc_id: str) -> Outcome:
    """The document through the pipeline, taken up again after each transient failure or wait."""
    rounds = 0
    while (outcome := await pipeline.process(doc_id)).state is Ending.RETRYING:
        # A transient failure uses an attempt (the pipeline fails the document after
        # max_attempts); a wait (a full disk, an unreachable folder) does not, so without a bound
        # of its own a lasting one would hold `once` for ever.
        rounds += 1
        if rounds >= ONCE_ROUNDS:
            return dataclasses.replace(
                outcome, state=Ending.FAILED, reason=f"gave up after {rounds} tries: {outcome.reason}"
            )
        await asyncio.sleep(backoff_seconds(0.5, rounds, ONCE_PAUSE_CAP_SECONDS))
    return outcome
