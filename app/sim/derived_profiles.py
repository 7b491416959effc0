"""Two derived throughput profiles for the simulator, until measured ones exist.

This module owns the cost models behind the derived profiles and the CLI that writes them; it measures
nothing. Shape symbols: B batch (requests), K gamma, N total tokens in a verify step.

1. CPU (``derived-smollm2-135m-instruct-xeon-2-cores.json``): SmolLM2-135M-Instruct in bf16 on this 2-core
   Xeon, fitted to the forward-pass times in /work/shared/MEASURED.md (200-token KV cache):
       verify_ms(B, N) = 66 + 2.3 * (B - 1) + 0.72 * max(0, N - 12)
   66 ms is the 1-token pass (dispatch-bound); 2.3 ms per extra request from the 16 x 1 figure (103 ms);
   0.72 ms per token past the ~12 tokens AMX hides, from the 64- and 128-token passes. Residuals against the
   table: 1 x 8 -10 ms, 1 x 16 -4, 1 x 64 0, 1 x 128 +1, 16 x 1 +1, 16 x 8 -14 ms. Batch sizes past 16 are
   extrapolated. Drafter: draft_ms(B) = 12 + 0.10 * B * K (about 4 ms of drafter dispatch plus an 8 ms
   replica call carrying the target features, then ~0.1 ms per drafted token for the LM head), K = 7.
   The lead's profiler replaces this file with a measured profile.

2. GPU-like (``roofline-llama-3.1-8b-h200.json``): Llama-3.1-8B in bf16 on one H200, a roofline:
       verify_ms(B, N) = overhead + max(memory_ms(B), compute_ms(N))
       memory_ms(B)    = (weight_bytes + B * context * kv_bytes_per_token) / (hbm_bw * bw_eff)
       compute_ms(N)   = N * (2 * params + 4 * layers * hidden * context) / (peak_flops * mfu)
   flat while memory-bound (the weights and KV cache are read once whatever N is), then linear in N; the
   knee lies near N = 480 tokens at B = 256. Drafter: draft_ms(B) = overhead_draft +
   max(draft_bytes / (hbm_bw * bw_eff), 2 * draft_params * B * K / (peak_flops * mfu)).
   Constants are in :data:`H200_LLAMA8B`.
"""

from __future__ import annotations

import argparse
import datetime as dt
from pathlib import Path

import torch

from app.scheduling.profile import Provenance, save_profile, ThroughputProfile, profile_filename

DRAFT_GAMMA = 7
CPU_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
CPU_TOKENS_PER_REQUEST = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16]
GPU_BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
GPU_TOKENS_PER_REQUEST = [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16]

H200_LLAMA8B = {
    "params": 8.03e9,  # Llama-3.1-8B parameters
    "weight_bytes": 16.06e9,  # bf16
    "layers": 32,
    "hidden": 4096,
    "kv_bytes_per_token": 32 * 8 * 128 * 2 * 2,  # layers x KV heads x head dim x (K, V) x bf16 = 131072
    "context": 1024,  # mean KV length per request (tokens)
    "hbm_bw": 4.8e12,  # H200 HBM3e, bytes/s
    "bw_eff": 0.8,  # achieved fraction of HBM bandwidth
    "peak_flops": 989e12,  # H200 dense bf16, FLOP/s
    "mfu": 0.6,  # achieved fraction of peak in large GEMMs
    "overhead_ms": 1.0,  # launch (CUDA graphs), sampling, scheduler per step
    "draft_params": 0.75e9,  # block drafter incl. shared LM head, FLOPs/2 per drafted token
    "draft_bytes": 1.5e9,
    "overhead_draft_ms": 0.3,
}


def cpu_verify_ms(batch: int, tokens: float) -> float:
    """Fitted CPU verify-step time (ms) of ``tokens`` total tokens over ``batch`` requests (formula above)."""
    return 66.0 + 2.3 * (batch - 1) + 0.72 * max(0.0, tokens - 12.0)


