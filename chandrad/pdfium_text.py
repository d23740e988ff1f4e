"""A PDF's own text, page by page, read by PDFium in a child process (``python -m chandrad.pdfium_text``),
for ``ocr_mode`` (``chandrad.scan.digital``): how many visible and invisible characters each page
draws, and its text.

A character counts when its Unicode is usable (not a control, not U+FFFD or the private-use area
that a font without a ToUnicode map yields) and its box lies inside the page's outer ``MARGIN``
(a stray page number or a scanner's stamp in the margin is not a page's text). Invisible: drawn
in render mode 3 or 7 (another OCR's layer); anything else is visible.

Protocol: ``PDF MARGIN``, the password (if any) in ``CHANDRAD_PDF_PASSWORD``. On success one JSON
list on stdout, a ``{"visible", "invisible", "width_pt", "height_pt", "text"}`` per page, exit 0;
exit 3: the PDF cannot be read (the reason on stderr). Only the standard library and pypdfium2
are imported, as in ``pdfium_page``.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

EXIT_UNREADABLE = 3
PASSWORD_ENV = "CHANDRAD_PDF_PASSWORD"


def usable(code: int) -> bool:
    """Whether a character's Unicode is text a person could read (not whitespace, a control,
    the replacement character, or the private-use area)."""
    if code < 0x21 or code == 0xFFFD or 0xE000 <= code <= 0xF8FF or 0x7F <= code < 0xA0:
        return False
    return not chr(code).isspace()


def main(argv: list[str]) -> int:
    import pypdfium2 as pdfium
    import pypdfium2.raw as pdfium_c

    path, margin = argv[0], float(argv[1])
    invisible_modes = {pdfium_c.FPDF_TEXTRENDERMODE_INVISIBLE, pdfium_c.FPDF_TEXTRENDERMODE_CLIP}
    pages = []
    try:
        document = pdfium.PdfDocument(path, password=os.environ.get(PASSWORD_ENV) or None)
        for index in range(len(document)):
            page = document[index]
            width, height = page.get_width(), page.get_height()
            textpage = page.get_textpage()
            left, right = ctypes.c_double(), ctypes.c_double()
            bottom, top = ctypes.c_double(), ctypes.c_double()
            visible = invisible = 0
            for char in range(textpage.count_chars()):
                if not usable(pdfium_c.FPDFText_GetUnicode(textpage, char)):
                    continue
                pdfium_c.FPDFText_GetCharBox(textpage, char, left, right, bottom, top)
                x, y = (left.value + right.value) / 2, (bottom.value + top.value) / 2
                if not (margin * width <= x <= (1 - margin) * width and margin * height <= y <= (1 - margin) * height):
                    continue
                text_object = pdfium_c.FPDFText_GetTextObject(textpage, char)
                mode = pdfium_c.FPDFTextObj_GetTextRenderMode(text_object) if text_object else 0
                if mode in invisible_modes:
                    invisible += 1
                else:
                    visible += 1
            pages.append(
                {
                    "visible": visible,
                    "invisible": invisible,
                    "width_pt": width,
                    "height_pt": height,
                    "text": textpage.get_text_bounded() if visible or invisible else "",
                }
            )
    except pdfium.PdfiumError as error:
        sys.stderr.write(f"{error}\n")
        return EXIT_UNREADABLE
    sys.stdout.write(json.dumps(pages))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
