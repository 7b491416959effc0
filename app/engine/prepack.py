"""Linear layers on weights prepacked once into oneDNN's blocked layout (CPU, bfloat16 and float32).

Why: ``F.linear`` on a bfloat16 CPU tensor hands oneDNN a plain row-major weight, which it reorders into its
blocked layout inside every call. At decode sizes that reorder is most of the call: prepacked weights make the
decoder's matmuls of SmolLM2-135M about 1.4-1.6x faster at 1-16 rows and the greedy screen's [49152, 576] head about
2x faster at one row; prefill sizes (160 rows) gain little. The outputs were bit-identical to ``F.linear``'s on every
shape tried (1-160 rows, each layer shape of the model), including where ``F.linear`` itself rounds a row
differently at another row count; ``tests/engine/test_prepack.py`` checks layers and the real target's decoding.

Float32 (the decoder of a float32 model, and the float32 LM head of any model: the logits of sampled requests and
of greedy ones with a control or logprobs): ``F.linear``'s float32 kernel is not memory-bound at a few rows (it
streams the weight as the transposed operand and costs about twice a one-row product at 2-8 rows), while the packed
kernel reads each weight once per call: on an AVX2 CPU the 120 decoder matmuls of SmolLM2-135M cost about the same
at 1 row and about half at 2-8 rows (docs/serving.md, "CPU dtype"). Float32 outputs are not ``F.linear``'s bit for
bit (another summation order: differences of ~1e-4 on logits of ~20), but a row's values are the same whatever the
number of rows in the call from two rows up, where ``F.linear``'s change with it (``tests/engine/test_prepack.py``). A
one-row call may take another kernel: on an AVX-512 host with AMX, Din = 1536 rounds a lone row differently in the
last bits (seen; 576 does not).

The ops are PyTorch's own (``torch.ops.mkldnn._reorder_linear_weight`` / ``_linear_pointwise``, what inductor's
CPU backend emits for frozen linear layers); they exist on x86 builds with oneDNN, and bfloat16 needs a CPU with
avx512_bf16 or AMX (``prepack_supported``).

Shape symbols: N rows, Din input features, Dout output features.
"""

from __future__ import annotations

import torch
from torch import nn

from app.engine.hardware import cpu_has_bf16_kernels

# Row count oneDNN is told to expect when packing (a hint for its blocking; measured: 1, 16 and 64 pack to
# within noise of each other at every row count from 1 to 64).
PACK_ROWS_HINT = 16


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch build can prepack ``dtype`` linear weights on ``device``: on the CPU with oneDNN, float32,
    and bfloat16 where oneDNN has bfloat16 kernels."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_has_bf16_kernels())


class PrepackedLinear(nn.Module):
    """``nn.Linear`` (no bias or a bias) on a weight prepacked for oneDNN; inference only.

    Args:
        weight: [Dout, Din] bfloat16 or float32 CPU weight; bias: [Dout] or None.
        keep_weight: keep ``weight`` itself as ``.weight`` too, for code that reads the plain weight (the LM head's:
            the greedy screen rescores rows of it); otherwise only the packed copy is held.
    Raises:
        ValueError: a weight this torch build cannot prepack (``prepack_supported``) or not 2-D.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, keep_weight: bool = False) -> None:
        super().__init__()
        if weight.dim() != 2 or not prepack_supported(weight.device, weight.dtype):
            raise ValueError(f"cannot prepack a {tuple(weight.shape)} {weight.dtype} weight on {weight.device}")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
        self.register_buffer("packed_weight", packed, persistent=False)
        self.register_buffer("bias", None if bias is None else bias.detach().clone(), persistent=False)
        self.register_buffer("weight", weight.detach() if keep_weight else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., Din] -> [..., Dout] in ``x``'s dtype (the weight's)."""
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack_linears(module: nn.Module) -> int:
    """Replace, in place, every CPU ``nn.Linear`` under ``module`` whose dtype ``prepack_supported`` accepts (float32
    with oneDNN, bfloat16 where oneDNN has bfloat16 kernels) by a ``PrepackedLinear``; ``module`` itself stays.
    Returns the number replaced (0 when nothing can be packed, or everything is packed already)."""
    targets = [(name, child) for name, child in module.named_modules()
               if name and isinstance(child, nn.Linear) and prepack_supported(child.weight.device, child.weight.dtype)]
    for name, linear in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, attr, PrepackedLinear(linear.weight, linear.bias))
    return len(targets)


def prepack_named(module: nn.Module, names: list[str], *, keep_weight: tuple[str, ...] = ()) -> int:
    """Replace, in place, the ``nn.Linear`` submodules of ``module`` at the dotted ``names`` by ``PrepackedLinear``
    where ``prepack_supported`` accepts their dtype and device (a name that is absent, None or already packed is
    skipped); a name ending in one of ``keep_weight`` keeps its plain ``.weight`` readable (code that slices it).
    Returns the number replaced."""
    packed = 0
    for name in names:
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        linear = getattr(parent, attr, None)
        if type(linear) is nn.Linear and prepack_supported(linear.weight.device, linear.weight.dtype):
            setattr(parent, attr, PrepackedLinear(linear.weight, linear.bias, keep_weight=name.endswith(keep_weight)))
            packed += 1
    return packed
