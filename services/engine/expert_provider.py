"""Where the MoE layer gets expert weights: the seam the offload runtime plugs into."""

from __future__ import annotations

import ctypes
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias

import torch

from services.engine.step_context import StepContext

if TYPE_CHECKING:
    from services.engine.cpu_kernels.moe_calls import ExpertCall
    from services.engine.models.fused_moe import StackedExperts
    from services.engine.models.native_moe import NativeExperts
    from services.engine.quant.packed import QuantizedExpertWeights


@dataclass
class ExpertWeights:
    gate_up: torch.Tensor  # [2 * intermediate, hidden]: gate rows then up rows, one matmul for both
    down: torch.Tensor  # [hidden, intermediate]
    # The native kernels' one-expert call on these tensors, made on first use (models/moe.py expert_forward);
    # False where they cannot read them. A host store's and a cache slot's views live as long as their buffers.
    native: ExpertCall | Literal[False] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return self.gate_up.numel() * self.gate_up.element_size() + self.down.numel() * self.down.element_size()


# One expert's weights as stored: dense, or packed int8/int4 (services/engine/quant/packed.py).
StoredWeights: TypeAlias = "ExpertWeights | QuantizedExpertWeights"

# A host expert computed in place: its output added straight into the MoE layer's output by the thread that
# gathers the layer (the native call the layer's own experts take), not into rows of its own and then added by
# a second call. False: these weights need the general path.
HostSink: TypeAlias = "Callable[[StoredWeights], bool]"


class HostResult(Protocol):
    """A host computation's output, gathered by the MoE layer (a Future, or the host executor's HostJob):
    None once its sink has added it into the layer's output."""

    def result(self) -> torch.Tensor | None: ...


class HostCompute(Protocol):
    """What computes host-placed experts: the engine's HostExecutor, or the simulator's host timeline."""

    def submit(
        self, weights: StoredWeights, x: torch.Tensor, activation: bool = False, share: float = 1.0,
        sink: HostSink | None = None,
    ) -> HostResult: ...

    def flush(self, wake: bool = True) -> None: ...

    def backlog_seconds(self) -> float: ...

    def shutdown(self) -> None: ...


@dataclass
class CachedBatch:
    """A layer's device experts whose weights sit ready in the cache's slots, computed by one native MoE call
    (the resident engine's): `slots` holds every slot's matrices, `matrix_of` each expert id's slot, -1 for the
    experts left to `get`."""

    experts: list[int]
    slots: NativeExperts
    matrix_of: ctypes.Array


@dataclass
class LayerPlan:
    """Where one layer's experts are computed: `device` in this order (weights from `get`), `host` by the
    provider itself (`host_forward`, started before the device loop so both sides overlap), `split`: the
    activation on the host (`host_activation`), the down projection on the device (`get_down`)."""

    device: list[int]
    host: list[int] = field(default_factory=list)
    split: list[int] = field(default_factory=list)


class ExpertProvider(ABC):
    """Gives the MoE layer one expert's weights at a time, or computes an expert where its weights live.

    Per MoE layer and step: `begin_layer` with the step's expert set right after the router (the provider may
    queue fetches, choose the compute order and keep some experts on the host), `host_forward` for each host
    expert, `dispatched`, `get` for each device expert in order, then `end_layer`.
    """

    @abstractmethod
    def begin_layer(
        self, layer: int, experts: list[int], ctx: StepContext, tokens: list[int] | None = None
    ) -> LayerPlan:
        """Places `experts` (`tokens[i]` tokens routed to `experts[i]`; None: one each)."""

    @abstractmethod
    def get(self, layer: int, expert: int) -> StoredWeights: ...

    def cached_batch(self, layer: int, experts: list[int], wait: bool = False) -> CachedBatch | None:
        """Those of the plan's device `experts` ready in the cache now, for one native call before any `get`;
        `wait`: also those with a slot still loading, once landed. They stay pinned until the next
        `cached_batch`, `get` or `end_layer`. None: each goes through `get`."""
        return None

    def host_forward(self, layer: int, expert: int, x: torch.Tensor, sink: HostSink | None = None) -> HostResult:
        """Computes a host-placed expert on its tokens `x`; the result lands on x's device (or, by `sink`, in
        the layer's output)."""
        raise NotImplementedError(f"{type(self).__name__} computes every expert on the device")

    def host_activation(self, layer: int, expert: int, x: torch.Tensor) -> HostResult:
        """A split expert's gate/up half on the host: its activation [tokens, intermediate] on x's device."""
        raise NotImplementedError(f"{type(self).__name__} splits no expert")

    def get_down(self, layer: int, expert: int) -> torch.Tensor:
        """A split expert's down matrix on the device, once its transfer has landed."""
        raise NotImplementedError(f"{type(self).__name__} splits no expert")

    def dispatched(self, layer: int, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """Called once the layer's host work is handed over, before the device computes: the time for guesses
        about later layers (prefetches), which must not delay the host's start."""

    def end_layer(self, layer: int, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """Called once the layer's experts are computed (unpin slots)."""

    def end_step(self, ctx: StepContext) -> None:  # noqa: B027 - optional hook
        """Called after the last layer of a step."""

    def stacked_experts(self, layer: int) -> StackedExperts | None:
        """The layer's experts stacked for the fused path, when they all stay resident and dense; else None."""
        return None

    def native_experts(self, layer: int) -> NativeExperts | None:
        """The layer's experts for the one-call native MoE (resident, on the CPU, kernels built); else None."""
        return None

    @property
    def native_epoch(self) -> int:
        """Changes whenever native_experts' answers may have (what the model built from them is rebuilt)."""
        return 0

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

    def __init__(
        self, experts: list[list[StoredWeights] | None], stacked: list[StackedExperts | None] | None = None,
        native: list[NativeExperts | None] | None = None,
    ) -> None:
        self._experts = experts  # indexed [layer][expert]; None for dense layers
        self._stacked = stacked or [None] * len(experts)  # views of the same memory as `experts` where set
        self._native = native or [None] * len(experts)  # the same memory again, as the native kernels read it

    def begin_layer(
        self, layer: int, experts: list[int], ctx: StepContext, tokens: list[int] | None = None
    ) -> LayerPlan:
        return LayerPlan(experts)

    def get(self, layer: int, expert: int) -> StoredWeights:
        experts = self._experts[layer]
        assert experts is not None, f"layer {layer} has no routed experts"
        return experts[expert]

    def stacked_experts(self, layer: int) -> StackedExperts | None:
        return self._stacked[layer]

    def native_experts(self, layer: int) -> NativeExperts | None:
        return self._native[layer]

    @property
    def device_bytes(self) -> int:
        packed = sum(s.packed_bytes for s in self._stacked if s is not None)  # oneDNN's copies (CPU fp32)
        return sum(w.nbytes for layer in self._experts if layer for w in layer) + packed
