"""A request as the scheduler sees it: token ids, KV blocks, status, sampling state."""

from __future__ import annotations

import itertools
import time
from enum import Enum, auto
from typing import TYPE_CHECKING

import torch

from services.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from services.engine.sampler import PenaltyState


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


_serials = itertools.count(1)


class Sequence:
    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, block_size: int
    ) -> None:
        self.request_id = request_id
        self.serial = next(_serials)
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.block_size = block_size
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0  # tokens whose K/V are in the cache
        self.num_scheduled_tokens = 0  # uncached tokens a prefill step computes (1: a running row; 0: all left)
        self.block_keys: list[bytes] = []  # prefix keys of its full blocks so far (block manager's prefix cache)
        self.num_registered_blocks = 0  # leading blocks of block_table already registered in the prefix cache
        self.finish_reason: str | None = None
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator().manual_seed(params.seed)
        self.penalty_state: PenaltyState | None = None  # made by the sampler, only if a penalty is set

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def num_blocks_needed(self) -> int:
        return (len(self.token_ids) + self.block_size - 1) // self.block_size

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
