"""Starting several engine streams together (n > 1, several prompts) and interleaving their outputs."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from services.gateway.errors import APIError


async def _close_all(streams: Sequence[AsyncGenerator[Any, None]]) -> None:
    for stream in streams:
        with contextlib.suppress(Exception):
            await stream.aclose()


async def prime(streams: Sequence[AsyncGenerator[Any, None]]) -> list[Any]:
    """The first output of every stream, fetched concurrently.

    This is where admission, failover and the engine's validation happen, so awaiting it before sending
    response headers lets those errors keep their HTTP status. If any stream fails, all are closed (their
    engine requests aborted) and the most telling error is raised: a client error over a server one.
    """
    if len(streams) == 1:
        try:
            return [await anext(streams[0])]
        except BaseException:
            await _close_all(streams)
            raise
    tasks = [asyncio.ensure_future(anext(s)) for s in streams]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled: the client went away
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(streams)
        raise
    errors = [e for e in (t.exception() for t in done) if e is not None]
    if not errors:
        return [t.result() for t in tasks]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    await _close_all(streams)
    api_errors = sorted((e for e in errors if isinstance(e, APIError)), key=lambda e: e.status >= 500)
    raise (api_errors[0] if api_errors else errors[0])


async def merge(
    streams: Sequence[AsyncGenerator[Any, None]], firsts: Sequence[Any]
) -> AsyncGenerator[tuple[int, Any], None]:
    """Yields (stream index, output) as outputs arrive, starting with the primed first outputs.

    An error in any stream is raised here after the others are closed (their engine requests aborted).
    """
    if len(streams) == 1:  # the common case: no tasks, no queue
        stream = streams[0]
        try:
            yield 0, firsts[0]
            async for out in stream:
                yield 0, out
        finally:
            await _close_all(streams)
        return

    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
    done_marker = object()

    async def pump(index: int, stream: AsyncGenerator[Any, None]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((index, out, None))
            queue.put_nowait((index, done_marker, None))
        except Exception as exc:
            queue.put_nowait((index, None, exc))

    tasks: list[asyncio.Future] = []
    remaining = len(streams)
    try:
        for index, first in enumerate(firsts):
            yield index, first
        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        while remaining:
            index, out, error = await queue.get()
            if error is not None:
                raise error
            if out is done_marker:
                remaining -= 1
                continue
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)
        await _close_all(streams)
