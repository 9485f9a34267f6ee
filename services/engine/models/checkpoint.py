"""Lazy access to a Hugging Face safetensors checkpoint, one tensor at a time by name."""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open


class Checkpoint:
    """Maps tensor names to shards; reads a tensor only when asked (never the whole model at once)."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        else:
            single = os.path.join(model_dir, "model.safetensors")
            if not os.path.isfile(single):
                raise FileNotFoundError(f"no model.safetensors or safetensors index in {model_dir}")
            with safe_open(single, framework="pt") as f:
                weight_map = {name: "model.safetensors" for name in f.keys()}
        self._shard_of = weight_map
        self._handles: dict[str, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._shard_of

    def names(self) -> list[str]:
        return list(self._shard_of)

    def get(self, name: str) -> torch.Tensor:
        shard = self._shard_of.get(name)
        if shard is None:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.model_dir}")
        handle = self._handles.get(shard)
        if handle is None:
            handle = safe_open(os.path.join(self.model_dir, shard), framework="pt")
            self._handles[shard] = handle
        return handle.get_tensor(name)  # type: ignore[attr-defined]

    def dtype(self) -> torch.dtype | None:
        for name in self._shard_of:
            if name.endswith("weight"):
                return self.get(name).dtype
        return None

    def close(self) -> None:
        self._handles.clear()
