"""The Broker inside one process (the embedded default): same semantics as Redis, no server.

Thread-safe and usable from several event loops at once (the engine's link thread and the predictor may
run different loops): state sits behind a lock and waiters are woken with `call_soon_threadsafe`.
`available = False` simulates an outage (every call raises BrokerUnavailable), for tests.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from services.common.broker import DEFAULT_STREAM_MAXLEN, Broker, BrokerUnavailable, StreamEntry, Subscription

_SUBSCRIBER_BUFFER = 10_000  # a subscriber that stops reading loses its oldest messages, never blocks us


class _Waiters:
    """Futures of coroutines waiting for "something changed", possibly on different event loops."""

    def __init__(self) -> None:
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []

    def add(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._futures.append((loop, fut))
        return fut

    def wake_all(self) -> None:
        futures, self._futures = self._futures, []
        for loop, fut in futures:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, fut)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


async def _wait(fut: asyncio.Future, timeout: float | None) -> None:
    try:
        await asyncio.wait_for(fut, timeout)
    except asyncio.TimeoutError:
        pass


class _InProcessSubscription(Subscription):
    def __init__(self, broker: InProcessBroker, channel: str) -> None:
        self._broker = broker
        self.channel = channel
        self.messages: deque[bytes] = deque(maxlen=_SUBSCRIBER_BUFFER)
        self.waiters = _Waiters()

    async def get(self, timeout: float | None = None) -> bytes | None:
        for attempt in range(2):
            with self._broker._lock:
                self._broker._check()
                if self.messages:
                    return self.messages.popleft()
                if attempt or timeout == 0:
                    return None
                fut = self.waiters.add()
            await _wait(fut, timeout)
        return None

    async def close(self) -> None:
        with self._broker._lock:
            self._broker._channels.get(self.channel, set()).discard(self)


@dataclass
class _Group:
    last_delivered: int
    pending: dict[str, OrderedDict[int, None]] = field(default_factory=dict)  # consumer -> entry seqs


@dataclass
class _Stream:
    entries: OrderedDict[int, bytes] = field(default_factory=OrderedDict)
    next_seq: int = 1
    groups: dict[str, _Group] = field(default_factory=dict)
    waiters: _Waiters = field(default_factory=_Waiters)


def _entry_id(seq: int) -> str:
    return f"{seq}-0"


def _seq(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


class InProcessBroker(Broker):
    url = "inprocess"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, set[_InProcessSubscription]] = {}
        self._streams: dict[str, _Stream] = {}
        self.available = True

    def _check(self) -> None:
        if not self.available:
            raise BrokerUnavailable("in-process broker unavailable")

    async def ping(self) -> None:
        self._check()

    async def publish(self, channel: str, data: bytes) -> int:
        with self._lock:
            self._check()
            subs = list(self._channels.get(channel, ()))
            for sub in subs:
                sub.messages.append(data)
                sub.waiters.wake_all()
        return len(subs)

    async def subscribe(self, channel: str) -> Subscription:
        with self._lock:
            self._check()
            sub = _InProcessSubscription(self, channel)
            self._channels.setdefault(channel, set()).add(sub)
        return sub

    async def stream_append(self, stream: str, data: bytes, maxlen: int = DEFAULT_STREAM_MAXLEN) -> str:
        with self._lock:
            self._check()
            s = self._streams.setdefault(stream, _Stream())
            seq, s.next_seq = s.next_seq, s.next_seq + 1
            s.entries[seq] = data
            while len(s.entries) > maxlen:  # exact trimming: cheap here
                s.entries.popitem(last=False)
            s.waiters.wake_all()
        return _entry_id(seq)

    async def ensure_group(self, stream: str, group: str, start: str = "$") -> None:
        with self._lock:
            self._check()
            s = self._streams.setdefault(stream, _Stream())
            if group not in s.groups:
                s.groups[group] = _Group(last_delivered=s.next_seq - 1 if start == "$" else _seq(start))

    async def stream_read_group(
        self, stream: str, group: str, consumer: str, count: int = 64, block_ms: int | None = 100,
        pending: bool = False,
    ) -> list[StreamEntry]:
        for attempt in range(2):
            with self._lock:
                self._check()
                s = self._streams.setdefault(stream, _Stream())
                g = s.groups.setdefault(group, _Group(last_delivered=0))  # lost group: start over, like Redis
                mine = g.pending.setdefault(consumer, OrderedDict())
                if pending:
                    gone = [q for q in mine if q not in s.entries]  # trimmed by maxlen: nothing to redo
                    for q in gone:
                        del mine[q]
                    return [StreamEntry(_entry_id(q), s.entries[q]) for q in list(mine)[:count]]
                new = []
                for q in reversed(s.entries):  # newest first: stop at the first delivered one
                    if q <= g.last_delivered:
                        break
                    new.append(q)
                new = new[::-1][:count]
                if new or attempt or not block_ms:
                    for q in new:
                        mine[q] = None
                    if new:
                        g.last_delivered = new[-1]
                    return [StreamEntry(_entry_id(q), s.entries[q]) for q in new]
                fut = s.waiters.add()
            await _wait(fut, block_ms / 1000)
        return []

    async def stream_ack(self, stream: str, group: str, ids: list[str]) -> None:
        with self._lock:
            self._check()
            g = self._streams.get(stream, _Stream()).groups.get(group)
            if g is None:
                return
            for entry_id in ids:
                seq = _seq(entry_id)
                for mine in g.pending.values():
                    mine.pop(seq, None)

    async def stream_range(self, stream: str, after_id: str, count: int = 256) -> list[StreamEntry]:
        after = _seq(after_id)
        with self._lock:
            self._check()
            s = self._streams.get(stream, _Stream())
            return [StreamEntry(_entry_id(q), data) for q, data in s.entries.items() if q > after][:count]

    async def group_last_delivered(self, stream: str, group: str) -> str | None:
        with self._lock:
            self._check()
            g = self._streams.get(stream, _Stream()).groups.get(group)
            return None if g is None else _entry_id(g.last_delivered)

    async def stream_len(self, stream: str) -> int:
        with self._lock:
            self._check()
            return len(self._streams.get(stream, _Stream()).entries)

    async def close(self) -> None:
        """Nothing to release: the state lives as long as the object (shared by link and service)."""
