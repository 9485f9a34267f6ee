"""Where the MoE layer gets expert weights: the seam the offload runtime plugs into."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from services.engine.step_context import StepContext


@dataclass
class ExpertWeights:
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate rows then up rows, one matmul for both
    down: torch.Tensor  # [hidden, intermediate]

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()


class ExpertProvider(ABC):
    """Gives the MoE layer one expert's weights at a time.

    Per MoE layer and step: `begin_layer` with the step's expert set right after the router (the provider may
    queue fetches and choose the compute order), `get` for each expert in that order, then `end_layer`.
    """

    @abstractmethod
    def begin_layer(self, layer: int, experts: list[int], ctx: StepContext) -> list[int]:
        """Returns the order in which the layer should compute `experts`."""

    @abstractmethod
    def get(self, layer: int, expert: int) -> ExpertWeights: ...

    def end_layer(self, layer: int, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """Called once the layer's experts are computed (unpin slots)."""

    def end_step(self, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """Called after the last layer of a step."""

    def engine_stats(self) -> dict[str, float]:
        """Counters for the engine's Stats RPC (offload hits, bytes moved, ...)."""
        return {}

    @property
    @abstractmethod
    def device_bytes(self) -> int:
        """Bytes of expert weights this provider keeps on the compute device."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Stops background work (transfer threads)."""


class ResidentExpertProvider(ExpertProvider):
    """Every expert lives on the compute device: no offload (the speed bound)."""

    def __init__(self, experts: list[list[ExpertWeights] | None]) -> None:
        self._experts = experts  # indexed [layer][expert]; None for dense layers

    def begin_layer(self, layer: int, experts: list[int], ctx: StepContext) -> list[int]:
        return experts

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self._experts[layer][expert]  # type: ignore[index]

    @property
    def device_bytes(self) -> int:
        return sum(w.nbytes for layer in self._experts if layer for w in layer)
