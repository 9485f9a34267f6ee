"""What this machine offers for serving: builds, devices, native kernels, memory and link bandwidth, Redis (the
CPU's model and features: services/common/cpu.py). Each probe returns plain data (the CLI prints it or dumps it
as JSON) and never raises."""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from typing import Any

_BANDWIDTH_BYTES = 128 << 20  # 4x a large L3, so copies stream from DRAM
_BANDWIDTH_SECONDS = 1.0


def builds() -> dict[str, Any]:
    import torch

    return {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "platform": platform.platform()}


def cuda_devices() -> list[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append({"index": i, "name": p.name, "memory_gb": p.total_memory / 1e9,
                    "capability": f"{p.major}.{p.minor}"})
    return out


def host_memory_gb() -> dict[str, float]:
    """MemTotal and MemAvailable from /proc/meminfo, in GB (1e9 bytes)."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    out[key] = int(value.split()[0]) * 1024 / 1e9
    except OSError:
        pass
    return {"total_gb": out.get("MemTotal", 0.0), "available_gb": out.get("MemAvailable", 0.0)}


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def native_kernels() -> dict[str, Any]:
    """Whether services/engine/cpu_kernels built here, and if not, why (the warning library() logs)."""
    from services.engine import cpu_kernels

    if os.environ.get("HINTSERVE_CPU_KERNELS", "1") == "0":
        return {"built": False, "why": "turned off by HINTSERVE_CPU_KERNELS=0"}
    handler = _Captured()
    log = logging.getLogger(cpu_kernels.__name__)
    log.addHandler(handler)
    try:
        lib = cpu_kernels.library()
    finally:
        log.removeHandler(handler)
    if lib is not None:
        return {"built": True, "why": f"cached in {cpu_kernels.cache_dir()}", "runs": cpu_kernels.describe(),
                "used_when": "torch runs one intra-op thread and the run dtype is float32"}
    return {"built": False, "why": handler.messages[-1] if handler.messages else "library() returned None"}


def pinned_memory() -> dict[str, Any]:
    import torch

    try:
        torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        return {"available": True, "why": ""}
    except RuntimeError as exc:
        return {"available": False, "why": str(exc).splitlines()[0]}


def host_bandwidth_gbps(seconds: float = _BANDWIDTH_SECONDS) -> float:
    """DRAM copy bandwidth, GB/s (read + write bytes), best of repeated 128 MB copies for about `seconds`."""
    import torch

    src = torch.ones(_BANDWIDTH_BYTES // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults are not bandwidth
    best, end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * _BANDWIDTH_BYTES / best / 1e9


def link_bandwidth_gbps(device: int = 0) -> float | None:
    """Pinned host -> device copy bandwidth, GB/s; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(256 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=f"cuda:{device}")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return 5 * src.numel() / (time.perf_counter() - start) / 1e9


def redis_status(url: str) -> dict[str, Any]:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    try:
        start = time.perf_counter()
        client.ping()
        return {"url": url, "reachable": True, "ping_ms": (time.perf_counter() - start) * 1e3, "why": ""}
    except redis.RedisError as exc:
        return {"url": url, "reachable": False, "why": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
    finally:
        client.close()
