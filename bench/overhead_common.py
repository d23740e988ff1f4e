"""Shared helpers of bench/overhead.py's phases (and of bench/soak_gpu.py): the engine settings
of one side, the pages (drawn, saved as a scanner's drop, pre-scaled), the measuring probes
(rates, percentiles, nvidia-smi, per-thread and per-process CPU from /proc, event-loop lag), the
daemon's config, log and journal readers, the drop, and the run's description (device, git).

``SRC`` is where the chandrad package is imported from (this process and the daemon): the entry
point sets it from --src; read it as ``overhead_common.SRC`` (it changes after import).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import platform
import random
import shutil
import sqlite3
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from vllm_server import free_port

REPO = Path(__file__).resolve().parent.parent
# Where the chandrad package is imported from (this process and the daemon): the checkout, or a
# snapshot given with --src (a device call can pin the code it measures).
SRC = REPO

WORDS = ("invoice total amount due date page table header footer section figure the of and "
         "revenue quarter report summary customer account number address balance payment tax "
         "analysis results method data model value policy agreement shall party hereby").split()
LETTER_IN = (8.5, 11.0)
TICK = os.sysconf("SC_CLK_TCK")


# -- engine settings -------------------------------------------------------------------------------


def engine_settings(a: argparse.Namespace, model: str, gpus: tuple[int, ...] = (0,), layout: str = "single") -> Any:
    """EngineSettings for one side; ``in_flight`` is per engine (max_num_seqs), and pages in flight
    follow chandrad's own rule (EngineSettings.pages_in_flight) unless --max-pages-in-flight says."""
    from chandrad.config import EngineSettings

    extra: dict[str, Any] = {}
    for item in a.engine_arg:
        key, _, raw = item.partition("=")
        try:
            extra[key] = json.loads(raw)
        except json.JSONDecodeError:
            extra[key] = raw
    if a.load_format:
        extra["load_format"] = a.load_format
    values: dict[str, Any] = dict(
        kind="vllm", model=model, max_model_len=a.max_model_len, max_num_seqs=a.in_flight,
        max_num_batched_tokens=a.max_num_batched_tokens, gpu_memory_utilization=a.gpu_memory_utilization,
        enable_prefix_caching=not a.no_prefix_caching, max_tokens=a.max_tokens, max_retries=0,
        bench_force_max_tokens=True, engine_args=extra, gpus=gpus, layout=layout,
        max_pages_in_flight=a.max_pages_in_flight,  # None: the daemon's own rule (max_num_seqs per scheduler)
    )
    if a.gpu:
        values["enforce_eager"] = a.enforce_eager
        if a.kv_cache_gb:
            values["kv_cache_memory_gb"] = a.kv_cache_gb
    else:
        values["enforce_eager"] = True
        values["kv_cache_memory_gb"] = a.kv_cache_gb or 1.0
    return EngineSettings(**values)


def pages_in_flight_for(settings: Any) -> int:
    try:
        from chandrad.engine import pages_in_flight
    except ImportError:  # a --src tree from before 2026-12 kept it on EngineSettings
        return int(settings.pages_in_flight("vllm"))
    return pages_in_flight(settings, "vllm")


# -- pages -----------------------------------------------------------------------------------------


