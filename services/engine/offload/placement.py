"""Placement of a layer's cache misses: fetch to the device, or compute on the host where the expert lives.

`HostPlacement` never moves an expert (llama.cpp `-ot exps=CPU`, `--n-cpu-moe`, KTransformers). `CostPlacement`
is Fiddler's rule with HybriMoE's balancing: misses, most tokens first, each go to whichever side finishes
it sooner given the work already queued there (host backlog; the link serialises this layer's fetches).
With `split` prices it may also split an expert (offload/split_experts.py): gate/up on the host while down
crosses the link, both sides busy at once, which beats either side alone when neither is much faster.
Batched prefill keeps streaming experts to the device when the policy streams prefill (DuoServe): many
tokens per expert make host compute the slow side, and the rule would mostly agree anyway.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

from services.engine.offload.cost_model import PlacementCosts
from services.engine.step_context import StepContext


class Placed(NamedTuple):
    fetch: list[int]  # fetched to the device (or waited for, if already on the link)
    host: list[int]  # computed on the host
    split: list[int]  # gate/up on the host, down fetched and computed on the device


class SplitPrices(NamedTuple):
    """A split expert's share of each price: host (gate/up), link and device (down)."""

    host: float
    link: float
    device: float


class Placement(ABC):
    @abstractmethod
    def place(
        self, misses: list[int], tokens: dict[int, int], ctx: StepContext, host_backlog: float,
        link_backlog: float = 0.0, landing: dict[int, float] | None = None, split_room: int = 0,
    ) -> Placed:
        """Where each miss goes; backlogs: seconds of work each side
        holds that a new job would wait behind; `landing`: seconds until an expert already on the link
        lands (it costs no further link time); `split_room`: experts the staging can take split."""


class HostPlacement(Placement):
    def place(
        self, misses: list[int], tokens: dict[int, int], ctx: StepContext, host_backlog: float,
        link_backlog: float = 0.0, landing: dict[int, float] | None = None, split_room: int = 0,
    ) -> Placed:
        return Placed([], misses, [])


class CostPlacement(Placement):
    def __init__(self, costs: PlacementCosts, stream_prefill: bool, split: SplitPrices | None = None) -> None:
        self.costs = costs
        self.stream_prefill = stream_prefill
        self.split_prices = split

    def place(
        self, misses: list[int], tokens: dict[int, int], ctx: StepContext, host_backlog: float,
        link_backlog: float = 0.0, landing: dict[int, float] | None = None, split_room: int = 0,
    ) -> Placed:
        if ctx.is_prefill and self.stream_prefill:
            return Placed(misses, [], [])
        c, part = self.costs, self.split_prices
        landing = landing or {}
        link_done, host_done = link_backlog, host_backlog
        placed = Placed([], [], [])
        for expert in sorted(misses, key=lambda e: -tokens[e]):
            n = tokens[expert]
            lands = landing.get(expert)
            on_host = host_done + c.host(n)
            on_device = (link_done + c.link if lands is None else lands) + c.device(n)
            can_split = lands is None and len(placed.split) < split_room
            halves = self.split_seconds(n, host_done, link_done) if can_split else float("inf")
            if on_host <= on_device and on_host <= halves:
                placed.host.append(expert)
                host_done = on_host
            elif halves < on_device:
                placed.split.append(expert)
                host_done += part.host * c.host(n)  # type: ignore[union-attr]
                link_done += part.link * c.link  # type: ignore[union-attr]
            else:
                placed.fetch.append(expert)
                if lands is None:
                    link_done += c.link
        return placed

    def split_seconds(self, tokens: int, host_done: float = 0.0, link_done: float = 0.0) -> float:
        """When a split expert would be done, both sides starting behind what they hold (inf: no splitting)."""
        part, c = self.split_prices, self.costs
        if part is None:
            return float("inf")
        return max(host_done + part.host * c.host(tokens), link_done + part.link * c.link) + part.device * c.device(tokens)
