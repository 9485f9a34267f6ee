"""Router rules: router logits -> (top-k weights, top-k expert ids, full probabilities), per family."""

from __future__ import annotations

import torch


def softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Softmax over experts in fp32, then top-k, optionally renormalised (Mixtral always; Qwen/OLMoE by config)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), experts, probs
