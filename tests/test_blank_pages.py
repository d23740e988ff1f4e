"""Duplex scans' blank backs: judged blank when read (Chandra 2's Blank-Page label; the tesseract
engine's ink measure), dropped from the Markdown, HTML and JSON pages with blank_pages = "drop",
kept in the searchable PDF unless drop_blank_pdf_pages (real tesseract, PDFium, pikepdf)."""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import img2pdf
import numpy as np
import pikepdf
import pypdfium2 as pdfium
from PIL import Image, ImageDraw, ImageFont, ImageOps

from chandrad.scan.blank import BLANK_INK, ink_share, judge_blank, model_says_blank
from tests.conftest import corpus_file, once_with_tesseract

FRONTS = ["linn.pdf", "c02-22.pdf", "francais.pdf"]


def blank_back(seed: int, size: tuple[int, int] = (1632, 2112)) -> Image.Image:
    """A duplex scan's empty back as a scanner makes it: grey paper with noise, dust, the front's
    text shining through (mirrored, faint) and the scanner's dark edge."""
    width, height = size
    rng = np.random.default_rng(seed)
    page = Image.fromarray(np.clip(rng.normal(236, 5, (height, width)), 0, 255).astype(np.uint8), "L")
    ghost = Image.new("L", size, 0)
    font = ImageFont.load_default(size=28)
    for row in range(30):
        ImageDraw.Draw(ghost).text((150, 200 + row * 55), "the front page's text, seen through", fill=255, font=font)
    page = Image.composite(Image.new("L", size, 212), page, ImageOps.mirror(ghost))
    draw = ImageDraw.Draw(page)
    for _ in range(40):
        x, y = int(rng.integers(0, width - 3)), int(rng.integers(0, height - 3))
        draw.rectangle((x, y, x + 2, y + 2), fill=int(rng.integers(40, 120)))
    draw.rectangle((0, 0, 40, height), fill=30)
    return page


def _front(name: str) -> Image.Image:
    return pdfium.PdfDocument(str(corpus_file(name)))[0].render(scale=192 / 72).to_pil().convert("L")


def _duplex_scan(path: Path) -> None:
    """Three fronts, each followed by its blank back, as one image PDF."""
    frames = []
    for index, name in enumerate(FRONTS):
        for image in (_front(name), blank_back(index)):
            buffer = io.BytesIO()
            image.save(buffer, "PNG", dpi=(192, 192))
            frames.append(buffer.getvalue())
    path.write_bytes(img2pdf.convert(frames))


def _once(folder: Path, source: Path, config: str) -> Path:
    return once_with_tesseract(folder, [source], config, formats="md,html,json,pdf") / source.stem


def test_blank_backs_are_dropped_from_markdown_html_and_json_but_kept_in_the_pdf(tmp_path):
    source = tmp_path / "duplex.pdf"
    _duplex_scan(source)
    folder = _once(tmp_path / "drop", source, 'blank_pages = "drop"\n')
    document = json.loads((folder / "duplex.json").read_text())
    assert document["num_pages"] == 6
    assert [page["page"] for page in document["pages"]] == [1, 3, 5]
    assert document["dropped_pages"] == [{"page": 2, "why": "blank"}, {"page": 4, "why": "blank"},
                                         {"page": 6, "why": "blank"}]
    assert all(not page["blank"]["blank"] and page["blank"]["by"] == "ink" for page in document["pages"])
    html = (folder / "duplex.html").read_text()
    assert [int(n) for n in __import__("re").findall(r'data-page="(\d+)"', html)] == [1, 3, 5]
    markdown = (folder / "duplex.md").read_text().lower()
    assert "tip-toeing" in markdown  # c02-22's front is there
    with pikepdf.open(folder / "duplex.pdf") as pdf:
        assert len(pdf.pages) == 6, "blank pages stay in the searchable PDF unless drop_blank_pdf_pages"


def test_drop_blank_pdf_pages_leaves_them_out_of_the_pdf_too(tmp_path):
    source = tmp_path / "duplex.pdf"
    _duplex_scan(source)
    folder = _once(tmp_path / "drop-pdf", source, 'blank_pages = "drop"\ndrop_blank_pdf_pages = true\n')
    with pikepdf.open(folder / "duplex.pdf") as pdf:
        assert len(pdf.pages) == 3
    assert json.loads((folder / "duplex.json").read_text())["pdf"]["dropped_pages"] == [2, 4, 6]
    text = subprocess.run(["pdftotext", str(folder / "duplex.pdf"), "-"], capture_output=True, text=True).stdout
    assert "tip-toeing" in text.lower()


def test_by_default_blank_backs_are_kept_and_marked(tmp_path):
    source = tmp_path / "duplex.pdf"
    _duplex_scan(source)
    document = json.loads((_once(tmp_path / "keep", source, "") / "duplex.json").read_text())
    assert [page["page"] for page in document["pages"]] == [1, 2, 3, 4, 5, 6]
    assert document["dropped_pages"] == []
    assert [page["blank"]["blank"] for page in document["pages"]] == [False, True] * 3
    backs = document["pages"][1::2]
    assert all(not page["orientation"]["turned"] for page in backs), "a blank back is never turned"


def test_the_ink_measure_tells_a_blank_back_from_one_line_of_text():
    back = blank_back(7)
    one_line = back.copy()
    ImageDraw.Draw(one_line).text((200, 300), "This is a multi page document. Page 1.", fill=20,
                                  font=ImageFont.load_default(size=32))
    assert ink_share(back) < BLANK_INK <= ink_share(one_line)
    sparse = pdfium.PdfDocument(str(corpus_file("multi-page-digital.pdf")))[0].render(scale=192 / 72).to_pil()
    assert not judge_blank("", ink_share(sparse), "tesseract").blank, "one line of text is not a blank page"
    blank = pdfium.PdfDocument(str(corpus_file("blank.pdf")))[0].render().to_pil()
    assert judge_blank("", ink_share(blank), "tesseract").blank


def test_chandra_says_blank_with_its_blank_page_label():
    """A named stand-in for Chandra 2's answer (the random-weight test model cannot give one): the
    model's label decides for the model's engines, whatever the ink says."""
    assert model_says_blank('<div data-bbox="0 0 1000 1000" data-label="Blank-Page"></div>')
    assert not model_says_blank('<div data-bbox="0 0 1000 1000" data-label="Blank-Page"></div>'
                                '<div data-bbox="10 10 900 80" data-label="Text"><p>Hi</p></div>')
    assert not model_says_blank("")
    text_page = _front("linn.pdf")
    blank_label = '<div data-bbox="0 0 1000 1000" data-label="Blank-Page"></div>'
    assert judge_blank(blank_label, ink_share(text_page), "vllm").blank
    assert not judge_blank('<div data-label="Text"><p>x</p></div>', ink_share(blank_back(1)), "vllm").blank
