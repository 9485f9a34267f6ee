"""Weight-only int8/int4 matmul kernels on one demo-model expert (SwiGLU), CPU, fp32 activations.

Compares torch's own CPU ops, torchao 0.18 and hqq 0.2 against dequantise-then-matmul at 1/8/64 tokens;
run with `hintserve bench quant-kernels` (writes bench/results/quant_kernels.{json,md}); torchao
and hqq rows need `pip install torchao==0.18.0 hqq` (not project dependencies: neither is used, see the md).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings

import torch
import torch.nn.functional as F

HIDDEN, INTER, GROUP = 256, 512, 64
TOKENS = (1, 8, 64)


def timed(fn, x, repeats=300) -> float:
    for _ in range(20):
        fn(x)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def swiglu_with(linear_gu, linear_d):
    def run(x):
        gate, up = linear_gu(x).chunk(2, dim=-1)
        return linear_d(F.silu(gate) * up)
    return run


def rtn(w: torch.Tensor, bits: int, group: int):
    n, k = w.shape
    wg = w.view(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-8)
    q = ((wg - lo) / scale).round().clamp(0, 2**bits - 1)
    return q.view(n, k), scale.squeeze(-1), lo.squeeze(-1)


def variants(gu: torch.Tensor, d: torch.Tensor) -> dict:
    out = {"fp32 dense (reference)": swiglu_with(lambda x: F.linear(x, gu), lambda x: F.linear(x, d))}
    gu16, d16 = gu.bfloat16(), d.bfloat16()
    out["bf16 weights, bf16 matmul"] = swiglu_with(lambda x: F.linear(x.bfloat16(), gu16).float(),
                                                   lambda x: F.linear(x.bfloat16(), d16).float())

    def dequant_linear(w, bits):
        q, s, z = rtn(w, bits, GROUP)
        qi = q.to(torch.uint8)
        n, k = w.shape

        def lin(x):
            deq = (qi.view(n, k // GROUP, GROUP).float() * s[..., None] + z[..., None]).view(n, k)
            return F.linear(x, deq)
        return lin

    for bits in (8, 4):
        out[f"int{bits} g{GROUP}: dequantise then matmul"] = swiglu_with(dequant_linear(gu, bits), dequant_linear(d, bits))

    def int8_channel(w):
        s = w.abs().amax(1) / 127
        q = (w / s[:, None]).round().clamp(-127, 127).to(torch.int8)
        return lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s)

    out["int8 per-channel: aten._weight_int8pack_mm"] = swiglu_with(int8_channel(gu), int8_channel(d))

    def int4_tinygemm(w):
        q, s, lo = rtn(w, 4, GROUP)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        sz = torch.stack([s, lo + 8 * s], -1).transpose(0, 1).contiguous()
        return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)

    out[f"int4 g{GROUP}: aten._weight_int4pack_mm_for_cpu"] = swiglu_with(int4_tinygemm(gu), int4_tinygemm(d))

    from services.engine.quant.kernels import packed_linear
    from services.engine.quant.packed import QuantScheme, pack_matrix

    for bits in (8, 4):
        mats = [pack_matrix(w, QuantScheme(bits, GROUP), "cpu") for w in (gu, d)]
        name = "int8 per-row" if bits == 8 else f"int4 g{GROUP}"
        out[f"{name}: ours = the aten kernel with bf16 activations (packed_linear)"] = swiglu_with(
            lambda x, m=mats[0]: packed_linear(x, m), lambda x, m=mats[1]: packed_linear(x, m))

    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

        for name, cfg in (("int8 per-channel: torchao Int8WeightOnlyConfig", Int8WeightOnlyConfig()),
                          (f"int4 g{GROUP}: torchao Int4WeightOnlyConfig (plain_int32, CPU)",
                           Int4WeightOnlyConfig(group_size=GROUP, int4_packing_format="plain_int32"))):
            mods = []
            for w in (gu, d):
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight.data.copy_(w)
                try:
                    quantize_(lin, cfg)
                    lin(torch.randn(1, w.shape[1]))
                except Exception as e:  # noqa: BLE001 - a config this build cannot run on CPU is reported
                    mods = str(e).splitlines()[0][:100]
                    break
                mods.append(lin)
            out[name] = mods if isinstance(mods, str) else swiglu_with(mods[0], mods[1])
    except ImportError as e:
        out["torchao"] = f"not installed: {e}"

    try:
        from hqq.core.quantize import BaseQuantizeConfig, HQQBackend, HQQLinear

        HQQLinear.set_backend(HQQBackend.PYTORCH)
        mods = []
        for w in (gu, d):
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            mods.append(HQQLinear(lin, BaseQuantizeConfig(nbits=4, group_size=GROUP), compute_dtype=torch.float32,
                                  device="cpu"))
        out[f"int4 g{GROUP}: hqq HQQLinear (PYTORCH backend)"] = swiglu_with(mods[0], mods[1])
    except Exception as e:  # noqa: BLE001
        out["hqq"] = f"failed: {str(e).splitlines()[0][:100]}"
    return out


def run_quant_kernels(out_dir: str = "bench/results") -> list[dict]:
    """Times every variant at TOKENS tokens; writes OUT_DIR/quant_kernels.{json,md}; returns the rows."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)  # one thread and a fixed seed: the figures compare kernels, not cores
    torch.set_num_threads(1)
    gu = torch.randn(2 * INTER, HIDDEN) * 0.05
    d = torch.randn(HIDDEN, INTER) * 0.05
    rows = []
    for name, fn in variants(gu, d).items():
        if isinstance(fn, str):
            rows.append({"kernel": name, "error": fn})
            continue
        row = {"kernel": name}
        for t in TOKENS:
            row[f"us_{t}"] = round(timed(fn, torch.randn(t, HIDDEN)), 1)
        rows.append(row)
        print(row, flush=True)
    ref = rows[0]
    lines = ["| kernel | " + " | ".join(f"{t} tok (us, x ref)" for t in TOKENS) + " |",
             "|---|" + "---|" * len(TOKENS)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | " + " | ".join(["n/a"] * len(TOKENS)) + f" |  ({r['error']})")
            continue
        cells = [f"{r[f'us_{t}']:.0f} ({r[f'us_{t}'] / ref[f'us_{t}']:.2f}x)" for t in TOKENS]
        lines.append(f"| {r['kernel']} | " + " | ".join(cells) + " |")
    meta = {"hidden": HIDDEN, "intermediate": INTER, "group": GROUP, "threads": 1, "torch": torch.__version__}
    with open(os.path.join(out_dir, "quant_kernels.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "quant_kernels.md"), "w") as f:
        f.write(f"One demo-model expert (SwiGLU, hidden {HIDDEN}, intermediate {INTER}), 1 thread, median us\n\n")
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows
