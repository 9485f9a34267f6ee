"""The Broker on Redis: pub-sub channels, and Streams trimmed with MAXLEN and read through consumer groups."""

from __future__ import annotations

import time
from typing import cast

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from services.common.broker import DEFAULT_STREAM_MAXLEN, Broker, BrokerUnavailable, StreamEntry, Subscription

_DOWN = (RedisConnectionError, RedisTimeoutError, OSError)
_FIELD = b"d"  # one field per entry: the protobuf payload
# What XREADGROUP answers: per stream, its entries (id, fields; fields None once MAXLEN dropped a pending one).
_GroupReply = list[tuple[bytes, list[tuple[bytes, "dict[bytes, bytes] | None"]]]]


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class _RedisSubscription(Subscription):
    def __init__(self, client: redis.Redis, pubsub: redis.client.PubSub) -> None:
        self._client = client  # its own client: closing the subscription closes exactly its connection
        self._pubsub = pubsub

    async def get(self, timeout: float | None = None) -> bytes | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                msg = await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=left)
            except _DOWN as exc:
                raise BrokerUnavailable(f"redis pub-sub: {exc}") from exc
            if msg is not None and msg.get("type") == "message":
                return msg["data"]
            # None is also what a (skipped) subscribe confirmation gives: wait on unless time is up.
            if left is not None and left <= 0 or deadline is not None and time.monotonic() >= deadline:
                return None

    async def close(self) -> None:
        try:
            await self._pubsub.aclose()
            await self._client.aclose()
        except _DOWN:
            pass  # the connection is gone already


class RedisBroker(Broker):
    def __init__(self, url: str, connect_timeout_s: float = 0.5, socket_timeout_s: float = 5.0) -> None:
        self.url = url
        self._connect_timeout_s, self._socket_timeout_s = connect_timeout_s, socket_timeout_s
        # One pool per role: blocking reads and pub-sub connections never share a pool with the short
        # commands (closing a pub-sub connection there has been seen to strand a concurrent blocked read).
        self._client = self._connect()
        self._reader = self._connect()

    def _connect(self) -> redis.Redis:
        # No client-side retries: callers own the backoff, and a retry loop here would hide outages
        # for seconds. socket_timeout must exceed the longest XREADGROUP BLOCK we issue (1 s).
        return redis.Redis.from_url(
            self.url, socket_connect_timeout=self._connect_timeout_s, socket_timeout=self._socket_timeout_s,
            retry=Retry(NoBackoff(), 0), health_check_interval=0,
        )

    async def ping(self) -> None:
        try:
            await self._client.ping()
        except _DOWN as exc:
            raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc

    async def publish(self, channel: str, data: bytes) -> int:
        try:
            return int(await self._client.publish(channel, data))
        except _DOWN as exc:
            raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc

    async def subscribe(self, channel: str) -> Subscription:
        client = self._connect()
        sub = _RedisSubscription(client, client.pubsub(ignore_subscribe_messages=True))
        try:
            await sub._pubsub.subscribe(channel)
        except _DOWN as exc:
            await sub.close()
            raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc
        return sub

    async def stream_append(self, stream: str, data: bytes, maxlen: int = DEFAULT_STREAM_MAXLEN) -> str:
        try:
            # Approximate trimming ("~") drops whole radix-tree nodes: O(1) amortised, bound within ~100.
            entry = await self._client.xadd(stream, {_FIELD: data}, maxlen=maxlen, approximate=True)
        except _DOWN as exc:
            raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc
        return _text(entry)

    async def ensure_group(self, stream: str, group: str, start: str = "$") -> None:
        try:
            await self._client.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        except _DOWN as exc:
            raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc

    async def stream_read_group(
        self, stream: str, group: str, consumer: str, count: int = 64, block_ms: int | None = 100,
        pending: bool = False,
    ) -> list[StreamEntry]:
        reply: _GroupReply = []
        for attempt in range(2):
            try:
                reply = cast(_GroupReply, await self._reader.xreadgroup(
                    group, consumer, {stream: "0" if pending else ">"}, count=count,
                    block=None if pending else block_ms,
                ))
                break
            except ResponseError as exc:
                # NOGROUP: Redis restarted without persistence (or the stream was deleted). Start over
                # from the beginning of whatever the engines appended since.
                if "NOGROUP" not in str(exc) or attempt:
                    raise
                await self.ensure_group(stream, group, start="0")
            except _DOWN as exc:
                raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc
        out: list[StreamEntry] = []
        trimmed: list[str] = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                if fields is None or _FIELD not in fields:
                    trimmed.append(_text(entry_id))  # pending, but MAXLEN already dropped it
                else:
                    out.append(StreamEntry(_text(entry_id), fields[_FIELD]))
        if trimmed:
            await self.stream_ack(stream, group, trimmed)
        return out

    async def stream_ack(self, stream: str, group: str, ids: list[str]) -> None:
        if not ids:
            return
        try:
            await self._client.xack(stream, group, *ids)
        except _DOWN as exc:
            raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc

    async def stream_range(self, stream: str, after_id: str, count: int = 256) -> list[StreamEntry]:
        try:
            reply = cast(list[tuple[bytes, dict[bytes, bytes]]],
                         await self._client.xrange(stream, min=f"({after_id}", max="+", count=count))
        except _DOWN as exc:
            raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc
        return [StreamEntry(_text(entry_id), fields[_FIELD]) for entry_id, fields in reply if _FIELD in fields]

    async def group_last_delivered(self, stream: str, group: str) -> str | None:
        try:
            groups = await self._client.xinfo_groups(stream)
        except ResponseError:  # no such stream
            return None
        except _DOWN as exc:
            raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc
        for info in groups:
            name = info["name"].decode() if isinstance(info["name"], bytes) else info["name"]
            if name == group:
                last = info["last-delivered-id"]
                return last.decode() if isinstance(last, bytes) else last
        return None

    async def stream_len(self, stream: str) -> int:
        try:
            return int(await self._client.xlen(stream))
        except _DOWN as exc:
            raise BrokerUnavailable(f"redis {self.url}: {exc}") from exc

    async def close(self) -> None:
        for client in (self._client, self._reader):
            try:
                await client.aclose()
            except _DOWN:
                pass
