"""Whether the GPUs hold the weights and the KV cache (``gpu_fit``, pure), and what to change when not."""

from __future__ import annotations

import math
from dataclasses import dataclass

from chandrad.model.facts import ModelFacts, TextDims, dtype_bytes

# vLLM's budget is gpu_memory_utilization of the GPU; out of it come the weights, the peak
# activations of its profile run (a max_num_batched_tokens prefill, the vision encoder on a page)
# with CUDA graphs and the CUDA context, and the rest is KV cache. The middle part, estimated:
ACTIVATION_BYTES = 3 * 2**30
# A typical page: a US-Letter page at 192 dpi is ~5 000 prompt tokens with Chandra's ocr_layout
# prompt, and ~1 500 output tokens (bench/NOTES-gpu.md).
TYPICAL_PAGE_TOKENS = 6500
# Below this a page at Chandra's pixel cap no longer fits with a useful answer.
MIN_MODEL_LEN = 8192


@dataclass(frozen=True)
class MemoryNeeds:
    weight_bytes: int
    kv_bytes_per_token: int
    state_bytes_per_sequence: int

    def sequence_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token + self.state_bytes_per_sequence


def memory_needs(facts_or_dims: ModelFacts | TextDims, weight_bytes: int, kv_cache_dtype: str = "auto") -> MemoryNeeds:
    dims = facts_or_dims.dims if isinstance(facts_or_dims, ModelFacts) else facts_or_dims
    kv_bytes = dtype_bytes(dims.dtype if kv_cache_dtype == "auto" else kv_cache_dtype)
    return MemoryNeeds(
        weight_bytes=weight_bytes,
        kv_bytes_per_token=2 * dims.full_attention_layers * dims.kv_heads * dims.head_dim * kv_bytes,
        state_bytes_per_sequence=dims.linear_state_bytes,
    )


@dataclass(frozen=True)
class GpuFit:
    fits: bool  # vLLM starts: the weights and one sequence of max_model_len fit
    kv_room_bytes: int  # the KV cache vLLM will have
    sequences_at_max_len: int  # sequences of max_model_len tokens it holds at once
    sequences_typical: int  # typical pages it holds at once
    min_gpu_bytes: int  # the smallest GPU that holds max_num_seqs typical pages
    setting: str | None  # the setting to change, or None
    value: str | None  # ...to this
    detail: str


def gpu_fit(
    needs: MemoryNeeds,
    gpu_bytes: int,
    *,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    tensor_parallel: int = 1,
    kv_cache_bytes: int | None = None,
    typical_tokens: int = TYPICAL_PAGE_TOKENS,
) -> GpuFit:
    """Whether ``tensor_parallel`` GPUs of ``gpu_bytes`` each hold the model at these settings.

    Pure arithmetic, an estimate (the activation allowance is a constant). vLLM refuses to start
    without room for one sequence of ``max_model_len`` beside the weights; with room for fewer
    than ``max_num_seqs`` typical pages it preempts and recomputes pages all the time, so
    ``max_num_seqs`` should come down to what fits. Fewer full-length sequences than
    ``max_num_seqs`` is normal: pages rarely run to the limit.
    """
    n = tensor_parallel
    typical = min(typical_tokens, max_model_len)
    full = needs.sequence_bytes(max_model_len)
    if kv_cache_bytes is not None:  # a fixed KV cache per GPU (engine.kv_cache_memory_gb)
        kv_room = n * kv_cache_bytes
        if needs.weight_bytes + n * (ACTIVATION_BYTES + kv_cache_bytes) > n * gpu_bytes:
            kv_room = 0
    else:
        kv_room = int(n * (gpu_bytes * gpu_memory_utilization - ACTIVATION_BYTES)) - needs.weight_bytes
    at_max = max(kv_room, 0) // full
    at_typical = max(kv_room, 0) // needs.sequence_bytes(typical)
    smallest = min_gpu_bytes(
        needs,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel=n,
        typical_tokens=typical_tokens,
    )
    if at_max < 1:
        setting, value = _make_it_fit(needs, gpu_bytes, n, full, kv_room, kv_cache_bytes is not None, smallest)
        detail = (
            f"a KV cache of {format_gib(n * kv_cache_bytes)} (engine.kv_cache_memory_gb) beside the weights "
            f"({format_gib(needs.weight_bytes)}) does not hold one sequence of {max_model_len} tokens "
            f"({format_gib(full)})"
            if kv_cache_bytes is not None
            else f"the weights ({format_gib(needs.weight_bytes)}) and one sequence of {max_model_len} tokens "
            f"({format_gib(full)}) do not fit in {n} × {format_gib(gpu_bytes)} × {gpu_memory_utilization}"
        )
        return GpuFit(False, kv_room, 0, 0, smallest, setting, value, detail)
    setting_or_none, value_or_none = (
        ("engine.max_num_seqs", str(at_typical)) if at_typical < max_num_seqs else (None, None)
    )
    detail = (
        f"weights {format_gib(needs.weight_bytes)}, KV cache {format_gib(kv_room)}: {at_max} sequences of "
        f"{max_model_len} tokens or {at_typical} typical pages (~{typical} tokens) at once, "
        f"for max_num_seqs = {max_num_seqs}"
    )
    return GpuFit(True, kv_room, at_max, at_typical, smallest, setting_or_none, value_or_none, detail)


def min_gpu_bytes(
    needs: MemoryNeeds,
    *,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    tensor_parallel: int = 1,
    typical_tokens: int = TYPICAL_PAGE_TOKENS,
) -> int:
    """The smallest GPU (each of ``tensor_parallel``) that holds ``max_num_seqs`` typical pages."""
    kv = max(
        max_num_seqs * needs.sequence_bytes(min(typical_tokens, max_model_len)), needs.sequence_bytes(max_model_len)
    )
    per_gpu = (needs.weight_bytes + kv) / tensor_parallel + ACTIVATION_BYTES
    return math.ceil(per_gpu / gpu_memory_utilization)


def _make_it_fit(
    needs: MemoryNeeds, gpu_bytes: int, n: int, full: int, kv_room: int, fixed_kv: bool, smallest: int
) -> tuple[str, str]:
    """The setting that lets vLLM start: more of the GPU, a shorter context, or more GPUs."""
    utilization = (needs.weight_bytes / n + ACTIVATION_BYTES + full / n) / gpu_bytes
    if not fixed_kv and utilization <= 0.95:
        return "engine.gpu_memory_utilization", f"{math.ceil(utilization * 100) / 100:.2f}"
    longest = (kv_room - needs.state_bytes_per_sequence) // needs.kv_bytes_per_token // 256 * 256
    if longest >= MIN_MODEL_LEN:
        return "engine.max_model_len", str(longest)
    gpus = 2
    while (needs.weight_bytes + full) / gpus + ACTIVATION_BYTES > 0.9 * gpu_bytes and gpus < 64:
        gpus *= 2
    return "engine.layout", f'"tensor-parallel" with {gpus} GPUs in engine.gpus (or GPUs of {format_gib(smallest)})'


def format_gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"
