"""The experts each step routed to, per layer: recorded from one run, replayed by the oracle and Belady."""

from __future__ import annotations

import bisect
import json
import math
import os
from dataclasses import dataclass

from services.engine.step_context import StepContext

Key = tuple[int, int]


class RoutingTrace:
    def __init__(self, num_layers: int, steps: list[list[list[int]]] | None = None) -> None:
        self.num_layers = num_layers
        self.steps: list[list[list[int]]] = steps or []  # [step][layer] -> sorted expert ids
        self._positions: dict[Key, list[int]] | None = None

    # ---- recording (a step observer) ----
    def __call__(self, ctx: StepContext) -> None:
        per_layer: list[list[int]] = [[] for _ in range(self.num_layers)]
        for layer, experts in ctx.selected_experts.items():
            per_layer[layer] = sorted(set(experts.flatten().tolist()))
        self.steps.append(per_layer)
        self._positions = None

    # ---- replay ----
    @staticmethod
    def replay_step(ctx: StepContext | None) -> int:
        """Steps count from the engine's start in both the recorded and the replaying run, which must be
        identical (same requests submitted the same way to a fresh engine)."""
        return 0 if ctx is None else ctx.step_index

    def experts(self, step: int, layer: int) -> list[int]:
        if 0 <= step < len(self.steps):
            return self.steps[step][layer]
        return []

    def next_use(self, key: Key, step: int, layer: int) -> float:
        """Position (step * layers + layer) of the next use of `key` after (step, layer); inf if never."""
        index = self._positions if self._positions is not None else self._index()
        positions = index.get(key, [])
        i = bisect.bisect_right(positions, step * self.num_layers + layer)
        return positions[i] if i < len(positions) else math.inf

    def _index(self) -> dict[Key, list[int]]:
        positions: dict[Key, list[int]] = {}
        for step, layers in enumerate(self.steps):
            for layer, experts in enumerate(layers):
                for e in experts:
                    positions.setdefault((layer, e), []).append(step * self.num_layers + layer)
        self._positions = positions
        return positions

    def hot_set(self, size: int) -> set[Key]:
        """The `size` most frequently used experts (a static policy's pinned set)."""
        counts: dict[Key, int] = {}
        for layers in self.steps:
            for layer, experts in enumerate(layers):
                for e in experts:
                    counts[(layer, e)] = counts.get((layer, e), 0) + 1
        return set(sorted(counts, key=lambda k: counts[k], reverse=True)[:size])

    # ---- files ----
    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump({"num_layers": self.num_layers, "steps": self.steps}, f)

    @classmethod
    def load(cls, path: str) -> RoutingTrace:
        with open(path) as f:
            data = json.load(f)
        return cls(data["num_layers"], data["steps"])


@dataclass(frozen=True)
class TraceFile:
    """A recorded routing trace's path (--routing-trace), loaded only by the parts that replay it."""

    path: str | None = None

    def __bool__(self) -> bool:
        return bool(self.path)

    def load(self, user: str) -> RoutingTrace:
        """The trace, or a one-line error naming `user` (the policy that replays it) when it is missing."""
        if not self.path or not os.path.isfile(self.path):
            raise ValueError(
                f"policy {user!r} replays a recorded routing trace: pass --routing-trace FILE "
                "(record one with the resident policy on the same prompts)"
            )
        return RoutingTrace.load(self.path)
