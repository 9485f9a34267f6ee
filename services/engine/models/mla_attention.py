"""Multi-head Latent Attention (DeepSeek-V2/V3) over a paged cache of the compressed latent.

Every head's key and value are linear in one per-token latent (kv_lora_rank wide, RMS-normalised), plus one
rotary key part (qk_rope_head_dim wide) shared by all heads. The cache holds just those two, side by side:
kv_lora_rank + qk_rope_head_dim numbers per token and layer instead of heads * (qk_head_dim + v_head_dim).

Prefill expands the new tokens' latents into per-head keys and values, as transformers does. Decode instead
folds kv_b_proj into the query and the output ("weight absorption", DeepSeek-V2 paper, section 2.1.2): the
query moves into latent space, attends to the cached latents as one shared KV head, and the result is
projected to each head's value afterwards; nothing per head is ever materialised for the context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.engine.models.attention import AttentionMetadata, apply_rope, prefill_attention, rms_norm
from services.engine.models.spec import MlaDims, ModelSpec
from services.engine.models.weights import MlaWeights

# q_a_layernorm and kv_a_layernorm are built without the config's rms_norm_eps in transformers.
LATENT_NORM_EPS = 1e-6


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's rope: rotates adjacent pairs (x0, x1), (x2, x3), ... by one frequency each.

    x: [tokens, heads, rope_dim]; cos/sin: [tokens, rope_dim] tables laid out as cat(freqs, freqs). The result
    lists every pair's first components, then their second ones (transformers' V3 layout; its V2 keeps pairs
    in place). Queries and keys are permuted alike, so every query-key product is the same either way.
    """
    half = x.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def mla_attention(
    x: torch.Tensor,
    w: MlaWeights,
    latent_cache: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    meta: AttentionMetadata,
    spec: ModelSpec,
) -> torch.Tensor:
    """x: [tokens, hidden] -> [tokens, hidden]; writes the tokens' latents into latent_cache [slots, width]."""
    mla = spec.mla
    assert mla is not None  # an MLA layer's model has MLA dims
    tokens = x.shape[0]
    rope = apply_rope_interleaved if mla.rope_interleave else apply_rope

    if w.q is not None:
        q = F.linear(x, w.q)
    else:
        assert w.q_a is not None and w.q_a_norm is not None and w.q_b is not None  # q_lora_rank set: the low-rank q
        q = F.linear(rms_norm(F.linear(x, w.q_a, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS), w.q_b)
    q_nope, q_rope = q.view(tokens, spec.num_heads, mla.qk_head_dim).split(
        [mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1
    )
    latent, k_rope = F.linear(x, w.kv_a, w.kv_a_bias).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
    latent = rms_norm(latent, w.kv_a_norm, LATENT_NORM_EPS)
    q_rope = rope(q_rope, cos, sin)
    k_rope = rope(k_rope.unsqueeze(1), cos, sin)  # one rotary key shared by every head
    latent_cache.index_copy_(0, meta.slot_mapping, torch.cat((latent, k_rope[:, 0]), dim=-1))

    if meta.is_prefill:
        n = meta.num_decode_rows()
        out = _prefill(q_nope[n:], q_rope[n:], latent[n:], k_rope[n:], latent_cache, w, mla, meta, spec.softmax_scale)
        if n:  # a mixed step's running sequences: the decode path on their cached latents
            assert meta.decode_rows is not None
            decoded = _decode(q_nope[:n], q_rope[:n], latent_cache, w, mla, meta.decode_rows, spec.softmax_scale)
            out = torch.cat((decoded, out))
    else:
        out = _decode(q_nope, q_rope, latent_cache, w, mla, meta, spec.softmax_scale)
    return F.linear(out.reshape(tokens, -1), w.o, w.o_bias)


def _prefill(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    w: MlaWeights,
    mla: MlaDims,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Per-head keys [T, H, qk_head_dim] and values [T, H, v_head_dim] from the latents; causal attention. A
    chunk after cached tokens (chunked prefill) expands its whole context's latents, read from the cache. The
    rows after a mixed step's decode rows (which _decode takes)."""
    heads = q_nope.shape[1]
    if meta.prefill_kv_slots is not None:
        context = latent_cache.index_select(0, meta.prefill_kv_slots)
        latent, k_rope = context.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k_rope = k_rope.unsqueeze(1)
    kv = F.linear(latent, w.kv_b).view(latent.shape[0], heads, mla.qk_nope_head_dim + mla.v_head_dim)
    k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_rope.expand(-1, heads, -1)), dim=-1)
    q = torch.cat((q_nope, q_rope), dim=-1)
    return prefill_attention(q, k, v, meta.chunk_seq_lens(), scale, meta.prefill_kv_lens)


def _decode(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent_cache: torch.Tensor,
    w: MlaWeights,
    mla: MlaDims,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One token per sequence against its cached latents: q_nope . (W_uk c) = (W_uk^T q_nope) . c."""
    heads = q_nope.shape[1]
    kv_b = w.kv_b.view(heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
    w_uk, w_uv = kv_b[:, : mla.qk_nope_head_dim], kv_b[:, mla.qk_nope_head_dim :]
    q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
    query = torch.cat((q_latent, q_rope), dim=-1).unsqueeze(2)  # [B, H, 1, kv_lora_rank + rope]
    context = latent_cache[meta.gathered_slots()].unsqueeze(1)  # [B, 1, L, kv_lora_rank + rope]: one KV head
    values = context[..., : mla.kv_lora_rank]
    out_latent = F.scaled_dot_product_attention(
        query, context, values, attn_mask=meta.attended_mask(), scale=scale, enable_gqa=True
    ).squeeze(2)  # [B, H, kv_lora_rank]
    return torch.einsum("bhr,hvr->bhv", out_latent, w_uv)
