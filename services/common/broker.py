"""One broker interface for the engine <-> predictor traffic: pub-sub channels and bounded streams.

FineMoE decouples the predictor from the engine with publisher-subscriber messaging. Two patterns:

* Streams (engine -> predictor): iteration contexts are appended to a stream bounded by MAXLEN and read
  through a consumer group, so a restarted predictor resumes where its group left off (and re-reads what
  it had not acknowledged).
* Pub-sub (predictor -> engine): prefetch hints are published on one channel per engine; a hint nobody
  listens to is simply lost, which is right for hints (late hints are worthless anyway).

Payloads are bytes (serialised protobuf). Implementations: `RedisBroker` (services/common/redis_broker.py)
and `InProcessBroker` (services/common/inprocess_broker.py, the embedded default without --redis-url).
Every method raises `BrokerUnavailable` when the broker cannot be reached, so callers handle outages
(reconnect with backoff) without knowing the implementation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

CONTEXT_STREAM = "hintserve:ctx"
HINT_CHANNEL_PREFIX = "hintserve:hints:"
PREDICTOR_GROUP = "hintserve-predictor"
DEFAULT_STREAM_MAXLEN = 1_000  # a few seconds of steps: older contexts are stale, and a Mixtral batch of 8 is ~150 KB


class StreamEntry(NamedTuple):
    """One stream entry as read back: its id ("<ms>-<seq>") and its payload (serialised protobuf)."""

    entry_id: str
    payload: bytes


def entry_key(entry_id: str) -> tuple[int, int]:
    """Stream entry ids ("<ms>-<seq>") in their order."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def hint_channel(engine_id: str) -> str:
    return f"{HINT_CHANNEL_PREFIX}{engine_id}"


class BrokerUnavailable(ConnectionError):
    """The broker cannot be reached (down, restarting, network); retry later."""


class Subscription(ABC):
    """Messages of one pub-sub channel, in order."""

    @abstractmethod
    async def get(self, timeout: float | None = None) -> bytes | None:
        """The next message; None after `timeout` seconds without one (None: wait indefinitely)."""

    @abstractmethod
    async def close(self) -> None: ...


class Broker(ABC):
    """Asynchronous; safe to use from one event loop at a time per instance (Redis) or from any (in-process)."""

    url: str = ""

    @abstractmethod
    async def ping(self) -> None:
        """Raises BrokerUnavailable unless the broker answers."""

    # ---- pub-sub ----
    @abstractmethod
    async def publish(self, channel: str, data: bytes) -> int:
        """Sends `data` to the channel's current subscribers; returns how many received it."""

    @abstractmethod
    async def subscribe(self, channel: str) -> Subscription: ...

    # ---- streams ----
    @abstractmethod
    async def stream_append(self, stream: str, data: bytes, maxlen: int = DEFAULT_STREAM_MAXLEN) -> str:
        """Appends one entry, trimming the stream to about `maxlen` entries; returns the entry id."""

    @abstractmethod
    async def ensure_group(self, stream: str, group: str, start: str = "$") -> None:
        """Creates the consumer group (and the stream) unless it exists; `start` "$" = only new entries."""

    @abstractmethod
    async def stream_read_group(
        self, stream: str, group: str, consumer: str, count: int = 64, block_ms: int | None = 100,
        pending: bool = False,
    ) -> list[StreamEntry]:
        """Entries for `consumer`: new ones (waiting up to `block_ms`), or with `pending` the ones it was
        given before but never acknowledged (what a restarted consumer must redo). Recreates a group the
        broker lost (e.g. a Redis restart without persistence)."""

    @abstractmethod
    async def stream_ack(self, stream: str, group: str, ids: list[str]) -> None: ...

    @abstractmethod
    async def stream_range(self, stream: str, after_id: str, count: int = 256) -> list[StreamEntry]:
        """Up to `count` entries with ids after `after_id`, oldest first, whether delivered or not (replay)."""

    @abstractmethod
    async def group_last_delivered(self, stream: str, group: str) -> str | None:
        """The id of the last entry the group handed out; None if there is no such group."""

    @abstractmethod
    async def stream_len(self, stream: str) -> int: ...

    @abstractmethod
    async def close(self) -> None: ...


def check_broker_url(url: str | None) -> None:
    """Raises ValueError unless `url` is empty, "inprocess" or a Redis URL."""
    if url and url != "inprocess" and not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"unsupported broker URL {url!r}: use redis://host:port[/db] (or omit for in-process)")


def make_broker(url: str | None) -> Broker:
    """RedisBroker for redis:// (or rediss://, unix://) URLs; a private InProcessBroker for None or "inprocess"."""
    check_broker_url(url)
    if not url or url == "inprocess":
        from services.common.inprocess_broker import InProcessBroker

        return InProcessBroker()
    from services.common.redis_broker import RedisBroker

    return RedisBroker(url)
