"""The tesseract engine speaks Chandra's format: layout divs with 0–1000 bboxes that chandra parses."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from chandra.output import parse_chunks, parse_markdown
from pdf2image import convert_from_path

from chandrad.config import EngineSettings
from chandrad.engine import create_engine
from chandrad.engine.base import PageRequest
from chandrad.engine.tesseract import TesseractEngine, hocr_to_chandra_html
from chandrad.errors import ConfigError, PermanentError
from tests.conftest import corpus_file

HOCR = (
    "<div class='ocr_page' title='bbox 0 0 2000 1000'>\n"
    "<div class='ocr_carea' title='bbox 200 100 1800 300'><p class='ocr_par'>\n"
    "<span class='ocr_line' title='bbox 200 100 1800 150'>"
    "<span class='ocrx_word'>Hello</span> <span class='ocrx_word'>&amp;</span></span>\n"
    "<span class='ocr_line' title='bbox 200 160 1800 200'><span class='ocrx_word'>world</span></span>\n"
    "</p></div></div>"
)


def test_hocr_blocks_become_text_divs_with_normalised_bboxes():
    html = hocr_to_chandra_html(HOCR, width=2000, height=1000)
    assert html == '<div data-bbox="100 100 900 300" data-label="Text"><p>Hello &amp; world</p></div>'


def test_hocr_with_a_character_xml_does_not_allow_is_read_and_unreadable_hocr_is_a_clear_error():
    """tesseract's hOCR is read as XML: a control character in a word (not allowed in XML 1.0) is
    left out rather than losing the page; hOCR that is not XML at all fails the page with a reason."""
    html = hocr_to_chandra_html(HOCR.replace("Hello", "Hel\x0blo"), width=2000, height=1000)
    assert html == '<div data-bbox="100 100 900 300" data-label="Text"><p>Hello &amp; world</p></div>'
    with pytest.raises(PermanentError, match="hOCR could not be read"):
        hocr_to_chandra_html(HOCR.replace("</p>", ""), width=2000, height=1000)


def _two_paragraphs(first_line: str, second_line: str) -> str:
    line = "<span class='ocr_line' title='bbox 200 {} 1800 {}'>{}</span>"
    words = lambda text: " ".join(f"<span class='ocrx_word'>{w}</span>" for w in text.split())  # noqa: E731
    return (
        "<div class='ocr_page' title='bbox 0 0 2000 1000'>"
        "<div class='ocr_carea' title='bbox 200 100 1800 300'>"
        f"<p class='ocr_par'>{line.format(100, 150, words(first_line))}</p>"
        f"<p class='ocr_par'>{line.format(160, 200, words(second_line))}</p>"
        "</div></div>"
    )


def test_a_paragraph_tesseract_splits_inside_a_hyphenated_word_is_one_paragraph():
    """multi_column_miss.pdf: beside a drop cap tesseract ends one paragraph at "organi-" and starts
    the next at "sations"; a paragraph that ends with a letter and a hyphen, followed in its block by
    one that begins in lower case, is the same paragraph. One that begins in upper case, or follows
    a dash after a number, is not."""
    joined = hocr_to_chandra_html(_two_paragraphs("from non-governmental organi-", "sations (NGOs), and"), 2000, 1000)
    assert "<p>from non-governmental organi- sations (NGOs), and</p>" in joined
    apart = hocr_to_chandra_html(_two_paragraphs("the well-", "Known cases"), 2000, 1000)
    assert "<p>the well-</p><p>Known cases</p>" in apart
    after_a_number = hocr_to_chandra_html(_two_paragraphs("pages 12-", "and more"), 2000, 1000)
    assert "<p>pages 12-</p><p>and more</p>" in after_a_number


def test_a_drop_cap_does_not_make_its_line_in_the_text_layer_as_tall_as_itself():
    """multi_column_miss.pdf at 192 dpi: tesseract's line "Ores from non-governmental organi-" is 66 px
    tall because of its drop cap (the other words 17-21 px); a layer line that tall was joined by
    pdftotext to the side column's "Correspondence to:" ("organiCorrespondence"). The line's box in
    ``data-lines`` is its other words' box; the drop cap keeps its x-range."""
    hocr = (
        "<div class='ocr_page' title='bbox 0 0 2000 3000'>"
        "<div class='ocr_carea' title='bbox 444 1561 927 1635'><p class='ocr_par'>"
        "<span class='ocr_line' title='bbox 444 1565 926 1631; baseline 0 -27'>"
        "<span class='ocrx_word' title='bbox 444 1565 597 1631'>Ores</span> "
        "<span class='ocrx_word' title='bbox 608 1587 653 1604'>from</span> "
        "<span class='ocrx_word' title='bbox 664 1587 845 1608'>non-governmental</span> "
        "<span class='ocrx_word' title='bbox 856 1589 926 1606'>organi-</span></span>"
        "</p></div></div>"
    )
    html = hocr_to_chandra_html(hocr, 2000, 3000, word_boxes=True)
    assert 'data-lines="444 1587 926 1608 4 0 444 597 608 653 664 845 856 926"' in html
    level = hocr.replace("1565 597 1631", "1588 597 1606")  # the same line without a drop cap
    assert 'data-lines="444 1565 926 1631 4 0 ' in hocr_to_chandra_html(level, 2000, 3000, word_boxes=True)
    # A dot leader's dots are lower than the line's text, not its text taller than the line.
    leader = (
        "<div class='ocr_page' title='bbox 0 0 2000 3000'>"
        "<div class='ocr_carea' title='bbox 100 100 900 120'><p class='ocr_par'>"
        "<span class='ocr_line' title='bbox 100 100 900 120; baseline 0 -3'>"
        + "".join(f"<span class='ocrx_word' title='bbox {x} 114 {x + 4} 117'>.</span> " for x in range(300, 800, 50))
        + "<span class='ocrx_word' title='bbox 100 100 250 117'>Contents</span> "
        "<span class='ocrx_word' title='bbox 880 103 900 117'>5</span></span>"
        "</p></div></div>"
    )
    assert 'data-lines="100 100 900 120 12 0 ' in hocr_to_chandra_html(leader, 2000, 3000, word_boxes=True)


