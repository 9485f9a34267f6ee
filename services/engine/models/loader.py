"""Builds a ready-to-run model from a local Hugging Face directory."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import PretrainedConfig

from services.engine.expert_format import ExpertLayout
from services.engine.expert_provider import ExpertProvider, ExpertWeights, ResidentExpertProvider
from services.engine.models.dense_layers import dense_layers
from services.engine.models.fused_moe import StackedExperts, grouped_mm_supported, stackable
from services.engine.models.geometry import expert_bytes, total_experts
from services.engine.models.model import MoECausalLM
from services.engine.models.native_linear import dense_format
from services.engine.models.native_moe import NativeExperts
from services.engine.models.packed_linear import should_pack
from services.engine.models.spec import ModelSpec, load_hf_config, rope_inv_freq, spec_from_config
from services.engine.models.weights import (
    NonExpertWeights,
    WeightReader,
    expert_loader,
    load_non_expert_weights,
)
from services.engine.quant.checkpoint import open_checkpoint
from services.engine.quant.layout import StoredLayout
from services.engine.quant.packed import QuantizedExpertWeights

# Resident routed experts are prepacked for oneDNN (a second copy) only up to this many bytes in all: the demo
# and test models gain 1.7-3x on their MoE GEMMs; a real checkpoint on the CPU should not double its memory.
PACK_EXPERTS_MAX_BYTES = 1 << 30

ProviderFactory = Callable[[WeightReader, ModelSpec, NonExpertWeights], ExpertProvider]


@dataclass
class LoadedModel:
    model: MoECausalLM
    spec: ModelSpec
    hf_config: PretrainedConfig
    reader: WeightReader
    dtype: torch.dtype


def load_resident_experts(
    reader: WeightReader,
    spec: ModelSpec,
    layout: StoredLayout | None = None,
    fused: bool = True,
) -> ResidentExpertProvider:
    """Every expert on the device, as read or (with a quantized `layout`) packed into one buffer each. On the
    CPU with the native kernels built, each layer runs in one native call on the experts as they are; else
    dense experts are stacked for the fused MoE path (the per-expert weights become views: one copy either way)."""
    experts: list[list[ExpertWeights | QuantizedExpertWeights] | None] = []
    stacks: list[StackedExperts | None] = []
    natives: list[NativeExperts | None] = []
    small = expert_bytes(spec, reader.dtype) * total_experts(spec) <= PACK_EXPERTS_MAX_BYTES
    for layer in tqdm(range(spec.num_layers), desc="loading experts", unit="layer", leave=False, disable=None):
        if not spec.moe_layers[layer]:
            experts.append(None)
            stacks.append(None)
            natives.append(None)
            continue
        load = expert_loader(reader, spec, layer)
        layer_experts = [_place(load(e, reader.device), layout, reader.device) for e in range(spec.num_experts)]
        stacked = None
        native = NativeExperts.build(layer_experts) if fused and str(reader.device) == "cpu" else None
        natives.append(native)
        if native is None and fused and stackable(layer_experts) and grouped_mm_supported(reader.device, layer_experts[0].gate_up.dtype):
            pack = small and should_pack(str(reader.device), layer_experts[0].gate_up.dtype)
            stacked = StackedExperts.stack(layer_experts, pack)  # type: ignore[arg-type]
            layer_experts = [stacked.expert(e) for e in range(spec.num_experts)]
        experts.append(layer_experts)
        stacks.append(stacked)
    return ResidentExpertProvider(experts, stacks, natives)  # type: ignore[arg-type]


def _place(
    w: ExpertWeights, layout: StoredLayout | None, device: torch.device | str
) -> ExpertWeights | QuantizedExpertWeights:
    if layout is None or (isinstance(layout, ExpertLayout) and layout.dtype == w.gate_up.dtype):
        return w  # already in the form the layout asks for: no copy
    flat = torch.empty(layout.numel, dtype=layout.dtype, device=device)
    layout.pack(w, flat)
    return layout.views(flat)


def _quantization_config(hf_config: PretrainedConfig) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    return qc if qc is None or isinstance(qc, dict) else qc.to_dict()


def load_model(
    model_dir: str,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    max_len: int | None = None,
    make_provider: ProviderFactory | None = None,
    weight_dtype: str = "auto",
    weight_group_size: int = 64,
) -> LoadedModel:
    """Non-expert weights go to `device`; experts come from `make_provider`'s provider (default: resident).
    weight_dtype: the CPU format of the attention projections and LM head (see native_linear)."""
    hf_config = load_hf_config(model_dir)
    spec = spec_from_config(hf_config)
    ckpt = open_checkpoint(model_dir, _quantization_config(hf_config))
    if isinstance(dtype, torch.dtype):
        torch_dtype = dtype
    elif dtype == "auto":
        torch_dtype = torch.float32 if device == "cpu" else (ckpt.dtype() or torch.float32)
    else:
        torch_dtype = getattr(torch, dtype)
    reader = WeightReader(ckpt, torch_dtype, device)
    weights = load_non_expert_weights(reader, spec)
    dense = dense_layers(weights, dense_format(weight_dtype, torch_dtype) if device == "cpu" else None,
                         weight_group_size)
    provider = (make_provider or (lambda r, s, _w: load_resident_experts(r, s)))(reader, spec, weights)
    inv_freq, scaling = rope_inv_freq(hf_config)
    model = MoECausalLM(spec, weights, provider, inv_freq, scaling, max_len or spec.max_position_embeddings, dense)
    return LoadedModel(model, spec, hf_config, reader, torch_dtype)
