"""What a model's files say about it: architecture, dtype, parameters (from the safetensors
headers), the layer and head sizes its memory needs follow from, and the stop token ids the engine
will use.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import snapshot_download

from chandrad.model.cache import hand_over
from chandrad.model.hub import ModelFilesError, SilentTqdm, hub_errors, plan_fetch


@dataclass(frozen=True)
class StopToken:
    id: int
    token: str
    sources: tuple[str, ...]  # "chandrad", "generation config", "tokenizer eos"


@dataclass(frozen=True)
class TextDims:
    """The language model's shape, as far as memory goes."""

    layers: int
    full_attention_layers: int
    kv_heads: int
    head_dim: int
    # Per sequence, all linear-attention (Gated DeltaNet) layers: their state does not grow with length.
    linear_state_bytes: int
    dtype: str


@dataclass(frozen=True)
class ModelFacts:
    folder: Path
    architecture: str
    model_type: str
    dtype: str
    parameters: int | None
    weight_bytes: int | None
    dims: TextDims
    patch_size: int
    merge_size: int
    stop_tokens: tuple[StopToken, ...]

    @property
    def stop_ids(self) -> list[int]:
        return [token.id for token in self.stop_tokens]


DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype.removeprefix("torch.").lower(), 2)


def text_dims(config: Mapping[str, Any]) -> TextDims:
    """Layer and head sizes from a model's config.json (its text_config for a vision-language model)."""
    text = config.get("text_config") or config
    declared = next(
        (d for d in (text.get("dtype"), text.get("torch_dtype"), config.get("dtype"), config.get("torch_dtype")) if d),
        "bfloat16",
    )
    dtype = str(declared).removeprefix("torch.")
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
    layer_types = text.get("layer_types")
    if layer_types:
        full = sum(1 for kind in layer_types if kind in ("full_attention", "attention", "sliding_attention"))
    elif text.get("full_attention_interval"):
        full = layers // int(text["full_attention_interval"])
    else:
        full = layers
    linear = layers - full
    state = 0
    if linear:
        key_heads = int(text.get("linear_num_key_heads", 0))
        value_heads = int(text.get("linear_num_value_heads", 0))
        key_dim = int(text.get("linear_key_head_dim", 0))
        value_dim = int(text.get("linear_value_head_dim", 0))
        kernel = int(text.get("linear_conv_kernel_dim", 4))
        ssm_bytes = dtype_bytes(str(text.get("mamba_ssm_dtype") or dtype))
        recurrent = value_heads * key_dim * value_dim * ssm_bytes
        conv = (kernel - 1) * (2 * key_heads * key_dim + value_heads * value_dim) * dtype_bytes(dtype)
        state = linear * (recurrent + conv)
    return TextDims(layers, full, kv_heads, head_dim, state, dtype)


def read_model_facts(folder: Path, parameters: int | None = None, weight_bytes: int | None = None) -> ModelFacts:
    """What a model folder (local, or a snapshot in the cache) says about the model.

    ``parameters``/``weight_bytes`` stand in where the weights are not there yet (the hub's counts).
    """
    config = _read_json(folder / "config.json")
    if config is None:
        raise ModelFilesError(f"{folder} has no readable config.json")
    vision = config.get("vision_config") or {}
    counted = _count_safetensors(folder)
    if counted is not None:
        parameters, weight_bytes = counted
    dims = text_dims(config)
    return ModelFacts(
        folder=folder,
        architecture=", ".join(config.get("architectures") or []) or "?",
        model_type=str(config.get("model_type", "?")),
        dtype=dims.dtype,
        parameters=parameters,
        weight_bytes=weight_bytes,
        dims=dims,
        patch_size=int(vision.get("patch_size", 16)),
        merge_size=int(vision.get("spatial_merge_size", 2)),
        stop_tokens=tuple(stop_tokens(folder)),
    )


