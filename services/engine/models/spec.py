"""What our model code needs to know about one MoE family, read from its transformers config."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    norm_topk_prob: bool  # renormalise the top-k softmax weights to sum to one
    qkv_bias: bool
    o_bias: bool
    qk_norm: str  # "none" | "head" (per-head RMSNorm, Qwen3) | "full" (over the whole projection, OLMoE)
    clip_qkv: float | None
    shared_expert_intermediate_size: int  # 0: no shared expert
    moe_layers: tuple[bool, ...]  # False: a dense MLP layer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)


def _sparse_layers(cfg: PretrainedConfig) -> tuple[bool, ...]:
    only_mlp = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return tuple(
        (i not in only_mlp) and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)
    )


def _eos_ids(cfg: PretrainedConfig) -> tuple[int, ...]:
    eos = cfg.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def load_hf_config(model_dir: str) -> PretrainedConfig:
    cfg = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    if cfg.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {cfg.model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return cfg


def spec_from_config(cfg: PretrainedConfig) -> ModelSpec:
    mt = cfg.model_type
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if mt == "mixtral":
        num_experts, moe_inter, norm_topk = cfg.num_local_experts, cfg.intermediate_size, True
        moe_layers = (True,) * cfg.num_hidden_layers
    else:
        num_experts = cfg.num_experts
        moe_inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        norm_topk = bool(cfg.norm_topk_prob)
        moe_layers = _sparse_layers(cfg) if mt in ("qwen2_moe", "qwen3_moe") else (True,) * cfg.num_hidden_layers
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return ModelSpec(
        model_type=mt,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        num_experts=num_experts,
        top_k=cfg.num_experts_per_tok,
        moe_intermediate_size=moe_inter,
        dense_intermediate_size=cfg.intermediate_size,
        norm_topk_prob=norm_topk,
        qkv_bias=bool(cfg.qkv_bias) if mt == "qwen2_moe" else attention_bias,
        o_bias=attention_bias if mt in ("olmoe", "qwen3_moe") else False,
        qk_norm={"olmoe": "full", "qwen3_moe": "head"}.get(mt, "none"),
        clip_qkv=getattr(cfg, "clip_qkv", None),
        shared_expert_intermediate_size=(cfg.shared_expert_intermediate_size if mt == "qwen2_moe" else 0),
        moe_layers=moe_layers,
        bos_token_id=cfg.bos_token_id,
        eos_token_ids=_eos_ids(cfg),
    )


def rope_inv_freq(cfg: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and scaling exactly as the family's transformers rotary embedding computes them."""
    import importlib

    module = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    rotary_cls = next(
        getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding")
    )
    rotary = rotary_cls(cfg)
    return rotary.inv_freq.float().clone(), float(rotary.attention_scaling)
