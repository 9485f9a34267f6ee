"""The host's timeline in a simulation: the engine's HostExecutor without threads.

A host job starts when the compute side hands it over (or when the host finishes what it already holds)
and takes the cost model's host price for its tokens while it has the DRAM to itself; it reads the expert's
bytes from the DRAM the link's copies read too (offload/memory_bus.py), so while both run each goes slower.
The compute side stalls only when it gathers a job that has not finished. The placement reads the same prices (Fiddler's rule, as the engine's start-up
measurement feeds it).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from services.engine.expert_provider import HostResult
from services.engine.offload.cost_model import PROBE_TOKENS, PlacementCosts
from services.engine.offload.memory_bus import HOST_LANE, BusJob
from services.engine.offload.stats import OffloadStats
from services.simulator.hardware import CostModel
from services.simulator.timeline import SimClock, SimTransferEngine


class SimHostJob:
    """A host job on the simulated DRAM: its time is all there is (the MoE layer never reads an output)."""

    def __init__(self, job: BusJob) -> None:
        self.job = job

    def result(self) -> torch.Tensor:
        return torch.empty(0)


class SimHostExecutor:
    def __init__(
        self, cost: CostModel, clock: SimClock, stats: OffloadStats, transfers: SimTransferEngine, expert_bytes: int
    ) -> None:
        self.cost = cost
        self.clock = clock
        self.stats = stats
        self.transfers = transfers  # its copy engine shares the DRAM (transfers.bus)
        self.bus = transfers.bus
        self.expert_bytes = expert_bytes
        self.blocked = 0.0  # compute stalled gathering host results

    def submit(self, weights: object, x: torch.Tensor, activation: bool = False, share: float = 1.0,
               sink: object = None) -> SimHostJob:
        """The job's time on the host; the simulator computes nothing, so `sink` is not called."""
        tokens = x.shape[0]
        seconds = share * self.cost.host_expert_seconds(tokens)
        self.stats.host_split_experts += activation
        self.transfers.advance()  # the chunks the link starts before now are on the DRAM first
        nbytes = share * self.expert_bytes
        job = self.bus.add(HOST_LANE, nbytes, nbytes / seconds, self.clock.now)
        self.stats.host_experts += 1
        self.stats.host_tokens += tokens
        self.stats.host_busy_seconds += seconds
        return SimHostJob(job)

    def flush(self, wake: bool = True) -> None:
        """The layer's jobs started as they were submitted (the hand-off's cost: HOST_PATH_S, priced per layer)."""

    def backlog_seconds(self) -> float:
        last = self.bus.last(HOST_LANE)
        return 0.0 if last is None else max(0.0, self.bus.finish(last) - self.clock.now)

    def gather(self, result: HostResult) -> None:
        """Compute stalls until `result`'s job is done. Nothing is submitted meanwhile, so the copy engine runs
        ahead to the projected finish; each chunk it starts before then slows the job, and the finish is
        projected again."""
        assert isinstance(result, SimHostJob)  # one of ours: the provider's host jobs all come from submit
        job = result.job
        done = self.bus.finish(job)
        while done > self.clock.now:
            self.transfers.advance(done)
            later = self.bus.finish(job)
            if later <= done:
                break
            done = later
        if done > self.clock.now:
            self.blocked += done - self.clock.now
            self.clock.blocked += done - self.clock.now
            self.clock.now = done

    def shutdown(self) -> None:
        pass


def placement_costs(cost: CostModel, expert_bytes: int) -> PlacementCosts:
    """The prices the engine measures at start-up, read off the simulator's cost model."""
    costs = PlacementCosts.fit(
        (cost.expert_seconds(1), cost.expert_seconds(PROBE_TOKENS)),
        (cost.host_expert_seconds(1), cost.host_expert_seconds(PROBE_TOKENS)),
        expert_bytes / cost.link_bytes_per_second,
    )
    return replace(costs, dram=cost.dram_bytes_per_second(expert_bytes), host_bytes=expert_bytes, link_bytes=expert_bytes)


def token_slice(tokens: int) -> torch.Tensor:
    """What the sim hands `host_forward`: only its row count (the tokens) is read."""
    return torch.empty(tokens, 0)
