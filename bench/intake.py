"""Burst intake: how fast the real daemon takes in N files dropped at once while its workers render.

On the H200 the daemon took 192 dropped PDFs in over ~10 s (NOTES-gpu §11-§12): the first ~25 in
0.2 s, the rest at ~19 a second once documents were preparing. This bench reproduces that on the
CPU: ``chandrad run`` (the tesseract engine, many documents in flight so that workers render while
files are still arriving) from each ``--src`` tree in turn, N one-page PDFs renamed into the inbox at
once, timed from the drop to each "document queued" event of the daemon's log. The daemon is stopped
once every file is queued (OCR speed is not what is measured). Ratios are against the first --src,
measured in the same run.

    .venv/bin/python bench/intake.py --src /work/base --src . --files 96 --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw


def make_pdfs(folder: Path, count: int) -> list[Path]:
    """``count`` distinct one-page US-Letter PDFs at 192 dpi (a line of text each, so no two are copies)."""
    folder.mkdir(parents=True)
    paths = []
    for n in range(count):
        image = Image.new("RGB", (1632, 2112), "white")
        ImageDraw.Draw(image).text((200, 200 + n), f"Burst intake page {n}", fill="black")
        path = folder / f"page-{n:04d}.pdf"
        image.save(path, "PDF", resolution=192.0)
        paths.append(path)
    return paths


def events(log_path: Path) -> list[dict[str, Any]]:
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def at(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def wait_for(predicate: Any, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)


def one_run(
    src: Path, pdfs: list[Path], root: Path, documents: int, spy: str | None = None, until: str = "queued"
) -> dict[str, Any]:
    inbox, state, log_path, config = root / "inbox", root / "state", root / "daemon.log", root / "config.toml"
    inbox.mkdir(parents=True)
    config.write_text(
        f'state_dir = "{state}"\nlog_format = "json"\nmetrics_address = ""\n'
        f"max_documents_in_flight = {documents}\n"
        '[engine]\nkind = "tesseract"\n'
        f'[[inbox]]\npath = "{inbox}"\nsettle_seconds = 1\nduplicates = "reprocess"\n'
    )
    # The tree measured first, then whatever PYTHONPATH holds (a GPU host's /root/site of packages).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH", "")])),
           "PYTHONUNBUFFERED": "1"}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "chandrad", "run", "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    profiler = None
    try:
        wait_for(lambda: any(e.get("event") == "watching inbox" for e in events(log_path)) or proc.poll() is not None,
                 120, "the daemon to watch its inbox")
        if proc.poll() is not None:
            raise SystemExit(f"daemon from {src} exited at start:\n{log_path.read_text()[-2000:]}")
        # Copied next to the inbox first, then renamed in: a drop that arrives all at once.
        staged = [root / p.name for p in pdfs]
        for source, target in zip(pdfs, staged, strict=True):
            target.write_bytes(source.read_bytes())
        # py-spy, when given: stacks of the threads holding the GIL (one process runs the loop,
        # intake's threads and, on a GPU host, vLLM's input processing: what they contend for).
        if spy:
            profiler = subprocess.Popen([spy, "record", "--pid", str(proc.pid), "--gil", "--rate", "200", "--format",
                                         "raw", "--output", str(root / "gil.txt")],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        dropped_at = time.time()
        for target in staged:
            target.rename(inbox / target.name)
        wait_for(lambda: sum(e.get("event") == f"document {until}" for e in events(log_path)) >= len(pdfs)
                 or proc.poll() is not None, 600, f"every file to be {until}")
    finally:
        if spy and profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(60)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    queued = sorted(at(e) - dropped_at for e in events(log_path) if e.get("event") == "document queued")
    if len(queued) < len(pdfs):
        raise SystemExit(f"only {len(queued)} of {len(pdfs)} queued; see {log_path}")
    prepared_at = sorted(at(e) - dropped_at for e in events(log_path) if e.get("event") == "document prepared")
    prepared = len(prepared_at)
    if until == "prepared":  # every file taken in and prepared: what the engine waits for
        return {
            "all_prepared_s": round(prepared_at[-1], 3),
            "prepared_p50_s": round(statistics.median(prepared_at), 3),
            "prepared_p90_s": round(prepared_at[int(0.9 * (len(prepared_at) - 1))], 3),
            "all_queued_s": round(queued[-1], 3),
            "p90_s": round(queued[int(0.9 * (len(queued) - 1))], 3),
        }
    return {
        "all_queued_s": round(queued[-1], 3),
        "first_queued_s": round(queued[0], 3),
        "p50_s": round(statistics.median(queued), 3),
        "p90_s": round(queued[int(0.9 * (len(queued) - 1))], 3),
        "files_per_s": round(len(queued) / queued[-1], 2),
        "prepared_while_queueing": prepared,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", action="append", required=True, help="a tree holding chandrad/ (first = baseline)")
    ap.add_argument("--files", type=int, default=96)
    ap.add_argument("--documents", type=int, default=48, help="max_documents_in_flight (workers rendering)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per tree, interleaved")
    ap.add_argument("--out", help="also write the result JSON here")
    ap.add_argument("--spy", help="py-spy's path: profile the daemon's GIL holders during the burst")
    ap.add_argument("--keep", help="copy each run's folder (log, profile) here")
    ap.add_argument("--until", choices=("queued", "prepared"), default="queued",
                    help="time each file until it is queued (intake), or until it is prepared (intake and "
                         "the document's preparation: what the engine waits for)")
    a = ap.parse_args()
    srcs = [Path(s).resolve() for s in a.src]
    with tempfile.TemporaryDirectory(prefix="intake-bench-") as tmp:
        pdfs = make_pdfs(Path(tmp) / "pdfs", a.files)
        runs: dict[str, list[dict[str, Any]]] = {str(s): [] for s in srcs}
        for n in range(a.repeat):
            for i, src in enumerate(srcs):
                result = one_run(src, pdfs, Path(tmp) / f"run-{n}-{i}", a.documents, a.spy, a.until)
                if a.keep:
                    kept = Path(a.keep) / f"run-{n}-{i}"
                    kept.mkdir(parents=True, exist_ok=True)
                    for name in ("daemon.log", "gil.txt"):
                        if (Path(tmp) / f"run-{n}-{i}" / name).exists():
                            shutil.copy(Path(tmp) / f"run-{n}-{i}" / name, kept / name)
                runs[str(src)].append(result)
                print(f"[{src}] run {n + 1}: {json.dumps(result)}", flush=True)
    summary: dict[str, Any] = {"files": a.files, "documents_in_flight": a.documents, "cores": os.cpu_count(),
                               "runs": runs, "median_all_queued_s": {}}
    key = f"all_{a.until}_s"
    summary["until"] = a.until
    for src, results in runs.items():
        summary["median_all_queued_s"][src] = statistics.median(r["all_queued_s"] for r in results)
        summary.setdefault(f"median_{key}", {})[src] = statistics.median(r[key] for r in results)
    base = summary[f"median_{key}"][str(srcs[0])]
    for src in srcs:
        value = summary[f"median_{key}"][str(src)]
        print(f"{src}: every file {a.until} after {value:.2f} s (median of {a.repeat}); "
              f"{base / value:.2f}x the baseline's speed")
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
