"""What the engine needs to know of the hardware it runs on: its name, as throughput profiles and their cache
record it, and whether the CPU has native bfloat16 matmul kernels."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_has_bf16_kernels() -> bool:
    """Whether this torch build runs bfloat16 matmuls natively on this CPU: oneDNN's bfloat16 path (x86 with
    AVX-512 or AMX, Arm with bf16 instructions). False where bfloat16 is emulated (x86 with AVX2 only)."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def hardware_name(device: torch.device, threads: int | None = None) -> str:
    """GPU name, or the CPU model name, torch's vector ISA on it (``torch.backends.cpu.get_cpu_capability()``:
    'AVX2', 'AVX512', ...) and the torch threads (``threads``, default: this process's), e.g.
    ``"AMD EPYC AVX2 2 threads"``. The ISA is part of the name because one model name covers CPUs with and
    without AVX-512, whose step times differ several-fold."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return f"{model} {torch.backends.cpu.get_cpu_capability()} {threads or torch.get_num_threads()} threads"
