"""Placement of a layer's cache misses: fetch to the device, or compute on the host where the expert lives.

`HostPlacement` never moves an expert (llama.cpp `-ot exps=CPU`, `--n-cpu-moe`, KTransformers). `CostPlacement`
is Fiddler's rule with HybriMoE's balancing: misses, most tokens first, each go to whichever side finishes
it sooner given the work already queued there (host backlog; the link serialises this layer's fetches).
Batched prefill keeps streaming experts to the device when the policy streams prefill (DuoServe): many
tokens per expert make host compute the slow side, and the rule would mostly agree anyway.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from services.engine.offload.cost_model import PlacementCosts
from services.engine.step_context import StepContext


class Placement(ABC):
    @abstractmethod
    def split(
        self, misses: list[int], tokens: dict[int, int], ctx: StepContext, host_backlog: float,
        link_backlog: float = 0.0, landing: dict[int, float] | None = None,
    ) -> tuple[list[int], list[int]]:
        """(misses to fetch or wait for, misses to compute on the host); backlogs: seconds of work each side
        holds that a new job would wait behind; `landing`: seconds until an expert already on the link
        lands (it costs no further link time)."""


class HostPlacement(Placement):
    def split(
        self, misses: list[int], tokens: dict[int, int], ctx: StepContext, host_backlog: float,
        link_backlog: float = 0.0, landing: dict[int, float] | None = None,
    ) -> tuple[list[int], list[int]]:
        return [], misses


class CostPlacement(Placement):
    def __init__(self, costs: PlacementCosts, stream_prefill: bool) -> None:
        self.costs = costs
        self.stream_prefill = stream_prefill

    def split(
        self, misses: list[int], tokens: dict[int, int], ctx: StepContext, host_backlog: float,
        link_backlog: float = 0.0, landing: dict[int, float] | None = None,
    ) -> tuple[list[int], list[int]]:
        if ctx.is_prefill and self.stream_prefill:
            return misses, []
        c = self.costs
        landing = landing or {}
        link_done, host_done = link_backlog, host_backlog
        fetch, host = [], []
        for expert in sorted(misses, key=lambda e: -tokens[e]):
            n = tokens[expert]
            on_host = host_done + c.host(n)
            lands = landing.get(expert)
            on_device = (link_done + c.link if lands is None else lands) + c.device(n)
            if on_host < on_device:
                host.append(expert)
                host_done = on_host
            else:
                fetch.append(expert)
                if lands is None:
                    link_done += c.link
        return fetch, host
