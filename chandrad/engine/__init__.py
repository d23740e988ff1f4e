"""Engines turn page images into Chandra HTML; ``create_engine`` picks one from the settings."""

from __future__ import annotations

import asyncio
import glob
import os
import shutil
from functools import partial
from pathlib import Path

import structlog

from chandrad.config import EngineSettings
from chandrad.engine.base import Engine, PageRequest, PageResult
from chandrad.errors import ConfigError

log = structlog.get_logger("chandrad.engine")

__all__ = [
    "Engine",
    "PageRequest",
    "PageResult",
    "create_engine",
    "cuda_gpu_visible",
    "loads_model_files",
    "pages_in_flight",
]


def cuda_gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible, decided without initialising CUDA in this process."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or (
        shutil.which("nvidia-smi") is not None and bool(glob.glob("/proc/driver/nvidia/gpus/*"))
    )


def pages_in_flight(settings: EngineSettings, engine_name: str) -> int:
    """Pages kept at the engine at once, across all documents: ``max_pages_in_flight``, else what the
    engine reads at once at best: one per core for tesseract, ``max_num_seqs`` per vLLM engine core."""
    if settings.max_pages_in_flight is not None:
        return settings.max_pages_in_flight
    if engine_name == "tesseract":
        return os.cpu_count() or 1
    return settings.max_num_seqs * max(1, len(settings.gpus) if settings.layout in ("replicas", "data-parallel") else 1)


def loads_model_files(engine: Engine) -> bool:
    """Whether ``engine`` loads its model's files on this machine (in-process vLLM), so that they
    must be in this machine's hub cache before it starts. A remote server and tesseract do not."""
    from chandrad.engine.replicas import ReplicaSet
    from chandrad.engine.supervisor import SupervisedEngine

    return isinstance(engine, SupervisedEngine | ReplicaSet)


def create_engine(settings: EngineSettings, state_dir: Path) -> Engine:
    """The engine the settings ask for: tesseract, a supervised in-process vLLM, or remote servers."""
    kind = settings.kind
    if kind == "auto":
        if settings.urls or cuda_gpu_visible():
            kind = "vllm"
        else:
            log.warning(
                "no CUDA GPU visible: using the tesseract CPU engine. Its output is plain text blocks, "
                "far below Chandra's quality; run chandrad on a GPU server for Chandra OCR",
            )
            kind = "tesseract"
    if kind == "tesseract":
        from chandrad.engine.tesseract import TesseractEngine

        return TesseractEngine(settings.tesseract_languages, settings.page_timeout_seconds)
    if settings.urls:
        from chandrad.engine.remote import RemoteEngine

        return RemoteEngine(settings)
    try:
        import vllm  # noqa: F401
    except ImportError as error:
        raise ConfigError(
            f"engine.kind = \"vllm\" needs vLLM in chandrad's environment: pip install 'chandrad[vllm]' "
            f'(or set engine.url to a vLLM server, or kind = "tesseract") — {error}'
        ) from None
    from chandrad.engine.layout import plan_engines
    from chandrad.engine.replicas import ReplicaSet
    from chandrad.engine.supervisor import SupervisedEngine
    from chandrad.engine.vllm import VllmEngine

    plan_engines(settings, state_dir / "ec_cache")  # refuse impossible layouts now, not after a model load
    if settings.layout != "replicas":
        return SupervisedEngine(lambda: VllmEngine(settings, state_dir), settings)
    # One supervised single-GPU engine per GPU; they take turns only to spawn their EngineCore.
    spawn_gate = asyncio.Lock()
    replicas = []
    for index, gpu in enumerate(settings.gpus):
        one_gpu = settings.model_copy(update={"gpus": (gpu,), "layout": "single"})
        replicas.append(
            SupervisedEngine(
                partial(VllmEngine, one_gpu, state_dir, spawn_gate=spawn_gate),
                one_gpu,
                recycle_phase=index / len(settings.gpus),
            )
        )
    return ReplicaSet(replicas)
