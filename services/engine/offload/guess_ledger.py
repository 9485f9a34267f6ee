"""Who guessed what, for the hybrid provider's prefetch gate (offload/prefetch_gate.py).

Which prefetcher filled each prefetched slot, and which evicted each recent victim: a miss on a victim is a
hit that prefetcher displaced. The gate is credited for the guesses a layer then computes on the device and
debited for the misses the guesses (or the prefetches' reserve beside the hot set) caused.
"""

from __future__ import annotations

from services.engine.offload.expert_cache import ExpertCache, Slot
from services.engine.offload.prefetch_gate import PrefetchGate

Owed = tuple[int, int, bool]  # (expert, id(prefetcher), landed): a guess this layer uses


class GuessLedger:
    def __init__(self) -> None:
        self.asking: int | None = None  # id() of the prefetcher planning now; None: the hot-set fill
        self._issuer: dict[int, int | None] = {}  # slot index -> id(prefetcher)
        self._ghosts: dict[int, dict[int, int]] = {}  # layer -> expert a prefetch evicted -> id(prefetcher)

    def started(self, slot: Slot, evicted: Slot | None) -> None:
        """A prefetch took `slot` for the prefetcher asking now, evicting `evicted`."""
        self._issuer[slot.index] = self.asking
        if evicted is not None and evicted.key is not None and self.asking is not None:
            layer, expert = evicted.key
            self._ghosts.setdefault(layer, {})[expert] = self.asking

    def settle(self, gate: PrefetchGate, cache: ExpertCache, layer: int, experts: list[int]) -> list[Owed]:
        """Debits each miss a prefetch's eviction caused (the victim's layer asked for it again on its next
        visit: a hit had it stayed) or the prefetches' reserve caused (the whole budget's hot set holds it);
        returns the guesses this layer uses, credited (`credit`) once placement shows where they run."""
        ghosts = self._ghosts.pop(layer, {})
        reserved = cache.eviction.reserved
        owed = []
        for expert in experts:
            slot = cache.lookup((layer, expert))
            if slot is None:
                if expert in ghosts:
                    gate.credit(ghosts[expert], -1.0)
                elif (layer, expert) in reserved:
                    gate.charge_reserve(1.0)
            elif slot.prefetched:
                issuer = self._issuer.get(slot.index)
                if issuer is not None:
                    owed.append((expert, issuer, slot.ready))
        return owed

    @staticmethod
    def credit(gate: PrefetchGate, owed: list[Owed], on_device: list[int]) -> None:
        """A guess computed on the device saved a miss (some of it, if it landed late)."""
        for expert, issuer, ready in owed:
            if expert in on_device:
                gate.credit(issuer, 1.0 if ready else 0.5)
