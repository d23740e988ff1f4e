"""Born-digital pages (``ocr_mode``, OCRmyPDF's and paperless-ngx's meanings): which pages of a
PDF keep their own text instead of going to the model, and that text as Chandra-shaped HTML so
that every output is made from it as from the model's answer.

- ``force`` (the default): every page to the model (Chandra's layout is the product).
- ``skip``: a page with text of its own (visible, or another OCR's invisible layer) keeps it;
  only image-only pages go to the model.
- ``redo``: a page with visible text keeps it; a page whose only text is another OCR's invisible
  layer is read again, as are image-only pages.

"Has text": at least ``MIN_TEXT_CHARS`` characters with usable Unicode inside the outer
``MARGIN`` (``pdfium_text``): one stray character, a page number or a stamp in the margin is not.
"""

from __future__ import annotations

import html
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from chandrad.config import PrepareSettings
from chandrad.errors import PermanentError
from chandrad.tools import run_tool

OcrMode = Literal["force", "skip", "redo"]
PagePath = Literal["model", "text"]

MIN_TEXT_CHARS = 10
MARGIN = 0.04
# The engine name a page read from its own text is recorded with (the JSON's "engine").
PDF_TEXT_ENGINE = "pdf-text"


@dataclass(frozen=True)
class PageText:
    """What one page of a PDF draws as text: usable characters inside the margins, by visibility."""

    visible: int
    invisible: int
    width_pt: float
    height_pt: float
    text: str

    def path(self, mode: OcrMode) -> PagePath:
        """Which way this page goes under ``mode``."""
        if mode == "force":
            return "model"
        if self.visible >= MIN_TEXT_CHARS:
            return "text"
        if mode == "skip" and self.invisible >= MIN_TEXT_CHARS:
            return "text"
        return "model"


def page_texts(pdf: Path, settings: PrepareSettings, password: str | None = None) -> list[PageText]:
    """Every page's text facts, read by PDFium in a child process with the tools' deadline and
    memory cap. Blocking: run it in a thread."""
    done = run_tool(
        [sys.executable, "-m", "chandrad.pdfium_text", str(pdf), str(MARGIN)],
        settings,
        "inspect",
        env={"CHANDRAD_PDF_PASSWORD": password} if password else None,
    )
    if done.returncode != 0:
        reason = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        raise PermanentError(f"the PDF's own text could not be read: {reason[0]}", stage="inspect")
    return [PageText(**entry) for entry in json.loads(done.stdout)]


def text_page_html(text: str) -> str:
    """A page's own text as Chandra writes a page: one ``Text`` block per paragraph (a blank line
    apart), its lines joined into one flowing paragraph, over the whole page (its box in Chandra's
    0-1000 units: the text's place on the page is not measured)."""
    paragraphs = [part.strip() for part in re.split(r"(?:\r?\n\s*){2,}", text.strip()) if part.strip()]
    blocks = []
    for paragraph in paragraphs:
        lines = " ".join(html.escape(line.strip()) for line in paragraph.splitlines() if line.strip())
        blocks.append(f'<div data-bbox="0 0 1000 1000" data-label="Text"><p>{lines}</p></div>')
    return "".join(blocks)
