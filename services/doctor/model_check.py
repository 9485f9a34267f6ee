"""A model directory checked without loading it: config.json and the safetensors headers only."""

from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter
from dataclasses import asdict, dataclass

# Bytes per element of the safetensors dtypes (the header names them).
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
# The config.json key that counts a family's routed experts.
_EXPERT_KEYS = {"mixtral": "num_local_experts", "deepseek_v2": "n_routed_experts", "deepseek_v3": "n_routed_experts"}
_LAYER = re.compile(r"\blayers\.(\d+)\.")
_MAX_HEADER = 100 << 20  # safetensors' own limit on a header


@dataclass(frozen=True)
class ModelFacts:
    path: str
    family: str
    num_layers: int
    moe_layers: int
    experts_per_layer: int
    top_k: int
    format: str  # bf16 | fp16 | fp32 | gptq | awq | compressed-tensors | fp8
    expert_layout: str  # per-expert tensors or fused 3-D
    total_bytes: int
    expert_bytes: int  # one routed expert, as stored
    all_experts_bytes: int
    tensors: int

    @property
    def non_expert_bytes(self) -> int:
        return self.total_bytes - self.all_experts_bytes

    def as_dict(self) -> dict:
        return asdict(self) | {"non_expert_bytes": self.non_expert_bytes}


def safetensors_header(path: str) -> dict[str, dict]:
    """The tensor table at the head of a .safetensors file (8-byte length, then JSON); reads nothing else."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
        (length,) = struct.unpack("<Q", raw)
        if length > _MAX_HEADER:
            raise ValueError(f"{path}: not a safetensors file (header length {length})")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise ValueError(f"{path}: safetensors header is not JSON") from None
    header.pop("__metadata__", None)
    return header


def _shards(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return sorted(set(json.load(f)["weight_map"].values()))
    names = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    return names


def _tensor_bytes(info: dict) -> int:
    offsets = info.get("data_offsets")
    if offsets:
        return int(offsets[1]) - int(offsets[0])
    count = 1
    for d in info["shape"]:
        count *= int(d)
    return count * _DTYPE_BYTES.get(info["dtype"], 1)


def check_model(model_dir: str) -> ModelFacts:
    """Family, size, expert count and format; ValueError / FileNotFoundError naming what is wrong."""
    from services.engine.models.spec import SUPPORTED_MODEL_TYPES

    config_path = os.path.join(model_dir, "config.json")
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"no config.json in model directory {model_dir}")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_path} is not JSON: {exc}") from None
    family = config.get("model_type", "")
    if family not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"unsupported model_type {family!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    tensors: dict[str, dict] = {}
    for shard in _shards(model_dir):
        tensors.update(safetensors_header(os.path.join(model_dir, shard)))
    sizes = {name: _tensor_bytes(info) for name, info in tensors.items()}
    experts = [n for n in tensors if ".experts." in n]
    moe_layers = {int(m.group(1)) for n in experts if (m := _LAYER.search(n))}
    per_layer = int(config.get(_EXPERT_KEYS.get(family, "num_experts")) or 0)
    if not experts or not per_layer:
        raise ValueError(f"{model_dir}: no routed expert tensors (`.experts.`) or expert count in config.json")
    all_experts = sum(sizes[n] for n in experts)
    by_dtype = Counter()
    for name, info in tensors.items():
        by_dtype[info["dtype"]] += sizes[name]
    quant = (config.get("quantization_config") or {}).get("quant_method")
    if not quant and any(n.endswith("weight_scale_inv") for n in tensors):
        quant = "fp8"
    dtype = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}.get(by_dtype.most_common(1)[0][0], "other")
    fused = any(re.search(r"\.experts\.(gate_up_proj|down_proj|w\d)\b", n) for n in experts)
    return ModelFacts(
        path=model_dir, family=family, num_layers=int(config.get("num_hidden_layers", 0)),
        moe_layers=len(moe_layers), experts_per_layer=per_layer, top_k=int(config.get("num_experts_per_tok", 0)),
        format=str(quant).lower() if quant else dtype, expert_layout="fused 3-D" if fused else "per expert",
        total_bytes=sum(sizes.values()), expert_bytes=all_experts // (len(moe_layers) * per_layer),
        all_experts_bytes=all_experts, tensors=len(tensors),
    )
