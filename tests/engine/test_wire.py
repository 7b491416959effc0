"""Many small tensors as one pickled buffer (app/engine/wire.py)."""

from __future__ import annotations

import os
import pickle
import threading

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


def _threads_added_by(fn, tries: int = 1) -> int:
    """OS threads of this process that ``fn`` starts when run on a fresh thread (counted before it ends): the fewest
    new thread ids over ``tries`` runs. Threads that other code of the process ends meanwhile do not count, and one
    it starts meanwhile counts only if it does so in every run."""

    def tids() -> set[str]:
        return set(os.listdir("/proc/self/task"))

    def body():
        before = tids()
        fn()
        added.append(len(tids() - before))

    counts = []
    for _ in range(tries):
        added: list[int] = []
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        counts.append(added[0])
    return min(counts)


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in Linux's /proc")
def test_packing_starts_no_openmp_pool_on_the_pickling_thread():
    """Pickling runs on a transport thread; a torch copy of a prompt's features there starts an OpenMP pool of its
    own (torch_thread.py), which slowed every later verify step of a served target by ~10 ms."""
    features = torch.randn(150, 2880).to(torch.bfloat16)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if _threads_added_by(features.clone) < 1:
            pytest.skip("torch starts no OpenMP pool for a copy here")
        assert _threads_added_by(lambda: tensors_from_wire(*tensors_to_wire([features])), tries=3) == 0
    finally:
        torch.set_num_threads(threads)


def test_bad_input_is_named():
    meta, data = tensors_to_wire([torch.arange(4.0)])
    with pytest.raises(ValueError, match="wire buffer of 8 bytes"):
        tensors_from_wire(meta, data[:8])
    with pytest.raises(ValueError, match="CPU tensors, got one on meta"):
        tensors_to_wire([torch.zeros(1, device="meta")])
