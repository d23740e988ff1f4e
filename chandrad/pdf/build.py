"""A document's pages and their OCR layout → a searchable PDF: the pages as they were, text invisible on top.

At publish time, from each page's lines and words (``chandrad.pdf.lines``, measured at page time):
PDF inputs keep every page object, content stream, image and font as it is; each page gets one more
content stream (the original ones wrapped in ``q``/``Q``) that draws the text layer
(``chandrad.pdf.layer``). Image inputs become one page per frame (``chandrad.pdf.images``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pikepdf
from pikepdf import Name, Pdf

from chandrad.pdf.font import add_font
from chandrad.pdf.images import image_document
from chandrad.pdf.layer import PageLayer, page_frame, text_layer, turned_frame
from chandrad.pdf.lines import block_tokens
from chandrad.pdf.original import remove_signatures, strip_invisible_text, text_kind
from chandrad.pdf.pdfa import make_pdfa, pdfa_blockers


@dataclass
class PdfReport:
    """What the PDF step did, for the document's JSON and the log."""

    pages: int = 0
    words: int = 0
    text_pages: list[int] = field(default_factory=list)  # pages given a text layer
    kept_text_pages: list[int] = field(default_factory=list)  # pages whose own text was kept (no layer added)
    replaced_text_pages: list[int] = field(default_factory=list)  # another OCR's invisible text replaced
    gap_pages: list[int] = field(default_factory=list)  # pages that could not be read: no text
    pdfa: bool = False  # the file declares PDF/A-2b
    pdfa_blockers: list[str] = field(default_factory=list)  # why it does not, when PDF/A was asked for
    signature_removed: bool = False  # the original was signed; the copy's pages are the same, unsigned
    decrypted: bool = False  # the original was encrypted; the copy is not
    rotated_pages: list[int] = field(default_factory=list)  # given a /Rotate to show upright (rotate_pdf_pages)
    dropped_pages: list[int] = field(default_factory=list)  # blank pages left out (drop_blank_pdf_pages)

    def as_json(self) -> dict[str, Any]:
        return {
            "pages": self.pages,
            "words": self.words,
            "text_pages": self.text_pages,
            "kept_text_pages": self.kept_text_pages,
            "replaced_text_pages": self.replaced_text_pages,
            "gap_pages": self.gap_pages,
            "pdfa": self.pdfa,
            "pdfa_blockers": self.pdfa_blockers,
            "signature_removed": self.signature_removed,
            "decrypted": self.decrypted,
            "rotated_pages": self.rotated_pages,
            "dropped_pages": self.dropped_pages,
        }


ASPECT_TOLERANCE = 0.05  # of the larger aspect ratio: a page image more than 5 % off is another page


class PageCountMismatch(ValueError):
    """The page results do not match the document's pages (their number, or a page's shape)."""


def searchable_base(original: Path, rendered_from: Path, password: str | None = None) -> Path:
    """The PDF to put the text on: the original when ``prepare`` rendered a Ghostscript rewrite of it
    only to flatten its form fields (lossless), so that its pages stay as they were; the rewrite when
    the original cannot be opened or does not have the rewrite's pages (repaired, lossy compress:
    the caller passes the rewrite then). Blocking."""
    if original == rendered_from:
        return original
    try:
        with Pdf.open(original, password=password or "") as first, Pdf.open(rendered_from) as second:
            if len(first.pages) != len(second.pages):
                return rendered_from
            for a, b in zip(first.pages, second.pages, strict=True):
                if abs(_aspect(a.obj) - _aspect(b.obj)) > 0.01:
                    return rendered_from
    except (pikepdf.PdfError, OSError):
        return rendered_from
    return original


def _aspect(page: pikepdf.Object) -> float:
    """The displayed page's width / height (MediaBox, /Rotate)."""
    frame = page_frame(page, 1, 1)
    x0, y0, x1, y1 = frame.box
    width, height = (y1 - y0, x1 - x0) if frame.rotate in (90, 270) else (x1 - x0, y1 - y0)
    return width / max(height, 1e-9)


