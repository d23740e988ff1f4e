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
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import overhead_common as common
from overhead_bare import bare_phase
from overhead_common import REPO, device_description, engine_settings, git_state, make_pages, wait_gpu_memory_free
from overhead_daemon import daemon_phase
from overhead_micro import micro
from overhead_remote import remote_phase, server_for, stop_server

# The phases are in overhead_bare.py (a), overhead_daemon.py (b), overhead_remote.py (remote,
# remote-kill, serve, stop-server) and overhead_micro.py (--micro); what they share is in
# overhead_common.py. This file chooses the phases, prints the ratios and writes the result.


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


# -- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.deadline_at = time.monotonic() + a.deadline if a.deadline else None
    common.SRC = Path(a.src).resolve() if a.src else REPO
    sys.path.insert(0, str(common.SRC))
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
