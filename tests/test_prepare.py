"""Prepare: content sniffing, Chandra's DPI rule with a pixel cap, Ghostscript normalisation, images."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from chandra.model.util import scale_to_fit
from PIL import Image, ImageChops

from chandrad.config import PrepareSettings
from chandrad.errors import PermanentError, TransientError
from chandrad.prepare import RENDERER, is_blank, open_regular, page_dpi, prepare_document, sniff
from chandrad.testing import render_pages
from chandrad.tools import ToolWorker, ToolWorkers, WorkerGoneError, kill_tools, running_tools
from tests.conftest import corpus_file

SETTINGS = PrepareSettings()


def test_dpi_rule_is_192_for_letter_and_lifts_small_pages_to_1024_px():
    assert page_dpi(612, 792, SETTINGS) == 192
    three_inch = page_dpi(216, 216, SETTINGS)
    assert round(216 / 72 * three_inch) == 1024


def test_huge_pages_are_rendered_at_a_lower_dpi_instead_of_exploding(tmp_path):
    dpi = page_dpi(8400, 8400, SETTINGS)
    assert (8400 / 72 * dpi) ** 2 <= SETTINGS.max_page_pixels * 1.001
    doc = prepare_document(corpus_file("hugemono.pdf"), tmp_path, "lossless", SETTINGS)
    page = doc.render(1, SETTINGS)
    assert page.image.width * page.image.height <= SETTINGS.max_page_pixels * 1.01


def test_an_absurd_page_is_refused_with_its_size(tmp_path):
    tight = PrepareSettings(max_page_pixels=100_000, min_dpi=50)
    doc = prepare_document(corpus_file("enormous.pdf"), tmp_path, "lossless", tight)
    with pytest.raises(PermanentError, match="too large"):
        doc.render(1, tight)


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"", "empty"),
        (b"<!DOCTYPE html><html><body>hi</body></html>", "web page"),
        (b"PK\x03\x04rest-of-zip", "ZIP"),
        (b"\x7fELF\x02\x01\x01", "executable"),
        (b"just some text that is not a document", "not a PDF or a supported image"),
    ],
)
def test_non_documents_named_pdf_are_refused_by_content(tmp_path, content, reason):
    fake = tmp_path / "invoice.pdf"
    fake.write_bytes(content)
    with pytest.raises(PermanentError, match=reason):
        sniff(fake)


def test_mislabelled_files_are_read_by_what_they_contain(tmp_path):
    png_named_pdf = tmp_path / "scan.pdf"
    png_named_pdf.write_bytes(corpus_file("simple-no-dpi.png").read_bytes())
    pdf_named_png = tmp_path / "scan.png"
    pdf_named_png.write_bytes(corpus_file("trivial.pdf").read_bytes())
    assert sniff(png_named_pdf) == "image" and sniff(pdf_named_png) == "pdf"
    assert prepare_document(png_named_pdf, tmp_path / "w1", "lossless", SETTINGS).page_count == 1


def test_symlinks_and_fifos_are_never_opened(tmp_path):
    target = tmp_path / "target.pdf"
    target.write_bytes(b"%PDF-1.4")
    (tmp_path / "link.pdf").symlink_to(target)
    os.mkfifo(tmp_path / "fifo.pdf")
    with pytest.raises(PermanentError, match="symbolic link"):
        open_regular(tmp_path / "link.pdf")
    with pytest.raises(PermanentError, match="not a regular file"):
        open_regular(tmp_path / "fifo.pdf")


def test_password_protected_pdfs_fail_unless_the_password_is_configured(tmp_path):
    with pytest.raises(PermanentError, match="password-protected"):
        prepare_document(corpus_file("encrypted.pdf"), tmp_path / "a", "lossless", SETTINGS)
    doc = prepare_document(corpus_file("password-is-test.pdf"), tmp_path / "b", "lossless", SETTINGS, password="test")
    assert doc.page_count >= 1
    assert doc.render(1, SETTINGS).image.width > 0


def test_a_damaged_pdf_is_repaired_by_ghostscript_and_an_empty_one_refused(tmp_path):
    assert prepare_document(corpus_file("junk-prefix.pdf"), tmp_path / "a", "lossless", SETTINGS).page_count == 2
    with pytest.raises(PermanentError, match="not a readable PDF"):
        prepare_document(corpus_file("invalid.pdf"), tmp_path / "b", "lossless", SETTINGS)


def test_a_pdf_cut_short_is_repaired_into_its_pages_with_a_warning_that_they_may_be_empty(tmp_path):
    # The stages fail such a document as damaged when every page renders blank (the warning says why).
    truncated = tmp_path / "truncated.pdf"
    data = corpus_file("multipage.pdf").read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    doc = prepare_document(truncated, tmp_path / "work", "lossless", SETTINGS)
    assert doc.page_count == 6 and doc.source == tmp_path / "work" / "normalised.pdf"
    assert doc.repair_warning, "Ghostscript's repair reported content it could not draw"
    assert is_blank(doc.render(1, SETTINGS).image), "the page images were in the half cut off"


def test_lossless_normalisation_keeps_the_original_when_rewriting_would_grow_it(tmp_path):
    doc = prepare_document(corpus_file("skew.pdf"), tmp_path, "lossless", SETTINGS)
    assert doc.source == corpus_file("skew.pdf")
    assert not (tmp_path / "normalised.pdf").exists()


def test_forms_are_flattened_through_ghostscript_and_healthy_pdfs_rendered_as_they_are(tmp_path):
    assert prepare_document(corpus_file("with-form.pdf"), tmp_path / "a", "lossless", SETTINGS).source.name == (
        "normalised.pdf"
    )
    assert prepare_document(corpus_file("linn.pdf"), tmp_path / "b", "lossless", SETTINGS).source == (
        corpus_file("linn.pdf")
    )
    assert prepare_document(corpus_file("c02-22.pdf"), tmp_path / "c", "ebook", SETTINGS).source.name == (
        "normalised.pdf"
    )


def test_rotate_is_honoured(tmp_path):
    doc = prepare_document(corpus_file("cardinal.pdf"), tmp_path, "lossless", SETTINGS)
    shapes = [doc.render(n, SETTINGS).image.size for n in range(1, 5)]
    portrait = [w < h for w, h in shapes]
    assert portrait == [True, False, True, False]


def test_multi_frame_tiff_gives_one_page_per_frame_and_exif_rotation_applies(tmp_path):
    doc = prepare_document(corpus_file("multi-page-images.tiff"), tmp_path, "lossless", SETTINGS)
    assert doc.page_count == 3
    assert [page.page_no for page in render_pages(doc, SETTINGS, skip={2})] == [1, 3]

    rotated = tmp_path / "phone.jpg"
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90° clockwise to display"
    Image.new("RGB", (400, 200), "white").save(rotated, exif=exif)
    page = prepare_document(rotated, tmp_path / "j", "lossless", SETTINGS).render(1, SETTINGS)
    # Upright (portrait), then scaled up as Chandra scales a small image, to its model input's size.
    assert page.image.size == scale_to_fit(Image.new("L", (1536, 3072))).size == (1540, 3080)


def test_a_small_image_is_scaled_up_to_chandras_minimum_short_side_and_a_large_one_is_not(tmp_path):
    from chandra.input import load_image

    small = tmp_path / "receipt.png"
    Image.new("RGB", (517, 147), "white").save(small)
    page = prepare_document(small, tmp_path / "s", "lossless", SETTINGS).render(1, SETTINGS)
    # Chandra's upscale (to 5 402 × 1 535: its float truncation included), then its scale_to_fit: one step here.
    assert page.image.size == scale_to_fit(load_image(str(small))).size == (4676, 1344)
    large = tmp_path / "scan.png"
    Image.new("L", (1700, 2200), 255).save(large)
    assert prepare_document(large, tmp_path / "l", "lossless", SETTINGS).render(1, SETTINGS).image.size == (1700, 2200)


def test_a_pdf_page_is_rendered_as_chandras_own_pipeline_renders_it(tmp_path):
    from chandra.input import load_pdf_images

    for name in ("linn.pdf", "cardinal.pdf", "jbig2.pdf", "with-form.pdf"):
        source = corpus_file(name)
        doc = prepare_document(source, tmp_path / name, "lossless", SETTINGS)
        ours = doc.render(1, SETTINGS).image
        (theirs,) = load_pdf_images(str(source), [0])
        assert ours.size == theirs.size, name
        assert ImageChops.difference(ours, theirs.convert("RGB")).getbbox() is None, f"{name}: the same pixels"


def test_a_pixel_bomb_image_is_refused_before_decoding(tmp_path):
    bomb = tmp_path / "bomb.png"
    buffer = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buffer, format="PNG")  # 400 MP, a few KB on disk
    bomb.write_bytes(buffer.getvalue())
    with pytest.raises(PermanentError, match="pixels"):
        prepare_document(bomb, tmp_path / "w", "lossless", SETTINGS)


def test_a_corrupt_image_is_a_permanent_error(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_bytes(corpus_file("baiona.png").read_bytes()[:300])
    with pytest.raises(PermanentError):
        prepare_document(broken, tmp_path / "w", "lossless", SETTINGS).render(1, SETTINGS)


@pytest.fixture
def renderers() -> Iterator[ToolWorkers]:
    """The kept page renderers, as the daemon's page reader has them."""
    kept = ToolWorkers(keep=2)
    yield kept
    kept.close()


