"""Round-to-nearest weight quantization: int4 asymmetric per group of inputs, int8 symmetric per output row.

int4: w ~= (q - 8) * scale + zero with q in 0..15, one (scale, zero) per `group_size` consecutive inputs of a
row (zero is in the float domain, the form torch's int4 matmul kernels take). int8: w ~= q * scale with q in
-127..127 and one scale per output row, the form torch's int8 weight-only kernel takes (see
bench/results/quant_kernels.md for why int8 is not grouped).
"""

from __future__ import annotations

import torch

from services.engine import cpu_kernels

_NATIVE_SOURCES = {torch.float32: 0, torch.bfloat16: 1}  # cpu_kernels/quantize.c's source types


def quantize_int4(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q uint8 [N, K] in 0..15, scale [N, K/g], zero [N, K/g] in float32): the torch ops
    below, or on the CPU the native kernels' one pass over the rows, the same bits (cpu_kernels/quantize.c)."""
    check_groups(w.shape[1], group_size)
    native = _native_grid(w, group_size)
    if native is not None:
        q, scale, zero = native
        assert zero is not None  # int4 grids have zeros
        return q, scale, zero
    return quantize_int4_ops(w, group_size)


def quantize_int4_ops(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_int4 in torch ops: on any device, and the definition the native pass is held to."""
    n, k = w.shape
    check_groups(k, group_size)
    groups = w.float().view(n, k // group_size, group_size)
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = (groups - lo[..., None]).div_(scale[..., None]).round_().clamp_(0, 15)  # in place: one float copy
    return q.view(n, k).to(torch.uint8), scale, lo + 8 * scale


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    groups = q.float().view(n, k // group_size, group_size) - 8
    return (groups * scale.float()[..., None] + zero.float()[..., None]).view(n, k)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K], scale float32 [N]): torch's ops or the native pass, as quantize_int4."""
    native = _native_grid(w, 0)
    return native[:2] if native is not None else quantize_int8_ops(w)


def quantize_int8_ops(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_int8 in torch ops."""
    scale = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-10)
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()[:, None]


def check_groups(k: int, group_size: int) -> None:
    if k % group_size:
        raise ValueError(f"input dimension {k} is not a multiple of the quantization group size {group_size}")


def native_source(w: torch.Tensor) -> int | None:
    """quantize.c's source type for w (fp32 0, bf16 1) where its pass can read it: the kernels built, a CPU
    matrix of rows with unit stride; else None (the torch ops quantize it)."""
    source = _NATIVE_SOURCES.get(w.dtype)
    if (cpu_kernels.library() is None or source is None or w.device.type != "cpu" or w.dim() != 2
            or w.stride(1) != 1 or not w.numel()):
        return None
    return source


def _native_grid(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """(q, scale, zero) from quantize.c (group 0: int8, no zero) where it reads w (native_source); else None."""
    source = native_source(w)
    if source is None:
        return None
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.uint8 if group else torch.int8)
    scale = torch.empty(n, k // group) if group else torch.empty(n)
    zero = torch.empty(n, k // group) if group else None
    if cpu_kernels.loaded().hs_quantize_grid(w.data_ptr(), source, w.stride(0), n, k, group, q.data_ptr(),
                                             scale.data_ptr(), None if zero is None else zero.data_ptr()):
        return None
    return q, scale, zero
