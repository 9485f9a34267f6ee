"""Every routed expert resident on the device: as read, or packed into the layout --expert-dtype asks for."""

from __future__ import annotations

import torch
from tqdm import tqdm

from services.engine.expert_format import ExpertLayout
from services.engine.expert_provider import ExpertWeights, ResidentExpertProvider
from services.engine.host_allocator import huge_page_empty
from services.engine.models.fused_moe import StackedExperts, grouped_mm_supported, stackable
from services.engine.models.geometry import expert_bytes, total_experts
from services.engine.models.native_moe import NativeExperts
from services.engine.models.packed_linear import should_pack
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import WeightReader, expert_loader, read_ahead
from services.engine.quant.layout import StoredLayout, converts
from services.engine.quant.packed import QuantizedExpertWeights

# Resident routed experts are prepacked for oneDNN (a second copy) only up to this many bytes in all: the demo
# and test models gain 1.7-3x on their MoE GEMMs; a real checkpoint on the CPU should not double its memory.
PACK_EXPERTS_MAX_BYTES = 1 << 30
# fp32 experts the native kernels run are also stacked and prepacked for oneDNN up to this many bytes in all
# (two more copies): the native fp32 tiles compute at about two thirds of oneDNN's packed GEMM, so a long
# prompt's experts go there (model.py: PACKED_MIN_TOKENS) and decode steps stay native. The demo model's
# 256-token prefill: 52-54 ms native, 40-45 with its experts packed (Zen 4 guest).
PREFILL_PACK_MAX_BYTES = 256 << 20


def load_resident_experts(
    reader: WeightReader,
    spec: ModelSpec,
    layout: StoredLayout | None = None,
    fused: bool = True,
) -> ResidentExpertProvider:
    """Every expert on the device, as read or (with a quantized `layout`) packed; on the CPU into one buffer a
    layer (_layer_buffer). On the CPU with the native kernels built, each layer runs in one native call on the
    experts as they are; else dense experts are stacked for the fused MoE path (the per-expert weights become
    views: one copy either way)."""
    experts: list[list[ExpertWeights | QuantizedExpertWeights] | None] = []
    stacks: list[StackedExperts | None] = []
    natives: list[NativeExperts | None] = []
    all_bytes = expert_bytes(spec, reader.dtype) * total_experts(spec)
    small = all_bytes <= PACK_EXPERTS_MAX_BYTES
    packed_for_prefill = all_bytes <= PREFILL_PACK_MAX_BYTES and should_pack(str(reader.device), torch.float32)
    # No layout: experts dense in the dtype read (on the CPU copied into a layer buffer too, for its huge pages).
    layout = layout or ExpertLayout(spec.hidden_size, spec.moe_intermediate_size, reader.dtype)
    for layer in tqdm(range(spec.num_layers), desc="loading experts", unit="layer", leave=False, disable=None):
        if not spec.moe_layers[layer]:
            experts.append(None)
            stacks.append(None)
            natives.append(None)
            continue
        packed = _layer_buffer(layout, spec.num_experts, reader.device)
        # Into a layer buffer, each expert is packed (and converted) as soon as it is read: read as stored, into
        # buffers the reads reuse (weights.read_ahead).
        transient = packed is not None
        load = expert_loader(reader, spec, layer, as_stored=transient or converts(layout, reader.dtype),
                             transient=transient)
        layer_experts = [_place(w, layout, reader.device, packed, e)
                         for e, w in enumerate(read_ahead(load, spec.num_experts, reader.device))]
        stacked = None
        native = NativeExperts.build(layer_experts) if fused and str(reader.device) == "cpu" else None
        natives.append(native)
        if (fused and stackable(layer_experts) and grouped_mm_supported(reader.device, layer_experts[0].gate_up.dtype)
                and (native is None or (packed_for_prefill and layer_experts[0].gate_up.dtype == torch.float32))):
            pack = small and should_pack(str(reader.device), layer_experts[0].gate_up.dtype)
            stacked = StackedExperts.stack(layer_experts, pack)
            layer_experts = [stacked.expert(e) for e in range(spec.num_experts)]
        experts.append(layer_experts)
        stacks.append(stacked)
    return ResidentExpertProvider(experts, stacks, natives)


def _layer_buffer(layout: StoredLayout, experts: int, device: torch.device | str) -> torch.Tensor | None:
    """One buffer for a layer's packed experts, on huge pages on the CPU (host_allocator.huge_page_empty),
    which one expert's (an int4 Qwen3 expert is 2.8 MB, mostly carved from memory the load already touched)
    was not; the layer's experts then stream without a page walk every 4 KB."""
    if torch.device(device).type == "cpu":
        return huge_page_empty((experts, layout.numel), layout.dtype)
    if isinstance(layout, ExpertLayout):
        return None  # experts kept as read (a dense layout of another dtype converts expert by expert)
    return torch.empty(experts, layout.numel, dtype=layout.dtype, device=device)


def _place(
    w: ExpertWeights, layout: StoredLayout, device: torch.device | str, packed: torch.Tensor | None = None,
    index: int = 0,
) -> ExpertWeights | QuantizedExpertWeights:
    if packed is None and isinstance(layout, ExpertLayout) and layout.dtype == w.gate_up.dtype:
        return w  # already in the form the layout asks for: no copy
    flat = packed[index] if packed is not None else torch.empty(layout.numel, dtype=layout.dtype, device=device)
    layout.pack(w, flat)
    return layout.views(flat)
