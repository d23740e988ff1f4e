"""ocr_mode: born-digital pages keep their own text ("skip"), another OCR's pages are read again
("redo"), every page goes to the model by default ("force"); decided page by page from the PDF's
own text (real PDFium in a child process, real tesseract engine, pikepdf-made inputs)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pikepdf
import pytest

from chandrad.config import PrepareSettings
from chandrad.scan.digital import MIN_TEXT_CHARS, PageText, page_texts
from tests.conftest import corpus_file, once_with_tesseract


def _json(folder: Path) -> dict:
    return json.loads(next(folder.glob("*.json")).read_text())


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def test_skip_sends_no_page_of_a_digital_pdf_to_the_engine_and_keeps_its_text(tmp_path):
    source = corpus_file("multi-page-digital.pdf")
    folder = once_with_tesseract(tmp_path, [source], 'ocr_mode = "skip"\n') / source.stem
    pages = _json(folder)["pages"]
    assert [(page["path"], page["engine"]) for page in pages] == [("text", "pdf-text")] * 3
    own = subprocess.run(["pdftotext", str(source), "-"], capture_output=True, text=True, check=True).stdout
    assert _words((folder / f"{source.stem}.md").read_text()) == _words(own)
    assert _json(folder)["pdf"]["kept_text_pages"] == [1, 2, 3]


def test_force_is_the_default_and_reads_every_page(tmp_path):
    source = corpus_file("multi-page-digital.pdf")
    pages = _json(once_with_tesseract(tmp_path, [source], "") / source.stem)["pages"]
    assert [(page["path"], page["engine"]) for page in pages] == [("model", "tesseract")] * 3


@pytest.fixture(scope="module")
def ocred_scan(tmp_path_factory) -> Path:
    """linn.pdf as another OCR leaves it: the scan with an invisible text layer (made by chandrad's
    own searchable PDF, which is what such a layer is)."""
    folder = tmp_path_factory.mktemp("ocred")
    out = once_with_tesseract(folder, [corpus_file("linn.pdf")], "", formats="pdf")
    made = out / "linn" / "linn.pdf"
    with pikepdf.open(made) as pdf:
        assert pdf.pages[0].obj.Contents is not None
    return made


def test_skip_keeps_another_ocrs_layer_and_redo_reads_the_page_again(tmp_path, ocred_scan):
    facts = page_texts(ocred_scan, PrepareSettings())
    assert facts[0].visible < MIN_TEXT_CHARS <= facts[0].invisible
    kept = _json(once_with_tesseract(tmp_path / "skip", [ocred_scan], 'ocr_mode = "skip"\n') / "linn")
    assert kept["pages"][0]["path"] == "text" and kept["pdf"]["kept_text_pages"] == [1]

    redone = once_with_tesseract(tmp_path / "redo", [ocred_scan], 'ocr_mode = "redo"\n') / "linn"
    document = _json(redone)
    assert document["pages"][0]["path"] == "model" and document["pages"][0]["engine"] == "tesseract"
    assert document["pdf"]["replaced_text_pages"] == [1], "the old invisible layer gives way to the new one"
    markdown = _words((redone / "linn.md").read_text())
    layer = _words(subprocess.run(["pdftotext", str(redone / "linn.pdf"), "-"], capture_output=True,
                                  text=True, check=True).stdout)
    assert len(layer) <= 1.1 * len(markdown), "one text layer, not two"


def _page_of(source: Path, index: int, into: pikepdf.Pdf) -> None:
    with pikepdf.open(source) as pdf:
        into.pages.append(pdf.pages[index])


def test_a_mixed_document_is_decided_page_by_page(tmp_path):
    mixed = tmp_path / "mixed.pdf"
    with pikepdf.new() as pdf:
        _page_of(corpus_file("multi-page-digital.pdf"), 0, pdf)
        _page_of(corpus_file("linn.pdf"), 0, pdf)
        _page_of(corpus_file("multi-page-digital.pdf"), 1, pdf)
        pdf.save(mixed)
    folder = once_with_tesseract(tmp_path, [mixed], 'ocr_mode = "skip"\n') / "mixed"
    assert [page["path"] for page in _json(folder)["pages"]] == ["text", "model", "text"]
    markdown = (folder / "mixed.md").read_text()
    assert "Page 1." in markdown and "Page 2." in markdown and "LinnSequencer" in markdown.replace(" ", "")


def test_a_stray_character_or_a_margin_stamp_is_not_a_pages_text(tmp_path):
    """A scan with a one-letter mark in its middle and a page number in its margin goes to the model."""
    stamped = tmp_path / "stamped.pdf"
    with pikepdf.new() as pdf:
        _page_of(corpus_file("linn.pdf"), 0, pdf)
        page = pdf.pages[0]
        width, height = float(page.mediabox[2]), float(page.mediabox[3])
        font = pdf.make_indirect(pikepdf.Dictionary(Type=pikepdf.Name.Font, Subtype=pikepdf.Name.Type1,
                                                    BaseFont=pikepdf.Name.Helvetica))
        page.obj.Resources.Font = pikepdf.Dictionary(Fs=font)
        marks = f"BT /Fs 10 Tf {width / 2:.1f} {height / 2:.1f} Td (x) Tj ET BT /Fs 9 Tf {width / 2:.1f} 8 Td (Page 12 of 40) Tj ET"
        page.contents_add(pdf.make_stream(marks.encode()), prepend=False)
        pdf.save(stamped)
    facts = page_texts(stamped, PrepareSettings())
    assert facts[0].visible == 1, facts[0]
    assert _json(once_with_tesseract(tmp_path, [stamped], 'ocr_mode = "skip"\n') / "stamped")["pages"][0]["path"] == "model"


@pytest.mark.parametrize(
    ("visible", "invisible", "force", "skip", "redo"),
    [
        (500, 0, "model", "text", "text"),
        (0, 500, "model", "text", "model"),
        (500, 500, "model", "text", "text"),
        (0, 0, "model", "model", "model"),
        (MIN_TEXT_CHARS - 1, 0, "model", "model", "model"),
    ],
)
def test_which_path_a_page_takes_in_each_mode(visible, invisible, force, skip, redo):
    page = PageText(visible, invisible, 612, 792, "text")
    assert (page.path("force"), page.path("skip"), page.path("redo")) == (force, skip, redo)
