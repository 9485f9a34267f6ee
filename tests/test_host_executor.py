"""The host executor: a layer's host-computed experts handed over, run, gathered and merged; the emulated
host's clock."""

from __future__ import annotations

import pytest
import torch

from services.engine.step_context import Phase, StepContext


def test_host_executor_leaves_the_compute_threads_as_they_were(monkeypatch) -> None:
    """torch.set_num_threads is process-wide (MKL's count among others): a worker that set its own to one
    left the engine's decode attention taking milliseconds per op, so the executor never calls it."""
    from services.engine.expert_provider import ExpertWeights
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    executor = HostExecutor(2, OffloadStats(1))
    weights = ExpertWeights(torch.randn(16, 4), torch.randn(4, 8))
    for _ in range(4):
        executor.submit(weights, torch.randn(3, 4)).result()
    executor.shutdown()
    assert calls == []


def test_host_executor_hands_a_layer_over_at_once_and_returns_every_result_or_error() -> None:
    """The layer's jobs go to the workers in one hand-off per worker; each result (or the error its math raised)
    comes back to the gathering thread, in whatever order it gathers them, and shutdown ends the workers."""
    from services.engine.expert_provider import ExpertWeights
    from services.engine.models.moe import expert_forward
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    executor = HostExecutor(2, OffloadStats(1))
    weights = ExpertWeights(torch.randn(16, 4), torch.randn(4, 8))
    broken = ExpertWeights(torch.randn(16, 5), torch.randn(4, 8))  # the wrong width: its math raises
    for _ in range(3):
        xs = [torch.randn(n, 4) for n in (1, 2, 3, 4, 5)]
        jobs = [executor.submit(weights, x) for x in xs]
        failing = executor.submit(broken, torch.randn(1, 4))
        executor.flush()
        for x, job in reversed(list(zip(xs, jobs))):
            assert torch.allclose(job.result(), expert_forward(x, weights), atol=1e-5)
        with pytest.raises(RuntimeError):
            failing.result()
    executor.shutdown()
    assert not any(worker.is_alive() for worker in executor._workers)


def test_a_layer_all_on_the_host_runs_on_the_gathering_thread(monkeypatch) -> None:
    """With nothing else to do, the gathering thread runs the layer's host jobs itself: no worker is woken
    (wake=False), while a layer with device work hands its jobs to the workers to overlap them."""
    import threading

    from services.engine.expert_provider import ExpertWeights
    from services.engine.offload import host_executor
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    ran_on: list[str] = []
    ran = threading.Event()
    real = host_executor.expert_forward

    def recorded(x, w, *rest):
        ran_on.append(threading.current_thread().name)
        ran.set()
        return real(x, w, *rest)

    monkeypatch.setattr(host_executor, "expert_forward", recorded)
    executor = HostExecutor(1, OffloadStats(1))
    weights = ExpertWeights(torch.randn(16, 4), torch.randn(4, 8))
    try:
        jobs = [executor.submit(weights, torch.randn(2, 4)) for _ in range(3)]
        executor.flush(wake=False)
        for job in jobs:
            job.result()
        assert ran_on == [threading.current_thread().name] * 3
        ran_on.clear()
        ran.clear()
        job = executor.submit(weights, torch.randn(2, 4))
        executor.flush()
        assert ran.wait(timeout=30)  # the woken worker runs it (the gatherer would only once it asks)
        job.result()
        assert ran_on == ["hintserve-host-0"]
    finally:
        executor.shutdown()


def test_the_host_path_is_measured_all_on_the_host_and_beside_device_experts() -> None:
    from services.engine.offload.host_path import measure_host_path

    path = measure_host_path(1, repeats=20)
    assert path["host_path_s"] >= 0 and path["mixed_path_s"] >= 0
    assert path["host_layer_s"] > 0 and path["mixed_layer_s"] > 0 and path["device_layer_s"] > 0


@pytest.mark.parametrize("mixed", [False, True], ids=["all-on-host", "beside-device-experts"])
def test_host_experts_the_gathering_thread_runs_go_into_the_layer_output_in_place(monkeypatch, mixed: bool) -> None:
    """With every expert on the host no worker is woken: the gathering thread runs each job through its sink,
    the layer's own native call, and never into rows of its own; the output is the device path's."""
    from services.engine import cpu_kernels
    from services.engine.cpu_threads import intra_op_threads
    from services.engine.expert_provider import ExpertWeights
    from services.engine.models.moe import moe_forward
    from services.engine.models.router import Routing
    from services.engine.offload import host_path
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    if cpu_kernels.library() is None:
        pytest.skip("no C compiler: no native call to add in place")
    gen = torch.Generator().manual_seed(0)
    width = host_path.WIDTH
    weights = [ExpertWeights(torch.randn(2 * width, width, generator=gen), torch.randn(width, width, generator=gen))
               for _ in range(host_path.EXPERTS)]
    x = torch.randn(5, width, generator=gen)
    probs = torch.softmax(torch.randn(5, host_path.EXPERTS, generator=gen), dim=-1)
    routing = Routing(*probs.topk(host_path.TOP_K, dim=-1), probs)
    ctx = StepContext(phase=Phase.DECODE, request_ids=["r"], num_tokens=5)
    general = []
    run = HostExecutor._run
    monkeypatch.setattr(HostExecutor, "_run", lambda self, *args: general.append(1) or run(self, *args))
    executor = HostExecutor(1, OffloadStats(1))
    try:
        outputs = []
        for on_host in (executor, None):
            provider = host_path._TinyProvider(on_host, mixed=mixed)
            provider.weights = weights
            with torch.no_grad(), intra_op_threads(1):  # the kernels run on one torch thread
                outputs.append(moe_forward(x, 0, routing, provider, ctx))
    finally:
        executor.shutdown()
    torch.testing.assert_close(outputs[0], outputs[1])
    if not mixed:
        assert general == []  # every job in place


