"""Tiny quantized checkpoints in each format's own layout, packed the way each format's reference code packs.

The packers follow AutoGPTQ's QuantLinear.pack, AutoAWQ's WQLinear_GEMM.from_linear, compressed-tensors'
pack_to_int32 and DeepSeek-V3's block-wise FP8 cast, loop for loop, so they share no code with our loaders.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import torch
from safetensors.torch import load_file, save_file

GROUP = 32
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def _rtn(w: torch.Tensor, group: int, bits: int = 4):
    """Asymmetric round-to-nearest over groups of inputs: int q [out, in], scale and zero [out, in/g]."""
    out, inputs = w.shape
    g = w.view(out, inputs // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / (2**bits - 1)).clamp(min=1e-6).half().float()
    zero = (-lo / scale).round().clamp(0, 2**bits - 1)
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, 2**bits - 1)
    return q.view(out, inputs).to(torch.int64), scale, zero.to(torch.int64)


def _words(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.astype(np.uint32).view(np.int32))


def gptq_pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale, zero = _rtn(w, GROUP)
    intweight = q.t().numpy().astype(np.uint32)  # [in, out]
    qweight = np.zeros((intweight.shape[0] // 8, intweight.shape[1]), dtype=np.uint32)
    i = row = 0
    while row < qweight.shape[0]:
        for j in range(i, i + 8):
            qweight[row] |= intweight[j] << (4 * (j - i))
        i += 8
        row += 1
    zeros = zero.t().numpy().astype(np.uint32) - 1  # [groups, out], v1 stores zero - 1
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    i = col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + 8):
            qzeros[:, col] |= zeros[:, j] << (4 * (j - i))
        i += 8
        col += 1
    g_idx = torch.arange(w.shape[1], dtype=torch.int32) // GROUP
    return {"qweight": _words(qweight), "qzeros": _words(qzeros), "scales": scale.t().contiguous().half(),
            "g_idx": g_idx}


def gptq_reference(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """AutoGPTQ's torch dequantisation (the QuantLinear forward's unpacking)."""
    wf = torch.tensor(list(range(0, 32, 4)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(t["qzeros"].unsqueeze(2).expand(-1, -1, 8), wf.unsqueeze(0)).to(torch.int8)
    zeros = (torch.bitwise_and(zeros, 15) + 1).reshape(t["scales"].shape)
    weight = torch.bitwise_right_shift(t["qweight"].unsqueeze(1).expand(-1, 8, -1), wf.unsqueeze(-1)).to(torch.int8)
    weight = torch.bitwise_and(weight, 15).reshape(-1, weight.shape[2])
    g = t["g_idx"].long()
    return (t["scales"].float()[g] * (weight.float() - zeros.float()[g])).t()


def awq_pack(w: torch.Tensor) -> dict[str, torch.Tensor]:
    q, scale, zero = _rtn(w, GROUP)
    intweight = q.t().numpy().astype(np.uint32)  # [in, out]
    qweight = np.zeros((intweight.shape[0], intweight.shape[1] // 8), dtype=np.uint32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            qweight[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    zeros = zero.t().numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 8), dtype=np.uint32)
    for col in range(zeros.shape[1] // 8):
        for i in range(8):
            qzeros[:, col] |= zeros[:, col * 8 + AWQ_ORDER[i]] << (i * 4)
    return {"qweight": _words(qweight), "qzeros": _words(qzeros), "scales": scale.t().contiguous().half()}


def awq_reference(t: dict[str, torch.Tensor]) -> torch.Tensor:
    """AutoAWQ's unpack_awq + reverse_awq_order + dequantize_gemm."""
    shifts = torch.arange(0, 32, 4)
    reverse = torch.arange(t["qweight"].shape[1] * 8).view(-1, 8)[:, AWQ_REVERSE_ORDER].view(-1)
    iweights = torch.bitwise_right_shift(t["qweight"][:, :, None], shifts[None, None, :]).view(t["qweight"].shape[0], -1)
    izeros = torch.bitwise_right_shift(t["qzeros"][:, :, None], shifts[None, None, :]).view(t["qzeros"].shape[0], -1)
    iweights = torch.bitwise_and(iweights[:, reverse], 15)
    izeros = torch.bitwise_and(izeros[:, reverse], 15)
    scales = t["scales"].float().repeat_interleave(GROUP, dim=0)
    izeros = izeros.repeat_interleave(GROUP, dim=0)
    return ((iweights - izeros).float() * scales).t()


