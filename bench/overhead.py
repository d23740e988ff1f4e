#!/usr/bin/env python
"""What the daemon costs over a bare engine: the same pages through a bare ``AsyncLLM`` loop and
through ``chandrad run``, one after the other in ONE run, with the same engine settings.

(a) bare: ``AsyncLLM`` built from the engine args chandrad builds (``plan_engines`` on the same
    ``EngineSettings``, with chandrad's engine environment), the prompt rendered the way
    ``VllmEngine`` renders it (the model's chat template on Chandra's ``ocr_layout`` prompt, stop on
    ``<|im_end|>``/``<|endoftext|>``), the same ``SamplingParams`` as chandrad's first (greedy)
    attempt with ``bench_force_max_tokens`` (``ignore_eos``), images pre-scaled with
    ``scale_to_fit`` before the clock starts, at most ``--in-flight`` requests at once.
(b) daemon: ``python -m chandrad run --config`` as a child process with the same engine settings
    (``max_num_seqs`` = ``max_pages_in_flight`` = ``--in-flight``, ``max_retries = 0``: random
    weights make Chandra's loop detector meaningless), each page dropped into its inbox as a
    one-page US-Letter PDF at ``--dpi`` (192; the daemon renders at it too) (PIL, JPEG inside, like a scanner) or PNG (``--drop png``),
    by an atomic rename; done when the journal says every document is published.

Every page has distinct content (no prefix-cache hits). Both sides get a warm-up (not timed):
chandrad's own 224 px page, plus one full-size page. Throughput is pages / (last page done -
first page submitted/dropped): that is the figure to compare. "steady" is the completion rate over the
middle half of completions; it is only a hint (when the daemon admits pages slowly, its completions
bunch up at the end and "steady" overstates it).

Usage (CPU, tiny random model built into a temp dir):
    python bench/overhead.py --pages 24 --in-flight 8 --max-tokens 128
GPU (see bench/gpu.sh):
    python bench/overhead.py --gpu --model DIR --load-format dummy --pages 192 --in-flight 96 \\
        --max-tokens 1500 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85 \\
        --engine-arg gdn_prefill_backend=triton
Last stdout line: ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import multiprocessing
import os
import platform
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from vllm_server import VllmServer, free_port

REPO = Path(__file__).resolve().parent.parent
# Where the chandrad package is imported from (this process and the daemon): the checkout, or a
# snapshot given with --src (a device call can pin the code it measures).
SRC = REPO

WORDS = ("invoice total amount due date page table header footer section figure the of and "
         "revenue quarter report summary customer account number address balance payment tax "
         "analysis results method data model value policy agreement shall party hereby").split()
LETTER_IN = (8.5, 11.0)
TICK = os.sysconf("SC_CLK_TCK")


# -- options ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", help="directory holding the chandrad package to measure (default: this checkout)")
    ap.add_argument("--model", help="model directory (default: build one with --make-model into a temp dir)")
    ap.add_argument("--make-model", default=str(REPO / "scripts" / "make_tiny_model.py"),
                    help="script that writes a model dir: SCRIPT OUT --arch ARCH")
    ap.add_argument("--arch", default="tiny-qwen3vl")
    ap.add_argument("--full-vocab", action="store_true", help="pass --full-vocab to the make-model script")
    ap.add_argument("--pages", type=int, default=24)
    ap.add_argument("--in-flight", type=int, default=8, help="max_num_seqs = pages in flight (both sides)")
    ap.add_argument("--max-tokens", type=int, default=128, help="forced output tokens per page (ignore_eos)")
    ap.add_argument("--dpi", type=int, default=192)
    ap.add_argument("--drop", choices=["pdf", "png"], default="pdf", help="file type dropped into the inbox")
    ap.add_argument("--gpu", action="store_true", help="GPU engine settings (no CPU KV size, CUDA graphs)")
    ap.add_argument("--load-format", default=None, help='engine_args load_format, e.g. "dummy"')
    ap.add_argument("--max-model-len", type=int, default=18000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--kv-cache-gb", type=float, default=None, help="CPU default 1.0")
    ap.add_argument("--enforce-eager", action="store_true", help="GPU: no CUDA graphs (CPU: always eager)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="extra AsyncEngineArgs keyword (VALUE parsed as JSON, else a string); repeatable")
    ap.add_argument("--max-documents-in-flight", type=int, default=None,
                    help="daemon: documents worked on at once (default 2 x --in-flight; chandrad's default is 4)")
    ap.add_argument("--max-pages-in-flight", type=int, default=None,
                    help="daemon: engine.max_pages_in_flight (default chandrad's: --in-flight per engine fed)")
    ap.add_argument("--prepare-workers", type=int, default=None, help="daemon: prepare.workers")
    ap.add_argument("--settle-seconds", type=float, default=1.0)
    ap.add_argument("--phases", default="bare,daemon", help="order of the phases (bare,daemon | daemon,bare | one)")
    ap.add_argument("--no-daemon-warmup", action="store_true", help="skip the full-size warm-up document")
    ap.add_argument("--start-timeout", type=float, default=1200.0)
    ap.add_argument("--timeout", type=float, default=1800.0, help="per phase, after the engine is up")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds after this script starts: the daemon phase stops waiting then and reports the "
                         "pages published so far (\"partial\": true) instead of nothing; for calls with a hard limit")
    ap.add_argument("--workdir", help="keep everything here (default: a temp dir, removed)")
    ap.add_argument("--out", help="also write the RESULT json to this file")
    ap.add_argument("--label", default="", help="free text stored in the result")
    ap.add_argument("--micro", action="store_true", help="also time render/scale/publish steps per page, alone")
    ap.add_argument("--daemon-gpus", default="0", help="daemon: engine.gpus, e.g. 0 or 0,1")
    ap.add_argument("--layout", default="single", help="daemon: engine.layout (replicas, data-parallel, ...)")
    ap.add_argument("--bare-gpu", type=int, default=0, help="bare engine: the GPU it runs on")
    ap.add_argument("--concurrent", action="store_true",
                    help="run the bare engine and the daemon at the same time, on different GPUs "
                         "(--bare-gpu vs --daemon-gpus): one engine start of wall time instead of two")
    ap.add_argument("--bare-cache", default=None,
                    help="bare engine: VLLM_CACHE_ROOT, Triton cache inside, kept between runs (default: one in the workdir)")
    ap.add_argument("--bare-render", action="store_true",
                    help="bare engine: render prompts through vLLM's renderer threads as chandrad does "
                         "(default: raw prompts, the established baseline of shared/device/bench_engine.py)")
    ap.add_argument("--daemon-cache", default=None,
                    help="daemon: VLLM_CACHE_ROOT, Triton cache inside (keep it between runs for warm compile caches)")
    ap.add_argument("--server-state", default=None, metavar="FILE",
                    help="remote phases: a vllm serve described here and alive is used (else one is started "
                         "and described here; default WORKDIR/server/server.json)")
    ap.add_argument("--keep-server", action="store_true",
                    help="leave the vllm serve running at the end (its own session: it outlives a device call)")
    ap.add_argument("--kill-pages", type=int, default=None,
                    help="remote-kill phase: pages dropped (distinct from --pages'; default --pages / 2)")
    ap.add_argument("--kill-server-after", type=int, default=None,
                    help="remote-kill phase: SIGKILL the server once this many of its pages are published "
                         "(default a quarter of them), then start it again on the same port")
    ap.add_argument("--server-start-timeout", type=float, default=900.0)
    ap.add_argument("--daemon-profile", default=None, metavar="JSON",
                    help='daemon: run it through bench/profiled_daemon.py (the same Daemon, in-process) with vLLM\'s '
                         'torch profiler, e.g. {"dir": "/root/prof", "after_pages": 220, "seconds": 8}: the trace of '
                         'SECONDS of steady state once AFTER_PAGES timed pages are done (bench/profile_gpu.py groups it)')
    return ap.parse_args(argv)


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


def _pages_in_flight(settings: Any) -> int:
    try:
        from chandrad.engine import pages_in_flight
    except ImportError:  # a --src tree from before 2026-12 kept it on EngineSettings
        return int(settings.pages_in_flight("vllm"))
    return pages_in_flight(settings, "vllm")


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


# -- (a) bare engine -------------------------------------------------------------------------------


async def bare_phase(a: argparse.Namespace, settings: Any, images: list[Any], warm_image: Any,
                     state_dir: Path) -> dict[str, Any]:
    import vllm
    from chandra.prompts import PROMPT_MAPPING
    from PIL import Image
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from chandrad.engine.layout import plan_engines
    from chandrad.engine.vllm import STOP_TOKENS, EngineStats, _stat_logger_factory, set_spawn_environment

    specs = plan_engines(settings, state_dir / "ec_cache")
    assert len(specs) == 1, "the bare loop covers single-engine layouts"
    spec = specs[0]
    # Its own compile cache: a daemon started at the same time compiles into its own.
    os.environ.update(compile_cache_env(a.bare_cache or str(state_dir / "vllm-cache")))
    set_spawn_environment(spec)  # what VllmEngine does before it starts an engine

    stats = EngineStats()
    t = time.perf_counter()
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**spec.engine_args), stat_loggers=[_stat_logger_factory(stats)])
    start_s = time.perf_counter() - t
    print(f"[bare] engine up in {start_s:.1f} s (vLLM {vllm.__version__})", flush=True)
    result: dict[str, Any] = {"engine_start_s": round(start_s, 1)}
    try:
        tokenizer = llm.tokenizer if getattr(llm, "tokenizer", None) is not None else llm.get_tokenizer()
        if asyncio.iscoroutine(tokenizer):
            tokenizer = await tokenizer
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT_MAPPING["ocr_layout"]}]}],
            tokenize=False, add_generation_prompt=True,
        )
        vocab = tokenizer.get_vocab()
        stop_ids = [vocab[token] for token in STOP_TOKENS if token in vocab]

        def params(max_tokens: int) -> Any:  # = VllmEngine._generate, attempt 0, bench_force_max_tokens
            return SamplingParams(max_tokens=max_tokens, temperature=0.0, top_p=0.1, stop_token_ids=stop_ids,
                                  ignore_eos=settings.bench_force_max_tokens, seed=None)

        sem = asyncio.Semaphore(a.in_flight)
        done_at: list[float] = []
        latencies: list[float] = []
        tokens: list[tuple[int, int]] = []

        async def one(rid: str, image: Any, max_tokens: int) -> None:
            async with sem:
                t1 = time.perf_counter()
                final = None
                engine_input: Any = {"prompt": prompt, "multi_modal_data": {"image": image}}
                if a.bare_render:
                    (engine_input,) = await llm.renderer.render_cmpl_async([engine_input])
                async for out in llm.generate(engine_input, params(max_tokens), request_id=rid):
                    final = out
                assert final is not None
                latencies.append(time.perf_counter() - t1)
                done_at.append(time.time())
                tokens.append((len(final.prompt_token_ids or []), len(final.outputs[0].token_ids)))

        t = time.perf_counter()

        async def warm_up() -> None:
            await one("warm-small", Image.new("RGB", (224, 224), "white"), 8)  # chandrad's own warm-up
            await one("warm-full", warm_image, 16)                               # + one full-size page
        try:
            await asyncio.wait_for(warm_up(), timeout=seconds_to_deadline(a))
        except TimeoutError:  # --deadline: the start figure stays
            result.update({"partial": True, "stopped_in": "warm-up"})
            print("[bare] --deadline reached during the warm-up", flush=True)
            return result
        result["warmup_s"] = round(time.perf_counter() - t, 2)
        done_at.clear(), latencies.clear(), tokens.clear()
        stats.peak_running = 0

        gpu = GpuPoller(tuple(settings.gpus))
        gpu.start()
        cpu = CpuWindow(os.getpid())
        lag = LoopLag()
        lag_task = asyncio.create_task(lag.run())
        start = time.time()
        tasks = [asyncio.create_task(one(f"page-{i}", image, a.max_tokens)) for i, image in enumerate(images)]
        _, pending = await asyncio.wait(tasks, timeout=seconds_to_deadline(a))
        if pending:  # --deadline: keep what finished, abort the rest
            result["partial"] = True
            print(f"[bare] --deadline reached: {len(done_at)} of {len(tasks)} pages finished", flush=True)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        end = time.time()
        result["window"] = [start, end]
        lag_task.cancel()
        gpu.stop_event.set()
        result.update(rates(start, done_at))
        result.update({"pages": len(done_at), "engine_peak_running": stats.peak_running,
                       "cpu": cpu.close(), "loop_lag": lag.summary(), **gpu.summary(start, end)})
        if done_at:
            span = max(done_at) - start
            result.update({
                "lat_p50_s": round(pct(latencies, 50), 3), "lat_p95_s": round(pct(latencies, 95), 3),
                "prompt_tokens_per_page": sorted({p for p, _ in tokens}),
                "mean_pages_at_engine": round(sum(latencies) / span, 2),
                "output_tokens_total": sum(o for _, o in tokens),
                "output_tok_per_s": round(sum(o for _, o in tokens) / span, 1),
            })
        result["vllm"] = vllm.__version__
    finally:
        try:
            llm.shutdown()
        except Exception as error:  # a second shutdown at exit may raise; the engine is gone either way
            print(f"[bare] shutdown raised {error!r}", flush=True)
        llm.shutdown = lambda *args, **kwargs: None
    return result


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


# -- (b) the daemon --------------------------------------------------------------------------------


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
        f"max_documents_in_flight = {a.max_documents_in_flight or 2 * _pages_in_flight(settings)}",
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


def _ts(event: dict[str, Any]) -> float | None:
    try:
        return datetime.datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()
    except (KeyError, ValueError, AttributeError):
        return None


def timeline(events: list[dict[str, Any]], dropped_at: float, skip_file: str | None) -> dict[str, Any]:
    """Where a page's time goes in the daemon, from its log events (median and p90 over documents, s).

    intake: drop -> "document queued" (settle + hash + claim); prepare: queued -> "document prepared"
    (pdfinfo); to_engine: prepared -> sent to the engine (render + waiting for a page slot);
    engine: the page's latency at the engine; publish: "page done" -> "document published".
    """
    docs: dict[str, dict[str, float]] = {}
    names = {"document queued": "queued", "document prepared": "prepared", "page done": "done",
             "document published": "published"}
    for event in events:
        name = names.get(event.get("event", ""))
        doc = event.get("doc")
        t = _ts(event)
        if name is None or doc is None or t is None or event.get("file") == skip_file:
            continue
        if t < dropped_at - 1:
            continue
        entry = docs.setdefault(doc, {})
        entry[name] = t
        if name == "done":
            entry["engine"] = float(event.get("seconds") or 0.0)
    spans: dict[str, list[float]] = {"intake": [], "prepare": [], "to_engine": [], "engine": [], "publish": []}
    for entry in docs.values():
        if not {"queued", "prepared", "done", "published"} <= entry.keys():
            continue
        sent = entry["done"] - entry["engine"]
        spans["intake"].append(entry["queued"] - dropped_at)
        spans["prepare"].append(entry["prepared"] - entry["queued"])
        spans["to_engine"].append(sent - entry["prepared"])
        spans["engine"].append(entry["engine"])
        spans["publish"].append(entry["published"] - entry["done"])
    out: dict[str, Any] = {"documents": len(spans["engine"])}
    for key, values in spans.items():
        if values:
            out[key] = {"p50": round(pct(values, 50), 3), "p90": round(pct(values, 90), 3),
                        "max": round(max(values), 3)}
    return out


def drop(source: Path, inbox: Path) -> None:
    """Put a ready file into the inbox in one rename (same filesystem), like a scanner's temp+rename;
    through a hard link, so that the next phase can drop the same pages again."""
    staged = inbox.parent / f".{source.name}.dropping"
    os.link(source, staged)
    os.replace(staged, inbox / source.name)


def daemon_phase(a: argparse.Namespace, settings: Any, files: list[Path], warm_file: Path | None,
                 root: Path, while_waiting: Any = None) -> dict[str, Any]:
    """``while_waiting(rows)``, if given, is called with the finished journal rows at every poll of
    the timed window (the remote-kill phase kills and restarts the server from it)."""
    (root / "inbox").mkdir(parents=True, exist_ok=True)
    config = daemon_config(a, settings, root)
    log_path = root / "daemon.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
           **compile_cache_env(a.daemon_cache or str(root / "vllm-cache"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)  # chandrad sets it per engine from engine.gpus
    if a.layout == "encoder-split":
        try:
            from chandrad.testing import ec_loads_logging_config
        except ImportError:  # a --src tree from before chandrad.testing (2026-12)
            from chandrad.engine.layout import ec_loads_logging_config

        logging_config = root / "vllm-logging.json"  # the result counts the hand-offs (ec_loads_in_window)
        logging_config.write_text(json.dumps(ec_loads_logging_config()))
        env["VLLM_LOGGING_CONFIG_PATH"] = str(logging_config)
    state = root / "state"
    result: dict[str, Any] = {"config": config.read_text()}
    command = [sys.executable, "-m", "chandrad", "run", "--config", str(config)]
    profile_record = root / "profile-record.json"
    if a.daemon_profile:
        spec = json.loads(a.daemon_profile)
        command = [sys.executable, str(REPO / "bench" / "profiled_daemon.py"), "--config", str(config),
                   "--src", str(SRC), "--after-pages", str(spec["after_pages"]), "--seconds", str(spec["seconds"]),
                   "--delay", str(spec.get("delay", 0)),
                   "--record", str(profile_record)]
        env["VLLM_CUSTOM_SCOPES_FOR_PROFILING"] = "1"  # preprocess/forward/postprocess/sample in the trace
    with open(log_path, "ab") as log:
        t = time.perf_counter()
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=root)
    try:
        deadline = time.monotonic() + a.start_timeout
        while not any(e.get("event") == "watching inbox" for e in read_events(log_path)):
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited at start ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
            if a.deadline_at and time.monotonic() > a.deadline_at:  # keep how long it was given
                result.update({"partial": True, "stopped_in": "start",
                               "start_waited_s": round(time.perf_counter() - t, 1)})
                print(f"[daemon] --deadline reached while the daemon was starting ({result['start_waited_s']} s)",
                      flush=True)
                return result
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon did not start within {time.perf_counter() - t:.0f} s (--start-timeout)")
            time.sleep(0.5)
        result["start_to_watching_s"] = round(time.perf_counter() - t, 1)
        ready = [e for e in read_events(log_path) if e.get("event") == "engine ready"]
        if ready:
            result["engine_start_s"] = ready[-1].get("seconds")
        print(f"[daemon] watching after {result['start_to_watching_s']} s", flush=True)

        def finished() -> list[sqlite3.Row]:
            return [r for r in journal_docs(state) if r["state"] in ("published", "failed")]

        def wait_docs(count: int, timeout: float, partial_ok: bool = False) -> list[sqlite3.Row]:
            deadline = time.monotonic() + timeout
            while True:
                rows = finished()
                if len(rows) >= count:
                    return rows
                if while_waiting is not None and count > 1:  # not during the warm-up document
                    while_waiting(rows)
                if proc.poll() is not None:
                    raise RuntimeError(f"the daemon died ({proc.returncode}):\n{log_path.read_text()[-4000:]}")
                # Past --deadline, return even with no page finished: the start figures are kept.
                if partial_ok and a.deadline_at and time.monotonic() > a.deadline_at:
                    result["partial"] = True
                    print(f"[daemon] --deadline reached: {len(rows)} of {count} documents finished", flush=True)
                    return rows
                if time.monotonic() > deadline:
                    raise RuntimeError(f"timed out: {len(rows)} of {count} documents finished")
                time.sleep(0.25)

        base = 0
        if warm_file is not None:
            t = time.perf_counter()
            drop(warm_file, root / "inbox")
            if not wait_docs(1, a.timeout, partial_ok=True):
                result["stopped_in"] = "warm-up"
                return result
            base = 1
            result["warmup_s"] = round(time.perf_counter() - t, 2)
            print(f"[daemon] warm-up document done in {result['warmup_s']} s", flush=True)

        gpu = GpuPoller(tuple(settings.gpus))
        gpu.start()
        cpu = CpuWindow(proc.pid)
        log_offset = log_path.stat().st_size  # what the log says from the timed drop on
        start = time.time()
        for path in files:
            drop(path, root / "inbox")
        drop_s = time.time() - start
        rows = wait_docs(base + len(files), a.timeout, partial_ok=True)
        end = time.time()
        result["window"] = [start, end]
        gpu.stop_event.set()
        cpu_summary = cpu.close()
        timed = [r for r in rows if r["rel_path"] != (warm_file.name if warm_file else None)]
        states: dict[str, int] = {}
        for r in timed:
            states[r["state"]] = states.get(r["state"], 0) + 1
        result.update(rates(start, [r["updated_at"] for r in timed if r["state"] == "published"]))
        if a.daemon_profile:
            try:
                record = json.loads(profile_record.read_text())
            except (OSError, json.JSONDecodeError) as error:
                record = {"error": f"no profile record: {error!r}"}
            result["profile"] = record
            stall = record.get("stop_stall_s")
            if stall and result.get("wall_s") and result.get("pages_per_s"):
                # The stop wrote the trace while the engine did no steps: the same pages without that pause.
                published = round(result["pages_per_s"] * result["wall_s"])
                result["pages_per_s_without_profiler_stall"] = round(published / (result["wall_s"] - stall), 4)
        result.update({"pages": len(timed), "states": states, "drop_s": round(drop_s, 3), "cpu": cpu_summary,
                       **gpu.summary(start, end)})
        # What the outbox says about each page (prompt tokens prove both sides did the same work).
        # Only the documents the journal had published when the window closed: the daemon goes on
        # publishing until it is stopped, and writes a document's outputs before its journal row.
        published_stems = {Path(r["rel_path"]).stem for r in timed if r["state"] == "published"}
        prompt_tokens, out_tokens, latencies, retries, sizes = set(), 0, [], 0, set()
        for doc_json in (root / "outbox").glob("*/*.json"):
            if doc_json.parent.name not in published_stems:
                continue
            try:
                document = json.loads(doc_json.read_text())
            except (OSError, json.JSONDecodeError):
                continue
            for page in document.get("pages", []):
                prompt_tokens.add(page.get("prompt_tokens"))
                out_tokens += page.get("output_tokens") or 0
                latencies.append(page.get("latency_s") or 0.0)
                retries += page.get("retries") or 0
                box = page.get("page_box") or []
                if len(box) == 4:
                    sizes.add((box[2] - box[0], box[3] - box[1]))
        result.update({"prompt_tokens_per_page": sorted(p for p in prompt_tokens if p is not None),
                       "output_tokens_total": out_tokens, "page_retries": retries,
                       "page_sizes": sorted(list(s) for s in sizes)})
        if latencies and result.get("wall_s"):
            result.update({"engine_lat_p50_s": round(pct(latencies, 50), 3),
                           "engine_lat_p95_s": round(pct(latencies, 95), 3),
                           # Little's law: mean pages at the engine over the timed window
                           "mean_pages_at_engine": round(sum(latencies) / result["wall_s"], 2)})
        events = read_events(log_path)
        result["timeline"] = timeline(events, start, warm_file.name if warm_file else None)
        peaks = [e.get("engine_peak_running") for e in events if e.get("event") == "page done"]
        peaks = [p for p in peaks if isinstance(p, int)]
        if peaks:
            result["engine_peak_running"] = max(peaks)
        result["log_warnings"] = [e.get("event") for e in events if e.get("level") in ("warning", "error")][:20]
        if a.layout == "encoder-split":
            try:
                from chandrad.testing import EC_LOADED_LINE
            except ImportError:  # a --src tree from before chandrad.testing (2026-12)
                from chandrad.engine.layout import EC_LOADED_LINE

            # From the timed drop to the end of the window: pages still at the engine then count too.
            with open(log_path, "rb") as log_file:
                log_file.seek(log_offset)
                result["ec_loads_in_window"] = log_file.read().count(EC_LOADED_LINE.encode())
    finally:
        if proc.poll() is None:
            kids = descendants(proc.pid)
            # Cut short by --deadline: pages are still at the engine; no time for a graceful stop.
            proc.send_signal(signal.SIGKILL if result.get("partial") else signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            for pid in kids:  # an EngineCore left behind would hold the GPU
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        result["exit_code"] = proc.returncode
    return result


# -- remote: the daemon with engine.url on a vllm serve of the same engine settings ------------------


def server_state(a: argparse.Namespace, root: Path) -> Path:
    """Where the remote phases' server is described: --server-state, else in the run's folder."""
    return Path(a.server_state) if a.server_state else root / "server" / "server.json"


def server_for(a: argparse.Namespace, settings: Any, root: Path) -> Any:
    """The ``vllm serve`` of the remote phases: the one --server-state describes if it is alive,
    else a new one (started, not yet answering) with the engine arguments and environment the
    in-process engine of ``settings`` gets, and the daemon's compile cache (a warm start)."""
    from chandrad.engine.layout import plan_engines
    from chandrad.engine.vllm import set_spawn_environment

    state = server_state(a, root)
    root = root / "server"
    if state.exists():
        server = VllmServer.load(state)
        if server.alive():
            print(f"[remote] using the running vllm serve (pid {server.pid}, {server.url})", flush=True)
            return server, state
    (spec,) = plan_engines(settings, root / "ec_cache")
    before = dict(os.environ)
    try:
        os.environ.update(compile_cache_env(a.daemon_cache or str(root / "vllm-cache")))
        set_spawn_environment(spec)  # what the in-process engine's EngineCore would inherit
        env = {k: v for k, v in os.environ.items() if before.get(k) != v}
    finally:
        os.environ.clear()
        os.environ.update(before)
    root.mkdir(parents=True, exist_ok=True)
    # Beside its state file: a server kept for the next device call keeps its log where that call looks.
    server = VllmServer.for_engine(settings.model, spec.engine_args, env, state.with_suffix(".log"))
    server.start()
    server.save(state)
    print(f"[remote] vllm serve started (pid {server.pid}, {server.url}): {' '.join(server.command[3:])}", flush=True)
    return server, state


