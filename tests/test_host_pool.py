"""A CUDA engine's host experts run on the native kernels' pool: its torch keeps several intra-op threads for
its own CPU ops, so `cpu_kernels.usable` alone would send them to torch's products (2.2 times slower for bf16
on a Zen 4 guest). What a CUDA engine sets and runs is checked here on the CPU: the threads, and a host job
on bf16 rows as they arrive from a bf16 device; tests/gpu runs the job from a CUDA tensor."""

from __future__ import annotations

import os

import pytest
import torch

from services.engine import cpu_kernels
from services.engine.config import EngineConfig
from services.engine.cpu_kernels import formats, moe_calls
from services.engine.cpu_threads import apply_threads, compute_line, core_threads
from services.engine.expert_provider import ExpertWeights, StoredWeights
from services.engine.models.moe import expert_forward, pooled_expert, swiglu
from services.engine.offload.host_executor import HostExecutor, host_math
from services.engine.offload.stats import OffloadStats
from services.engine.quant.layout import expert_layout

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: native kernels not built")

HIDDEN, WIDTH = 256, 128


@pytest.fixture
def torch_on_two_threads():
    """A CUDA engine's process: torch's own intra-op threads, the pool at one until the engine sizes it."""
    before_torch, before_pool = torch.get_num_threads(), cpu_kernels.pool_threads() or 1
    torch.set_num_threads(2)
    cpu_kernels.set_threads(1)
    yield
    cpu_kernels.set_threads(before_pool)
    torch.set_num_threads(before_torch)


def _bf16_expert(seed: int = 0) -> ExpertWeights:
    gen = torch.Generator().manual_seed(seed)
    return ExpertWeights((torch.randn(2 * WIDTH, HIDDEN, generator=gen) / 16).bfloat16(),
                         (torch.randn(HIDDEN, WIDTH, generator=gen) / 11).bfloat16())


def test_a_hybrid_cuda_engine_sizes_the_pool_and_leaves_torch_alone(demo_model_dir: str, torch_on_two_threads: None,
                                                                    monkeypatch) -> None:
    copies_only = EngineConfig(model=demo_model_dir, device="cuda", offload_policy="lru", threads=3)
    apply_threads(copies_only)
    assert cpu_kernels.pool_threads() == 1 and torch.get_num_threads() == 2 and compute_line(copies_only) is None
    hybrid = EngineConfig(model=demo_model_dir, device="cuda", offload_policy="fiddler", threads=3)
    apply_threads(hybrid)
    assert cpu_kernels.pool_threads() == 3 and torch.get_num_threads() == 2
    assert compute_line(hybrid) == f"host experts on {cpu_kernels.describe()}, 3 thread(s)"
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    apply_threads(EngineConfig(model=demo_model_dir, device="cuda", offload_policy="cpu-experts"))
    # A core for the frontend, as a CPU engine leaves, and one for the thread launching the device's kernels.
    assert cpu_kernels.pool_threads() == core_threads() - 1 == 6 and torch.get_num_threads() == 2
    monkeypatch.setenv("OMP_NUM_THREADS", "5")  # said outright: taken as it is
    apply_threads(EngineConfig(model=demo_model_dir, device="cuda", offload_policy="cpu-experts"))
    assert cpu_kernels.pool_threads() == 5


def test_a_host_job_on_bf16_rows_takes_the_kernels_when_the_pool_is_the_hosts(torch_on_two_threads: None) -> None:
    cpu_kernels.set_threads(2)
    w = _bf16_expert()
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1)).bfloat16()
    gate_up, down = formats.as_cpu_matrix(w.gate_up), formats.as_cpu_matrix(w.down)
    assert gate_up is not None and down is not None
    native = moe_calls.expert(x.float(), gate_up, down).bfloat16()  # the kernels on the rows widened, exactly
    assert torch.equal(host_math(w, x, activation=False, pool_is_host=True), native)
    # Without the pool the same job is torch's bf16 product (the kernels would need torch on one thread).
    torch_path = host_math(w, x, activation=False, pool_is_host=False)
    assert torch.equal(torch_path, swiglu(x, w.gate_up, w.down)) and not torch.equal(torch_path, native)
    # A split expert's gate/up half the same way, in the device's dtype.
    half = host_math(w, x, activation=True, pool_is_host=True)
    assert half.dtype == torch.bfloat16 and torch.equal(half, moe_calls.expert(x.float(), gate_up, None).bfloat16())


def test_the_host_executor_runs_its_jobs_on_the_pool(torch_on_two_threads: None) -> None:
    cpu_kernels.set_threads(2)
    w = _bf16_expert(2)
    executor = HostExecutor(1, OffloadStats(1), pool_is_host=True)
    try:
        xs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(n)).bfloat16() for n in (1, 4)]
        jobs = [executor.submit(w, x) for x in xs]
        executor.flush()
        for x, job in zip(xs, jobs):
            assert torch.equal(job.result(), expert_forward(x.float(), w, pool_is_host=True).bfloat16())
    finally:
        executor.shutdown()


