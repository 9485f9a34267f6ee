"""The physical bound of a decode run: what no offload policy can beat on this hardware, cache and routing.

Every routed expert the cache does not hold when its layer runs is read from the host's DRAM once: computed
there, or copied over the link into a slot. The fewest such misses any placement of the cache can have, m_v for
layer visit v (one layer of one step), is the optimal offline caching with bypass (offline_cache.fewest_misses).
A miss is served one of two ways, and they are not alike in *when* they can run:

- a link copy can be made at any time before its layer (a perfect placement knows the future), so the link's
  work spreads over the whole run;
- a host-computed miss needs its layer's input and the next layer waits for its result, so it runs inside its
  own layer visit, after the layer's attention and beside its device experts, and adds the host path's sync.

Both read the one DRAM (`dram` bytes/s between them). With h_v of visit v's misses on the host (a fraction
counts: a split expert is part host, part link), the visit takes

    t_v(h) = a_v + max(e_v - h * p_v, h * c_host) + sync * [h > 0]

(a_v: attention, router and shared parts; e_v: its routed experts on the device; p_v: the most one of them
takes there; c_host: one miss on the host, at most at the DRAM's rate), and during it the link moves at most
cap_v(h) = min(t_v / c_link, (dram * t_v - h * b_host) / b_link) misses. The run needs

    minimise  T = sum_v t_v(h_v) + F + w   subject to   sum_v (cap_v(h_v) - (m_v - h_v)) + r (F + w) >= 0

with F the head and dense layers' time, w any time the device waits on the link, and r = min(1 / c_link,
dram / b_link) the link's miss rate alone. Its Lagrangian dual, max over 0 <= lam <= 1/r of

    L(lam) = sum_v min_{0<=h<=m_v} [t_v(h) - lam (cap_v(h) - (m_v - h))] + F (1 - lam r),

is a lower bound on T for every lam (weak duality), with each visit's minimum exact (t and cap are piecewise
linear in h: their breakpoints are the candidates). With no host (transfer-only) it is the device time plus the
misses the link cannot hide behind it at the link's rate. What it leaves out, so it stays a bound: the link's
slots (a prefetched expert needs room), copies before the decode run, and the device slowed by landing copies.
The host computes misses only: a resident expert is many times faster on the device (splitting one with the
host would save under 1% of a simulated Mixtral layer), and no policy does it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from services.engine.step_context import Phase
from services.simulator.hardware import CostModel
from services.simulator.host import HOST_PATH_S
from services.simulator.offline_cache import fewest_misses, static_misses
from services.simulator.workload import Workload


@dataclass(frozen=True)
class Bound:
    seconds: float  # the decode run's
    device_seconds: float  # every expert resident
    miss_bytes: float
    miss_layers: int  # layer visits with a miss
    steps: int

    @property
    def tpot_ms(self) -> float:
        return self.seconds * 1e3 / max(1, self.steps)


@dataclass(frozen=True)
class Side:
    """One way a miss is served: `seconds` per miss alone, `dram_bytes` it reads from the host's DRAM."""

    seconds: float
    dram_bytes: float


@dataclass
class Visits:
    """The decode run's MoE layer visits, one entry each (see the module's docstring for the symbols)."""

    fixed: list[float]  # a_v
    experts: list[float]  # e_v
    per_expert: list[float]  # p_v
    misses: list[int]  # m_v
    free_seconds: float = 0.0  # F: the head and the dense layers

    def add(self, fixed: float, experts: float, per_expert: float, misses: int) -> None:
        self.fixed.append(fixed)
        self.experts.append(experts)
        self.per_expert.append(per_expert)
        self.misses.append(misses)


