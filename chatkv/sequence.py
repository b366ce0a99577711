"""A request's state while it waits, runs and finishes."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Hashable

import torch

from chatkv.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Retained:
    """KV a finished sequence leaves behind for the next turn of its session.

    ``node`` is the locked radix node ending at its last full block (None if it
    had none); ``tail_block`` is its own partial last block (a pool reference the
    holder owns) with ``tail_len`` tokens in it; ``kv_len`` counts every token
    with KV: ``full blocks * block_size + tail_len``.
    """

    node: Any
    tail_block: int | None
    tail_len: int
    kv_len: int


@dataclass
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt, then every generated token
    num_prompt_tokens: int
    params: SamplingParams
    namespace: Hashable
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    max_total_tokens: int  # the model context (or pool) bound on len(token_ids)
    retain: bool = False  # on finish keep the sequence's KV locked for the next turn (sessions)
    prefix: Retained | None = None  # the previous turn's retained KV, handed over at admission
    retained: Retained | None = None  # what this sequence left behind (set on finish when retain)
    status: Status = Status.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens whose KV is in the pool
    num_cached: int = -1  # prefix-hit tokens at first admission (-1: not admitted yet)
    num_restored: int = 0  # tokens brought back from disk before admission (sessions)
    num_prefilled: int = 0  # tokens this request actually computed before its first sample
    lock_node: Any = None  # radix node locked while the sequence holds its prefix
    finish_reason: str | None = None
    text: str = ""
    emitted: int = 0  # characters of text already streamed
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
