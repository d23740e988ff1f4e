"""Bytes → page images, one page at a time.

PDFs are inspected with ``pdfinfo``, normalised by Ghostscript (repair, flattened forms, lossless
unless a lossy preset is chosen) and rasterised page by page by PDFium, Chandra's own renderer
(``chandrad-render-page``, a child process), at Chandra's DPI rule, capped in pixels. Images get
EXIF rotation and one page per TIFF frame. Every external program runs with a timeout; its
failure becomes a ``PermanentError`` (the input is unusable) or a ``TransientError`` (worth
retrying). Nothing here holds more than one page of a document in memory: callers iterate.

Every read of an inbox file goes through ``open_regular``: ``O_NOFOLLOW`` plus an ``fstat`` check,
so a symlink, FIFO or device node is never read.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import shutil
import signal
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import structlog
from chandra.model.util import scale_to_fit
from chandra.settings import settings as chandra_settings
from PIL import Image, ImageOps, ImageSequence, UnidentifiedImageError

from chandrad import pdfium_page
from chandrad.config import PrepareSettings
from chandrad.errors import PageTooLargeError, PermanentError, ToolTimeoutError, TransientError, UnreadablePdfError
from chandrad.tools import ToolWorkers, WorkerGoneError, killed_from_outside, ran_out_of_memory, run_tool

# Chandra scales up standalone images whose short side is under this (chandra.input.load_image).
CHANDRA_MIN_IMAGE_DIM: int = chandra_settings.MIN_IMAGE_DIM

log = structlog.get_logger("chandrad.prepare")

DocType = Literal["pdf", "image"]

# What a mislabelled file really is, for the reason a person reads.
_OTHER_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"PK\x03\x04", "a ZIP archive (or an Office document)"),
    (b"\x7fELF", "a Linux executable"),
    (b"MZ", "a Windows executable"),
    (b"\xd0\xcf\x11\xe0", "an old Microsoft Office document"),
    (b"{\\rtf", "an RTF document"),
    (b"\x1f\x8b", "a gzip archive"),
    (b"Rar!", "a RAR archive"),
    (b"7z\xbc\xaf", "a 7-Zip archive"),
)
_IMAGE_SIGNATURES: tuple[bytes, ...] = (
    b"\x89PNG\r\n\x1a\n",
    b"\xff\xd8\xff",
    b"II*\x00",
    b"MM\x00*",
    b"GIF87a",
    b"GIF89a",
    b"BM",
    b"\x00\x00\x00\x0cjP  \r\n\x87\n",
    b"\xff\x4f\xff\x51",
)


@dataclass(frozen=True)
class PageImage:
    page_no: int  # 1-based
    image: Image.Image
    dpi: float


def open_regular(path: Path) -> BinaryIO:
    """Open an inbox file for reading, refusing symlinks and anything but a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ENOENT:
            # Gone (moved or deleted): callers decide. Intake drops a stale name; it used to become
            # a TransientError here, and intake then journaled a phantom "vanished" document.
            raise
        if error.errno == errno.ELOOP:
            raise PermanentError("it is a symbolic link; chandrad never follows links", stage="intake") from None
        if error.errno in (errno.EACCES, errno.EPERM):
            raise PermanentError(
                "permission denied: give chandrad's user read access to the file", stage="intake"
            ) from None
        raise TransientError(f"cannot open the file: {error.strerror}", stage="intake") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PermanentError("it is not a regular file (a pipe, socket or device)", stage="intake")
    return os.fdopen(fd, "rb")


