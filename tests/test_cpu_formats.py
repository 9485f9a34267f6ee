"""The native CPU kernels in every weight format (cpu_kernels/formats.py, matmul.c, rows.c, moe.c)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.engine import cpu_kernels
from services.engine.config import EngineConfig
from services.engine.cpu_kernels import formats, moe_calls
from services.engine.quant import groupwise
from services.engine.quant.groupwise import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int4_ops,
    quantize_int8,
    quantize_int8_ops,
)

FORMATS = ("fp32", "bf16", "int8", "int4")
# Where the math differs from an fp32 product with the dequantised weights: bf16 rounds the activations to
# bf16, int8/int4 quantise them to int8 per block (as llama.cpp's Q8_0 activations): the error against the
# largest output, measured at 0.2% / 0.7% / 0.6% on these shapes.
TOLERANCE = {"fp32": 1e-5, "bf16": 5e-3, "int8": 1.5e-2, "int4": 1.5e-2}

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: native kernels not built")


@pytest.fixture(params=[1, 2], ids=["one-thread", "two-threads"])
def pool(request):
    before = cpu_kernels.library().hs_threads()
    assert cpu_kernels.set_threads(request.param) == request.param
    yield request.param
    cpu_kernels.set_threads(before)


def relative_error(y: torch.Tensor, reference: torch.Tensor) -> float:
    return ((y - reference).abs().max() / reference.abs().max()).item()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
def test_every_format_matches_its_dequantised_product(fmt: str, rows: int, pool: int) -> None:
    g = torch.Generator().manual_seed(rows)
    n, k = 203, 256  # not whole tiles (16 rows int8/int4, 4 fp32/bf16): the padding must not show
    w, bias = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    m = formats.pack(w, fmt, 64, bias)
    x = torch.randn(rows + 2, k, generator=g)[1:-1]  # rows inside a larger tensor: a row stride of k
    y = formats.matmul(x, m)
    reference = F.linear(x, formats.dequantize(m), bias)
    assert y.shape == (rows, n) and relative_error(y, reference) < TOLERANCE[fmt]


def test_packed_grids_are_the_groupwise_quantisers() -> None:
    """The CPU layouts hold exactly quant/groupwise's grids (the weights torch's kernels computed on)."""
    w = torch.randn(40, 192)
    q, scale, zero = quantize_int4(w, 64)
    assert torch.equal(formats.dequantize(formats.pack(w, "int4", 64)),
                       dequantize_int4(q, scale.bfloat16(), zero.bfloat16(), 64))
    q8, scale8 = quantize_int8(w)
    assert torch.equal(formats.dequantize(formats.pack(w, "int8")), dequantize_int8(q8, scale8))
    assert formats.pack(w, "int4", 64).nbytes < formats.pack(w, "int8").nbytes < formats.pack(w, "bf16").nbytes


def test_packing_by_blocks_of_rows_is_packing_the_whole_matrix() -> None:
    """Where the native quantizer does not take a matrix (here fp16), pack quantizes PACK_BLOCK_ROWS rows at a
    time (a bounded transient): the bytes are the whole matrix's, the last block's padding to a tile included."""
    w = torch.randn(2 * formats.PACK_BLOCK_ROWS + 7, 128, dtype=torch.float16)
    assert not formats._native_quantize(w, "int4", 64, torch.empty(0, dtype=torch.uint8), None)
    whole4 = formats.from_int4(*quantize_int4(w, 64), 64)
    blocks4 = formats.pack(w, "int4", 64)
    assert torch.equal(blocks4.weight, whole4.weight) and blocks4.weight.shape == whole4.weight.shape
    whole8, blocks8 = formats.from_int8(*quantize_int8(w)), formats.pack(w, "int8")
    assert torch.equal(blocks8.weight, whole8.weight) and blocks8.scales is not None and whole8.scales is not None
    assert torch.equal(blocks8.scales, whole8.scales)


def hard_to_quantize(dtype: torch.dtype) -> torch.Tensor:
    """[37, 384] of `dtype` with a row stride of 512: rows past a whole tile, a flat group, a row of zeros,
    magnitudes from 1e-6 to 100, and halves on the grid (scale 1), where rounding half to even and half away
    from zero part."""
    gen = torch.Generator().manual_seed(7)
    rows = 2 * formats.TILE + 5
    source = torch.randn(rows, 512, generator=gen) * torch.logspace(-6, 2, rows)[:, None]
    source[0, :128] = 0.5
    source[1] = 0.0
    source[2, :128] = torch.arange(128) % 15 + 0.5
    source[2, 0:128:32], source[2, 1:128:32] = 0.0, 15.0
    source[3] = torch.arange(512) % 8 - 3.5
    source[3, 0] = 127.0
    return source.to(dtype)[:, :384]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("fmt", "group"), [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 0)])
def test_the_native_quantizer_makes_the_torch_ops_bits(dtype: torch.dtype, fmt: str, group: int) -> None:
    """quantize.c packs at load exactly what quant/groupwise's torch ops and from_int4 / from_int8 make, and
    quantize_int4 / quantize_int8 (its plain grids, which the CUDA layouts pack) are the ops' bits too."""
    w = hard_to_quantize(dtype)
    rows = w.shape[0]
    padded = -(-rows // formats.TILE) * formats.TILE
    weight = torch.full((padded, formats.packed_nbytes((rows, 384), fmt, group or 64) // padded), 0xAB,
                        dtype=torch.uint8)
    scales = torch.full((padded,), -1.0) if fmt == "int8" else None
    assert formats._native_quantize(w, fmt, group or 64, weight, scales)  # the native pass ran
    if fmt == "int4":
        reference = formats.from_int4(*quantize_int4_ops(w, group), group)
    else:
        reference = formats.from_int8(*quantize_int8_ops(w))
        assert scales is not None and reference.scales is not None and torch.equal(scales, reference.scales)
    assert torch.equal(weight, reference.weight.reshape(weight.shape))
    grids = quantize_int4(w, group) if fmt == "int4" else quantize_int8(w)
    ops = quantize_int4_ops(w, group) if fmt == "int4" else quantize_int8_ops(w)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(grids, ops, strict=True))
    assert groupwise._native_grid(w, group) is not None  # the grids came from the native pass


def test_an_int4_tile_is_one_stream_each_groups_scales_after_its_nibbles() -> None:
    """Row i's scale and zero of group j lie right after that group's nibbles in its tile (no second stream)."""
    n, k, group = 40, 192, 64
    w = torch.randn(n, k)
    q, scale, zero = quantize_int4(w, group)
    m = formats.pack(w, "int4", group)
    groups, block = k // group, group // 2 * formats.TILE + 4 * formats.TILE
    assert m.scales is None and m.nbytes == 48 // formats.TILE * groups * block
    blocks = m.weight.view(-1, groups, block)
    for row, j in ((0, 0), (17, 2), (39, 1)):
        pair = blocks[row // formats.TILE, j, -4 * formats.TILE:].view(torch.bfloat16).view(2, formats.TILE)
        assert pair[0, row % formats.TILE] == scale[row, j].bfloat16()
        assert pair[1, row % formats.TILE] == zero[row, j].bfloat16()


def test_widths_the_kernels_cannot_take_run_on_torch() -> None:
    """An input width off the kernels' vectors (96) still computes, through the dequantised matrix."""
    w, x = torch.randn(48, 96), torch.randn(3, 96)
    for fmt in FORMATS:
        m = formats.pack(w, fmt, 32)
        assert not formats.native_widths(fmt, 96, 32) or fmt == "int4"
        torch.testing.assert_close(formats.matmul(x, m), F.linear(x, formats.dequantize(m)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_one_call_moe_is_the_per_expert_sum(fmt: str, pool: int) -> None:
    g = torch.Generator().manual_seed(7)
    experts, hidden, inter, tokens, top_k = 6, 128, 192, 11, 2
    gate_up = [formats.pack(torch.randn(2 * inter, hidden, generator=g) * 0.1, fmt, 64) for _ in range(experts)]
    down = [formats.pack(torch.randn(hidden, inter, generator=g) * 0.1, fmt, 64) for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=g)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    out = moe_calls.moe(x, ids, weights, moe_calls.native_array(gate_up), moe_calls.native_array(down), hidden)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for e, wt in zip(ids[t].tolist(), weights[t].tolist()):
            gate, up = F.linear(x[t], formats.dequantize(gate_up[e])).chunk(2)
            expected[t] += wt * F.linear(F.silu(gate) * up, formats.dequantize(down[e]))
    assert relative_error(out, expected) < 2 * TOLERANCE[fmt]
    with pytest.raises(ValueError, match="expert id out of range"):
        moe_calls.moe(x, ids + experts, weights, moe_calls.native_array(gate_up), moe_calls.native_array(down), hidden)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens, top_k, one_expert", [(9000, 2, False), (17000, 1, True)],
                         ids=["whole-experts-a-pass", "one-expert-over-two-passes"])
def test_a_call_larger_than_one_pass_of_intermediates_is_still_the_per_expert_sum(
        fmt: str, tokens: int, top_k: int, one_expert: bool) -> None:
    """hs_moe holds at most MOE_PASS_BYTES (16 MB) of intermediates: these calls need over 16 MB at these
    widths, so they run in passes, the second one an expert's tokens split over two."""
    g = torch.Generator().manual_seed(11)
    experts, hidden, inter = 4, 64, 64
    gate_up = [formats.pack(torch.randn(2 * inter, hidden, generator=g) * 0.1, fmt, 64) for _ in range(experts)]
    down = [formats.pack(torch.randn(hidden, inter, generator=g) * 0.1, fmt, 64) for _ in range(experts)]
    x = torch.randn(tokens, hidden, generator=g)
    if one_expert:
        ids = torch.zeros(tokens, 1, dtype=torch.int64)
    else:
        ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    out = moe_calls.moe(x, ids, weights, moe_calls.native_array(gate_up), moe_calls.native_array(down), hidden)
    expected = torch.zeros(tokens, hidden)
    for e in range(experts):
        gate, up = F.linear(x, formats.dequantize(gate_up[e])).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, formats.dequantize(down[e]))
        expected += ((ids == e) * weights).sum(dim=1, keepdim=True) * y
    assert relative_error(out, expected) < 2 * TOLERANCE[fmt]


def test_a_second_thread_calling_during_a_pool_job_runs_alone() -> None:
    """The host executor's threads call the kernels beside the serving loop: each call gets its own answer."""
    import concurrent.futures

    cpu_kernels.set_threads(2)
    try:
        w = torch.randn(512, 256)
        m = formats.pack(w, "int8")
        xs = [torch.randn(4, 256) for _ in range(16)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool_:
            ys = list(pool_.map(lambda x: formats.matmul(x, m), xs))
        for x, y in zip(xs, ys):
            assert relative_error(y, F.linear(x, formats.dequantize(m))) < TOLERANCE["int8"]
    finally:
        cpu_kernels.set_threads(1)


@pytest.mark.parametrize("field, value, message", [
    ("weight_dtype", "int3", "unknown weight dtype"),
    ("weight_group_size", 32, "weight_group_size must be 64 or 128"),
    ("threads", 0, "threads must be in 1..256"),
])
def test_bad_cpu_knobs_are_refused(field: str, value: object, message: str, tiny_mixtral_dir: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=tiny_mixtral_dir, **{field: value}).validate()


_RESIZE_THEN_RUN = """
import torch
from services.engine import cpu_kernels
from services.engine.cpu_kernels import formats
from services.engine.cpu_kernels import moe_calls
m = formats.pack(torch.randn(64, 128), "int8")
x = torch.randn(2, 128)
for i in range(2000):
    cpu_kernels.set_threads(1 + i % 2)
    formats.matmul(x, m)
"""


def test_a_job_right_after_the_pool_grows_is_joined_by_every_worker() -> None:
    """A worker made by set_threads must join a job posted before it first ran (it once took that job's
    generation for its starting one, and the caller waited for it forever)."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", _RESIZE_THEN_RUN], check=True, timeout=120)


@pytest.mark.parametrize("intermediate", [192, 100])  # 100: the vector SwiGLU's padded tail
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_split_experts_host_half_is_the_swiglu_activation(fmt: str, intermediate: int) -> None:
    """moe_calls.expert without down: the gate/up half a split expert computes on the host, [T, I]."""
    g = torch.Generator().manual_seed(3)
    gate_up = formats.pack(torch.randn(2 * intermediate, 128, generator=g) * 0.1, fmt, 64)
    x = torch.randn(5, 128, generator=g)
    gate, up = F.linear(x, formats.dequantize(gate_up)).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = moe_calls.expert(x, gate_up, None)
    assert got.shape == (5, intermediate) and relative_error(got, expected) < TOLERANCE[fmt]


def test_the_native_swiglu_is_torchs_to_float_rounding() -> None:
    """hs_swiglu (every native SwiGLU): silu(gate) * up within a few ulps, saturating gates included."""
    g = torch.Generator().manual_seed(4)
    gate_up = formats.pack(torch.eye(2 * 40, 128), "fp32", 64)  # out = x's first 80 inputs: gate, then up
    x = torch.randn(3, 128, generator=g) * 30
    x[0, :4] = torch.tensor([-120.0, -88.0, 88.0, 120.0])
    got = moe_calls.expert(x, gate_up, None)
    expected = F.silu(x[:, :40]) * x[:, 40:80]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalised", "as-is"])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_native_softmax_routing_is_torchs_up_to_the_products_summation_order(rows: int, renormalize: bool,
                                                                             pool: int) -> None:
    """hs_route_softmax against router.softmax_topk on torch's product: the same experts in the same order,
    weights and probabilities within fp32 rounding of a 2048-long dot product; a tie goes to the lower expert."""
    from services.engine.models.router import softmax_topk

    g = torch.Generator().manual_seed(rows)
    router = torch.randn(128, 2048, generator=g) / 45
    x = torch.randn(rows, 2048, generator=g)
    weights, ids, probs = moe_calls.route_softmax(x, formats.pack(router, "fp32"), 8, renormalize)
    want = softmax_topk(F.linear(x, router), 8, renormalize)
    assert torch.equal(ids, want.experts)
    torch.testing.assert_close(weights, want.weights, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(probs, want.probs, rtol=1e-5, atol=1e-7)
    tied = moe_calls.route_softmax(torch.zeros(1, 2048), formats.pack(router, "fp32"), 3, renormalize)
    assert tied[1].tolist() == [[0, 1, 2]] and torch.allclose(tied[2], torch.full((1, 128), 1 / 128))
