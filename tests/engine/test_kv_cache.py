"""The slot KV cache starts at zero and, on the CPU, takes resident memory only as slots are written; prefix copies
between slots read every source before writing."""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from app.engine.model import KVCache, ModelArgs, lazy_zeros


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lazy_zeros_are_aligned_writable_zeros(dtype):
    t = lazy_zeros((3, 5, 7), dtype=dtype, device="cpu")
    assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % mmap.PAGESIZE == 0
    assert torch.equal(t, torch.zeros(3, 5, 7, dtype=dtype))
    t[1, 2] = 1.5
    assert float(t.sum()) == 1.5 * 7


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/statm")
def test_an_unwritten_cpu_cache_is_not_resident():
    """A 256 MiB cache (k and v) adds well under its size to resident memory until slots are written; one slot
    written becomes resident. ``torch.zeros`` would have written every byte at construction."""
    args = ModelArgs(vocab_size=16, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=8192,
                     tie_word_embeddings=True)
    before = resident_bytes()
    cache = KVCache(args, num_slots=16, max_len=4096, dtype=torch.float32, device="cpu")
    size = cache.k.numel() * 4 * 2
    assert size == 256 << 20
    assert resident_bytes() - before < size // 16
    cache.k[:, 0].fill_(1.0)  # one slot of 16 in k
    assert resident_bytes() - before >= cache.k[:, 0].numel() * 4


@pytest.mark.parametrize("token_major", [False, True])
def test_prefix_copies_read_every_source_before_writing(token_major):
    """Slot 1 is both a source (of slot 2's copy) and a destination (of slot 0's): slot 2 gets slot 1's old
    positions; a source no copy writes (slot 0, read twice) is copied from in place."""
    args = ModelArgs(vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
                     tie_word_embeddings=True)
    cache = KVCache(args, num_slots=4, max_len=8, dtype=torch.float32, device="cpu", token_major=token_major)
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    before = [[t.clone() for t in cache.slot_tokens(slot, 8)] for slot in range(4)]
    cache.copy_prefixes([(0, 1, 5), (1, 2, 6), (0, 3, 2)])
    for slot, count, source in ((1, 5, 0), (2, 6, 1), (3, 2, 0)):
        for now, old, rest in zip(cache.slot_tokens(slot, 8), before[source], before[slot]):
            assert torch.equal(now[..., :count, :], old[..., :count, :])
            assert torch.equal(now[..., count:, :], rest[..., count:, :])  # beyond the prefix: untouched
    for now, old in zip(cache.slot_tokens(0, 8), before[0]):
        assert torch.equal(now, old)
