"""``chandrad check``'s lines about the model: where its files are, its facts, stop ids, GPU fit."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from chandrad.config import EngineSettings
from chandrad.model.cache import cached_snapshot, is_hub_id, service_owner, snapshot_complete
from chandrad.model.facts import ModelFacts, read_model_facts, remote_facts
from chandrad.model.fit import format_gib, gpu_fit, memory_needs, min_gpu_bytes
from chandrad.model.gpus import GpuInfo
from chandrad.model.hub import ModelFilesError, hub_offline
from chandrad.model.progress import format_gb

Level = Literal["ok", "warn", "FAIL"]


@dataclass(frozen=True)
class CheckLine:
    level: Level
    what: str
    detail: str


def check_model(
    engine: EngineSettings,
    hub_cache: Path,
    gpus: list[GpuInfo] | None,
    *,
    will_use_gpu: bool,
    endpoint: str | None = None,
) -> list[CheckLine]:
    """``chandrad check``'s lines about the model: where its files are, its facts, stop ids, GPU fit."""
    lines: list[CheckLine] = []
    model = engine.model
    facts: ModelFacts | None
    if not is_hub_id(model):
        folder = Path(model).expanduser()
        if not snapshot_complete(folder):
            return [CheckLine("FAIL", "model", f"{folder} lacks config.json, a tokenizer or complete weights")]
        lines.append(CheckLine("ok", "model", f"local folder {folder}"))
        facts = _readable_facts(folder, lines)
    elif (folder_or_none := cached_snapshot(model, hub_cache)) is not None:
        lines.append(CheckLine("ok", "model", f"{model} in {folder_or_none}"))
        facts = _readable_facts(folder_or_none, lines)
    else:
        where = f"{model} is not downloaded to {hub_cache} yet"
        if not will_use_gpu:
            lines.append(CheckLine("warn", "model", f"{where} (no GPU visible: the daemon would use tesseract)"))
            return lines
        if hub_offline():
            return [CheckLine("FAIL", "model", f"{where}, and HF_HUB_OFFLINE is set: run chandrad fetch-model")]
        try:
            facts = remote_facts(model, hub_cache, endpoint=endpoint, owner=service_owner(hub_cache))
        except (ModelFilesError, KeyError, ValueError, TypeError, OSError) as error:
            detail = f"its config lacks {error}" if isinstance(error, KeyError) else str(error)
            return [CheckLine("warn", "model", f"{where}; its facts cannot be read: {detail}")]
        lines.append(
            CheckLine(
                "warn",
                "model",
                f"{where} ({format_gb(facts.weight_bytes or 0)} of weights): the daemon downloads it at start, "
                f"or run chandrad fetch-model now",
            )
        )
    if facts is None:
        return lines
    lines.append(CheckLine("ok", "model facts", describe_facts(facts)))
    stops = ", ".join(f"{t.id} {t.token} ({', '.join(t.sources)})" for t in facts.stop_tokens)
    if not any(t.token == "<|im_end|>" for t in facts.stop_tokens):
        lines.append(
            CheckLine("FAIL", "stop tokens", f"{stops or 'none'}: no <|im_end|>, every page would run to max_tokens")
        )
    else:
        lines.append(CheckLine("ok", "stop tokens", stops))
    lines.append(_fit_line(engine, facts, gpus))
    return lines


def _readable_facts(folder: Path, lines: list[CheckLine]) -> ModelFacts | None:
    try:
        return read_model_facts(folder)
    except (ModelFilesError, KeyError, ValueError, TypeError, OSError) as error:
        detail = f"missing {error}" if isinstance(error, KeyError) else str(error)
        lines.append(CheckLine("FAIL", "model facts", f"cannot read {folder / 'config.json'}: {detail}"))
        return None


def describe_facts(facts: ModelFacts) -> str:
    count = facts.parameters
    parameters = (
        "parameters unknown"
        if not count
        else f"{count / 1e9:.2f} B parameters"
        if count >= 1e9
        else f"{count:,} parameters"
    )
    weights = f", {format_gb(facts.weight_bytes)} of weights" if facts.weight_bytes else ""
    layers = f"{facts.dims.layers} layers"
    if facts.dims.full_attention_layers != facts.dims.layers:
        layers += f" ({facts.dims.full_attention_layers} full attention)"
    return f"{facts.architecture} ({facts.model_type}), {facts.dtype}, {parameters}{weights}, {layers}"


def _fit_line(engine: EngineSettings, facts: ModelFacts, gpus: list[GpuInfo] | None) -> CheckLine:
    weight_bytes = facts.weight_bytes or 0
    dtype = facts.dtype if engine.dtype == "auto" else engine.dtype
    kv_dtype = str(engine.engine_args.get("kv_cache_dtype", "auto"))
    needs = memory_needs(replace(facts.dims, dtype=dtype), weight_bytes, kv_dtype)
    tensor_parallel = len(engine.gpus) if engine.layout == "tensor-parallel" else 1
    used = [engine.gpus[1]] if engine.layout == "encoder-split" else list(engine.gpus)
    kv_cache = int(engine.kv_cache_memory_gb * 2**30) if engine.kv_cache_memory_gb else None
    if not gpus:
        least = min_gpu_bytes(
            needs,
            max_num_seqs=engine.max_num_seqs,
            max_model_len=engine.max_model_len,
            gpu_memory_utilization=engine.gpu_memory_utilization,
            tensor_parallel=tensor_parallel,
        )
        return CheckLine(
            "warn",
            "GPU fit",
            f"no GPU visible, nothing to check; at max_num_seqs = {engine.max_num_seqs} and max_model_len = "
            f"{engine.max_model_len} it needs {tensor_parallel} GPU(s) of at least {format_gib(least)} "
            f"(gpu_memory_utilization {engine.gpu_memory_utilization})",
        )
    by_index = {gpu.index: gpu for gpu in gpus}
    missing = [index for index in used if index not in by_index]
    if missing:
        return CheckLine("FAIL", "GPU fit", f"engine.gpus lists {missing}, but the visible GPUs are {sorted(by_index)}")
    smallest = min((by_index[index] for index in used), key=lambda gpu: gpu.memory_bytes)
    fit = gpu_fit(
        needs,
        smallest.memory_bytes,
        max_num_seqs=engine.max_num_seqs,
        max_model_len=engine.max_model_len,
        gpu_memory_utilization=engine.gpu_memory_utilization,
        tensor_parallel=tensor_parallel,
        kv_cache_bytes=kv_cache,
    )
    where = f"GPU {smallest.index} ({smallest.name}, {format_gib(smallest.memory_bytes)})"
    advice = f"; set {fit.setting} = {fit.value}" if fit.setting else ""
    level: Level = "ok" if fit.fits and fit.setting is None else "warn" if fit.fits else "FAIL"
    return CheckLine(level, "GPU fit", f"{where}: {fit.detail}{advice}")
