"""bench/overhead.py's phase (a): the bare ``AsyncLLM`` loop on the engine settings chandrad builds."""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
from typing import Any

from overhead_common import CpuWindow, GpuPoller, LoopLag, compile_cache_env, pct, rates, seconds_to_deadline

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
            async with asyncio.timeout(seconds_to_deadline(a)):  # not wait_for: gh-86296 on 3.11
                await warm_up()
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
