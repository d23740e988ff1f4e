#!/usr/bin/env python
"""chandrad's CPU path against OCRmyPDF, one run, same files, same cores (not a test: numbers).

What a user without a GPU compares: ``chandrad once --engine tesseract --formats md,pdf`` against
``ocrmypdf --output-type pdfa`` (OCRmyPDF's defaults otherwise), on

- the corpus scans (image-only PDFs; ``linn.pdf`` has its ground truth in ``linn.txt``), and
- born-digital corpus PDFs rasterized here at 300 dpi into image-only PDFs (8-bit gray, Flate:
  lossless), whose own text (``pdftotext``) is the ground truth; one of them also turned a quarter
  turn in its pixels, as a feeder delivers a page put in sideways.

OCRmyPDF runs as a user would run it over a folder of files: as many files at once as there are
cores, ``-j 1`` each (its best throughput for a batch; one file with ``-j N`` leaves cores idle on
one-page files), in its default mode (``--mode skip/redo`` are refused beside Debian 12's
Ghostscript 10.0.0, and every input here is image-only anyway), once as it comes and once with
``--rotate-pages`` (off by default in OCRmyPDF, on by default in chandrad).

Printed per tool: pages/s over the whole set (wall clock, first start to last exit); word recall
against the ground truth of the Markdown (chandrad) and of each searchable PDF's text layer
(``pdftotext``), per page and in all; output size against the input; whether every original image
stream is in the output byte for byte; whether each output page renders like the input page
(100 dpi gray, mean and max pixel difference). Ratios are chandrad against OCRmyPDF measured in
the same run.

Usage: python bench/peers.py [--cores N] [--copies K] [--json OUT] [--ocrmypdf PATH] [--keep DIR]
On the GPU machine's cores: bench/peers_device.sh.
OCRmyPDF is installed on first use into bench/.peers-venv (not the project's venv: it pins its own
pikepdf and pdfminer).
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# CHANDRAD_CORPUS: where the corpus is on a machine without ../shared (the device: .bench-carry/corpus)
CORPUS = Path(os.environ.get("CHANDRAD_CORPUS", REPO.parent / "shared" / "corpus"))
PEER_VENV = REPO / "bench" / ".peers-venv"
# The release the issue's first measurement used; pinned so that runs on different days compare.
OCRMYPDF = "ocrmypdf==17.13.0"

SCANS = ["linn.pdf", "c02-22.pdf", "skew.pdf", "cardinal.pdf", "ccitt.pdf", "jbig2.pdf", "lichtenstein.pdf"]
# Born-digital PDFs with enough text to score: (file, pages); rasterized at 300 dpi.
DIGITAL = [("multi_column_miss.pdf", 1), ("mathfuncs.pdf", 1), ("junk-prefix.pdf", 2), ("multi-page-digital.pdf", 3)]
SIDEWAYS = "multi_column_miss.pdf"
RASTER_DPI = 300
COMPARE_DPI = 100


@dataclass
class PageScore:
    document: str
    page: int
    truth_words: int
    recall: dict[str, float] = field(default_factory=dict)


@dataclass
class DocumentResult:
    document: str
    pages: int
    input_bytes: int
    output_bytes: int = 0
    images_kept: bool | None = None
    render_mean_diff: float | None = None
    render_max_diff: int | None = None
    # Pages the output shows turned (a /Rotate added): compared turned back, and resampled so.
    pages_turned: int = 0
    error: str | None = None


# -- inputs --------------------------------------------------------------------------------------


def image_pdf(pngs: list[Path], sizes: list[tuple[float, float]], target: Path) -> None:
    """An image-only PDF, one 8-bit gray Flate image per page at the page's size: lossless."""
    import zlib

    import pikepdf
    from PIL import Image

    pdf = pikepdf.new()
    for png, (width_pt, height_pt) in zip(pngs, sizes, strict=True):
        with Image.open(png) as image:
            gray = image.convert("L")
            data = zlib.compress(gray.tobytes(), 6)
            width, height = gray.size
        xobject = pikepdf.Stream(pdf, data)
        xobject.Type, xobject.Subtype = pikepdf.Name.XObject, pikepdf.Name.Image
        xobject.Width, xobject.Height, xobject.BitsPerComponent = width, height, 8
        xobject.ColorSpace, xobject.Filter = pikepdf.Name.DeviceGray, pikepdf.Name.FlateDecode
        contents = pikepdf.Stream(pdf, f"q {width_pt:.3f} 0 0 {height_pt:.3f} 0 0 cm /Im0 Do Q".encode())
        page = pikepdf.Dictionary(
            Type=pikepdf.Name.Page,
            MediaBox=[0, 0, width_pt, height_pt],
            Resources=pikepdf.Dictionary(XObject=pikepdf.Dictionary(Im0=xobject)),
            Contents=contents,
        )
        pdf.pages.append(pikepdf.Page(page))
    pdf.save(target)


