"""The shape of a model's routed experts: what offload policies, caches and the simulator need to know.

Both the engine's ModelSpec (read from a checkpoint) and the simulator's MoEModelSpec (real-size models on
paper) satisfy ExpertGeometry, so one set of constructors serves the engine and the simulator.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ExpertGeometry(Protocol):
    @property
    def hidden_size(self) -> int: ...

    @property
    def moe_intermediate_size(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def num_experts(self) -> int: ...

    @property
    def top_k(self) -> int: ...

    @property
    def moe_layers(self) -> tuple[bool, ...]:
        """One entry per decoder layer; False: a dense MLP layer without experts."""
        ...

    @property
    def num_moe_layers(self) -> int: ...

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        ...


def expert_params(hidden_size: int, moe_intermediate_size: int) -> int:
    """gate and up ([intermediate, hidden] each) and down ([hidden, intermediate])."""
    return 3 * hidden_size * moe_intermediate_size


def expert_bytes(geometry: ExpertGeometry, dtype: torch.dtype) -> int:
    """Bytes of one routed expert stored unquantised in `dtype`."""
    return geometry.expert_params * dtype.itemsize


def total_experts(geometry: ExpertGeometry) -> int:
    return geometry.num_moe_layers * geometry.num_experts
