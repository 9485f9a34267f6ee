"""Placement of a layer's cache misses: fetch to the device, or compute on the host where the expert lives.

`HostPlacement` never moves an expert (llama.cpp `-ot exps=CPU`, `--n-cpu-moe`, KTransformers). `CostPlacement`
is Fiddler's rule with HybriMoE's balancing: misses, most tokens first, each go to whichever side finishes
it sooner given the work already queued there (host backlog; the link serialises this layer's fetches), both
sides reading one DRAM where the prices say how much it gives (offload/memory_bus.py: a fetch while the host
computes slows both).
With `split` prices it may also split an expert (offload/split_experts.py): gate/up on the host while down
crosses the link, both sides busy at once, which beats either side alone when neither is much faster.
Batched prefill keeps streaming experts to the device when the policy streams prefill (DuoServe): many
tokens per expert make host compute the slow side, and the rule would mostly agree anyway.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import NamedTuple

from services.engine.offload.cost_model import PlacementCosts
from services.engine.offload.memory_bus import HOST_LANE, LINK_LANE, MemoryBus
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
    costs: PlacementCosts | None = None  # the prices it weighs; None: it never weighs any (host only)
    split_prices: SplitPrices | None = None  # a split expert's share of each price; None: it never splits

    def split_seconds(self, tokens: int, host_done: float = 0.0, link_done: float = 0.0) -> float:
        """When a split expert would be done, both sides starting behind what they hold (inf: no splitting)."""
        return math.inf

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
        self.costs: PlacementCosts = costs
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
        host_jobs, link_jobs = [self._host_job(host_backlog, 1)], [self._link_job(link_backlog)]
        placed = Placed([], [], [])
        for expert in sorted(misses, key=lambda e: -tokens[e]):
            n = tokens[expert]
            lands = landing.get(expert)
            alone = self._host_job(c.host(n), n)
            on_host = self._finish(host_jobs + [alone], link_jobs)[0]
            fetched = self._link_job(c.link)
            on_device = (self._finish(host_jobs, link_jobs + [fetched])[1] if lands is None else lands) + c.device(n)
            halves, pieces = float("inf"), None
            if lands is None and len(placed.split) < split_room and part is not None:
                pieces = (self._host_job(part.host * c.host(n), n), self._link_job(part.link * c.link))
                halves = max(self._finish(host_jobs + [pieces[0]], link_jobs + [pieces[1]]))
                halves += part.device * c.device(n)
            if on_host <= on_device and on_host <= halves:
                placed.host.append(expert)
                host_jobs.append(alone)
            elif halves < on_device:
                placed.split.append(expert)
                assert pieces is not None  # halves is finite only when priced
                host_jobs.append(pieces[0])
                link_jobs.append(pieces[1])
            else:
                placed.fetch.append(expert)
                if lands is None:
                    link_jobs.append(fetched)
        return placed

    # Each side's queued work as (seconds alone, bytes/s it draws alone from the DRAM): the host reads an expert's
    # bytes in its time for the tokens, the link at its rate.
    def _host_job(self, seconds: float, tokens: int) -> tuple[float, float]:
        return seconds, self.costs.host_bytes / self.costs.host(tokens)

    def _link_job(self, seconds: float) -> tuple[float, float]:
        return seconds, self.costs.link_bytes / self.costs.link

    def _finish(self, host: list[tuple[float, float]], link: list[tuple[float, float]]) -> tuple[float, float]:
        """When each side's queued jobs are done, both reading the one DRAM from now."""
        if math.isinf(self.costs.dram):
            return sum(s for s, _ in host), sum(s for s, _ in link)
        bus = MemoryBus(self.costs.dram)
        lasts = [[bus.add(lane, seconds * cap, cap, 0.0) for seconds, cap in jobs if seconds > 0][-1:]
                 for lane, jobs in ((HOST_LANE, host), (LINK_LANE, link))]
        host_done, link_done = (bus.finish(last[0]) if last else 0.0 for last in lasts)
        return host_done, link_done

    def split_seconds(self, tokens: int, host_done: float = 0.0, link_done: float = 0.0) -> float:
        part, c = self.split_prices, self.costs
        if part is None:
            return float("inf")
        host = [self._host_job(host_done, 1), self._host_job(part.host * c.host(tokens), tokens)]
        link = [self._link_job(link_done), self._link_job(part.link * c.link)]
        return max(self._finish(host, link)) + part.device * c.device(tokens)
