"""Chandra on vLLM: long-lived ``AsyncLLM`` engines shared by every page of every document.

The prompt is Chandra's own (``chandra.prompts.PROMPT_MAPPING``) with the page image, rendered
by the model's chat template; images are pre-scaled with ``chandra.model.util.scale_to_fit``.
Generation is greedy first, then Chandra's retry ladder (rising temperature) while
``detect_repeat_token`` sees a loop or the engine reports a recoverable error, at most
``max_retries`` times. What Chandra's client leaves to vLLM's server (penalties, top_k, min_p) is
taken from the model's generation config, as that server takes it. An engine that died raises
``EngineDied``: the supervisor restarts it and sends the page again.

vLLM is imported only in ``start``: the daemon's process never touches CUDA itself (each
``AsyncLLM`` runs its EngineCore in a child process with its own ``CUDA_VISIBLE_DEVICES``).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from chandra.model.util import scale_to_fit
from chandra.prompts import PROMPT_MAPPING
from PIL import Image

from chandrad.config import EngineSettings
from chandrad.engine.base import PageRequest, PageResult
from chandrad.engine.ladder import Completion, Sampling, chandra_is_repeating, read_with_retries
from chandrad.engine.layout import EngineSpec, plan_engines
from chandrad.engine.processes import (
    descendant_pids,
    end_process_tree,
    is_vllm_process,
    record_engine_process,
    spawned_children,
)
from chandrad.errors import EngineDied, PermanentError, TransientError

log = structlog.get_logger("chandrad.engine.vllm")

STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")

# Chandra's own client sends temperature, top_p and max_tokens; vLLM's OpenAI server, which it talks
# to, takes whatever else a request leaves unset from the model's generation_config.json (vLLM's
# ``--generation-config auto``, the default). These are those, so that a page is decoded as
# Chandra's pipeline decodes it (a repetition_penalty there changes even the greedy answer).
SERVER_SAMPLING_DEFAULTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "top_k", "min_p")

# How long an engine start may take to spawn its EngineCore process before the next one is spawned
# anyway (after waiting for the first to finish loading: correct, only slower).
SPAWN_WAIT_SECONDS = 120.0

# For the CPU build of vLLM (tests, machines without a GPU): don't pin OpenMP threads to cores we
# share with the daemon; run the model inside the EngineCore process (no extra worker process),
# which is only stable with one OpenMP thread per process. Set only where the user has not.
CPU_ENV = {
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "OMP_NUM_THREADS": "1",
}


@dataclass
class EngineStats:
    """What the engines' schedulers report, read by the supervisor and the tests."""

    running: int = 0
    waiting: int = 0
    peak_running: int = 0
    kv_cache_usage: float = 0.0
    pages: int = 0
    output_tokens: int = 0
    started_at: float = field(default_factory=time.monotonic)


def _stat_logger_factory(stats: EngineStats) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerWatcher(StatLoggerBase):  # type: ignore[misc]  # vLLM is not type-checked here (not followed)
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
        ) -> None:
            if scheduler_stats is not None:
                stats.running = scheduler_stats.num_running_reqs
                stats.waiting = scheduler_stats.num_waiting_reqs
                stats.peak_running = max(stats.peak_running, stats.running)
                stats.kv_cache_usage = getattr(scheduler_stats, "kv_cache_usage", 0.0)

        def log_engine_initialized(self) -> None:
            return None

    return SchedulerWatcher