def compressed_pack(w: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """Symmetric int`bits` per group (int4) or per channel (int8), packed by pack_to_int32's loop."""
    out, inputs = w.shape
    group = GROUP if bits == 4 else inputs
    g = w.view(out, inputs // group, group)
    scale = (g.abs().amax(-1) / (2 ** (bits - 1) - 1)).clamp(min=1e-6)
    q = (g / scale[..., None]).round().clamp(-(2 ** (bits - 1)), 2 ** (bits - 1) - 1).view(out, inputs)
    value = (q.to(torch.int64) + (1 << (bits - 1))).numpy().astype(np.uint32)
    pack_factor = 32 // bits
    packed = np.zeros((out, inputs // pack_factor), dtype=np.uint32)
    for i in range(pack_factor):
        packed |= value[:, i::pack_factor] << bits * i
    return {"weight_packed": _words(packed), "weight_scale": scale.bfloat16(),
            "weight_shape": torch.tensor([out, inputs], dtype=torch.int64)}


def compressed_reference(t: dict[str, torch.Tensor], bits: int) -> torch.Tensor:
    """unpack_from_int32 then (q - 0) * scale per group."""
    packed = t["weight_packed"].numpy().view(np.uint32)
    pack_factor = 32 // bits
    out = t["weight_shape"].tolist()
    unpacked = np.zeros((packed.shape[0], packed.shape[1] * pack_factor), dtype=np.int64)
    for i in range(pack_factor):
        unpacked[:, i::pack_factor] = (packed >> (bits * i)) & ((1 << bits) - 1)
    q = torch.from_numpy(unpacked[:, : out[1]] - (1 << (bits - 1))).float()
    scale = t["weight_scale"].float()
    return q * scale.repeat_interleave(out[1] // scale.shape[1], dim=1)


def fp8_pack(w: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
    out, inputs = w.shape
    rows, cols = -(-out // block), -(-inputs // block)
    scale = torch.zeros(rows, cols)
    q = torch.zeros(out, inputs)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * block : (r + 1) * block, c * block : (c + 1) * block]
            s = tile.abs().max().clamp(min=1e-12) / 448.0
            scale[r, c] = s
            q[r * block : (r + 1) * block, c * block : (c + 1) * block] = tile / s
    return {"weight": q.to(torch.float8_e4m3fn), "weight_scale_inv": scale}


def fp8_reference(t: dict[str, torch.Tensor], block: int = 128) -> torch.Tensor:
    """DeepSeek-V3 inference/kernel.py weight_dequant, one block at a time."""
    w = t["weight"].float()
    for r in range(t["weight_scale_inv"].shape[0]):
        for c in range(t["weight_scale_inv"].shape[1]):
            w[r * block : (r + 1) * block, c * block : (c + 1) * block] *= t["weight_scale_inv"][r, c]
    return w


FORMATS = {
    "gptq": (gptq_pack, gptq_reference, {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False,
                                         "sym": False}),
    "awq": (awq_pack, awq_reference, {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
                                      "zero_point": True}),
    "compressed-int4": (lambda w: compressed_pack(w, 4), lambda t: compressed_reference(t, 4), {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}}),
    "compressed-int8": (lambda w: compressed_pack(w, 8), lambda t: compressed_reference(t, 8), {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None}}}}),
    "fp8": (fp8_pack, fp8_reference, {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                      "weight_block_size": [128, 128]}),
}


def quantize_checkpoint(dense_dir: str, out_dir: str, fmt: str) -> tuple[str, str, dict[str, torch.Tensor]]:
    """Writes `fmt`'s checkpoint of every expert linear of `dense_dir` into `out_dir`, and next to it
    (`out_dir`-dense) the same model holding the reference dequantisation as dense fp32 weights.

    Returns (quantized dir, dense-reference dir, reference weights by linear name)."""
    pack, reference, qconfig = FORMATS[fmt]
    state = load_file(os.path.join(dense_dir, "model.safetensors"))
    quantized, dense, refs = {}, {}, {}
    for name, t in state.items():
        if ".experts." not in name or not name.endswith(".weight"):
            quantized[name] = dense[name] = t
            continue
        prefix = name[: -len(".weight")]
        parts = pack(t.float())
        refs[name] = reference(parts)
        dense[name] = refs[name].contiguous()
        quantized.update({f"{prefix}.{k}": v.contiguous() for k, v in parts.items()})
    ref_dir = out_dir + "-dense"
    for d, tensors in ((out_dir, quantized), (ref_dir, dense)):
        shutil.copytree(dense_dir, d)
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = qconfig
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    return out_dir, ref_dir, refs
