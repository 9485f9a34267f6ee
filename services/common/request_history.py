"""One request's finished iterations as the predictors read them, kept in compact arrays.

The predictors read two things of a request's past: its last finished iteration (previous-token, the expert
map's semantic key) and the sum of its decode iterations' counts (EAMC's request-level EAM). So that is all
that is kept: the last iteration's probs (float32) and counts (the smallest exact dtype), and every windowed
decode iteration's counts as a list of flat expert indices, one entry per routed token (a top-k decode step
is num_layers x k uint16). At 24 layers x 64 experts, top-2, that is under 16 KB a request where the
IterationContext objects it replaces held ~20 KB an iteration (tests/test_predictor_history.py measures it).
The past's embeddings are not kept: no predictor reads them.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable

import numpy as np

from services.common.iteration_context import IterationContext

_EMPTY = np.zeros(0, np.float32)


def _exact_uint(counts: np.ndarray) -> np.ndarray | None:
    """`counts` in the smallest unsigned dtype that holds it exactly, or None (negative, fractional, huge)."""
    if counts.size and (counts.min() < 0 or counts.max() > np.iinfo(np.uint16).max):
        return None
    if not np.array_equal(counts, np.floor(counts)):
        return None
    top = counts.max() if counts.size else 0
    return counts.astype(np.uint8 if top <= np.iinfo(np.uint8).max else np.uint16)


class RequestHistory:
    """The last finished iteration whole, and the decode counts of the last `window` ones (None: all)."""

    __slots__ = ("window", "_request_id", "_iteration", "_num_tokens", "_probs", "_counts", "_iterations",
                 "_lengths", "_experts", "_dense")

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.clear()

    @classmethod
    def of(cls, iterations: Iterable[IterationContext], window: int | None = None) -> RequestHistory:
        history = cls(window)
        for it in iterations:
            history.append(it)
        return history

    def clear(self) -> None:
        self._request_id, self._iteration, self._num_tokens = "", -1, 1
        self._probs: np.ndarray | None = None
        self._counts: np.ndarray | None = None
        self._iterations = array("i")  # the windowed iterations' numbers, oldest first
        self._lengths = array("I")  # how many entries of _experts each windowed iteration holds
        self._experts: array[int] = array("H")  # flat layer * num_experts + expert indices, a token's each
        self._dense: dict[int, np.ndarray] | None = None  # iteration -> float32 counts indices cannot say (rare)

    def __len__(self) -> int:
        return len(self._iterations)

    def __bool__(self) -> bool:
        return self._probs is not None

    @property
    def nbytes(self) -> int:
        """Bytes of array data held (what grows with the model's shape and the request's length)."""
        arrays = [a.nbytes for a in (self._probs, self._counts) if a is not None]
        lists = [len(a) * a.itemsize for a in (self._iterations, self._lengths, self._experts)]
        return sum(arrays) + sum(lists) + sum(a.nbytes for a in (self._dense or {}).values())

    def append(self, ctx: IterationContext) -> None:
        """Records a finished iteration (the newest); the oldest leaves the window."""
        counts = _exact_uint(ctx.counts)
        self._request_id, self._iteration, self._num_tokens = ctx.request_id, ctx.iteration, ctx.num_tokens
        self._probs = ctx.probs
        self._counts = counts if counts is not None else ctx.counts
        self._iterations.append(ctx.iteration)
        if ctx.iteration == 0:  # the prefill is no part of the decode sum
            self._lengths.append(0)
        elif counts is None or ctx.counts.size > 1 << 16:
            self._lengths.append(0)
            self._dense = self._dense or {}
            self._dense[ctx.iteration] = ctx.counts.astype(np.float32)
        else:
            flat = counts.ravel()
            nonzero = np.flatnonzero(flat)
            entries = np.repeat(nonzero, flat[nonzero]).astype(np.uint16)
            self._experts.frombytes(entries.tobytes())
            self._lengths.append(len(entries))
        if self.window is not None and len(self._iterations) > self.window:
            dropped = self._iterations.pop(0)
            if self._dense:
                self._dense.pop(dropped, None)
            del self._experts[: self._lengths.pop(0)]

    @property
    def last(self) -> IterationContext | None:
        """The latest finished iteration (float32 probs and counts; no embedding), or None."""
        if self._probs is None or self._counts is None:
            return None
        return IterationContext(self._request_id, self._iteration, self._probs, self._counts.astype(np.float32),
                                _EMPTY, num_tokens=self._num_tokens)

    def decode_counts(self) -> np.ndarray | None:
        """The windowed decode iterations' counts summed ([layers, experts] float32), or None if there are none."""
        if self._probs is None or not any(i > 0 for i in self._iterations):
            return None
        shape = self._probs.shape
        total = np.bincount(np.frombuffer(self._experts, np.uint16), minlength=shape[0] * shape[1])
        out = total.astype(np.float32).reshape(shape)
        for counts in (self._dense or {}).values():
            out += counts
        return out
