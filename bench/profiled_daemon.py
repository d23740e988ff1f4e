#!/usr/bin/env python
"""``chandrad run`` in this process, with vLLM's torch profiler driven from outside chandrad.

bench/overhead.py starts this instead of ``python -m chandrad run`` when it is given
``--daemon-profile``: the same Daemon, settings, logging and engine as ``chandrad run --config``
(nothing under chandrad/ changes), plus one task that reaches into the running engine
(``Daemon.engine`` -> ``SupervisedEngine.engine`` -> ``VllmEngine._instances[0].llm``, an
``AsyncLLM``) and, once ``--after-pages`` pages have finished (a steady state: the first wave is
done and new pages are being admitted), calls ``start_profile()``, waits ``--seconds``, calls
``stop_profile()`` and writes what happened to ``--record`` (wall-clock times of both calls,
pages finished and the scheduler's running/waiting counts at each end, how long the stop held the
engine while the trace was written).

The profiler itself is configured by the engine argument ``profiler_config`` (vLLM 0.26 has no
VLLM_TORCH_PROFILER_DIR any more), which overhead.py adds to the daemon's engine_args; vLLM 0.26's
EngineArgs leaves a dict there unconverted, so this process converts it (a patch of vLLM's
``EngineArgs.__post_init__`` in this process only). VLLM_CUSTOM_SCOPES_FOR_PROFILING=1 (set by
overhead.py) makes the model runner mark preprocess (the vision encoder runs there), forward,
postprocess (the logits) and sample in the trace, which bench/profile_gpu.py groups by.

Usage: python bench/profiled_daemon.py --config CFG --src DIR --after-pages N --seconds S --record FILE
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any


def patch_profiler_config() -> None:
    from vllm.config import ProfilerConfig
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.__post_init__

    def post_init(self: Any) -> None:
        if isinstance(getattr(self, "profiler_config", None), dict):
            self.profiler_config = ProfilerConfig(**self.profiler_config)
        original(self)

    EngineArgs.__post_init__ = post_init  # type: ignore[method-assign]


def engine_of(daemon: Any) -> Any:
    """The VllmEngine inside the daemon's supervisor, or None while it is not up."""
    supervised = getattr(daemon, "engine", None)
    inner = getattr(supervised, "engine", None)
    return inner if inner is not None and getattr(inner, "_instances", None) else None


async def drive_profiler(daemon: Any, a: argparse.Namespace) -> None:
    record: dict[str, Any] = {"after_pages": a.after_pages, "delay": a.delay, "seconds": a.seconds}
    try:
        while engine_of(daemon) is None or not daemon.started:
            await asyncio.sleep(0.5)
        engine = engine_of(daemon)
        base = engine.stats.pages  # the warm-up pages (chandrad's own, the bench's full-size one) count too
        record["pages_before_timed"] = base
        while engine.stats.pages - base < a.after_pages:
            await asyncio.sleep(0.05)
        await asyncio.sleep(a.delay)  # e.g. into the decode-only middle of the first wave
        llm = engine._instances[0].llm

        def snapshot() -> dict[str, Any]:
            s = engine.stats
            return {"t": time.time(), "pages": s.pages - base, "running": s.running, "waiting": s.waiting,
                    "kv_cache_usage": s.kv_cache_usage}

        record["start_called"] = snapshot()
        await llm.start_profile()
        record["start_returned"] = snapshot()
        await asyncio.sleep(a.seconds)
        record["stop_called"] = snapshot()
        await llm.stop_profile()
        record["stop_returned"] = snapshot()
        record["start_call_s"] = round(record["start_returned"]["t"] - record["start_called"]["t"], 3)
        # stop_profile returns once the worker has written the trace: the engine did no steps meanwhile
        record["stop_stall_s"] = round(record["stop_returned"]["t"] - record["stop_called"]["t"], 3)
        record["profiled_s"] = round(record["stop_called"]["t"] - record["start_returned"]["t"], 3)
        print(f"[profiled_daemon] profiled {record['profiled_s']} s; stop held the engine "
              f"{record['stop_stall_s']} s", file=sys.stderr, flush=True)
    except asyncio.CancelledError:
        record["cancelled"] = True
        raise
    except Exception as error:  # the daemon's figures stay valid; say why there is no trace
        record["error"] = repr(error)
        print(f"[profiled_daemon] profiling failed: {error!r}", file=sys.stderr, flush=True)
    finally:
        Path(a.record).write_text(json.dumps(record, indent=2) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, type=Path)
    ap.add_argument("--src", required=True, help="directory holding the chandrad package measured")
    ap.add_argument("--after-pages", type=int, required=True, help="timed pages finished before the profile starts")
    ap.add_argument("--seconds", type=float, required=True, help="how long the profile runs")
    ap.add_argument("--delay", type=float, default=0.0, help="seconds to wait after --after-pages before starting")
    ap.add_argument("--record", required=True, help="JSON file: what the profiler task did, with times")
    a = ap.parse_args()
    sys.path.insert(0, str(Path(a.src).resolve()))
    patch_profiler_config()
    from chandrad.cli import load as _load
    from chandrad.logs import configure_logging
    from chandrad.service.daemon import Daemon
    from chandrad.service.notify import Notifier

    settings = _load(a.config)
    configure_logging(settings.log_format, settings.log_level, settings.journal_socket)

    async def run() -> int:
        daemon = Daemon(settings, a.config, notifier=Notifier.from_environment())
        profiler = asyncio.create_task(drive_profiler(daemon, a))
        try:
            return await daemon.serve()
        finally:
            if not profiler.done():
                profiler.cancel()
            await asyncio.gather(profiler, return_exceptions=True)

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
