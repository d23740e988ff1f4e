#!/usr/bin/env python
"""What the model sees: Chandra's own pipeline vs chandrad's, page by page, for any files given.

    python bench/parity.py FILE...

For each page: the size of the image Chandra's pipeline hands its model (``chandra.input`` then
``chandra.model.util.scale_to_fit``), the size of the one chandrad's engine receives (prepare, then
the engine's own ``scale_to_fit``), and their mean absolute pixel difference (0-255, over RGB; only
when the sizes match). One JSON line per page, then a summary line. A file chandrad refuses (or
Chandra cannot read) gets a line with its error instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image, ImageChops, ImageSequence, ImageStat

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def chandra_pages(path: Path) -> Iterator[Image.Image]:
    """Chandra's model input for each page: its loader, then its scale_to_fit. A multi-frame image
    is read frame by frame with Chandra's image rule (Chandra itself reads only the first)."""
    import filetype
    from chandra.input import load_image, load_pdf_images
    from chandra.model.util import scale_to_fit

    kind = filetype.guess(str(path))
    if kind is not None and kind.extension == "pdf":
        import pypdfium2 as pdfium

        count = len(pdfium.PdfDocument(str(path)))
        for index in range(count):
            (image,) = load_pdf_images(str(path), [index])
            yield scale_to_fit(image)
        return
    with Image.open(path) as opened:
        frames = getattr(opened, "n_frames", 1)
        if frames == 1:
            yield scale_to_fit(load_image(str(path)))
            return
        with tempfile.TemporaryDirectory() as scratch:
            for index, frame in enumerate(ImageSequence.Iterator(opened)):
                single = Path(scratch) / f"frame-{index}.png"
                frame.save(single)
                yield scale_to_fit(load_image(str(single)))


def chandrad_pages(path: Path, work: Path) -> Iterator[Image.Image]:
    """What chandrad's engine receives for each page: prepare's page image through the engine's scaling."""
    from chandra.model.util import scale_to_fit

    from chandrad.config import PrepareSettings
    from chandrad.prepare import prepare_document
    from chandrad.testing import render_pages

    settings = PrepareSettings()
    prepared = prepare_document(path, work, "lossless", settings)
    for page in render_pages(prepared, settings):
        yield scale_to_fit(page.image.convert("RGB"))


def mean_abs_diff(a: Image.Image, b: Image.Image) -> float:
    diff = ImageChops.difference(a.convert("RGB"), b.convert("RGB"))
    return float(sum(ImageStat.Stat(diff).mean) / 3)


def compare(path: Path) -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as work:
        try:
            theirs = list(chandra_pages(path))
        except Exception as error:
            yield {"file": str(path), "error": f"Chandra's pipeline: {type(error).__name__}: {error}"}
            return
        try:
            ours = list(chandrad_pages(path, Path(work)))
        except Exception as error:
            yield {"file": str(path), "error": f"chandrad: {getattr(error, 'reason', error)}"}
            return
        for page_no in range(1, max(len(theirs), len(ours)) + 1):
            chandra_image = theirs[page_no - 1] if page_no <= len(theirs) else None
            chandrad_image = ours[page_no - 1] if page_no <= len(ours) else None
            row: dict[str, Any] = {
                "file": str(path),
                "page": page_no,
                "chandra_size": list(chandra_image.size) if chandra_image else None,
                "chandrad_size": list(chandrad_image.size) if chandrad_image else None,
                "mean_abs_diff": None,
            }
            if chandra_image is not None and chandrad_image is not None and chandra_image.size == chandrad_image.size:
                row["mean_abs_diff"] = round(mean_abs_diff(chandra_image, chandrad_image), 3)
            yield row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    pages = same_size = within_2 = 0
    for path in args.files:
        for row in compare(path):
            print(json.dumps(row), flush=True)
            if "page" not in row:
                continue
            pages += 1
            if row["mean_abs_diff"] is not None:
                same_size += 1
                within_2 += row["mean_abs_diff"] <= 2.0
    print(json.dumps({"summary": True, "pages": pages, "same_size": same_size, "within_2": within_2}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
