#!/usr/bin/env python
"""How fast this machine's disk makes a small file and its folder durable (not a test: numbers).

Intake makes every claimed file durable with about five fsyncs (its claim record, the claim folder,
the host's claims folder, the inbox folder): on a disk whose cache flush is slow, their latency,
and how many of them run at once, set intake's pace. Prints, for the folder given (default: the
system's temporary folder, where ``bench/intake.py`` works): one thread's latency of a 100-byte
write + fsync + its folder's fsync, and the rate of such pairs with 1, 4, 16, 32 and 64 threads
at once (each thread its own folder, as each claim has its own).

Usage: python bench/fsync_probe.py [--dir DIR] [--seconds 1.0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path


def durable_pair(folder: Path, n: int) -> None:
    fd = os.open(folder / f"f{n}", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        os.write(fd, b"x" * 100)
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def rate(root: Path, threads: int, seconds: float) -> float:
    done = [0] * threads
    stop = time.monotonic() + seconds

    def run(index: int) -> None:
        folder = root / f"t{threads}-{index}"
        folder.mkdir()
        n = 0
        while time.monotonic() < stop:
            durable_pair(folder, n)
            n += 1
        done[index] = n

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    started = time.monotonic()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(done) / (time.monotonic() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="fsync-probe-") as scratch:
        root = Path(scratch)
        (root / "one").mkdir()
        latencies = []
        for n in range(50):
            started = time.perf_counter()
            durable_pair(root / "one", n)
            latencies.append(time.perf_counter() - started)
        result = {
            "dir": str(args.dir),
            "pair_latency_ms_median": round(statistics.median(latencies) * 1000, 3),
            "pair_latency_ms_max": round(max(latencies) * 1000, 3),
            "pairs_per_s_by_threads": {t: round(rate(root, t, args.seconds), 1) for t in (1, 4, 16, 32, 64)},
        }
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
