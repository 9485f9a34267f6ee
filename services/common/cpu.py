"""The CPU's model and the vector features the kernels care about, from /proc/cpuinfo: what `hintserve doctor`
reports and every saved benchmark result names."""

from __future__ import annotations

import os
import platform
from typing import Any

# /proc/cpuinfo flags, by what they mean for the kernels (expert GEMMs and quantized matmuls).
CPU_FEATURES = {
    "avx2": ("avx2",),
    "avx512": ("avx512f",),
    "vnni": ("avx512_vnni", "avx_vnni"),
    "bf16": ("avx512_bf16",),
    "amx": ("amx_bf16", "amx_tile", "amx_int8"),
}


def cpu_info(cpuinfo: str = "/proc/cpuinfo") -> dict[str, Any]:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
                elif key.strip() == "model name":
                    model = value.strip()
    except OSError:
        pass
    features = {name: any(f in flags for f in names) for name, names in CPU_FEATURES.items()}
    return {"model": model, "cores": os.cpu_count() or 1, "features": features}
