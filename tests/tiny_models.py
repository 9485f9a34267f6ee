"""Tiny random-weight checkpoints of each supported family, saved with transformers (exactness tests only)."""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

VOCAB = 384
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
_TOKENIZER_TEXT = [
    "The quick brown fox jumps over the lazy dog. Mixture of experts models route tokens to experts.",
    "def add(a, b):\n    return a + b\n",
    "héllo wörld ✓ 你好 — naïve café",
] * 20


def _config(family: str):
    if family == "mixtral":
        return MixtralConfig(**COMMON, num_local_experts=8, num_experts_per_tok=2), MixtralForCausalLM
    if family == "qwen2_moe":
        cfg = Qwen2MoeConfig(
            **COMMON,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=80,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        return cfg, Qwen2MoeForCausalLM
    if family == "olmoe":
        return OlmoeConfig(
            **COMMON, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False
        ), OlmoeForCausalLM
    if family == "qwen3_moe":
        cfg = Qwen3MoeConfig(
            **COMMON,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
        )
        return cfg, Qwen3MoeForCausalLM
    if family.startswith("deepseek"):
        return deepseek_config(family)
    raise ValueError(family)


def deepseek_config(family: str, **overrides):
    """A tiny DeepSeek config and its model class: MLA with v_head_dim != qk_head_dim, a dense first layer,
    shared experts, grouped top-k (V3 also a nonzero selection bias, set in build_tiny_model, and yarn rope).

    The groups are set so that grouping changes the choice: V2 ranks groups by their best expert, so its two
    best experts always lie in its two best groups; only one eligible group (of four experts) constrains it.
    """
    kw = dict(
        **COMMON,
        kv_lora_rank=24,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
    )
    kw["num_key_value_heads"] = kw["num_attention_heads"]  # MLA: one key and value per query head
    if family in ("deepseek_v2", "deepseek_v2_lite"):  # V2-Lite has no query compression
        kw.update(
            q_lora_rank=None if family == "deepseek_v2_lite" else 32,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=2,
            topk_group=1,
            routed_scaling_factor=1.5,
        )
        return DeepseekV2Config(**{**kw, **overrides}), DeepseekV2ForCausalLM
    # V3 with yarn rope scaling: attention_factor scales cos/sin, mscale_all_dim the softmax scale.
    yarn = dict(
        rope_type="yarn",
        rope_theta=10000.0,
        factor=4.0,
        original_max_position_embeddings=128,
        mscale=1.0,
        mscale_all_dim=0.8,
        beta_fast=32,
        beta_slow=1,
    )
    kw.update(
        q_lora_rank=32,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters=yarn,
    )
    return DeepseekV3Config(**{**kw, **overrides}), DeepseekV3ForCausalLM


FAMILIES = ("mixtral", "qwen2_moe", "olmoe", "qwen3_moe", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3")


def save_tokenizer(out_dir: str) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<|pad|>", "<|endoftext|>", "<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_TOKENIZER_TEXT, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|end|>", pad_token="<|pad|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_tiny_model(family: str, out_dir: str, seed: int = 0, fused: bool = False, **overrides: object) -> str:
    """Saves a random tiny model of `family`; fused=True writes transformers' in-memory 3-D expert layout;
    overrides: config fields set over the family's tiny ones (e.g. widths the native kernels take)."""
    torch.manual_seed(seed)
    cfg, cls = _config(family)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    model = cls(cfg).eval()
    # Larger router weights make routing decisive, so tiny numeric noise cannot flip top-k choices.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".gate.weight") and p.shape[0] == 8:
                p.mul_(4.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # nonzero, so selection-only use is tested
                b.copy_(0.05 * torch.randn_like(b))
    model.save_pretrained(out_dir)
    if fused:
        os.remove(os.path.join(out_dir, "model.safetensors"))
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(out_dir)
    return out_dir
