"""FP8 block-quantized linears (DeepSeek-V3 / Qwen3 FP8 releases): `weight` float8_e4m3fn [out, in] and
`weight_scale_inv` fp32 [ceil(out/B), ceil(in/B)], one scale per B x B block (B = 128); w = weight * scale."""

from __future__ import annotations

from collections.abc import Callable

import torch

FORMAT = "FP8"


def dequantize_fp8(get: Callable[[str], torch.Tensor], prefix: str, block: tuple[int, int]) -> torch.Tensor:
    weight = get(f"{prefix}.weight")
    scale = get(f"{prefix}.weight_scale_inv").float()
    out, inputs = weight.shape
    expected = (-(-out // block[0]), -(-inputs // block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"malformed {FORMAT} checkpoint: {prefix}.weight_scale_inv has shape "
                         f"{tuple(scale.shape)}, expected {expected} for {block[0]}x{block[1]} blocks")
    full = scale.repeat_interleave(block[0], dim=0)[:out].repeat_interleave(block[1], dim=1)[:, :inputs]
    return weight.float() * full
