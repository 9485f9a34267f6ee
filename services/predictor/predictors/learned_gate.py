"""ProMoE's learned predictor (seed 002 section 4): small per-layer MLPs on recorded layer inputs.

For every source layer l (and the input embedding, source -1, for predictions made at the iteration start)
one MLP maps a token's residual stream entering layer l's MoE block to the experts of layers l+1..l+D
(one head per stride d, stride prefetching). Trained with BCE on traces recorded with `--layer-inputs`.
It needs hidden states, so it runs inside the engine: `predict_from_hidden(hidden, source, target)`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from services.common.iteration_context import PredictionQuery, RequestTrace
from services.predictor.predictors.base import Predictor
from services.predictor.predictors.common import hidden_at

MAX_STRIDE = 4


def _normalise(x: torch.Tensor) -> torch.Tensor:
    """RMS-normalise each token (the residual stream's scale grows with depth)."""
    return x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt()


class GateMLP(nn.Module):
    def __init__(self, hidden: int, num_experts: int, strides: int, width: int = 128) -> None:
        super().__init__()
        self.num_experts, self.strides = num_experts, strides
        self.net = nn.Sequential(nn.Linear(hidden, width), nn.ReLU(), nn.Linear(width, strides * num_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [tokens, H] -> [tokens, strides, E] logits
        return self.net(_normalise(x)).view(len(x), self.strides, self.num_experts)


def gate_dataset(requests: list[RequestTrace], source: int, num_layers: int, num_experts: int,
                 strides: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(inputs [N, H], multi-hot targets [N, strides, E], valid mask [N, strides]) for one source layer."""
    xs, ys = [], []
    for request in requests:
        for it in request.iterations:
            experts = getattr(it, "token_experts", None)
            inputs = getattr(it, "layer_inputs", None)  # both set together (a TracedIteration) or neither
            if source < 0:  # the embedding: exact per token only for decode steps
                if it.num_tokens != 1 or not it.embedding.size:
                    continue
                xs.append(it.embedding[None].astype(np.float32))
                sel = (it.counts > 0)[None]  # [1, L, E]
            else:
                if experts is None or inputs is None:
                    continue
                xs.append(inputs[:, source].astype(np.float32))
                sel = np.zeros((len(experts), num_layers, num_experts), bool)
                np.put_along_axis(sel, experts.astype(np.int64), True, axis=2)
            y = np.zeros((len(sel), strides, num_experts), np.float32)
            for d in range(1, strides + 1):
                if source + d < num_layers:
                    y[:, d - 1] = sel[:, source + d]
            ys.append(y)
    if not xs:
        return np.zeros((0, 0), np.float32), np.zeros((0, strides, num_experts), np.float32), np.zeros((0, strides))
    valid = np.array([[source + d < num_layers for d in range(1, strides + 1)]], np.float32)
    x, y = np.concatenate(xs), np.concatenate(ys)
    return x, y, np.repeat(valid, len(x), 0)


class LearnedGatePredictor(Predictor):
    name = "learned-gate"
    requires_layer_inputs = True

    def __init__(self, num_layers: int, num_experts: int, top_k: int, strides: int = MAX_STRIDE, width: int = 128,
                 steps: int = 300, seed: int = 0) -> None:
        super().__init__(num_layers, num_experts, top_k)
        self.strides, self.width, self.steps, self.seed = strides, width, steps, seed
        self.gates: dict[int, GateMLP] = {}  # source layer (-1 = embedding) -> MLP
        self.popularity = np.full((num_layers, num_experts), 1.0 / num_experts, np.float32)

    def fit(self, requests: list[RequestTrace]) -> None:
        counts = sum((it.counts > 0).astype(np.float32) for r in requests for it in r.iterations)
        if isinstance(counts, np.ndarray):
            self.popularity = counts / counts.sum(1, keepdims=True)
        for source in range(-1, self.num_layers - 1):
            x, y, valid = gate_dataset(requests, source, self.num_layers, self.num_experts, self.strides)
            if len(x) >= 8:
                self.gates[source] = self._train(x, y, valid)

    def _train(self, x: np.ndarray, y: np.ndarray, valid: np.ndarray) -> GateMLP:
        torch.manual_seed(self.seed)
        gate = GateMLP(x.shape[1], self.num_experts, self.strides, self.width)
        opt = torch.optim.Adam(gate.parameters(), lr=3e-3, weight_decay=1e-4)
        xt, yt, vt = torch.from_numpy(x), torch.from_numpy(y), torch.from_numpy(valid.astype(np.float32))
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(self.steps):
            idx = torch.randint(len(xt), (min(512, len(xt)),), generator=gen)
            loss = nn.functional.binary_cross_entropy_with_logits(gate(xt[idx]), yt[idx], reduction="none")
            loss = (loss.mean(-1) * vt[idx]).sum() / vt[idx].sum().clamp(min=1)
            opt.zero_grad()
            loss.backward()
            opt.step()
        return gate.eval()

    def predict_from_hidden(self, hidden: np.ndarray | torch.Tensor, source: int, target: int) -> np.ndarray:
        """Expert scores for `target` from the tokens' hidden states entering `source` ([tokens, H])."""
        gate = self.gates.get(source)
        if gate is None:
            return self.popularity[target].copy()
        stride = min(target - source, self.strides)
        x = torch.as_tensor(hidden, dtype=torch.float32)
        with torch.no_grad():
            return torch.sigmoid(gate(x)[:, stride - 1]).mean(0).numpy()

    def predict(self, query: PredictionQuery) -> np.ndarray:
        source = query.current.layers_seen - 1
        hidden = hidden_at(query.current, source)
        if hidden is None:  # no recorded hidden states: fall back to layer popularity
            return self.popularity[query.target_layer].copy()
        return self.predict_from_hidden(hidden, source, query.target_layer)

    def snapshot(self) -> dict[str, Any]:
        return {"popularity": self.popularity.copy(), "width": self.width, "strides": self.strides,
                "gates": {s: {k: v.clone() for k, v in g.state_dict().items()} for s, g in self.gates.items()}}

    def restore(self, state: dict[str, Any]) -> None:
        self.popularity = np.asarray(state["popularity"], np.float32)
        self.width, self.strides = int(state["width"]), int(state["strides"])
        self.gates = {}
        for source, sd in state["gates"].items():
            gate = GateMLP(sd["net.0.weight"].shape[1], self.num_experts, self.strides, self.width)
            gate.load_state_dict(sd)
            self.gates[int(source)] = gate.eval()
