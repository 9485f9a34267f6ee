"""The step-loop watchdog: requests waiting and no word from the engine core for a bounded time means the loop
is stuck (a deadlock, a wedged GPU, a step that never returns); the frontend then stops the core and reports
NOT_SERVING, and `hintserve engine` / `serve` exit 1 so compose or Kubernetes restart them.

The core speaks at least every HEARTBEAT_S while it has work (outputs, or stats after a step without any), so
silence means no step finished. A watchdog tick that itself comes late means this whole process was stopped
(SIGSTOP, a suspended VM): the core then gets a fresh window rather than the blame.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

HEARTBEAT_S = 1.0  # the core's longest silence while it has work and steps finish
MAX_TICK_S = 1.0


class StepWatchdog:
    def __init__(self, timeout_s: float, has_work: Callable[[], bool], on_stall: Callable[[str], None]) -> None:
        self.timeout_s = timeout_s
        self.has_work = has_work
        self.on_stall = on_stall
        self.last_progress = time.monotonic()

    def progress(self) -> None:
        """The core said something (outputs, stats): a step finished, or it went idle."""
        self.last_progress = time.monotonic()

    def work_arrived(self, was_idle: bool) -> None:
        """A request was submitted; the window starts now if the core had nothing to do before."""
        if was_idle:
            self.last_progress = time.monotonic()

    async def run(self) -> None:
        """Ticks until it fires once (then returns) or is cancelled."""
        tick = min(MAX_TICK_S, self.timeout_s / 4)
        last_tick = time.monotonic()
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            if now - last_tick > tick + max(tick, 0.5):  # we were stopped ourselves: not the core's fault
                self.last_progress = now
            last_tick = now
            silent = now - self.last_progress
            if self.has_work() and silent > self.timeout_s:
                self.on_stall(f"the engine core finished no step for {silent:.1f} s with requests waiting "
                              f"(step watchdog, --step-watchdog-s {self.timeout_s:g})")
                return
