"""The attention kernels against plain SDPA: batched equal-length prefill, decode over the head-major paged cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.models import attention
from services.engine.models.attention import AttentionMetadata, decode_attention, prefill_attention, write_kv

HQ, HKV, D, BS = 8, 4, 16, 4


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         is_causal=causal, scale=0.3, enable_gqa=True)
    return out[0].transpose(0, 1)


def test_equal_length_prefill_is_one_batched_call_with_the_same_result() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3 * 9, h, D, generator=g) for h in (HQ, HKV, HKV))
    want = torch.cat([_sdpa(q[i * 9 : (i + 1) * 9], k[i * 9 : (i + 1) * 9], v[i * 9 : (i + 1) * 9], True)
                      for i in range(3)])
    torch.testing.assert_close(prefill_attention(q, k, v, [9, 9, 9], 0.3), want)
    torch.testing.assert_close(prefill_attention(q, k, v, [9, 5, 13], 0.3)[:9], want[:9])


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: native kernels not built")
def test_a_long_prefill_attends_on_the_pools_threads(monkeypatch) -> None:
    """torch runs one thread beside the native pool; a long prompt's attention borrows the pool's threads."""
    seen: list[int] = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return sdpa(*args, **kwargs)

    before, torch_before = cpu_kernels.library().hs_threads(), torch.get_num_threads()
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    cpu_kernels.set_threads(2)
    torch.set_num_threads(1)
    try:
        n = attention.SHARED_ATTENTION_TOKENS
        for length in (n - 1, n):
            q, k, v = (torch.randn(length, h, D) for h in (HQ, HKV, HKV))
            prefill_attention(q, k, v, [length], 0.3)
        assert seen == [1, 2] and torch.get_num_threads() == 1
    finally:
        cpu_kernels.set_threads(before)
        torch.set_num_threads(torch_before)


def test_decode_reads_the_head_major_paged_cache() -> None:
    g = torch.Generator().manual_seed(1)
    k_cache, v_cache = torch.zeros(HKV, 16 * BS, D), torch.zeros(HKV, 16 * BS, D)
    lengths, tables = [6, 11], [[3, 7], [0, 9, 2]]  # blocks scattered over the cache
    contexts = []
    for length, table in zip(lengths, tables):
        k, v = torch.randn(length, HKV, D, generator=g), torch.randn(length, HKV, D, generator=g)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(length)])
        write_kv(k_cache, v_cache, k, v, slots)
        contexts.append((k, v))
    q = torch.randn(2, HQ, D, generator=g)
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    positions = torch.arange(width * BS)
    mask = (positions[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    meta = AttentionMetadata(False, torch.zeros(2, dtype=torch.long), [1, 1], block_tables, BS, context_mask=mask)
    got = decode_attention(q, k_cache, v_cache, meta, 0.3)
    want = torch.cat([_sdpa(q[i : i + 1], k, v, False) for i, (k, v) in enumerate(contexts)])
    torch.testing.assert_close(got, want)


def test_equal_length_prefill_keeps_the_value_head_size() -> None:
    """MLA's values are narrower than its queries and keys: the batched call returns v's head size."""
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(10, 4, 24, generator=g), torch.randn(10, 4, 24, generator=g)
    v = torch.randn(10, 4, 12, generator=g)
    out = prefill_attention(q, k, v, [5, 5], 0.3)
    want = torch.cat([prefill_attention(q[s : s + 5], k[s : s + 5], v[s : s + 5], [5], 0.3) for s in (0, 5)])
    assert out.shape == (10, 4, 12)
    torch.testing.assert_close(out, want)
