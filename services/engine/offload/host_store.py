"""Every expert's weights in host memory: one contiguous buffer per expert, each a view of one buffer a layer,
pinned when a CUDA device copies from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from tqdm import tqdm

from services.engine.expert_format import ExpertLayout
from services.engine.expert_provider import StoredWeights
from services.engine.host_allocator import huge_page_empty, pinned_empty
from services.engine.models.spec import ModelSpec
from services.engine.models.weights import WeightReader, expert_loader, read_ahead
from services.engine.quant.layout import StoredLayout

Key = tuple[int, int]  # (layer, expert)


class ExpertStore(Protocol):
    """Every expert in host memory, as the offloaded provider reads it (the simulator's stand-in holds none)."""

    @property
    def layout(self) -> StoredLayout: ...

    @property
    def buffers(self) -> Mapping[Key, torch.Tensor]: ...

    @property
    def expert_bytes(self) -> int: ...

    def weights(self, key: Key) -> StoredWeights: ...


class HostExpertStore:
    def __init__(self, reader: WeightReader, spec: ModelSpec, pin: bool, layout: StoredLayout | None = None) -> None:
        self.layout = layout or ExpertLayout(spec.hidden_size, spec.moe_intermediate_size, reader.dtype)
        self.dtype = self.layout.dtype
        self.buffers: dict[Key, torch.Tensor] = {}
        self._views: dict[Key, StoredWeights] = {}
        layers = [layer for layer in range(spec.num_layers) if spec.moe_layers[layer]]
        for layer in tqdm(layers, desc="host expert store", unit="layer", leave=False):
            # Each expert is packed (and converted) into its buffer as soon as it is read: read as stored, into
            # buffers the reads reuse (weights.read_ahead).
            load = expert_loader(reader, spec, layer, as_stored=True, transient=True)
            # One buffer a layer on huge pages, which the host's kernels stream faster; pinned for the copy
            # engine where a device reads it, with exactly its bytes (host_allocator.pinned_empty says why not
            # torch's pinned memory).
            shape = (spec.num_experts, self.layout.numel)
            layer_buffer = pinned_empty(shape, self.dtype) if pin else huge_page_empty(shape, self.dtype)
            for expert, w in enumerate(read_ahead(load, spec.num_experts, "cpu")):  # never placed on the device
                self.layout.pack(w, layer_buffer[expert])
                self.buffers[(layer, expert)] = layer_buffer[expert]

    @property
    def expert_bytes(self) -> int:
        return self.layout.nbytes

    @property
    def total_bytes(self) -> int:
        return self.expert_bytes * len(self.buffers)

    def weights(self, key: Key) -> StoredWeights:
        views = self._views.get(key)
        if views is None:  # built once: a host expert's views are asked for on every miss
            views = self._views[key] = self.layout.views(self.buffers[key])
        return views
