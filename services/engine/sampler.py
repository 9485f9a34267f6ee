"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from services.engine.sequence import Sequence

_NEG_INF = float("-inf")


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks tokens outside each row's top-k and nucleus (top-p) sets; rows keep at least one token."""
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    mask = ranks >= top_k[:, None]
    probs = sorted_logits.masked_fill(mask, _NEG_INF).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    mask |= mass_before > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(mask, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...], default_generator: torch.Generator
) -> list[int]:
    """logits: [batch, vocab] fp32, one row per sequence. Returns one token id per sequence."""
    for i, seq in enumerate(seqs):
        p = seq.params
        if seq.num_completion_tokens < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_ids))
            if banned:
                logits[i, banned] = _NEG_INF
    greedy = [seq.params.greedy for seq in seqs]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()

    vocab = logits.shape[-1]
    temps = torch.tensor([s.params.temperature if not g else 1.0 for s, g in zip(seqs, greedy)])
    scaled = logits / temps[:, None]
    if any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs):
        top_k = torch.tensor([s.params.top_k if s.params.top_k > 0 else vocab for s in seqs])
        top_p = torch.tensor([s.params.top_p for s in seqs])
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    tokens = logits.argmax(dim=-1).tolist()
    for i, seq in enumerate(seqs):
        if greedy[i]:
            continue
        # Exponential race (Gumbel-max equivalent): argmax(p / q), q ~ Exp(1), one generator per request.
        noise = torch.empty(vocab).exponential_(generator=seq.generator or default_generator)
        tokens[i] = int(torch.argmax(probs[i] / noise))
    return tokens
