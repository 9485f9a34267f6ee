"""On a GPU: the host store's page-locked memory (host_allocator.pinned_empty) is pinned for the copy engine,
exactly its bytes, and copies from it asynchronously (tests/test_host_allocator.py checks the rest on the CPU)."""

from __future__ import annotations

import gc

import pytest
import torch

from services.engine.host_allocator import pinned_empty

pytestmark = pytest.mark.gpu


def test_registered_memory_is_pinned_and_copies_without_the_caching_allocator() -> None:
    def cached() -> int:  # bytes torch's pinned allocator holds (0 where this torch does not say)
        stats = getattr(torch.cuda, "host_memory_stats", None)
        return stats().get("allocated_bytes.current", 0) if stats is not None else 0

    before = cached()
    host = pinned_empty((3, 9 * 2**20 // 2), torch.bfloat16)  # three Qwen3-30B-A3B bf16 experts
    assert host.is_pinned() and host[1].is_pinned()
    assert cached() == before  # none of it from torch's cache, which would round it up to 32 MiB
    host.copy_(torch.randn(host.shape).bfloat16())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        device = host.to("cuda", non_blocking=True)
    stream.synchronize()
    assert torch.equal(device.cpu(), host)
    del host, device
    gc.collect()  # unregisters; a second one registers afresh
    assert pinned_empty((1024,), torch.float32).is_pinned()
