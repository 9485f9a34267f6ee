"""Predictor state on disk: periodic and shutdown snapshots, restore at start (MoE-Infinity keeps its EAMC
across failures).

Format: one `.npz` per model (`<model>.snapshot.npz`), loaded with allow_pickle=False so a snapshot file
(or a Restore RPC) can never run code. `Predictor.snapshot()` returns a tree of dicts, lists, tuples,
scalars, strings, numpy arrays and torch tensors; the tree is JSON with arrays stored beside it. Files
are written to a temporary name and renamed, so a crash mid-write leaves the previous snapshot intact.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
from typing import Any

import numpy as np

from services.common.messages import InvalidInput, Shape
from services.predictor.hub import PredictorHub

log = logging.getLogger(__name__)
SUFFIX = ".snapshot.npz"
_META = "__meta__"


# ---- a safe encoding of snapshot trees ----
def _encode(value: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(value, np.ndarray) or type(value).__module__ == "torch":
        arr = value.detach().cpu().numpy() if hasattr(value, "detach") else value
        if arr.dtype == object:
            raise TypeError("snapshot arrays must not hold Python objects")
        name = f"a{len(arrays)}"
        arrays[name] = arr
        return {"__array__": name, "torch": not isinstance(value, np.ndarray)}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"__dict__": {k: _encode(v, arrays) for k, v in value.items()}}
        return {"__items__": [[_encode(k, arrays), _encode(v, arrays)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, arrays) for v in value]}
    if isinstance(value, list):
        return [_encode(v, arrays) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot snapshot a {type(value).__name__}")


def _decode(value: Any, arrays: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v, arrays) for v in value]
    if not isinstance(value, dict):
        return value
    if "__array__" in value:
        arr = arrays[value["__array__"]]
        if value.get("torch"):
            import torch

            return torch.from_numpy(arr.copy())
        return arr
    if "__dict__" in value:
        return {k: _decode(v, arrays) for k, v in value["__dict__"].items()}
    if "__items__" in value:
        return {_freeze(_decode(k, arrays)): _decode(v, arrays) for k, v in value["__items__"]}
    if "__tuple__" in value:
        return tuple(_decode(v, arrays) for v in value["__tuple__"])
    raise ValueError(f"unknown snapshot node {sorted(value)}")


def _freeze(key: Any) -> Any:
    return tuple(_freeze(k) for k in key) if isinstance(key, (list, tuple)) else key


def dumps(meta: dict[str, Any], state: dict[str, Any]) -> bytes:
    arrays: dict[str, np.ndarray] = {}
    tree = {"meta": meta, "state": _encode(state, arrays)}
    buf = io.BytesIO()
    np.savez(buf, **arrays, **{_META: np.frombuffer(json.dumps(tree).encode(), np.uint8)})
    return buf.getvalue()


def loads(data: bytes) -> tuple[dict[str, Any], dict[str, Any]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    tree = json.loads(arrays.pop(_META).tobytes())
    return tree["meta"], _decode(tree["state"], arrays)


# ---- files ----
def file_name(model: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", model) + SUFFIX


class Snapshotter:
    def __init__(self, directory: str, hub: PredictorHub) -> None:
        self.directory = directory
        self.hub = hub
        # model -> the id of the last context-stream entry its restored snapshot had learned from: the
        # service replays the entries after it, so a kill -9 loses nothing the stream still holds.
        self.stream_ids: dict[str, str] = {}
        os.makedirs(directory, exist_ok=True)

    def encode(self, model: str, stream_id: str | None = None) -> tuple[str, bytes]:
        """(file name, bytes) of one model's state; runs on the hub's loop so the state is consistent."""
        state = self.hub.models[model]
        meta = {"shape": vars(state.shape), "predictor": self.hub.predictor_name, "stream_id": stream_id}
        return file_name(model), dumps(meta, state.predictor.snapshot())

    def write(self, name: str, data: bytes) -> None:
        """Atomic: a reader (or a crash) sees the old file or the new one, never half of one."""
        path = os.path.join(self.directory, name)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:  # a full disk, a read-only directory: no half-written temp file stays behind
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def save_all(self, stream_id: str | None = None) -> list[tuple[str, int]]:
        """Synchronous snapshot of every model (shutdown path): [(file, bytes)]."""
        out = []
        for model in list(self.hub.models):
            name, data = self.encode(model, stream_id)
            self.write(name, data)
            out.append((name, len(data)))
        return out

    def path_of(self, name: str) -> str:
        if not name or os.path.basename(name) != name or not name.endswith(SUFFIX):
            raise InvalidInput(f"snapshot file must be a bare name ending in {SUFFIX}, got {name!r}")
        return os.path.join(self.directory, name)

    def restore(self, name: str) -> Shape:
        """Loads one snapshot file into the hub (replacing that model's predictor)."""
        path = self.path_of(name)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no snapshot {name!r} in {self.directory}")
        with open(path, "rb") as f:
            try:
                meta, state = loads(f.read())
            except (ValueError, KeyError, OSError) as exc:
                raise InvalidInput(f"snapshot {name!r} is corrupt: {exc}") from exc
        shape = Shape(**meta["shape"])
        want = self.hub.predictor_name
        if want and meta.get("predictor") and meta["predictor"] != want:
            raise InvalidInput(f"snapshot {name!r} holds predictor {meta['predictor']!r}, this service runs {want!r}")
        predictor = self.hub.factory(shape)
        predictor.restore(state)
        self.hub.install(shape, predictor)
        if meta.get("stream_id"):
            self.stream_ids[shape.model] = meta["stream_id"]
        else:
            self.stream_ids.pop(shape.model, None)
        return shape

    def restore_all(self) -> list[Shape]:
        """Every snapshot in the directory (start-up); a bad file is logged and skipped, not fatal."""
        shapes = []
        for name in sorted(os.listdir(self.directory)):
            if not name.endswith(SUFFIX):
                continue
            try:
                shapes.append(self.restore(name))
            except Exception as exc:  # one corrupt snapshot must not keep the service down
                log.warning("skipping snapshot %s: %s", name, exc)
        return shapes