def hash_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path) as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def sniff(path: Path) -> DocType:
    """Decide by content, not by name, what a file is; refuse what chandrad cannot read."""
    with open_regular(path) as handle:
        head = handle.read(2048)
    if not head:
        raise PermanentError("the file is empty (0 bytes); the upload or scan probably failed", stage="sniff")
    # PDF readers accept junk before the header (within the first KiB), and so do we.
    if b"%PDF-" in head[:1024]:
        return "pdf"
    if any(head.startswith(sig) for sig in _IMAGE_SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
        return "image"
    for signature, description in _OTHER_SIGNATURES:
        if head.startswith(signature):
            raise PermanentError(f"the file is {description}, not a PDF or an image", stage="sniff")
    text = head.lstrip().lower()
    if text.startswith((b"<!doctype html", b"<html")):
        raise PermanentError("the file is a web page (HTML), not a PDF or an image", stage="sniff")
    raise PermanentError(
        f"the file is not a PDF or a supported image (PNG, JPEG, TIFF, GIF, BMP, WebP, JPEG 2000); "
        f"it starts with {head[:8]!r}",
        stage="sniff",
    )


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


# -- PDF -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PdfInfo:
    pages: int
    encrypted: bool
    has_form: bool


def pdf_info(pdf: Path, settings: PrepareSettings, password: str | None = None) -> PdfInfo:
    args = ["pdfinfo"]
    if password:
        args += ["-upw", password]
    head = run_tool([*args, str(pdf)], settings, "inspect")
    if killed := killed_from_outside("pdfinfo", head.returncode, "inspect"):
        raise killed
    if head.returncode != 0:
        message = head.stderr.strip()
        if "password" in message.lower():
            raise PermanentError(
                "the PDF is password-protected; remove the password (or set pdf_password for this inbox) "
                "and drop it again",
                stage="inspect",
            )
        raise UnreadablePdfError(f"not a readable PDF ({_last_line(message) or 'pdfinfo failed'})", stage="inspect")
    fields = dict(
        line.split(":", 1) for line in head.stdout.splitlines() if ":" in line and not line.startswith("Page ")
    )
    try:
        pages = int(fields.get("Pages", "0").strip())
    except ValueError:
        pages = 0
    if pages < 1:
        raise PermanentError("the PDF has no pages", stage="inspect")
    if pages > settings.max_pages:
        raise PermanentError(
            f"the PDF declares {pages} pages, more than max_pages = {settings.max_pages}; split it", stage="inspect"
        )
    return PdfInfo(
        pages=pages,
        encrypted=fields.get("Encrypted", "no").strip().startswith("yes"),
        has_form=fields.get("Form", "none").strip() not in ("none", ""),
    )


_COMPRESS_ARGS = {
    # Lossless: keep every image as it is (no downsampling, no re-encoding of JPEGs).
    "lossless": [
        "-dPDFSETTINGS=/default",
        "-dPassThroughJPEGImages=true",
        "-dPassThroughJPXImages=true",
        "-dDownsampleColorImages=false",
        "-dDownsampleGrayImages=false",
        "-dDownsampleMonoImages=false",
        "-dAutoFilterColorImages=false",
        "-dAutoFilterGrayImages=false",
        "-dColorImageFilter=/FlateEncode",
        "-dGrayImageFilter=/FlateEncode",
    ],
    # Measured on the corpus: /ebook keeps OCR text at 0.994 similarity; /screen drops to 0.931 (not offered).
    "ebook": ["-dPDFSETTINGS=/ebook"],
    "printer": ["-dPDFSETTINGS=/printer"],
}


def normalise_pdf(
    source: Path,
    target: Path,
    compress: str,
    settings: PrepareSettings,
    password: str | None = None,
    warnings: list[str] | None = None,
) -> bool:
    """Rewrite ``source`` through Ghostscript into ``target``: repairs damage, flattens form fields.

    Returns False (and leaves no ``target``) when Ghostscript could not rewrite the file; the
    caller then uses the original bytes if they are readable. Ghostscript's complaints about page
    content it could not draw are appended to ``warnings``.
    """
    args = [
        "gs",
        "-q",
        "-dNOPAUSE",
        "-dBATCH",
        "-dSAFER",
        "-sDEVICE=pdfwrite",
        "-dCompatibilityLevel=1.7",
        "-dPreserveAnnots=false",
        "-dShowAcroForm=true",
        *_COMPRESS_ARGS[compress],
        f"-sOutputFile={target}",
    ]
    if password:
        args.append(f"-sPDFPassword={password}")
    try:
        result = run_tool([*args, str(source)], settings, "normalise")
    except (TransientError, PermanentError):
        target.unlink(missing_ok=True)
        raise
    if killed := killed_from_outside("gs", result.returncode, "normalise"):
        # Not the file's fault: retry rather than fall back to unflattened or unrepaired bytes.
        target.unlink(missing_ok=True)
        raise killed
    # Ghostscript exits 0 and writes a blank page when it found no page at all in the input.
    found_nothing = "No pages will be processed" in result.stderr + result.stdout
    if result.returncode != 0 or found_nothing or not target.exists() or target.stat().st_size == 0:
        log.warning("ghostscript could not rewrite the PDF", error=_last_line(result.stderr or result.stdout))
        target.unlink(missing_ok=True)
        return False
    if warnings is not None and "Page drawing error" in result.stderr + result.stdout:
        warnings.append("Ghostscript: page drawing error occurred, output may be incorrect")
    return True


def page_dpi(width_pt: float, height_pt: float, settings: PrepareSettings) -> float:
    """Chandra's rule (at least ``dpi``, short side at least ``min_short_side_px``), capped in pixels."""
    return pdfium_page.page_dpi(width_pt, height_pt, settings.dpi, settings.min_short_side_px, settings.max_page_pixels)


RENDERER = "chandrad-render-page"


def renderer_command() -> list[str]:
    """The PDF renderer: found on PATH like the other tools (so an admin, or a test, can wrap it),
    else the one installed beside this interpreter, else the module run by it (a source tree)."""
    beside = Path(sys.executable).with_name(RENDERER)
    found = shutil.which(RENDERER) or (str(beside) if beside.exists() else None)
    return [found] if found else [sys.executable, "-m", "chandrad.pdfium_page"]


@dataclass
class _RendererAnswer:
    """What the renderer said about one page, from a one-page run or a serving child alike."""

    returncode: int
    fields: dict[str, Any]
    pixels: bytes = b""
    stderr: str = ""


def render_pdf_page(
    pdf: Path, page_no: int, settings: PrepareSettings, password: str | None = None, workers: ToolWorkers | None = None
) -> PageImage:
    """One page through PDFium, Chandra's renderer, in a child process (``chandrad.pdfium_page``):
    one of ``workers``' serving children when given (the daemon's page reader), else one started
    for this page."""
    try:
        if workers is None:
            answer = _render_in_child(pdf, page_no, settings, password)
        else:
            answer = _render_in_worker(workers, pdf, page_no, settings, password)
    except ToolTimeoutError:
        raise ToolTimeoutError(
            f"rendering page {page_no} took longer than {settings.subprocess_timeout_seconds:.0f} s", stage="render"
        ) from None
    if killed := killed_from_outside("the PDF renderer", answer.returncode, "render"):
        raise TransientError(f"rendering page {page_no}: {killed.reason}", stage="render")
    if answer.returncode == pdfium_page.EXIT_TOO_LARGE:
        raise PageTooLargeError(
            f"page {page_no} is {answer.fields['width_in']:.0f}×{answer.fields['height_in']:.0f} inches: too "
            f"large to read within max_page_pixels = {settings.max_page_pixels}",
            stage="render",
        )
    if answer.returncode != 0:
        why = (
            _last_line(answer.stderr)
            if answer.returncode > 0
            else f"the PDF renderer crashed ({_signal_name(answer.returncode)})"
        )
        raise PermanentError(f"page {page_no} could not be rendered" + (f" ({why})" if why else ""), stage="render")
    try:
        size = (answer.fields["width"], answer.fields["height"])
        image = Image.frombytes("RGB", size, answer.pixels)
    except (ValueError, KeyError, TypeError) as error:
        raise PermanentError(f"page {page_no} could not be rendered ({error})", stage="render") from None
    return PageImage(page_no, image, float(answer.fields["dpi"]))


def _render_in_child(pdf: Path, page_no: int, settings: PrepareSettings, password: str | None) -> _RendererAnswer:
    args = [
        *renderer_command(),
        *(str(pdf), str(page_no), str(settings.dpi), str(settings.min_short_side_px)),
        *(str(settings.max_page_pixels), str(settings.min_dpi)),
    ]
    env = {pdfium_page.PASSWORD_ENV: password} if password else None
    result = run_tool(args, settings, "render", binary=True, env=env)
    if result.returncode == pdfium_page.EXIT_TOO_LARGE:
        return _RendererAnswer(result.returncode, _json_fields(result.stdout))
    if result.returncode != 0:
        return _RendererAnswer(result.returncode, {}, stderr=result.stderr)
    header, _, pixels = result.stdout.partition(b"\n")
    return _RendererAnswer(0, _json_fields(header), pixels)


def _json_fields(text: bytes) -> dict[str, Any]:
    try:
        fields = json.loads(text)
    except ValueError:
        return {}
    return fields if isinstance(fields, dict) else {}


def _render_in_worker(
    workers: ToolWorkers, pdf: Path, page_no: int, settings: PrepareSettings, password: str | None
) -> _RendererAnswer:
    command = (*renderer_command(), "--serve")
    request = {
        "pdf": str(pdf),
        "page": page_no,
        "dpi": settings.dpi,
        "min_short_side_px": settings.min_short_side_px,
        "max_page_pixels": settings.max_page_pixels,
        "min_dpi": settings.min_dpi,
        "password": password,
    }
    # RGB within max_page_pixels: a child that announces more is not a renderer to trust.
    max_bytes = 3 * settings.max_page_pixels + 3 * 65536
    fresh = False
    while True:
        worker = workers.take(command, settings.tool_memory_mb, "render", fresh=fresh)
        try:
            answer, pixels = worker.ask(request, settings.subprocess_timeout_seconds, "render", max_bytes)
        except WorkerGoneError as gone:
            worker.close()
            if worker.served and gone.returncode not in (-signal.SIGKILL, -signal.SIGTERM):
                # It had rendered other pages: its end may be their doing (a leak, the memory cap
                # reached at last), not this page's. Only a child that starts with this page blames it.
                log.info("a page renderer ended; rendering the page again in a new one", page=page_no)
                fresh = True
                continue
            if out_of_memory := ran_out_of_memory(command[0], gone.stderr, settings.tool_memory_mb, "render"):
                raise out_of_memory from None
            return _RendererAnswer(gone.returncode, {}, stderr=gone.stderr.decode("utf-8", "replace"))
        except BaseException:
            worker.close()
            raise
        workers.give_back(worker)
        code = answer.get("exit")
        return _RendererAnswer(code if isinstance(code, int) else 1, answer, pixels, str(answer.get("reason", "")))


def _signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"exit {returncode}"


# -- images --------------------------------------------------------------------------------------


def _open_image(path: Path, settings: PrepareSettings) -> Image.Image:
    handle = open_regular(path)
    try:
        image = Image.open(handle)
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, SyntaxError, ValueError) as error:
        handle.close()
        if isinstance(error, Image.DecompressionBombError):
            raise PermanentError("the image has too many pixels to decode safely", stage="decode") from None
        raise PermanentError(f"the image is damaged or in an unsupported format ({error})", stage="decode") from None
    width, height = image.size
    if width * height > settings.max_image_pixels:
        image.close()
        raise PermanentError(
            f"the image is {width}×{height} pixels, more than max_image_pixels = {settings.max_image_pixels}",
            stage="decode",
        )
    return image


