"""The searchable PDF, proven with real tools: corpus pages prepared as the daemon prepares them, read
by the real tesseract engine, parsed by chandra, built into a PDF, then checked by qpdf, pdftoppm and
pdftotext.

The corpus subset (OCR dominates the run time, ~1 min on 2 cores): linn.pdf (two columns), skew.pdf,
ccitt.pdf (CCITT G4), signed.pdf (signed, owner-password encrypted), multi-page-digital.pdf (a text
layer of its own), cardinal.pdf (four /Rotate values), multi-page-images.tiff (three frames),
typewriter.png (1-bit palette PNG), simple-no-dpi.png; plus a four-orientation copy of linn made here
whose pages all display upright (content stored turned, /Rotate turning it back, one MediaBox offset).
"""

from __future__ import annotations

import asyncio
import collections
import re
import shutil
import subprocess
from dataclasses import dataclass
from html import unescape
from pathlib import Path

import numpy as np
import pikepdf
import pytest
from bs4 import BeautifulSoup
from chandra.output import parse_chunks, parse_markdown
from PIL import Image, ImageOps, ImageSequence

from chandrad.config import PrepareSettings
from chandrad.engine.base import PageRequest
from chandrad.engine.tesseract import TesseractEngine
from chandrad.pdf.build import PageCountMismatch, PdfReport, build_searchable_pdf, searchable_base
from chandrad.pdf.font import glyphless_font
from chandrad.pdf.layer import PageLayer, placed_lines
from chandrad.pdf.lines import block_tokens, line_turn, page_text_lines
from chandrad.prepare import prepare_document
from chandrad.testing import render_pages
from tests.conftest import corpus_file

PDFS = ["linn.pdf", "skew.pdf", "ccitt.pdf", "signed.pdf", "multi-page-digital.pdf", "cardinal.pdf"]
IMAGES = ["multi-page-images.tiff", "typewriter.png", "simple-no-dpi.png"]
ROTATED = "rotated-linn.pdf"
# cardinal.pdf's pages 2 and 4 are scans lying on their side (the file has no /Rotate at all):
# tesseract reads their lines running up or down the page, and the layer sets text in level lines.
SIDEWAYS = {("cardinal.pdf", 2), ("cardinal.pdf", 4)}


def _need(tool: str) -> None:
    if shutil.which(tool) is None:
        pytest.fail(f"{tool} is missing: scripts/setup.sh test installs it (qpdf, poppler-utils)")


@dataclass
class Read:
    """One corpus document as the daemon would have it at publish time."""

    source: Path  # what the pages were rendered from (prepared.source)
    original: Path
    doc_type: str
    images: list[Image.Image]
    htmls: list[str]
    layers: list[PageLayer]


def _rotated_linn(target: Path) -> Path:
    """linn's page four times, its content stored turned by 0/90/180/270° and /Rotate turning it back
    upright; a fifth page turned by 90° in a MediaBox that does not start at the origin."""
    with pikepdf.open(corpus_file("linn.pdf")) as source, pikepdf.new() as out:
        w, h = 612, 792
        turns = [
            (0, (1, 0, 0, 1, 0, 0), [0, 0, w, h]),
            (90, (0, 1, -1, 0, h, 0), [0, 0, h, w]),
            (180, (-1, 0, 0, -1, w, h), [0, 0, w, h]),
            (270, (0, -1, 1, 0, 0, w), [0, 0, h, w]),
            (90, (0, 1, -1, 0, h + 30, 40), [30, 40, 30 + h, 40 + w]),
        ]
        for rotate, matrix, box in turns:
            out.pages.append(source.pages[0])
            page = out.pages[-1]
            page.contents_add(out.make_stream(b"q %g %g %g %g %g %g cm\n" % matrix), prepend=True)
            page.contents_add(out.make_stream(b"\nQ\n"), prepend=False)
            page.MediaBox = box
            page.Rotate = rotate
        out.save(target)
    return target


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Read]:
    """Every document of the subset prepared, rendered and read by tesseract (two pages at a time)."""
    for tool in ("tesseract", "pdftoppm", "pdfinfo"):
        _need(tool)
    root = tmp_path_factory.mktemp("corpus")
    settings = PrepareSettings()
    files = {name: corpus_file(name) for name in PDFS + IMAGES}
    files[ROTATED] = _rotated_linn(root / ROTATED)

    async def read(engine: TesseractEngine, name: str, path: Path) -> Read:
        prepared = await asyncio.to_thread(prepare_document, path, root / f"work-{name}", "lossless", settings)
        pages = await asyncio.to_thread(lambda: list(render_pages(prepared, settings)))
        results = await asyncio.gather(*(engine.ocr(PageRequest(name, page.page_no, page.image)) for page in pages))
        images = [page.image for page in pages]
        htmls = [result.html for result in results]
        layers = []
        for image, html in zip(images, htmls, strict=True):
            chunks = parse_chunks(html, image)
            layers.append(PageLayer(image.width, image.height, chunks, page_text_lines(image, chunks, html)))
        base = searchable_base(path, prepared.source) if prepared.doc_type == "pdf" else path
        return Read(base, path, prepared.doc_type, images, htmls, layers)

    async def read_all() -> dict[str, Read]:
        engine = TesseractEngine(concurrency=2)
        await engine.start()
        reads = await asyncio.gather(*(read(engine, name, path) for name, path in files.items()))
        return dict(zip(files, reads, strict=True))

    return asyncio.run(read_all())


