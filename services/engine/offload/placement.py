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
        # Each side's queue done, bounded without a projection on the bus: a lane's jobs run one after another,
        # each at best at min(cap, dram) and at worst, beside the other lane, at min(cap, dram / 2) (max-min
        # fair), so the host is done at worst by its time at best plus all the link's at worst. A miss whose host
        # finish at worst is no later than the other sides' at best goes to the host, as the projections would
        # decide; they were most of a decode layer's placement time.
        host_worst, host_best = self._worst(host_jobs[0]), self._best(host_jobs[0])
        link_best, link_worst = self._best(link_jobs[0]), self._worst(link_jobs[0])
        placed = Placed([], [], [])
        for expert in sorted(misses, key=lambda e: -tokens[e]):
            n = tokens[expert]
            lands = landing.get(expert)
            alone = self._host_job(c.host(n), n)
            fetched = self._link_job(c.link)
            pieces, split_device = None, 0.0
            if lands is None and len(placed.split) < split_room and part is not None:
                pieces = (self._host_job(part.host * c.host(n), n), self._link_job(part.link * c.link))
                split_device = part.device * c.device(n)
            device_best = (link_best + self._best(fetched) if lands is None else lands) + c.device(n)
            halves_best = math.inf if pieces is None else (
                max(host_best + self._best(pieces[0]), link_best + self._best(pieces[1])) + split_device)
            host_done = min(host_worst + self._worst(alone), host_best + self._best(alone) + link_worst)
            on_host = host_done <= min(device_best, halves_best)
            if on_host:
                on_device = halves = math.inf
            else:
                on_host_done = self._finish(host_jobs + [alone], link_jobs)[0]
                on_device = (self._finish(host_jobs, link_jobs + [fetched])[1] if lands is None else lands) + c.device(n)
                halves = math.inf
                if pieces is not None:
                    halves = max(self._finish(host_jobs + [pieces[0]], link_jobs + [pieces[1]])) + split_device
                on_host = on_host_done <= on_device and on_host_done <= halves
            if on_host:
                placed.host.append(expert)
                queued_host, queued_link = [alone], []
            elif halves < on_device:
                placed.split.append(expert)
                assert pieces is not None  # halves is finite only when priced
                queued_host, queued_link = [pieces[0]], [pieces[1]]
            else:
                placed.fetch.append(expert)
                queued_host, queued_link = [], [fetched] if lands is None else []
            host_jobs += queued_host
            link_jobs += queued_link
            host_worst += sum(self._worst(job) for job in queued_host)
            host_best += sum(self._best(job) for job in queued_host)
            link_best += sum(self._best(job) for job in queued_link)
            link_worst += sum(self._worst(job) for job in queued_link)
        return placed

    # Each side's queued work as (seconds alone, bytes/s it draws alone from the DRAM): the host reads an expert's
    # bytes in its time for the tokens, the link at its rate.
    def _host_job(self, seconds: float, tokens: int) -> tuple[float, float]:
        return seconds, self.costs.host_bytes / self.costs.host(tokens)

    def _link_job(self, seconds: float) -> tuple[float, float]:
        return seconds, self.costs.link_bytes / self.costs.link

    def _best(self, job: tuple[float, float]) -> float:
        """A job's seconds with the DRAM to itself."""
        seconds, cap = job
        return seconds * cap / min(cap, self.costs.dram) if seconds > 0 else 0.0

    def _worst(self, job: tuple[float, float]) -> float:
        """A job's seconds beside the other lane's, drawing all it can."""
        seconds, cap = job
        return seconds * cap / min(cap, self.costs.dram / 2) if seconds > 0 else 0.0

    def _finish(self, host: list[tuple[float, float]], link: list[tuple[float, float]]) -> tuple[float, float]:
        """When each side's queued jobs are done, both reading the one DRAM from now."""
        if math.isinf(self.costs.dram):
            return sum(s for s, _ in host), sum(s for s, _ in link)
        bus = MemoryBus(self.costs.dram)
        lasts = [[bus.add(lane, seconds * cap, cap, 0.0) for seconds, cap in jobs if seconds > 0][-1:]
                 for lane, jobs in ((HOST_LANE, host), (LINK_LANE, link))]
        host_done, link_done = (bus.finish(last[0]) if last else 0.0 for last in lasts)
        return host_done, link_done

    def layer_seconds(self, placed: Placed, tokens: dict[int, int]) -> float:
        """When a layer whose misses are placed so is done, both sides idle at its start: the host's queue, and
        the link's followed by the device's part of what it brought."""
        c, part = self.costs, self.split_prices
        host = [self._host_job(c.host(tokens[e]), tokens[e]) for e in placed.host]
        link = [self._link_job(c.link) for _ in placed.fetch]
        device = sum(c.device(tokens[e]) for e in placed.fetch)
        if placed.split:
            assert part is not None  # only a splitting placement splits
            host += [self._host_job(part.host * c.host(tokens[e]), tokens[e]) for e in placed.split]
            link += [self._link_job(part.link * c.link) for _ in placed.split]
            device += sum(part.device * c.device(tokens[e]) for e in placed.split)
        host_done, link_done = self._finish(host, link)
        return max(host_done, link_done + device)

    def split_seconds(self, tokens: int, host_done: float = 0.0, link_done: float = 0.0) -> float:
        part, c = self.split_prices, self.costs
        if part is None:
            return float("inf")
        host = [self._host_job(host_done, 1), self._host_job(part.host * c.host(tokens), tokens)]
        link = [self._link_job(link_done), self._link_job(part.link * c.link)]
        return max(self._finish(host, link)) + part.device * c.device(tokens)
