"""The native CPU kernels against torch: paged decode attention, the routed experts, the build's fallbacks, and
the engine taking them on one thread with the same greedy text."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.config import EngineConfig
from services.engine.cpu_kernels import moe_calls
from services.engine.cpu_kernels.decode_layer import NativeDecodeLayer
from services.engine.cpu_threads import intra_op_threads
from services.engine.llm_engine import LLMEngine
from services.engine.models import attention, native_moe
from services.engine.models.attention import AttentionMetadata, decode_attention, write_kv
from services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: the kernels are off here")


def _paged_context(lengths: list[int], kv_heads: int, head_dim: int, block_size: int, seed: int):
    """Caches with each sequence's context in scattered blocks, and the contexts themselves."""
    g = torch.Generator().manual_seed(seed)
    blocks = sum(-(-n // block_size) for n in lengths) + 3
    k_cache, v_cache = torch.zeros(kv_heads, blocks * block_size, head_dim), torch.zeros(kv_heads, blocks * block_size,
                                                                                          head_dim)
    order = torch.randperm(blocks, generator=g).tolist()
    tables, contexts = [], []
    for n in lengths:
        table = [order.pop() for _ in range(-(-n // block_size))]
        k, v = torch.randn(n, kv_heads, head_dim, generator=g), torch.randn(n, kv_heads, head_dim, generator=g)
        write_kv(k_cache, v_cache, k, v, torch.tensor([table[p // block_size] * block_size + p % block_size
                                                       for p in range(n)]))
        tables.append(table)
        contexts.append((k, v))
    width = max(len(t) for t in tables)
    return k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in tables]), contexts


@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(8, 4, 32), (4, 4, 64), (16, 2, 128), (6, 3, 48)])
def test_paged_decode_attention_matches_sdpa(q_heads: int, kv_heads: int, head_dim: int) -> None:
    lengths = [1, 15, 16, 17, 47, 100]  # a partial group of 16 keys, exact groups, blocks crossed mid-group
    k_cache, v_cache, tables, contexts = _paged_context(lengths, kv_heads, head_dim, block_size=8, seed=head_dim)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(len(lengths), q_heads + 2 * kv_heads, head_dim, generator=g)
    q = qkv[:, :q_heads]  # a view with the projection's row stride, as the model passes it
    got = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lengths), 8, 0.2)
    for i, (k, v) in enumerate(contexts):
        want = F.scaled_dot_product_attention(q[i : i + 1].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                              v.transpose(0, 1)[None], scale=0.2, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(got[i : i + 1], want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("threads", [2, 3])
def test_paged_decode_attention_on_the_pool_is_one_threads_result(threads: int) -> None:
    """Each (sequence, KV head) is a pool item with its own scores, so any thread count gives one thread's
    result bit for bit, longer contexts included (an item's scratch grows on whichever thread runs it)."""
    lengths = [3, 200, 17, 64, 900]
    k_cache, v_cache, tables, _ = _paged_context(lengths, 4, 64, block_size=16, seed=5)
    q = torch.randn(len(lengths), 16, 64, generator=torch.Generator().manual_seed(1))
    before = cpu_kernels.pool_threads()
    try:
        cpu_kernels.set_threads(1)
        one = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lengths), 16, 0.125)
        assert cpu_kernels.set_threads(threads) == threads
        many = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor(lengths), 16, 0.125)
    finally:
        cpu_kernels.set_threads(before or 1)
    assert torch.equal(one, many)


def test_paged_decode_attention_refuses_a_context_outside_the_cache() -> None:
    k_cache, v_cache, tables, _ = _paged_context([20], 2, 16, block_size=8, seed=0)
    q = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="outside the KV cache"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([25]), 8, 1.0)
    with pytest.raises(ValueError, match="outside the KV cache"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, tables + 100, torch.tensor([20]), 8, 1.0)


def test_decode_attention_takes_the_kernel_on_one_thread_with_the_gathered_result(monkeypatch) -> None:
    lengths = [5, 40]
    k_cache, v_cache, tables, _ = _paged_context(lengths, 4, 32, block_size=8, seed=3)
    mask = (torch.arange(tables.shape[1] * 8)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    q = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1))

    def meta() -> AttentionMetadata:
        return AttentionMetadata(False, torch.zeros(2, dtype=torch.long), [1, 1], tables, 8, context_mask=mask,
                                 context_lens=torch.tensor(lengths))

    calls = []
    kernel = cpu_kernels.paged_decode_attention
    monkeypatch.setattr(cpu_kernels, "paged_decode_attention", lambda *a: calls.append(1) or kernel(*a))
    with intra_op_threads(2):
        gathered = decode_attention(q, k_cache, v_cache, meta(), 0.3)
    assert not calls  # more than one torch thread: torch's path
    with intra_op_threads(1):
        native = decode_attention(q, k_cache, v_cache, meta(), 0.3)
    assert calls == [1]
    torch.testing.assert_close(native, gathered, atol=2e-6, rtol=1e-5)


