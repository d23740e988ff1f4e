#!/usr/bin/env python
"""What the remote engine sends a server a page as (not a test: numbers, against a baseline measured now).

Corpus scans rendered at prepare's 192 dpi, each encoded as ``engine.remote._png_data_url`` does
(``scale_to_fit``, then a grey PNG where every pixel has three equal channels) against the
baseline in the same run: the same scaled page always as an RGB PNG at the same level. Prints per
page the best of --repeat runs on one core, the bytes of each, whether the page went grey, and
whether the server's RGB of what is sent equals ``scale_to_fit``'s pixels (it must, always).

Usage: python bench/remote_png.py [--repeat 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = Path(os.environ.get("CHANDRAD_CORPUS") or REPO.parent / "shared" / "corpus")
sys.path.insert(0, str(REPO))
SCANS = ["linn.pdf", "skew.pdf", "epson.pdf", "c02-22.pdf", "cardinal.pdf", "typewriter.png"]


def best_of(repeat: int, work) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeat):
        started = time.perf_counter()
        out = work()
        times.append(time.perf_counter() - started)
    return min(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})

    import numpy as np
    from chandra.model.util import scale_to_fit
    from PIL import Image

    from chandrad import prepare
    from chandrad.config import PrepareSettings
    from chandrad.engine.remote import PNG_COMPRESS_LEVEL, _png_data_url

    settings = PrepareSettings()
    rows = []
    for name in SCANS:
        path = CORPUS / name
        if not path.exists():
            continue
        render = prepare.render_pdf_page if prepare.sniff(path) == "pdf" else prepare.render_image_page
        page = render(path, 1, settings).image.convert("RGB")  # as a renderer hands a page on

        def rgb_png(page: Image.Image = page) -> bytes:
            buffer = io.BytesIO()
            scale_to_fit(page).save(buffer, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
            return buffer.getvalue()

        base_s, base_bytes = best_of(args.repeat, rgb_png)
        sent_s, url = best_of(args.repeat, lambda page=page: _png_data_url(page))
        sent = Image.open(io.BytesIO(base64.b64decode(str(url).split(",", 1)[1])))
        same = np.array_equal(np.asarray(sent.convert("RGB")), np.asarray(scale_to_fit(page)))
        rows.append({
            "file": name, "size": list(page.size), "sent_mode": sent.mode, "same_pixels": bool(same),
            "rgb_png_ms": round(base_s * 1000, 1), "sent_ms": round(sent_s * 1000, 1),
            "time_ratio": round(sent_s / base_s, 3),
            "rgb_png_bytes": len(base_bytes), "sent_png_bytes": len(base64.b64decode(str(url).split(",", 1)[1])),
        })
        print(json.dumps(rows[-1]), flush=True)
    grey = [r for r in rows if r["sent_mode"] == "L"]
    summary = {
        "pages": len(rows), "grey_pages": len(grey), "all_same_pixels": all(r["same_pixels"] for r in rows),
        "grey_time_ratio": [r["time_ratio"] for r in grey],
        "grey_bytes_ratio": [round(r["sent_png_bytes"] / r["rgb_png_bytes"], 3) for r in grey],
        "colour_time_ratio": [r["time_ratio"] for r in rows if r["sent_mode"] != "L"],
    }
    print(json.dumps(summary), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