def _block(*lines: list[tuple[str, tuple[int, int, int, int]]]) -> str:
    spans = []
    for words in lines:
        x0, y0 = min(b[0] for _, b in words), min(b[1] for _, b in words)
        x1, y1 = max(b[2] for _, b in words), max(b[3] for _, b in words)
        inner = " ".join(f"<span class='ocrx_word' title='bbox {b[0]} {b[1]} {b[2]} {b[3]}'>{w}</span>" for w, b in words)
        spans.append(f"<span class='ocr_line' title='bbox {x0} {y0} {x1} {y1}'>{inner}</span>")
    return (
        "<div class='ocr_page' title='bbox 0 0 2112 1632'><div class='ocr_carea' title='bbox 0 0 2112 1632'>"
        f"<p class='ocr_par'>{''.join(spans)}</p></div></div>"
    )


def test_a_line_read_down_or_up_the_page_gives_its_words_spans_down_the_page_and_its_turn():
    """cardinal.pdf page 2 (a page lying sideways, read as it lies): tesseract's lines run down the
    page, each word below the one before. Such a line gives each word's y-range and, last, 270 (the
    clockwise turn that sets it level); a line whose words go up gives 90; a level line is as before.
    A line of one word goes with its block: a short word ("is", as wide as tall on end) too; a long
    word standing on end alone runs down; a long word lying down, or a short one alone, is level."""
    down = [("The", (1849, 222, 1868, 264)), ("LinnSequencer", (1844, 272, 1869, 433))]
    lone = [("machine", (1810, 300, 1836, 420))], [("is", (1780, 441, 1800, 456))]
    html = hocr_to_chandra_html(_block(down, *lone), 2112, 1632, word_boxes=True)
    assert 'data-lines="1844 222 1869 433 2 0 222 264 272 433 270,1810 300 1836 420 1 0 300 420 270,' in html
    assert ",1780 441 1800 456 1 0 441 456 270" in html
    assert "<p>The LinnSequencer machine is</p>" in html
    alone = hocr_to_chandra_html(_block([("CONFIDENTIAL", (40, 300, 70, 900))]), 2112, 1632, word_boxes=True)
    assert 'data-lines="40 300 70 900 1 0 300 900 270"' in alone
    lying = hocr_to_chandra_html(_block([("Total", (100, 100, 200, 130))]), 2112, 1632, word_boxes=True)
    assert 'data-lines="100 100 200 130 1 0 100 200"' in lying
    up = [("Total", (100, 900, 130, 1000)), ("sales", (100, 780, 130, 880))]
    assert 'data-lines="100 780 130 1000 2 0 900 1000 780 880 90"' in hocr_to_chandra_html(
        _block(up), 2112, 1632, word_boxes=True
    )
    level = [("Il", (100, 100, 110, 130))]  # taller than wide, but two letters: a level line
    assert 'data-lines="100 100 110 130 1 0 100 110"' in hocr_to_chandra_html(_block(level), 2112, 1632, word_boxes=True)


