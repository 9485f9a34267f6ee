"""Every weight format under the kernels' other builds of this source: the portable C loops, the AVX2 loops of
an AVX-512 machine, Intel AMX tiles, and one-row pairs turned off, each held to this machine's build, the
torch ops or its own vector loops (the builds run in subprocesses or beside the loaded one)."""

from __future__ import annotations

import platform

import pytest
import torch

from services.engine import cpu_kernels
from services.engine.cpu_kernels import formats
from tests.test_cpu_formats import relative_error

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: native kernels not built")


_PORTABLE = """
import os, torch, torch.nn.functional as F
from services.engine import cpu_kernels
os.environ["HINTSERVE_KERNEL_FLAGS"] = "-O3 -march=x86-64"  # no AVX-512: the portable C loops
assert cpu_kernels.library().hs_isa() == b"portable C"
from services.engine.cpu_kernels import formats
g = torch.Generator().manual_seed(1)
for threads in (1, 2):
    cpu_kernels.set_threads(threads)
    for fmt in ("fp32", "bf16", "int8", "int4"):
        m = formats.pack(torch.randn(200, 256, generator=g) * 0.05, fmt, 64, torch.randn(200, generator=g))
        for rows in (1, 3, 9):
            x = torch.randn(rows, 256, generator=g)
            y, ref = formats.matmul(x, m), F.linear(x, formats.dequantize(m), m.bias)
            assert ((y - ref).abs().max() / ref.abs().max()).item() < 2e-2, (fmt, rows)
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 compiler flags")
def test_the_portable_loops_compute_every_format_too(tmp_path) -> None:
    """CPUs without AVX-512 run the portable C loops over the same layouts: built so here and checked."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "HINTSERVE_KERNEL_CACHE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", _PORTABLE], check=True, timeout=300, env=env)