@pytest.fixture(scope="module")
def built(corpus: dict[str, Read], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, PdfReport]]:
    root = tmp_path_factory.mktemp("built")
    out = {}
    for name, read in corpus.items():
        target = root / f"{name}.pdf"
        report = build_searchable_pdf(
            read.source,
            read.doc_type,
            read.layers,
            target,
            pdfa=True,
            replace_text=False,  # type: ignore[arg-type]
        )
        out[name] = (target, report)
    return out


# -- helpers ----------------------------------------------------------------------------------------


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def _renders(pdf: Path, dpi: float, folder: Path, tag: str) -> list[np.ndarray]:
    folder.mkdir(parents=True, exist_ok=True)
    result = _run("pdftoppm", "-r", f"{dpi:g}", str(pdf), str(folder / tag))
    assert result.returncode == 0, result.stderr
    files = sorted(folder.glob(f"{tag}-*.ppm"), key=lambda p: int(p.stem.rsplit("-", 1)[1]))
    return [np.asarray(Image.open(f).convert("RGB"), dtype=np.int16) for f in files]


_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    return [w.lower() for w in _WORD.findall(text)]


def _markdown_words(html: str) -> list[str]:
    markdown = re.sub(r"!\[[^\]]*\]\([^)]*\)", " ", parse_markdown(html))  # image links are no page text
    return _words(unescape(markdown))


def _recall(expected: list[str], found: list[str]) -> float:
    """Order-insensitive recall: the share of expected words found (with multiplicity)."""
    pool: dict[str, int] = {}
    for word in found:
        pool[word] = pool.get(word, 0) + 1
    hits = 0
    for word in expected:
        if pool.get(word, 0) > 0:
            pool[word] -= 1
            hits += 1
    return hits / len(expected) if expected else 1.0


@dataclass
class BoxWord:
    text: str
    x0: float
    y0: float
    x1: float
    y1: float


def _bbox_words(pdf: Path, page: int) -> tuple[float, float, list[BoxWord]]:
    """pdftotext -bbox's words of one page, in points of the displayed page, and that page's size
    (pdftotext gives the MediaBox's unturned size but the words' places on the turned page)."""
    result = _run("pdftotext", "-bbox", "-f", str(page), "-l", str(page), str(pdf), "-")
    assert result.returncode == 0, result.stderr
    size = re.search(r'<page width="([\d.]+)" height="([\d.]+)"', result.stdout)
    assert size is not None
    with pikepdf.open(pdf) as opened:
        turned = int(opened.pages[page - 1].obj.get("/Rotate", 0)) % 180 == 90
    width, height = float(size.group(1)), float(size.group(2))
    if turned:
        width, height = height, width
    words = [
        BoxWord(unescape(m.group(5)), float(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4)))
        for m in re.finditer(
            r'<word xMin="([-\d.]+)" yMin="([-\d.]+)" xMax="([-\d.]+)" yMax="([-\d.]+)">(.*?)</word>', result.stdout
        )
    ]
    return width, height, words


def _pixels(word: BoxWord, width_pt: float, height_pt: float, layer: PageLayer) -> tuple[float, ...]:
    sx, sy = layer.width / width_pt, layer.height / height_pt
    return word.x0 * sx, word.y0 * sy, word.x1 * sx, word.y1 * sy


def _engine_boxes(layer: PageLayer) -> list[tuple[str, tuple[float, float, float, float]]]:
    """What the PDF places for each word, from the engine's own boxes (the layer was built from them)."""
    return [(w, line.word_box(a, b)) for line in placed_lines(layer) for w, a, b in line.words]


# -- every document --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*PDFS, ROTATED])
def test_a_pdf_keeps_its_pages_renders_the_same_and_is_searchable(name, corpus, built, tmp_path):
    """qpdf --check is clean, the page count is the input's, every page renders as the input's
    (pdftoppm at 72 dpi, mean absolute difference < 0.5/255), pdftotext finds ≥ 95 % of the
    Markdown's words on pages given a layer, and the size stays within input + 10 % + 20 KB a page."""
    _need("qpdf")
    read, (pdf, report) = corpus[name], built[name]
    check = _run("qpdf", "--check", str(pdf))
    assert check.returncode == 0, check.stdout + check.stderr
    with pikepdf.open(read.source, password="") as source, pikepdf.open(pdf) as out:
        assert len(out.pages) == len(source.pages) == len(read.layers)
    before = _renders(read.source, 72, tmp_path, "in")
    after = _renders(pdf, 72, tmp_path, "out")
    assert len(before) == len(after)
    for number, (a, b) in enumerate(zip(before, after, strict=True), start=1):
        assert a.shape == b.shape, f"page {number}"
        assert np.abs(a - b).mean() < 0.5, f"page {number} renders differently"
    for number in report.text_pages:
        text = _run("pdftotext", "-f", str(number), "-l", str(number), str(pdf), "-").stdout
        expected = _markdown_words(read.htmls[number - 1])
        assert _recall(expected, _words(text)) >= 0.95, f"page {number}"
    pages = len(read.layers)
    assert pdf.stat().st_size <= read.source.stat().st_size * 1.1 + 20_000 * pages


