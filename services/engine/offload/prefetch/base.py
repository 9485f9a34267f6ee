"""One interface for every prefetcher: after a layer's router, which experts to fetch ahead, how urgently."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from services.engine.step_context import StepContext


@dataclass(frozen=True)
class PrefetchRequest:
    layer: int
    expert: int
    priority: float  # higher first
    next_step: bool = False  # for the following step (wrapping past the last layer)
    probability: float | None = None  # that the target layer asks for it (eviction's view); None: priority


class GuessTracker:
    """How often a prefetcher's guesses for layers of the same step were then routed to (an EMA over steps),
    and the mean probability it gave them: what turns its scores into probabilities the eviction policy can
    weigh a prefetch by."""

    def __init__(self, precision: float, mean_probability: float = 1.0, weight: float = 0.1) -> None:
        self.precision = precision
        self.mean_probability = mean_probability
        self.weight = weight
        self._guessed: dict[int, dict[int, float]] = {}  # target layer -> expert -> probability given

    def guess(self, layer: int, expert: int, probability: float = 1.0) -> None:
        self._guessed.setdefault(layer, {})[expert] = probability

    def step_end(self, ctx: StepContext) -> None:
        right = total = 0
        mass = 0.0
        for layer, guessed in self._guessed.items():
            actual = ctx.selected_experts.get(layer)
            if actual is None:
                continue
            routed = set(actual.flatten().tolist())
            right += sum(1 for e in guessed if e in routed)
            total += len(guessed)
            mass += sum(guessed.values())
        self._guessed.clear()
        if total:
            w = self.weight
            self.precision = (1 - w) * self.precision + w * right / total
            self.mean_probability = (1 - w) * self.mean_probability + w * mass / total


class Prefetcher(ABC):
    name: str = ""
    tracker: GuessTracker | None = None  # how often its guesses are then routed to; None: it keeps no count

    @abstractmethod
    def plan(self, layer: int, ctx: StepContext) -> list[PrefetchRequest]:
        """Called right after `layer`'s router; ctx holds router probabilities and layer inputs so far."""

    def on_step_end(self, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """The step's last layer has run (online statistics update here)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stops its background work (the hint prefetcher's predictor link)."""


def targets(layer: int, distance: int, moe_layers: tuple[bool, ...]) -> list[tuple[int, int, bool]]:
    """The next `distance` MoE layers after `layer` as (hops, layer, next_step), wrapping into the next step."""
    out: list[tuple[int, int, bool]] = []
    num = len(moe_layers)
    position = layer
    hops = 0
    while len(out) < distance and hops < 2 * num:
        position += 1
        hops += 1
        target = position % num
        if moe_layers[target]:
            out.append((len(out) + 1, target, position >= num))
    return out