class _Instance:
    """One AsyncLLM and what is needed to prompt it."""

    def __init__(
        self,
        spec: EngineSpec,
        llm: Any,
        tokenizer: Any,
        prompt_by_type: dict[str, str],
        stop_ids: list[int],
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.llm = llm
        self.tokenizer = tokenizer
        self.prompt_by_type = prompt_by_type
        self.stop_ids = stop_ids
        self.sampling_defaults = sampling_defaults or {}


class VllmEngine:
    name = "vllm"

    def __init__(
        self,
        settings: EngineSettings,
        state_dir: Path,
        repeat_detector: Callable[[str], bool] = chandra_is_repeating,
        spawn_gate: asyncio.Lock | None = None,
    ) -> None:
        self.settings = settings
        self.state_dir = state_dir
        # Engines of one process that start at the same time (replicas) take turns only while
        # their EngineCore is being spawned: see _spawn.
        self.spawn_gate = spawn_gate or asyncio.Lock()
        self.model = settings.model
        self.repeat_detector = repeat_detector
        self.stats = EngineStats()
        self.ec_storage = state_dir / "ec_cache"
        self.specs = plan_engines(settings, self.ec_storage)
        self._ec_names: dict[str, set[str]] = {}  # encoder-split: a page's id → its rendered image hashes
        self._instances: list[_Instance] = []
        self._encoders: list[_Instance] = []
        self._loading_cores: dict[str, list[int]] = {}  # while start() runs: engine name → its EngineCore
        self.vllm_version = ""

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        import vllm

        self.vllm_version = vllm.__version__
        self.stats = EngineStats()
        loading: dict[str, asyncio.Task[_Instance]] = {}
        try:
            for spec in self.specs:
                await self._spawn(spec, loading)
            for spec in self.specs:
                # Shielded: cancelling start() must not cancel the load's task, whose thread would
                # load on unwatched (see below).
                instance = await asyncio.shield(loading[spec.name])
                (self._encoders if spec.role == "encoder" else self._instances).append(instance)
            one_torch_thread_in_front_end()
            await self._warm_up()
        except BaseException:
            # A stop, a start timeout or a sibling's failure: nobody wants the engines still loading.
            # Their threads cannot be cancelled, and a load runs on for minutes (on the GPU a stop
            # during a recycle kept chandrad 30 s past "chandrad stopped"); ending an EngineCore ends
            # its load at once (vLLM's start-up wait watches the process and raises). Whatever still
            # finishes loading is shut down once it is up.
            for name, task in loading.items():
                if not task.done():
                    end_process_tree(self._loading_cores.get(name, []))
                    task.add_done_callback(_shut_down_when_loaded)
                elif (
                    not task.cancelled()
                    and task.exception() is None
                    and task.result() not in (*self._instances, *self._encoders)
                ):
                    self._instances.append(task.result())
            await self.aclose()
            raise
        finally:
            self._loading_cores.clear()

    async def _spawn(self, spec: EngineSpec, loading: dict[str, asyncio.Task[_Instance]]) -> None:
        """Start loading one engine into ``loading``; return once its EngineCore process exists.

        The EngineCore child takes CUDA_VISIBLE_DEVICES from this process's environment when it is
        spawned, so engines are spawned one at a time, each with its own GPUs set, and then load
        (minutes: weights, compile, CUDA graphs) side by side: two replicas start in the time of one.
        """
        async with self.spawn_gate:
            set_spawn_environment(spec)
            before = set(spawned_children())
            task = loading[spec.name] = asyncio.create_task(
                asyncio.to_thread(self._create, spec), name=f"load-{spec.name}"
            )
            deadline = time.monotonic() + SPAWN_WAIT_SECONDS
            # Without a child process (CPU build, in-process engine) this waits for the whole load.
            while not task.done() and time.monotonic() < deadline:
                spawned = set(spawned_children()) - before
                if spawned:
                    self._loading_cores[spec.name] = sorted(spawned)
                    for pid in spawned:
                        try:
                            record_engine_process(self.state_dir, pid)
                        except OSError as error:  # e.g. a state_dir this user cannot write
                            log.warning(
                                "cannot record the engine process: if chandrad is killed, end it by hand",
                                pid=pid,
                                error=str(error),
                            )
                    break
                await asyncio.sleep(0.2)
            if not task.done() and time.monotonic() >= deadline:
                await asyncio.shield(task)

    def _create(self, spec: EngineSpec) -> _Instance:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if spec.role == "encoder":
            # vLLM's example EC connector never deletes what it writes: a crash's leftovers go here,
            # each page's own output after its page (ocr).
            shutil.rmtree(self.ec_storage, ignore_errors=True)
            self.ec_storage.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        args = AsyncEngineArgs(**spec.engine_args)
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self.stats)])
        tokenizer = llm.tokenizer if getattr(llm, "tokenizer", None) is not None else llm.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # older vLLM: async get_tokenizer
            tokenizer = asyncio.run(tokenizer)  # type: ignore[arg-type]  # an awaitable, a coroutine in every vLLM that has it
        prompts = {
            prompt_type: tokenizer.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}],
                tokenize=False,
                add_generation_prompt=True,
            )
            for prompt_type, text in PROMPT_MAPPING.items()
        }
        vocab = tokenizer.get_vocab()
        stop_ids = [vocab[token] for token in STOP_TOKENS if token in vocab]
        sampling_defaults = _server_sampling_defaults(llm)
        renders_off_loop = _async_renderer(llm) is not None
        log.info(
            "vllm engine started",
            engine=spec.name,
            gpus=spec.cuda_visible_devices,
            seconds=round(time.monotonic() - started, 1),
            vllm=self.vllm_version,
            prompts_rendered_in="renderer threads" if renders_off_loop else "event loop",
            sampling_defaults=sampling_defaults or None,
        )
        if not renders_off_loop:
            log.warning(
                "this vLLM has no async renderer: each page's image is processed on the daemon's "
                "event loop, one at a time (~0.2 s a page on a GPU host); install vLLM >= 0.26 for "
                "engine.renderer_workers to apply",
                vllm=self.vllm_version,
            )
        return _Instance(spec, llm, tokenizer, prompts, stop_ids, sampling_defaults)

    async def _warm_up(self) -> None:
        """One small page end to end: readiness means the engine has answered, not just loaded."""
        page = Image.new("RGB", (224, 224), "white")  # the smallest page scale_to_fit makes
        await self.ocr(PageRequest("warm-up", 0, page), max_tokens=8, retries=0)

    async def aclose(self) -> None:
        instances, self._instances, self._encoders = [*self._encoders, *self._instances], [], []
        for instance in instances:
            # shutdown() blocks for seconds while it stops the EngineCore: not on the event loop.
            await asyncio.to_thread(_shutdown_quietly, instance.llm)

    async def check_health(self) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        for instance in [*self._encoders, *self._instances]:
            try:
                await instance.llm.check_health()
            except EngineDeadError as error:
                raise EngineDied("the vLLM engine failed its health check", stage="engine") from error

    def engine_pids(self) -> list[int]:
        """Process ids of the EngineCore children (for memory watermarks)."""
        return [child for child in descendant_pids(os.getpid()) if is_vllm_process(child)]

    # -- pages ---------------------------------------------------------------------------------

    async def ocr(self, request: PageRequest, max_tokens: int | None = None, retries: int | None = None) -> PageResult:
        if not self._instances:
            raise EngineDied("the vLLM engine is not running", stage="engine")
        # One language-model engine per VllmEngine (replicas are ReplicaSet's, one VllmEngine each).
        instance = self._instances[0]
        # Resizing costs ~130 ms a page: on the event loop it capped the daemon at 82% of a bare
        # engine on an H200 (bench/NOTES-overhead.md). A worker thread does it instead.
        image = await asyncio.to_thread(_scaled_rgb, request.image)
        max_tokens = max_tokens or self.settings.max_tokens
        max_retries = self.settings.max_retries if retries is None else retries
        started = time.monotonic()
        # The page image's name for vLLM's caches, the same for every attempt at this page: without
        # one vLLM names an image by hashing its pixels, copying them first under the GIL (a sixth
        # of the daemon process's GIL time in the H100 wave, bench/NOTES-overhead.md), and every
        # replica's front end shares the daemon's one GIL. Unique to this read of this page.
        image_id = f"{request.doc_id}-p{request.page_no}-{uuid.uuid4().hex[:12]}"
        if not self._encoders:
            return await self._read(instance, request, image, max_tokens, max_retries, started, image_id)
        # encoder-split: both engines must name the image alike, or the language model never finds
        # the encoder's output and encodes the image again itself (vLLM names it by a per-request id
        # when the encoder engine has no caches). The name is ours, so is the file: ~17 MB a page
        # for Chandra 2, which vLLM's example connector never deletes.
        try:
            await self._generate(self._encoders[0], request, image, 1, 0.0, 1.0, -1, image_id, encoder_split=True)
            return await self._read(
                instance, request, image, max_tokens, max_retries, started, image_id, encoder_split=True
            )
        finally:
            # The file is named by the id, or (vLLM 0.26, with processor kwargs) by a hash of it,
            # which is what the prompts rendered for this page carry.
            for name in {image_id, *self._ec_names.pop(image_id, ())}:
                # Not awaited: this also runs while the page is being cancelled.
                asyncio.get_running_loop().run_in_executor(None, shutil.rmtree, self.ec_storage / name, True)

    async def _read(
        self,
        instance: _Instance,
        request: PageRequest,
        image: Image.Image,
        max_tokens: int,
        max_retries: int,
        started: float,
        image_id: str,
        encoder_split: bool = False,
    ) -> PageResult:
        async def attempt_once(attempt: int, sampling: Sampling) -> Completion:
            output = await self._generate(
                instance,
                request,
                image,
                max_tokens,
                sampling.temperature,
                sampling.top_p,
                attempt,
                image_id,
                encoder_split,
            )
            completion = output.outputs[0]
            return Completion(
                completion.text,
                len(output.prompt_token_ids or []),
                len(completion.token_ids),
                str(completion.finish_reason),
            )

        result = await read_with_retries(attempt_once, max_retries, request.page_no, self.repeat_detector, started)
        self.stats.pages += 1
        self.stats.output_tokens += result.output_tokens
        return result

    async def _generate(
        self,
        instance: _Instance,
        request: PageRequest,
        image: Image.Image,
        max_tokens: int,
        temperature: float,
        top_p: float,
        attempt: int,
        image_id: str,
        encoder_split: bool = False,
    ) -> Any:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMValidationError
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        # An over-long prompt: VLLMValidationError (a ValueError subclass in 0.26, not in 0.32),
        # or a plain ValueError from 0.26's engine-level length check.
        prompt_rejected = (VLLMValidationError, ValueError)
        # Only the final output is wanted, as token ids: vLLM would otherwise detokenize every step
        # and build an output object per token on this event loop, which serves every page.
        # No per-request seed, as Chandra's client sends none: a seeded request also killed the CPU
        # build's EngineCore whenever its prefill came in chunks ("CPU Generator does not use
        # offset": a Chandra 2 page's retry with prefix caching on).
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            stop_token_ids=instance.stop_ids,
            ignore_eos=self.settings.bench_force_max_tokens,
            output_kind=RequestOutputKind.FINAL_ONLY,
            detokenize=False,
            **instance.sampling_defaults,
            **self._repetition_detection(),
        )
        prompt: dict[str, Any] = {
            "prompt": instance.prompt_by_type[request.prompt_type],
            "multi_modal_data": {"image": image},
            "multi_modal_uuids": {"image": [image_id]},
        }
        request_id = f"{request.doc_id}-p{request.page_no}-a{attempt}-{uuid.uuid4().hex[:8]}"
        final = None
        try:
            engine_input = await _render_off_loop(instance.llm, prompt)
            if encoder_split:
                self._ec_names.setdefault(image_id, set()).update(_mm_hashes(engine_input))
            async for output in instance.llm.generate(engine_input, params, request_id=request_id):
                final = output
        except EngineDeadError as error:
            raise EngineDied("the vLLM engine process died", stage="engine", detail=str(error)) from error
        except prompt_rejected as error:
            raise PermanentError(
                f"page {request.page_no} does not fit the model ({error}); lower engine.max_pixels or raise "
                f"engine.max_model_len",
                stage="engine",
            ) from None
        except asyncio.CancelledError:
            raise
        except Exception as error:  # vLLM's recoverable per-request errors (EngineGenerateError, ...)
            if getattr(instance.llm, "errored", False):
                raise EngineDied("the vLLM engine failed", stage="engine", detail=str(error)) from error
            raise TransientError(f"the engine could not generate: {error}", stage="engine") from error
        if final is None:
            raise TransientError("the engine returned no output", stage="engine")
        completion = final.outputs[0]
        completion.text = await asyncio.to_thread(
            instance.tokenizer.decode,
            list(completion.token_ids),
            skip_special_tokens=True,
        )
        return final

    def _repetition_detection(self) -> dict[str, Any]:
        """vLLM's own loop detector stops a looping page early (finish "repetition"), where it exists."""
        max_pattern = self.settings.repetition_max_pattern_tokens
        if not max_pattern or self.settings.bench_force_max_tokens:
            return {}
        try:
            from vllm.sampling_params import RepetitionDetectionParams
        except ImportError:
            return {}
        return {
            "repetition_detection": RepetitionDetectionParams(
                max_pattern_size=max_pattern,
                min_count=self.settings.repetition_min_count,
            )
        }