def make_page(idx: int, w: int, h: int):
    """A dense text page unique to ``idx`` (title, paragraphs, a ruled table)."""
    from PIL import Image, ImageDraw, ImageFont

    rng = random.Random(idx)
    fs = max(10, h // 90)
    try:
        font = ImageFont.load_default(size=fs)
    except TypeError:
        font = ImageFont.load_default()
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    margin, y, step = w // 14, h // 20, int(fs * 1.45)
    d.text((margin, y), f"Document {idx:05d} - Quarterly report {rng.randint(1000, 9999)}", fill="black", font=font)
    y += 2 * step
    table_at, line = rng.randint(15, 35), 0
    while y < h - h // 20:
        if line == table_at:
            cw = (w - 2 * margin) // 4
            for _ in range(8):
                for c in range(4):
                    x0 = margin + c * cw
                    d.rectangle([x0, y, x0 + cw, y + step], outline="black")
                    d.text((x0 + 4, y + 2), f"{rng.choice(WORDS)} {rng.randint(0, 99999)}", fill="black", font=font)
                y += step
            y += step
        else:
            words, n = [], 0
            while n < (w - 2 * margin) // (fs * 0.55):
                wd = rng.choice(WORDS) if rng.random() > 0.15 else str(rng.randint(0, 10**6))
                words.append(wd)
                n += len(wd) + 1
            d.text((margin, y), " ".join(words), fill="black", font=font)
            y += step
        line += 1
    return img


def _page_job(job: tuple[int, str, str, int]) -> tuple[int, str, tuple[int, int], bytes, tuple[int, int]]:
    """Worker: draw page ``idx``, save it as the file a scanner would drop, return the pre-scaled pixels."""
    from chandra.model.util import scale_to_fit

    idx, path, kind, dpi = job
    w, h = round(LETTER_IN[0] * dpi), round(LETTER_IN[1] * dpi)
    img = make_page(idx, w, h)
    if kind == "pdf":
        img.save(path, "PDF", resolution=float(dpi))
    else:
        img.save(path, "PNG", dpi=(dpi, dpi))
    scaled = scale_to_fit(img)
    return idx, path, img.size, scaled.tobytes(), scaled.size


def make_pages(indices: list[int], folder: Path, kind: str, dpi: int) -> tuple[list[Path], list[Any], tuple[int, int]]:
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    jobs = [(i, str(folder / f"page-{i + 1 if i >= 0 else 'warm'}.{kind}"), kind, dpi) for i in indices]
    procs = max(1, min(len(jobs), (os.cpu_count() or 1)))
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        done = sorted(pool.map(_page_job, jobs, chunksize=1), key=lambda r: indices.index(r[0]))
    files = [Path(r[1]) for r in done]
    images = [Image.frombytes("RGB", r[4], r[3]) for r in done]
    return files, images, done[0][2]


# -- measuring helpers -----------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def seconds_to_deadline(a: argparse.Namespace) -> float | None:
    """What is left until --deadline (at least 1 s: what finished by then is still collected), or None."""
    return max(a.deadline_at - time.monotonic(), 1.0) if a.deadline_at else None


def rates(start: float, done_times: list[float]) -> dict[str, float | None]:
    """End-to-end pages/s and the rate over the middle half of completions."""
    t = sorted(done_times)
    n = len(t)
    if n == 0:  # --deadline came before the first page: say so, keep the start figures
        return {"wall_s": None, "pages_per_s": 0.0, "first_page_s": None}
    wall = t[-1] - start
    out = {"wall_s": round(wall, 3), "pages_per_s": round(n / wall, 4),
           "first_page_s": round(t[0] - start, 3)}
    lo, hi = n // 4, (3 * n) // 4
    if hi > lo and t[hi - 1] > t[lo]:
        out["steady_pages_per_s"] = round((hi - 1 - lo) / (t[hi - 1] - t[lo]), 4)
    return out


def nvidia_smi(query: str) -> list[list[str]] | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except Exception:
        return None
    return [[x.strip() for x in line.split(",")] for line in out.strip().splitlines()] or None


class GpuPoller(threading.Thread):
    """nvidia-smi every second: utilization (mean) and memory used (summed) over ``gpus`` (all: None)."""

    def __init__(self, gpus: tuple[int, ...] | None = None) -> None:
        super().__init__(daemon=True)
        self.gpus = gpus
        self.samples: list[tuple[float, float, float]] = []
        self.per_gpu_mem_max: dict[int, float] = {}
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            rows = nvidia_smi("index,utilization.gpu,memory.used")
            if rows is None:
                return
            try:
                rows = [r for r in rows if self.gpus is None or int(r[0]) in self.gpus]
                util = sum(float(r[1]) for r in rows) / len(rows)
                mem = sum(float(r[2]) for r in rows)
                for r in rows:
                    self.per_gpu_mem_max[int(r[0])] = max(self.per_gpu_mem_max.get(int(r[0]), 0.0), float(r[2]))
            except (ValueError, IndexError, ZeroDivisionError):
                return
            self.samples.append((time.time(), util, mem))
            self.stop_event.wait(1.0)

    def summary(self, t0: float, t1: float) -> dict[str, Any]:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if not inside:
            return {}
        return {"gpu_util_mean_pct": round(sum(s[1] for s in inside) / len(inside), 1),
                "gpu_util_min_pct": min(s[1] for s in inside),
                "gpu_mem_used_mib_max": max(s[2] for s in inside), "gpu_samples": len(inside),
                "gpu_mem_used_mib_max_per_gpu": {str(k): v for k, v in sorted(self.per_gpu_mem_max.items())}}


def _stat_fields(path: str) -> list[str] | None:
    try:
        with open(path) as handle:
            raw = handle.read()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()  # fields from 3 (state) on


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of ``pid`` ("main" for the thread with tid == pid)."""
    found: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tids:
        fields = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
        if fields is None:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as handle:
                name = handle.read().strip()
        except OSError:
            name = "?"
        name = "main" if int(tid) == pid else "".join(c for c in name if not c.isdigit()).rstrip("_-") or name
        found[name] = found.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
    return found


def proc_cpu(pid: int) -> dict[str, float]:
    """self (all threads) and reaped children CPU seconds of ``pid``."""
    fields = _stat_fields(f"/proc/{pid}/stat")
    if fields is None:
        return {}
    return {"self": (int(fields[11]) + int(fields[12])) / TICK, "children": (int(fields[13]) + int(fields[14])) / TICK}


def descendants(pid: int) -> list[int]:
    from chandrad.engine.processes import descendant_pids  # imported late: --src picks which chandrad

    return descendant_pids(pid)


def cmdline(pid: int) -> str:
    try:
        from chandrad.testing import process_cmdline
    except ImportError:  # a --src tree from before chandrad.testing (2026-12)
        from chandrad.engine.vllm import process_cmdline

    return process_cmdline(pid)


class CpuWindow:
    """CPU seconds used by a process (per thread name), its EngineCore children and reaped children."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.t0 = time.time()
        self.threads0 = threads_cpu(pid)
        self.proc0 = proc_cpu(pid)
        self.cores0 = self._cores()

    def _cores(self) -> dict[int, float]:
        out = {}
        for child in descendants(self.pid):
            if "EngineCore" in cmdline(child) or "VLLM" in cmdline(child):
                out[child] = proc_cpu(child).get("self", 0.0)
        return out

    def close(self) -> dict[str, Any]:
        wall = time.time() - self.t0
        threads1, proc1, cores1 = threads_cpu(self.pid), proc_cpu(self.pid), self._cores()
        per_thread = {k: round(v - self.threads0.get(k, 0.0), 2) for k, v in threads1.items()}
        per_thread = {k: v for k, v in sorted(per_thread.items(), key=lambda kv: -kv[1]) if v >= 0.05}
        core = sum(v - self.cores0.get(pid, 0.0) for pid, v in cores1.items())
        main = per_thread.get("main", 0.0)
        return {
            "window_s": round(wall, 2),
            "main_thread_cpu_s": main, "main_thread_busy_frac": round(main / wall, 3) if wall else None,
            "process_cpu_s": round(proc1.get("self", 0) - self.proc0.get("self", 0), 2),
            "reaped_children_cpu_s": round(proc1.get("children", 0) - self.proc0.get("children", 0), 2),
            "engine_core_cpu_s": round(core, 2),
            "threads_cpu_s": per_thread,
        }


def wait_gpu_memory_free(limit_mib: float = 4096, timeout: float = 60) -> float | None:
    deadline = time.monotonic() + timeout
    used = None
    while time.monotonic() < deadline:
        rows = nvidia_smi("memory.used")
        if rows is None:
            return None
        used = sum(float(r[0]) for r in rows)
        if used < limit_mib:
            return used
        time.sleep(1)
    return used


class LoopLag:
    """How late a 10 ms sleep wakes up on the event loop: the loop's responsiveness."""

    def __init__(self) -> None:
        self.lags: list[float] = []

    async def run(self) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            self.lags.append(time.perf_counter() - t - 0.01)

    def summary(self) -> dict[str, float]:
        if not self.lags:
            return {}
        return {"p50_ms": round(pct(self.lags, 50) * 1e3, 2), "p99_ms": round(pct(self.lags, 99) * 1e3, 2),
                "max_ms": round(max(self.lags) * 1e3, 2)}


# -- the daemon's config, log and journal ----------------------------------------------------------


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} as TOML")