@pytest.mark.parametrize("name", IMAGES)
def test_an_image_becomes_pages_that_render_as_its_frames_and_are_searchable(name, corpus, built, tmp_path):
    """One page per frame at the frame's own DPI (300 without one), its image the frame's very pixels
    (pdftoppm itself resamples an image drawn 1:1 by ~3/255, so the pixels are compared where they
    are stored); pdftotext finds ≥ 95 % of the Markdown's words; qpdf --check is clean; the size
    bound holds."""
    _need("qpdf")
    read, (pdf, report) = corpus[name], built[name]
    assert _run("qpdf", "--check", str(pdf)).returncode == 0
    with Image.open(read.original) as image:
        frames = [ImageOps.exif_transpose(f.copy()).convert("RGB") for f in ImageSequence.Iterator(image)]
        dpi = image.info.get("dpi", (300, 300))[0] or 300
    with pikepdf.open(pdf) as out:
        assert len(out.pages) == len(frames) == len(read.layers)
        assert float(out.pages[0].mediabox[2]) == pytest.approx(frames[0].width * 72 / dpi, abs=0.01)
    with pikepdf.open(pdf) as out:
        for number, (frame, page) in enumerate(zip(frames, out.pages, strict=True), start=1):
            (image,) = [pikepdf.PdfImage(x) for x in page.images.values()]
            embedded = np.asarray(image.as_pil_image().convert("RGB"), dtype=np.int16)
            assert (embedded == np.asarray(frame, dtype=np.int16)).all(), f"page {number}: pixels changed"
    rendered = _renders(pdf, dpi, tmp_path, "out")
    for number, (frame, page) in enumerate(zip(frames, rendered, strict=True), start=1):
        assert page.shape[:2] == (frame.height, frame.width), f"page {number}"
    for number in report.text_pages:
        text = _run("pdftotext", "-f", str(number), "-l", str(number), str(pdf), "-").stdout
        assert _recall(_markdown_words(read.htmls[number - 1]), _words(text)) >= 0.95, f"page {number}"
    assert pdf.stat().st_size <= read.original.stat().st_size * 1.1 + 20_000 * len(frames)


def test_a_multi_frame_tiff_gives_a_multi_page_pdf(built):
    pdf, report = built["multi-page-images.tiff"]
    with pikepdf.open(pdf) as out:
        assert len(out.pages) == 3
    assert report.pages == 3 and report.text_pages == [1, 2, 3]


@pytest.mark.parametrize("name", [*PDFS, ROTATED, *IMAGES])
def test_word_boxes_lie_on_the_page_and_inside_their_block(name, corpus, built):
    """Each word pdftotext -bbox reports on a page given a layer lies on the page and inside one of
    the page's layout blocks (2 px of slack: block boxes are stored in 0–1000 units)."""
    read, (pdf, report) = corpus[name], built[name]
    checked = 0
    for number in report.text_pages:
        layer = read.layers[number - 1]
        width_pt, height_pt, words = _bbox_words(pdf, number)
        boxes = [chunk["bbox"] for chunk in layer.chunks if block_tokens(chunk)]
        for word in words:
            x0, y0, x1, y1 = _pixels(word, width_pt, height_pt, layer)
            assert -1 <= x0 < x1 <= layer.width + 1 and -1 <= y0 < y1 <= layer.height + 1, (number, word)
            assert any(b[0] - 2 <= x0 and x1 <= b[2] + 2 and b[1] - 2 <= y0 and y1 <= b[3] + 2 for b in boxes), (
                number,
                word,
            )
            checked += 1
    assert checked > 0 or not report.text_pages  # signed.pdf, multi-page-digital.pdf keep their own text


# -- /Rotate, offsets, orientation ----------------------------------------------------------------------


def _placed_on_engine_words(pdf: Path, number: int, layer: PageLayer) -> tuple[float, float]:
    """(share of pdftotext's words whose centre lies in the engine's box for a word of that text,
    share of words of 4+ letters whose box is wider than tall: text runs upright)."""
    width_pt, height_pt, words = _bbox_words(pdf, number)
    engine: dict[str, list[tuple[float, float, float, float]]] = {}
    for text, box in _engine_boxes(layer):
        engine.setdefault(text, []).append(box)
    hits = upright = long_words = 0
    for word in words:
        x0, y0, x1, y1 = _pixels(word, width_pt, height_pt, layer)
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        hits += any(b[0] - 1 <= cx <= b[2] + 1 and b[1] - 1 <= cy <= b[3] + 1 for b in engine.get(word.text, []))
        if len(word.text) >= 4:
            long_words += 1
            upright += (x1 - x0) > (y1 - y0)
    return hits / max(len(words), 1), upright / max(long_words, 1)


def test_rotated_pages_get_upright_text_on_their_words(corpus, built):
    """Pages stored turned by 0/90/180/270° (one with a MediaBox off the origin) and shown upright by
    /Rotate: tesseract reads each displayed page the same, and on every page the text layer's words
    run upright on the displayed page and sit on the words tesseract found there."""
    read, (pdf, report) = corpus[ROTATED], built[ROTATED]
    assert report.text_pages == [1, 2, 3, 4, 5]
    for number, layer in enumerate(read.layers, start=1):
        assert "LinnSequencer" in parse_markdown(read.htmls[number - 1]), f"page {number}"
        placed, upright = _placed_on_engine_words(pdf, number, layer)
        assert placed >= 0.95 and upright >= 0.95, (number, placed, upright)