def one_torch_thread_in_front_end() -> None:
    """Torch in the daemon's process at one intra-op thread, once the engines run in their own.

    vLLM's renderer threads (``engine.renderer_workers``) put each page through the model's image
    processor here, with torch at its default of a thread per core. Every such op wakes an OpenMP
    pool whose workers spin after it; vLLM sets its own workers to one thread for that reason
    (``set_torch_threads_for_runtime``) but leaves the front end's process as it is. Beside a burst
    of page renders (children at a lower priority) those spinning workers take the cores the
    renders need. An admin's ``OMP_NUM_THREADS`` is kept (the CPU build sets it: ``CPU_ENV``).
    """
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    if torch.get_num_threads() != 1:
        log.info("torch in the daemon's process set to one thread", was=torch.get_num_threads())
        torch.set_num_threads(1)


def _server_sampling_defaults(llm: Any) -> dict[str, Any]:
    """What vLLM's OpenAI server would add from the model's generation config to Chandra's requests."""
    model_config = getattr(llm, "model_config", None)
    defaults = getattr(model_config, "get_diff_sampling_param", None)
    if defaults is None:
        return {}
    found: dict[str, Any] = defaults()
    return {name: found[name] for name in SERVER_SAMPLING_DEFAULTS if name in found}


def _mm_hashes(engine_input: Any) -> list[str]:
    """The image hashes of a rendered prompt (an EC connector names its files by them)."""
    hashes = engine_input.get("mm_hashes") if isinstance(engine_input, dict) else None
    return [h for item_hashes in (hashes or {}).values() for h in item_hashes]


