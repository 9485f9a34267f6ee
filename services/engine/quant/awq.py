"""AWQ 4-bit linears (AutoAWQ GEMM `qweight` / `qzeros` / `scales`, Mixtral and Qwen-MoE releases).

qweight int32 [in, out/8] and qzeros int32 [in/g, out/8] pack 8 outputs per word in AWQ's interleaved order
(field i holds output 8c + AWQ_ORDER[i]); scales [in/g, out]; w[o, i] = scales[i/g, o] * (q[i, o] - zero[i/g, o]).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.quant.bitpack import expect_shape, unpack_int32

FORMAT = "AWQ"
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def dequantize_awq(get: Callable[[str], torch.Tensor], prefix: str, bits: int, group_size: int) -> torch.Tensor:
    if bits != 4:
        raise ValueError(f"AWQ checkpoints with {bits} bits are not supported (4 only): {prefix}.qweight")
    qweight = get(f"{prefix}.qweight")
    inputs, words = qweight.shape
    out = words * 8
    groups = -(-inputs // group_size)
    qzeros, scales = get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
    expect_shape(f"{prefix}.scales", scales, (groups, out), FORMAT)
    expect_shape(f"{prefix}.qzeros", qzeros, (groups, words), FORMAT)
    q = unpack_int32(qweight, 4, AWQ_ORDER)  # [in, out]
    zeros = unpack_int32(qzeros, 4, AWQ_ORDER)  # [groups, out]
    g_idx = torch.arange(inputs) // group_size
    w = scales.float()[g_idx] * (q.float() - zeros.float()[g_idx])
    return w.t().contiguous()
