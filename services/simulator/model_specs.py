"""Real-size MoE models as the simulator sees them: parameter counts and bytes, from each model's config.

Sizes are in bytes and decimal GB (1e9), as the papers we calibrate against count them. Quantised weights
carry their scales and zero points in `Precision.bits`; embeddings, the LM head, routers and norms stay
fp16, as AWQ/GPTQ checkpoints keep them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.engine.expert_format import bits_per_parameter
from services.engine.models.geometry import expert_params


@dataclass(frozen=True)
class Precision:
    name: str
    bits: float  # stored bits per parameter, quantisation scales and zero points included


FP16 = Precision("fp16", 16.0)
FP32 = Precision("fp32", 32.0)
# AWQ / GPTQ 4-bit with group size 128: one fp16 scale and one packed 4-bit zero point per 128 weights.
INT4_G128 = Precision("4-bit g128", 4.0 + (16 + 4) / 128)
# llama.cpp Q4_K_M: Q4_K (4.5 bits) for most matrices, Q6_K (6.56) for some down projections: about 4.85 on average.
Q4_K_M = Precision("Q4_K_M", 4.85)
# gpt-oss MXFP4: 4-bit values with one 8-bit scale per 32.
MXFP4 = Precision("MXFP4", 4.0 + 8 / 32)


def engine_expert_precision(expert_dtype: str, group_size: int, hidden: int, intermediate: int) -> Precision:
    """The bits per expert parameter of our engine's `--expert-dtype` (services/engine/expert_format.py)."""
    name = {"bf16": "bf16", "int4": f"int4 g{group_size}", "int8": "int8 per row"}.get(expert_dtype, expert_dtype)
    return Precision(name, bits_per_parameter(expert_dtype, group_size, hidden, intermediate))


def gqa_attention(
    hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool = False, o_bias: bool = False
) -> tuple[int, int]:
    """(parameters, KV-cache numbers per token) of one grouped-query attention layer."""
    q, kv = heads * head_dim, kv_heads * head_dim
    params = hidden * (q + 2 * kv) + q * hidden
    params += (q + 2 * kv) * qkv_bias + hidden * o_bias
    return params, 2 * kv


def mla_attention(
    hidden: int,
    heads: int,
    kv_lora_rank: int,
    nope_dim: int,
    rope_dim: int,
    v_dim: int,
    q_lora_rank: int | None = None,
) -> tuple[int, int]:
    """(parameters, KV-cache numbers per token) of one DeepSeek multi-head latent attention layer; the cache
    holds the compressed latent and the shared rotary key, as vLLM stores it."""
    qk = nope_dim + rope_dim
    q = (
        hidden * heads * qk
        if q_lora_rank is None
        else hidden * q_lora_rank + q_lora_rank + q_lora_rank * heads * qk
    )
    kv = hidden * (kv_lora_rank + rope_dim) + kv_lora_rank + kv_lora_rank * heads * (nope_dim + v_dim)
    return q + kv + heads * v_dim * hidden, kv_lora_rank + rope_dim


def _bytes(params: int, precision: Precision) -> int:
    return math.ceil(params * precision.bits / 8)