def test_cardinal_text_is_placed_on_the_words_of_its_upright_and_upside_down_pages(corpus, built):
    """cardinal.pdf's four orientations (as scanned: the file sets no /Rotate): every page gets a
    layer; on the pages whose lines run across the page (upright, upside down) the words sit where
    tesseract saw them."""
    read, (pdf, report) = corpus["cardinal.pdf"], built["cardinal.pdf"]
    assert report.text_pages == [1, 2, 3, 4]
    for number, layer in enumerate(read.layers, start=1):
        if ("cardinal.pdf", number) in SIDEWAYS:
            continue
        placed, upright = _placed_on_engine_words(pdf, number, layer)
        assert placed >= 0.9 and upright >= 0.9, (number, placed, upright)


def test_sideways_lines_get_text_that_follows_them(corpus, built):
    """cardinal.pdf pages 2 and 4 lie sideways and are read as they lie (no orientation step here):
    tesseract reads their lines down the page (page 2's rightly; page 4's text runs up, and
    tesseract reads it downwards all the same, as garbage). The layer follows tesseract's lines:
    pdftotext finds ≥ 95 % of the Markdown's words, ≥ 90 % of them sit on the words tesseract
    found and run down the page (set level, pdftotext joined a line's words letter by letter across
    lines: "patolIfgeixhnr’.s"), on lines turned 270 degrees."""
    read, (pdf, _) = corpus["cardinal.pdf"], built["cardinal.pdf"]
    for _, number in sorted(SIDEWAYS):
        layer = read.layers[number - 1]
        text = _run("pdftotext", "-f", str(number), "-l", str(number), str(pdf), "-").stdout
        assert _recall(_markdown_words(read.htmls[number - 1]), _words(text)) >= 0.95, number
        placed, upright = _placed_on_engine_words(pdf, number, layer)
        assert placed >= 0.9 and upright <= 0.1, (number, placed, upright)
        turns = [line_turn(line) for block in layer.lines or [] for line in block for _ in range(line[4])]
        assert turns.count(270) >= 0.9 * len(turns), (number, collections.Counter(turns))


@pytest.mark.parametrize("turn", [90, 270], ids=["up", "down"])
def test_a_line_running_up_or_down_the_margin_is_found_where_it_is_printed(turn, tmp_path):
    """A margin note running up (or down) a 200 × 400 pt page, given as the tesseract engine gives
    such a line (its words' spans down the page, its turn last): pdftotext reads its words in order,
    each where the engine saw it and taller than wide."""
    spans = {"going": (560, 690), "up": (500, 540), "the": (420, 480), "margin": (250, 400)}
    if turn == 270:  # the same words printed downwards
        spans = {w: (800 - b, 800 - a) for w, (a, b) in spans.items()}
    ys = " ".join(f"{a} {b}" for a, b in spans.values())
    html = f'<div data-bbox="125 125 200 875" data-label="Text" data-lines="50 100 80 700 4 0 {ys} {turn}"><p>{" ".join(spans)}</p></div>'
    image = Image.new("L", (400, 800), 255)
    chunks = parse_chunks(html, image)
    layer = PageLayer(400, 800, chunks, page_text_lines(image, chunks, html))
    source = tmp_path / "page.pdf"
    with pikepdf.new() as pdf:
        pdf.add_blank_page(page_size=(200, 400))
        pdf.save(source)
    report = build_searchable_pdf(source, "pdf", [layer], tmp_path / "out.pdf", pdfa=False, replace_text=False)
    assert report.words == 4
    assert _words(_run("pdftotext", str(tmp_path / "out.pdf"), "-").stdout) == list(spans)
    _, _, words = _bbox_words(tmp_path / "out.pdf", 1)
    for word in words:
        a, b = spans[word.text]
        assert 24 <= word.x0 < word.x1 <= 41, word
        assert abs(word.y0 - a / 2) <= 3 and abs(word.y1 - b / 2) <= 3, word
        assert word.y1 - word.y0 > word.x1 - word.x0, word


