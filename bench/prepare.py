#!/usr/bin/env python
"""Benchmark the prepare stage (not a test: numbers, printed as ratios against a baseline measured now).

1. Throughput: chandrad's prepare (inspect + Ghostscript normalisation + page-by-page rendering at
   Chandra's DPI rule) against plain `pdftoppm -r 192` of the whole file, on the same multi-page PDF.
2. Memory: peak RSS of a process that prepares a generated 300-page PDF against a 3-page one.
   Flat memory means the ratio stays near 1.

Usage: python bench/prepare.py [--pages 24] [--big 300]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO.parent / "shared" / "corpus"
sys.path.insert(0, str(REPO))


def make_pdf(target: Path, pages: int) -> Path:
    """Concatenate multipage.pdf (6 scanned pages) with Ghostscript until ``pages`` pages."""
    source = CORPUS / "multipage.pdf"
    copies = -(-pages // 6)
    subprocess.run(
        ["gs", "-q", "-dNOPAUSE", "-dBATCH", "-sDEVICE=pdfwrite", f"-dLastPage={pages}",
         f"-sOutputFile={target}", *[str(source)] * copies],
        check=True,
    )
    return target


def prepare_all(pdf: Path, work: Path) -> dict:
    from chandrad.config import PrepareSettings
    from chandrad.prepare import prepare_document
    from chandrad.testing import render_pages

    settings = PrepareSettings()
    started = time.perf_counter()
    doc = prepare_document(pdf, work, "lossless", settings)
    pixels = 0
    for page in render_pages(doc, settings):
        pixels += page.image.width * page.image.height
    seconds = time.perf_counter() - started
    return {
        "pages": doc.page_count, "seconds": seconds, "megapixels": pixels / 1e6,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def run_child(pdf: Path, work: Path) -> dict:
    """Measure in a fresh process so peak RSS belongs to this document alone."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", str(pdf), str(work)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pages", type=int, default=24)
    parser.add_argument("--big", type=int, default=300)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(prepare_all(Path(args.child[0]), Path(args.child[1]))))
        return

    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        pdf = make_pdf(tmp / f"doc{args.pages}.pdf", args.pages)

        started = time.perf_counter()
        subprocess.run(["pdftoppm", "-r", "192", str(pdf), str(tmp / "baseline")], check=True)
        baseline_s = time.perf_counter() - started
        ours = run_child(pdf, tmp / "work")
        print(f"throughput on {args.pages} pages ({ours['megapixels']:.0f} MP rendered):")
        print(f"  pdftoppm -r 192 whole file : {args.pages / baseline_s:6.2f} pages/s")
        print(f"  chandrad prepare           : {ours['pages'] / ours['seconds']:6.2f} pages/s")
        print(f"  ratio chandrad/pdftoppm    : {(ours['pages'] / ours['seconds']) / (args.pages / baseline_s):6.2f}")

        small = run_child(make_pdf(tmp / "small.pdf", 3), tmp / "w-small")
        big = run_child(make_pdf(tmp / "big.pdf", args.big), tmp / "w-big")
        print("peak RSS of the preparing process:")
        print(f"  3 pages   : {small['peak_rss_mb']:7.1f} MB")
        print(f"  {args.big} pages : {big['peak_rss_mb']:7.1f} MB  ({big['seconds']:.0f} s)")
        print(f"  ratio {args.big}/3 : {big['peak_rss_mb'] / small['peak_rss_mb']:6.2f}")


if __name__ == "__main__":
    main()
