"""One PDF page rendered by PDFium, in a child process (``chandrad-render-page``).

PDFium is Chandra's own renderer (``chandra.input.load_pdf_images``): the page is rendered exactly
as Chandra's pipeline renders it (forms initialised and flattened with their values visible,
Chandra's DPI rule, smoothing of 1-bit scans below their resolution), so the model sees the pixels
it was trained on. It runs in a child process because a hostile PDF can crash PDFium or make it
allocate without bound: the parent (``prepare.render_pdf_page``) runs it with a timeout and a
memory cap, like every other tool. Only the standard library, PIL and pypdfium2 are imported here,
so the child starts in ~70 ms.

Protocol, one page a run: ``PDF PAGE DPI MIN_SHORT_SIDE_PX MAX_PAGE_PIXELS MIN_DPI``, the password
(if any) in ``CHANDRAD_PDF_PASSWORD`` (an environment is readable by its own user only; an argument
by anyone). On success: one JSON line ``{"width", "height", "dpi"}`` then the raw RGB bytes on
stdout, exit 0. Exit 3: the page cannot be rendered (the reason on stderr); exit 4: the page is
too large for ``MAX_PAGE_PIXELS`` even at ``MIN_DPI`` (its size in inches on stdout, as JSON).

``--serve``: many pages, one at a time, for ``tools.ToolWorkers``: the daemon's page reader keeps a
few such children instead of starting one a page (a start and the imports cost about as much CPU
as the render itself). Each request is a JSON line on stdin (``pdf``, ``page``, ``dpi``,
``min_short_side_px``, ``max_page_pixels``, ``min_dpi``, ``password``); each answer a JSON line
``{"exit", "bytes", ...}`` (``exit`` as above; ``reason`` with 3, the size with 4, the image's with
0) followed by ``bytes`` raw bytes. A crash ends the child: the parent sees its stdout end.
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


def render(
    path: str,
    page_no: int,
    dpi: float,
    min_short_side_px: int,
    max_page_pixels: int,
    min_dpi: float,
    password: str | None,
) -> tuple[int, dict[str, object], bytes]:
    """One page: its exit code, the answer's fields and, on success, the raw RGB bytes."""
    import pypdfium2 as pdfium
    import pypdfium2.raw as pdfium_c

    try:
        document = pdfium.PdfDocument(path, password=password or None)
        try:
            # As chandra.input.load_pdf_images: forms initialised, the page flattened (values visible).
            document.init_forms()
            page = document[page_no - 1]
            width_pt, height_pt = page.get_width(), page.get_height()
            chosen = page_dpi(width_pt, height_pt, dpi, min_short_side_px, max_page_pixels)
            if chosen < min_dpi:
                return EXIT_TOO_LARGE, {"width_in": width_pt / 72, "height_in": height_pt / 72}, b""
            pdfium_c.FPDFPage_Flatten(page, pdfium_c.FLAT_NORMALDISPLAY)
            page = document[page_no - 1]  # flattening changes the page: Chandra takes it again too
            image = page.render(scale=chosen / 72).to_pil().convert("RGB")
        finally:
            document.close()  # a serving child renders many documents: each one's memory goes with it
    except pdfium.PdfiumError as error:
        return EXIT_UNREADABLE, {"reason": str(error)}, b""
    return 0, {"width": image.width, "height": image.height, "dpi": chosen}, image.tobytes()


def main(argv: list[str]) -> int:
    path, page_no = argv[0], int(argv[1])
    dpi, min_short_side_px, max_page_pixels, min_dpi = float(argv[2]), int(argv[3]), int(argv[4]), float(argv[5])
    code, fields, pixels = render(
        path, page_no, dpi, min_short_side_px, max_page_pixels, min_dpi, os.environ.get(PASSWORD_ENV)
    )
    if code == EXIT_UNREADABLE:
        sys.stderr.write(f"{fields['reason']}\n")
        return code
    if code == EXIT_TOO_LARGE:
        sys.stdout.write(json.dumps(fields))
        return code
    out = sys.stdout.buffer
    out.write(json.dumps(fields).encode() + b"\n")
    out.write(pixels)
    out.flush()
    return 0


def serve() -> int:
    """Pages until stdin ends (``--serve``), one answer each."""
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        request = json.loads(line)
        code, fields, pixels = render(
            str(request["pdf"]),
            int(request["page"]),
            float(request["dpi"]),
            int(request["min_short_side_px"]),
            int(request["max_page_pixels"]),
            float(request["min_dpi"]),
            request.get("password"),
        )
        out.write(json.dumps({"exit": code, "bytes": len(pixels), **fields}).encode() + b"\n")
        out.write(pixels)
        out.flush()
    return 0


def cli() -> None:
    sys.exit(serve() if sys.argv[1:] == ["--serve"] else main(sys.argv[1:]))


if __name__ == "__main__":
    cli()
