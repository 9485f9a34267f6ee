"""Attention over a paged KV cache, in plain torch (SDPA), for prefill and decode steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step layout of the batch, built once by the model runner and shared by every layer."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens]: KV-cache slot each new token writes
    # Prefill: each sequence's tokens are contiguous in the batch and attend causally to themselves.
    seq_lens: list[int]
    # Decode: one token per sequence; context gathered from the cache through these slot ids.
    context_slots: torch.Tensor | None = None  # [batch, max_context]
    context_mask: torch.Tensor | None = None  # [batch, 1, 1, max_context] True where attended


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as transformers does."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    k_cache.index_copy_(0, slots, k)
    v_cache.index_copy_(0, slots, v)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for sequences laid end to end; causal within each sequence."""
    outputs = []
    start = 0
    for n in seq_lens:
        qs = q[start : start + n].transpose(0, 1).unsqueeze(0)
        ks = k[start : start + n].transpose(0, 1).unsqueeze(0)
        vs = v[start : start + n].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1))
        start += n
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D], one new token per sequence; keys and values gathered from the paged cache.

    Two batched GEMMs over (sequence, kv head) with each kv head's query group as the rows: on CPU this is
    several times faster than SDPA's kernel for a single query row.
    """
    slots = meta.context_slots  # [B, L]
    batch, length = slots.shape  # type: ignore[union-attr]
    kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // kv_heads
    keys = k_cache[slots].permute(0, 2, 3, 1).reshape(batch * kv_heads, head_dim, length)
    values = v_cache[slots].transpose(1, 2).reshape(batch * kv_heads, length, head_dim)
    bias = torch.zeros(batch, length, dtype=q.dtype, device=q.device)
    bias.masked_fill_(~meta.context_mask.reshape(batch, length), float("-inf"))  # type: ignore[union-attr]
    bias = bias.repeat_interleave(kv_heads, dim=0)[:, None, :].expand(batch * kv_heads, group, length)
    scores = torch.baddbmm(bias, q.reshape(batch * kv_heads, group, head_dim), keys, alpha=scale)
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    return torch.bmm(probs, values).view(batch, kv_heads * group, head_dim)
