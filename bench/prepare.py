#!/usr/bin/env python
"""Benchmark the prepare stage (not a test: numbers, printed as ratios against a baseline measured now).

1. Throughput: chandrad's prepare (inspect + Ghostscript normalisation + page-by-page rendering at
   Chandra's DPI rule) against plain `pdftoppm -r 192` of the whole file, on the same multi-page PDF.
2. Memory: peak RSS of a process that prepares a generated 300-page PDF against a 3-page one.
   Flat memory means the ratio stays near 1.
3. Pages side by side (``--parallel``): each page of the corpus scans as the daemon's page reader
   takes it (the PDFium render in one of its kept renderer children, the ink measure, orientation
   by Leptonica and, where it cannot decide, tesseract), on as many threads as there are cores,
   against ``pdftoppm -r 192`` of the same pages on as many threads; and the same with a renderer
   child started for every page (``chandrad-child-a-page``, the daemon before the kept renderers).
   Prints pages/s, CPU seconds a page (this process and its children: the kept renderers are ended
   before the count is taken) and what that makes on 16 cores if the work scales with them.

Usage: python bench/prepare.py [--pages 24] [--big 300] [--parallel] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# CHANDRAD_CORPUS: where the corpus is elsewhere (the device: bench/stage-device.sh carries these scans).
CORPUS = Path(os.environ.get("CHANDRAD_CORPUS") or REPO.parent / "shared" / "corpus")
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


SCANS = [
    "linn.pdf", "c02-22.pdf", "cardinal.pdf", "lichtenstein.pdf", "kcs.pdf", "francais.pdf", "skew.pdf",
    "multipage.pdf", "epson.pdf", "ccitt.pdf", "jbig2.pdf",
]


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def parallel(rounds: int) -> dict:
    """The page reader's work per page on every core, against pdftoppm on every core."""
    from concurrent.futures import ThreadPoolExecutor

    from chandrad import prepare
    from chandrad.config import PrepareSettings
    from chandrad.scan.blank import ink_share
    from chandrad.scan.orientation import detect_orientation
    from chandrad.tools import ToolWorkers

    settings = PrepareSettings()
    pages = [
        (CORPUS / name, n)
        for name in SCANS
        for n in range(1, min(prepare.pdf_info(CORPUS / name, settings).pages, 4) + 1)
    ] * rounds
    workers = os.cpu_count() or 1

    renderers: ToolWorkers | None = None

    def ours(job: tuple[Path, int]) -> str:
        page = prepare.render_pdf_page(job[0], job[1], settings, None, renderers)
        grey = page.image.convert("L")
        return detect_orientation(grey, page.dpi, settings, ink_share(grey)).method

    def baseline(job: tuple[Path, int]) -> None:
        subprocess.run(["pdftoppm", "-r", "192", "-f", str(job[1]), "-l", str(job[1]), str(job[0])],
                       check=True, stdout=subprocess.DEVNULL)

    result: dict = {"pages": len(pages), "workers": workers}
    for label, work in (("pdftoppm", baseline), ("chandrad-child-a-page", ours), ("chandrad", ours)):
        renderers = ToolWorkers(keep=workers) if label == "chandrad" else None
        cpu, started = cpu_seconds(), time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            methods = list(pool.map(work, pages))
        wall = time.perf_counter() - started
        if renderers is not None:
            renderers.close()  # ended and waited for: their CPU time is counted in RUSAGE_CHILDREN
        per_page = (cpu_seconds() - cpu) / len(pages)
        result[label] = {"pages_per_s": round(len(pages) / wall, 2), "cpu_s_per_page": round(per_page, 3),
                         "pages_per_s_16_cores": round(16 / per_page, 1)}
        if label.startswith("chandrad"):
            result[label]["orientation_by"] = {m or "none": methods.count(m) for m in set(methods)}
    result["ratio_pages_per_s"] = round(result["chandrad"]["pages_per_s"] / result["pdftoppm"]["pages_per_s"], 2)
    result["ratio_kept_renderers_to_child_a_page"] = round(
        result["chandrad"]["pages_per_s"] / result["chandrad-child-a-page"]["pages_per_s"], 2
    )
    return result


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
    parser.add_argument("--parallel", action="store_true", help="only the pages-side-by-side measurement")
    parser.add_argument("--rounds", type=int, default=3, help="--parallel: times through the corpus pages")
    parser.add_argument("--json", type=Path, help="--parallel: also write the result here")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(prepare_all(Path(args.child[0]), Path(args.child[1]))))
        return
    if args.parallel:
        result = parallel(args.rounds)
        print(json.dumps(result, indent=1))
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
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