def stop_tokens(folder: Path) -> list[StopToken]:
    """The ids generation stops at: chandrad's stop tokens, the generation config's and the tokenizer's eos.

    Chandra 2's generation config lists only ``<|endoftext|>`` while the model ends its turn with
    ``<|im_end|>``: chandrad's own list (engine/vllm.py STOP_TOKENS, passed as stop_token_ids)
    adds it; vLLM adds the generation config's and the tokenizer's eos to every request.
    """
    from chandrad.engine.vllm import STOP_TOKENS

    vocab = _vocab(folder)
    names = {token_id: token for token, token_id in vocab.items()}
    found: dict[int, list[str]] = {}

    def add(token_id: int, source: str) -> None:
        found.setdefault(token_id, [])
        if source not in found[token_id]:
            found[token_id].append(source)

    for token in STOP_TOKENS:
        if token in vocab:
            add(vocab[token], "chandrad")
    generation = _read_json(folder / "generation_config.json") or {}
    eos = generation.get("eos_token_id")
    for token_id in eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []:
        add(int(token_id), "generation config")
    tokenizer_config = _read_json(folder / "tokenizer_config.json") or {}
    tokenizer_eos = tokenizer_config.get("eos_token")
    if isinstance(tokenizer_eos, dict):
        tokenizer_eos = tokenizer_eos.get("content")
    if isinstance(tokenizer_eos, str) and tokenizer_eos in vocab:
        add(vocab[tokenizer_eos], "tokenizer eos")
    return [StopToken(token_id, names.get(token_id, "?"), tuple(sources)) for token_id, sources in found.items()]


def _vocab(folder: Path) -> dict[str, int]:
    """token → id, as ``tokenizer.get_vocab()`` gives it (added tokens included), from the files alone."""
    vocab: dict[str, int] = {}
    tokenizer = _read_json(folder / "tokenizer.json") or {}
    model_vocab = (tokenizer.get("model") or {}).get("vocab")
    if isinstance(model_vocab, dict):
        vocab.update({str(k): int(v) for k, v in model_vocab.items()})
    elif (folder / "vocab.json").is_file():
        vocab.update({str(k): int(v) for k, v in (_read_json(folder / "vocab.json") or {}).items()})
    for added in tokenizer.get("added_tokens") or []:
        vocab[str(added["content"])] = int(added["id"])
    decoder = (_read_json(folder / "tokenizer_config.json") or {}).get("added_tokens_decoder") or {}
    for token_id, added in decoder.items():
        vocab.setdefault(str(added["content"]), int(token_id))
    return vocab


def _count_safetensors(folder: Path) -> tuple[int, int] | None:
    """(parameters, weight bytes) from the safetensors headers, or None without weights."""
    files = sorted(folder.glob("*.safetensors"))
    if not files or not all(path.is_file() for path in files):
        return None
    parameters = size = 0
    for path in files:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            parameters += math.prod(tensor["shape"])
            start, end = tensor["data_offsets"]
            size += end - start
    return parameters, size


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remote_facts(
    repo_id: str,
    hub_cache: Path,
    *,
    endpoint: str | None = None,
    token: str | None = None,
    owner: tuple[int, int] | None = None,
) -> ModelFacts:
    """The facts of a model not downloaded yet: its small files into the cache, its counts from the hub."""
    plan = plan_fetch(repo_id, hub_cache, endpoint=endpoint, token=token)
    small = [f.path for f in plan.files if not f.path.endswith((".safetensors", ".bin", ".pt"))]
    with hub_errors(repo_id, endpoint, plan.revision):
        folder = Path(
            snapshot_download(
                repo_id,
                revision=plan.commit,
                cache_dir=hub_cache,
                allow_patterns=small,
                endpoint=endpoint,
                token=token,
                tqdm_class=SilentTqdm,
            )
        )
    if owner is not None:
        hand_over(hub_cache, owner)
    return read_model_facts(folder, plan.parameters, plan.weight_bytes)
