"""Token sampling: penalties, greedy, temperature, top-k, top-p, per-request seeded generators."""

from __future__ import annotations

import torch

from services.engine.sampling_params import SamplingParams
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


class _GrowingTensor:
    """A 1-D tensor with amortised O(1) appends (its capacity doubles); `filled` views the appended part."""

    def __init__(self, dtype: torch.dtype) -> None:
        self._data = torch.empty(16, dtype=dtype)
        self.size = 0

    def _reserve(self, size: int) -> None:
        if size > len(self._data):
            grown = torch.empty(max(size, 2 * len(self._data)), dtype=self._data.dtype)
            grown[: self.size] = self.filled
            self._data = grown

    def append(self, value: float) -> None:
        self._reserve(self.size + 1)
        self._data[self.size] = value
        self.size += 1

    def extend(self, values: list[int]) -> None:
        self._reserve(self.size + len(values))
        self._data[self.size : self.size + len(values)] = torch.tensor(values, dtype=self._data.dtype)
        self.size += len(values)

    def set(self, position: int, value: float) -> None:
        self._data[position] = value

    @property
    def filled(self) -> torch.Tensor:
        return self._data[: self.size]


class PenaltyState:
    """What a penalised sequence's penalties touch, kept as small per-sequence tensors, updated incrementally.

    The penalties change only the logits of token ids the sequence has seen, a few hundred or thousand out
    of a vocabulary of up to ~150k, so a step gathers and scatters just those: `seen_ids` (each id of the
    prompt and output once, for the repetition penalty) and `generated_ids` with `subtrahends`
    (frequency_penalty * count + presence_penalty of each generated id). Built on the sequence's first
    step, then updated with only the tokens appended since (one per decode step): no step rescans it.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.uses_repetition = params.repetition_penalty != 1.0
        self.uses_subtrahends = params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
        self.seen: set[int] = set()
        self.seen_ids = _GrowingTensor(torch.long)
        self.generated_counts: dict[int, int] = {}
        self.generated_positions: dict[int, int] = {}  # id -> its index in generated_ids and subtrahends
        self.generated_ids = _GrowingTensor(torch.long)
        self.subtrahends = _GrowingTensor(torch.float32)
        self.num_tokens_seen = 0

    def update(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        p = self.params
        start = self.num_tokens_seen
        if start < num_prompt_tokens:  # the first step: the whole prompt in one go
            if self.uses_repetition:
                prompt = dict.fromkeys(token_ids[start:num_prompt_tokens])  # distinct, in order
                new = [token for token in prompt if token not in self.seen]
                self.seen.update(new)
                self.seen_ids.extend(new)
            start = num_prompt_tokens
        for token in token_ids[start:]:  # then one generated token per decode step
            if self.uses_repetition and token not in self.seen:
                self.seen.add(token)
                self.seen_ids.append(token)
            if self.uses_subtrahends:
                count = self.generated_counts.get(token, 0) + 1
                self.generated_counts[token] = count
                subtrahend = p.frequency_penalty * count + p.presence_penalty
                if count == 1:
                    self.generated_positions[token] = self.generated_ids.size
                    self.generated_ids.append(token)
                    self.subtrahends.append(subtrahend)
                else:
                    self.subtrahends.set(self.generated_positions[token], subtrahend)
        self.num_tokens_seen = len(token_ids)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Applies each sequence's penalties to its row of `logits` in place, all rows in one batch: repetition
    first, then frequency and presence, in vLLM's order. Rows of unpenalised sequences are left alone.
    """
    rows = [i for i, seq in enumerate(seqs) if seq.params.has_penalties]
    if not rows:
        return
    states: list[PenaltyState] = []
    for i in rows:
        seq = seqs[i]
        if seq.penalty_state is None:
            seq.penalty_state = PenaltyState(seq.params)
        seq.penalty_state.update(seq.token_ids, seq.num_prompt_tokens)
        states.append(seq.penalty_state)

    # Each penalty is one gather and one scatter over the flattened rows, for every penalised row at once.
    flat_logits = logits.view(-1)
    vocab = logits.shape[-1]
    repeated = [(row, state) for row, state in zip(rows, states) if state.uses_repetition]
    if repeated:
        index = torch.cat([state.seen_ids.filled + row * vocab for row, state in repeated])
        penalty = torch.cat(
            # float(): an int penalty (Python callers) would otherwise make an int64 tensor
            [torch.full((state.seen_ids.size,), float(state.params.repetition_penalty)) for _, state in repeated]
        )
        seen_logits = flat_logits.index_select(0, index)
        penalised = torch.where(seen_logits > 0, seen_logits / penalty, seen_logits * penalty)
        flat_logits.index_copy_(0, index, penalised)
    counted = [(row, state) for row, state in zip(rows, states) if state.uses_subtrahends]
    if counted:
        index = torch.cat([state.generated_ids.filled + row * vocab for row, state in counted])
        subtrahends = torch.cat([state.subtrahends.filled for _, state in counted])
        flat_logits.index_add_(0, index, subtrahends, alpha=-1)


def sample(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...], default_generator: torch.Generator
) -> list[int]:
    """logits: [batch, vocab] fp32, one row per sequence. Returns one token id per sequence.

    Admission validated every parameter against the vocabulary; ids and top_k are still clamped to it here,
    so that no single request's values can raise inside the batch (which would fail all of them).
    """
    vocab = logits.shape[-1]
    for i, seq in enumerate(seqs):
        p = seq.params
        if seq.num_completion_tokens < p.min_tokens:
            banned = [t for t in p.stop_token_ids if 0 <= t < vocab]
            if not p.ignore_eos:
                banned += [t for t in eos_ids if 0 <= t < vocab]
            if banned:
                logits[i, banned] = _NEG_INF
    apply_penalties(logits, seqs)
    greedy = [seq.params.greedy for seq in seqs]
    if all(greedy):
        return logits.argmax(dim=-1).tolist()

    temps = torch.tensor([s.params.temperature if not g else 1.0 for s, g in zip(seqs, greedy)])
    scaled = logits / temps[:, None]
    if any(s.params.top_k > 0 or s.params.top_p < 1.0 for s in seqs):
        top_k = torch.tensor([min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in seqs])
        top_p = torch.tensor([s.params.top_p for s in seqs])
        scaled = _filter_top_k_top_p(scaled, top_k, top_p)
    probs = scaled.softmax(dim=-1)
    tokens = logits.argmax(dim=-1).tolist()
    # Exponential race (Gumbel-max equivalent): argmax(p / q), q ~ Exp(1). A seeded request draws from its own
    # generator (its tokens do not depend on its batch); the others share one draw from the engine's.
    shared = [i for i, seq in enumerate(seqs) if not greedy[i] and seq.generator is None]
    if shared:
        rows = probs if len(shared) == len(seqs) else probs[shared]
        picked = (rows / _exponential(rows.shape, default_generator)).argmax(dim=-1).tolist()
        for i, token in zip(shared, picked):
            tokens[i] = token
    for i, seq in enumerate(seqs):
        if not greedy[i] and seq.generator is not None:
            tokens[i] = int(torch.argmax(probs[i] / _exponential((vocab,), seq.generator)))
    return tokens


def _exponential(shape: torch.Size | tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Exp(1) samples as -log(U): on CPU 4x faster than Tensor.exponential_ (U = 0 gives +inf: never picked)."""
    return torch.empty(shape).uniform_(generator=generator).log_().neg_()