@pytest.mark.parametrize("turn", [0, 270], ids=["level", "down"])
def test_a_column_whose_lines_reach_down_unequally_reads_as_one_block_in_order(turn, tmp_path):
    """Four lines of one column, the third without descenders (its box a fifth shorter), given as
    the tesseract engine gives them, level or running down the page: pdftotext reads them as one
    block of equal-sized words, in order, and joins the word hyphenated across the line end. (Each
    line drawn at its own box's size made this column three blocks; on bench/peers.py's page lying
    sideways, pdftotext put such blocks of a column out of order and a word's halves apart.)"""
    lines = ["words printed down the", "page in one column interna-", "tional and set in lines", "of one size of type"]
    # (top, bottom) across each line: the third line's box ends at its baseline
    across = [(100, 130), (140, 170), (180, 204), (220, 250)]
    entries, along_end = [], 0
    for text, (top, bottom) in zip(lines, across, strict=True):
        spans, position = [], 100
        for word in text.split():
            spans.append((position, position + 12 * len(word)))
            position += 12 * (len(word) + 1)
        along_end = max(along_end, position)
        words = " ".join(f"{a} {b}" for a, b in spans)
        if turn == 0:
            entries.append(f"100 {top} {spans[-1][1]} {bottom} {len(spans)} 0 {words}")
        else:  # a line running down: its letters' tops face right, so the next line lies to its left
            entries.append(f"{400 - bottom} 100 {400 - top} {spans[-1][1]} {len(spans)} 0 {words} 270")
    width, height = (800, 400) if turn == 0 else (400, 800)
    if turn == 0:
        x0, y0, x1, y1 = 100, 100, along_end, 250
    else:
        x0, y0, x1, y1 = 150, 100, 300, along_end
    box = f"{x0 * 1000 // width} {y0 * 1000 // height} {-(-x1 * 1000 // width)} {-(-y1 * 1000 // height)}"
    html = f'<div data-bbox="{box}" data-label="Text" data-lines="{",".join(entries)}"><p>{" ".join(lines)}</p></div>'
    image = Image.new("L", (width, height), 255)
    chunks = parse_chunks(html, image)
    layer = PageLayer(width, height, chunks, page_text_lines(image, chunks, html))
    assert [line.turn for line in placed_lines(layer)] == [turn] * 4
    source = tmp_path / "page.pdf"
    with pikepdf.new() as pdf:
        pdf.add_blank_page(page_size=(width / 2, height / 2))
        pdf.save(source)
    report = build_searchable_pdf(source, "pdf", [layer], tmp_path / "out.pdf", pdfa=False, replace_text=False)
    assert report.words == sum(len(text.split()) for text in lines)
    text = _run("pdftotext", str(tmp_path / "out.pdf"), "-").stdout
    expected = " ".join(lines).replace("interna- tional", "international")
    assert _words(text) == _words(expected), text
    layout = _run("pdftotext", "-bbox-layout", str(tmp_path / "out.pdf"), "-").stdout
    assert layout.count("<block") == 1, layout
    _, _, words = _bbox_words(tmp_path / "out.pdf", 1)
    sizes = {round(word.y1 - word.y0 if turn == 0 else word.x1 - word.x0, 1) for word in words}
    assert len(sizes) == 1, sizes


@pytest.mark.parametrize(
    "content",
    [
        "<p>Hello &amp; caf&eacute; &nbsp;world</p><p>two\nlines</p>",
        "<table><tr><th>Item</th><td colspan=2>two words</td></tr></table>",
        "<h2 class='t'>Title</h2><ul><li>one</li><li>two<br/>three</li></ul>",
        "<math>\\frac{a}{b}</math>",
        "<p>x<img src='a.png' alt='a picture'>y</p>",
        "<p>a<!-- a comment -->b</p>",
        "<p>x<script>var hidden</script>y</p>",
        "<p title='a>b'>t</p>",
        "<p>1 < 2 and 3 > 2</p>",
        "plain words",
    ],
)
def test_a_blocks_words_are_what_an_html_parser_finds_in_its_text(content):
    """The words a block gives the text layer are those of BeautifulSoup's text of its markup, images
    left out, whether or not the markup is simple enough to be read without building a tree."""
    soup = BeautifulSoup(content, "html.parser")
    for image in soup.find_all("img"):
        image.decompose()
    assert block_tokens({"label": "Text", "content": content}) == soup.get_text(" ").split()


# -- PDF/A ---------------------------------------------------------------------------------------------


def _fonts(pdf: pikepdf.Pdf) -> list[pikepdf.Dictionary]:
    found = []
    for page in pdf.pages:
        fonts = page.obj.get("/Resources", pikepdf.Dictionary()).get("/Font", pikepdf.Dictionary())
        found.extend(fonts.values())
    return found


@pytest.mark.parametrize("name", ["linn.pdf", "typewriter.png"])
def test_pdfa_properties_one_by_one(name, built):
    """No PDF/A validator can be installed here (veraPDF is in no registry this project reaches), so
    the PDF/A-2b properties are checked one by one: XMP pdfaid part 2, conformance B; a GTS_PDFA1
    output intent with an sRGB display profile (ICC v4 or lower); every font embedded; no encryption."""
    pdf_path, report = built[name]
    assert report.pdfa and not report.pdfa_blockers
    with pikepdf.open(pdf_path) as pdf:
        assert not pdf.is_encrypted
        assert "/Encrypt" not in pdf.trailer
        meta = pdf.open_metadata()
        assert meta["pdfaid:part"] == "2" and meta["pdfaid:conformance"] == "B"
        assert pdf.Root.Metadata.get("/Filter") is None  # readable as XML without decoding
        (intent,) = list(pdf.Root.OutputIntents)
        assert intent.S == pikepdf.Name.GTS_PDFA1
        profile = intent.DestOutputProfile.read_bytes()
        assert intent.DestOutputProfile.N == 3
        assert profile[12:16] == b"mntr" and profile[16:20] == b"RGB " and profile[36:40] == b"acsp"
        assert profile[8] <= 4  # ICC major version
        fonts = _fonts(pdf)
        assert fonts
        for font in fonts:
            for descendant in font.get("/DescendantFonts", [font]):
                descriptor = descendant.FontDescriptor
                assert any(key in descriptor for key in ("/FontFile", "/FontFile2", "/FontFile3"))
                assert descendant.get("/CIDToGIDMap") is not None  # CIDFontType2 needs one (6.2.11.3.2)
        assert pdf.pdf_version <= "1.7"
    assert "File is not encrypted" in _run("qpdf", "--show-encryption", str(pdf_path)).stdout


