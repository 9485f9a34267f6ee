"""GPTQ 4-bit linears (AutoGPTQ / GPTQModel `qweight` / `qzeros` / `scales` / `g_idx`, Mixtral and Qwen-MoE releases).

qweight int32 [in/8, out] packs 8 inputs per word (field i = input 8r+i); qzeros int32 [in/g, out/8] packs 8
outputs per word; scales [in/g, out]; g_idx [in] the group of each input (act-order permutes it).
w[o, i] = scales[g_idx[i], o] * (q[i, o] - zero[g_idx[i], o]), where the stored zero is one less than the
real one in the original (v1) format, the one Hugging Face releases use.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from services.engine.quant.bitpack import expect_shape, unpack_int32

FORMAT = "GPTQ"


def dequantize_gptq(get: Callable[[str], torch.Tensor], has: Callable[[str], bool], prefix: str, bits: int,
                    group_size: int, zero_offset: int = 1) -> torch.Tensor:
    """The float [out, in] weight of linear `prefix` (its tensors read with `get`)."""
    qweight = get(f"{prefix}.qweight")
    words, out = qweight.shape
    inputs = words * 32 // bits
    g = group_size if group_size > 0 else inputs
    groups = -(-inputs // g)
    qzeros, scales = get(f"{prefix}.qzeros"), get(f"{prefix}.scales")
    expect_shape(f"{prefix}.scales", scales, (groups, out), FORMAT)
    expect_shape(f"{prefix}.qzeros", qzeros, (groups, out * bits // 32), FORMAT)
    q = unpack_int32(qweight.t(), bits).t()  # [in, out]
    zeros = unpack_int32(qzeros, bits) + zero_offset  # [groups, out]
    if has(f"{prefix}.g_idx"):
        g_idx = get(f"{prefix}.g_idx").long()
        expect_shape(f"{prefix}.g_idx", g_idx, (inputs,), FORMAT)
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
            raise ValueError(f"malformed {FORMAT} checkpoint: {prefix}.g_idx names groups outside 0..{groups - 1}")
    else:
        g_idx = torch.arange(inputs) // g
    w = scales.float()[g_idx] * (q.float() - zeros.float()[g_idx])
    return w.t().contiguous()