def page_size(pdf: Path, page: int) -> tuple[float, float]:
    info = subprocess.run(
        ["pdfinfo", "-f", str(page), "-l", str(page), str(pdf)], capture_output=True, text=True, check=True
    ).stdout
    match = re.search(rf"Page\s+{page} size:\s+([\d.]+) x ([\d.]+)", info)
    assert match, info
    return float(match.group(1)), float(match.group(2))


def pdf_text(pdf: Path, page: int) -> str:
    return subprocess.run(
        ["pdftotext", "-q", "-f", str(page), "-l", str(page), str(pdf), "-"], capture_output=True, text=True
    ).stdout


def build_inputs(work: Path) -> tuple[list[Path], dict[tuple[str, int], str]]:
    """The input files, and the ground truth per (file name, page) where there is one."""
    inputs_dir = work / "inputs"
    inputs_dir.mkdir()
    truths: dict[tuple[str, int], str] = {}
    inputs = []
    for name in SCANS:
        shutil.copy(CORPUS / name, inputs_dir / name)
        inputs.append(inputs_dir / name)
    truths[("linn.pdf", 1)] = (CORPUS / "linn.txt").read_text(encoding="utf-8")
    from PIL import Image

    for name, pages in DIGITAL:
        source = CORPUS / name
        raster_dir = work / "raster" / name
        raster_dir.mkdir(parents=True)
        subprocess.run(
            ["pdftoppm", "-q", "-r", str(RASTER_DPI), "-gray", "-png", str(source), str(raster_dir / "p")], check=True
        )
        pngs = sorted(raster_dir.glob("p*.png"), key=lambda p: int(p.stem.split("-")[-1]))
        assert len(pngs) == pages, (name, pngs)
        sizes = [page_size(source, number) for number in range(1, pages + 1)]
        target = inputs_dir / f"{Path(name).stem}-300dpi.pdf"
        image_pdf(pngs, sizes, target)
        inputs.append(target)
        for number in range(1, pages + 1):
            truths[(target.name, number)] = pdf_text(source, number)
        if name == SIDEWAYS:
            # The page put in the feeder a quarter turn: its pixels turned, the page box with them.
            turned = raster_dir / "turned.png"
            with Image.open(pngs[0]) as image:
                image.rotate(90, expand=True).save(turned)
            target = inputs_dir / f"{Path(name).stem}-300dpi-sideways.pdf"
            image_pdf([turned], [(sizes[0][1], sizes[0][0])], target)
            inputs.append(target)
            truths[(target.name, 1)] = truths[(f"{Path(name).stem}-300dpi.pdf", 1)]
    return inputs, truths


def with_copies(inputs: list[Path], truths: dict[tuple[str, int], str], copies: int) -> list[Path]:
    """The inputs ``copies`` times over (``name-copyK``, ground truth alike): a batch that keeps
    many cores busy, where the 12 files alone leave most of 16 cores idle in either tool."""
    out = list(inputs)
    for k in range(2, copies + 1):
        for source in inputs:
            copy = source.with_name(f"{source.stem}-copy{k}{source.suffix}")
            shutil.copy(source, copy)
            out.append(copy)
            for (name, page), text in list(truths.items()):
                if name == source.name:
                    truths[(copy.name, page)] = text
    return out


# -- scoring -------------------------------------------------------------------------------------

_TAG = re.compile(r"<[^>]+>")
_WORD = re.compile(r"\w+", re.UNICODE)


# A word broken at a line's end ("func- tion") counts as the word: pdftotext joins such halves,
# the ground truth (linn.txt) and the Markdown keep them apart.
_BROKEN = re.compile(r"(\w)-\s+(\w)")