def stop_server(a: argparse.Namespace, root: Path) -> None:
    state = server_state(a, root)
    if state.exists():
        server = VllmServer.load(state)
        if server.alive():
            server.stop()
            print("[remote] vllm serve stopped", flush=True)


def remote_settings(a: argparse.Namespace, settings: Any, url: str) -> Any:
    """The daemon's engine section for the server: what reaches the model is the same; pages in
    flight as the in-process daemon has them."""
    from chandrad.config import EngineSettings

    return EngineSettings(
        kind="vllm", model=settings.model, url=url, served_model_name="chandra", max_tokens=a.max_tokens,
        max_retries=0, bench_force_max_tokens=True,
        max_pages_in_flight=a.max_pages_in_flight or _pages_in_flight(settings),
        # A killed server's pages wait for it (a warm start is ~1 min on an H200): no attempt is spent.
        page_timeout_seconds=max(1800.0, a.timeout), health_check_seconds=2.0,
        restart_backoff_seconds=0.5, restart_backoff_max_seconds=2.0,
    )


def remote_phase(a: argparse.Namespace, settings: Any, files: list[Path], warm_file: Path | None, root: Path,
                 kill: bool) -> dict[str, Any]:
    """The daemon with ``engine.url``; with ``kill``, the server is SIGKILLed once
    --kill-server-after pages are published and started again at once on the same port: the
    result says how long it was down and how long after it answered again the next page was done."""
    server, state = server_for(a, settings, root.parent)
    t = time.perf_counter()
    waited = server.wait_ready(a.server_start_timeout)
    result: dict[str, Any] = {"server_command": server.command, "server_ready_waited_s": round(waited, 1),
                              "server_pid": server.pid}
    print(f"[remote] vllm serve answering after {time.perf_counter() - t:.1f} s of waiting", flush=True)
    r_settings = remote_settings(a, settings, server.url)
    kill_after = a.kill_server_after or max(1, len(files) // 4)
    events: dict[str, float] = {}

    def killer(rows: list[sqlite3.Row]) -> None:
        warm_name = warm_file.name if warm_file else None
        published = [r for r in rows if r["state"] == "published" and r["rel_path"] != warm_name]
        if "killed_at" not in events and len(published) >= kill_after:
            events["killed_at"] = server.kill9()
            events["published_at_kill"] = len(published)
            print(f"[remote] vllm serve killed (SIGKILL) with {len(published)} pages published", flush=True)
            server.start()
            server.save(state)

            def wait_back() -> None:
                try:
                    server.wait_ready(a.server_start_timeout)
                    events["answering_at"] = time.time()
                    print(f"[remote] vllm serve answering again {events['answering_at'] - events['killed_at']:.1f} s "
                          "after the kill", flush=True)
                except RuntimeError as error:
                    events["restart_error"] = repr(error)  # type: ignore[assignment]

            threading.Thread(target=wait_back, daemon=True).start()

    try:
        result.update(daemon_phase(a, r_settings, files, warm_file, root, killer if kill else None))
    finally:
        server.save(state)
    if kill:
        result["kill"] = dict(events)
        killed, back = events.get("killed_at"), events.get("answering_at")
        done = sorted(r["updated_at"] for r in journal_docs(root / "state") if r["state"] == "published")
        if killed and back:
            after = [d for d in done if d > back]
            result["kill"].update({
                "down_s": round(back - killed, 1),
                "first_page_after_back_s": round(after[0] - back, 1) if after else None,
                "last_page_after_back_s": round(after[-1] - back, 1) if after else None,
                "pages_published_while_down": sum(1 for d in done if killed < d <= back),
            })
    # Nothing lost, nothing twice: one outbox folder per document, every document published once.
    rows = journal_docs(root / "state")
    folders = [p for p in (root / "outbox").iterdir() if p.is_dir() and not p.name.startswith(".")]
    result["accounting"] = {"documents": len(rows), "published": sum(r["state"] == "published" for r in rows),
                            "failed": sum(r["state"] == "failed" for r in rows), "outbox_folders": len(folders),
                            "distinct_outbox_folders": len({p.name for p in folders})}
    return result


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


# -- main ------------------------------------------------------------------------------------------


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


def main(argv: list[str] | None = None) -> int:
    global SRC
    a = parse_args(argv)
    a.deadline_at = time.monotonic() + a.deadline if a.deadline else None
    SRC = Path(a.src).resolve() if a.src else REPO
    sys.path.insert(0, str(SRC))
    phases = [p.strip() for p in a.phases.split(",") if p.strip()]
    root = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="chandrad-overhead-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        model = a.model
        if model is None:
            model = str(root / "model")
            t = time.perf_counter()
            subprocess.run([sys.executable, a.make_model, model, "--arch", a.arch,
                            *(["--full-vocab"] if a.full_vocab else [])], check=True, capture_output=True)
            print(f"model {a.arch} written to {model} in {time.perf_counter() - t:.1f} s", flush=True)
        daemon_gpus = tuple(int(g) for g in a.daemon_gpus.split(","))
        settings = engine_settings(a, model, daemon_gpus, a.layout)  # the daemon's
        if a.daemon_profile:  # only the daemon is profiled; profiler_config is not in vLLM's compile hash
            spec = json.loads(a.daemon_profile)
            profiler = {"profiler": "torch", "torch_profiler_dir": spec["dir"], "torch_profiler_with_stack": False,
                        "torch_profiler_use_gzip": False, "torch_profiler_dump_cuda_time_total": False,
                        "ignore_frontend": True}
            settings = settings.model_copy(update={"engine_args": {**settings.engine_args,
                                                                   "profiler_config": profiler}})
        bare_settings = engine_settings(a, model, (a.bare_gpu,), "single")
        if a.concurrent and a.bare_gpu in daemon_gpus:
            raise SystemExit("--concurrent needs the bare engine on a GPU the daemon does not use")

        t = time.perf_counter()
        drop_dir = root / "to-drop"
        files, images, page_px = make_pages(list(range(a.pages)), drop_dir, a.drop, a.dpi)
        warm_files, warm_images, _ = make_pages([-1], root / "warm", a.drop, a.dpi)
        kill_files: list[Path] = []
        if "remote-kill" in phases:  # pages of their own: the same content again would be a duplicate
            kill_count = a.kill_pages or max(1, a.pages // 2)
            kill_files, _, _ = make_pages(list(range(a.pages, a.pages + kill_count)), root / "to-drop-kill",
                                          a.drop, a.dpi)
        print(f"{a.pages} pages of {page_px[0]}x{page_px[1]} px made in {time.perf_counter() - t:.1f} s "
              f"({sum(f.stat().st_size for f in files) / len(files) / 1024:.0f} KiB per {a.drop})", flush=True)

        result: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "label": a.label, "device": device_description(a.gpu),
            "gpus": len(settings.gpus) if a.gpu else 0, "layout": a.layout, "concurrent": a.concurrent,
            "pages": a.pages, "in_flight": a.in_flight,
            "max_tokens": a.max_tokens, "page_px": list(page_px), "dpi": a.dpi, "drop": a.drop,
            "model": model, "arch": a.arch, "options": vars(a),
            "engine_settings": settings.model_dump(mode="json", exclude_defaults=True),
            "python": platform.python_version(), "git": git_state(),
        }
        if a.micro:
            try:
                result["micro"] = micro(files, a.drop)
                print(f"micro: {result['micro']}", flush=True)
            except Exception as error:
                result["micro"] = {"error": repr(error)}

        def save() -> None:
            if a.out:
                Path(a.out).parent.mkdir(parents=True, exist_ok=True)
                # a copy: the daemon side's thread may add its key meanwhile (--concurrent)
                Path(a.out).write_text(json.dumps(dict(result), indent=2) + "\n")

        def run_phase(phase: str) -> None:
            if phase not in ("bare", "daemon", "remote", "remote-kill", "serve", "stop-server"):
                raise SystemExit(f"unknown phase {phase!r}")
            try:
                if phase == "bare":
                    bare = asyncio.run(bare_phase(a, bare_settings, images, warm_images[0], root / "bare-state"))
                    result["bare"] = bare
                    result["vllm"] = bare.get("vllm")
                    print(f"[bare] {bare.get('pages', 0)} pages in {bare.get('wall_s')} s: "
                          f"{bare.get('pages_per_s', 0.0)} pages/s", flush=True)
                elif phase in ("remote", "remote-kill"):
                    kill = phase == "remote-kill"
                    remote = remote_phase(a, settings, kill_files if kill else files,
                                          None if a.no_daemon_warmup else warm_files[0], root / phase, kill)
                    result[phase] = remote
                    print(f"[{phase}] {remote.get('pages', 0)} pages in {remote.get('wall_s')} s: "
                          f"{remote.get('pages_per_s', 0.0)} pages/s; {remote.get('kill', '')} "
                          f"{remote.get('accounting')}", flush=True)
                elif phase == "serve":  # start it (for the next call) and go on: it loads meanwhile
                    server_for(a, settings, root)
                elif phase == "stop-server":  # the GPU is needed by what follows
                    stop_server(a, root)
                else:
                    daemon = daemon_phase(a, settings, files, None if a.no_daemon_warmup else warm_files[0],
                                          root / "daemon")
                    result["daemon"] = daemon
                    print(f"[daemon] {daemon.get('pages', 0)} pages in {daemon.get('wall_s')} s: "
                          f"{daemon.get('pages_per_s', 0.0)} pages/s", flush=True)
            except Exception as error:  # keep what was measured; say what broke
                import traceback

                result[f"{phase}_error"] = f"{error!r}\n{traceback.format_exc()[-3000:]}"
                print(f"[{phase}] FAILED: {error!r}", flush=True)
            if a.gpu and not a.concurrent and phase in ("bare", "daemon"):
                result.setdefault(phase, {})["gpu_mem_mib_after_shutdown"] = wait_gpu_memory_free()

        save()
        if a.concurrent:
            # Daemon (child process) and bare engine (this process) on different GPUs, same pages.
            daemon_side = threading.Thread(target=run_phase, args=("daemon",), name="daemon-phase")
            daemon_side.start()
            run_phase("bare")
            save()  # the bare figures survive a daemon side that outlives the call's limit
            daemon_side.join()
            windows = [result.get(side, {}).get("window") for side in ("bare", "daemon")]
            if all(windows) and all(result[side].get("pages") for side in ("bare", "daemon")):
                (b0, b1), (d0, d1) = windows  # type: ignore[misc]
                result["timed_windows_overlap_frac"] = round(max(0.0, min(b1, d1) - max(b0, d0)) / max(b1 - b0, d1 - d0), 3)
        else:
            for phase in phases:
                save()
                run_phase(phase)
        if "vllm" not in result or result["vllm"] is None:
            try:
                import vllm
                result["vllm"] = vllm.__version__
            except ImportError:
                result["vllm"] = None
        def whole(phase: str) -> bool:
            """The phase timed all its pages: a phase cut by --deadline gives no ratio (Y of 2026-12-02:
            the bare engine's 81 of 384 pages gave a 'daemon/bare' of 2.74)."""
            return bool(result.get(phase, {}).get("pages_per_s")) and not result[phase].get("partial")

        for phase in ("bare", "daemon", "remote"):
            if result.get(phase, {}).get("partial"):
                print(f"[{phase}] cut by --deadline: no ratio against it", flush=True)
        if whole("bare") and whole("daemon"):
            b, d = result["bare"], result["daemon"]
            result["engine_pages_per_s"] = b["pages_per_s"]
            result["daemon_pages_per_s"] = d["pages_per_s"]
            result["daemon_vs_engine"] = round(d["pages_per_s"] / b["pages_per_s"], 4)
            result["overhead_ms_per_page"] = round((1 / d["pages_per_s"] - 1 / b["pages_per_s"]) * 1e3, 1)
            if "steady_pages_per_s" in b and "steady_pages_per_s" in d:
                result["daemon_vs_engine_steady"] = round(d["steady_pages_per_s"] / b["steady_pages_per_s"], 4)
            print(f"daemon/bare = {result['daemon_vs_engine']:.3f} "
                  f"({d['pages_per_s']:.3f} vs {b['pages_per_s']:.3f} pages/s; "
                  f"{result['overhead_ms_per_page']:+.1f} ms per page)", flush=True)
        if whole("remote") and whole("daemon"):
            r, d = result["remote"], result["daemon"]
            result["remote_pages_per_s"] = r["pages_per_s"]
            result["daemon_pages_per_s"] = d["pages_per_s"]
            result["remote_vs_in_process"] = round(r["pages_per_s"] / d["pages_per_s"], 4)
            if "steady_pages_per_s" in r and "steady_pages_per_s" in d:
                result["remote_vs_in_process_steady"] = round(r["steady_pages_per_s"] / d["steady_pages_per_s"], 4)
            print(f"remote/in-process = {result['remote_vs_in_process']:.3f} "
                  f"({r['pages_per_s']:.3f} vs {d['pages_per_s']:.3f} pages/s)", flush=True)
        if not a.keep_server and any(p in phases for p in ("remote", "remote-kill", "serve")):
            try:
                stop_server(a, root)
            except Exception as error:  # the result matters more than the tidy-up
                print(f"[remote] could not stop vllm serve: {error!r}", flush=True)
        save()
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    finally:
        if not a.workdir:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