def test_an_empty_page_is_a_blank_page_block():
    assert 'data-label="Blank-Page"' in hocr_to_chandra_html("<html></html>", 100, 100)


async def test_tesseract_reads_a_corpus_page_into_parseable_chandra_html():
    engine = create_engine(EngineSettings(kind="tesseract"), Path("/nonexistent"))
    assert isinstance(engine, TesseractEngine)
    await engine.start()
    image = convert_from_path(corpus_file("linn.pdf"), dpi=150)[0]
    try:
        result = await engine.ocr(PageRequest("doc", 1, image))
    finally:
        await engine.aclose()
    assert result.latency_s > 0 and result.finish_reason == "stop"
    chunks = parse_chunks(result.html, image)
    assert chunks and all(chunk["label"] == "Text" for chunk in chunks)
    assert all(0 <= chunk["bbox"][0] < chunk["bbox"][2] <= image.width for chunk in chunks)
    assert "LinnSequencer" in parse_markdown(result.html)


def _tessdata() -> Path:
    listed = subprocess.run(["tesseract", "--list-langs"], capture_output=True, text=True, check=True).stdout
    return Path(re.search(r'"([^"]+)"', listed).group(1))


async def test_a_tesseract_that_cannot_write_hocr_or_lacks_the_language_is_refused_at_start(tmp_path, monkeypatch):
    """A tessdata holding the models but not configs/hocr makes tesseract print plain text (read as
    an empty page, every document would have come out blank), and a language that is not
    installed fails every page: the engine's start says which, and what to install."""
    models = tmp_path / "tessdata"
    models.mkdir()
    for name in ("eng.traineddata", "osd.traineddata"):
        shutil.copy(_tessdata() / name, models / name)
    monkeypatch.setenv("TESSDATA_PREFIX", str(models))
    with pytest.raises(ConfigError, match="no configs/hocr"):
        await TesseractEngine().start()
    monkeypatch.delenv("TESSDATA_PREFIX")
    with pytest.raises(ConfigError, match="cannot read pages in 'xyz'.*apt-get install tesseract-ocr-"):
        await TesseractEngine(languages="xyz").start()
    await TesseractEngine().start()  # the installed one passes


def test_auto_falls_back_to_tesseract_without_a_gpu(monkeypatch):
    monkeypatch.setattr("chandrad.engine.cuda_gpu_visible", lambda: False)
    assert create_engine(EngineSettings(kind="auto"), Path("/nonexistent")).name == "tesseract"