def _moe_reference(x, experts, weights, w13, w2):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].tolist()):
            gate, up = (x[t] @ w13[e]).chunk(2)
            out[t] += w * ((F.silu(gate) * up) @ w2[e])
    return out


@pytest.mark.parametrize(("tokens", "top_k", "hidden", "intermediate"),
                         [(1, 2, 64, 32), (3, 1, 32, 48), (9, 2, 64, 64), (40, 4, 48, 80)])
def test_moe_swiglu_matches_the_per_token_sum(tokens: int, top_k: int, hidden: int, intermediate: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    num_experts = 6
    w13 = torch.randn(num_experts, hidden, 2 * intermediate, generator=g) * 0.1
    w2 = torch.randn(num_experts, intermediate, hidden, generator=g) * 0.1
    x = torch.randn(tokens, hidden, generator=g)
    # 9 tokens on one expert crosses the kernel's 8-row passes; 40 x 4 spreads over all six
    experts = torch.zeros(tokens, top_k, dtype=torch.long) if tokens == 9 else \
        torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)])
    if tokens == 9:
        experts[:, 1] = 5
    weights = torch.rand(tokens, top_k, generator=g)
    got = cpu_kernels.moe_swiglu(x, experts, weights, w13, w2)
    torch.testing.assert_close(got, _moe_reference(x, experts, weights, w13, w2), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="expert id out of range"):
        cpu_kernels.moe_swiglu(x, experts + num_experts, weights, w13, w2)