def _async_renderer(llm: Any) -> Callable[..., Any] | None:
    """vLLM's ``renderer.render_cmpl_async`` (0.26 and later), or None."""
    return getattr(getattr(llm, "renderer", None), "render_cmpl_async", None)


async def _render_off_loop(llm: Any, prompt: dict[str, Any]) -> Any:
    """The prompt tokenised and its image through the model's processor, in vLLM's renderer threads.

    Handed a raw prompt, vLLM (0.26 and 0.32 alike) runs the image processor inside ``generate`` on
    the caller's event loop: ~195 ms a page on an H200 host, one page at a time, which capped one
    front end near 3 pages/s (bench/NOTES-overhead.md). Its renderer does the same work in a thread
    pool of ``renderer_num_workers`` (engine.renderer_workers). Older vLLM without a renderer gets
    the raw prompt.
    """
    render = _async_renderer(llm)
    if render is None:
        return prompt
    (engine_input,) = await render([prompt])
    return engine_input


def _scaled_rgb(image: Image.Image) -> Image.Image:
    scaled: Image.Image = scale_to_fit(image.convert("RGB"))  # chandra-ocr ships no type hints
    return scaled


def _shut_down_when_loaded(task: asyncio.Task[_Instance]) -> None:
    if not task.cancelled() and task.exception() is None:
        threading.Thread(target=_shutdown_quietly, args=(task.result().llm,), daemon=True).start()


