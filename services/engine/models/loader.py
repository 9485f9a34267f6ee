"""Builds a ready-to-run model from a local Hugging Face directory."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from services.engine.expert_provider import ExpertProvider
from services.engine.models.dense_layers import dense_layers
from services.engine.models.model import MoECausalLM
from services.engine.models.native_linear import dense_format
from services.engine.models.resident import load_resident_experts
from services.engine.models.spec import ModelSpec, load_hf_config, rope_inv_freq, spec_from_config
from services.engine.models.weights import WeightReader, load_non_expert_weights
from services.engine.offload.settings import OffloadSettings
from services.engine.offload.setup import build_expert_provider
from services.engine.quant.checkpoint import QuantizedCheckpoint, open_checkpoint
from services.engine.quant.layout import settings_expert_layout


@dataclass
class LoadedModel:
    model: MoECausalLM
    spec: ModelSpec
    hf_config: PretrainedConfig
    reader: WeightReader
    dtype: torch.dtype


def _quantization_config(hf_config: PretrainedConfig) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    return qc if qc is None or isinstance(qc, dict) else qc.to_dict()


def load_model(
    model_dir: str,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    max_len: int | None = None,
    offload: OffloadSettings | None = None,
    weight_dtype: str = "auto",
    weight_group_size: int = 64,
) -> LoadedModel:
    """Non-expert weights go to `device`; the routed experts where `offload` puts them (default: resident, as
    read). weight_dtype: the CPU format of the attention projections and LM head (see native_linear)."""
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
    provider: ExpertProvider
    if offload is None:
        provider = load_resident_experts(reader, spec)
    else:
        quant = ckpt.quant if isinstance(ckpt, QuantizedCheckpoint) else None
        layout = settings_expert_layout(offload.expert_dtype, offload.expert_group_size, spec, torch_dtype,
                                        device, quant)
        provider = build_expert_provider(offload, reader, spec, weights, layout)
    inv_freq, scaling = rope_inv_freq(hf_config)
    model = MoECausalLM(spec, weights, provider, inv_freq, scaling, max_len or spec.max_position_embeddings, dense)
    return LoadedModel(model, spec, hf_config, reader, torch_dtype)