def test_the_glyphless_font_loads_in_freetype():
    """The embedded font program is a font FreeType (poppler's and Pillow's) reads: 0.5 em per glyph."""
    from PIL import ImageFont

    font = ImageFont.truetype(__import__("io").BytesIO(glyphless_font()), 100)
    assert font.getlength("Hello") == 250
    assert font.getname() == ("ChandradInvisible", "Regular")


def test_without_pdfa_the_pdf_is_plain(corpus, tmp_path):
    read = corpus["linn.pdf"]
    out = tmp_path / "plain.pdf"
    report = build_searchable_pdf(read.source, "pdf", read.layers, out, pdfa=False, replace_text=False)
    assert not report.pdfa
    with pikepdf.open(out) as pdf:
        assert "/OutputIntents" not in pdf.Root
        assert "pdfaid:part" not in pdf.open_metadata()
    assert report.text_pages == [1]


def test_what_pdfa_forbids_in_the_original_is_reported_not_claimed(tmp_path):
    """A page painting in DeviceCMYK with no CMYK output intent cannot be PDF/A without changing it:
    the file is written without the PDF/A identification and the report says why."""
    source = tmp_path / "cmyk.pdf"
    with pikepdf.new() as pdf:
        page = pdf.add_blank_page(page_size=(200, 200))
        page.obj.Contents = pdf.make_stream(b"0 0 0 1 k 10 10 50 50 re f")
        pdf.save(source)
    layer = PageLayer(200, 200, [{"label": "Text", "bbox": [10, 10, 190, 40], "content": "<p>cyan key</p>"}])
    report = build_searchable_pdf(source, "pdf", [layer], tmp_path / "out.pdf", pdfa=True, replace_text=False)
    assert not report.pdfa and any("DeviceCMYK" in reason for reason in report.pdfa_blockers)
    with pikepdf.open(tmp_path / "out.pdf") as pdf:
        assert "pdfaid:part" not in pdf.open_metadata()


def _with(tmp_path, change) -> Path:
    """A one-page PDF that the change makes un-PDF/A-able (or not)."""
    source = tmp_path / "source.pdf"
    with pikepdf.new() as pdf:
        page = pdf.add_blank_page(page_size=(200, 200))
        change(pdf, page)
        pdf.save(source)
    return source


def _annot(pdf, page, **keys):
    page.obj.Annots = pdf.make_indirect(pikepdf.Array([pdf.make_indirect(pikepdf.Dictionary(
        Type=pikepdf.Name.Annot, Rect=[10, 10, 50, 50], **keys))]))


def _js(pdf):
    return pikepdf.Dictionary(S=pikepdf.Name.JavaScript, JS=pikepdf.String("app.alert(1)"))


BLOCKERS = {
    "an open trigger's JavaScript": (lambda pdf, page: setattr(pdf.Root, "AA", pikepdf.Dictionary(WC=_js(pdf))),
                                     "runs an action when opened"),
    "a page's trigger": (lambda pdf, page: setattr(page.obj, "AA", pikepdf.Dictionary(O=_js(pdf))),
                         "page 1 runs an action"),
    "an action's next action": (lambda pdf, page: setattr(pdf.Root, "OpenAction", pikepdf.Dictionary(
        S=pikepdf.Name.GoTo, D=[page.obj, pikepdf.Name.Fit], Next=_js(pdf))), "runs an action when opened"),
    "a link that launches": (lambda pdf, page: _annot(pdf, page, Subtype=pikepdf.Name.Link, F=4, A=pikepdf.Dictionary(
        S=pikepdf.Name.Launch, F=pikepdf.String("calc.exe"))), "annotation that runs an action"),
    "a link that does not print": (lambda pdf, page: _annot(pdf, page, Subtype=pikepdf.Name.Link, F=0),
                                   "annotation that does not print"),
    "a print output intent": (lambda pdf, page: setattr(pdf.Root, "OutputIntents", pikepdf.Array([pikepdf.Dictionary(
        Type=pikepdf.Name.OutputIntent, S=pikepdf.Name.GTS_PDFX, OutputConditionIdentifier="FOGRA39",
        DestOutputProfile=pdf.make_stream(b"\0" * 128, N=4))])), "output intent of its own"),
}


@pytest.mark.parametrize("kind", list(BLOCKERS))
def test_what_pdfa_forbids_is_looked_for_everywhere_it_hides(tmp_path, kind):
    change, reason = BLOCKERS[kind]
    source = _with(tmp_path, change)
    layer = PageLayer(200, 200, [{"label": "Text", "bbox": [10, 10, 190, 40], "content": "<p>words</p>"}])
    report = build_searchable_pdf(source, "pdf", [layer], tmp_path / "out.pdf", pdfa=True, replace_text=False)
    assert not report.pdfa and any(reason in blocker for blocker in report.pdfa_blockers), report.pdfa_blockers


def test_a_printable_link_keeps_pdfa(tmp_path):
    source = _with(tmp_path, lambda pdf, page: _annot(pdf, page, Subtype=pikepdf.Name.Link, F=4, A=pikepdf.Dictionary(
        S=pikepdf.Name.URI, URI=pikepdf.String("https://example.org"))))
    layer = PageLayer(200, 200, [{"label": "Text", "bbox": [10, 10, 190, 40], "content": "<p>words</p>"}])
    report = build_searchable_pdf(source, "pdf", [layer], tmp_path / "out.pdf", pdfa=True, replace_text=False)
    assert report.pdfa and not report.pdfa_blockers