def _shutdown_quietly(llm: Any) -> None:
    try:
        llm.shutdown()
    except Exception as error:  # a dead engine may fail to shut down cleanly; it is gone either way
        log.debug("engine shutdown raised", error=str(error))
    # AsyncLLM.__del__ calls shutdown() again; at interpreter exit that raises a TypeError into
    # the log. It is done: make the second call a no-op.
    llm.shutdown = lambda *args, **kwargs: None


def _has_cuda_devices() -> bool:
    from chandrad.engine import cuda_gpu_visible

    return cuda_gpu_visible()


def set_spawn_environment(spec: EngineSpec) -> None:
    """What the EngineCore child of ``spec`` inherits when it is spawned: its GPUs and allocator."""
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    # One Triton cache for every start. Left unset, torch's inductor points it at a folder under its
    # own cache when it compiles (a cold start), while a warm start, which loads the compiled graph,
    # uses Triton's default folder: the GDN kernels that vLLM's profile run JIT-compiles and
    # autotunes were then missing at the first warm start after a cold one (a restart, a recycle,
    # the next daemon start), which paid them again: 80-97 s on an H200 (bench/NOTES-gpu.md
    # "Engine start"). The systemd units set it under chandrad's cache directory.
    if "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = str(triton_default_cache_dir())
    if _has_cuda_devices():
        os.environ.update(spec.env)
        # engine.gpus are the indices nvidia-smi and NVML show (PCI order), not CUDA's own order.
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
    else:
        for key, value in CPU_ENV.items():
            os.environ.setdefault(key, value)


def triton_default_cache_dir() -> Path:
    """Where Triton itself caches kernels when nothing redirects it ($TRITON_HOME or ~, .triton/cache)."""
    return Path(os.environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache"
