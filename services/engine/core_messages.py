"""The messages between the engine core process and its frontend: msgspec Structs, sent as MessagePack.

  frontend -> core   AddRequest, AbortRequest (reason "stop": the frontend saw a stop string), StopCore
  core -> frontend   CoreReady once the model is loaded; CoreOutputs after a step with outputs (stats ride
                     along every STATS_INTERVAL_S and with every finish); CoreStats whenever the core goes
                     idle or a step has no outputs; CoreDead when loading or the loop failed

Why msgspec, measured by `python -m services.bench.core_message_cost` (encode + decode of one decode step's
message, median of 5000, on a shared 2-core machine while a soak ran): 32 outputs without stats take 3.4 us as
msgspec Structs in MessagePack, 5.6 us as the positional tuples they replaced (pickled), 14.8 us as Structs
pickled, 45.4 us as dataclasses pickled; with the stats dict 5.4 / 9.6 / 18.8 / 50.5 us; one output 0.3 / 0.8
/ 3.4 / 6.5 us. So the fields got names and the step's message got cheaper (vLLM's engine core does the same).
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import msgspec

from services.engine.input_processor import EngineLimits
from services.engine.sampling_params import SamplingParams

# array_like: fields travel by position (no names on the wire); gc=False: these hold no reference cycles.


class AddRequest(msgspec.Struct, tag="add", array_like=True, gc=False):
    request_id: str
    serial: int  # the frontend's numbering: its streams match outputs by (request_id, serial)
    prompt_token_ids: list[int]
    params: SamplingParams


class AbortRequest(msgspec.Struct, tag="abort", array_like=True, gc=False):
    request_id: str
    serial: int
    reason: str  # the finish reason the request ends with: "abort", or "stop" for a frontend stop string


class StopCore(msgspec.Struct, tag="stop", array_like=True, gc=False):
    """Abort everything and exit."""


class CoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's step: the token it sampled (None: it ended without one) and how it finished, if it did."""

    request_id: str
    serial: int
    token_id: int | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str | None
    error: str | None


class CoreReady(msgspec.Struct, tag="ready", array_like=True, gc=False):
    limits: EngineLimits
    model_info: dict[str, Any]
    stats: dict[str, float]


class CoreOutputs(msgspec.Struct, tag="outputs", array_like=True, gc=False):
    outputs: list[CoreOutput]
    stats: dict[str, float] | None


class CoreStats(msgspec.Struct, tag="stats", array_like=True, gc=False):
    stats: dict[str, float]


class CoreDead(msgspec.Struct, tag="dead", array_like=True, gc=False):
    message: str
    user_error: bool  # a bad model directory or setting (ValueError) rather than a failure


CoreRequest = AddRequest | AbortRequest | StopCore
CoreMessage = CoreReady | CoreOutputs | CoreStats | CoreDead

_encoder = msgspec.msgpack.Encoder()
_requests = msgspec.msgpack.Decoder(CoreRequest)
_messages = msgspec.msgpack.Decoder(CoreMessage)


def send(conn: Connection, message: CoreRequest | CoreMessage) -> None:
    conn.send_bytes(_encoder.encode(message))


def recv_request(conn: Connection) -> CoreRequest:
    """The frontend's next request; EOFError once it is gone."""
    return _requests.decode(conn.recv_bytes())


def recv_message(conn: Connection) -> CoreMessage:
    """The core's next message; EOFError once it is gone."""
    return _messages.decode(conn.recv_bytes())
