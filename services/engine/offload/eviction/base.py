"""One interface for every cache eviction policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Set as AbstractSet

from services.engine.step_context import StepContext

Key = tuple[int, int]  # (layer, expert)


class EvictionPolicy(ABC):
    """Told about accesses, inserts and evictions; asked to pick a victim among evictable slots."""

    name: str = ""
    # A hot set the hybrid provider keeps filled (hot-set eviction); empty for the others. `reserved`: experts
    # the whole budget's hot set would hold that the slots kept beside it (`reserve`) leave out.
    hot: AbstractSet[Key] = frozenset()
    reserved: AbstractSet[Key] = frozenset()

    def reserve(self, slots: int) -> None:  # noqa: B027 - optional hook
        """Keeps `slots` outside the hot set from the next step on (hot-set eviction only)."""

    def on_access(self, key: Key, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """The router asked for `key` (hit or miss)."""

    def on_insert(self, key: Key) -> None:  # noqa: B027 - optional hook
        """`key` got a slot (demand or prefetch)."""

    def on_evict(self, key: Key) -> None:  # noqa: B027 - optional hook
        """`key` lost its slot."""

    def on_layer_routed(self, layer: int, mean_probs: list[float], ctx: StepContext) -> None:  # noqa: B027
        """The router's mean probability per expert of `layer` for this step."""

    def on_prediction(self, key: Key, probability: float) -> None:  # noqa: B027 - optional hook
        """A prefetcher expects `key` with `probability`."""

    def on_step_end(self, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """The step's last layer has run."""

    def admit(self, key: Key, victim: Key, ctx: StepContext | None, layer_now: int) -> bool:
        """May a prefetch of `key` evict `victim`? (demand fetches always may)"""
        return True

    @abstractmethod
    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        """The slot to free among `candidates` (never empty; pinned and loading slots are excluded)."""
