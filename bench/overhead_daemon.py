"""bench/overhead.py's phase (b): ``chandrad run`` as a child process, pages dropped into its inbox;
its rates, CPU, GPU, outbox figures and the per-stage timeline from its log."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import overhead_common as common
from overhead_common import (
    REPO,
    CpuWindow,
    GpuPoller,
    compile_cache_env,
    daemon_config,
    descendants,
    drop,
    journal_docs,
    pct,
    rates,
    read_events,
)

# -- (b) the daemon --------------------------------------------------------------------------------


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


def daemon_phase(a: argparse.Namespace, settings: Any, files: list[Path], warm_file: Path | None,
                 root: Path, while_waiting: Any = None) -> dict[str, Any]:
    """``while_waiting(rows)``, if given, is called with the finished journal rows at every poll of
    the timed window (the remote-kill phase kills and restarts the server from it)."""
    (root / "inbox").mkdir(parents=True, exist_ok=True)
    config = daemon_config(a, settings, root)
    log_path = root / "daemon.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(common.SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
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
                   "--src", str(common.SRC), "--after-pages", str(spec["after_pages"]),
                   "--seconds", str(spec["seconds"]),
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