def serving_renderers() -> list[psutil.Process]:
    return [child for child in psutil.Process().children() if "--serve" in child.cmdline()]


@pytest.mark.parametrize("kept", [False, True], ids=["a-child-a-page", "kept-renderers"])
def test_a_tool_over_its_memory_limit_fails_the_document_with_a_reason(tmp_path, kept, renderers):
    # 24 MiB of address space: not even Ghostscript's or poppler's libraries fit.
    starved = PrepareSettings(tool_memory_mb=24)
    with pytest.raises(PermanentError, match=r"ran out of the memory it may use \(prepare.tool_memory_mb = 24\)"):
        doc = prepare_document(corpus_file("cardinal.pdf"), tmp_path, "lossless", starved)
        doc.render(1, starved, renderers if kept else None)


@pytest.mark.parametrize("kept", [False, True], ids=["a-child-a-page", "kept-renderers"])
def test_a_hung_renderer_is_a_transient_timeout(tmp_path, kept, renderers):
    impatient = PrepareSettings(subprocess_timeout_seconds=0.05)
    doc = prepare_document(corpus_file("hugemono.pdf"), tmp_path, "lossless", PrepareSettings())
    with pytest.raises(TransientError, match="took longer"):
        doc.render(1, impatient, renderers if kept else None)
    assert serving_renderers() == [], "the renderer past its deadline is killed, not kept"


