"""Random-weight checkpoints at real MoE families' per-layer shapes: what speed is measured on.

The demo model's 0.5 MB experts sit in L2; real decode streams 9-350 MB experts from DRAM. This writes a Hugging
Face folder at the real shapes of Qwen3-30B-A3B, Mixtral-8x7B or DeepSeek-V2-Lite (fewer layers, the demo
tokenizer's vocabulary) that our loader, `transformers` and llama.cpp's convert_hf_to_gguf.py all read: the
released config.json keys and per-expert tensor names, bf16 safetensors written one 1 GiB shard at a time (RAM
holds about two shards, never the model). Weights are N(0, 1/fan_in) so every projection keeps its input's scale and the
activations stay finite at any depth; the special tokens' LM-head rows are zero, so their logits (0) lose to
some ordinary token's and greedy decoding runs to max_tokens.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer

from .tokenizer import (
    BOS_TOKEN,
    END_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    save_tokenizer,
    token_id,
    train_tokenizer,
)

TOKENIZER_CORPUS_BYTES = 2_000_000  # stdlib text the BPE tokenizer learns from: about a second
BUILD_FILE = "random_model_build.json"
SHARD_BYTES = 1 << 30  # a shard is built in memory, then serialised into one more buffer of its size

# The released config.json of each family (its keys, so every reader takes it as it takes the real one),
# without the vocabulary, token ids and layer count, which the build sets.
SHAPES: dict[str, dict] = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "max_position_embeddings": 40960, "attention_bias": False,
        "tie_word_embeddings": False, "hidden_act": "silu", "use_sliding_window": False,
    },
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "tie_word_embeddings": False, "hidden_act": "silu", "sliding_window": None,
    },
    "deepseek-v2-lite": {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "hidden_size": 2048,
        "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 512, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "topk_method": "greedy",
        "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0, "norm_topk_prob": False,
        "scoring_func": "softmax", "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 163840,
        "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                         "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        "attention_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
    },
}
_EXPERT_COUNT_KEY = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "deepseek_v2": "n_routed_experts"}


def shape_config(shape: str, layers: int, vocab_size: int, experts: int | None = None) -> dict:
    """config.json for `shape` with `layers` layers and `vocab_size` tokens (`experts`: fewer, for tests)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose from: {', '.join(SHAPES)}")
    if layers < 1:
        raise ValueError(f"--layers must be at least 1, got {layers}")
    cfg = {**SHAPES[shape], "num_hidden_layers": layers, "vocab_size": vocab_size, "torch_dtype": "bfloat16"}
    if experts is not None:
        if experts < cfg["num_experts_per_tok"]:
            raise ValueError(f"--experts must be at least the shape's top-k ({cfg['num_experts_per_tok']})")
        cfg[_EXPERT_COUNT_KEY[cfg["model_type"]]] = experts
    return cfg


def _linear(out_features: int, in_features: int, gen: torch.Generator) -> torch.Tensor:
    """N(0, 1/in): the output keeps the input's scale (drawn in fp32, stored bf16 like the real checkpoints)."""
    w = torch.randn(out_features, in_features, generator=gen)
    return w.mul_(1.0 / math.sqrt(in_features)).to(torch.bfloat16)


Tensors = Iterator[tuple[str, torch.Tensor]]  # drawn one at a time: a shard holds what is written next


def _ones(name: str, n: int) -> Tensors:
    yield name, torch.ones(n, dtype=torch.bfloat16)


def _linears(gen: torch.Generator, *specs: tuple[str, int, int]) -> Tensors:
    for name, out_features, in_features in specs:
        yield name, _linear(out_features, in_features, gen)


def _mlp(prefix: str, hidden: int, inter: int, names: tuple[str, str, str], gen: torch.Generator) -> Tensors:
    gate, up, down = names
    yield from _linears(gen, (f"{prefix}.{gate}.weight", inter, hidden), (f"{prefix}.{up}.weight", inter, hidden),
                        (f"{prefix}.{down}.weight", hidden, inter))


def _attention(cfg: dict, p: str, gen: torch.Generator) -> Tensors:
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg["model_type"] == "deepseek_v2":  # MLA, no query compression (V2-Lite's q_lora_rank is None)
        rank, rope, nope, v = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        yield from _linears(gen, (f"{p}.q_proj.weight", heads * (nope + rope), hidden),
                            (f"{p}.kv_a_proj_with_mqa.weight", rank + rope, hidden))
        yield from _ones(f"{p}.kv_a_layernorm.weight", rank)
        yield from _linears(gen, (f"{p}.kv_b_proj.weight", heads * (nope + v), rank),
                            (f"{p}.o_proj.weight", hidden, heads * v))
        return
    head_dim = cfg.get("head_dim") or hidden // heads
    q, kv = heads * head_dim, cfg["num_key_value_heads"] * head_dim
    yield from _linears(gen, (f"{p}.q_proj.weight", q, hidden), (f"{p}.k_proj.weight", kv, hidden),
                        (f"{p}.v_proj.weight", kv, hidden), (f"{p}.o_proj.weight", hidden, q))
    if cfg["model_type"] == "qwen3_moe":  # per-head RMSNorm of queries and keys
        yield from _ones(f"{p}.q_norm.weight", head_dim)
        yield from _ones(f"{p}.k_norm.weight", head_dim)