def build_searchable_pdf(
    source: Path,
    doc_type: Literal["pdf", "image"],
    pages: list[PageLayer],
    out: Path,
    *,
    pdfa: bool,
    replace_text: bool,
    rotate_pages: bool = False,
    drop_pages: tuple[int, ...] = (),
    password: str | None = None,
) -> PdfReport:
    """Write ``out``: ``source``'s pages with an invisible text layer from ``pages`` (one per page, in order).

    PDF inputs: every page object kept (content, images, fonts, annotations as they were); a page
    that has text of its own keeps it and gets no layer, unless ``replace_text`` and that text is
    invisible (another OCR's layer), which is then replaced. Image inputs: one page per frame.
    A page whose image was turned upright before it was read (``PageLayer.turn``) keeps its content
    as it is; its text layer runs along the words as they lie on the page, or, with ``rotate_pages``,
    the page gets the turn added to its /Rotate so that a viewer shows it upright.
    ``pdfa``: PDF/A-2b (XMP identification, sRGB output intent), unless the original holds what
    PDF/A forbids and only re-rendering could change (``PdfReport.pdfa_blockers`` says what).
    The output is never encrypted. Blocking: run it in a thread. Raises ``PageCountMismatch``.
    """
    report = PdfReport(pages=len(pages))
    if doc_type == "pdf":
        pdf = Pdf.open(source, password=password or "")
        report.decrypted = pdf.is_encrypted
    else:
        pdf = image_document(source)
    with pdf:
        if len(pdf.pages) != len(pages):
            raise PageCountMismatch(f"{source.name} has {len(pdf.pages)} pages, {len(pages)} page results were given")
        report.signature_removed = doc_type == "pdf" and remove_signatures(pdf)
        font_ref = add_font(pdf)
        for number, (page, layer) in enumerate(zip(pdf.pages, pages, strict=True), start=1):
            if layer.error is not None:
                report.gap_pages.append(number)
                continue
            if doc_type == "pdf":
                kind = text_kind(page)
                if kind == "visible" or (kind == "invisible" and not replace_text):
                    report.kept_text_pages.append(number)
                    continue
                if kind == "invisible":
                    strip_invisible_text(pdf, page)
                    report.replaced_text_pages.append(number)
            if layer.turn and rotate_pages:
                page.obj.Rotate = (page_frame(page.obj, 1, 1).rotate + layer.turn) % 360
                report.rotated_pages.append(number)
            if not any(block_tokens(chunk) for chunk in layer.chunks):
                continue
            frame = page_frame(page.obj, layer.width, layer.height)
            if layer.turn and not rotate_pages:
                frame = turned_frame(frame, layer.turn)
            # Relative, and loose enough for the model input's 28-pixel grid (chandra's scale_to_fit),
            # which stretches a thin strip by up to ~3 % (a 360 × 60 receipt is read at 6 132 × 1 008).
            page_aspect, image_aspect = _aspect(page.obj), layer.width / max(layer.height, 1)
            if layer.turn in (90, 270) and not rotate_pages:
                page_aspect = 1 / max(page_aspect, 1e-9)
            if abs(page_aspect - image_aspect) > ASPECT_TOLERANCE * max(page_aspect, image_aspect):
                raise PageCountMismatch(
                    f"page {number} is shaped {_aspect(page.obj):.3f}, its image {layer.width}×{layer.height}: "
                    f"not the page the layout was read from"
                )
            name = page.add_resource(font_ref, Name.Font, prefix="FChandrad")
            content, words = text_layer(frame, layer, str(name))
            if words:
                _append_content(pdf, page, content)
                report.text_pages.append(number)
                report.words += words
        # Blank pages go last, after every page was matched with its layer; never every page (a PDF
        # has at least one).
        dropping = sorted(set(drop_pages))
        if dropping and len(dropping) < len(pdf.pages):
            for number in reversed(dropping):
                del pdf.pages[number - 1]
            report.dropped_pages = dropping
        if pdfa:
            report.pdfa_blockers = pdfa_blockers(pdf)
            if not report.pdfa_blockers:
                make_pdfa(pdf)
                report.pdfa = True
        version = pdf.pdf_version
        pdf.save(
            out,
            encryption=False,
            force_version="1.7" if report.pdfa and version > "1.7" else "",
            min_version="1.5" if doc_type == "image" else "",
        )
    return report


def _append_content(pdf: Pdf, page: pikepdf.Page, content: bytes) -> None:
    """The original content wrapped in q/Q (its graphics state cannot leak into ours), then ours."""
    page.contents_add(pdf.make_stream(b"q\n"), prepend=True)
    page.contents_add(pdf.make_stream(b"\nQ\n"), prepend=False)
    page.contents_add(pdf.make_stream(zlib.compress(content), Filter=Name.FlateDecode), prepend=False)