def compile_cache_env(cache_root: str) -> dict[str, str]:
    """vLLM's compile cache and, inside it, Triton's kernel cache: one fixed folder for each, as the
    systemd unit sets them (there as siblings under chandrad's cache), so a warm start finds both."""
    return {"VLLM_CACHE_ROOT": cache_root, "TRITON_CACHE_DIR": os.path.join(cache_root, "triton")}


def daemon_config(a: argparse.Namespace, settings: Any, root: Path) -> Path:
    engine = settings.model_dump(exclude_defaults=True, mode="json")
    lines = [
        f'state_dir = {toml_value(str(root / "state"))}', 'log_format = "json"', 'log_level = "info"',
        f"max_documents_in_flight = {a.max_documents_in_flight or 2 * pages_in_flight_for(settings)}",
        f'metrics_address = "127.0.0.1:{free_port()}"',  # metrics stay on (their cost is the daemon's)
        "max_attempts = 1", "", "[engine]",
        *(f"{key} = {toml_value(value)}" for key, value in engine.items()),
        "", "[prepare]",
        # the daemon renders each PDF at this DPI: the bare side's images were made at --dpi too
        f"dpi = {a.dpi}",
        *([f"workers = {a.prepare_workers}"] if a.prepare_workers else []),
        "", "[[inbox]]", f'path = {toml_value(str(root / "inbox"))}',
        f"settle_seconds = {a.settle_seconds}", "rescan_seconds = 300.0", 'duplicates = "reprocess"',
    ]
    config = root / "config.toml"
    config.write_text("\n".join(lines) + "\n")
    return config


