"""Separator sheets of a batch scan found where they are (real zxing-cpp on pages rendered by
prepare's PDFium child; generated stacks of corpus scans): the detection and the page ranges it
gives (tests/test_split.py: the daemon making each part a document)."""

from __future__ import annotations

import io

import img2pdf
import numpy as np
import pypdfium2 as pdfium
import pytest
import zxingcpp
from PIL import Image

from chandrad import prepare
from chandrad.config import PrepareSettings
from chandrad.scan.separators import SplitRule, parts, separator_kind
from tests.conftest import corpus_file
from tests.test_blank_pages import blank_back

LETTERS = ["linn.pdf", "c02-22.pdf", "francais.pdf"]


def _scan(name: str) -> Image.Image:
    return pdfium.PdfDocument(str(corpus_file(name)))[0].render(scale=192 / 72).to_pil().convert("L")


def _sheet(text: str, kind: zxingcpp.BarcodeFormat, scale: int) -> Image.Image:
    """A separator sheet as one is printed and scanned: a code on a white page, with a caption."""
    page = Image.new("L", (1632, 2112), 250)
    code = Image.fromarray(np.asarray(zxingcpp.create_barcode(text, kind).to_image(scale=scale)))
    page.paste(code, ((page.width - code.width) // 2, 700))
    return page


SHEETS = {
    "patch-t": lambda: _sheet("PATCHT", zxingcpp.BarcodeFormat.Code128, 4),
    "barcode:NEXT-LETTER": lambda: _sheet("NEXT-LETTER", zxingcpp.BarcodeFormat.QRCode, 10),
    "blank": lambda: blank_back(3),
}


def stack_bytes(separator: Image.Image) -> bytes:
    """Three letters (two pages each: the letter's scan, then c02-22 as its second page) with the
    separator between them, as one image PDF: pages 1-2, [3], 4-5, [6], 7-8."""
    frames = []
    for index, name in enumerate(LETTERS):
        if index:
            frames.append(separator)
        frames += [_scan(name), _scan("c02-22.pdf")]
    encoded = []
    for frame in frames:
        buffer = io.BytesIO()
        frame.save(buffer, "PNG", dpi=(192, 192))
        encoded.append(buffer.getvalue())
    return img2pdf.convert(encoded)


def _stack(tmp_path, separator: Image.Image):
    path = tmp_path / "stack.pdf"
    path.write_bytes(stack_bytes(separator))
    return path


@pytest.mark.parametrize("spec", list(SHEETS))
def test_the_separator_sheets_of_a_stack_are_found_and_give_the_letters_page_ranges(tmp_path, spec):
    stack = _stack(tmp_path, SHEETS[spec]())
    rule = SplitRule.parse([spec])
    settings = PrepareSettings()
    found = [
        page_no
        for page_no in range(1, 9)
        if separator_kind(prepare.render_pdf_page(stack, page_no, settings).image, rule) is not None
    ]
    assert found == [3, 6]
    assert parts(8, found) == [(1, 2), (4, 5), (7, 8)]


def test_a_code_that_says_something_else_is_no_separator():
    rule = SplitRule.parse(["barcode:NEXT-LETTER", "patch-t"])
    assert separator_kind(_sheet("INVOICE-2026-0042", zxingcpp.BarcodeFormat.QRCode, 10), rule) is None
    assert separator_kind(_scan("linn.pdf"), rule) is None
    assert separator_kind(blank_back(1), rule) is None, "a blank page separates only with \"blank\""


def test_split_on_is_parsed_and_refused_with_a_reason():
    assert SplitRule.parse(["patch-t", "barcode:A B", "blank"]) == SplitRule(True, ("A B",), True)
    assert not SplitRule.parse([]).wanted
    for bad in (["barcode:"], ["qr"], ["Patch-T"]):
        with pytest.raises(ValueError, match="split_on"):
            SplitRule.parse(bad)


def test_parts_leave_out_separators_and_empty_parts():
    assert parts(5, []) == [(1, 5)]
    assert parts(5, [1, 2, 5]) == [(3, 4)]
    assert parts(6, [3, 4]) == [(1, 2), (5, 6)]
    assert parts(2, [1, 2]) == []