def image_frame_count(path: Path, settings: PrepareSettings) -> int:
    with _open_image(path, settings) as image:
        frames = getattr(image, "n_frames", 1) if image.format == "TIFF" else 1
    if frames > settings.max_pages:
        raise PermanentError(
            f"the TIFF has {frames} frames, more than max_pages = {settings.max_pages}", stage="decode"
        )
    return frames


# EXIF orientation → the transpose that shows the image upright (as ImageOps.exif_transpose).
_ORIENTATION = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _capped_size(width: int, height: int, max_pixels: int) -> tuple[int, int]:
    if width * height <= max_pixels:
        return width, height
    scale = math.sqrt(max_pixels / (width * height))
    return max(1, int(width * scale)), max(1, int(height * scale))


def _page_from_frame(frame: Image.Image, page_no: int, settings: PrepareSettings) -> PageImage:
    width, height = frame.size
    if width * height > settings.max_image_pixels:
        raise PageTooLargeError(f"frame {page_no} is {width}×{height} pixels: too large", stage="decode")
    target = _capped_size(width, height, settings.max_page_pixels)
    if frame.format == "JPEG" and target != frame.size:
        # Let the JPEG decoder scale down (by 1/2, 1/4 or 1/8) while decoding instead of after.
        frame.draft(frame.mode, target)
    orientation = frame.getexif().get(0x0112, 1)
    dpi = frame.info.get("dpi", (0, 0))[0] if isinstance(frame.info.get("dpi"), tuple) else 0
    if target == frame.size:
        page = ImageOps.exif_transpose(frame).convert("RGB")
    else:
        # Scale down first, in the image's own mode, and only then rotate and convert: converting a
        # 12 000 × 12 000 grayscale scan to RGB before scaling held ~8 bytes per pixel at once
        # (decoded + rotated copy + RGB copy: 1.1 GB RSS measured); now the peak is the decoded
        # frame plus the small result. Mode "1" becomes "L" first: resizing 1-bit images in Pillow
        # means nearest-neighbour, which shreds thin text strokes.
        page = frame
        if page.mode == "1":
            page = page.convert("L")
        elif page.mode not in ("L", "RGB"):
            page = page.convert("RGB")
        page = page.resize(target, Image.Resampling.LANCZOS, reducing_gap=3.0)
        if orientation in _ORIENTATION:
            page = page.transpose(_ORIENTATION[orientation])
        page = page.convert("RGB")
    return PageImage(page_no, _upscale_small(page, settings), float(dpi or 0))