def words(text: str) -> list[str]:
    return _WORD.findall(_BROKEN.sub(r"\1\2", html.unescape(_TAG.sub(" ", text))).lower())


def recall(truth: str, found: str) -> float:
    truth_words = collections.Counter(words(truth))
    if not truth_words:
        return float("nan")
    return sum((truth_words & collections.Counter(words(found))).values()) / sum(truth_words.values())


def image_digests(pdf: Path) -> list[str]:
    import pikepdf

    digests = []
    with pikepdf.open(pdf) as document:
        for page in document.pages:
            for image in page.get_images().values():
                digests.append(hashlib.sha256(image.read_raw_bytes()).hexdigest())
    return digests


def render_difference(original: Path, output: Path, work: Path) -> tuple[float, int, int]:
    """Mean and max gray difference between the two files' pages rendered at COMPARE_DPI; a page
    the output shows turned (a /Rotate added, as ``--rotate-pages`` does) is compared turned back."""
    import numpy as np
    from PIL import Image

    frames = []
    for label, pdf in (("in", original), ("out", output)):
        prefix = work / f"{output.stem}-{label}"
        subprocess.run(["pdftoppm", "-q", "-r", str(COMPARE_DPI), "-gray", str(pdf), str(prefix)], check=True)
        frames.append(sorted(work.glob(f"{prefix.name}-*.pgm"), key=lambda p: int(p.stem.split("-")[-1])))
    if len(frames[0]) != len(frames[1]):
        return float("inf"), 255, 0
    means, peak, turned = [], 0, 0
    for left, right in zip(*frames, strict=True):
        a = np.asarray(Image.open(left), dtype=np.int16)
        b = np.asarray(Image.open(right), dtype=np.int16)
        candidates = [(k, np.abs(a - np.rot90(b, k))) for k in range(4) if np.rot90(b, k).shape == a.shape]
        if not candidates:
            return float("inf"), 255, turned
        k, diff = min(candidates, key=lambda pair: float(pair[1].mean()))
        turned += k != 0
        means.append(float(diff.mean()))
        peak = max(peak, int(diff.max()))
    return max(means), peak, turned


# -- the runs ------------------------------------------------------------------------------------