@dataclass(frozen=True)
class MoEModelSpec:
    name: str
    description: str
    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    vocab_size: int
    attention: tuple[int, int]  # (parameters per layer, KV-cache numbers per token and layer)
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of experts (DeepSeek's first)
    dense_intermediate_size: int = 0
    shared_intermediate_size: int = 0  # the always-on shared expert(s) of each MoE layer, widths summed
    tie_word_embeddings: bool = False
    expert_precision: Precision = FP16
    linear_precision: Precision = FP16  # attention, shared experts and dense MLPs
    base_precision: Precision = FP16  # embeddings, LM head, norms, routers
    kv_bytes_per_number: int = 2

    # ---- shape: ExpertGeometry (services/engine/models/geometry.py), as the engine's ModelSpec ----
    @property
    def moe_layers(self) -> tuple[bool, ...]:
        return tuple(i not in self.dense_layers for i in range(self.num_layers))

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - len(self.dense_layers)

    # ---- experts ----
    @property
    def expert_params(self) -> int:
        return expert_params(self.hidden_size, self.moe_intermediate_size)

    @property
    def expert_chunk_bytes(self) -> tuple[int, int]:
        """The two chunks one transfer moves, as the engine's ExpertLayout splits it: gate/up, then down."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return _bytes(2 * h * i, self.expert_precision), _bytes(h * i, self.expert_precision)

    @property
    def expert_bytes(self) -> int:
        return sum(self.expert_chunk_bytes)

    @property
    def all_experts_bytes(self) -> int:
        return self.expert_bytes * self.num_experts * self.num_moe_layers

    # ---- everything else ----
    def layer_linear_params(self, layer: int) -> int:
        """Quantisable weights of one layer outside the routed experts."""
        h = self.hidden_size
        mlp = (
            3
            * h
            * (self.dense_intermediate_size if layer in self.dense_layers else self.shared_intermediate_size)
        )
        return self.attention[0] + mlp

    def layer_fp16_params(self, layer: int) -> int:
        """Norms and the router: kept in fp16 by quantised checkpoints."""
        router = 0 if layer in self.dense_layers else self.hidden_size * self.num_experts
        return 2 * self.hidden_size + router

    def layer_non_expert_bytes(self, layer: int) -> int:
        return _bytes(self.layer_linear_params(layer), self.linear_precision) + _bytes(
            self.layer_fp16_params(layer), self.base_precision
        )

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_bytes(self) -> int:
        """The LM head (the embedding matrix itself when tied) and the final norm, read once per step."""
        return _bytes(self.embedding_params + self.hidden_size, self.base_precision)

    @property
    def non_expert_bytes(self) -> int:
        embed = 0 if self.tie_word_embeddings else _bytes(self.embedding_params, self.base_precision)
        return embed + self.head_bytes + sum(self.layer_non_expert_bytes(i) for i in range(self.num_layers))

    @property
    def non_expert_params(self) -> int:
        layers = sum(self.layer_linear_params(i) + self.layer_fp16_params(i) for i in range(self.num_layers))
        return self.embedding_params * (1 if self.tie_word_embeddings else 2) + self.hidden_size + layers

    @property
    def total_params(self) -> int:
        return self.non_expert_params + self.expert_params * self.num_experts * self.num_moe_layers

    @property
    def active_params(self) -> int:
        return self.non_expert_params + self.expert_params * self.top_k * self.num_moe_layers

    @property
    def total_bytes(self) -> int:
        return self.non_expert_bytes + self.all_experts_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache of one token in one layer."""
        return self.attention[1] * self.kv_bytes_per_number


def _mixtral(
    name: str,
    description: str,
    hidden: int,
    layers: int,
    inter: int,
    vocab: int,
    heads: int,
    precision: Precision,
) -> MoEModelSpec:
    return MoEModelSpec(
        name,
        description,
        hidden_size=hidden,
        num_layers=layers,
        num_experts=8,
        top_k=2,
        moe_intermediate_size=inter,
        vocab_size=vocab,
        attention=gqa_attention(hidden, heads, 8, 128),
        expert_precision=precision,
        linear_precision=precision,
    )


def _deepseek(name: str, description: str, num_layers: int, attention: tuple[int, int]) -> MoEModelSpec:
    """DeepSeek's small MoE family: layer 0 dense, 64 experts top-6 + 2 shared."""
    return MoEModelSpec(name, description, num_layers=num_layers, attention=attention, hidden_size=2048,
                        num_experts=64, top_k=6, moe_intermediate_size=1408, vocab_size=102400, dense_layers=(0,),
                        dense_intermediate_size=10944, shared_intermediate_size=2 * 1408)

# fmt: off
MODEL_SPECS: dict[str, MoEModelSpec] = {s.name: s for s in (
    _mixtral("mixtral-8x7b", "Mixtral-8x7B-Instruct-v0.1, fp16", 4096, 32, 14336, 32000, 32, FP16),
    _mixtral("mixtral-8x7b-4bit", "Mixtral-8x7B, AWQ 4-bit g128 (DuoServe's setting)", 4096, 32, 14336, 32000, 32,
             INT4_G128),
    _mixtral("mixtral-8x22b", "Mixtral-8x22B-Instruct-v0.1, fp16", 6144, 56, 16384, 32768, 48, FP16),
    _mixtral("mixtral-8x22b-4bit", "Mixtral-8x22B, AWQ 4-bit g128", 6144, 56, 16384, 32768, 48, INT4_G128),
    MoEModelSpec("qwen1.5-moe-a2.7b", "Qwen1.5-MoE-A2.7B, fp16: 60 experts top-4 + a 5632-wide shared expert",
                 hidden_size=2048, num_layers=24, num_experts=60, top_k=4, moe_intermediate_size=1408,
                 vocab_size=151936, attention=gqa_attention(2048, 16, 16, 128, qkv_bias=True),
                 shared_intermediate_size=5632),
    _deepseek("deepseek-v2-lite", "DeepSeek-V2-Lite, fp16: MLA, layer 0 dense, 64 experts top-6 + 2 shared",
              27, mla_attention(2048, 16, 512, 128, 64, 128)),
    _deepseek("deepseek-moe-16b", "DeepSeek-MoE-16B (ProMoE's DS-1), fp16: layer 0 dense, 64 experts top-6 + 2 "
              "shared", 28, gqa_attention(2048, 16, 16, 128)),
    MoEModelSpec("qwen3-30b-a3b", "Qwen3-30B-A3B, fp16: 128 experts top-8", hidden_size=2048, num_layers=48,
                 num_experts=128, top_k=8, moe_intermediate_size=768, vocab_size=151936,
                 attention=gqa_attention(2048, 32, 4, 128)),
    MoEModelSpec("qwen3-30b-a3b-q4", "Qwen3-30B-A3B, llama.cpp Q4_K_M (embeddings fp16 here)", hidden_size=2048,
                 num_layers=48, num_experts=128, top_k=8, moe_intermediate_size=768, vocab_size=151936,
                 attention=gqa_attention(2048, 32, 4, 128), expert_precision=Q4_K_M, linear_precision=Q4_K_M),
    MoEModelSpec("gpt-oss-20b", "gpt-oss-20b: 32 experts top-4 in MXFP4, attention bf16", hidden_size=2880,
                 num_layers=24, num_experts=32, top_k=4, moe_intermediate_size=2880, vocab_size=201088,
                 attention=gqa_attention(2880, 64, 8, 64, qkv_bias=True, o_bias=True), expert_precision=MXFP4),
    MoEModelSpec("phi-3.5-moe", "Phi-3.5-MoE-instruct, fp16: 16 experts top-2", hidden_size=4096, num_layers=32,
                 num_experts=16, top_k=2, moe_intermediate_size=6400, vocab_size=32064,
                 attention=gqa_attention(4096, 32, 8, 128, qkv_bias=True, o_bias=True)),
)}
# fmt: on


def spec_from_model_dir(model_dir: str, precision: Precision = FP32) -> MoEModelSpec:
    """A checkpoint our engine loads (e.g. the demo model), at the precision the engine runs it in (fp32 on CPU)."""
    from services.engine.models.spec import load_hf_config, spec_from_config

    s = spec_from_config(load_hf_config(model_dir))
    attention = gqa_attention(s.hidden_size, s.num_heads, s.num_kv_heads, s.head_dim, s.qkv_bias, s.o_bias)
    return MoEModelSpec(
        name=model_dir,
        description=f"{s.model_type} checkpoint at {model_dir}, {precision.name}",
        hidden_size=s.hidden_size,
        num_layers=s.num_layers,
        num_experts=s.num_experts,
        top_k=s.top_k,
        moe_intermediate_size=s.moe_intermediate_size,
        vocab_size=s.vocab_size,
        attention=attention,
        dense_layers=tuple(i for i, moe in enumerate(s.moe_layers) if not moe),
        dense_intermediate_size=s.dense_intermediate_size,
        shared_intermediate_size=s.shared_expert_intermediate_size,
        tie_word_embeddings=s.tie_word_embeddings,
        expert_precision=precision,
        linear_precision=precision,
        base_precision=precision,
        kv_bytes_per_number=math.ceil(precision.bits / 8),
    )


def get_model_spec(name: str) -> MoEModelSpec:
    """A registered spec by name, or a model directory with a config.json."""
    import os

    if name in MODEL_SPECS:
        return MODEL_SPECS[name]
    if os.path.isfile(os.path.join(name, "config.json")):
        return spec_from_model_dir(name)
    raise ValueError(
        f"unknown model spec {name!r}; choose from: {', '.join(MODEL_SPECS)} (or a model directory)"
    )