def _upscale_small(page: Image.Image, settings: PrepareSettings) -> Image.Image:
    """Chandra's rule for a standalone image (``chandra.input.load_image``): a short side under
    ``MIN_IMAGE_DIM`` (1 536 px) is scaled up to it, LANCZOS, and its model input is that scaled
    by ``scale_to_fit``. Both steps are taken as one here, straight to the size Chandra's pair gives
    (``scale_to_fit``'s own arithmetic, run on the size alone): a receipt 360 × 60 px would
    otherwise be 9 216 × 1 536 px in memory (42 MB) only to be scaled down again by the engine."""
    width, height = page.size
    short_side = min(width, height)
    if short_side >= CHANDRA_MIN_IMAGE_DIM:
        return page
    scale = CHANDRA_MIN_IMAGE_DIM / short_side
    upscaled = (int(width * scale), int(height * scale))
    final_width, final_height = scale_to_fit(_SizeOnly(upscaled)).size
    return page.resize(_capped_size(final_width, final_height, settings.max_page_pixels), Image.Resampling.LANCZOS)


class _SizeOnly:
    """An image's size and nothing else, for ``scale_to_fit`` to compute the size it would resize to."""

    def __init__(self, size: tuple[int, int]) -> None:
        self.size = size

    def resize(self, size: tuple[int, int], resample: object = None) -> _SizeOnly:
        return _SizeOnly(size)


