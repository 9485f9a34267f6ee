"""Attention over a paged KV cache, in plain torch (SDPA), for prefill and decode steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.cpu_threads import intra_op_threads

# Prefill attention of this many tokens or more runs on the pool's threads: torch keeps one thread beside the
# native pool, and a long prompt's attention is a tenth of its prefill time on one thread.
SHARED_ATTENTION_TOKENS = 64


@dataclass
class AttentionMetadata:
    """Per-step layout of the batch, built once by the model runner and shared by every layer."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [num_tokens]: KV-cache slot each new token writes
    # Prefill: each sequence's tokens are contiguous in the batch and attend causally to themselves.
    seq_lens: list[int]
    # Decode: one token per sequence; context gathered from the cache by whole blocks (padded to a block).
    block_tables: torch.Tensor | None = None  # [batch, max_blocks]
    block_size: int = 0
    # [batch, max_blocks * block_size]: the block tables slot by slot (MLA); made on first use (gathered_slots)
    context_slots: torch.Tensor | None = None
    # [batch, 1, 1, max_blocks * block_size] True where attended; made on first use (attended_mask)
    context_mask: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None  # [batch] int64: tokens each sequence attends (the new one included)
    # decode_attention's additive mask, [kv_heads * batch, 1, context]: made by the first layer, shared by all.
    decode_bias: torch.Tensor | None = None
    # Chunked prefill (a chunk after cached tokens): each sequence's context length (cached and new tokens), and
    # the cache slots of those contexts laid end to end; attention reads their keys and values from the cache.
    prefill_kv_lens: list[int] | None = None
    prefill_kv_slots: torch.Tensor | None = None
    # A mixed step's first rows, running sequences' next tokens (one each after its cached context): their
    # decode layout, so they read the paged cache in place; the prefill_kv fields describe the rows after them.
    decode_rows: AttentionMetadata | None = None

    def num_decode_rows(self) -> int:
        return 0 if self.decode_rows is None else len(self.decode_rows.seq_lens)

    def chunk_seq_lens(self) -> list[int]:
        """seq_lens of the rows after the decode rows: the prompts' chunks, which prefill attention takes."""
        n = self.num_decode_rows()
        return self.seq_lens[n:] if n else self.seq_lens

    # The native kernels read block tables and context lengths only: the two views below are made when a path
    # that gathers the context asks (MLA, torch's decode attention), not in every step's prologue, where their
    # five tensor ops ran cold after the forward pass (~60 us a step on the demo model).
    def gathered_slots(self) -> torch.Tensor:
        if self.context_slots is None:
            assert self.block_tables is not None  # decode metadata always has them
            batch = self.block_tables.shape[0]
            offsets = torch.arange(self.block_size, device=self.block_tables.device)
            self.context_slots = (self.block_tables[:, :, None] * self.block_size + offsets).view(batch, -1)
        return self.context_slots

    def attended_mask(self) -> torch.Tensor:
        if self.context_mask is None:
            assert self.block_tables is not None and self.context_lens is not None  # decode metadata has both
            width = self.block_tables.shape[1] * self.block_size
            offsets = torch.arange(width, device=self.block_tables.device)
            self.context_mask = (offsets[None, :] < self.context_lens[:, None])[:, None, None, :]
        return self.context_mask


