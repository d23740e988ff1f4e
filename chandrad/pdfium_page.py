"""One PDF page rendered by PDFium, in a child process (``chandrad-render-page``).

PDFium is Chandra's own renderer (``chandra.input.load_pdf_images``): the page is rendered exactly
as Chandra's pipeline renders it (forms initialised and flattened with their values visible,
Chandra's DPI rule, smoothing of 1-bit scans below their resolution), so the model sees the pixels
it was trained on. It runs in a child process because a hostile PDF can crash PDFium or make it
allocate without bound: the parent (``prepare.render_pdf_page``) runs it with a timeout and a
memory cap, like every other tool. Only the standard library, PIL and pypdfium2 are imported here,
so the child starts in ~70 ms.

Protocol: ``PDF PAGE DPI MIN_SHORT_SIDE_PX MAX_PAGE_PIXELS MIN_DPI``, the password (if any) in
``CHANDRAD_PDF_PASSWORD`` (an environment is readable by its own user only; an argument by
anyone). On success: one JSON line ``{"width", "height", "dpi"}`` then the raw RGB bytes on
stdout, exit 0. Exit 3: the page cannot be rendered (the reason on stderr); exit 4: the page is
too large for ``MAX_PAGE_PIXELS`` even at ``MIN_DPI`` (its size in inches on stdout, as JSON).
"""

from __future__ import annotations

import json
import math
import os
import sys

EXIT_UNREADABLE = 3
EXIT_TOO_LARGE = 4
PASSWORD_ENV = "CHANDRAD_PDF_PASSWORD"


def page_dpi(width_pt: float, height_pt: float, dpi: float, min_short_side_px: int, max_page_pixels: int) -> float:
    """Chandra's rule (at least ``dpi``, short side at least ``min_short_side_px``), capped in pixels."""
    short_side = max(min(width_pt, height_pt), 1.0)
    chosen = max(float(dpi), min_short_side_px * 72.0 / short_side)
    area_in2 = max(width_pt * height_pt, 1.0) / (72.0 * 72.0)
    if area_in2 * chosen * chosen > max_page_pixels:
        chosen = math.sqrt(max_page_pixels / area_in2)
    return chosen


def main(argv: list[str]) -> int:
    import pypdfium2 as pdfium
    import pypdfium2.raw as pdfium_c

    path, page_no = argv[0], int(argv[1])
    dpi, min_short_side_px, max_page_pixels, min_dpi = float(argv[2]), int(argv[3]), int(argv[4]), float(argv[5])
    try:
        document = pdfium.PdfDocument(path, password=os.environ.get(PASSWORD_ENV) or None)
        # As chandra.input.load_pdf_images: forms initialised, the page flattened (values visible).
        document.init_forms()
        page = document[page_no - 1]
        width_pt, height_pt = page.get_width(), page.get_height()
        chosen = page_dpi(width_pt, height_pt, dpi, min_short_side_px, max_page_pixels)
        if chosen < min_dpi:
            sys.stdout.write(json.dumps({"width_in": width_pt / 72, "height_in": height_pt / 72}))
            return EXIT_TOO_LARGE
        pdfium_c.FPDFPage_Flatten(page, pdfium_c.FLAT_NORMALDISPLAY)
        page = document[page_no - 1]  # flattening changes the page: Chandra takes it again too
        image = page.render(scale=chosen / 72).to_pil().convert("RGB")
    except pdfium.PdfiumError as error:
        sys.stderr.write(f"{error}\n")
        return EXIT_UNREADABLE
    out = sys.stdout.buffer
    out.write(json.dumps({"width": image.width, "height": image.height, "dpi": chosen}).encode() + b"\n")
    out.write(image.tobytes())
    out.flush()
    return 0


def cli() -> None:
    sys.exit(main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
