"""Separator sheets in a batch scan (``split_on``): which pages end one document and start the
next, and the page ranges of the parts between them.

A separator is a page whose barcode says so, decoded with zxing-cpp (as paperless-ngx v3 does):
``"patch-t"``, the PATCH T sheet as paperless prints it (a barcode reading ``PATCHT``; a bare
Kodak patch pattern without it is not recognised), ``"barcode:TEXT"``, any 1-D or 2-D code
reading exactly TEXT (paperless's ``CONSUMER_BARCODE_STRING``), or, with ``"blank"``, a blank page
(``scan.blank``'s ink measure). Separator pages belong to no part. ``document/split.py`` makes
each part a document of its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import zxingcpp
from PIL import Image

from chandrad.config.inbox import split_specs
from chandrad.scan.blank import BLANK_INK, ink_share

PATCH_T_TEXTS = ("PATCHT", "PATCH T", "PATCH-T")

SeparatorKind = Literal["patch-t", "barcode", "blank"]


@dataclass(frozen=True)
class SplitRule:
    """``split_on`` as parsed: which kinds of separator sheet end a part."""

    patch_t: bool = False
    barcode_texts: tuple[str, ...] = ()
    blank: bool = False

    @classmethod
    def parse(cls, specs: Iterable[str]) -> SplitRule:
        """``["patch-t", "barcode:NEXT", "blank"]`` → a rule; ValueError names a spec it cannot read."""
        return cls(*split_specs(specs))

    @property
    def wanted(self) -> bool:
        return self.patch_t or self.blank or bool(self.barcode_texts)


def separator_kind(image: Image.Image, rule: SplitRule) -> SeparatorKind | None:
    """Whether the page image is a separator sheet under ``rule``, and of which kind."""
    if rule.patch_t or rule.barcode_texts:
        grey = image.convert("L") if image.mode != "L" else image
        for code in zxingcpp.read_barcodes(grey):
            text = code.text.strip()
            if rule.patch_t and text.upper() in PATCH_T_TEXTS:
                return "patch-t"
            if text in rule.barcode_texts:
                return "barcode"
    if rule.blank and ink_share(image) < BLANK_INK:
        return "blank"
    return None


def parts(page_count: int, separators: Iterable[int]) -> list[tuple[int, int]]:
    """The (first, last) pages of each part, separators left out; a part with no page (two
    separators in a row, one at either end) is no part."""
    cut = set(separators)
    found: list[tuple[int, int]] = []
    start: int | None = None
    for page_no in range(1, page_count + 1):
        if page_no in cut:
            if start is not None:
                found.append((start, page_no - 1))
            start = None
        elif start is None:
            start = page_no
    if start is not None:
        found.append((start, page_count))
    return found
