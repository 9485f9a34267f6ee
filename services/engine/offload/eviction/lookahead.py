"""Layer-lookahead eviction: evict the expert whose layer comes round again last, then the least likely one.

Decoding visits layers in a fixed cycle, so the experts of the layers just computed are the ones needed
furthest in the future (one whole pass later), while LRU evicts exactly the layers about to run. Ranking
by layer distance first approximates Belady's optimum for this cyclic access; within a layer, FineMoE's
1/(p * freq) picks the expert least likely to be asked for.
"""

from __future__ import annotations

from services.engine.offload.eviction.base import Key
from services.engine.offload.eviction.finemoe import FineMoEEviction
from services.engine.step_context import StepContext


class LookaheadEviction(FineMoEEviction):
    name = "lookahead"

    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.num_layers = num_layers

    def victim(self, candidates: list[Key], ctx: StepContext | None, layer_now: int) -> Key:
        L = self.num_layers
        return max(candidates, key=lambda k: ((k[0] - layer_now - 1) % L, self.priority(k)))
