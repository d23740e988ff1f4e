#!/usr/bin/env python
"""GPU soak: thousands of mixed-size pages through ``chandrad run``, with a planned recycle and a
``kill -9`` of an EngineCore in the middle, GPU memory sampled the whole time.

Pages: one-page PDFs at 192 dpi in real paper sizes (receipt, A5, A4, Letter, Legal, A3, an A1
poster), each with distinct text, dropped into the inbox at once. The daemon recycles each engine
after ``--recycle-after`` pages (replicas in turn); when ``--kill-at`` of the pages are published,
one EngineCore process gets SIGKILL. At the end every document must be published exactly once.

Writes ``--out`` (JSON: pages/s, recycles and restarts with their seconds, losses, duplicates,
GPU memory after warm-up per GPU) and ``--csv`` (t_s, gpu, memory_used_mib, util_pct every 2 s).
Stops itself at ``--deadline`` seconds and still writes what it measured.

    python bench/soak_gpu.py --src SRC --model DIR --gpus 0,1 --layout replicas --pages 2000 \\
        --in-flight 96 --max-tokens 1500 --recycle-after 500 --kill-at 0.6 --out soak.json --csv soak.csv
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import overhead  # noqa: E402  (its parse_args: the engine options of a run)
import overhead_common as common  # the page maker, journal and log readers, GPU and CPU probes

# Paper sizes in inches and how often each comes; the poster is scaled down by prepare's pixel cap.
SIZES = {
    "receipt": ((3.15, 8.0), 10), "A5": ((5.83, 8.27), 10), "A4": ((8.27, 11.69), 30),
    "Letter": ((8.5, 11.0), 30), "Legal": ((8.5, 14.0), 10), "A3": ((11.69, 16.54), 8),
    "poster-A1": ((23.39, 33.11), 2),
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--gpus", default="0")
    ap.add_argument("--layout", default="single")
    ap.add_argument("--pages", type=int, default=2000)
    ap.add_argument("--in-flight", type=int, default=96)
    ap.add_argument("--max-tokens", type=int, default=1500)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--recycle-after", type=int, default=500)
    ap.add_argument("--kill-at", type=float, default=0.6, help="fraction of pages published when an EngineCore is killed")
    ap.add_argument("--engine-arg", action="append", default=[])
    ap.add_argument("--dpi", type=int, default=192)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--cache", default=None, help="VLLM_CACHE_ROOT for the daemon, Triton cache inside")
    ap.add_argument("--deadline", type=float, default=540.0, help="seconds from the start of this script")
    ap.add_argument("--out", required=True)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--cpu", action="store_true", help="smoke-test the script on the CPU build (real weights, no dummy)")
    return ap.parse_args()


def _make(job: tuple[int, str, float, float, int]) -> tuple[int, str]:
    idx, path, w_in, h_in, dpi = job
    img = common.make_page(idx, round(w_in * dpi), round(h_in * dpi))
    img.save(path, "PDF", resolution=float(dpi))
    return idx, path


def make_pages(count: int, folder: Path, dpi: int) -> list[tuple[Path, str]]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(7)
    names = list(SIZES)
    kinds = rng.choices(names, weights=[SIZES[n][1] for n in names], k=count)
    jobs = [(i, str(folder / f"{kind}-{i:05d}.pdf"), *SIZES[kind][0], dpi) for i, kind in enumerate(kinds)]
    with multiprocessing.get_context("fork").Pool(os.cpu_count() or 1) as pool:
        pool.map(_make, jobs, chunksize=4)
    return [(Path(job[1]), kind) for job, kind in zip(jobs, kinds)]


class MemorySampler(threading.Thread):
    def __init__(self, t0: float) -> None:
        super().__init__(daemon=True)
        self.t0 = t0
        self.rows: list[tuple[float, int, float, float]] = []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            now = time.time() - self.t0
            for row in common.nvidia_smi("index,memory.used,utilization.gpu") or []:
                try:
                    self.rows.append((round(now, 1), int(row[0]), float(row[1]), float(row[2])))
                except (ValueError, IndexError):
                    pass
            self.stop_event.wait(2.0)


def main() -> int:
    a = parse_args()
    began = time.time()
    common.SRC = Path(a.src).resolve()
    sys.path.insert(0, str(common.SRC))
    root = Path(a.workdir)
    (root / "inbox").mkdir(parents=True, exist_ok=True)
    gpus = tuple(int(g) for g in a.gpus.split(","))
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": common.device_description(True), "gpus": len(gpus), "layout": a.layout,
        "options": vars(a), "git": common.git_state(),
    }
    sampler = MemorySampler(began)

    def save() -> None:
        Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
        with open(a.csv, "w") as handle:
            handle.write("t_s,gpu,memory_used_mib,util_pct\n")
            for row in sampler.rows:
                handle.write(",".join(str(x) for x in row) + "\n")

    engine_cli = ["--max-num-batched-tokens", str(a.max_num_batched_tokens), "--in-flight", str(a.in_flight),
                  "--max-tokens", str(a.max_tokens), "--gpu-memory-utilization", str(a.gpu_memory_utilization),
                  *([] if a.cpu else ["--gpu", "--load-format", "dummy"]),
                  *sum((["--engine-arg", e] for e in a.engine_arg), [])]
    options = overhead.parse_args(engine_cli)
    settings = common.engine_settings(options, a.model, gpus, a.layout)
    settings = settings.model_copy(update={"recycle_after_pages": a.recycle_after, "health_check_seconds": 5.0})
    options.settle_seconds, options.prepare_workers = 1.0, None
    options.max_documents_in_flight = None
    config = common.daemon_config(options, settings, root)
    log_path = root / "daemon.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(common.SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
           **common.compile_cache_env(a.cache or str(root / "vllm-cache"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    sampler.start()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "chandrad", "run", "--config", str(config)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    state = root / "state"
    killed: dict[str, Any] = {}
    t = time.time()
    try:
        # The pages are drawn while the engines load (minutes of GPU work, few CPU cores).
        pages = make_pages(a.pages, root / "to-drop", a.dpi)
        result["pages_made_s"] = round(time.time() - t, 1)
        result["page_sizes"] = {kind: sum(1 for _, k in pages if k == kind) for kind in SIZES}
        print(f"{len(pages)} pages made in {result['pages_made_s']} s: {result['page_sizes']}", flush=True)
        while not any(e.get("event") == "watching inbox" for e in common.read_events(log_path)):
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited at start:\n{log_path.read_text()[-3000:]}")
            if time.time() - began > a.deadline:
                raise RuntimeError("deadline before the daemon was ready")
            time.sleep(0.5)
        result["daemon_ready_s"] = round(time.time() - t, 1)
        print(f"daemon ready after {result['daemon_ready_s']} s", flush=True)
        drop_t = time.time()
        result["drop_at_s"] = round(drop_t - began, 1)
        for path, _ in pages:
            common.drop(path, root / "inbox")
        while True:
            rows = common.journal_docs(state)
            done = [r for r in rows if r["state"] in ("published", "failed")]
            published = sum(1 for r in done if r["state"] == "published")
            events = common.read_events(log_path)
            recycling = sum(e.get("event") == "engine recycling" for e in events) > \
                sum(e.get("event") == "engine recycled" for e in events)
            # Not during a planned recycle: the kill must hit an engine that is reading pages.
            if not killed and not recycling and published >= a.kill_at * len(pages):
                cores = [pid for pid in common.descendants(proc.pid) if "EngineCore" in common.cmdline(pid)]
                if cores:
                    os.kill(cores[0], signal.SIGKILL)
                    killed = {"pid": cores[0], "at_s": round(time.time() - began, 1), "published_before": published,
                              "engine_cores": len(cores)}
                    print(f"killed EngineCore {cores[0]} at {published} published", flush=True)
            if len(done) >= len(pages):
                break
            if proc.poll() is not None:
                raise RuntimeError(f"daemon died ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
            if time.time() - began > a.deadline:
                result["stopped_at_deadline"] = True
                break
            time.sleep(1.0)
        end = time.time()
        result["killed"] = killed
        rows = common.journal_docs(state)
        states: dict[str, int] = {}
        for r in rows:
            states[r["state"]] = states.get(r["state"], 0) + 1
        published_times = sorted(r["updated_at"] for r in rows if r["state"] == "published")
        outputs = [d for d in (root / "outbox").iterdir() if d.is_dir() and not d.name.startswith(".")] \
            if (root / "outbox").exists() else []
        names = [d.name for d in outputs]
        result.update({
            "documents": len(pages), "journal_states": states, "published": len(published_times),
            "outbox_folders": len(outputs), "duplicated": len(names) - len(set(names)),
            "lost": len(pages) - sum(states.values()) if not result.get("stopped_at_deadline") else None,
            "pages_per_s": round(len(published_times) / (end - drop_t), 3),
            "wall_s": round(end - drop_t, 1),
        })
        # Completions per 30 s bucket: the dips are the recycles and the restart.
        buckets: dict[int, int] = {}
        for stamp in published_times:
            buckets[int((stamp - drop_t) // 30)] = buckets.get(int((stamp - drop_t) // 30), 0) + 1
        result["published_per_30s"] = [buckets.get(i, 0) for i in range(max(buckets) + 1)] if buckets else []
        events = common.read_events(log_path)
        # The engine's own events in full; the per-page ones (192 at a kill) only counted, so that
        # they cannot crowd the restarts and recycles out of the list.
        result["engine_events"] = [
            {k: e.get(k) for k in ("event", "reason", "seconds", "generation", "restarts", "recycles", "timestamp")}
            for e in events if e.get("event") in ("engine recycling", "engine recycled", "engine restarted", "engine up",
                                                 "engine recycle waits for the other replicas to be up",
                                                 "engine recycle skipped: chandrad is stopping")
        ]
        result["pages_witnessing_a_death"] = sum(e.get("event") == "engine died with the page in flight" for e in events)
        result["pages_moved_to_another_replica"] = sum(e.get("event") == "page moved to another replica" for e in events)
        result["recycle_seconds"] = [e.get("seconds") for e in events if e.get("event") == "engine recycled"]
        result["restart_seconds"] = [e.get("seconds") for e in events if e.get("event") == "engine restarted"]
        result["log_errors"] = sorted({str(e.get("event")) for e in events if e.get("level") in ("error", "critical")})[:20]
    except Exception as error:
        result["error"] = repr(error)
        print(f"FAILED: {error!r}", flush=True)
    finally:
        if proc.poll() is None:
            kids = common.descendants(proc.pid)
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
            for pid in kids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        sampler.stop_event.set()
        # GPU memory once every engine is up and warm: from the first page published (+60 s) on.
        warm_from = result.get("drop_at_s", 0) + 60
        per_gpu: dict[str, Any] = {}
        for gpu in gpus:
            used = [m for (ts, g, m, _) in sampler.rows if g == gpu and ts >= warm_from and m > 1024]
            if used:
                used.sort()
                per_gpu[str(gpu)] = {"min_mib": used[0], "p10_mib": used[len(used) // 10],
                                     "p50_mib": used[len(used) // 2], "max_mib": used[-1], "samples": len(used)}
        result["gpu_memory_after_warmup"] = per_gpu
        save()
    print("RESULT " + json.dumps({k: v for k, v in result.items() if k not in ("engine_events", "options")}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
