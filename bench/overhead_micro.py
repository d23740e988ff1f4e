"""bench/overhead.py's --micro: per-page costs of the daemon's own steps, one core."""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path
from typing import Any

from overhead_common import WORDS

# -- micro: per-page costs of the daemon's own steps, one core -------------------------------------


def micro(files: list[Path], kind: str) -> dict[str, Any]:
    from chandra.model.util import scale_to_fit

    from chandrad import prepare
    from chandrad.config import PrepareSettings
    from chandrad.output import publish

    settings = PrepareSettings()
    out: dict[str, Any] = {}
    sample = files[: min(4, len(files))]
    t = time.perf_counter()
    pages = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(sample):
            doc = prepare.prepare_document(path, Path(tmp) / str(i), "lossless", settings)
            pages.append(doc.render(1, settings).image)
    out[f"prepare_and_render_{kind}_ms"] = round((time.perf_counter() - t) / len(sample) * 1e3, 1)
    t = time.perf_counter()
    for image in pages:
        scale_to_fit(image.convert("RGB"))
    out["scale_to_fit_ms"] = round((time.perf_counter() - t) / len(pages) * 1e3, 1)
    html = "".join(f'<div data-label="Text" data-bbox="{10 * k} 10 {10 * k + 90} 60"><p>'
                   + " ".join(random.Random(k).choice(WORDS) for _ in range(120)) + "</p></div>" for k in range(12))
    t = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for image in pages:
            publish.save_page_images(html, image, Path(tmp) / "images")
    out["save_page_images_ms"] = round((time.perf_counter() - t) / len(pages) * 1e3, 1)
    return out

