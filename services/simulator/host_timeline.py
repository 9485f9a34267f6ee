"""The host's timeline in a simulation: the engine's HostExecutor without threads.

A host job starts when the compute side hands it over (or when the host finishes what it already holds)
and takes the cost model's host price for its tokens; the compute side stalls only when it gathers a job
that has not finished. The placement reads the same prices (Fiddler's rule, as the engine's start-up
measurement feeds it).
"""

from __future__ import annotations

import torch

from services.engine.offload.cost_model import PROBE_TOKENS, PlacementCosts
from services.engine.offload.stats import OffloadStats
from services.simulator.hardware import CostModel
from services.simulator.timeline import SimClock


class SimHostJob:
    def __init__(self, done_at: float) -> None:
        self.done_at = done_at


class SimHostExecutor:
    def __init__(self, cost: CostModel, clock: SimClock, stats: OffloadStats) -> None:
        self.cost = cost
        self.clock = clock
        self.stats = stats
        self.free_at = 0.0
        self.busy_seconds = 0.0
        self.blocked = 0.0  # compute stalled gathering host results

    def submit(self, weights: object, x: torch.Tensor, activation: bool = False, share: float = 1.0) -> SimHostJob:
        tokens = x.shape[0]
        seconds = share * self.cost.host_expert_seconds(tokens)
        self.stats.host_split_experts += activation
        self.free_at = max(self.clock.now, self.free_at) + seconds
        self.busy_seconds += seconds
        self.stats.host_experts += 1
        self.stats.host_tokens += tokens
        self.stats.host_busy_seconds += seconds
        return SimHostJob(self.free_at)

    def backlog_seconds(self) -> float:
        return max(0.0, self.free_at - self.clock.now)

    def gather(self, job: SimHostJob) -> None:
        if job.done_at > self.clock.now:
            self.blocked += job.done_at - self.clock.now
            self.clock.blocked += job.done_at - self.clock.now
            self.clock.now = job.done_at

    def shutdown(self) -> None:
        pass


def placement_costs(cost: CostModel, expert_bytes: int) -> PlacementCosts:
    """The prices the engine measures at start-up, read off the simulator's cost model."""
    ends = (1, PROBE_TOKENS)
    return PlacementCosts.fit(
        tuple(cost.expert_seconds(n) for n in ends),  # type: ignore[arg-type]
        tuple(cost.host_expert_seconds(n) for n in ends),  # type: ignore[arg-type]
        expert_bytes / cost.link_bytes_per_second,
    )


def token_slice(tokens: int) -> torch.Tensor:
    """What the sim hands `host_forward`: only its row count (the tokens) is read."""
    return torch.empty(tokens, 0)