# -- inputs it cannot carry as they are ------------------------------------------------------------------


def test_a_signed_encrypted_pdf_keeps_its_pages_loses_its_signature_and_its_encryption(corpus, built):
    _read, (pdf, report) = corpus["signed.pdf"], built["signed.pdf"]
    assert report.signature_removed and report.decrypted
    with pikepdf.open(corpus_file("signed.pdf")) as original:
        assert original.is_encrypted
    with pikepdf.open(pdf) as out:
        assert not out.is_encrypted and len(out.pages) == 1
        fields = out.Root.get("/AcroForm", pikepdf.Dictionary()).get("/Fields", [])
        assert all(not (f.get("/FT") == pikepdf.Name.Sig and "/V" in f) for f in fields)
    assert report.as_json()["signature_removed"] is True


def test_a_pdf_with_its_own_text_keeps_it_and_gets_no_second_layer(corpus, built):
    read, (pdf, report) = corpus["multi-page-digital.pdf"], built["multi-page-digital.pdf"]
    assert report.kept_text_pages == [1, 2, 3] and report.text_pages == []
    assert _run("pdftotext", str(pdf), "-").stdout == _run("pdftotext", str(read.source), "-").stdout


def test_another_ocr_layer_is_kept_unless_replace_text_then_replaced_once(corpus, built, tmp_path):
    """An invisible text layer (ours, from a first pass) is kept as it is; with replace_text it is
    replaced by the new one: the text is there once, not twice."""
    read, (first, _) = corpus["linn.pdf"], built["linn.pdf"]
    once = _words(_run("pdftotext", str(first), "-").stdout)
    kept = build_searchable_pdf(first, "pdf", read.layers, tmp_path / "kept.pdf", pdfa=True, replace_text=False)
    assert kept.kept_text_pages == [1] and kept.text_pages == []
    redone = build_searchable_pdf(first, "pdf", read.layers, tmp_path / "redo.pdf", pdfa=True, replace_text=True)
    assert redone.replaced_text_pages == [1] and redone.text_pages == [1]
    assert len(_words(_run("pdftotext", str(tmp_path / "redo.pdf"), "-").stdout)) == len(once)


def test_a_gap_page_gets_no_text(corpus, tmp_path):
    read = corpus["cardinal.pdf"]
    layers = [*read.layers]
    layers[1] = PageLayer(layers[1].width, layers[1].height, [], None, error="the engine gave up")
    report = build_searchable_pdf(read.source, "pdf", layers, tmp_path / "gap.pdf", pdfa=True, replace_text=False)
    assert report.gap_pages == [2] and report.text_pages == [1, 3, 4]
    assert _run("pdftotext", "-f", "2", "-l", "2", str(tmp_path / "gap.pdf"), "-").stdout.strip() == ""


def test_page_results_that_do_not_match_the_pages_are_refused(corpus, tmp_path):
    read = corpus["linn.pdf"]
    with pytest.raises(PageCountMismatch):
        build_searchable_pdf(read.source, "pdf", read.layers * 2, tmp_path / "x.pdf", pdfa=True, replace_text=False)


# -- page_text_lines ---------------------------------------------------------------------------------------


def test_tesseract_boxes_are_taken_as_they_are(corpus):
    """With the tesseract engine's data-lines, each block's lines are tesseract's, word for word."""
    read = corpus["linn.pdf"]
    layer = read.layers[0]
    assert layer.lines is not None
    tokens = sum(len(block_tokens(chunk)) for chunk in layer.chunks)
    assert sum(line[4] for block in layer.lines for line in block) == tokens
    assert all(len(line) == 6 + 2 * line[4] for block in layer.lines for line in block)


def test_segmented_words_land_in_tesseract_boxes(corpus):
    """Without the engine's boxes (as with Chandra), the block's pixels are segmented and the words
    aligned: on linn.pdf ≥ 90 % of words are placed inside the box tesseract gives that word."""
    read = corpus["linn.pdf"]
    image, layer = read.images[0], read.layers[0]
    truth = _engine_boxes(layer)
    segmented = PageLayer(layer.width, layer.height, layer.chunks, page_text_lines(image, layer.chunks))
    placed = _engine_boxes(segmented)
    assert [w for w, _ in placed] == [w for w, _ in truth]
    inside = sum(
        t[0] <= (p[0] + p[2]) / 2 <= t[2] and t[1] <= (p[1] + p[3]) / 2 <= t[3]
        for (_, p), (_, t) in zip(placed, truth, strict=True)
    )
    assert inside / len(truth) >= 0.9


# -- image inputs kept as they are (img2pdf) ---------------------------------------------------------------


def _fax_scan() -> Image.Image:
    """ccitt.pdf's page, a 2550 × 3300 CCITT G4 fax image, as the bilevel frame a scanner writes."""
    with pikepdf.open(corpus_file("ccitt.pdf")) as source:
        (raw,) = source.pages[0].get_images().values()
        return pikepdf.PdfImage(raw).as_pil_image().convert("1")


def _one_text_block(width: int, height: int) -> PageLayer:
    return PageLayer(width, height, [{"label": "Text", "bbox": [100, 100, 900, 140], "content": "<p>fax page</p>"}])


