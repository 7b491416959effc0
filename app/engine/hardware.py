"""The name of the hardware an engine runs on, as throughput profiles and their cache record it."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def hardware_name(device: torch.device, threads: int | None = None) -> str:
    """GPU name, or the CPU model name and the torch threads (``threads``, default: this process's)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} {threads or torch.get_num_threads()} threads"
