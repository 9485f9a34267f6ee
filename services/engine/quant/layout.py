"""One expert's packed weights in one flat byte buffer (host store, transfer chunks, device cache slot)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.expert_format import EXPERT_DTYPES, ExpertLayout
from services.engine.expert_provider import ExpertWeights
from services.engine.models.geometry import ExpertGeometry
from services.engine.quant.checkpoint import CheckpointQuant
from services.engine.quant.packed import PackedMatrix, QuantizedExpertWeights, QuantScheme, pack_matrix

_ALIGN = 64  # bytes: every piece (and every slot) starts on a cache line, so typed views are aligned


@dataclass(frozen=True)
class _Piece:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class QuantizedExpertLayout:
    """Where each packed matrix's weights and scales live inside one uint8 expert buffer."""

    dtype = torch.uint8

    def __init__(self, hidden: int, intermediate: int, scheme: QuantScheme, device: torch.device | str) -> None:
        self.scheme = scheme
        self.device = torch.device(device)
        self.shapes = {"gate_up": (2 * intermediate, hidden), "down": (hidden, intermediate)}
        self.pieces: dict[str, tuple[_Piece, _Piece | None]] = {}
        offset = 0
        for name, shape in self.shapes.items():
            probe = pack_matrix(torch.zeros(shape), scheme, self.device)  # the kernel layout's real shapes
            parts: list[_Piece | None] = []
            for t in (probe.qweight, probe.scales):
                if t is None:  # CPU int4: its scales lie among its nibbles
                    parts.append(None)
                    continue
                nbytes = t.numel() * t.element_size()
                parts.append(_Piece(offset, nbytes, t.dtype, tuple(t.shape)))
                offset = _aligned(offset + nbytes)
            assert parts[0] is not None  # every layout has its weights
            self.pieces[name] = (parts[0], parts[1])
            if name == "gate_up":
                self.gate_up_numel = offset
        self.numel = offset

    @property
    def nbytes(self) -> int:
        return self.numel  # uint8

    def pack(self, w: ExpertWeights, flat: torch.Tensor) -> None:
        """Quantizes a float expert into `flat` (which may live on the host)."""
        for name, matrix in (("gate_up", w.gate_up), ("down", w.down)):
            qweight, scales = self.pieces[name]
            # On the host, packed straight into its piece (no copy); a device layout is made, then copied.
            into = qweight.view(flat) if self.device.type == "cpu" and flat.device.type == "cpu" else None
            packed = pack_matrix(matrix, self.scheme, self.device, into)
            if into is None:
                qweight.view(flat).copy_(packed.qweight)
            if scales is not None and packed.scales is not None:
                scales.view(flat).copy_(packed.scales)

    def views(self, flat: torch.Tensor) -> QuantizedExpertWeights:
        gate_up, down = (self._matrix(name, flat) for name in ("gate_up", "down"))
        return QuantizedExpertWeights(gate_up, down)

    def chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[: self.gate_up_numel], flat[self.gate_up_numel :]]

    def _matrix(self, name: str, flat: torch.Tensor) -> PackedMatrix:
        qweight, scales = self.pieces[name]
        return PackedMatrix(self.scheme.bits, self.scheme.group_size, self.shapes[name], qweight.view(flat),
                            None if scales is None else scales.view(flat), on_cpu=self.device.type == "cpu")


StoredLayout = ExpertLayout | QuantizedExpertLayout  # one expert's flat buffer, dense or packed


def converts(layout: StoredLayout | None, run_dtype: torch.dtype) -> bool:
    """Whether `layout` keeps experts in another form than the run dtype: they may be read as stored."""
    return layout is not None and (not isinstance(layout, ExpertLayout) or layout.dtype != run_dtype)


def expert_layout(
    hidden: int, intermediate: int, expert_dtype: str, group_size: int, run_dtype: torch.dtype,
    device: torch.device | str,
) -> StoredLayout:
    """The layout every copy of an expert uses: dense in the run dtype (auto) or bf16, or packed int8/int4."""
    if expert_dtype not in EXPERT_DTYPES:
        raise ValueError(f"unknown expert dtype {expert_dtype!r}: use {', '.join(EXPERT_DTYPES)}")
    if expert_dtype == "auto":
        return ExpertLayout(hidden, intermediate, run_dtype)
    if expert_dtype == "bf16":
        return ExpertLayout(hidden, intermediate, torch.bfloat16)
    return QuantizedExpertLayout(hidden, intermediate, QuantScheme(int(expert_dtype[3:]), group_size), device)


def settings_expert_layout(
    expert_dtype: str, group_size: int, geometry: ExpertGeometry, run_dtype: torch.dtype, device: str,
    quant: CheckpointQuant | None = None,
) -> StoredLayout:
    """The layout --expert-dtype / --expert-group-size ask for; `auto` on a quantized checkpoint (`quant`)
    keeps its bit width (int4 for GPTQ/AWQ/int4 compressed-tensors, int8 for FP8) and group size."""
    if expert_dtype == "auto" and quant is not None:
        expert_dtype, group_size = quant.expert_dtype, quant.expert_group_size
    return expert_layout(geometry.hidden_size, geometry.moe_intermediate_size, expert_dtype, group_size,
                         run_dtype, device)
