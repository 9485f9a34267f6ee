"""Start-up checks of everything on disk a service needs, before anything loads: a bad model directory or path
is one line naming the file and the problem (the CLI prints it and exits 2), never a traceback from deep in the
loader or from the engine core's process.

They read headers only (config.json, the safetensors headers, an index), so they cost milliseconds even for a
large checkpoint; the loader (services/engine/models) still does the full job afterwards.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from services.common.paths import check_writable_dir, os_reason
from services.engine.models.spec import SUPPORTED_MODEL_TYPES

SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors library's own limit on the JSON header


def check_model_dir(model_dir: str) -> None:
    """config.json readable, a supported family, every safetensors shard present and whole."""
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"model directory not found: {model_dir}")
    config = read_json_object(os.path.join(model_dir, "config.json"))
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{os.path.join(model_dir, 'config.json')}: unsupported model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for shard in _shards(model_dir):
        check_safetensors(os.path.join(model_dir, shard))


def read_json_object(path: str) -> dict[str, Any]:
    """A JSON object from `path`; ValueError / FileNotFoundError naming the file otherwise."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: not found")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read: {_reason(exc)}") from None
    if not text.strip():
        raise ValueError(f"{path}: is empty")
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, not {type(value).__name__}")
    return value


def _shards(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index}: no weight_map of tensor names to shard files")
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise ValueError(f"{index}: weight_map names {shard!r}, not a file of the model directory")
        missing = [s for s in shards if not os.path.isfile(os.path.join(model_dir, s))]
        if missing:
            raise FileNotFoundError(f"{index}: shard(s) missing from {model_dir}: {', '.join(missing[:5])}")
        return shards
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    return ["model.safetensors"]


def check_safetensors(path: str) -> None:
    """The file's header parses and its tensors end exactly at the end of the file (not truncated)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{path}: truncated or not a safetensors file ({size} bytes)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > SAFETENSORS_MAX_HEADER or 8 + header_len > size:
                raise ValueError(f"{path}: corrupt or truncated safetensors header ({size} bytes in the file)")
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read: {_reason(exc)}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise ValueError(f"{path}: corrupt safetensors header (tensor {name[:80]!r} has no data_offsets)")
        end = max(end, offsets[1])
    data = size - 8 - header_len
    if end > data:
        raise ValueError(f"{path}: truncated: its header promises {end} bytes of tensor data, the file holds {data}")


def load_tokenizer(model_dir: str) -> Any:
    """The model directory's tokenizer; ValueError naming the directory when it does not load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except Exception as exc:  # OSError, ValueError, JSON and sentencepiece errors, ...: all "does not load"
        raise ValueError(f"{model_dir}: the tokenizer does not load: {_reason(exc)}") from None


def check_kernel_cache() -> None:
    """$HINTSERVE_KERNEL_CACHE, when set, must be a writable directory (unset: the default path, whose
    failure only turns the native CPU kernels off with a warning)."""
    path = os.environ.get("HINTSERVE_KERNEL_CACHE")
    if path and os.environ.get("HINTSERVE_CPU_KERNELS", "1") != "0":
        check_writable_dir(path, "HINTSERVE_KERNEL_CACHE")


def check_expert_kernels(device: str, expert_dtype: str, group_size: int) -> None:
    """Quantized experts on `device` run one tiny product through the engine's own path at start-up: torch has
    a CUDA int8 weight-only kernel only from 2.9, and its int4 packing took another layout before 2.5, so an
    older torch (which torch>=2.4 admits) would fail the first request instead."""
    if expert_dtype not in ("int8", "int4"):
        return
    import torch

    from services.engine.quant.kernels import packed_linear
    from services.engine.quant.packed import QuantScheme, pack_matrix

    try:
        m = pack_matrix(torch.ones(64, 256) / 16, QuantScheme(int(expert_dtype[3:]), group_size), device)
        packed_linear(torch.ones(2, 256, device=device), m)
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        raise ValueError(f"--expert-dtype {expert_dtype} on {device}: torch {torch.__version__} cannot run it "
                         f"({_reason(exc)}); use torch >= 2.9 or --expert-dtype bf16") from None


def _reason(exc: BaseException) -> str:
    """One line: the OS's reason for an OSError, else the exception's first line."""
    if isinstance(exc, OSError):
        return os_reason(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]
