"""x @ W.T for a PackedMatrix: the native kernels on the CPU (cpu_kernels/formats.py), torch's weight-only
kernels on CUDA (chosen in bench/results/quant_kernels.md; they take bf16 activations).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.cpu_kernels import formats
from services.engine.quant.packed import PackedMatrix


def packed_linear(x: torch.Tensor, m: PackedMatrix) -> torch.Tensor:
    if m.on_cpu:
        return formats.matmul(x, m.cpu_matrix()).to(x.dtype)
    assert m.scales is not None  # CUDA layouts keep their scales apart
    xs = x.to(m.scales.dtype)
    if m.bits == 8:
        y = torch.ops.aten._weight_int8pack_mm(xs, m.qweight, m.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm(xs, m.qweight, m.group_size, m.scales)
    return y.to(x.dtype)


def packed_swiglu(x: torch.Tensor, gate_up: PackedMatrix, down: PackedMatrix) -> torch.Tensor:
    gate, up = packed_linear(x, gate_up).chunk(2, dim=-1)
    return packed_linear(F.silu(gate) * up, down)
