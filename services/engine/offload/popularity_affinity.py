"""DuoServe's popularity vector and inter-layer affinity matrix (seed 000 section 4.1, eq. 2-3), as counts.

popularity[l, e]: how often layer l selected expert e (eq. 2). affinity[l, i, j]: how often a selection of i
at layer l was followed by j at layer l's successor (eq. 3). Counts start at one (a Laplace prior: uniform
before any data) and grow online. One implementation for the engine's `affinity` prefetcher (model layers,
each linked to the next MoE layer, per-token selections) and the predictor's `popularity-affinity`
predictor (traced layers, each linked to the next, per-iteration selections).
"""

from __future__ import annotations

import numpy as np


class PopularityAffinity:
    def __init__(self, num_layers: int, num_experts: int, num_links: int | None = None) -> None:
        links = num_layers - 1 if num_links is None else num_links
        self.pop_counts = np.ones((num_layers, num_experts), np.float64)
        self.aff_counts = np.ones((max(links, 0), num_experts, num_experts), np.float64)
        self._normalised: tuple[np.ndarray, np.ndarray] | None = None

    def add_selections(self, counts: np.ndarray, layer: int | None = None) -> None:
        """counts: [experts] selections at `layer`, or [layers, experts] at every layer (layer None)."""
        if layer is None:
            self.pop_counts += counts
        else:
            self.pop_counts[layer] += counts
        self._normalised = None

    def add_pairs(self, pairs: np.ndarray, link: int | None = None) -> None:
        """pairs: [experts, experts] joint selections (i at `link`, j at its successor), or one per link."""
        if link is None:
            self.aff_counts += pairs
        else:
            self.aff_counts[link] += pairs
        self._normalised = None

    def normalised(self) -> tuple[np.ndarray, np.ndarray]:
        """(popularity [layers, experts], affinity rows [links, experts, experts]) as float32 distributions."""
        if self._normalised is None:
            pop = (self.pop_counts / self.pop_counts.sum(1, keepdims=True)).astype(np.float32)
            aff = (self.aff_counts / self.aff_counts.sum(2, keepdims=True)).astype(np.float32)
            self._normalised = (pop, aff)
        return self._normalised
