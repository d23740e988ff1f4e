"""GPU layouts → the vLLM engines to start, each with its arguments and its GPUs.

| layout | engines | what vLLM does |
|---|---|---|
| single | 1 on gpus[0] | one EngineCore |
| replicas | 1 per GPU | independent engines, each its own front end; the daemon balances pages |
| data-parallel | 1 | ``data_parallel_size = len(gpus)``: one front end, one EngineCore per GPU |
| tensor-parallel | 1 | ``tensor_parallel_size = len(gpus)``, vision encoder data-parallel (``mm_encoder_tp_mode``) |
| encoder-split | 2 | vision encoder on gpus[0] (EC producer) feeds the language model on gpus[1] (EC consumer) |

Everything here is pure: it builds plain dicts, so every layout is unit-tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from chandrad.config import EngineSettings
from chandrad.errors import ConfigError

Role = Literal["generate", "encoder"]


@dataclass(frozen=True)
class EngineSpec:
    """One AsyncLLM to start: its GPUs (CUDA_VISIBLE_DEVICES), env and AsyncEngineArgs keywords."""

    name: str
    role: Role
    gpus: tuple[int, ...]
    engine_args: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(gpu) for gpu in self.gpus)


def base_engine_args(settings: EngineSettings) -> dict[str, Any]:
    """AsyncEngineArgs keywords shared by every layout (Chandra's serving settings)."""
    args: dict[str, Any] = {
        "model": settings.model,
        "dtype": settings.dtype,
        "max_model_len": settings.max_model_len,
        "max_num_seqs": settings.max_num_seqs,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "limit_mm_per_prompt": {"image": 1, "video": 0},
        # Pixel bounds in the form transformers 5 wants ("size"); min/max_pixels are deprecated there.
        "mm_processor_kwargs": {"size": {"shortest_edge": settings.min_pixels, "longest_edge": settings.max_pixels}},
        "mm_processor_cache_gb": settings.mm_processor_cache_gb,
        "renderer_num_workers": settings.renderer_workers,
        "enforce_eager": settings.enforce_eager,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "disable_log_stats": True,  # our own stat logger reads the scheduler's numbers
        "seed": 0,
    }
    if settings.served_model_name:
        args["served_model_name"] = settings.served_model_name
    if settings.max_num_batched_tokens is not None:
        args["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.kv_cache_memory_gb is not None:
        args["kv_cache_memory_bytes"] = int(settings.kv_cache_memory_gb * 2**30)
    if settings.speculative_config:
        args["speculative_config"] = dict(settings.speculative_config)
    return args


def _allocator_env(tensor_parallel: bool) -> dict[str, str]:
    # Expandable segments fight fragmentation across pages of different sizes; vLLM's custom
    # all-reduce (tensor parallel) cannot register such memory, so it is left out there.
    return {} if tensor_parallel else {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


def plan_engines(settings: EngineSettings, ec_storage: Path | None = None) -> list[EngineSpec]:
    """The engines a layout needs; ConfigError for combinations that cannot work."""
    gpus = tuple(settings.gpus)
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"engine.gpus lists a GPU twice: {list(gpus)}")
    if not gpus:
        raise ConfigError("engine.gpus is empty: list at least one GPU index, e.g. gpus = [0]")
    layout = settings.layout
    if layout == "single" and len(gpus) != 1:
        raise ConfigError(
            f'engine.layout = "single" uses one GPU but engine.gpus = {list(gpus)}; '
            'choose layout = "replicas", "data-parallel", "tensor-parallel" or "encoder-split" for several'
        )
    if layout != "single" and len(gpus) < 2:
        raise ConfigError(f'engine.layout = "{layout}" needs at least two GPUs in engine.gpus (got {list(gpus)})')
    if layout == "encoder-split" and len(gpus) != 2:
        raise ConfigError('engine.layout = "encoder-split" takes exactly two GPUs: [encoder, language model]')
    if layout == "tensor-parallel" and len(gpus) & (len(gpus) - 1):
        raise ConfigError(f"tensor parallelism needs a power-of-two number of GPUs, got {len(gpus)}")

    base = base_engine_args(settings)
    if layout == "single":
        return [EngineSpec("engine", "generate", gpus, {**base, **settings.engine_args}, _allocator_env(False))]
    if layout == "replicas":
        return [
            EngineSpec(f"engine-gpu{gpu}", "generate", (gpu,), {**base, **settings.engine_args}, _allocator_env(False))
            for gpu in gpus
        ]
    if layout == "data-parallel":
        args = {**base, "data_parallel_size": len(gpus), **settings.engine_args}
        return [EngineSpec("engine", "generate", gpus, args, _allocator_env(False))]
    if layout == "tensor-parallel":
        args = {**base, "tensor_parallel_size": len(gpus), "mm_encoder_tp_mode": "data", **settings.engine_args}
        return [EngineSpec("engine", "generate", gpus, args, _allocator_env(True))]

    # encoder-split: vLLM's encoder disaggregation through the shared-storage EC connector.
    if ec_storage is None:
        raise ConfigError("encoder-split needs a directory for the encoder cache (state_dir/ec_cache)")
    if not settings.enable_prefix_caching:
        # The language engine must identify the image by the id chandrad gives it (the encoder's
        # output file is named by it); vLLM 0.26 replaces given ids when both its caches are off.
        raise ConfigError('engine.layout = "encoder-split" needs engine.enable_prefix_caching = true')
    storage = {"shared_storage_path": str(ec_storage)}
    producer = {
        **base,
        # vLLM 0.26 does not derive these from ec_role (0.3x does): an encoder-only engine without
        # KV cache, whole prompts in one step, no CUDA graphs for an encoder pass.
        "mm_encoder_only": True,
        "enable_prefix_caching": False,
        # With no cache at all, vLLM 0.26 names each image by a per-request id instead of the one
        # chandrad gives (multi_modal_uuids), and the language engine would never find the output.
        # A small cache keeps the given id; vLLM's cache needs a single renderer thread.
        "mm_processor_cache_gb": max(settings.mm_processor_cache_gb, 0.25),
        "renderer_num_workers": 1,
        "enforce_eager": True,
        "max_num_batched_tokens": max(settings.max_model_len, 114688),
        "ec_transfer_config": {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": storage,
        },
        **settings.engine_args,
    }
    consumer = {
        **base,
        "ec_transfer_config": {
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_consumer",
            "ec_connector_extra_config": storage,
        },
        **settings.engine_args,
    }
    return [
        EngineSpec("encoder", "encoder", (gpus[0],), producer, _allocator_env(False)),
        EngineSpec("language", "generate", (gpus[1],), consumer, _allocator_env(False)),
    ]
