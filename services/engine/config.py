"""Engine settings: one name per knob (CLI flag, env var HINTSERVE_<NAME>, field)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from services.common.broker import check_broker_url
from services.engine.expert_format import DEFAULT_GROUP_SIZE, check_expert_format


@dataclass
class EngineConfig:
    model: str = "models/demo-moe"
    dtype: str = "auto"  # auto: float32 on CPU (bf16 matmuls are slow there), checkpoint dtype on CUDA
    device: str = "cpu"
    max_num_seqs: int = 32  # sequences in the running batch at most (the rest wait)
    max_num_batched_tokens: int = 2048  # prompt tokens one step computes at most; longer prompts prefill in chunks
    # While sequences decode, a step that prefills takes only the prompt tokens that keep it near this many ms
    # (their next token waits on it; chunk_sizer.py); None: the whole max_num_batched_tokens.
    itl_target_ms: float | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 4096
    block_size: int = 32  # tokens per KV block: decode gathers whole blocks, and 2 KB runs (16) ran 2.4x slower cold
    kv_cache_mb: int | None = None  # None: enough blocks for max_num_seqs full-length sequences, capped
    seed: int = 0  # the engine's random state for unseeded sampling
    enforce_eager: bool = False  # CUDA: decode steps run eagerly, no CUDA graphs (vLLM's flag)
    # Prompts reuse the KV blocks of earlier prompts' shared prefixes (block_manager.py; vLLM's flag).
    enable_prefix_caching: bool = False
    # Requests waiting and no step finished for this long: the core is stopped, the engine exits 1. 0: off.
    step_watchdog_s: float | None = 60.0
    # Offload runtime (services/engine/offload): which policy, how big the device expert cache, which link.
    offload_policy: str = "resident"
    expert_cache_gb: float | None = None
    expert_cache_experts: int | None = None
    expert_cache_fraction: float | None = None  # of all experts; default 0.25 when offloading
    link: str = "emulated"  # emulated (CPU or GPU) | native (CUDA copy engine)
    link_gbps: float | None = None  # emulated link bandwidth in GB/s (gigabytes per second)
    link_ratio: float | None = None  # emulated: one expert's transfer = R x one expert's compute (default 30)
    host_ratio: float | None = None  # emulated host: one expert on the host = R x on the device (default 15.6)
    host_threads: int | None = None  # host expert executor worker threads (default 1)
    prefetch_distance: int | None = None  # MoE layers ahead; None: the policy's own (2 unless it says)
    eviction: str | None = None  # override the policy's eviction policy
    routing_trace: str | None = None  # recorded routing for the oracle / belady policies
    # Routed experts' storage everywhere they live (services/engine/quant): auto = the run dtype unquantized.
    expert_dtype: str = "auto"  # auto | bf16 | int8 (per output row) | int4 (per group of inputs)
    expert_group_size: int = DEFAULT_GROUP_SIZE  # int4: inputs per (scale, zero)
    # Non-expert matrices (attention projections, LM head) on the CPU: auto = the run dtype; see native_linear.
    weight_dtype: str = "auto"  # auto | fp32 | bf16 | int8 (per output row) | int4 (per group of inputs)
    weight_group_size: int = 64  # int4 dense matrices: inputs per (scale, zero): 64 or 128
    # CPU compute threads (the native kernels' pool; torch then runs one): None = cores - 1, one core left
    # to the frontend as vLLM's CPU worker leaves it (OMP_NUM_THREADS decides when set); generate and serve alike.
    # On CUDA: the pool for a hybrid policy's host experts, None = cores - 2 (torch keeps its threads).
    threads: int | None = None
    # Predictor link (policies with prediction hints): Redis broker, or an embedded predictor without one.
    redis_url: str | None = None  # redis://host:port; None: in-process broker + embedded predictor service
    engine_id: str | None = None  # names this engine's hint channel hintserve:hints:<engine_id>; None: generated
    predictor: str | None = None  # override the policy's predictor (registry name or module:Class); none: off
    extra: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if not os.path.isdir(self.model):
            raise FileNotFoundError(f"model directory not found: {self.model}")
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise FileNotFoundError(f"no config.json in model directory {self.model}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"unknown dtype {self.dtype!r}: use auto, float32, bfloat16 or float16")
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"unknown device {self.device!r}: use cpu or cuda[:N]")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device cuda requested but CUDA is not available")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.itl_target_ms is not None and not 0 < self.itl_target_ms <= 3_600_000:
            raise ValueError(f"itl_target_ms must be positive (at most an hour), got {self.itl_target_ms}")
        if self.itl_target_ms is not None and self.offload_policy != "resident":
            # A prefill step of any size moves nearly every offloaded expert (over the link or through the
            # host): smaller chunks barely shorten its step and multiply the prompt's steps.
            raise ValueError("--itl-target-ms sizes chunks for resident experts; with --offload-policy "
                             f"{self.offload_policy} keep whole --max-num-batched-tokens chunks")
        if self.step_watchdog_s is not None and not 0 <= self.step_watchdog_s <= 86400:
            raise ValueError(f"step_watchdog_s must be in [0, 86400], got {self.step_watchdog_s}")
        if self.kv_cache_mb is not None and self.kv_cache_mb < 1:
            raise ValueError(f"kv_cache_mb must be positive, got {self.kv_cache_mb}")
        if self.link not in ("emulated", "native"):
            raise ValueError(f"unknown link {self.link!r}: use emulated or native")
        if self.link == "native" and not self.device.startswith("cuda"):
            raise ValueError("--link native needs a CUDA device; use --link emulated on CPU")
        for name in ("expert_cache_gb", "expert_cache_experts", "expert_cache_fraction", "link_gbps", "link_ratio",
                     "host_ratio"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.expert_cache_fraction is not None and self.expert_cache_fraction > 1:
            raise ValueError(f"expert_cache_fraction must be in (0, 1], got {self.expert_cache_fraction}")
        if self.host_threads is not None and self.host_threads < 1:
            raise ValueError(f"host_threads must be at least 1, got {self.host_threads}")
        if self.prefetch_distance is not None and self.prefetch_distance < 1:
            raise ValueError(f"prefetch_distance must be at least 1, got {self.prefetch_distance}")
        check_expert_format(self.expert_dtype, self.expert_group_size)
        if self.weight_dtype not in ("auto", "fp32", "bf16", "int8", "int4"):
            raise ValueError(f"unknown weight dtype {self.weight_dtype!r}: use auto, fp32, bf16, int8 or int4")
        if self.weight_dtype != "auto" and self.device != "cpu":
            raise ValueError("--weight-dtype runs on the CPU's native kernels: use --device cpu (or leave it auto)")
        if self.weight_group_size not in (64, 128):
            raise ValueError(f"weight_group_size must be 64 or 128, got {self.weight_group_size}")
        if self.threads is not None and not 1 <= self.threads <= 256:
            raise ValueError(f"threads must be in 1..256, got {self.threads}")
        check_broker_url(self.redis_url)

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.device == "cpu" or checkpoint_dtype is None:
            return torch.float32
        return checkpoint_dtype

    @classmethod
    def from_env(cls, **overrides: object) -> EngineConfig:
        """Fields from HINTSERVE_<FIELD> environment variables, then explicit overrides."""
        values: dict[str, Any] = {}  # each parsed as its field's type
        for f in fields(cls):
            raw = os.environ.get(f"HINTSERVE_{f.name.upper()}")
            if raw is None or f.name == "extra":
                continue
            if f.type in ("int", "int | None"):
                values[f.name] = int(raw)
            elif f.type == "bool":
                if raw.lower() not in ("0", "1", "true", "false"):
                    raise ValueError(f"HINTSERVE_{f.name.upper()} must be 0, 1, true or false, got {raw!r}")
                values[f.name] = raw.lower() in ("1", "true")
            elif f.type == "float | None":
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)
