#!/usr/bin/env python
"""Orientation detection on the corpus (not a test: numbers, printed against a baseline measured now).

Every page of the corpus scans below, rendered as prepare renders it, turned 0, 90, 180 and 270
degrees, through ``scan.orientation.detect_orientation`` one at a time on one core. Prints:

- accuracy: the share of judged turned pages detected at the right angle and turned, and of
  upright pages left alone; pages tesseract cannot judge (too few characters) counted apart;
- the confidences of right and wrong answers (what ``prepare.orientation_min_confidence`` is
  chosen from), and how many right answers OCRmyPDF's 14 and paperless-ngx's 12 would have kept;
- time: detection per page against the same page's prepare render (the baseline, measured in
  the same run), as a ratio; and against the page's preparation without orientation (its render,
  its greyscale copy and its ink measure, which the daemon makes for every page and hands to the
  judges, as ``document.pages`` does), the share the issue's ≤ 5 % target is about.

Twice: with tesseract judging every page (``orientation_quick_check = false``: the confidences
the threshold is chosen from are tesseract's), then as chandrad runs by default (Leptonica first,
tesseract for the pages it cannot decide), with the share each judge decided.

Usage: python bench/orientation.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# CHANDRAD_CORPUS: where the corpus is elsewhere (the device: bench/stage-device.sh carries these scans).
CORPUS = Path(os.environ.get("CHANDRAD_CORPUS") or REPO.parent / "shared" / "corpus")
sys.path.insert(0, str(REPO))

# The pages of the corpus that are not upright as they render: cardinal.pdf is OCRmyPDF's test of
# page rotation (its pages 2-4 lie sideways, upside down, sideways; checked by eye). Every other
# page renders upright.
NOT_UPRIGHT = {("cardinal.pdf", 2): 270, ("cardinal.pdf", 3): 180, ("cardinal.pdf", 4): 90}

SCANS = [
    "linn.pdf", "typewriter.png", "c02-22.pdf", "cardinal.pdf", "lichtenstein.pdf", "kcs.pdf",
    "francais.pdf", "skew.pdf", "multipage.pdf", "epson.pdf", "baiona.png", "ccitt.pdf", "jbig2.pdf",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core: the render and its children

    from chandrad import prepare
    from chandrad.config import PrepareSettings
    from chandrad.scan.blank import ink_share
    from chandrad.scan.orientation import detect_orientation

    settings = PrepareSettings()
    renders = []
    for name in SCANS:
        path = CORPUS / name
        if not path.exists():
            continue
        doc_type = prepare.sniff(path)
        count = prepare.pdf_info(path, settings).pages if doc_type == "pdf" else prepare.image_frame_count(path, settings)
        for page_no in range(1, min(count, 4) + 1):
            started = time.perf_counter()
            if doc_type == "pdf":
                page = prepare.render_pdf_page(path, page_no, settings)
            else:
                page = prepare.render_image_page(path, page_no, settings)
            renders.append((name, page_no, page, time.perf_counter() - started))
    results = {}
    for mode, quick in (("tesseract only", False), ("default", True)):
        settings = PrepareSettings(orientation_quick_check=quick)
        rows = []
        for name, page_no, page, render_s in renders:
            for angle in (0, 90, 180, 270):
                turned = page.image.rotate(angle, expand=True)  # PIL turns counter-clockwise
                started = time.perf_counter()
                grey = turned.convert("L")
                ink = ink_share(grey)
                look_s = time.perf_counter() - started
                started = time.perf_counter()
                found = detect_orientation(grey, page.dpi, settings, ink)
                # PIL turned it ``angle`` counter-clockwise: it takes that much more clockwise.
                needs = (NOT_UPRIGHT.get((name, page_no), 0) + angle) % 360
                rows.append({
                    "file": name, "page": page_no, "angle": angle, "needs": needs, "found": found.angle,
                    "confidence": found.confidence, "turn": found.turn, "note": found.note,
                    "method": found.method, "detect_s": round(time.perf_counter() - started, 4),
                    "render_s": round(render_s, 4), "prepare_s": round(render_s + look_s, 4),
                })
                print(mode, json.dumps(rows[-1]), flush=True)
        results[mode] = {"rows": rows, "summary": summarise(rows, settings)}
        print(json.dumps({"mode": mode, "summary": results[mode]["summary"]}), flush=True)
    base, default = results["tesseract only"]["summary"], results["default"]["summary"]
    print(f"detection per page, mean: tesseract only {base['detect_s_mean']:.3f} s, default "
          f"{default['detect_s_mean']:.3f} s ({base['detect_s_mean'] / default['detect_s_mean']:.1f}x less); "
          f"default/render: median {default['detect_over_render']:.2f}, mean {default['mean_detect_over_render']:.2f}; "
          f"default's share of a page's preparation: median {default['share_of_prepare_median']:.3f}, "
          f"mean {default['share_of_prepare_mean']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def summarise(rows: list[dict], settings: object) -> dict:
    threshold = settings.orientation_min_confidence
    # A page with text enough to judge: tesseract answered at the threshold or more for one of
    # its four copies (a photo, a chart or a two-line page never reaches it: it is to be left alone).
    judgeable = {
        (r["file"], r["page"]) for r in rows if r["confidence"] is not None and r["confidence"] >= threshold
    }
    text_rows = [r for r in rows if (r["file"], r["page"]) in judgeable]
    sparse_rows = [r for r in rows if (r["file"], r["page"]) not in judgeable]
    # The threshold's evidence: tesseract's own answers (Leptonica's confidences are on its own scale).
    right = [r for r in rows if r["method"] == "tesseract" and r["found"] == r["needs"] and r["needs"]]
    wrong = [r for r in rows if r["method"] == "tesseract" and r["found"] != r["needs"]]
    detect = [r["detect_s"] for r in rows]
    render = [r["render_s"] for r in rows]
    prepared = [r["prepare_s"] for r in rows]
    # per page: detection / (detection + the rest of the page's preparation)
    share = [r["detect_s"] / max(r["detect_s"] + r["prepare_s"], 1e-9) for r in rows]
    return {
        "pages": len(rows) // 4,
        "text_pages": len(judgeable),
        "copies_of_text_pages": len(text_rows),
        "upright_after": sum((r["needs"] - r["turn"]) % 360 == 0 for r in text_rows),
        "share_upright_after": round(
            sum((r["needs"] - r["turn"]) % 360 == 0 for r in text_rows) / max(len(text_rows), 1), 4
        ),
        "wrongly_turned": sum(r["turn"] and r["turn"] != r["needs"] for r in rows),
        "upright_turned": sum(r["turn"] and not r["needs"] for r in rows),
        "sparse_pages": len({(r["file"], r["page"]) for r in sparse_rows}),
        "sparse_turned": sum(bool(r["turn"]) for r in sparse_rows),
        "min_confidence_right": min((r["confidence"] for r in right), default=None),
        "max_confidence_wrong": max((r["confidence"] for r in wrong), default=None),
        "threshold": threshold,
        "right_answers": len(right),
        "right_kept_at_14": sum(r["confidence"] >= 14 for r in right),
        "right_kept_at_12": sum(r["confidence"] >= 12 for r in right),
        "right_kept_at_threshold": sum(r["confidence"] >= threshold for r in right),
        "detect_s_median": round(statistics.median(detect), 3),
        "render_s_median": round(statistics.median(render), 3),
        "detect_over_render": round(statistics.median(detect) / max(statistics.median(render), 1e-9), 2),
        "detect_s_mean": round(statistics.mean(detect), 4),
        "mean_detect_over_render": round(statistics.mean(detect) / max(statistics.mean(render), 1e-9), 2),
        "prepare_s_median": round(statistics.median(prepared), 3),
        "share_of_prepare_median": round(statistics.median(share), 3),
        "share_of_prepare_mean": round(statistics.mean(detect) / max(statistics.mean(detect) + statistics.mean(prepared), 1e-9), 3),
        "decided_by": {m: sum(r["method"] == m for r in rows) for m in ("leptonica", "tesseract", "")},
    }


if __name__ == "__main__":
    main()
