"""Lazy access to a Hugging Face safetensors checkpoint, one tensor at a time by name.

Each tensor is read from its shard with one `readinto` into a buffer of its own, not through a memory map:
pages of a mapped shard count towards the process's resident memory for as long as the map lives, so loading
a 5 GB checkpoint held 5 GB besides the weights in their final format. The header (offsets and dtypes) is
parsed once per shard; the format is safetensors' own (8-byte header length, JSON header, raw data).
"""

from __future__ import annotations

import json
import os
import struct

import torch

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class Checkpoint:
    """Maps tensor names to shards; reads a tensor only when asked (never the whole model at once)."""

    def __init__(self, model_dir: str) -> None:
        self.model_dir = model_dir
        index_path = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        else:
            if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
                raise FileNotFoundError(f"no model.safetensors or safetensors index in {model_dir}")
            weight_map = dict.fromkeys(self._header("model.safetensors")[0], "model.safetensors")
        self._shard_of = weight_map
        self._headers: dict[str, tuple[dict, int]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._shard_of

    def names(self) -> list[str]:
        return list(self._shard_of)

    def _header(self, shard: str) -> tuple[dict, int]:
        """The shard's tensor entries and where its data starts."""
        path = os.path.join(self.model_dir, shard)
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        return header, 8 + length

    def get(self, name: str) -> torch.Tensor:
        dtype, shape = self.spec(name)
        return self.read_into(name, torch.empty(shape, dtype=dtype))

    def spec(self, name: str) -> tuple[torch.dtype, list[int]]:
        """The tensor's dtype and shape, from its shard's header (nothing read)."""
        return self._spec(name, self._entry(name)[0])

    def _spec(self, name: str, entry: dict) -> tuple[torch.dtype, list[int]]:
        dtype = _DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} in {self._shard_of[name]} has dtype {entry['dtype']}, which we do "
                             "not read")
        return dtype, entry["shape"]

    def read_into(self, name: str, out: torch.Tensor) -> torch.Tensor:
        """Reads the tensor into `out` (contiguous CPU memory of its bytes, any dtype): what a loader that packs
        each tensor anew reuses, read after read, rather than fault in fresh pages for every one."""
        entry, data_start = self._entry(name)
        begin, end = entry["data_offsets"]
        dtype, shape = self._spec(name, entry)
        if not out.is_contiguous() or out.device.type != "cpu" or out.numel() * out.element_size() != end - begin:
            raise ValueError(f"tensor {name!r} is {end - begin} bytes; the buffer given holds "
                             f"{out.numel() * out.element_size()} (or is not contiguous CPU memory)")
        raw = out.view(-1).view(torch.uint8)
        shard = self._shard_of[name]
        with open(os.path.join(self.model_dir, shard), "rb", buffering=0) as f:
            f.seek(data_start + begin)
            if f.readinto(raw.numpy().data) != end - begin:
                raise ValueError(f"{shard} is truncated: tensor {name!r} runs past its end")
        return raw.view(dtype).view(shape)

    def _entry(self, name: str) -> tuple[dict, int]:
        """The tensor's header entry and where its shard's data starts."""
        shard = self._shard_of.get(name)
        if shard is None:
            raise KeyError(f"tensor {name!r} not in checkpoint {self.model_dir}")
        if shard not in self._headers:
            self._headers[shard] = self._header(shard)
        header, data_start = self._headers[shard]
        return header[name], data_start

    def dtype(self) -> torch.dtype | None:
        for name in self._shard_of:
            if name.endswith("weight"):
                shard = self._shard_of[name]
                if shard not in self._headers:
                    self._headers[shard] = self._header(shard)
                return _DTYPES.get(self._headers[shard][0][name]["dtype"])
        return None

    def close(self) -> None:
        self._headers.clear()