def render_image_page(path: Path, page_no: int, settings: PrepareSettings) -> PageImage:
    """Decode one frame (1-based) of an image file."""
    try:
        with _open_image(path, settings) as image:
            if page_no == 1:
                return _page_from_frame(image, 1, settings)
            for index, frame in enumerate(ImageSequence.Iterator(image), start=1):
                if index == page_no:
                    return _page_from_frame(frame, page_no, settings)
    except (OSError, SyntaxError, ValueError, EOFError) as error:
        raise PermanentError(f"page {page_no} of the image could not be decoded ({error})", stage="decode") from None
    raise PermanentError(f"the image has no frame {page_no}", stage="decode")


# -- one document --------------------------------------------------------------------------------


@dataclass
class PreparedDocument:
    """What rendering needs to know about one document, and where its working copy lives."""

    doc_type: DocType
    source: Path  # the bytes pages are rendered from (normalised PDF, or the claimed original)
    page_count: int
    password: str | None = None
    # Set while ``source`` is the untouched original PDF: where Ghostscript's repair may write.
    repair_to: Path | None = None
    compress: str = "lossless"
    # The original did not parse and Ghostscript's repair reported content it could not draw (a
    # file cut short, say): if every page then renders blank, the document is damaged, not empty.
    repair_warning: str = ""

    def render(self, page_no: int, settings: PrepareSettings, workers: ToolWorkers | None = None) -> PageImage:
        """Page ``page_no``'s image; a PDF's through one of ``workers``' renderers when given."""
        if self.doc_type == "image":
            return render_image_page(self.source, page_no, settings)
        try:
            return render_pdf_page(self.source, page_no, settings, self.password, workers)
        except PageTooLargeError:
            raise
        except PermanentError as error:
            if self.repair_to is None:
                raise
            # poppler choked on a page of the original: let Ghostscript rewrite the file, then retry once.
            log.info("page failed to render; repairing the PDF with Ghostscript", page=page_no, error=error.reason)
            target, self.repair_to = self.repair_to, None
            if not normalise_pdf(self.source, target, self.compress, settings, self.password):
                raise
            info = pdf_info(target, settings)
            if info.pages != self.page_count:
                raise
            self.source, self.password = target, None
            return render_pdf_page(self.source, page_no, settings, workers=workers)


