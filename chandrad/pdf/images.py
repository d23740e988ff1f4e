"""An image input as the PDF to put the text on: one page per frame through img2pdf, each image
without loss (a JPEG's own bytes, a PNG's own compressed data, a G4 TIFF frame's own fax data, alpha
as a soft mask), upright by ``/Rotate``."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import img2pdf  # type: ignore[import-untyped]  # img2pdf ships no type hints
from pikepdf import Pdf
from PIL import Image, ImageOps, ImageSequence

DEFAULT_IMAGE_DPI = 300.0  # a frame that states none (or less than 10): a scan's usual resolution

# EXIF orientations that mirror the image: img2pdf turns pages by /Rotate, which cannot mirror.
_MIRRORED = frozenset({2, 4, 5, 7})


def _frame_facts(source: Path) -> tuple[list[float], bool, bool]:
    """Each frame's DPI (the page size: pixels at this DPI), whether a frame is mirrored by its
    EXIF orientation, and whether the file has frames beyond its first that are pages (TIFF only:
    prepare reads a GIF's or an MPO's first frame alone)."""
    dpis, mirrored = [], False
    with Image.open(source) as opened:
        paged = opened.format == "TIFF"
        frames = ImageSequence.Iterator(opened) if paged else iter([opened])
        for frame in frames:
            stated = frame.info.get("dpi")
            dpi = float(stated[0]) if isinstance(stated, tuple) and stated[0] else DEFAULT_IMAGE_DPI
            dpis.append(dpi if dpi >= 10 else DEFAULT_IMAGE_DPI)
            mirrored = mirrored or int(frame.getexif().get(0x0112, 1) or 1) in _MIRRORED
    return dpis, mirrored, paged


def _upright_pngs(source: Path, paged: bool) -> list[bytes]:
    """Each frame turned upright by Pillow and stored as PNG (lossless; alpha kept): for what img2pdf
    refuses as it is (a palette with transparency, a mirroring EXIF orientation)."""
    pngs = []
    with Image.open(source) as opened:
        for frame in ImageSequence.Iterator(opened) if paged else iter([opened]):
            upright = ImageOps.exif_transpose(frame)
            if upright.mode not in ("1", "L", "LA", "RGB", "RGBA"):
                has_alpha = "A" in upright.getbands() or "transparency" in upright.info
                upright = upright.convert("RGBA" if has_alpha else "RGB")
            buffer = io.BytesIO()
            upright.save(buffer, format="PNG")
            pngs.append(buffer.getvalue())
    return pngs


def image_document(source: Path) -> Pdf:
    """One page per frame, made by img2pdf: a JPEG's own bytes, a plain PNG's own compressed data, a
    CCITT G4 TIFF frame's own fax data; anything else losslessly as PNG data, alpha as an /SMask.
    Each page is the frame at its DPI (DEFAULT_IMAGE_DPI without one), upright through /Rotate as
    its EXIF orientation says, as prepare showed it to the model."""
    dpis, mirrored, paged = _frame_facts(source)
    sizes = iter(dpis)

    def page_at_own_dpi(width_px: int, height_px: int, _stated: Any) -> tuple[float, float, float, float]:
        # img2pdf asks frame by frame, in file order; its own default for "no DPI" is 96.
        dpi = next(sizes, DEFAULT_IMAGE_DPI)
        width_pt, height_pt = width_px * 72.0 / dpi, height_px * 72.0 / dpi
        return width_pt, height_pt, width_pt, height_pt

    options: dict[str, Any] = {
        "layout_fun": page_at_own_dpi,
        "rotation": img2pdf.Rotation.ifvalid,
        "first_frame_only": not paged,
        "nodate": True,
    }
    try:
        made = None if mirrored else img2pdf.convert(source.read_bytes(), **options)
    except (img2pdf.AlphaChannelError, img2pdf.ExifOrientationError, img2pdf.UnsupportedColorspaceError):
        made = None
    if made is None:
        sizes = iter(dpis)
        made = img2pdf.convert(_upright_pngs(source, paged), **{**options, "first_frame_only": False})
    return Pdf.open(io.BytesIO(made))
