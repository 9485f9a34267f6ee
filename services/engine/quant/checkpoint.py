"""Quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8) read as dense ones: `<linear>.weight` is
dequantised on read, so every loader works unchanged; routed experts are then packed again in our own int4 /
int8 layout (`--expert-dtype auto` keeps the checkpoint's bit width)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from services.engine.expert_format import nearest_group_size
from services.engine.models.checkpoint import Checkpoint
from services.engine.quant.awq import dequantize_awq
from services.engine.quant.compressed_tensors import dequantize_compressed
from services.engine.quant.fp8 import dequantize_fp8
from services.engine.quant.gptq import dequantize_gptq

# The tensor whose presence marks a quantized linear, per format.
_MARKER = {"gptq": ".qweight", "awq": ".qweight", "compressed-tensors": ".weight_packed", "fp8": ".weight_scale_inv"}


@dataclass(frozen=True)
class CheckpointQuant:
    method: str  # gptq | awq | compressed-tensors | fp8
    bits: int
    group_size: int  # inputs per scale (0 or -1: per output channel); fp8: the block's input side
    zero_offset: int = 1  # GPTQ v1 stores zero - 1
    block: tuple[int, int] = (128, 128)  # fp8 weight_block_size

    @property
    def expert_dtype(self) -> str:
        """Our packed form closest to the checkpoint's (what --expert-dtype auto picks)."""
        return "int4" if self.bits <= 4 else "int8"

    @property
    def expert_group_size(self) -> int:
        return nearest_group_size(self.group_size)


def checkpoint_quant(quantization_config: dict | None, names: list[str]) -> CheckpointQuant | None:
    """The quantization a checkpoint declares in config.json (or, for FP8, carries in its tensor names)."""
    qc: dict[str, Any] = dict(quantization_config or {})
    method = str(qc.get("quant_method", "")).lower()
    if not method and any(n.endswith("weight_scale_inv") for n in names):
        method = "fp8"
    if not method:
        return None
    if method in ("gptq", "awq"):
        fmt = str(qc.get("checkpoint_format", "gptq")).lower()
        return CheckpointQuant(method, int(qc.get("bits", qc.get("w_bit", 4))),
                               int(qc.get("group_size", qc.get("q_group_size", 128))),
                               zero_offset=0 if fmt == "gptq_v2" else 1)
    if method == "fp8":
        block = tuple(qc.get("weight_block_size") or (128, 128))
        return CheckpointQuant("fp8", 8, int(block[1]), block=(int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        if qc.get("format") not in (None, "pack-quantized"):
            raise ValueError(f"compressed-tensors format {qc.get('format')!r} is not supported (pack-quantized is)")
        groups: dict[str, dict[str, Any]] = qc.get("config_groups") or {}
        weights = next(iter(groups.values()), {}).get("weights") or {}
        return CheckpointQuant(method, int(weights.get("num_bits", 4)), int(weights.get("group_size") or 0))
    raise ValueError(f"checkpoint quantization {method!r} is not supported: use gptq, awq, compressed-tensors, fp8")


class QuantizedCheckpoint:
    """A Checkpoint whose quantized linears read as dense float `<linear>.weight` tensors."""

    def __init__(self, ckpt: Checkpoint, quant: CheckpointQuant) -> None:
        self.ckpt = ckpt
        self.quant = quant
        self.model_dir = ckpt.model_dir
        marker = _MARKER[quant.method]
        self._linears = {n[: -len(marker)] for n in ckpt.names() if n.endswith(marker)}
        if not self._linears:
            raise ValueError(f"{quant.method} checkpoint {ckpt.model_dir} has no '*{marker}' tensors")

    def __contains__(self, name: str) -> bool:
        return name in self.ckpt or (name.endswith(".weight") and name[: -len(".weight")] in self._linears)

    def names(self) -> list[str]:
        return sorted(set(self.ckpt.names()) | {f"{p}.weight" for p in self._linears})

    def get(self, name: str) -> torch.Tensor:
        prefix = name[: -len(".weight")]
        if not name.endswith(".weight") or prefix not in self._linears:
            return self.ckpt.get(name)
        q = self.quant
        if q.method == "gptq":
            return dequantize_gptq(self._part, self.ckpt.__contains__, prefix, q.bits, q.group_size, q.zero_offset)
        if q.method == "awq":
            return dequantize_awq(self._part, prefix, q.bits, q.group_size)
        if q.method == "compressed-tensors":
            return dequantize_compressed(self._part, self.ckpt.__contains__, prefix, q.bits, q.group_size)
        return dequantize_fp8(self._part, prefix, q.block)

    def dtype(self) -> torch.dtype | None:
        dtype = self.ckpt.dtype()
        return torch.bfloat16 if dtype is None or dtype.itemsize == 1 or not dtype.is_floating_point else dtype

    def close(self) -> None:
        self.ckpt.close()

    def _part(self, name: str) -> torch.Tensor:
        if name not in self.ckpt:
            raise ValueError(f"malformed {self.quant.method} checkpoint {self.model_dir}: tensor {name} is missing")
        return self.ckpt.get(name)


def open_checkpoint(model_dir: str, quantization_config: dict | None) -> Checkpoint | QuantizedCheckpoint:
    ckpt = Checkpoint(model_dir)
    quant = checkpoint_quant(quantization_config, ckpt.names())
    return ckpt if quant is None else QuantizedCheckpoint(ckpt, quant)
