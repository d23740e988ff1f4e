"""A page turned upright before the model sees it, on a greyscale copy no larger than ``OSD_MAX_SIDE``.

Two judges, the cheap one first (``prepare.orientation_quick_check``): Leptonica's text-line
test (``scan.leptonica``, ~10-25 ms a page), which decides most pages of text or says it cannot;
then, for the pages it cannot decide, tesseract's orientation and script detection (``--psm 0``,
as OCRmyPDF and paperless-ngx use it; ~0.6 s), in a child process with the tools' deadline and
memory cap. Either answers with the clockwise turn that makes the page upright (0, 90, 180 or
270) and a confidence on its own scale; tesseract's turn is made only at
``prepare.orientation_min_confidence`` or more. A page neither can judge (too few characters: a
photo, a blank back, a sparse form) stays as it is.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from chandrad.config import PrepareSettings
from chandrad.errors import DocumentError
from chandrad.scan import leptonica
from chandrad.scan.blank import BLANK_INK, ink_share
from chandrad.tools import run_tool

# Tesseract's OSD reads character shapes: larger costs time without changing its answer (a
# US-Letter page at prepare's 192 dpi is 2 112 px tall); much smaller loses characters
# (bench/orientation.py: confidence falls by half at 1 000 px).
OSD_MAX_SIDE = 2400

TESSERACT_MISSING = (
    "tesseract is not installed; install tesseract-ocr (Debian: apt-get install tesseract-ocr) "
    "to turn pages upright that Leptonica cannot judge"
)

_ROTATE = re.compile(r"^Rotate:\s*(\d+)", re.MULTILINE)
_CONFIDENCE = re.compile(r"^Orientation confidence:\s*([0-9.]+)", re.MULTILINE)
# clockwise degrees → the transpose that turns an image by them
_TURNS = {
    90: Image.Transpose.ROTATE_270,  # PIL's names count counter-clockwise
    180: Image.Transpose.ROTATE_180,
    270: Image.Transpose.ROTATE_90,
}


@dataclass(frozen=True)
class Orientation:
    """What was decided about one page's orientation.

    ``angle``: the clockwise turn ``method`` (``leptonica`` or ``tesseract``) says makes the page
    upright, with its ``confidence`` (each on its own scale); ``turned``: whether the page image was
    turned by it (confident enough, and not already upright); ``note``: why not, when it was not
    judged.
    """

    angle: int = 0
    confidence: float | None = None
    turned: bool = False
    note: str = ""
    method: str = ""

    @property
    def turn(self) -> int:
        """Clockwise degrees the page image was turned before it was read (0 when it was not)."""
        return self.angle if self.turned else 0

    def as_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"angle": self.angle, "confidence": self.confidence, "turned": self.turned}
        if self.method:
            entry["method"] = self.method
        if self.note:
            entry["note"] = self.note
        return entry


def detect_orientation(
    image: Image.Image, dpi: float, settings: PrepareSettings, ink: float | None = None
) -> Orientation:
    """Which way ``image`` is up (``ink``: its ``ink_share``, when measured already): Leptonica's
    answer when it has one, else tesseract's. Blocking (a child process): run it in a thread.
    Never raises for the page's sake: a page neither can judge, or a tesseract that failed, leaves
    the page as it is, and ``note`` says why."""
    copy = image.convert("L") if image.mode not in ("L", "1") else image
    if (ink_share(copy) if ink is None else ink) < BLANK_INK:
        # A blank back has nothing to judge by: tesseract would spend ~0.1 s to say "too few characters".
        return Orientation(note="blank page: nothing to judge")
    scale = min(1.0, OSD_MAX_SIDE / max(copy.size))
    if scale < 1.0:
        copy = copy.resize(
            (max(1, round(copy.width * scale)), max(1, round(copy.height * scale))), Image.Resampling.BILINEAR
        )
    grey = copy if copy.mode == "L" else copy.convert("L")
    if settings.orientation_quick_check and (quick := leptonica.text_orientation(grey)) is not None:
        if quick.turn is not None:
            return Orientation(quick.turn, quick.confidence, turned=quick.turn != 0, method="leptonica")
        if not quick.text_found:
            # Where Leptonica finds no text lines at all, tesseract found too few characters, or
            # answered below its threshold, on every such corpus page (bench/orientation.py), at
            # ~0.6 s a page: a photo or a drawing is left as it is without asking it.
            return Orientation(note="too little text to judge", method="leptonica")
    if shutil.which("tesseract") is None:
        # Before the page is written out for it: on a GPU host without tesseract that write was a
        # sixth of the daemon's own CPU in a wave (bench/NOTES-overhead.md).
        return Orientation(note=f"orientation not detected: {TESSERACT_MISSING}")
    with tempfile.TemporaryDirectory(prefix="chandrad-osd-") as folder:
        # Uncompressed TIFF: written in ~10 ms where PNG's compression took ~80 ms (a 2 400 px
        # page), read by tesseract alike, and, unlike PNM, it carries the resolution.
        page_tiff = Path(folder) / "page.tif"
        # Tesseract judges text size by it; below 70 it assumes 70 anyway (with a warning).
        resolution = max(70, round(dpi * scale))
        copy.save(page_tiff, "TIFF", dpi=(resolution, resolution))
        try:
            # One thread: pages are judged side by side, a core each; tesseract's OpenMP would
            # otherwise start a thread per core for every one of them.
            done = run_tool(
                ["tesseract", str(page_tiff), "stdout", "--psm", "0", "--dpi", str(resolution)],
                settings,
                "orient",
                env={"OMP_THREAD_LIMIT": "1"},
            )
        except DocumentError as error:
            return Orientation(note=f"orientation not detected: {error.reason}")
    angle_found, confidence_found = _ROTATE.search(done.stdout), _CONFIDENCE.search(done.stdout)
    if done.returncode != 0 or angle_found is None or confidence_found is None:
        if "Too few characters" in done.stderr:
            return Orientation(note="too few characters to judge")
        last = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return Orientation(note=f"orientation not detected: tesseract: {last[0]}")
    angle = int(angle_found.group(1)) % 360
    confidence = round(float(confidence_found.group(1)), 2)
    if angle not in _TURNS:
        return Orientation(0, confidence, method="tesseract")
    if confidence < settings.orientation_min_confidence:
        return Orientation(angle, confidence, note="not confident enough to turn", method="tesseract")
    return Orientation(angle, confidence, turned=True, method="tesseract")


def turned_upright(image: Image.Image, orientation: Orientation) -> Image.Image:
    """The page image turned by ``orientation.turn`` (the image itself when that is 0)."""
    transpose = _TURNS.get(orientation.turn)
    return image if transpose is None else image.transpose(transpose)