_AVX2 = """
import sys, torch, torch.nn.functional as F
from services.engine import cpu_kernels
from services.engine.cpu_kernels import formats
from services.engine.cpu_kernels import moe_calls
isa = cpu_kernels.library().hs_isa().decode()
assert isa == sys.argv[1], isa
tolerance = {"fp32": 1e-5, "bf16": 5e-3, "int8": 1.5e-2, "int4": 1.5e-2}  # test_cpu_formats' TOLERANCE


def error(y, ref):
    return ((y - ref).abs().max() / ref.abs().max()).item()


g = torch.Generator().manual_seed(2)
for threads in (1, 2):
    assert cpu_kernels.set_threads(threads) == threads
    for fmt in ("fp32", "bf16", "int8", "int4"):
        for group in ((32, 64, 128) if fmt == "int4" else (64,)):
            m = formats.pack(torch.randn(203, 256, generator=g) * 0.05, fmt, group, torch.randn(203, generator=g))
            for rows in (1, 3, 8, 9, 17):
                x = torch.randn(rows + 2, 256, generator=g)[1:-1]
                y, ref = formats.matmul(x, m), F.linear(x, formats.dequantize(m), m.bias)
                assert y.shape == ref.shape and error(y, ref) < tolerance[fmt], (fmt, group, rows, threads)
            # A single expert and a one-call MoE of several, both through hs_moe.
            experts, hidden, inter, tokens = 4, 128, 256, 9
            gate_up = [formats.pack(torch.randn(2 * inter, hidden, generator=g) * 0.1, fmt, group)
                       for _ in range(experts)]
            down = [formats.pack(torch.randn(hidden, inter, generator=g) * 0.1, fmt, group) for _ in range(experts)]
            x = torch.randn(tokens, hidden, generator=g)

            def swiglu(e, row):
                gate, up = F.linear(row, formats.dequantize(gate_up[e])).chunk(2, dim=-1)
                return F.linear(F.silu(gate) * up, formats.dequantize(down[e]))

            assert error(moe_calls.expert(x, gate_up[0], down[0]), swiglu(0, x)) < 2 * tolerance[fmt], (fmt, "expert")
            ids = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(tokens)])
            weights = torch.rand(tokens, 2, generator=g)
            out = moe_calls.moe(x, ids, weights, moe_calls.native_array(gate_up), moe_calls.native_array(down), hidden)
            expected = torch.stack([sum(w * swiglu(e, x[t]) for e, w in zip(ids[t].tolist(), weights[t].tolist()))
                                    for t in range(tokens)])
            assert error(out, expected) < 2 * tolerance[fmt], (fmt, "moe", threads)
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()


@pytest.mark.parametrize("flags, isa, needed", [
    ("-mavx2 -mfma -mf16c -mno-avx512f", "avx2+fma", {"avx2", "fma", "f16c"}),
    ("-mavx2 -mfma -mf16c -mavxvnni -mno-avx512f", "avx2+fma+avxvnni", {"avx2", "fma", "f16c", "avx_vnni"}),
    # AVX-512 without VNNI and BF16 (Skylake-SP): its int8 and int4 run the AVX2 loops, bf16 widens at 512 bits.
    ("-march=skylake-avx512", "avx512", {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}),
], ids=["avx2", "avx2-avxvnni", "avx512-without-vnni"])
def test_the_avx2_loops_compute_every_format(tmp_path, flags: str, isa: str, needed: set[str]) -> None:
    """CPUs with AVX2 and FMA but no AVX-512 run rows.c's 256-bit loops (with AVX-VNNI's vpdpbusd where the CPU
    has it): built so here with HINTSERVE_KERNEL_FLAGS and checked, every format, single expert and MoE."""
    import os
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64") or not needed <= _cpu_flags():
        pytest.skip(f"this CPU lacks one of {sorted(needed)}")
    env = {**os.environ, "HINTSERVE_KERNEL_CACHE": str(tmp_path),
           "HINTSERVE_KERNEL_FLAGS": f"-O3 {flags} -fno-math-errno"}
    subprocess.run([sys.executable, "-c", _AVX2, isa], check=True, timeout=300, env=env)


_TILE_PRODUCTS = """
import sys, torch
from services.engine.cpu_kernels import formats
from services.engine.cpu_kernels import moe_calls
out = {}
for fmt in ("bf16", "int8", "int4"):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(203, 256, generator=g) * 0.05
    bias = torch.randn(203, generator=g)
    x = torch.randn(64, 256, generator=g)
    experts = [formats.pack(torch.randn(128, 256, generator=g) * 0.05, fmt) for _ in range(5)]
    downs = [formats.pack(torch.randn(256, 64, generator=g) * 0.05, fmt) for _ in range(5)]
    tokens = torch.randn(45, 256, generator=g)
    ids = torch.stack([torch.arange(45) % 4, (torch.arange(45) + 1) % 4], dim=1)
    ids[:3, 1] = 4  # experts 0-3 at 21-23 rows (tiles), expert 4 at 3 (the vector loops) in the same call
    weights = torch.rand(45, 2, generator=g)
    out[fmt, "linear"] = formats.matmul(x, formats.pack(w, fmt, bias=bias))
    if fmt == "int4":  # two tile products a group
        out[fmt, "linear, groups of 128"] = formats.matmul(x, formats.pack(w, fmt, group=128, bias=bias))
    out[fmt, "moe"] = moe_calls.moe(tokens, ids, weights, moe_calls.native_array(experts), moe_calls.native_array(downs),
                                  256)
    # every expert at the fewest rows the tiles take (bf16 5, int8 and int4 10): each packed as 16, over three times the
    # assignments
    many = 16 if fmt == "bf16" else 8
    experts = [formats.pack(torch.randn(128, 256, generator=g) * 0.05, fmt) for _ in range(many)]
    downs = [formats.pack(torch.randn(256, 64, generator=g) * 0.05, fmt) for _ in range(many)]
    ids = torch.stack([torch.arange(40) % many, (torch.arange(40) + many // 2) % many], dim=1)
    out[fmt, "fewest rows"] = moe_calls.moe(tokens[:40], ids, weights[:40], moe_calls.native_array(experts),
                                          moe_calls.native_array(downs), 256)
torch.save(out, sys.argv[1])
"""


def test_amx_tiles_match_the_vector_loops(tmp_path) -> None:
    """Where the CPU grants AMX, bf16 from 5 rows and int8 and int4 from 10 run on its tiles: bf16 sums the same
    products in fp32 in another order, so it agrees with the vector loops (HINTSERVE_AMX=0) to fp32 rounding;
    int8's and int4's integer sums are exact and scaled as the vector loops scale them, so they are their bits."""
    import os
    import subprocess
    import sys

    if not cpu_kernels.library().hs_amx_rows(formats.FORMAT_IDS["bf16"]):
        pytest.skip("no AMX tiles here (the CPU has none, or the OS or hypervisor does not grant them)")
    assert "AMX tiles: bf16 from 5 rows, int8 from 10 rows, int4 from 10 rows" in cpu_kernels.describe()
    results = {}
    for amx in ("1", "0"):
        out = tmp_path / f"amx{amx}.pt"
        subprocess.run([sys.executable, "-c", _TILE_PRODUCTS, str(out)], check=True, timeout=300,
                       env={**os.environ, "HINTSERVE_AMX": amx})
        results[amx] = torch.load(out)
    for (fmt, name), tiles in results["1"].items():
        vectors = results["0"][fmt, name]
        if fmt in ("int8", "int4"):
            assert torch.equal(tiles, vectors), (fmt, name)
        else:  # moe: a SwiGLU value may round to the next bf16 on its way to down, a bf16 step of one input
            assert relative_error(tiles, vectors) < (1e-5 if name == "linear" else 5e-3), name
    assert set(results["1"]) == {(fmt, name) for fmt in ("bf16", "int8", "int4") for name in ("linear", "moe", "fewest rows")
                                 } | {("int4", "linear, groups of 128")}


def test_one_row_pairs_compute_the_single_tiles_bits(tmp_path, monkeypatch) -> None:
    """One activation row reads its weight chunks in pairs, chunk t beside chunk t + half (rows.c's
    hs_rows_item): the same operations in the same order as one chunk at a time, so the same bits as a build
    with the pairs turned off, every format (those without a pair loop on this CPU compare with themselves)."""
    import ctypes

    if cpu_kernels.library() is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the native kernels are not built here, or this is not x86 (the pairs are x86 loops)")
    monkeypatch.setenv("HINTSERVE_KERNEL_CACHE", str(tmp_path))
    unpaired = cpu_kernels.build_library([[*cpu_kernels.flag_sets()[0],  # the loaded build's, and:
                                           *(f"-D{fmt}_PAIRS=0" for fmt in ("Q4", "Q8", "BF16", "F32"))]])
    assert unpaired is not None
    g = torch.Generator().manual_seed(11)
    x = torch.randn(1, 512, generator=g)
    for fmt in formats.FORMAT_IDS:
        m = formats.pack(torch.randn(80, 512, generator=g) * 0.05, fmt, bias=torch.randn(80, generator=g))  # 5 chunks
        paired = formats.matmul(x, m)
        alone = torch.empty_like(paired)
        assert unpaired.hs_linear(ctypes.byref(m.native()), x.data_ptr(), x.stride(0), alone.data_ptr(),
                                  alone.stride(0), 1) == 0
        assert torch.equal(paired, alone), fmt
