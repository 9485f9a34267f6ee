"""A CUDA engine's host job: rows leave the device into pinned memory, run on the native kernels' pool as fp32,
and come back in the device's dtype (tests/test_host_pool.py checks the same on the CPU)."""

from __future__ import annotations

import pytest
import torch

from services.engine import cpu_kernels
from services.engine.expert_provider import ExpertWeights
from services.engine.models.moe import expert_forward
from services.engine.offload.host_executor import HostExecutor
from services.engine.offload.stats import OffloadStats

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: native kernels not built")
def test_a_host_job_from_a_bf16_device_runs_on_the_kernels_pool() -> None:
    gen = torch.Generator().manual_seed(0)
    w = ExpertWeights((torch.randn(512, 256, generator=gen) / 16).bfloat16().pin_memory(),
                      (torch.randn(256, 256, generator=gen) / 16).bfloat16().pin_memory())
    before = cpu_kernels.pool_threads() or 1
    cpu_kernels.set_threads(2)
    executor = HostExecutor(1, OffloadStats(1), pool_is_host=True)
    try:
        x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16)
        job = executor.submit(w, x)
        executor.flush()
        y = job.result()
        torch.cuda.synchronize()
        assert y.device.type == "cuda" and y.dtype == torch.bfloat16
        want = expert_forward(x.cpu().float(), w, pool_is_host=True).bfloat16()
        assert torch.equal(y.cpu(), want)
    finally:
        executor.shutdown()
        cpu_kernels.set_threads(before)


@pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: native kernels not built")
def test_a_layers_host_experts_on_the_same_rows_share_one_copy_to_the_host(monkeypatch) -> None:
    """...and one native call, whose outputs go back to the device in one copy (HostGroup)."""
    from services.engine.offload import host_executor

    calls: list[int] = []
    run_experts = host_executor.moe_calls.run_experts
    monkeypatch.setattr(host_executor.moe_calls, "run_experts",
                        lambda x, group, rows: calls.append(len(group)) or run_experts(x, group, rows))
    gen = torch.Generator().manual_seed(1)
    experts = [ExpertWeights((torch.randn(512, 256, generator=gen) / 16).bfloat16(),
                             (torch.randn(256, 256, generator=gen) / 16).bfloat16()) for _ in range(3)]
    executor = HostExecutor(1, OffloadStats(1), pool_is_host=True)
    try:
        x = torch.randn(1, 256, device="cuda", dtype=torch.bfloat16)  # a one-token layer's rows, shared
        jobs = [executor.submit(w, x) for w in experts]
        staged = [item[2] for item in executor._batch]
        assert all(s is staged[0] for s in staged)
        executor.flush()
        for w, job in zip(experts, jobs):
            assert torch.equal(job.result().cpu(), expert_forward(x.cpu().float(), w, pool_is_host=True).bfloat16())
        assert calls == [3]
        other = executor.submit(experts[0], x)  # the next layer copies afresh
        assert executor._batch[-1][2] is not staged[0]
        executor.flush()
        other.result()
    finally:
        executor.shutdown()
