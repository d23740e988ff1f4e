"""Engines turn page images into Chandra HTML; ``create_engine`` picks one from the settings."""

from __future__ import annotations

import glob
import shutil

import structlog

from chandrad.config import EngineSettings
from chandrad.engine.base import Engine, PageRequest, PageResult
from chandrad.errors import ConfigError

log = structlog.get_logger("chandrad.engine")

__all__ = ["Engine", "PageRequest", "PageResult", "create_engine", "cuda_gpu_visible"]


def cuda_gpu_visible() -> bool:
    """Whether an NVIDIA GPU is visible, decided without initialising CUDA in this process."""
    return bool(glob.glob("/dev/nvidia[0-9]*")) or (
        shutil.which("nvidia-smi") is not None and bool(glob.glob("/proc/driver/nvidia/gpus/*"))
    )


def create_engine(settings: EngineSettings) -> Engine:
    kind = settings.kind
    if kind == "auto":
        if cuda_gpu_visible():
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
    try:
        from chandrad.engine.vllm import VllmEngine  # type: ignore[import-not-found]
    except ImportError as error:
        raise ConfigError(
            f"engine.kind = \"vllm\" needs vLLM: pip install 'chandrad[vllm]' ({error})"
        ) from None
    return VllmEngine(settings)  # type: ignore[no-any-return]