def test_build_falls_back_to_torch_without_a_compiler_or_when_disabled(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HINTSERVE_KERNEL_CACHE", str(tmp_path))
    try:
        cpu_kernels.forget_library()
        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        assert cpu_kernels.library() is None
        cpu_kernels.forget_library()
        monkeypatch.setenv("CC", "false")  # a compiler that fails: warned, then torch's path
        assert cpu_kernels.library() is None
        monkeypatch.delenv("CC")
        cpu_kernels.forget_library()
        monkeypatch.setenv("HINTSERVE_CPU_KERNELS", "0")
        assert cpu_kernels.library() is None and not cpu_kernels.usable(torch.zeros(1))
        monkeypatch.delenv("HINTSERVE_CPU_KERNELS")
        cpu_kernels.forget_library()
        assert cpu_kernels.library() is not None
        assert len(list(tmp_path.glob("hintserve_kernels_*.so"))) == 1  # built once into the cache, no temp left
        cpu_kernels.forget_library()
        assert cpu_kernels.library() is not None and len(list(tmp_path.iterdir())) == 1  # reused
    finally:
        cpu_kernels.forget_library()


def test_one_thread_engine_takes_both_kernels_with_the_same_greedy_text(monkeypatch) -> None:
    prompts = [[5, 17, 300, 42, 7, 99, 1200, 3], [900, 12, 64], list(range(100, 150))]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    calls = {"attention": 0, "moe": 0}
    attention_kernel, moe_kernel = cpu_kernels.paged_decode_attention, moe_calls.moe

    def count(name, kernel):
        def counted(*args):
            calls[name] += 1
            return kernel(*args)
        return counted

    monkeypatch.setattr(attention.cpu_kernels, "paged_decode_attention", count("attention", attention_kernel))
    monkeypatch.setattr(native_moe.moe_calls, "moe", count("moe", moe_kernel))
    # A decode step's layers run whole (decode_layer.py), their attention kernel inside: counted as attention.
    layer_call = NativeDecodeLayer.__call__
    monkeypatch.setattr(NativeDecodeLayer, "__call__", lambda self, *args: count("attention", layer_call)(self, *args))
    _same_text_with_and_without_kernels(monkeypatch, EngineConfig(), prompts, params, calls)


def _same_text_with_and_without_kernels(monkeypatch, config: EngineConfig, prompts, params, calls: dict) -> None:
    """One engine on one thread: every counted kernel runs, then with the kernels unusable none does, and the
    greedy tokens are the same."""
    with intra_op_threads(1):
        engine = LLMEngine(config, detokenize=False)
        try:
            native = engine.generate(prompts, params)
            assert all(calls.values()), calls
            monkeypatch.setattr(cpu_kernels, "usable", lambda x, pool_is_host=False: False)
            calls.update(dict.fromkeys(calls, 0))
            plain = engine.generate(prompts, params)
            assert not any(calls.values()), calls
        finally:
            engine.close()
    assert native == plain


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 17])
def test_expert_rows_matches_torch_in_every_mode(rows: int) -> None:
    """One expert in torch's layout (the offload store's), with and without its gather, halves and scatter."""
    g = torch.Generator().manual_seed(rows)
    hidden, intermediate, tokens = 32, 48, 20
    x = torch.randn(tokens, hidden, generator=g)
    gate_up, down = torch.randn(2 * intermediate, hidden, generator=g), torch.randn(hidden, intermediate, generator=g)
    index = torch.randint(0, tokens, (rows + 3,), generator=g)  # 3 assignments before this expert's
    route = torch.rand(rows + 3, generator=g)
    own, weights = index[3:], route[3:, None]
    h = F.silu(x[own] @ gate_up[:intermediate].T) * (x[own] @ gate_up[intermediate:].T)
    y = h @ down.T

    out = torch.randn(tokens, hidden, generator=g)
    expected = out.clone().index_add_(0, own, y * weights)
    cpu_kernels.expert_rows(x, gate_up, down, out, rows, 3, index, index, route)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)

    whole, activation = torch.empty(rows, hidden), torch.empty(rows, intermediate)
    cpu_kernels.expert_rows(x[own], gate_up, down, whole, rows)
    cpu_kernels.expert_rows(x[own], gate_up, None, activation, rows)
    torch.testing.assert_close(whole, y, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(activation, h, rtol=1e-5, atol=1e-4)

    out = torch.zeros(tokens, hidden)
    cpu_kernels.expert_rows(h, None, down, out, rows, 3, None, index, route)  # a split expert's down half
    cpu_kernels.expert_rows(y, None, None, out, rows, 3, None, index, route)  # a host expert's output
    torch.testing.assert_close(out, torch.zeros(tokens, hidden).index_add_(0, own, 2 * y * weights),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("policy", ["lru", "cpu-experts", "hintserve"])
def test_one_thread_offloaded_engine_takes_the_expert_kernel_with_the_same_greedy_text(monkeypatch, policy) -> None:
    """Cache hits, host-computed and split experts all go through the native kernels (expert_rows in the
    layer's gather and scatter, the one-call expert on the host), with torch's tokens."""
    prompts = [[5, 17, 300, 42, 7, 99, 1200, 3], list(range(100, 150))]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    calls = {"gate_up": 0, "down": 0}
    kernel, whole = cpu_kernels.expert_rows, moe_calls.moe

    def counted(x, gate_up, down, *args):
        calls["gate_up"] += gate_up is not None
        calls["down"] += down is not None
        return kernel(x, gate_up, down, *args)

    def counted_whole(*args):
        calls["gate_up"] += 1
        calls["down"] += 1
        return whole(*args)

    monkeypatch.setattr(cpu_kernels, "expert_rows", counted)
    monkeypatch.setattr(moe_calls, "moe", counted_whole)
    config = EngineConfig(offload_policy=policy, expert_cache_fraction=0.25, link_ratio=2.0, host_ratio=2.0)
    _same_text_with_and_without_kernels(monkeypatch, config, prompts, params, calls)


def test_the_emulation_unit_times_the_engines_expert_path_from_memory(monkeypatch) -> None:
    """The unit --link-ratio and --host-ratio multiply: experts as the engine computes them, cycling through
    more weights than a last-level cache holds (one expert over and over measured cache-hot math)."""
    from services.engine.offload import host_executor, link

    seen: dict[int, int] = {}
    forward = host_executor.expert_forward  # a host job's math (host_math), which the unit times

    def recorded(x, w, *rest):
        seen[id(w)] = w.nbytes
        return forward(x, w, *rest)

    monkeypatch.setattr(host_executor, "expert_forward", recorded)
    link.expert_compute_seconds(64, 128, torch.float32, repeats=10)
    assert sum(seen.values()) >= link.COLD_BYTES


def test_the_link_and_the_host_share_one_measured_unit(monkeypatch) -> None:
    """The emulated link asks for the unit without a token count, the cost model with tokens=1: one
    measurement, or the two would be timed apart and the ratios between link and host drift (a busy moment
    under one of them moved a slow link's split decision in CI)."""
    from services.engine.offload import link

    calls: list[tuple] = []
    monkeypatch.setattr(link, "expert_compute_seconds", lambda *args, **kw: calls.append(args) or 1e-4)
    shape = (16, 48, torch.float32)  # a shape no other test measures: the cache starts empty for it
    assert link.emulation_unit(*shape) == link.emulation_unit(*shape, 1) == 1e-4
    link.emulation_unit(*shape, 16)
    assert len(calls) == 2  # one token, sixteen tokens


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16])
def test_linear_matches_torch_with_and_without_bias(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, weight, bias = torch.randn(rows, 48, generator=g), torch.randn(80, 48, generator=g), torch.randn(80, generator=g)
    in_out = weight.t().contiguous()
    torch.testing.assert_close(cpu_kernels.linear(x, in_out, None), F.linear(x, weight), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cpu_kernels.linear(x, in_out, bias), F.linear(x, weight, bias), atol=1e-5, rtol=1e-5)


def test_rms_norm_with_the_residual_add_fused() -> None:
    g = torch.Generator().manual_seed(0)
    x, delta, weight = torch.randn(5, 64, generator=g), torch.randn(5, 64, generator=g), torch.randn(64, generator=g)
    same, normed = cpu_kernels.rms_norm(x, weight, 1e-5)
    assert same is x
    torch.testing.assert_close(normed, attention.rms_norm(x, weight, 1e-5))
    total, normed = cpu_kernels.rms_norm(x, weight, 1e-5, delta)
    torch.testing.assert_close(total, x + delta)
    torch.testing.assert_close(normed, attention.rms_norm(x + delta, weight, 1e-5))


@pytest.mark.parametrize("head_norms", [False, True], ids=["plain", "qwen3-head-norms"])
def test_rope_write_kv_matches_apply_rope_and_write_kv(head_norms: bool) -> None:
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, tokens, slots = 4, 2, 16, 6, 40
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 3
    angles = torch.rand(50, dim // 2, generator=g).repeat(1, 2) * 6
    cos, sin = angles.cos(), angles.sin()
    positions, slot_ids = torch.tensor([0, 3, 9, 10, 48, 49]), torch.tensor([5, 0, 39, 17, 18, 2])
    norms = (torch.rand(dim, generator=g) + 0.5, torch.rand(dim, generator=g) + 0.5) if head_norms else None
    heads_view = qkv.view(tokens, -1, dim)
    q, k = heads_view[:, :heads], heads_view[:, heads : heads + kv_heads]
    if norms is not None:  # what the torch path does for Qwen3 before rotating
        q, k = attention.rms_norm(q, norms[0], 1e-6), attention.rms_norm(k, norms[1], 1e-6)
    want_qk = attention.apply_rope(torch.cat((q, k), dim=1), cos[positions], sin[positions])
    want_k_cache, want_v_cache = torch.zeros(kv_heads, slots, dim), torch.zeros(kv_heads, slots, dim)
    write_kv(want_k_cache, want_v_cache, want_qk[:, heads:], heads_view[:, heads + kv_heads :], slot_ids)
    k_cache, v_cache = torch.zeros(kv_heads, slots, dim), torch.zeros(kv_heads, slots, dim)
    cpu_kernels.rope_write_kv(qkv, heads, kv_heads, dim, cos, sin, positions, slot_ids, k_cache, v_cache, norms, 1e-6)
    torch.testing.assert_close(qkv.view(tokens, -1, dim)[:, : heads + kv_heads], want_qk)
    torch.testing.assert_close(k_cache, want_k_cache)
    torch.testing.assert_close(v_cache, want_v_cache)
    for bad_positions, bad_slots in ((positions + 1, slot_ids), (positions, slot_ids + 1)):
        with pytest.raises(ValueError, match="outside"):
            cpu_kernels.rope_write_kv(qkv, heads, kv_heads, dim, cos, sin, bad_positions, bad_slots, k_cache, v_cache)


@pytest.mark.parametrize("threads", [1, 2])
def test_convert_rounds_and_widens_as_torch_does(threads: int) -> None:
    """A CUDA engine's host rows between fp32 and bf16 on the pool (convert.c): torch's round to nearest even,
    infinities and overflow kept, a NaN stays a NaN; widening exact; fp32 copied bit for bit."""
    before = cpu_kernels.pool_threads() or 1
    cpu_kernels.set_threads(threads)
    try:
        x = torch.randn(37, 2048, generator=torch.Generator().manual_seed(0)) * 1e3
        x[0, :6] = torch.tensor([float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40, float("nan")])
        x[1, :3] = torch.tensor([1.00390625, 1.01171875, -1.00390625])  # ties: to even, both ways
        narrow = cpu_kernels.convert(x, torch.empty(x.shape, dtype=torch.bfloat16))
        finite = ~x.isnan()
        assert torch.equal(narrow[finite].view(torch.int16), x[finite].bfloat16().view(torch.int16))
        assert narrow[~finite].isnan().all()
        wide = cpu_kernels.convert(narrow, torch.empty(x.shape))
        assert torch.equal(wide.view(torch.int32)[finite], narrow.float().view(torch.int32)[finite])
        same = cpu_kernels.convert(x, torch.empty(x.shape))
        assert torch.equal(same.view(torch.int32), x.view(torch.int32))
        half = cpu_kernels.convert(x[2:4], torch.empty(2, 2048, dtype=torch.float16))  # torch's, as before
        assert torch.equal(half, x[2:4].half())
    finally:
        cpu_kernels.set_threads(before)