def read_events(log_path: Path) -> list[dict[str, Any]]:
    events = []
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return events
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return events


def journal_docs(state: Path) -> list[sqlite3.Row]:
    db_path = state / "journal.sqlite3"
    if not db_path.exists():
        return []
    try:
        db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, timeout=5)
        db.row_factory = sqlite3.Row
        try:
            return db.execute("SELECT rel_path, state, updated_at, created_at FROM documents").fetchall()
        finally:
            db.close()
    except sqlite3.OperationalError:
        return []


def drop(source: Path, inbox: Path) -> None:
    """Put a ready file into the inbox in one rename (same filesystem), like a scanner's temp+rename;
    through a hard link, so that the next phase can drop the same pages again."""
    staged = inbox.parent / f".{source.name}.dropping"
    os.link(source, staged)
    os.replace(staged, inbox / source.name)


# -- the run's description -------------------------------------------------------------------------


def device_description(gpu: bool) -> str:
    rows = nvidia_smi("name,memory.total,driver_version") if gpu else None
    cpu = f"{os.cpu_count()} CPU cores"
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
        cpu += f" ({model})" if model else ""
    except OSError:
        pass
    if rows:
        return f"{len(rows)} x {rows[0][0]} ({rows[0][1]} MiB, driver {rows[0][2]}), {cpu}"
    return f"CPU only: {cpu}, {platform.machine()}"


def git_state() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=SRC, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:
            return ""
    if SRC != REPO:
        stamp = SRC / "SOURCE.txt"
        return {"src": str(SRC), "snapshot_of": stamp.read_text().strip() if stamp.exists() else None}
    # The device copy of the tree carries a stale .git (the working tree travels, the history does
    # not always): the call's command line names the commit it ran as BENCH_COMMIT.
    head = git("rev-parse", "HEAD")
    return {"commit": os.environ.get("BENCH_COMMIT") or head, "git_head": head, "dirty_files": [l[3:] for l in git("status", "--porcelain").splitlines()
                                                                if l[3:].startswith("chandrad/")]}
