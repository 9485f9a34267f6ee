"""Router rules: hidden states -> (top-k weights, top-k expert ids, per-expert scores), per family.

Every rule matches transformers 5.x. The scores returned third are the family's own per-expert probabilities
(softmax, or DeepSeek-V3's independent sigmoids), before any selection-only bias or group masking: they are what
StepContext.router_probs records for predictors and offload policies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from services.engine.cpu_kernels import formats, moe_calls
from services.engine.models.spec import ModelSpec


class Routing(NamedTuple):
    weights: torch.Tensor  # [tokens, top_k]: each chosen expert's weight in the token's output
    experts: torch.Tensor  # [tokens, top_k]: chosen expert ids
    probs: torch.Tensor  # [tokens, num_experts]: the family's scores, fp32


def route(spec: ModelSpec, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
          native: formats.CpuMatrix | None = None) -> Routing:
    """x: [tokens, hidden]; weight: the router's [num_experts, hidden]; bias: DeepSeek-V3's selection bias;
    native: the same router as the CPU kernels read it, for a softmax rule in one native call (fp32 activations
    on the CPU, the kernels built: cpu_kernels.usable)."""
    if spec.router_rule == "softmax":
        if native is not None:
            return Routing(*moe_calls.route_softmax(x, native, spec.top_k, spec.norm_topk_prob))
        return softmax_topk(F.linear(x, weight), spec.top_k, spec.norm_topk_prob)
    logits = F.linear(x.float(), weight.float())  # DeepSeek routes in fp32 whatever the run dtype
    if spec.router_rule == "deepseek_v2":
        return deepseek_v2_topk(
            logits, spec.top_k, spec.num_expert_groups, spec.topk_groups, spec.routed_scaling_factor
        )
    return deepseek_v3_topk(
        logits,
        bias,
        spec.top_k,
        spec.num_expert_groups,
        spec.topk_groups,
        spec.norm_topk_prob,
        spec.routed_scaling_factor,
    )


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """Softmax over experts in fp32, then top-k, optionally renormalised (Mixtral always; Qwen/OLMoE by config)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return Routing(weights.to(logits.dtype), experts, probs)


def deepseek_v2_topk(
    logits: torch.Tensor, top_k: int, num_groups: int, topk_groups: int, scaling: float
) -> Routing:
    """Softmax scores; grouped ("group_limited_greedy"): groups ranked by their best expert. Never renormalised.

    The weights stay fp32, as in transformers, where they promote each expert's output before the sum.
    """
    probs = logits.softmax(dim=-1, dtype=torch.float32)
    scores = probs
    if num_groups > 1:
        group_scores = probs.view(probs.shape[0], num_groups, -1).amax(dim=-1)
        scores = probs.masked_fill(~_best_groups(group_scores, topk_groups, probs.shape[-1]), 0.0)
    weights, experts = torch.topk(scores, top_k, dim=-1)
    return Routing(weights * scaling, experts, probs)


def deepseek_v3_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
) -> Routing:
    """Sigmoid scores; groups ranked by the sum of their two best experts.

    e_score_correction_bias (auxiliary-loss-free load balancing) shifts which experts are chosen, never their
    weights, which are the unbiased scores.
    """
    scores = logits.sigmoid()
    choice = scores if bias is None else scores + bias
    if num_groups > 1:
        group_scores = choice.view(choice.shape[0], num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
        choice = choice.masked_fill(~_best_groups(group_scores, topk_groups, choice.shape[-1]), float("-inf"))
    experts = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(weights * scaling, experts, scores)


def _best_groups(group_scores: torch.Tensor, topk_groups: int, num_experts: int) -> torch.Tensor:
    """[tokens, groups] -> [tokens, num_experts] mask, True for the experts of each token's best groups."""
    best = torch.topk(group_scores, topk_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return keep.repeat_interleave(num_experts // group_scores.shape[1], dim=1)