def physical_bound(visits: Visits, steps: int, link: Side, host: Side | None, dram: float, sync: float) -> Bound:
    """The dual bound of the module's docstring; `host` None: nothing computed on the host."""
    a, e, p = (np.asarray(x, dtype=float) for x in (visits.fixed, visits.experts, visits.per_expert))
    m = np.asarray(visits.misses, dtype=float)
    rate = min(1 / link.seconds, dram / link.dram_bytes)
    c_host = max(host.seconds, host.dram_bytes / dram) if host is not None else 0.0
    b_host = host.dram_bytes if host is not None else 0.0

    def time(h: np.ndarray) -> np.ndarray:
        return a + np.maximum(e - h * p, h * c_host) + sync * (h > 0)

    def surplus(h: np.ndarray) -> np.ndarray:
        t = time(h)
        return np.minimum(t / link.seconds, (dram * t - h * b_host) / link.dram_bytes) - (m - h)

    candidates = [np.zeros_like(m)]
    if host is not None:
        slope = 1 / link.seconds - dram / link.dram_bytes  # of cap's two terms' difference in t
        for start, grow in ((a + e + sync, -p), (a + sync, np.full_like(m, c_host))):  # t's two pieces
            with np.errstate(divide="ignore", invalid="ignore"):
                candidates.append(np.nan_to_num(-start * slope / (grow * slope + b_host / link.dram_bytes)))
        with np.errstate(divide="ignore", invalid="ignore"):
            candidates.append(np.nan_to_num(e / (p + c_host)))  # where the host's time overtakes the device's
        candidates.append(m)
    hs = [np.clip(h, 0, m) for h in candidates]
    times, surpluses = [time(h) for h in hs], [surplus(h) for h in hs]

    def dual(lam: float) -> float:
        best = np.min([t - lam * s for t, s in zip(times, surpluses)], axis=0)
        return float(best.sum() + visits.free_seconds * (1 - lam * rate))

    lo, hi = 0.0, 1 / rate  # L is concave in lam: golden-section search, keeping the best value seen
    best = max(dual(lo), dual(hi))
    for _ in range(80):
        m1, m2 = lo + 0.382 * (hi - lo), hi - 0.382 * (hi - lo)
        d1, d2 = dual(m1), dual(m2)
        best = max(best, d1, d2)
        lo, hi = (lo, m2) if d1 >= d2 else (m1, hi)
    device = float((a + e).sum()) + visits.free_seconds
    count = float(m.sum())
    return Bound(best, device, count * link.dram_bytes, int((m > 0).sum()), steps)


def simulated_bounds(
    workload: Workload, cost: CostModel, slots: int | None, warmup_steps: int = 0
) -> tuple[Bound, Bound]:
    """(the bound, the best static placement's figure) of a simulated run's decode steps (from the
    `warmup_steps`-th on) with a cache of `slots` experts, empty at the start as the policies' are for the bound
    (None: every expert resident from the start)."""
    spec = workload.spec
    steps = workload.routing_trace().steps
    counted = [s for s in workload.steps if s.phase is Phase.DECODE and s.index >= warmup_steps]
    size = spec.expert_bytes
    link, host = Side(size / cost.link_bytes_per_second, size), Side(cost.host_expert_seconds(1), size)
    dram = cost.dram_bytes_per_second(size)

    # The device's side of every visit, priced once; only the misses differ between the two figures.
    resident = Visits([], [], [], [])
    at: list[tuple[int, int]] = []  # each visit's (step index, layer)
    for step in counted:
        ctx, shape = workload.context(step), step.shape
        resident.free_seconds += cost.head_seconds(shape)
        for layer in range(spec.num_layers):
            fixed = cost.layer_seconds(layer, shape)
            if not spec.moe_layers[layer]:
                resident.free_seconds += fixed
                continue
            experts = [cost.expert_seconds(n) for n in workload.route(step, layer, ctx).values()]
            resident.add(fixed, sum(experts), max(experts, default=0.0), 0)
            at.append((step.index, layer))

    def bound(misses: list[list[int]]) -> Bound:
        visits = dataclasses.replace(resident, misses=[misses[s][layer] for s, layer in at])
        return physical_bound(visits, len(counted), link, host, dram, HOST_PATH_S)

    if slots is None:
        everything = physical_bound(resident, len(counted), link, host, dram, HOST_PATH_S)
        return everything, everything
    return bound(fewest_misses(steps, slots)), bound(static_misses(steps, slots))