def _feed_forward(cfg: dict, layer: int, gen: torch.Generator) -> Tensors:
    hidden, mt = cfg["hidden_size"], cfg["model_type"]
    if mt == "mixtral":
        prefix, names = f"model.layers.{layer}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        prefix, names = f"model.layers.{layer}.mlp", ("gate_proj", "up_proj", "down_proj")
    if mt == "deepseek_v2" and layer < cfg["first_k_dense_replace"]:
        yield from _mlp(prefix, hidden, cfg["intermediate_size"], names, gen)
        return
    experts = cfg[_EXPERT_COUNT_KEY[mt]]
    inter = cfg["intermediate_size"] if mt == "mixtral" else cfg["moe_intermediate_size"]
    yield from _linears(gen, (f"{prefix}.gate.weight", experts, hidden))
    for e in range(experts):
        yield from _mlp(f"{prefix}.experts.{e}", hidden, inter, names, gen)
    if mt == "deepseek_v2":  # the shared experts, fused into one MLP as in the released checkpoint
        yield from _mlp(f"{prefix}.shared_experts", hidden, inter * cfg["n_shared_experts"], names, gen)


def _tensors(cfg: dict, special_ids: list[int], gen: torch.Generator) -> Tensors:
    """Every tensor in checkpoint order: embeddings, the layers, the final norm and LM head."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    yield "model.embed_tokens.weight", torch.randn(vocab, hidden, generator=gen).to(torch.bfloat16)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        yield from _ones(f"{p}.input_layernorm.weight", hidden)
        yield from _attention(cfg, f"{p}.self_attn", gen)
        yield from _ones(f"{p}.post_attention_layernorm.weight", hidden)
        yield from _feed_forward(cfg, layer, gen)
    yield from _ones("model.norm.weight", hidden)
    head = _linear(vocab, hidden, gen)
    head[special_ids] = 0  # logit 0: below the largest of `vocab` N(0, ~1) logits, so never the greedy pick
    yield "lm_head.weight", head


def build_random(out_dir: Path, shape: str, layers: int, vocab_size: int = 8000, experts: int | None = None,
                 seed: int = 0) -> dict:
    """Writes the checkpoint, tokenizer and configs into `out_dir`; returns the build record."""
    from .corpus import build_corpus

    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = build_corpus(seed, TOKENIZER_CORPUS_BYTES, None)
    tokenizer = train_tokenizer((d.plain_text() for d in corpus.train), vocab_size)
    save_tokenizer(tokenizer, out_dir)
    cfg = shape_config(shape, layers, tokenizer.get_vocab_size(), experts)
    bos, end = token_id(tokenizer, BOS_TOKEN), token_id(tokenizer, END_TOKEN)
    cfg |= {"bos_token_id": bos, "eos_token_id": bos, "pad_token_id": token_id(tokenizer, PAD_TOKEN)}
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    generation = {"bos_token_id": bos, "eos_token_id": [bos, end], "pad_token_id": cfg["pad_token_id"]}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    params, total_bytes = _write_shards(out_dir, cfg, _special_ids(tokenizer), seed)
    info = {"shape": shape, "layers": layers, "vocab_size": cfg["vocab_size"], "experts": experts, "seed": seed,
            "params": params, "bytes": total_bytes, "build_s": round(time.perf_counter() - start, 2)}
    (out_dir / BUILD_FILE).write_text(json.dumps(info, indent=2) + "\n")
    return info


def _special_ids(tokenizer: Tokenizer) -> list[int]:
    return [token_id(tokenizer, t) for t in SPECIAL_TOKENS]


def _write_shards(out_dir: Path, cfg: dict, special_ids: list[int], seed: int) -> tuple[int, int]:
    """Writes model-0000i-of-0000n.safetensors of up to SHARD_BYTES each, then the index; returns (params,
    bytes). Peak memory is about two shards (safetensors serialises a shard into one buffer)."""
    for stale in (*out_dir.glob("model*.safetensors"), *out_dir.glob("shard-*.tmp")):  # an earlier build's
        stale.unlink()
    gen = torch.Generator().manual_seed(seed)
    shards: list[list[str]] = []
    shard: dict[str, torch.Tensor] = {}
    params = total_bytes = shard_bytes = 0

    def flush() -> None:
        save_file(shard, str(out_dir / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
        shards.append(list(shard))
        shard.clear()

    for name, tensor in _tensors(cfg, special_ids, gen):
        nbytes = tensor.numel() * tensor.element_size()
        if shard and shard_bytes + nbytes > SHARD_BYTES:
            flush()
            shard_bytes = 0
        shard[name] = tensor
        shard_bytes += nbytes
        params += tensor.numel()
        total_bytes += nbytes
    flush()
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        (out_dir / f"shard-{i:05d}.tmp").replace(out_dir / final)
        weight_map |= dict.fromkeys(names, final)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return params, total_bytes