def test_a_one_token_layer_hands_its_host_experts_the_token_itself() -> None:
    """Batch-1 decode: every routed expert's one row is x, handed over as it is (no gather copy per expert)."""
    from services.engine.models.moe import moe_forward
    from services.engine.models.router import Routing
    from services.engine.offload import host_path
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    handed: list[torch.Tensor] = []

    class Recording(host_path._TinyProvider):
        def host_forward(self, layer, expert, x, sink=None):
            handed.append(x)
            return super().host_forward(layer, expert, x, sink)

    executor = HostExecutor(1, OffloadStats(1))
    try:
        for tokens in (1, 3):
            handed.clear()
            x = torch.randn(tokens, host_path.WIDTH)
            probs = torch.softmax(torch.randn(tokens, host_path.EXPERTS), dim=-1)
            routing = Routing(*probs.topk(host_path.TOP_K, dim=-1), probs)
            ctx = StepContext(phase=Phase.DECODE, request_ids=["r"], num_tokens=tokens)
            moe_forward(x, 0, routing, Recording(executor), ctx)
            assert handed and all((rows is x) == (tokens == 1) for rows in handed)
    finally:
        executor.shutdown()


def test_emulated_host_jobs_end_at_their_finish_on_one_virtual_clock() -> None:
    """A job is ready when the emulated host would have finished it, queued behind the jobs before it, and
    the thread gathering it gets it then, not a worker's wake-up later."""
    import time

    from services.engine.expert_provider import ExpertWeights
    from services.engine.models.moe import expert_forward
    from services.engine.offload.host_executor import HostExecutor
    from services.engine.offload.stats import OffloadStats

    executor = HostExecutor(2, OffloadStats(1), emulated_seconds=lambda tokens: 0.004)
    weights = ExpertWeights(torch.randn(32, 16), torch.randn(16, 16))
    x = torch.randn(3, 16)
    # First, so the expert's code path is warm: its first call in a process (kernels loaded, torch's lazy
    # set-up) took 3-6 ms on a Xeon guest, longer than the emulated 4 ms, and the job ended late.
    reference = expert_forward(x, weights)
    try:
        start = time.perf_counter()
        first, second = executor.submit(weights, x), executor.submit(weights, x, activation=True, share=0.5)
        first_result = first.result()
        first_done = time.perf_counter()
        second.result()
        second_done = time.perf_counter()
    finally:
        executor.shutdown()
    assert torch.allclose(first_result, reference, atol=1e-5)
    # Late by at most 10 ms: a KVM guest's sleeps ended 1-2 ms late now and then (seen on a Xeon guest), and
    # 3.5 ms once on a Zen 4 guest while the other test worker ran mypy (2 of 21 runs there)
    assert first.ready_at <= first_done < first.ready_at + 10e-3
    assert second.ready_at == pytest.approx(first.ready_at + 0.002)  # queued behind the first, half its time
    assert second.ready_at <= second_done < second.ready_at + 10e-3
    assert 0.004 <= first.ready_at - start < 0.005


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="timer slack is Linux's")
def test_emulated_holds_sleep_without_timer_slack() -> None:
    """An emulated host job or transfer ends on the thread that waits for it, which sleeps most of the way:
    Linux ends a sleep up to 50 us late by default, so that thread's slack becomes 1 ns."""
    import ctypes
    import threading
    import time

    from services.engine.offload.link import hold_until

    prctl = ctypes.CDLL(None).prctl
    seen: list[int] = []

    def hold() -> None:
        prctl(29, 50_000, 0, 0, 0)  # PR_SET_TIMERSLACK: Linux's default, whatever this thread inherited
        hold_until(time.perf_counter() + 0.002)
        seen.append(prctl(30, 0, 0, 0, 0))  # PR_GET_TIMERSLACK, in ns

    holder = threading.Thread(target=hold)
    holder.start()
    holder.join()
    assert seen == [1]
