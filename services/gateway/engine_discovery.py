"""Engine discovery by DNS: every address an `--engines` host name resolves to is an engine.

`docker compose up --scale engine=N` gives the service name `engine` one A record per replica, and a
Kubernetes headless Service does the same for the engine StatefulSet's pods; re-resolving periodically
lets the gateway follow scale-ups, restarts (new IPs) and scale-downs without a restart of its own.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

from services.gateway.engine_client import EngineBackend
from services.gateway.engine_pool import EngineHandle, EnginePool

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def resolve_all(host: str, port: int) -> list[str]:
    """Every `ip:port` that `host` resolves to (all A and AAAA records), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({join_host_port(str(info[4][0]), port) for info in infos})


class EngineDiscovery:
    """Keeps the pool's engines equal to what the configured `host:port` names resolve to.

    A name that fails to resolve keeps the engines it had: a DNS hiccup must not empty a healthy pool.
    Engines that vanish are retired (their in-flight requests finish); new ones join once health-checked.
    """

    def __init__(
        self,
        pool: EnginePool,
        names: list[str],
        make_client: Callable[[str], EngineBackend],
        interval_s: float,
        resolve: Resolver = resolve_all,
    ) -> None:
        self.pool = pool
        self.names = names
        self.make_client = make_client
        self.interval_s = interval_s
        self.resolve = resolve
        # Which pool handles each name accounts for; at first, the pool's handle for the name itself.
        self._owned: dict[str, dict[str, EngineHandle]] = {
            name: {h.address: h for h in pool.engines if h.address == name} for name in names
        }
        self._task: asyncio.Task | None = None

    async def refresh(self) -> None:
        for name in self.names:
            host, _, port = name.rpartition(":")
            try:
                wanted = set(await self.resolve(host.strip("[]"), int(port)))
            except OSError as exc:  # socket.gaierror included
                log.warning(
                    "cannot resolve engines %s (%s); keeping %d engine(s)", name, exc, len(self._owned[name])
                )
                continue
            if not wanted:
                continue
            owned = self._owned[name]
            for address in sorted(wanted - owned.keys()):
                log.info("discovered engine %s (%s)", address, name)
                owned[address] = await self.pool.add(self.make_client(address))
            for address in sorted(owned.keys() - wanted):
                log.info("engine %s left %s", address, name)
                self.pool.retire(owned.pop(address))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.refresh()
            except Exception:  # never let the loop die: it is how new engines are found
                log.exception("engine discovery round failed")

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="hintserve-engine-discovery")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
