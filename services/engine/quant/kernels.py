"""x @ W.T for a PackedMatrix with torch's weight-only kernels (chosen in bench/results/quant_kernels.md).

The kernels run with bf16 activations: their fp32-activation CPU paths are 10-100x slower (unvectorised).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.quant.packed import PackedMatrix


def packed_linear(x: torch.Tensor, m: PackedMatrix) -> torch.Tensor:
    xs = x.to(m.scales.dtype)
    if m.bits == 8:
        y = torch.ops.aten._weight_int8pack_mm(xs, m.qweight, m.scales)
    elif x.is_cuda:
        y = torch.ops.aten._weight_int4pack_mm(xs, m.qweight, m.group_size, m.scales)
    else:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xs, m.qweight, m.group_size, m.scales)
    return y.to(x.dtype)


def packed_swiglu(x: torch.Tensor, gate_up: PackedMatrix, down: PackedMatrix) -> torch.Tensor:
    gate, up = packed_linear(x, gate_up).chunk(2, dim=-1)
    return packed_linear(F.silu(gate) * up, down)
