"""Pages as a feeder makes them: sideways and upside-down pages are turned upright before they are
read (real tesseract OSD, real PDFium, the tesseract engine), and the searchable PDF's text lands
on the words as they lie on the page."""

from __future__ import annotations

import difflib
import io
import json
import re
import subprocess
from pathlib import Path

import img2pdf
import pikepdf
import pypdfium2 as pdfium
import pytest
from PIL import Image

from chandrad import prepare
from chandrad.config import PrepareSettings
from chandrad.scan import leptonica
from chandrad.scan.orientation import Orientation, detect_orientation, turned_upright
from tests.conftest import corpus_file, once_with_tesseract

PARAGRAPH = (
    "This is the text that appears on a page which the feeder turned over. Every line of it "
    "should come back in the order it was written, whichever way the sheet went through the "
    "scanner. The quick brown fox jumps over the lazy dog while the office printer hums along."
)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def _in_order(expected: list[str], found: list[str]) -> float:
    """The share of ``expected``'s words that ``found`` has in the same order (longest common subsequence)."""
    blocks = difflib.SequenceMatcher(None, expected, found, autojunk=False).get_matching_blocks()
    return sum(block.size for block in blocks) / max(len(expected), 1)


def _turned_text_pdf(path: Path, angle: int) -> None:
    """A scanned US-Letter page (/Rotate 0, one image) whose text lies turned ``angle`` degrees
    counter-clockwise in the content itself (so it takes ``angle`` clockwise to read), as a
    feeder's sideways or upside-down sheet comes out of a scanner: the text drawn turned, then
    the page rendered at 200 dpi as the scanner's image."""
    lines, line = [], ""
    for word in PARAGRAPH.split():
        if len(line) + len(word) > 44:
            lines.append(line)
            line = ""
        line = f"{line} {word}".strip()
    lines.append(line)
    width, height = 612, 792
    # The text laid out upright on the page, then the whole page turned about its centre.
    turn = {90: (0, 1, -1, 0), 180: (-1, 0, 0, -1), 270: (0, -1, 1, 0)}[angle]
    a, b, c, d = turn
    cx, cy = width / 2, height / 2
    e, f = cx - (a * cx + c * cy), cy - (b * cx + d * cy)
    ops = [f"q {a} {b} {c} {d} {e:.2f} {f:.2f} cm BT /F1 18 Tf 22 TL 72 560 Td"]
    ops += [f"({text}) Tj T*" for text in lines]
    ops.append("ET Q")
    pdf = pikepdf.new()
    font = pdf.make_indirect(pikepdf.Dictionary(Type=pikepdf.Name.Font, Subtype=pikepdf.Name.Type1,
                                                BaseFont=pikepdf.Name.Helvetica))
    page = pdf.add_blank_page(page_size=(width, height))
    page.Resources = pikepdf.Dictionary(Font=pikepdf.Dictionary(F1=font))
    page.Contents = pdf.make_stream(" ".join(ops).encode("latin-1"))
    vector = path.with_suffix(".vector.pdf")
    pdf.save(vector)
    image = pdfium.PdfDocument(str(vector))[0].render(scale=200 / 72).to_pil().convert("L")
    vector.unlink()
    buffer = io.BytesIO()
    image.save(buffer, "PNG", dpi=(200, 200))
    path.write_bytes(img2pdf.convert(buffer.getvalue()))


