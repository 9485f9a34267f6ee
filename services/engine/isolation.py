"""Per-sequence failure isolation for one engine step.

A batch that raises is rerun one sequence at a time (a step is idempotent: it rewrites the same KV slots
from the same tokens), so an exception that one sequence's tokens or parameters cause fails that sequence
alone. When every sequence fails on its own too, or failures repeat with nothing succeeding in between, the
engine itself is broken: that is raised as a loop failure, which stops the engine for a restart.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from services.engine.sequence import Sequence

log = logging.getLogger(__name__)

MAX_FAILED_STEPS_IN_A_ROW = 3  # single-sequence steps failing back to back: blame the engine, not them


class EngineLoopError(RuntimeError):
    """The step failed in a way no single sequence explains: the engine must stop."""


class StepIsolator:
    def __init__(self, run: Callable[[list[Sequence], bool], list[int | None]]) -> None:
        self.run = run
        self.failed_steps_in_a_row = 0

    def step(
        self, seqs: list[Sequence], is_prefill: bool
    ) -> tuple[list[tuple[Sequence, int | None]], list[tuple[Sequence, str]]]:
        """(sequence, token) for those that ran (None: a prefill chunk with more to come), (sequence, error
        message) for those that failed."""
        try:
            tokens = self.run(seqs, is_prefill)
        except Exception as batch_error:  # a rare path: the common one costs one try block per step
            done, failed = self._one_by_one(seqs, is_prefill, batch_error)
        else:
            self.failed_steps_in_a_row = 0
            return list(zip(seqs, tokens)), []
        if done:
            self.failed_steps_in_a_row = 0
        else:
            self.failed_steps_in_a_row += 1
            if self.failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
                raise EngineLoopError(f"{self.failed_steps_in_a_row} steps failed in a row: {failed[0][1]}")
        return done, failed

    def _one_by_one(
        self, seqs: list[Sequence], is_prefill: bool, batch_error: Exception
    ) -> tuple[list[tuple[Sequence, int | None]], list[tuple[Sequence, str]]]:
        if len(seqs) == 1:
            log.warning("request %s failed in the step: %r", seqs[0].request_id, batch_error)
            return [], [(seqs[0], _describe(batch_error))]
        done, failed = [], []
        for seq in seqs:
            try:
                done.append((seq, self.run([seq], is_prefill)[0]))
            except Exception as exc:
                log.warning("request %s failed in the step: %r", seq.request_id, exc)
                failed.append((seq, _describe(exc)))
        if not done:
            raise EngineLoopError(
                f"every sequence of the batch fails on its own: {batch_error!r}"
            ) from batch_error
        return done, failed


def _describe(exc: Exception) -> str:
    return f"the engine failed on this request: {type(exc).__name__}: {exc}"