def ocrmypdf_command(explicit: Path | None) -> Path:
    if explicit is not None:
        return explicit
    binary = PEER_VENV / "bin" / "ocrmypdf"
    if not binary.exists():
        print(f"installing {OCRMYPDF} into {PEER_VENV}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "venv", str(PEER_VENV)], check=True)
        subprocess.run([str(PEER_VENV / "bin" / "pip"), "install", "-q", OCRMYPDF], check=True)
    return binary


def pinned(cores: set[int]) -> list[str]:
    return ["taskset", "-c", ",".join(str(core) for core in sorted(cores))]


def run_chandrad(inputs: list[Path], out_dir: Path, cores: set[int], work: Path, prepare: str) -> float:
    config = work / "chandrad.toml"
    # Embedded defaults but for the folders, which must not be the service's.
    config.write_text(
        f'state_dir = "{work / "state"}"\n' + (f"[prepare]\n{prepare}\n" if prepare else ""), encoding="utf-8"
    )
    # this checkout first, then wherever its dependencies are (the device: /root/site)
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    started = time.perf_counter()
    subprocess.run(
        [
            *pinned(cores),
            sys.executable,
            "-m",
            "chandrad",
            "once",
            "--config",
            str(config),
            "--engine",
            "tesseract",
            "--formats",
            "md,pdf,json",
            "-o",
            str(out_dir),
            *map(str, inputs),
        ],
        check=True,
        env=environment,
        stdout=subprocess.DEVNULL,
    )
    return time.perf_counter() - started


def run_ocrmypdf(
    binary: Path, inputs: list[Path], out_dir: Path, cores: set[int], extra: list[str]
) -> tuple[float, dict[str, str]]:
    out_dir.mkdir(parents=True)
    errors: dict[str, str] = {}

    def one(source: Path) -> None:
        done = subprocess.run(
            [
                *pinned(cores),
                str(binary),
                "--output-type",
                "pdfa",
                "-j",
                "1",
                *extra,
                str(source),
                str(out_dir / source.name),
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            errors[source.name] = (
                done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"
            )

    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(cores)) as pool:
        list(pool.map(one, inputs))
    return time.perf_counter() - started, errors


def page_count(pdf: Path) -> int:
    info = subprocess.run(["pdfinfo", str(pdf)], capture_output=True, text=True).stdout
    match = re.search(r"^Pages:\s+(\d+)", info, re.M)
    return int(match.group(1)) if match else 0


def score(
    tool: str,
    inputs: list[Path],
    outputs: dict[str, Path],
    truths: dict[tuple[str, int], str],
    work: Path,
    errors: dict[str, str],
    pages_by_tool: dict[tuple[str, int], PageScore],
    json_dir: Path | None = None,
) -> list[DocumentResult]:
    results = []
    compare_dir = work / "compare" / tool
    compare_dir.mkdir(parents=True)
    for source in inputs:
        result = DocumentResult(source.name, page_count(source), source.stat().st_size)
        output = outputs.get(source.name)
        if output is None or not output.exists():
            result.error = errors.get(source.name, "no output")
            results.append(result)
            continue
        result.output_bytes = output.stat().st_size
        kept = collections.Counter(image_digests(output))
        result.images_kept = all(kept[digest] > 0 for digest in image_digests(source))
        result.render_mean_diff, result.render_max_diff, result.pages_turned = render_difference(
            source, output, compare_dir
        )
        read_pages: list[str] = []
        if json_dir is not None:
            document = json.loads((json_dir / source.stem / f"{source.stem}.json").read_text(encoding="utf-8"))
            read_pages = [" ".join(chunk["content"] for chunk in page["chunks"]) for page in document["pages"]]
        for number in range(1, result.pages + 1):
            truth = truths.get((source.name, number))
            if truth is None:
                continue
            page = pages_by_tool.setdefault((source.name, number), PageScore(source.name, number, len(words(truth))))
            page.recall[f"{tool} pdf layer"] = recall(truth, pdf_text(output, number))
            if read_pages:
                page.recall[f"{tool} markdown"] = recall(truth, read_pages[number - 1])
        results.append(result)
    return results


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return ""
    found = re.search(r"^model name\s*:\s*(.+)$", text, re.MULTILINE)
    return found.group(1).strip() if found else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=int, default=None, help="run both on the first N cores (default: all)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--ocrmypdf", type=Path, default=None, help="an installed ocrmypdf to use")
    parser.add_argument("--keep", type=Path, default=None, help="leave the inputs and outputs in this folder")
    parser.add_argument("--no-peer", action="store_true", help="chandrad alone (trying its settings)")
    parser.add_argument("--prepare", default="", help='chandrad [prepare] settings, TOML lines ("dpi = 300")')
    parser.add_argument("--copies", type=int, default=1, help="each input this many times (a batch for many cores)")
    args = parser.parse_args()
    available = sorted(os.sched_getaffinity(0))
    cores = set(available[: args.cores or len(available)])
    binary = ocrmypdf_command(args.ocrmypdf)
    version = subprocess.run([str(binary), "--version"], capture_output=True, text=True).stdout.strip()

    work = Path(tempfile.mkdtemp(prefix="chandrad-peers-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    inputs, truths = build_inputs(work)
    inputs = with_copies(inputs, truths, args.copies)
    total_pages = sum(page_count(source) for source in inputs)
    print(f"{len(inputs)} files, {total_pages} pages, {len(truths)} pages with ground truth; {len(cores)} cores")

    runs: dict[str, dict[str, object]] = {}
    pages: dict[tuple[str, int], PageScore] = {}
    chandrad_out = work / "chandrad"
    seconds = run_chandrad(inputs, chandrad_out, cores, work, args.prepare)
    outputs = {source.name: chandrad_out / source.stem / f"{source.stem}.pdf" for source in inputs}
    documents = score("chandrad", inputs, outputs, truths, work, {}, pages, json_dir=chandrad_out)
    runs["chandrad"] = {"seconds": seconds, "documents": documents}
    peer_runs = [] if args.no_peer else [("ocrmypdf", []), ("ocrmypdf --rotate-pages", ["--rotate-pages"])]
    for label, extra in peer_runs:
        out_dir = work / label.replace(" ", "").replace("--", "-")
        seconds, errors = run_ocrmypdf(binary, inputs, out_dir, cores, extra)
        outputs = {source.name: out_dir / source.name for source in inputs}
        documents = score(label, inputs, outputs, truths, work, errors, pages)
        runs[label] = {"seconds": seconds, "documents": documents}

    print(
        f"\n{'tool':26} {'s':>7} {'pages/s':>8} {'recall md':>10} {'recall pdf':>10} {'size':>6} "
        f"{'images kept':>11} {'renders alike':>13}"
    )
    summary: dict[str, dict[str, object]] = {}
    truth_total = sum(page.truth_words for page in pages.values())
    for label, run in runs.items():
        documents = run["documents"]
        assert isinstance(documents, list)

        def pooled(key: str) -> float | None:
            scored = [page for page in pages.values() if key in page.recall]
            if not scored:
                return None
            return sum(page.recall[key] * page.truth_words for page in scored) / truth_total

        done = [d for d in documents if d.error is None]
        size = sum(d.output_bytes for d in done) / max(1, sum(d.input_bytes for d in done))
        kept = sum(1 for d in done if d.images_kept)
        alike = sum(1 for d in done if d.render_mean_diff is not None and d.render_mean_diff < 1.0)
        turned = sum(d.pages_turned for d in done)
        seconds = float(run["seconds"])  # type: ignore[arg-type]
        md, layer = pooled(f"{label} markdown"), pooled(f"{label} pdf layer")
        summary[label] = {
            "seconds": round(seconds, 2),
            "pages_per_s": round(total_pages / seconds, 3),
            "recall_markdown": None if md is None else round(md, 3),
            "recall_pdf_layer": None if layer is None else round(layer, 3),
            "output_over_input": round(size, 3),
            "documents_images_kept": kept,
            "documents_rendering_alike": alike,
            "pages_shown_turned": turned,
            "documents_failed": {d.document: d.error for d in documents if d.error},
        }
        print(
            f"{label:26} {seconds:7.1f} {total_pages / seconds:8.3f} {md if md is not None else float('nan'):10.3f} "
            f"{layer if layer is not None else float('nan'):10.3f} {size:6.2f} {kept:>5}/{len(documents):<5} "
            f"{alike:>7}/{len(documents):<5}"
        )
    base = summary.get("ocrmypdf", summary["chandrad"])
    ratios = {
        label: round(float(entry["pages_per_s"]) / float(base["pages_per_s"]), 2)  # type: ignore[arg-type]
        for label, entry in summary.items()
    }
    print("\npages/s against ocrmypdf (defaults), same run:", ratios)
    print("\nper page recall (words of the ground truth found):")
    keys = sorted({key for page in pages.values() for key in page.recall})
    print(f"{'page':42} {'words':>5} " + " ".join(f"{key[:24]:>24}" for key in keys))
    for page in pages.values():
        print(
            f"{page.document + ' p' + str(page.page):42} {page.truth_words:5} "
            + " ".join(f"{page.recall.get(key, float('nan')):24.3f}" for key in keys)
        )
    print(
        "\nper document (output bytes / input bytes, images kept byte for byte, render diff mean/max, "
        "pages shown turned):"
    )
    for label, run in runs.items():
        for document in run["documents"]:  # type: ignore[union-attr]
            ratio = document.output_bytes / document.input_bytes if document.output_bytes else float("nan")
            print(
                f"  {label:24} {document.document:40} {ratio:6.2f} {document.images_kept!s:>5} "
                f"{document.render_mean_diff if document.render_mean_diff is not None else float('nan'):7.2f} "
                f"{document.render_max_diff if document.render_max_diff is not None else -1:4} {document.pages_turned:3} "
                f"{document.error or ''}"
            )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "date": time.strftime("%Y-%m-%d"),
                    "cores": len(cores),
                    "cpu": _cpu_model(),
                    "copies": args.copies,
                    "peer": version,
                    "files": len(inputs),
                    "pages": total_pages,
                    "summary": summary,
                    "pages_per_s_vs_ocrmypdf": ratios,
                    "per_page": [asdict(page) for page in pages.values()],
                    "per_document": {label: [asdict(d) for d in run["documents"]] for label, run in runs.items()},  # type: ignore[union-attr]
                },
                indent=2,
                default=str,
            )
            + "\n",
            encoding="utf-8",
        )
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