def _frame_pixels(path: Path) -> list[np.ndarray]:
    with Image.open(path) as opened:
        return [np.asarray(frame.convert("L")) for frame in ImageSequence.Iterator(opened)]


@pytest.mark.parametrize("frames", [1, 3], ids=["big-scan", "multi-page"])
def test_a_g4_tiff_keeps_its_fax_data_and_renders_pixel_for_pixel(frames, tmp_path):
    """A G4 TIFF's frames are embedded as their own CCITT data (they used to be decoded and stored
    as Flate, several times the scan's size): the PDF is at most 1.1× the TIFF plus the text layer,
    each page's image is the frame's very pixels, and pdftoppm renders the page as it renders the
    same image in ccitt.pdf."""
    _need("pdftoppm")
    scan = _fax_scan()
    pages = [scan, scan.rotate(90, expand=True), scan.crop((0, 0, 2550, 1650))][:frames]
    tiff = tmp_path / "scan.tiff"
    pages[0].save(tiff, compression="group4", dpi=(300, 300), save_all=True, append_images=pages[1:])
    out = tmp_path / "scan.pdf"
    report = build_searchable_pdf(
        tiff, "image", [_one_text_block(*page.size) for page in pages], out, pdfa=True, replace_text=False
    )
    assert report.text_pages == list(range(1, frames + 1)) and report.pdfa
    text_layer_and_pdfa = 20_000 * frames  # font, ICC profile, XMP, the words (~8 kB measured)
    assert out.stat().st_size <= tiff.stat().st_size * 1.1 + text_layer_and_pdfa, (out.stat().st_size, tiff.stat())
    expected = _frame_pixels(tiff)
    with pikepdf.open(out) as pdf:
        for number, (page, pixels) in enumerate(zip(pdf.pages, expected, strict=True), start=1):
            (raw,) = page.get_images().values()
            filters = pikepdf.PdfImage(raw).filters
            assert filters == ["/CCITTFaxDecode"], f"page {number} was re-encoded ({filters})"
            embedded = np.asarray(pikepdf.PdfImage(raw).as_pil_image().convert("L"))
            assert (embedded == pixels).all(), f"page {number}: pixels changed"
    # No renderer draws a 1:1 bilevel image pixel for pixel (pdftoppm differs from ccitt.pdf's own
    # image in ~2 % of pixels): the scan's page renders exactly as ccitt.pdf's page does, and each
    # other page differs from its frame no more than that.
    rendered = _renders(out, 300, tmp_path, "page")
    (reference,) = _renders(corpus_file("ccitt.pdf"), 300, tmp_path, "ccitt")
    assert (rendered[0] == reference).all(), "the scan's page renders differently from ccitt.pdf's"
    renderers_own = (rendered[0][:, :, 0] != expected[0]).mean()
    for number, (page, pixels) in enumerate(zip(rendered, expected, strict=True), start=1):
        assert page.shape[:2] == pixels.shape, f"page {number}"
        assert (page[:, :, 0] != pixels).mean() <= renderers_own + 0.005, f"page {number}: the render differs"


def test_a_png_with_alpha_keeps_it_as_a_soft_mask(tmp_path):
    """The colour as stored, and the alpha channel as the image's /SMask, each exactly (the alpha
    used to be dropped: a logo on transparency became a logo on black or white)."""
    with Image.open(corpus_file("simple-no-dpi.png")) as opened:
        colour = opened.convert("RGB")
    alpha = Image.linear_gradient("L").resize(colour.size)
    rgba = colour.copy()
    rgba.putalpha(alpha)
    source = tmp_path / "logo.png"
    rgba.save(source)
    out = tmp_path / "logo.pdf"
    build_searchable_pdf(source, "image", [_one_text_block(*rgba.size)], out, pdfa=True, replace_text=False)
    with pikepdf.open(out) as pdf:
        (raw,) = pdf.pages[0].get_images().values()
        assert "/SMask" in raw, "the alpha channel was dropped"
        kept_alpha = np.asarray(pikepdf.PdfImage(raw.SMask).as_pil_image().convert("L"))
        kept_colour = np.asarray(pikepdf.PdfImage(raw).as_pil_image().convert("RGB"))
    assert (kept_alpha == np.asarray(alpha)).all()
    assert (kept_colour == np.asarray(colour)).all()


def test_a_jpeg_keeps_its_own_bytes_and_its_exif_turn_becomes_the_pages_rotate(tmp_path):
    with Image.open(corpus_file("simple-no-dpi.png")) as opened:
        stored = opened.convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # stored turned: shown upright after a quarter turn clockwise
    source = tmp_path / "phone.jpg"
    stored.save(source, quality=90, exif=exif, dpi=(200, 200))
    out = tmp_path / "phone.pdf"
    upright = (stored.height, stored.width)  # as prepare shows it to the model
    build_searchable_pdf(source, "image", [_one_text_block(*upright)], out, pdfa=False, replace_text=False)
    with pikepdf.open(out) as pdf:
        page = pdf.pages[0]
        (raw,) = page.get_images().values()
        assert pikepdf.PdfImage(raw).filters == ["/DCTDecode"] and raw.read_raw_bytes() == source.read_bytes()
        assert int(page.obj.get("/Rotate", 0)) % 360 == 90
        assert float(page.mediabox[2]) == pytest.approx(stored.width * 72 / 200, abs=0.01)