def _pdftotext(pdf: Path, *options: str) -> str:
    return subprocess.run(["pdftotext", *options, str(pdf), "-"], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("angle", [90, 180, 270])
def test_text_turned_in_the_page_content_reads_upright_in_markdown_and_in_the_pdf_layer(tmp_path, angle):
    source = tmp_path / f"turned-{angle}.pdf"
    _turned_text_pdf(source, angle)
    if angle == 180:
        # Read as it lies, an upside-down page is not readable (tesseract itself, the stand-in
        # engine here, finds sideways lines on its own; the model does not).
        as_is = once_with_tesseract(tmp_path / "as-is", [source], "rotate_pages = false\n")
        garbled = (as_is / source.stem / f"{source.stem}.md").read_text()
        assert _in_order(_words(PARAGRAPH), _words(garbled)) < 0.5, garbled

    out = once_with_tesseract(tmp_path, [source])
    folder = out / source.stem
    markdown = _words((folder / f"{source.stem}.md").read_text())
    assert _in_order(_words(PARAGRAPH), markdown) >= 0.95
    (page,) = json.loads((folder / f"{source.stem}.json").read_text())["pages"]
    assert page["orientation"]["turned"] and page["orientation"]["angle"] == angle
    assert page["orientation"]["confidence"] >= PrepareSettings().orientation_min_confidence
    # The text layer is drawn in reading order along the turned lines: in content order (-raw)
    # pdftotext gives it back as the Markdown has it; its layout mode finds every word too.
    pdf = folder / f"{source.stem}.pdf"
    assert _in_order(markdown, _words(_pdftotext(pdf, "-raw"))) >= 0.95
    assert set(markdown) <= set(_words(_pdftotext(pdf)))
    with pikepdf.open(pdf) as written:
        assert int(written.pages[0].obj.get("/Rotate", 0)) == 0, "the page is not turned without rotate_pdf_pages"


def test_rotate_pdf_pages_shows_the_turned_page_upright_with_its_layer(tmp_path):
    source = tmp_path / "turned-90.pdf"
    _turned_text_pdf(source, 90)
    out = once_with_tesseract(tmp_path, [source], "rotate_pdf_pages = true\n")
    pdf = out / source.stem / f"{source.stem}.pdf"
    markdown = _words((out / source.stem / f"{source.stem}.md").read_text())
    with pikepdf.open(pdf) as written:
        assert int(written.pages[0].obj.Rotate) == 90
    assert _in_order(markdown, _words(_pdftotext(pdf))) >= 0.95, "upright, even pdftotext's layout mode reads it in order"
    report = json.loads((out / source.stem / f"{source.stem}.json").read_text())["pdf"]
    assert report["rotated_pages"] == [1]


def _page_image(name: str) -> Image.Image:
    path = corpus_file(name)
    if path.suffix == ".pdf":
        return pdfium.PdfDocument(str(path))[0].render(scale=192 / 72).to_pil().convert("L")
    return Image.open(path).convert("L")


SCANS = ["linn.pdf", "typewriter.png", "c02-22.pdf", "cardinal.pdf"]


@pytest.mark.parametrize("quick_check", [True, False], ids=["leptonica-first", "tesseract-only"])
@pytest.mark.parametrize("name", SCANS)
def test_a_turned_scan_is_detected_and_an_upright_one_never_turned(name, quick_check):
    settings = PrepareSettings(orientation_quick_check=quick_check)
    upright = _page_image(name)
    for angle in (0, 90, 180, 270):
        # PIL turns counter-clockwise: a page turned that way needs ``angle`` clockwise to be upright.
        orientation = detect_orientation(upright.rotate(angle, expand=True), 192, settings)
        if angle == 0:
            assert not orientation.turned and orientation.angle == 0, orientation
        else:
            assert orientation.turned and orientation.angle == angle, (angle, orientation)
            assert turned_upright(upright.rotate(angle, expand=True), orientation).size == upright.size


@pytest.mark.parametrize("quick_check", [True, False], ids=["leptonica-first", "tesseract-only"])
@pytest.mark.parametrize("name", ["blank.pdf", "lichtenstein.pdf"])
def test_a_blank_or_sparse_page_stays_as_it_is(name, quick_check):
    settings = PrepareSettings(orientation_quick_check=quick_check)
    for angle in (0, 90, 180, 270):
        orientation = detect_orientation(_page_image(name).rotate(angle, expand=True), 192, settings)
        assert not orientation.turned, (angle, orientation)
        assert orientation.turn == 0


def test_without_tesseract_a_page_is_read_as_it_is_and_never_written_out_for_it(monkeypatch):
    page = _page_image("linn.pdf").rotate(90, expand=True)
    monkeypatch.setenv("PATH", "/nonexistent")

    def no_writes(*args: object, **kwargs: object) -> None:
        raise AssertionError("the page was encoded for a tesseract that is not there")

    monkeypatch.setattr(Image.Image, "save", no_writes)
    orientation = detect_orientation(page, 192, PrepareSettings(orientation_quick_check=False))
    assert orientation == Orientation(note=orientation.note) and "not installed" in orientation.note
    assert "apt-get install tesseract-ocr" in orientation.note


def test_leptonica_turns_a_page_of_text_without_asking_tesseract(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # a tesseract run would fail: "not installed"
    for angle in (0, 90, 180, 270):
        orientation = detect_orientation(_page_image("linn.pdf").rotate(angle, expand=True), 192, PrepareSettings())
        assert orientation.method == "leptonica" and orientation.angle == angle, (angle, orientation)
        assert orientation.turned == (angle != 0)


def _both_tests_decision(grey: Image.Image) -> tuple[int, float] | None:
    """Leptonica's answer with both of its tests run (as before the sideways test could be skipped)."""
    import ctypes

    lib = leptonica._library()
    data, _ = leptonica._words(leptonica._ink(grey))
    pix = ctypes.c_void_p(lib.pixCreate(grey.width, grey.height, 1))
    ctypes.memmove(lib.pixGetData(pix), data.ctypes.data, data.nbytes)
    up, left, decided = ctypes.c_float(), ctypes.c_float(), ctypes.c_int(0)
    lib.pixOrientDetect(pix, ctypes.byref(up), ctypes.byref(left), 0, 0)
    lib.makeOrientDecision(up, left, 0.0, 0.0, ctypes.byref(decided), 0)
    lib.pixDestroy(ctypes.byref(pix))
    turn = leptonica._TURN_OF.get(decided.value)
    return None if turn is None else (turn, round(max(abs(up.value), abs(left.value)), 2))


@pytest.mark.skipif(not leptonica.available(), reason="Leptonica (liblept5) is not installed")
def test_leptonica_runs_one_test_for_a_page_of_print_either_way_up_with_the_answer_of_both(monkeypatch):
    lib = leptonica._library()
    real_detect = lib.pixOrientDetect
    sideways_tests = []

    def counting_detect(pix, up, left, mincount, debug):
        sideways_tests.append(left is not None)
        return real_detect(pix, up, left, mincount, debug)

    monkeypatch.setattr(lib, "pixOrientDetect", counting_detect)
    # linn: dense print (its up/down measure is 37 upright); c02-22: less text (17), where both
    # tests still run; typewriter: print Leptonica decides only just (12)
    for name in ("linn.pdf", "c02-22.pdf", "typewriter.png"):
        grey = _page_image(name).convert("L")
        for angle in (0, 90, 180, 270):
            turned = grey.rotate(angle, expand=True)
            expected = _both_tests_decision(turned)
            sideways_tests.clear()
            answer = leptonica.text_orientation(turned)
            assert answer is not None and answer.text_found, (name, angle)
            decided = None if answer.turn is None else (answer.turn, answer.confidence)
            assert decided == expected, (name, angle)
            if name == "linn.pdf":
                # its lines' direction seen first, one test along them is beyond doubt: the other
                # (half the cost) is not run, whether the page lies upright, upside down or sideways
                assert sideways_tests == [angle in (90, 270)], (angle, sideways_tests)


@pytest.mark.skipif(not leptonica.available(), reason="Leptonica (liblept5) is not installed")
def test_a_wrong_guess_of_the_lines_direction_costs_a_test_never_the_answer(monkeypatch):
    real_guess = leptonica._lines_run_across
    monkeypatch.setattr(leptonica, "_lines_run_across", lambda ink: not real_guess(ink))
    for name in ("linn.pdf", "c02-22.pdf", "typewriter.png"):
        grey = _page_image(name).convert("L")
        for angle in (0, 90, 180, 270):
            turned = grey.rotate(angle, expand=True)
            answer = leptonica.text_orientation(turned)
            assert answer is not None and answer.text_found, (name, angle)
            decided = None if answer.turn is None else (answer.turn, answer.confidence)
            assert decided == _both_tests_decision(turned), (name, angle)
            if name == "linn.pdf":
                assert decided is not None and decided[0] == angle, (angle, decided)


@pytest.mark.skipif(not leptonica.available(), reason="Leptonica (liblept5) is not installed")
def test_a_page_where_leptonica_finds_no_text_is_left_as_it_is_without_asking_tesseract(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")  # a tesseract run would fail: "not installed"
    # lichtenstein: a photograph, no line of text; tesseract answered it at 1.4-1.8 (below the
    # threshold) at every turn, in ~0.6 s each (bench/orientation.py)
    for angle in (0, 90, 180, 270):
        orientation = detect_orientation(
            _page_image("lichtenstein.pdf").rotate(angle, expand=True), 192, PrepareSettings()
        )
        assert orientation == Orientation(note="too little text to judge", method="leptonica"), (angle, orientation)
    # and with the quick check off, tesseract is asked (and is missing here)
    orientation = detect_orientation(
        _page_image("lichtenstein.pdf"), 192, PrepareSettings(orientation_quick_check=False)
    )
    assert "tesseract is not installed" in orientation.note, orientation


def test_a_page_leptonica_cannot_decide_goes_to_tesseract():
    # baiona's Spanish print, as prepare renders it (640 px without a resolution, scaled up),
    # leaves Leptonica undecided at every turn (bench/orientation.py); tesseract still turns it.
    settings = PrepareSettings()
    page = prepare.render_image_page(corpus_file("baiona.png"), 1, settings)
    orientation = detect_orientation(page.image.rotate(90, expand=True), page.dpi, settings)
    assert orientation.method == "tesseract" and orientation.turned and orientation.angle == 90, orientation


def _turned_inputs(folder: Path, name: str) -> list[Path]:
    """The scan as an image PDF and as a PNG, turned 0, 90, 180 and 270 degrees."""
    upright = _page_image(name)
    made = []
    for angle in (0, 90, 180, 270):
        turned = upright.rotate(angle, expand=True)
        png = folder / f"{Path(name).stem}-{angle}.png"
        turned.save(png, dpi=(192, 192))
        buffer = io.BytesIO()
        turned.save(buffer, "PNG", dpi=(192, 192))
        pdf = folder / f"{Path(name).stem}-{angle}-scan.pdf"
        pdf.write_bytes(img2pdf.convert(buffer.getvalue()))
        made += [png, pdf]
    return made


def test_word_recall_of_turned_scans_through_the_engine_is_within_two_points_of_the_upright_page(tmp_path):
    files: list[Path] = []
    for name in ("linn.pdf", "c02-22.pdf"):
        files += _turned_inputs(tmp_path, name)
    out = once_with_tesseract(tmp_path, files)
    for name in ("linn", "c02-22"):
        truth = _words((out / f"{name}-0" / f"{name}-0.md").read_text())
        for path in files:
            if not path.stem.startswith(f"{name}-"):
                continue
            folder = out / path.stem
            read = _words((folder / f"{path.stem}.md").read_text())
            recall = _in_order(truth, read)
            assert recall >= 0.98, (path.name, recall)
            (page,) = json.loads((folder / f"{path.stem}.json").read_text())["pages"]
            angle = int(path.stem.split("-")[-1] if path.suffix == ".png" else path.stem.split("-")[-2])
            assert page["orientation"]["turned"] == (angle != 0) and page["orientation"]["angle"] == angle


def test_the_start_warns_of_a_missing_tesseract_only_where_an_inbox_or_one_of_its_rules_turns_pages(tmp_path):
    from chandrad.config import Settings
    from chandrad.service.starting import turns_pages

    def settings(inbox: dict) -> Settings:
        return Settings.model_validate({"state_dir": tmp_path / "state", "inbox": [{"path": tmp_path, **inbox}]})

    assert turns_pages(settings({})), "rotate_pages is on by default"
    assert not turns_pages(settings({"rotate_pages": False}))
    assert turns_pages(settings({"rotate_pages": False, "rule": [{"match": "feeder/**", "rotate_pages": True}]}))