def cpu_draft_ms(batch: int) -> float:
    """Assumed CPU drafter step (ms) for ``batch`` requests of DRAFT_GAMMA tokens."""
    return 12.0 + 0.10 * batch * DRAFT_GAMMA


def gpu_verify_ms(batch: int, tokens: float, c: dict[str, float] = H200_LLAMA8B) -> float:
    """Roofline verify-step time (ms) on one H200 (formula in the module docstring)."""
    bandwidth = c["hbm_bw"] * c["bw_eff"]
    memory = (c["weight_bytes"] + batch * c["context"] * c["kv_bytes_per_token"]) / bandwidth
    flops_per_token = 2 * c["params"] + 4 * c["layers"] * c["hidden"] * c["context"]
    compute = tokens * flops_per_token / (c["peak_flops"] * c["mfu"])
    return c["overhead_ms"] + 1e3 * max(memory, compute)


def gpu_draft_ms(batch: int, c: dict[str, float] = H200_LLAMA8B) -> float:
    """Roofline drafter step (ms) for ``batch`` requests of DRAFT_GAMMA tokens."""
    memory = c["draft_bytes"] / (c["hbm_bw"] * c["bw_eff"])
    compute = 2 * c["draft_params"] * batch * DRAFT_GAMMA / (c["peak_flops"] * c["mfu"])
    return c["overhead_draft_ms"] + 1e3 * max(memory, compute)


def cpu_profile(*, date: dt.date) -> ThroughputProfile:
    """The CPU profile derived from MEASURED.md (see the module docstring)."""
    return ThroughputProfile(
        provenance=Provenance(
            engine="derived",
            model="SmolLM2-135M-Instruct",
            dtype="bfloat16",
            torch_version=torch.__version__,
            hardware="xeon-2-cores",
            date=date,
            source="derived",
            context_tokens=200,
            notes="derived-from-MEASURED.md: least-squares-by-eye fit of the bf16 forward-pass table; "
            "batch > 16 extrapolated; drafter assumed. See app/sim/derived_profiles.py.",
        ),
        batch_sizes=CPU_BATCH_SIZES,
        tokens_per_request=CPU_TOKENS_PER_REQUEST,
        verify_ms=[[round(cpu_verify_ms(b, b * t), 3) for t in CPU_TOKENS_PER_REQUEST] for b in CPU_BATCH_SIZES],
        draft_ms=[round(cpu_draft_ms(b), 3) for b in CPU_BATCH_SIZES],
        draft_gamma=DRAFT_GAMMA,
    )


def gpu_profile(*, date: dt.date) -> ThroughputProfile:
    """The roofline profile of Llama-3.1-8B on one H200 (see the module docstring)."""
    return ThroughputProfile(
        provenance=Provenance(
            engine="roofline",
            model="Llama-3.1-8B",
            dtype="bfloat16",
            torch_version="n/a",
            hardware="H200",
            date=date,
            source="derived",
            context_tokens=int(H200_LLAMA8B["context"]),
            notes="roofline: overhead + max(memory, compute); constants in app/sim/derived_profiles.py "
            "H200_LLAMA8B (bw_eff 0.8, mfu 0.6, 1 ms overhead).",
        ),
        batch_sizes=GPU_BATCH_SIZES,
        tokens_per_request=GPU_TOKENS_PER_REQUEST,
        verify_ms=[[round(gpu_verify_ms(b, b * t), 4) for t in GPU_TOKENS_PER_REQUEST] for b in GPU_BATCH_SIZES],
        draft_ms=[round(gpu_draft_ms(b), 4) for b in GPU_BATCH_SIZES],
        draft_gamma=DRAFT_GAMMA,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description="Write the derived CPU and GPU-like throughput profiles.")
    parser.add_argument("--out", type=Path, default=Path("profiles"), help="output folder")
    args = parser.parse_args()
    today = dt.date.today()
    for profile in (cpu_profile(date=today), gpu_profile(date=today)):
        path = save_profile(profile, args.out / profile_filename(profile.provenance))
        print(path)


if __name__ == "__main__":
    main()