def _stored(dtype: str, seed: int) -> StoredWeights:
    """An expert as a host store holds it: bf16 rows, or the CPU kernels' int8 / int4 layout."""
    layout = expert_layout(HIDDEN, WIDTH, dtype, 64, torch.float32, "cpu")
    flat = torch.empty(layout.numel, dtype=layout.dtype)
    dense = torch.randn(3 * WIDTH, HIDDEN, generator=torch.Generator().manual_seed(seed)) / 16
    layout.pack(ExpertWeights(dense[: 2 * WIDTH], dense[2 * WIDTH :].t().contiguous()), flat)
    return layout.views(flat)


@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
def test_experts_in_one_call_give_each_row_what_a_call_each_gives(torch_on_two_threads: None, dtype: str) -> None:
    cpu_kernels.set_threads(2)
    experts = [_stored(dtype, seed) for seed in range(3)]
    rows = [1, 3, 2]
    xs = [torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(10 + n)) for n in rows]
    calls = [call for x, w in zip(xs, experts) if (call := pooled_expert(x, w)) is not None]
    assert len(calls) == len(experts)
    together = moe_calls.run_experts(torch.cat(xs), calls, rows)
    for part, x, w in zip(together.split(rows), xs, experts):
        assert torch.equal(part, expert_forward(x, w, pool_is_host=True))
    other = pooled_expert(xs[0], _stored("int8" if dtype != "int8" else "int4", 0))
    assert other is not None
    with pytest.raises(ValueError, match="one format and shape"):
        moe_calls.run_experts(torch.cat(xs[:2]), [calls[0], other], rows[:2])


def test_the_host_executor_computes_a_layers_whole_experts_in_one_call(torch_on_two_threads: None,
                                                                        monkeypatch) -> None:
    """A CUDA engine's host: the layer's jobs of one kind share one native call (one pass over the pool, one
    copy back), each its own result; a split expert's half and a job of another kind run alone."""
    from services.engine.offload import host_executor

    grouped: list[int] = []
    run_experts = moe_calls.run_experts

    def recorded(x, calls, rows):
        grouped.append(len(calls))
        return run_experts(x, calls, rows)

    monkeypatch.setattr(host_executor.moe_calls, "run_experts", recorded)
    cpu_kernels.set_threads(2)
    int4 = [_stored("int4", seed) for seed in range(4)]
    int8, split = _stored("int8", 9), _bf16_expert(3)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(5)).bfloat16()  # a bf16 device's token
    executor = HostExecutor(1, OffloadStats(1), pool_is_host=True)
    try:
        jobs = [executor.submit(w, x) for w in int4[:2]] + [executor.submit(int8, x)]
        jobs += [executor.submit(split, x, activation=True)] + [executor.submit(w, x) for w in int4[2:]]
        executor.flush()
        expected = [host_math(w, x, False, True) for w in (*int4[:2], int8)] + [host_math(split, x, True, True)]
        expected += [host_math(w, x, False, True) for w in int4[2:]]
        for job, want in zip(jobs, expected):
            assert torch.equal(job.result(), want)
        assert grouped == [4]
        monkeypatch.setattr(host_executor.moe_calls, "run_experts", lambda *_: (_ for _ in ()).throw(MemoryError("x")))
        failing = [executor.submit(w, x) for w in int4[:2]]
        executor.flush()
        for job in failing:  # every job of the group says why
            with pytest.raises(MemoryError):
                job.result()
    finally:
        executor.shutdown()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_cuda_engines_host_price_times_experts_as_its_store_holds_them(torch_on_two_threads: None,
                                                                         monkeypatch, dtype: str) -> None:
    """The placement weighs the host against the link: a quantized store's experts cost the host their own
    bytes, not a dense bf16 expert's (which priced the host about two (int8) to three and a half (int4) times too high)."""
    from services.engine.offload import host_executor, link
    from services.engine.quant.layout import expert_layout
    from services.engine.quant.packed import QuantizedExpertWeights

    layout = expert_layout(HIDDEN, WIDTH, dtype, 64, torch.bfloat16, "cpu")
    seen: list[object] = []
    forward = host_executor.expert_forward

    def recorded(x, w, *rest):
        seen.append(w)
        return forward(x, w, *rest)

    monkeypatch.setattr(host_executor, "expert_forward", recorded)
    cpu_kernels.set_threads(2)
    seconds = link.expert_compute_seconds(HIDDEN, WIDTH, torch.bfloat16, repeats=5, pool_is_host=True, layout=layout)
    assert seconds > 0 and seen and all(isinstance(w, QuantizedExpertWeights) for w in seen)
    assert len({id(w) for w in seen}) * layout.nbytes >= link.COLD_BYTES  # cycling from memory, not cache



@pytest.mark.parametrize("dtype", ["auto", "int8", "int4"])
def test_the_device_price_times_an_expert_as_the_slots_hold_it(dtype: str) -> None:
    """The placement's device side: slots of quantized experts take the quantized products, timed as such (run
    here on the CPU, where the same function times the CPU's own layouts)."""
    from services.engine.offload.cost_model import device_expert_seconds
    from services.engine.quant.layout import expert_layout

    layout = expert_layout(HIDDEN, WIDTH, dtype, 64, torch.float32, "cpu")
    assert device_expert_seconds(HIDDEN, WIDTH, torch.float32, "cpu", 4, layout) > 0
    assert device_expert_seconds(HIDDEN, WIDTH, torch.float32, "cpu", 1) > 0
