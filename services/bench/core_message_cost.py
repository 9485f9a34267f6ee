"""What one decode-step message costs to send between the engine core and its frontend, per encoding.

`python -m services.bench.core_message_cost` times encode + decode of the core's per-step message (a batch of
outputs, one token each, plus the stats dict every 0.25 s) the ways it could travel over the pipe: positional
tuples pickled (before issue 29), dataclasses pickled, msgspec Structs pickled, and msgspec Structs as
MessagePack. services/engine/core_messages.py records the figures and the choice made from them.
"""

from __future__ import annotations

import argparse
import pickle
import statistics
import time
from collections.abc import Callable
from dataclasses import make_dataclass

import msgspec

from services.engine.core_messages import CoreMessage, CoreOutput, CoreOutputs

# The same fields as plain dataclasses, for the comparison.
OutputDataclass = make_dataclass("OutputDataclass", [(f.name, f.type) for f in msgspec.structs.fields(CoreOutput)],
                                 slots=True)
OutputsDataclass = make_dataclass("OutputsDataclass", [(f.name, f.type) for f in msgspec.structs.fields(CoreOutputs)],
                                  slots=True)

OutputDataclass.__module__ = OutputsDataclass.__module__ = __name__  # so pickle finds them here


def _fields(i: int) -> tuple:
    return (f"cmpl-{i:08x}-{i * 7919:016x}", i, 1000 + i, 120, 37, None, None)


def _cases(batch: int, stats: dict[str, float] | None) -> dict[str, tuple[object, Callable, Callable]]:
    rows = [_fields(i) for i in range(batch)]
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(CoreMessage)

    def dump(obj: object) -> bytes:
        return pickle.dumps(obj, pickle.HIGHEST_PROTOCOL)

    return {
        "tuples, pickled": (("outputs", rows, stats), dump, pickle.loads),
        "dataclasses, pickled": (OutputsDataclass([OutputDataclass(*r) for r in rows], stats), dump, pickle.loads),
        "msgspec Structs, pickled": (CoreOutputs([CoreOutput(*r) for r in rows], stats), dump, pickle.loads),
        "msgspec Structs, msgpack": (CoreOutputs([CoreOutput(*r) for r in rows], stats), encoder.encode,
                                     decoder.decode),
    }


def _time_us(message: object, encode: Callable, decode: Callable, repeats: int) -> tuple[float, int]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        decode(encode(message))
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6, len(encode(message))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m services.bench.core_message_cost")
    parser.add_argument("--batches", default="1,8,32", help="outputs per step")
    parser.add_argument("--repeats", type=int, default=20000)
    args = parser.parse_args()
    stats = {f"counter_{i}": float(i) for i in range(40)}  # about what LLMEngine.stats() holds
    print("| encoding | outputs | stats | encode+decode (us) | bytes |\n|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        for with_stats in (False, True):
            for name, (message, encode, decode) in _cases(batch, stats if with_stats else None).items():
                us, size = _time_us(message, encode, decode, args.repeats)
                print(f"| {name} | {batch} | {'yes' if with_stats else 'no'} | {us:.1f} | {size} |", flush=True)


if __name__ == "__main__":
    main()
