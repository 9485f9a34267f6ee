"""compressed-tensors `pack-quantized` linears (llm-compressor's int4 / int8 weight-only exports).

weight_packed int32 [out, in*b/32] packs consecutive inputs (field i = input 32/b*c + i) as unsigned
q + 2^(b-1); weight_scale [out, in/g] (one column for per-channel); optional weight_zero_point (asymmetric);
weight_shape [2] the dense shape. w = (q - zero) * scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.quant.bitpack import expect_shape, unpack_int32

FORMAT = "compressed-tensors"


def dequantize_compressed(get: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefix: str,
                          bits: int, group_size: int) -> torch.Tensor:
    """`group_size` 0: one scale per output channel."""
    packed = get(f"{prefix}.weight_packed")
    out, words = packed.shape
    inputs = words * 32 // bits
    if has(f"{prefix}.weight_shape"):
        shape = tuple(int(v) for v in get(f"{prefix}.weight_shape").tolist())
        if len(shape) != 2 or shape[0] != out or not 0 < shape[1] <= inputs:
            raise ValueError(f"malformed {FORMAT} checkpoint: {prefix}.weight_shape {shape} does not fit "
                             f"{prefix}.weight_packed {tuple(packed.shape)}")
        inputs = shape[1]
    q = unpack_int32(packed, bits)[:, :inputs].float() - (1 << (bits - 1))
    group = group_size or inputs
    scale = get(f"{prefix}.weight_scale").float()
    expect_shape(f"{prefix}.weight_scale", scale, (out, -(-inputs // group)), FORMAT)
    zero = get(f"{prefix}.weight_zero_point").float() if has(f"{prefix}.weight_zero_point") else None
    if zero is not None:
        expect_shape(f"{prefix}.weight_zero_point", zero, tuple(scale.shape), FORMAT)
    g_idx = torch.arange(inputs) // group
    if zero is not None:
        q = q - zero[:, g_idx]
    return q * scale[:, g_idx]