def decode_metadata(
    positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor, block_size: int,
    context_lens: torch.Tensor | None = None,
) -> AttentionMetadata:
    """A decode step's layout from device tensors alone (no host reads, so a CUDA graph can capture it):
    positions [B] of the new tokens, their KV slots [B], block tables [B, max_blocks] padded with any block;
    context_lens (positions + 1) when the caller has them already."""
    return AttentionMetadata(
        is_prefill=False,
        slot_mapping=slots,
        seq_lens=[1] * block_tables.shape[0],
        block_tables=block_tables,
        block_size=block_size,
        context_lens=positions + 1 if context_lens is None else context_lens,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, as transformers does."""
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == dtype:  # one fused kernel for the six ops below (same values)
        return F.rms_norm(x, weight.shape, weight, eps)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, native: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding a sublayer's output (delta; None: none yet) and its norm for the next
    sublayer; native: one fused pass through the CPU kernel."""
    if native:
        return cpu_kernels.rms_norm(h, weight, eps, delta)
    if delta is not None:
        h = h + delta
    return h, rms_norm(h, weight, eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, head_dim]; cos/sin: [tokens, head_dim] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    """Caches are head-major, [kv_heads, slots, head_dim]: a decode step gathers [kv_heads, batch, context,
    head_dim] with one copy, already in the layout its batched GEMMs read (slot-major needed a permute too)."""
    k_cache.index_copy_(1, slots, k.transpose(0, 1))
    v_cache.index_copy_(1, slots, v.transpose(0, 1))


def cached_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [len(slots), Hkv, D] of those cache slots, in their order."""
    return k_cache.index_select(1, slots).transpose(0, 1), v_cache.index_select(1, slots).transpose(0, 1)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float,
    kv_lens: list[int] | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for sequences laid end to end; causal within each sequence.
    kv_lens (chunked prefill): each sequence's keys, its queries being the last seq_lens of them."""
    threads = cpu_kernels.pool_threads() if q.is_cpu and q.shape[0] >= SHARED_ATTENTION_TOKENS else None
    with intra_op_threads(threads):
        if kv_lens is not None and kv_lens != seq_lens:
            return _chunk_attention(q, k, v, seq_lens, kv_lens, scale)
        return _causal_attention(q, k, v, seq_lens, scale)


def _chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int], kv_lens: list[int], scale: float
) -> torch.Tensor:
    """Query i of a sequence with n queries and m keys sits at position m - n + i and sees keys up to it."""
    outputs = []
    q_start = kv_start = 0
    for n, m in zip(q_lens, kv_lens):
        qs = q[q_start : q_start + n].transpose(0, 1).unsqueeze(0)
        ks = k[kv_start : kv_start + m].transpose(0, 1).unsqueeze(0)
        vs = v[kv_start : kv_start + m].transpose(0, 1).unsqueeze(0)
        mask = None if n == m else torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=mask is None, scale=scale,
                                             enable_gqa=True)
        outputs.append(out[0].transpose(0, 1))
        q_start, kv_start = q_start + n, kv_start + m
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    n = seq_lens[0]
    if len(seq_lens) > 1 and all(length == n for length in seq_lens):  # one batched call (~10% faster)
        b = len(seq_lens)
        qs, ks, vs = (t.view(b, n, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], v.shape[2])  # MLA: v's head size is not q's
    return _chunk_attention(q, k, v, seq_lens, seq_lens, scale)  # sequence by sequence, each plainly causal


def last_token_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], scale: float
) -> torch.Tensor:
    """q: [B, Hq, D], each sequence's last token; k/v: [T, Hkv, D] for the B sequences laid end to end. The last
    token sees its whole sequence, so no mask: prefill_attention's rows for those tokens."""
    n = seq_lens[0]
    if all(length == n for length in seq_lens):
        b = len(seq_lens)
        ks, vs = (t.view(b, n, t.shape[1], t.shape[2]).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q[:, :, None], ks, vs, scale=scale, enable_gqa=True)
        return out[:, :, 0]
    outputs = []
    start = 0
    for row, n in enumerate(seq_lens):
        ks, vs = (t[start : start + n].transpose(0, 1)[None] for t in (k, v))
        out = F.scaled_dot_product_attention(q[row, :, None][None], ks, vs, scale=scale, enable_gqa=True)
        outputs.append(out[0, :, 0])
        start += n
    return torch.stack(outputs)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [B, Hq, D], one new token per sequence; keys and values gathered from the paged cache by block.

    With the native CPU kernel (one torch thread, fp32): each cached key and value read once, in place.
    Otherwise two batched GEMMs over (kv head, sequence) with each kv head's query group as the rows, on a
    gathered copy of the context: on CPU several times faster than SDPA's kernel for a single query row.
    """
    kv_heads, _, head_dim = k_cache.shape
    block_tables = meta.block_tables
    assert block_tables is not None  # decode metadata (decode_metadata) always has them
    if (meta.context_lens is not None and cpu_kernels.widths_supported(head_dim)
            and cpu_kernels.usable(q)):
        return cpu_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, meta.context_lens,
                                                  meta.block_size, scale)
    tables = block_tables.flatten()
    batch = q.shape[0]
    group = q.shape[1] // kv_heads
    width = meta.block_size * head_dim
    keys = k_cache.view(kv_heads, -1, width).index_select(1, tables).view(kv_heads * batch, -1, head_dim)
    values = v_cache.view(kv_heads, -1, width).index_select(1, tables).view(kv_heads * batch, -1, head_dim)
    if meta.decode_bias is None:
        length = keys.shape[1]
        bias = torch.zeros(batch, length, dtype=q.dtype, device=q.device)
        bias.masked_fill_(~meta.attended_mask().view(batch, length), float("-inf"))
        meta.decode_bias = bias.repeat(kv_heads, 1)[:, None, :]
    queries = q.view(batch, kv_heads, group, head_dim).transpose(0, 1).reshape(kv_heads * batch, group, head_dim)
    scores = torch.baddbmm(meta.decode_bias, queries, keys.transpose(1, 2), alpha=scale)
    probs = scores.float().softmax(dim=-1).to(q.dtype)
    out = torch.bmm(probs, values).view(kv_heads, batch, group, head_dim).transpose(0, 1)
    return out.reshape(batch, kv_heads * group, head_dim)
