"""The native link's readiness, on a CPU: a CUDA event stands in for torch's, counting the queries."""

from __future__ import annotations

import pytest
import torch

from services.engine.offload import cuda_link
from services.engine.offload.cuda_link import CudaEvent


class FakeCudaEvent:
    def __init__(self) -> None:
        self.queries = 0
        self.lands_after = 2  # the copy lands on the second query
        self.synchronized = False

    def query(self) -> bool:
        self.queries += 1
        return self.synchronized or self.queries >= self.lands_after

    def synchronize(self) -> None:
        self.synchronized = True


@pytest.fixture
def event(monkeypatch: pytest.MonkeyPatch) -> CudaEvent:
    monkeypatch.setattr(torch.cuda, "Event", FakeCudaEvent)
    return CudaEvent(device_index=0)


def test_an_unrecorded_event_is_not_ready_and_asks_the_device_nothing(event: CudaEvent) -> None:
    assert not event.is_ready()
    assert event.event.queries == 0


def test_a_landed_event_stays_ready_without_asking_the_device_again(event: CudaEvent) -> None:
    event._recorded.set()
    assert not event.is_ready()  # still copying
    assert event.is_ready()
    for _ in range(100):  # eviction asks every cached slot, each miss
        assert event.is_ready()
    assert event.event.queries == 2


def test_a_synchronized_event_is_ready_with_no_query(event: CudaEvent) -> None:
    event._recorded.set()
    event.synchronize()
    assert event.is_ready()
    assert event.event.queries == 0


def test_the_link_module_needs_no_cuda_to_import() -> None:
    assert cuda_link.CudaLink.name == "native"  # setup.py imports it on every machine
