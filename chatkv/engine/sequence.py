"""A request's state while it waits, runs and finishes."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Hashable

import torch

from chatkv.engine.detokenize import TextStream
from chatkv.engine.sampling import SamplingParams
from chatkv.kvcache.types import BlockTable
from chatkv.outputs import GenerationResult, TokenLogprob, Usage

if TYPE_CHECKING:
    from chatkv.engine.speculative import SpecState
    from chatkv.kvcache.prefix_cache import Node
    from chatkv.kvcache.types import RetainedKV


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]  # prompt, then every generated token
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    max_total_tokens: int  # the model context (or pool) bound on len(token_ids)
    out: TextStream  # the generated text, incrementally
    retain: bool = False  # on finish keep the sequence's KV for the conversation's next turn
    prefix: RetainedKV | None = None  # the previous turn's retained KV, handed over at admission
    retained: RetainedKV | None = None  # what this sequence left behind (set on finish when retain)
    status: Status = Status.WAITING
    # what it holds in the pool: its blocks, the radix lock of its cached prefix, the tokens with
    # KV, those copied back from the host tier (the KV manager fills, grows and empties it)
    kv: BlockTable = field(default_factory=BlockTable)
    num_cached: int = -1  # prefix-hit tokens at first admission (-1: not admitted yet)
    num_restored: int = 0  # tokens brought back from disk before admission (sessions)
    namespace: Hashable | None = None  # radix namespace of its KV; None: the KV manager's default
    priority: int = 0  # lower is admitted first (session turns 0, generate batches 1; the scheduler's rank)
    passed_over: int = 0  # scheduling rounds it waited through while others were admitted (aging)
    on_finish: Callable[["Sequence"], None] | None = None  # its owner, called once at finish on the thread
    # that steps (the loop thread): a session turn takes ``retained`` here, so no KV is ever ownerless
    stream: Any = None  # the engine loop's RequestStream carrying its output, once tracked
    num_prefilled: int = 0  # tokens this request actually computed before its first sample
    # what chatkv.rag.placement did before admission (a Placed: chunk tokens reused, recomputed, and
    # every token it computed); None: nothing
    placed: Any = None
    matcher: Any = None  # a constrained request's chatkv.engine.constraints.Matcher (None: unconstrained)
    finish_reason: str | None = None  # "stop" | "length" | "aborted" | "error"
    error: Exception | None = None  # why it ended with finish_reason "error"
    preemptions: int = 0
    draft: list[int] = field(
        default_factory=list
    )  # tokens proposed for this step's verification (chatkv.engine.speculative)
    spec: SpecState | None = None  # its speculation state: proposer, acceptance, counts (None: never speculated)
    # with params.logprobs: each sampled token's (the model runner appends them before the scheduler
    # appends the tokens, so it may briefly hold more entries than tokens; token_logprobs reads it)
    logprobs: list[TokenLogprob] | None = None
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None

    # views of its block table, read each step by the scheduler and the model runner
    @property
    def block_table(self) -> list[int]:
        return self.kv.blocks

    @property
    def lock_node(self) -> Node | None:
        return self.kv.lock_node

    @property
    def num_computed(self) -> int:
        """Leading tokens whose KV is in the pool (the scheduler advances it after each step)."""
        return self.kv.num_computed

    @num_computed.setter
    def num_computed(self, n: int) -> None:
        self.kv.num_computed = n

    @property
    def num_host(self) -> int:
        return self.kv.num_host

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def text(self) -> str:
        return self.out.text

    def usage(self) -> Usage:
        first = self.first_token_time or self.finish_time or time.perf_counter()
        end = self.finish_time or time.perf_counter()
        decode_s = end - first
        cached = max(self.num_cached, 0)
        restored = min(self.num_restored, cached)  # restored KV was put in the tree before admission
        host = min(self.num_host, cached - restored)  # so was KV copied back from host
        p = self.placed
        reused, recomputed, computed = (p.reused, p.recomputed, p.computed) if p is not None else (0, 0, 0)
        placed = min(reused + computed, cached - restored - host)  # in the prefix attached, built before admission
        return Usage(
            prompt_tokens=self.num_prompt_tokens,
            cached_tokens=cached - restored - host - placed,
            host_tokens=host,
            restored_tokens=restored,
            computed_tokens=self.num_prefilled + computed,
            reused_tokens=reused,
            recomputed_tokens=recomputed,
            generated_tokens=self.num_generated,
            ttft_s=first - self.arrival,
            tokens_per_s=(self.num_generated - 1) / decode_s if self.num_generated > 1 and decode_s > 0 else 0.0,
            proposed_tokens=self.spec.proposed if self.spec is not None else 0,
            accepted_tokens=self.spec.accepted if self.spec is not None else 0,
        )

    def token_logprobs(self, start: int = 0) -> list[TokenLogprob] | None:
        """The logprobs of the generated tokens from ``start`` on, a stop token that ended the
        sequence excluded (None unless ``params.logprobs`` asked for them). Safe to call from any
        thread while the loop runs: it reads only tokens already appended."""
        if self.params.logprobs is None:
            return None
        entries = self.logprobs or []
        n = min(self.num_generated, len(entries))
        if n and n == self.num_generated and self.token_ids[self.num_prompt_tokens + n - 1] in self.stop_ids:
            n -= 1  # a stop token ends the sequence: not part of its text
        return entries[start:n]

    def result(self) -> GenerationResult:
        return GenerationResult(
            request_id=self.seq_id,
            text=self.text,
            token_ids=self.generated_ids,
            finish_reason=self.finish_reason or "aborted",
            usage=self.usage(),
            preemptions=self.preemptions,
            logprobs=self.token_logprobs(),
        )
