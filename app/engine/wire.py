"""Many small tensors pickled as one buffer: the drafter call and its answer between processes.

A CPU tensor pickles through ``torch.save`` of its storage, tens of microseconds each way however small it is, and a
drafter call after a run of rounds without drafting carries one features tensor per request and round (hundreds).
``tensors_to_wire`` copies them into one byte array (NumPy's, which pickle protocol 5 and Ray's serializer move as one
buffer) beside their dtypes and shapes; ``tensors_from_wire`` turns that back into tensors, views of one buffer.

Owns only the packing; which messages use it is theirs (``app.loop.DraftCall`` and ``DraftRound``, ``__reduce__``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 8  # bytes: every tensor starts at a multiple, so a view of any dtype up to 8 bytes wide is aligned

Meta = tuple[torch.dtype, tuple[int, ...]] | None  # a tensor's dtype and shape, or None for an absent tensor


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def tensors_to_wire(tensors: Sequence[torch.Tensor | None]) -> tuple[list[Meta], np.ndarray]:
    """CPU tensors (any dtype and shape; None for an absent one) as their (dtype, shape) list and one uint8 array.
    Runs no torch kernel on contiguous tensors (a non-contiguous one is made contiguous by torch first), nor does
    ``tensors_from_wire``: both are safe on any thread.

    Raises:
        ValueError: a tensor not on the CPU.
    """
    meta: list[Meta] = []
    present = []
    for t in tensors:
        if t is None:
            meta.append(None)
            continue
        if t.device.type != "cpu":
            raise ValueError(f"tensors_to_wire packs CPU tensors, got one on {t.device}")
        meta.append((t.dtype, tuple(t.shape)))
        present.append(t)
    buf = np.empty(sum(_padded(t.numel() * t.element_size()) for t in present), dtype=np.uint8)
    offset = 0
    for t in present:
        nbytes = t.numel() * t.element_size()
        if nbytes:
            # NumPy copies, not torch: pickling runs on a transport thread, and a torch copy of a prompt's features
            # starts an OpenMP parallel region there, a second pool that slows every later step (torch_thread.py)
            buf[offset:offset + nbytes] = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        offset += _padded(nbytes)
    return meta, buf


def tensors_from_wire(meta: Sequence[Meta], data: np.ndarray) -> list[torch.Tensor | None]:
    """The tensors ``tensors_to_wire`` packed, in order: views of one buffer (a copy of ``data`` when it is read-only,
    as an array from Ray's object store is), so one kept tensor keeps the whole buffer alive.

    Raises:
        ValueError: ``data`` shorter than ``meta`` describes.
    """
    need = sum(_padded(math.prod(m[1]) * m[0].itemsize) for m in meta if m is not None)
    if data.nbytes < need:
        raise ValueError(f"wire buffer of {data.nbytes} bytes, its tensors need {need}")
    buf = torch.from_numpy(data if data.flags.writeable else data.copy())
    out: list[torch.Tensor | None] = []
    offset = 0
    for m in meta:
        if m is None:
            out.append(None)
            continue
        dtype, shape = m
        nbytes = math.prod(shape) * dtype.itemsize
        # an empty buffer can come back from NumPy with stride 0, which torch cannot view as another dtype
        out.append(buf[offset:offset + nbytes].view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype))
        offset += _padded(nbytes)
    return out