def test_kept_renderers_render_every_page_as_a_child_a_page_does_and_one_serves_them_all(tmp_path, renderers):
    pages = [("linn.pdf", 1), ("multipage.pdf", 2), ("multipage.pdf", 5), ("with-form.pdf", 1), ("jbig2.pdf", 1)]
    for name, page_no in pages:
        doc = prepare_document(corpus_file(name), tmp_path / name, "lossless", SETTINGS)
        kept, alone = doc.render(page_no, SETTINGS, renderers), doc.render(page_no, SETTINGS)
        assert (kept.image.size, kept.dpi) == (alone.image.size, alone.dpi), (name, page_no)
        assert kept.image.tobytes() == alone.image.tobytes(), f"{name} page {page_no}: the same pixels"
    assert len(serving_renderers()) == 1, "pages one after another: one renderer started, and kept"
    locked = prepare_document(corpus_file("password-is-test.pdf"), tmp_path / "p", "lossless", SETTINGS, "test")
    assert locked.render(1, SETTINGS, renderers).image.size == locked.render(1, SETTINGS).image.size
    renderers.close()
    assert serving_renderers() == [], "closed: the kept renderers end"


def test_kept_renderers_idle_for_their_time_end_and_busy_ones_stay(tmp_path):
    now = [0.0]
    kept = ToolWorkers(keep=2, idle_seconds=60, clock=lambda: now[0])
    try:
        doc = prepare_document(corpus_file("linn.pdf"), tmp_path, "lossless", SETTINGS)
        doc.render(1, SETTINGS, kept)
        now[0] = 59.0
        assert kept.end_idle() == 0 and len(serving_renderers()) == 1, "idle under a minute: kept"
        doc.render(1, SETTINGS, kept)  # used again at 59 s: idle from then on
        now[0] = 118.0
        assert kept.end_idle() == 0 and len(serving_renderers()) == 1
        now[0] = 119.0
        assert kept.end_idle() == 1 and serving_renderers() == [], "a minute idle: ended"
        assert doc.render(1, SETTINGS, kept).image.width > 0, "a new one starts when needed"
    finally:
        kept.close()


