"""Quality and routing statistics of the demo model on held-out text.

* validation perplexity (next-token cross-entropy, exp'd);
* per-layer router entropy: mean per-token entropy of the softmax over the experts (nats, max ln E);
* per-layer expert load: fraction of top-k slots each expert receives;
* the "skip-gate" hit used by Mixtral-Offloading-style prefetch: layer l's output hidden state (the input of
  layer l+1) pushed through layer l+1's post_attention_layernorm and router, top-k, compared with layer l+1's
  real top-k (exact-set hit and per-expert recall). The guess skips layer l+1's attention, which is what makes
  it available early enough to prefetch experts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

STATS_FILE = "demo_model_stats.json"


def make_windows(token_lists: Sequence[Sequence[int]], seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows of `seq_len` tokens over the concatenated documents, evenly sampled."""
    stream = [t for ids in token_lists for t in ids]
    n = len(stream) // seq_len
    if n == 0:
        raise ValueError(f"validation text too short: {len(stream)} tokens < one window of {seq_len}")
    windows = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)
    if n > max_windows:
        windows = windows[torch.linspace(0, n - 1, max_windows).round().long()]
    return windows


@torch.no_grad()
def perplexity(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) over all windows; router aux loss excluded."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = windows[i : i + batch_size]
        logits = model(input_ids=ids, output_router_logits=False, use_cache=False).logits.float()
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum"
        )
        total += loss.item()
        count += ids[:, 1:].numel()
    model.train(was_training)
    return math.exp(total / count)


@torch.no_grad()
def routing_stats(model: torch.nn.Module, windows: torch.Tensor, batch_size: int = 8) -> dict:
    """Router entropy, expert load and skip-gate hit per layer (see module docstring)."""
    model.eval()
    layers = model.model.layers
    top_k = model.config.num_experts_per_tok
    n_experts = model.config.num_local_experts
    n_layers = len(layers)
    outputs: dict[int, torch.Tensor] = {}
    logits: dict[int, torch.Tensor] = {}
    hooks = []
    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(lambda m, a, out, i=i: outputs.__setitem__(i, _first(out))))
        hooks.append(
            layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, out[0]))
        )
    entropy = torch.zeros(n_layers, dtype=torch.float64)
    load = torch.zeros(n_layers, n_experts, dtype=torch.float64)
    exact = torch.zeros(n_layers, dtype=torch.float64)
    recall = torch.zeros(n_layers, dtype=torch.float64)
    tokens = 0
    try:
        for i in range(0, len(windows), batch_size):
            ids = windows[i : i + batch_size]
            model(input_ids=ids, output_router_logits=False, use_cache=False)
            tokens += ids.numel()
            real_sets = []
            for layer in range(n_layers):
                probs = logits[layer].float().softmax(-1)
                entropy[layer] += -(probs * probs.clamp_min(1e-12).log()).sum(-1).sum().item()
                top = probs.topk(top_k, dim=-1).indices
                load[layer] += torch.bincount(top.flatten(), minlength=n_experts).double()
                real_sets.append(F.one_hot(top, n_experts).sum(1).bool())
            for layer in range(1, n_layers):
                nxt = layers[layer]
                hidden = outputs[layer - 1].reshape(-1, outputs[layer - 1].shape[-1])
                guess_logits = F.linear(nxt.post_attention_layernorm(hidden), nxt.mlp.gate.weight)
                guess = F.one_hot(guess_logits.topk(top_k, dim=-1).indices, n_experts).sum(1).bool()
                real = real_sets[layer]
                exact[layer] += (guess == real).all(-1).sum().item()
                recall[layer] += (guess & real).sum().item() / top_k
    finally:
        for hook in hooks:
            hook.remove()
    per_layer = []
    for layer in range(n_layers):
        row = {
            "layer": layer,
            "router_entropy_nats": entropy[layer].item() / tokens,
            "expert_load": [round(x, 4) for x in (load[layer] / (tokens * top_k)).tolist()],
        }
        if layer > 0:
            row["skip_gate_exact_hit"] = exact[layer].item() / tokens
            row["skip_gate_recall"] = recall[layer].item() / tokens
        per_layer.append(row)
    return {"tokens": tokens, "max_entropy_nats": math.log(n_experts), "layers": per_layer}


def _first(out: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def compute_stats(
    model: torch.nn.Module, val_windows: torch.Tensor, chat_windows: torch.Tensor | None
) -> dict:
    """All statistics as one JSON-ready dict."""
    stats = {"val_perplexity": perplexity(model, val_windows), "val_tokens": val_windows.numel()}
    if chat_windows is not None and len(chat_windows):
        stats["val_perplexity_chat"] = perplexity(model, chat_windows)
    stats["routing"] = routing_stats(model, val_windows)
    return stats


def format_table(stats: dict) -> str:
    """A short human-readable table."""
    lines = [f"validation perplexity: {stats['val_perplexity']:.2f} ({stats['val_tokens']} tokens)"]
    if "val_perplexity_chat" in stats:
        lines.append(f"validation perplexity (chat only): {stats['val_perplexity_chat']:.2f}")
    routing = stats["routing"]
    lines.append(
        f"layer  entropy(nats, max {routing['max_entropy_nats']:.2f})  skip-gate exact  recall  max load"
    )
    for row in routing["layers"]:
        hit = f"{row['skip_gate_exact_hit']:.3f}" if "skip_gate_exact_hit" in row else "  -  "
        rec = f"{row['skip_gate_recall']:.3f}" if "skip_gate_recall" in row else "  -  "
        lines.append(
            f"{row['layer']:>5}  {row['router_entropy_nats']:>25.3f}  {hit:>15}  {rec:>6}  {max(row['expert_load']):.3f}"
        )
    return "\n".join(lines)


def stats_for_dir(
    model_dir: Path, val_docs: Sequence[object], seq_len: int = 256, max_windows: int = 64
) -> dict:
    """Load the saved artefact from `model_dir` (computing in fp32), compute stats, write STATS_FILE."""
    from tokenizers import Tokenizer
    from transformers import MixtralForCausalLM

    from .tokenizer import encode_documents

    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model in {model_dir} (config.json missing)")
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # fp32 compute on the bf16 weights: CPUs without AVX512-BF16 run bf16 matmuls several times slower.
    model = MixtralForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    ids = encode_documents(tokenizer, val_docs)
    windows = make_windows(ids, seq_len, max_windows)
    chat_ids = [t for t, d in zip(ids, val_docs, strict=True) if getattr(d, "kind", "") == "chat"]
    chat = make_windows(chat_ids, seq_len, max_windows) if sum(map(len, chat_ids)) >= seq_len else None
    stats = compute_stats(model, windows, chat)
    (model_dir / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    return stats
