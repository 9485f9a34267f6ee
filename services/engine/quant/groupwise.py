"""Round-to-nearest weight quantization: int4 asymmetric per group of inputs, int8 symmetric per output row.

int4: w ~= (q - 8) * scale + zero with q in 0..15, one (scale, zero) per `group_size` consecutive inputs of a
row (zero is in the float domain, the form torch's int4 matmul kernels take). int8: w ~= q * scale with q in
-127..127 and one scale per output row, the form torch's int8 weight-only kernel takes (see
bench/results/quant_kernels.md for why int8 is not grouped).
"""

from __future__ import annotations

import torch


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int32 [N, K] in 0..15, scale [N, K/g], zero [N, K/g]) in float32."""
    n, k = w.shape
    check_groups(k, group_size)
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = (groups - lo[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)  # in place: one float copy
    return q.view(n, k).to(torch.int32), scale, lo + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    groups = q.float().view(n, k // group_size, group_size) - 8
    return (groups * scale.float()[..., None] + zero.float()[..., None]).view(n, k)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K], scale float32 [N])."""
    scale = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-10)
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def check_groups(k: int, group_size: int) -> None:
    if k % group_size:
        raise ValueError(f"input dimension {k} is not a multiple of the quantization group size {group_size}")