def prepare_as_is(
    original: Path, work_dir: Path, compress: str, settings: PrepareSettings, password: str | None = None
) -> PreparedDocument | None:
    """The claimed original as it will be read, when it needs no rewrite (an image; a healthy PDF
    without form fields in lossless mode: most scans), else None (``prepare_document`` rewrites it).
    Blocking (one ``pdfinfo``-like probe in a child): run it in a thread. Cheap next to a rewrite, so
    the daemon runs it without waiting for one of the few Ghostscript slots (``prepare.workers``)."""
    size = original.lstat().st_size
    if size > settings.max_file_mb * 1024 * 1024:
        raise PermanentError(
            f"the file is {size / 2**20:.0f} MB, more than max_file_mb = {settings.max_file_mb}", stage="sniff"
        )
    if sniff(original) == "image":
        return PreparedDocument("image", original, image_frame_count(original, settings))
    work_dir.mkdir(parents=True, exist_ok=True)
    if compress != "lossless":
        return None
    try:
        info = pdf_info(original, settings, password)
    except UnreadablePdfError:
        return None  # damaged: Ghostscript's repair is the only hope
    if info.has_form:
        return None
    return PreparedDocument("pdf", original, info.pages, password, work_dir / "normalised.pdf", compress)


def prepare_document(
    original: Path, work_dir: Path, compress: str, settings: PrepareSettings, password: str | None = None
) -> PreparedDocument:
    """Inspect one claimed original and normalise it where that is needed. Blocking: run it in a thread.

    Ghostscript rewrites a PDF when the original cannot be read (repair), has form fields (flatten),
    or a lossy ``compress`` preset was chosen. A healthy PDF in lossless mode is rendered as it is:
    rewriting it costs more than rendering it (5.7 s for 24 scanned pages) and changes nothing.
    """
    return prepare_as_is(original, work_dir, compress, settings, password) or rewrite_document(
        original, work_dir, compress, settings, password
    )


def rewrite_document(
    original: Path, work_dir: Path, compress: str, settings: PrepareSettings, password: str | None = None
) -> PreparedDocument:
    """A PDF ``prepare_as_is`` could not take as it is, through Ghostscript (repair, flatten, or a
    lossy ``compress``); the original as it is where the rewrite cannot help or comes out larger.
    Blocking: run it in a thread, in one of ``prepare.workers`` slots."""
    size = original.lstat().st_size
    work_dir.mkdir(parents=True, exist_ok=True)
    normalised = work_dir / "normalised.pdf"
    try:
        original_info: PdfInfo | None = pdf_info(original, settings, password)
    except UnreadablePdfError:
        # Anything else (password-protected, no pages, too many pages): a rewrite cannot change that.
        original_info = None  # damaged: Ghostscript's repair is the only hope
    as_is = (
        PreparedDocument("pdf", original, original_info.pages, password, normalised, compress)
        if original_info
        else None
    )
    if as_is is not None and original_info is not None and not original_info.has_form and compress == "lossless":
        return as_is
    # An OSError (ENOSPC on the state directory's disk included) propagates: the pipeline makes
    # a full disk wait instead of failing the document.
    warnings: list[str] = []
    rewritten = normalise_pdf(original, normalised, compress, settings, password, warnings)
    info = None
    if rewritten:
        try:
            info = pdf_info(normalised, settings)
        except PermanentError:
            info = None
    if info is None:
        if as_is is None:
            raise PermanentError("not a readable PDF: it is damaged beyond repair", stage="inspect")
        return as_is
    # A rewrite can grow a file (+34% on skew.pdf with /default): keep the smaller one unless forms
    # had to be flattened.
    if (
        as_is is not None
        and original_info is not None
        and not original_info.has_form
        and normalised.stat().st_size > size
    ):
        normalised.unlink()
        return as_is
    return PreparedDocument("pdf", normalised, info.pages, repair_warning="; ".join(warnings) if as_is is None else "")


def is_blank(image: Image.Image) -> bool:
    """Nothing but (near) white: what a page whose content could not be drawn renders as."""
    extrema = image.getextrema()
    bands = extrema if isinstance(extrema[0], tuple) else (extrema,)
    return all(band[0] >= 250 for band in bands)


def cleanup(work_dir: Path) -> None:
    shutil.rmtree(work_dir, ignore_errors=True)
