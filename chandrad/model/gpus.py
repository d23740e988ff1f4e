"""The NVIDIA GPUs here (index, name, total memory), asked without initialising CUDA."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    memory_bytes: int


def visible_gpus() -> list[GpuInfo] | None:
    """The NVIDIA GPUs (nvidia-smi's indices and total memory), without initialising CUDA; None: no driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            gpus = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                name = pynvml.nvmlDeviceGetName(handle)
                gpus.append(
                    GpuInfo(
                        index,
                        name.decode() if isinstance(name, bytes) else str(name),
                        int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    )
                )
            return gpus
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no pynvml, or no driver: ask nvidia-smi
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        result = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_nvidia_smi(result.stdout) if result.returncode == 0 else None


def parse_nvidia_smi(text: str) -> list[GpuInfo]:
    """``nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits`` (MiB)."""
    gpus = []
    for line in text.splitlines():
        parts = [part.strip() for part in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
            gpus.append(GpuInfo(int(parts[0]), parts[1], int(parts[2]) * 2**20))
    return gpus
