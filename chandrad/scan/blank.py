"""Whether a page is blank (a duplex scan's empty back): Chandra 2 says so itself (a page whose
only block is labelled ``Blank-Page``); for the tesseract engine an ink measure decides.

The ink measure: the page in greyscale, its outer ``MARGIN`` left out (scanner edges and punch
holes), box-averaged down to about ``SAMPLE_WIDTH`` pixels wide so that dust and specks fade into
the paper, then the share of samples darker than the paper by ``INK_CONTRAST`` grey levels. A
page under ``BLANK_INK`` is blank. Measured (tests/test_blank_pages.py's generated backs, the
corpus): a back with noise, dust, the front's text shining through and the scanner's dark edge
scores 0; one short line of text ("This is a multi page document. Page 1.") 0.0015 and more; the
corpus's pages with content 0.0007 (a 35 000 px fax page of specks) and more; so 0.0004.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from bs4 import BeautifulSoup
from PIL import Image

MARGIN = 0.04  # of each side
SAMPLE_WIDTH = 400
INK_CONTRAST = 60
BLANK_INK = 0.0004

BLANK_LABEL = "Blank-Page"


@dataclass(frozen=True)
class Blankness:
    """What was decided: ``blank``, by whom (the model's label or the ink measure), and the ink share."""

    blank: bool
    by: Literal["model", "ink"]
    ink: float

    def as_json(self) -> dict[str, Any]:
        return {"blank": self.blank, "by": self.by, "ink": round(self.ink, 5)}


def ink_share(image: Image.Image) -> float:
    """The share of the page (margins left out) darker than its paper by INK_CONTRAST levels."""
    grey = image.convert("L") if image.mode != "L" else image
    width, height = grey.size
    inner = grey.crop(
        (round(width * MARGIN), round(height * MARGIN), round(width * (1 - MARGIN)), round(height * (1 - MARGIN)))
    )
    factor = max(1, inner.width // SAMPLE_WIDTH)
    sample = np.asarray(inner.reduce(factor) if factor > 1 else inner, dtype=np.int16)
    if sample.size == 0:
        return 0.0
    paper = int(np.percentile(sample, 90))
    return float((sample < paper - INK_CONTRAST).mean())


def model_says_blank(html: str) -> bool:
    """Whether Chandra read the page as blank: every top-level block it gave is ``Blank-Page``."""
    labels = [div.get("data-label") for div in BeautifulSoup(html, "html.parser").find_all("div", recursive=False)]
    return bool(labels) and all(label == BLANK_LABEL for label in labels)


def judge_blank(html: str, ink: float, engine: str) -> Blankness:
    """The page's blankness as its engine can tell it: Chandra's label, or (tesseract) its ink
    (``ink_share`` of the page as it was rendered)."""
    if engine == "tesseract":
        return Blankness(ink < BLANK_INK, "ink", ink)
    return Blankness(model_says_blank(html), "model", ink)
