"""Page results → one document directory in the outbox, all or nothing (the original's last move is
``document/stages.finish``'s).

Rendering is pure (``render_document``) and uses ``chandra.output``, the model's own parser, so
our Markdown/HTML/JSON are what the ``chandra`` CLI would write. Writing is two steps: everything
goes into a staging directory on the outbox's filesystem and is fsynced (``stage_files``), then
the directory is renamed into place and the parent fsynced (``durable.rename_dir_durably``). A
reader of the outbox sees a whole document or none of it.

Nothing here writes outside the outbox, archive or failed folders: every name coming from an
inbox passes through ``storage.naming.safe_component``.
"""

from __future__ import annotations

import html
import io
import json
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pikepdf
import structlog
from chandra.output import extract_images, parse_chunks, parse_html, parse_markdown
from PIL import Image

from chandrad import __version__
from chandrad.pdf.build import PageCountMismatch, build_searchable_pdf, searchable_base
from chandrad.pdf.layer import PageLayer
from chandrad.storage.durable import fsync_dir, fsync_file, write_synced

log = structlog.get_logger("chandrad.output.publish")

# -- rendering (pure) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RenderedPage:
    """What is kept of a page once its image is gone: chunks carry pixel bboxes for the JSON."""

    chunks: list[dict[str, Any]]
    image_names: tuple[str, ...]


# What chandrad.scan decided about a page, as the JSON gives it: which path the page took (the
# model, or its own text), its orientation, whether it is blank.
SCAN_KEYS = ("path", "orientation", "blank")

_PAGE_PREFIX = re.compile(r"^p\d+-")


def save_page_images(html: str, image: Image.Image, images_dir: Path, page_no: int | None = None) -> RenderedPage:
    """Crop the page's Image/Figure blocks into ``images_dir``; return the chunks for the JSON.

    chandra names a crop after a hash of the page's HTML and the block's position, so two pages
    with the same HTML (two photo pages both read as one ``Image`` block, say) got the same
    name, and the second page's crop overwrote the first's. With ``page_no`` the stored name is
    ``p<page>-<chandra's name>``; ``_point_images_into_folder`` maps chandra's name to it.
    """
    chunks = parse_chunks(html, image)
    crops = extract_images(html, chunks, image)
    if crops:
        images_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for crop_name, crop in crops.items():
        name = f"p{page_no}-{crop_name}" if page_no is not None else crop_name
        encoded = io.BytesIO()
        crop.save(encoded, format="WEBP")
        write_synced(images_dir / name, encoded.getvalue())
        names.append(name)
    return RenderedPage(chunks=chunks, image_names=tuple(names))


@dataclass(frozen=True)
class PageOutput:
    page_no: int
    html: str
    width: int
    height: int
    chunks: list[dict[str, Any]]
    image_names: tuple[str, ...]
    stats: dict[str, Any]
    error: str | None = None  # a page that could not be read is published as a marked gap
    text_lines: Any = None  # pdf.lines.page_text_lines, measured at page time (None: estimated)
    scan: dict[str, Any] | None = None  # what chandrad.scan decided about the page (orientation)

    @property
    def turn(self) -> int:
        """Clockwise degrees the page image was turned upright before it was read."""
        orientation = (self.scan or {}).get("orientation") or {}
        return int(orientation.get("angle", 0)) if orientation.get("turned") else 0


def _gap(page: PageOutput) -> str:
    return f"[page {page.page_no} could not be read: {page.error}]"


def _point_images_into_folder(text: str, image_names: Iterable[str]) -> str:
    for name in image_names:
        text = text.replace(_PAGE_PREFIX.sub("", name), f"images/{name}")
    return text


def render_document(
    stem: str,
    pages: list[PageOutput],
    formats: Iterable[str],
    metadata: dict[str, Any],
    dropped: tuple[int, ...] = (),
) -> dict[str, bytes]:
    """File name → contents for one document (no images: those were written page by page).
    ``dropped``: blank pages left out of every output here, listed in the JSON's ``dropped_pages``."""
    formats = set(formats)
    page_count = len(pages)
    pages = [page for page in pages if page.page_no not in dropped]
    files: dict[str, bytes] = {}
    if "md" in formats:
        markdown = "\n\n".join(
            f"*{_gap(page)}*" if page.error else _point_images_into_folder(parse_markdown(page.html), page.image_names)
            for page in pages
        )
        files[f"{stem}.md"] = (markdown.strip() + "\n").encode("utf-8")
    if "html" in formats:
        body = "\n".join(
            f'<div class="page" data-page="{page.page_no}">\n'
            + (
                f'<p class="page-error">{html.escape(_gap(page))}</p>'
                if page.error
                else _point_images_into_folder(parse_html(page.html), page.image_names)
            )
            + "\n</div>"
            for page in pages
        )
        files[f"{stem}.html"] = body.encode("utf-8")
    if "json" in formats:
        document = {
            **metadata,
            "num_pages": page_count,
            "dropped_pages": [{"page": page_no, "why": "blank"} for page_no in dropped],
            "failed_pages": [page.page_no for page in pages if page.error],
            "total_prompt_tokens": sum(page.stats.get("prompt_tokens", 0) for page in pages),
            "total_output_tokens": sum(page.stats.get("output_tokens", 0) for page in pages),
            "pages": [
                {
                    "page": page.page_no,
                    "page_box": [0, 0, page.width, page.height],
                    **({"error": page.error} if page.error else {}),
                    **{key: page.scan[key] for key in SCAN_KEYS if page.scan and key in page.scan},
                    **page.stats,
                    "chunks": [
                        {**chunk, "content": _point_images_into_folder(chunk["content"], page.image_names)}
                        for chunk in page.chunks
                    ],
                    "images": [f"images/{name}" for name in page.image_names],
                }
                for page in pages
            ],
        }
        files[f"{stem}.json"] = json.dumps(document, ensure_ascii=False, indent=2).encode("utf-8")
    return files


