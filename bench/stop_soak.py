"""Stop soak: SIGHUP then SIGTERM against a live ``chandrad run``, at many timings, many times.

Each cycle starts the real daemon (the tesseract engine) on a fresh tree, drops a few documents at
some cycles (so that some stops find documents in flight), sends SIGHUP, waits one of the timings
below, sends SIGTERM, and times the exit. A stop that takes over ``--limit`` seconds (default 10)
or ends with any status but 0 is a failure. Two daemons run side by side (``--parallel``), and the
issue asks for it to be run with ``make test``'s ``-n 2`` load beside it: the cores are busy.

    .venv/bin/python bench/stop_soak.py --cycles 200 --out bench/results/stop-soak-<date>.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO.parent / "shared" / "corpus"
# SIGTERM this long after SIGHUP: before, during and after the reload's checks and a document's pages.
TIMINGS = (0.0, 0.001, 0.005, 0.01, 0.03, 0.1, 0.2, 0.3, 0.6, 1.0, 1.5, 2.5)


def write_config(root: Path) -> Path:
    config = root / "config.toml"
    config.write_text(
        f'state_dir = "{root / "state"}"\nlog_format = "json"\nmetrics_address = ""\n'
        "drain_seconds = 2\nstop_timeout_seconds = 8\n"
        f'[engine]\nkind = "tesseract"\n\n[[inbox]]\npath = "{root / "inbox"}"\nsettle_seconds = 0.5\n'
    )
    return config


def one_cycle(n: int, base: Path, limit: float) -> dict[str, Any]:
    root = base / f"cycle-{n}"
    root.mkdir()
    config = write_config(root)
    log_path = root / "daemon.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "chandrad", "run", "--config", str(config)],
            stdout=log, stderr=subprocess.STDOUT, cwd=root,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "HF_HUB_OFFLINE": "1"},
        )
    deadline = time.monotonic() + 120
    while b'"watching inbox"' not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            return {"cycle": n, "error": "did not start", "log": log_path.read_text(errors="replace")[-2000:]}
        time.sleep(0.05)
    if n % 3 == 0:
        for name in ("trivial.pdf", "simple-no-dpi.png", "multi-page-digital.pdf"):
            shutil.copy(CORPUS / name, root / "inbox" / name)
        time.sleep(0.7 + (n % 5) * 0.3)  # settled, and in progress at some of the stops
    after = TIMINGS[n % len(TIMINGS)]
    proc.send_signal(signal.SIGHUP)
    time.sleep(after)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(limit * 6)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(10)
        code = None
    took = time.monotonic() - started
    result = {"cycle": n, "term_after_hup_s": after, "stop_s": round(took, 3), "exit": code}
    if code != 0 or took > limit:
        result["log"] = log_path.read_text(errors="replace")[-3000:]
    else:
        shutil.rmtree(root, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--limit", type=float, default=10.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="stop-soak-"))
    begun = time.monotonic()
    with ThreadPoolExecutor(args.parallel) as pool:
        results = list(pool.map(lambda n: one_cycle(n, base, args.limit), range(args.cycles)))
    stops = sorted(r["stop_s"] for r in results if "stop_s" in r)
    bad = [r for r in results if r.get("exit") != 0 or r.get("stop_s", 0) > args.limit]
    summary = {
        "bench": "stop_soak",
        "date": datetime.now().isoformat(timespec="seconds"),
        "git": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO).stdout.strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "cycles": args.cycles,
        "parallel": args.parallel,
        "wall_s": round(time.monotonic() - begun, 1),
        "stop_s": {
            "p50": round(statistics.median(stops), 3) if stops else None,
            "p99": round(stops[int(len(stops) * 0.99) - 1], 3) if len(stops) >= 100 else None,
            "max": stops[-1] if stops else None,
        },
        "over_limit_or_failed": len(bad),
        "failures": bad[:5],
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=1))
    for failure in bad[:5]:
        print(f"cycle {failure['cycle']}: {failure.get('error') or failure}", file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1) + "\n")
    shutil.rmtree(base, ignore_errors=True) if not bad else print(f"kept: {base}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
