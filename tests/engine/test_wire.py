"""Many small tensors as one pickled buffer (app/engine/wire.py)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from app.engine.wire import tensors_from_wire, tensors_to_wire


def test_tensors_of_any_dtype_and_shape_come_back_equal():
    tensors = [
        torch.randn(3, 5).to(torch.bfloat16),
        None,
        torch.arange(7),
        torch.tensor([True, False, True]),
        torch.randn(2, 3, 4)[:, 1],  # not contiguous
        torch.zeros(0, 16),
        torch.tensor(2.5, dtype=torch.float64),  # 0-dim
        torch.randint(0, 100, (3,), dtype=torch.int32),
    ]
    meta, data = tensors_to_wire(tensors)
    meta, data = pickle.loads(pickle.dumps((meta, data), protocol=5))
    back = tensors_from_wire(meta, data)
    assert len(back) == len(tensors)
    for t, b in zip(tensors, back):
        if t is None:
            assert b is None
        else:
            assert b.dtype == t.dtype and b.shape == t.shape and torch.equal(b, t)


def test_a_read_only_buffer_is_copied_before_torch_reads_it():
    meta, data = tensors_to_wire([torch.arange(4.0)])
    data.flags.writeable = False  # as an array from Ray's object store
    (back,) = tensors_from_wire(meta, data)
    back += 1  # no warning, and the caller's array is untouched
    assert torch.equal(back, torch.arange(1.0, 5.0)) and np.frombuffer(data, np.float32).tolist() == [0, 1, 2, 3]


def test_empty_tensors_alone_come_back():
    """An all-empty buffer copied from a read-only array (a drafter answer without blocks, through Ray's object
    store) has stride 0 in torch."""
    meta, data = tensors_to_wire([torch.zeros(0, 7), torch.zeros(0, dtype=torch.long)])
    data.flags.writeable = False
    back = tensors_from_wire(meta, data)
    assert [(t.shape, t.dtype) for t in back] == [((0, 7), torch.float32), ((0,), torch.long)]


def test_bad_input_is_named():
    meta, data = tensors_to_wire([torch.arange(4.0)])
    with pytest.raises(ValueError, match="wire buffer of 8 bytes"):
        tensors_from_wire(meta, data[:8])
    with pytest.raises(ValueError, match="CPU tensors, got one on meta"):
        tensors_to_wire([torch.zeros(1, device="meta")])