def test_a_kept_renderer_that_died_between_pages_is_not_blamed_for_the_next_page(tmp_path, renderers):
    doc = prepare_document(corpus_file("linn.pdf"), tmp_path, "lossless", SETTINGS)
    first = doc.render(1, SETTINGS, renderers)
    (renderer,) = serving_renderers()
    renderer.send_signal(signal.SIGSEGV)  # as a leak or an earlier page's damage might end it
    renderer.wait(timeout=10)
    again = doc.render(1, SETTINGS, renderers)
    assert again.image.tobytes() == first.image.tobytes()
    assert [child.pid for child in serving_renderers()] != [renderer.pid]


def test_a_renderer_that_crashes_on_its_first_page_fails_the_page_with_the_reason(tmp_path, renderers, monkeypatch):
    """A crash that cannot be an earlier page's doing is the page's: no second try."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    crashing = bin_dir / RENDERER
    crashing.write_text("#!/bin/sh\necho 'PDFium: bad object' >&2\nkill -SEGV $$\n")
    crashing.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    doc = prepare_document(corpus_file("linn.pdf"), tmp_path / "w", "lossless", SETTINGS)
    with pytest.raises(PermanentError, match=r"page 1 could not be rendered \(the PDF renderer crashed \(SIGSEGV\)\)"):
        doc.render(1, SETTINGS, renderers)


def test_stopping_a_document_kills_the_kept_renderer_at_work_on_its_page(tmp_path, renderers):
    """The renderer is among the document's running tools while it renders, so a stop ends it
    (``tools.kill_tools``) instead of waiting for its deadline."""
    doc = prepare_document(corpus_file("hugemono.pdf"), tmp_path, "lossless", SETTINGS)
    tools: set[subprocess.Popen[bytes]] = set()
    failure: list[BaseException] = []

    def render() -> None:
        running_tools.set(tools)
        try:
            doc.render(1, SETTINGS, renderers)
        except BaseException as error:
            failure.append(error)

    worker = threading.Thread(target=render)
    worker.start()
    for _ in range(200):
        if tools:
            break
        time.sleep(0.05)
    assert kill_tools(tools) == 1
    worker.join(timeout=30)
    assert len(failure) == 1 and isinstance(failure[0], TransientError), failure
    assert "killed by SIGKILL" in failure[0].reason


@contextlib.contextmanager
def fake_renderer(tmp_path: Path, renderers: ToolWorkers, script: str) -> Iterator[ToolWorker]:
    """A kept renderer that runs ``script`` (shell) in place of ``chandrad-render-page --serve``."""
    program = tmp_path / RENDERER
    program.write_text("#!/bin/sh\n" + script)
    program.chmod(0o755)
    worker = renderers.take((str(program), "--serve"), SETTINGS.tool_memory_mb, "render")
    try:
        yield worker
    finally:
        worker.close()


def test_what_a_kept_renderer_says_before_it_dies_at_its_start_is_the_reason_it_gives(tmp_path, renderers):
    """It may end before its first request is written (a library it cannot load): its words
    still reach the error, however late the request comes."""
    script = "echo 'libpdfium.so: cannot open shared object file' >&2\nexit 1\n"
    with fake_renderer(tmp_path, renderers, script) as worker:
        worker.proc.wait(timeout=10)  # dead before it is asked
        with pytest.raises(WorkerGoneError) as gone:
            worker.ask({"pdf": str(corpus_file("linn.pdf")), "page": 1}, 10, "render")
    assert gone.value.returncode == 1
    assert b"libpdfium.so: cannot open shared object file" in gone.value.stderr


def test_a_renderer_that_answers_outside_the_protocol_fails_the_page_instead_of_filling_memory(tmp_path, renderers):
    """A wrapper that ignores ``--serve`` and prints without end: the answer's header is bounded."""
    with fake_renderer(tmp_path, renderers, "yes | tr -d '\\n'\n") as worker:
        with pytest.raises(WorkerGoneError) as gone:
            worker.ask({"pdf": str(corpus_file("linn.pdf")), "page": 1}, 30, "render")
        assert not worker.alive
    assert gone.value.stderr.startswith(b"answered outside the protocol: yyyy")


def test_a_renderer_that_announces_more_pixels_than_a_page_may_hold_is_not_read(tmp_path, renderers):
    script = 'read request\necho \'{"exit": 0, "bytes": 1000000000000}\'\nsleep 30\n'
    with fake_renderer(tmp_path, renderers, script) as worker, pytest.raises(WorkerGoneError) as gone:
        worker.ask({"pdf": "x", "page": 1}, 30, "render", max_bytes=3 * SETTINGS.max_page_pixels)
    assert b"answered outside the protocol" in gone.value.stderr, "refused at its header"