def document_metadata(doc_id: str, source_name: str, inbox: str, engine: str, model: str) -> dict[str, Any]:
    return {
        "doc_id": doc_id,
        "file_name": source_name,
        "inbox": inbox,
        "engine": engine,
        "model": model,
        "chandrad_version": __version__,
        "published_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


# -- writing (the one atomic step) ---------------------------------------------------------------


def stage_files(staging_dir: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` into ``staging_dir`` and make it durable, ready for its one rename."""
    staging_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        write_synced(staging_dir / name, data)
    images_dir = staging_dir / "images"
    if images_dir.is_dir():
        fsync_dir(images_dir)
    fsync_dir(staging_dir)


@dataclass(frozen=True)
class SearchablePdfJob:
    """What the searchable PDF is made from: the original (claimed) file, the file its pages were
    rendered from (a Ghostscript rewrite, or the original itself), and the inbox's PDF settings."""

    original: Path
    rendered_from: Path
    doc_type: Literal["pdf", "image"]
    lossless: bool
    pdfa: bool
    replace_text: bool
    password: str | None = None
    rotate_pages: bool = False  # a page read turned gets the turn as its /Rotate (rotate_pdf_pages)
    drop_pages: tuple[int, ...] = ()  # left out of the PDF (blank pages, drop_blank_pdf_pages)


def stage_document(
    staging_dir: Path,
    stem: str,
    pages: list[PageOutput],
    formats: Iterable[str],
    metadata: dict[str, Any],
    pdf_job: SearchablePdfJob | None = None,
    dropped: tuple[int, ...] = (),
) -> None:
    """Render a document's outputs and write them into its staging folder (one thread hop: all of it
    blocks). The searchable PDF comes first: what it did (or why it could not be made) goes into the JSON."""
    formats = set(formats)
    staging_dir.mkdir(parents=True, exist_ok=True)
    if "pdf" in formats and pdf_job is not None:
        metadata = {**metadata, "pdf": _stage_searchable_pdf(staging_dir / f"{stem}.pdf", pages, pdf_job)}
    stage_files(staging_dir, render_document(stem, pages, formats - {"pdf"}, metadata, dropped))


def _stage_searchable_pdf(out: Path, pages: list[PageOutput], job: SearchablePdfJob) -> dict[str, Any]:
    """Write the searchable PDF (fsynced) and return its report. A PDF that cannot be made leaves the
    other outputs to publish: the report then says why, and the log too."""
    if job.doc_type == "pdf":
        # A lossy preset's rewrite is what was asked for; a lossless rewrite only repaired or
        # flattened, and the original's pages are kept where they can be.
        source = searchable_base(job.original, job.rendered_from, job.password) if job.lossless else job.rendered_from
    else:
        source = job.original
    layers = [
        PageLayer(page.width, page.height, page.chunks, page.text_lines, page.error, turn=page.turn) for page in pages
    ]
    try:
        report = build_searchable_pdf(
            source,
            job.doc_type,
            layers,
            out,
            pdfa=job.pdfa,
            replace_text=job.replace_text,
            rotate_pages=job.rotate_pages,
            drop_pages=job.drop_pages,
            password=job.password if source == job.original else None,
        )
    except (PageCountMismatch, pikepdf.PdfError) as error:
        out.unlink(missing_ok=True)
        log.warning("the searchable PDF could not be made; the other outputs are published", error=str(error))
        return {"error": f"the searchable PDF could not be made: {error}"}
    fsync_file(out)
    if report.signature_removed:
        log.warning("the searchable PDF keeps the signed original's pages but not its signature")
    if report.decrypted:
        log.info("the searchable PDF of an encrypted original is not encrypted")
    if report.pdfa_blockers:
        log.warning("the searchable PDF is not PDF/A", why=report.pdfa_blockers)
    return report.as_json()
