"""DNS engine discovery: the pool follows what the --engines names resolve to (compose --scale, k8s)."""

from __future__ import annotations

import socket

import pytest

from services.gateway.engine_discovery import EngineDiscovery, join_host_port, resolve_all
from services.gateway.engine_pool import EnginePool
from tests.test_gateway_units import FakeBackend


class FakeDns:
    """A resolver whose answer the test sets; `None` answers like an unknown name."""

    def __init__(self, answer: list[str] | None) -> None:
        self.answer = answer
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        if self.answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [join_host_port(ip, port) for ip in self.answer]


class ClosingBackend(FakeBackend):
    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.closed = False

    async def close(self) -> None:
        self.closed = True


async def _discovery(dns: FakeDns) -> tuple[EnginePool, EngineDiscovery, dict[str, ClosingBackend]]:
    made: dict[str, ClosingBackend] = {}

    def make_client(address: str) -> ClosingBackend:
        made[address] = ClosingBackend(address)
        return made[address]

    pool = EnginePool([make_client("engine:50051")], 4, health_interval_s=60.0)
    await pool.start()
    return pool, EngineDiscovery(pool, ["engine:50051"], make_client, 60.0, resolve=dns), made


async def test_scale_up_restart_and_scale_down_follow_dns() -> None:
    dns = FakeDns(["10.0.0.2", "10.0.0.3"])
    pool, discovery, made = await _discovery(dns)
    await discovery.refresh()
    # The name's own handle gives way to one engine per A record, each health-checked before routing.
    assert sorted(h.address for h in pool.engines) == ["10.0.0.2:50051", "10.0.0.3:50051"]
    assert all(h.healthy for h in pool.engines)
    assert dns.asked == [("engine", 50051)]

    busy = next(h for h in pool.engines if h.address == "10.0.0.3:50051")
    pool.acquire(busy)  # a request streaming from the replica that goes away
    dns.answer = ["10.0.0.2", "10.0.0.4"]  # one replica replaced (a restart with a new IP)
    await discovery.refresh()
    assert sorted(h.address for h in pool.engines) == ["10.0.0.2:50051", "10.0.0.4:50051"]
    assert busy.retired and not busy.has_capacity and not made["10.0.0.3:50051"].closed
    pool.release(busy)  # its last request finished: now the channel closes
    await pool.stop()  # waits for the closes still under way
    assert made["engine:50051"].closed and made["10.0.0.3:50051"].closed


async def test_a_dns_failure_keeps_the_engines_it_had() -> None:
    dns = FakeDns(["10.0.0.2"])
    pool, discovery, _ = await _discovery(dns)
    await discovery.refresh()
    dns.answer = None
    await discovery.refresh()
    dns.answer = []
    await discovery.refresh()
    assert [h.address for h in pool.engines] == ["10.0.0.2:50051"]
    assert pool.pick() is pool.engines[0]
    await pool.stop()


async def test_resolve_all_returns_every_address_of_a_real_name() -> None:
    addresses = await resolve_all("localhost", 50051)
    assert addresses and all(a.endswith(":50051") for a in addresses)
    assert set(addresses) <= {"127.0.0.1:50051", "[::1]:50051"}
    with pytest.raises(OSError):
        await resolve_all("no-such-engine.invalid", 50051)
