"""Placement prices measured at start-up: device and host time per expert as a function of its tokens, and
the link's time per expert. Fiddler's rule reads them: a miss goes to the host when that finishes first.

Emulated (CPU-only) engines measure the device and price the host at `host_ratio` times the device, the
unit `EmulatedLink` uses too; on CUDA both sides are measured for real.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.engine.host_allocator import pinned_empty
from services.engine.offload.link import EmulatedLink, Link, emulation_unit, expert_compute_seconds

if TYPE_CHECKING:
    from services.engine.expert_provider import StoredWeights
    from services.engine.quant.layout import StoredLayout

# The default --host-ratio: one Mixtral-8x7B fp16 expert on one token on a dual-channel DDR4-3200 host over
# the same on an RTX A5000, both memory-bound (services/simulator/host.py prices them; a test checks that
# this constant is what that arithmetic gives): 352 MB at 75% of 51.2 GB/s = 9.17 ms on the host,
# 352 MB at 80% of 768 GB/s + 3 kernel launches = 0.59 ms on the device.
DEFAULT_HOST_RATIO = 15.6
PROBE_TOKENS = 16  # the second point of the linear fit in tokens


@dataclass(frozen=True)
class PlacementCosts:
    """Seconds for one expert: on the device or the host with n tokens (a + b (n - 1)), over the link."""

    device_first: float
    device_per_token: float
    host_first: float
    host_per_token: float
    link: float
    # One DRAM (offload/memory_bus.py): bytes/s the host's math and the link's copies share, and what one expert
    # reads from it on each side; inf: not modelled (a real host: its DRAM is not measured).
    dram: float = float("inf")
    host_bytes: float = 1.0
    link_bytes: float = 1.0

    def device(self, tokens: int) -> float:
        return self.device_first + self.device_per_token * (tokens - 1)

    def host(self, tokens: int) -> float:
        return self.host_first + self.host_per_token * (tokens - 1)

    @classmethod
    def fit(cls, device: tuple[float, float], host: tuple[float, float], link: float) -> PlacementCosts:
        """From times at 1 and PROBE_TOKENS tokens; costs never fall with more tokens."""
        # Never falling with more tokens, never more than one token's price per further token.
        slope = lambda t: min(t[0], max(0.0, (t[1] - t[0]) / (PROBE_TOKENS - 1)))  # noqa: E731
        return cls(device[0], slope(device), host[0], slope(host), link)


def measure_costs(
    hidden: int, intermediate: int, dtype: torch.dtype, device: str, link: Link, expert_bytes: int,
    host_ratio: float | None, host_layout: StoredLayout | None = None, device_layout: StoredLayout | None = None,
) -> PlacementCosts:
    """`host_ratio` None on CUDA: the host is measured, on experts stored in `host_layout` (the host store's;
    None: dense in `dtype`), and the device on experts in `device_layout` (the slots'; None: dense); on CPU the
    emulated host is that ratio (default DEFAULT_HOST_RATIO) times the device."""
    if device == "cpu":
        dev = (emulation_unit(hidden, intermediate, dtype, 1), emulation_unit(hidden, intermediate, dtype, PROBE_TOKENS))
        ratio = host_ratio or DEFAULT_HOST_RATIO
        host = (ratio * dev[0], ratio * dev[1])
    else:
        dev = (device_expert_seconds(hidden, intermediate, dtype, device, 1, device_layout),
               device_expert_seconds(hidden, intermediate, dtype, device, PROBE_TOKENS, device_layout))
        host = (expert_compute_seconds(hidden, intermediate, dtype, 20, 1, pool_is_host=True, layout=host_layout),
                expert_compute_seconds(hidden, intermediate, dtype, 20, PROBE_TOKENS, pool_is_host=True,
                                       layout=host_layout))
    return PlacementCosts.fit(dev, host, _link_seconds(link, expert_bytes, dtype, device))


def _link_seconds(link: Link, expert_bytes: int, dtype: torch.dtype, device: str) -> float:
    if isinstance(link, EmulatedLink):
        return expert_bytes / link.bytes_per_second
    src = pinned_empty((expert_bytes // dtype.itemsize,), dtype)  # torch's pinned cache would keep a block twice
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / 3


def device_expert_seconds(hidden: int, intermediate: int, dtype: torch.dtype, device: str, tokens: int,
                          layout: StoredLayout | None = None) -> float:
    """One expert's time on `tokens` tokens on the device, as its slots hold it (`layout`: quantized slots take
    torch's int8/int4 products, which a dense expert would misprice; None: dense in `dtype`)."""
    from services.engine.expert_provider import ExpertWeights
    from services.engine.models.moe import expert_forward

    x = torch.randn(tokens, hidden, dtype=dtype, device=device)
    dense = ExpertWeights(torch.randn(2 * intermediate, hidden, dtype=dtype) / hidden**0.5,
                          torch.randn(hidden, intermediate, dtype=dtype) / intermediate**0.5)
    w: StoredWeights
    if layout is None:
        w = ExpertWeights(dense.gate_up.to(device), dense.down.to(device))
    else:
        flat = torch.empty(layout.numel, dtype=layout.dtype, device=device)
        layout.pack(dense, flat)
        w = layout.views(flat)

    def settle() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(5):
        expert_forward(x, w)
    settle()
    start = time.perf_counter()
    for _ in range(20):
        expert_forward(x, w)
    settle()
    return (time.perf_counter() - start) / 20
