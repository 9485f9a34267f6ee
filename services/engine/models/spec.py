"""What our model code needs to know about one MoE family, read from its transformers config."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers import AutoConfig, PretrainedConfig

from services.engine.models.geometry import expert_params

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
DEEPSEEK_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class MlaDims:
    """Multi-head Latent Attention (DeepSeek-V2/V3): every head's key and value come from one per-token latent."""

    q_lora_rank: int | None  # None: queries projected straight from the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int  # the part of each query/key head without position information
    qk_rope_head_dim: int  # the rotary part; its key is shared by all heads
    v_head_dim: int
    rope_interleave: bool  # rotate adjacent pairs (x0, x1), (x2, x3), ... instead of the two halves

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Numbers cached per token and layer: the normalised latent, then the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


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
    softmax_scale: float  # attention logits scale: head_dim ** -0.5, times yarn's mscale**2 for DeepSeek
    router_rule: str = "softmax"  # "softmax" (Mixtral, Qwen, OLMoE) | "deepseek_v2" | "deepseek_v3"
    num_expert_groups: int = 1  # grouped top-k: experts only from the topk_groups best of num_expert_groups
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' weights (DeepSeek)
    mla: MlaDims | None = None  # None: ordinary multi-head attention with grouped KV heads

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def expert_params(self) -> int:
        return expert_params(self.hidden_size, self.moe_intermediate_size)

    @property
    def kv_cache_elems_per_token(self) -> int:
        """Cache entries one token takes over all layers (MLA caches its latent, others K and V per KV head)."""
        if self.mla is not None:
            return self.num_layers * self.mla.latent_width
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _sparse_layers(cfg: PretrainedConfig) -> tuple[bool, ...]:
    only_mlp = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return tuple((i not in only_mlp) and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers))


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
    family = _deepseek_fields(cfg) if cfg.model_type in DEEPSEEK_MODEL_TYPES else _classic_fields(cfg)
    return ModelSpec(
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        top_k=cfg.num_experts_per_tok,
        dense_intermediate_size=cfg.intermediate_size,
        clip_qkv=getattr(cfg, "clip_qkv", None),
        bos_token_id=cfg.bos_token_id,
        eos_token_ids=_eos_ids(cfg),
        **family,
    )


def _classic_fields(cfg: PretrainedConfig) -> dict:
    """Mixtral, Qwen2-MoE, OLMoE, Qwen3-MoE: grouped-KV attention, softmax router."""
    mt = cfg.model_type
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    if mt == "mixtral":
        num_experts, moe_inter, norm_topk = cfg.num_local_experts, cfg.intermediate_size, True
        moe_layers = (True,) * cfg.num_hidden_layers
    else:
        num_experts = cfg.num_experts
        moe_inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        norm_topk = bool(cfg.norm_topk_prob)
        moe_layers = (
            _sparse_layers(cfg) if mt in ("qwen2_moe", "qwen3_moe") else (True,) * cfg.num_hidden_layers
        )
    attention_bias = bool(getattr(cfg, "attention_bias", False))
    return dict(
        num_kv_heads=cfg.num_key_value_heads or cfg.num_attention_heads,
        head_dim=head_dim,
        num_experts=num_experts,
        moe_intermediate_size=moe_inter,
        norm_topk_prob=norm_topk,
        qkv_bias=bool(cfg.qkv_bias) if mt == "qwen2_moe" else attention_bias,
        o_bias=attention_bias if mt in ("olmoe", "qwen3_moe") else False,
        qk_norm={"olmoe": "full", "qwen3_moe": "head"}.get(mt, "none"),
        shared_expert_intermediate_size=(cfg.shared_expert_intermediate_size if mt == "qwen2_moe" else 0),
        moe_layers=moe_layers,
        softmax_scale=head_dim**-0.5,
    )


def _deepseek_fields(cfg: PretrainedConfig) -> dict:
    """DeepSeek-V2/V3: MLA attention, dense first layers, shared experts, (grouped) top-k with scaling."""
    v3 = cfg.model_type == "deepseek_v3"
    mla = MlaDims(
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_interleave=bool(cfg.rope_interleave) if v3 else True,  # V2's complex-number rope pairs dims
    )
    if v3:
        groups, topk_groups = cfg.n_group or 1, cfg.topk_group or 1
    elif cfg.topk_method == "group_limited_greedy":
        groups, topk_groups = cfg.n_group, cfg.topk_group
    elif cfg.topk_method == "greedy":
        groups, topk_groups = 1, 1
    else:
        raise ValueError(f"unsupported DeepSeek-V2 topk_method {cfg.topk_method!r}")
    # Released checkpoints all use moe_layer_freq 1, which transformers assumes; other values follow DeepSeek.
    first_moe, freq = cfg.first_k_dense_replace or 0, getattr(cfg, "moe_layer_freq", 1) or 1
    return dict(
        num_kv_heads=cfg.num_attention_heads,  # MLA expands the latent into one key and value per query head
        head_dim=mla.qk_head_dim,
        num_experts=cfg.n_routed_experts,
        moe_intermediate_size=cfg.moe_intermediate_size,
        norm_topk_prob=v3 and bool(cfg.norm_topk_prob),  # transformers' V2 router never renormalises
        qkv_bias=bool(cfg.attention_bias),
        o_bias=bool(cfg.attention_bias),
        qk_norm="none",
        shared_expert_intermediate_size=cfg.moe_intermediate_size * (cfg.n_shared_experts or 0),
        moe_layers=tuple(i >= first_moe and i % freq == 0 for i in range(cfg.num_hidden_layers)),
        softmax_scale=_yarn_mscale_squared(cfg.rope_parameters) * mla.qk_head_dim**-0.5,
        router_rule=cfg.model_type,
        num_expert_groups=groups,
        topk_groups=topk_groups,
        routed_scaling_factor=float(cfg.routed_scaling_factor),
        mla=mla,
    )


def _yarn_mscale_squared(rope: dict) -> float:
    """DeepSeek scales attention logits by yarn's mscale(factor, mscale_all_dim) twice (once per q and k)."""
    mscale_all_dim = rope.get("mscale_all_dim", 0)
    if rope.get("rope_type", "default") == "default" or not mscale_all_dim or rope["factor"] <= 1:
        return 1.0
    mscale = 0.1 * mscale_all_dim * math.log(rope["factor"]) + 1.0
    return mscale * mscale


# Families whose rotary embedding is the original RoPE over head_dim (or hidden / heads) at rope_type "default",
# else transformers' ROPE_INIT_FUNCTIONS: computed here, not by importing the family's modeling module (1.7 s
# and 127 MB of resident interpreter: ~1500 modules, scipy and dynamo among them, a tenth of an int4
# Qwen3-shape model's peak RSS).
PLAIN_ROPE_FAMILIES = frozenset({"mixtral", "qwen2_moe", "qwen3_moe", "olmoe"})


def rope_inv_freq(cfg: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and scaling exactly as the family's transformers rotary embedding computes them."""
    if cfg.model_type in PLAIN_ROPE_FAMILIES:
        rope = cfg.rope_parameters
        if rope.get("rope_type", "default") != "default":  # what their rotary embedding calls then
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg)
            return inv_freq.float().clone(), float(scaling)
        dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    import importlib

    module = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    rotary_cls = next(getattr(module, name) for name in dir(module) if name.endswith("RotaryEmbedding"))
    rotary = rotary_cls(cfg)
    return rotary.inv_freq.float().clone(), float(rotary.attention_scaling)
