"""What the MoE layers learn about the step they run in (phase, batch composition, routing so far)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch


class Phase(str, Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class StepContext:
    phase: Phase
    request_ids: list[str]
    num_tokens: int
    step_index: int = 0
    seq_lens: list[int] = field(default_factory=list)  # tokens per request in this step, in batch order
    iterations: list[int] = field(default_factory=list)  # per request: 0 = prefill, n = n-th decode step
    # per request: tokens already cached before this step's (a chunked prefill's later chunks; empty: none)
    cached_lens: list[int] = field(default_factory=list)
    # Filled layer by layer as the step runs, for prefetchers and trace recording.
    embeddings: torch.Tensor | None = None  # [tokens, hidden]: the step's input embeddings (semantic key)
    router_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    # The current layer's input only, unless keep_layer_inputs: every layer's would hold num_layers x tokens x
    # hidden floats through a prefill (805 MB for a 2048-token step at Qwen3-30B-A3B's 48 layers).
    layer_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    keep_layer_inputs: bool = False  # a step observer reads every layer's (ModelRunner.keep_layer_inputs)
    selected_experts: dict[int, torch.Tensor] = field(default_factory=dict)
    # layer -> observers told right after that layer's routing is in (ModelRunner.layer_observers).
    layer_observers: dict[int, list[Callable[[int, StepContext], None]]] = field(default_factory=dict)

    @property
    def is_prefill(self) -> bool:
        return self.phase is Phase.PREFILL

    def record_layer_input(self, layer: int, h: torch.Tensor) -> None:
        """The residual stream entering layer's MoE block (speculative prefetch reads it during the layer)."""
        if not self.keep_layer_inputs:
            self.layer_inputs.clear()
        self.layer_inputs[layer] = h

    def layer_routed(self, layer: int) -> None:
        """Called by the MoE layer once its routing is recorded: runs that layer's observers (enqueue only)."""
        observers = self.layer_observers.get(layer)
        if observers:
            for observe in observers:
                observe(layer, self)
