"""Continuous batching and request state: which sequences compute how many tokens next,
and what happens to them after each step.

Each step: every running sequence gets its share first (1 token for a decode, a
chunk for an unfinished prefill), then waiting sequences are admitted, longest
cached prefix first, while the token budget and free blocks allow. When blocks run
out the newest running sequence is preempted: its computed full blocks go into the
radix tree (so its re-admission hits them), its references are dropped and it goes
back to the front of the queue. A request that cannot fit even alone is finished
with an ``OutOfBlocks`` error of its own.

``postprocess`` takes the sampled tokens: it appends them, feeds the text stream,
checks stop tokens, stop strings and length, and finishes sequences.

Speculative decoding (a ``Speculator``, chatkv.engine.speculative): after the plan is made, decoding
sequences may get proposals (``seq.draft``) out of what is left of the step's token budget and
of the free blocks (never by evicting, preempting or spilling anyone); such a sequence computes
``1 + len(draft)`` tokens. Its sampled result is then a list of tokens: they are appended one at
a time through the same stop/length checks (the rest dropped at the first stop), only the KV of
the accepted ones counts as computed, and the blocks past it go back to the pool. ``abort``
ends a request in any state. All KV is held and released through the KVManager;
whatever raises in here leaves every sequence either holding its KV (running) or
holding none (waiting, finished).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from chatkv.engine.sequence import Sequence, Status
from chatkv.engine.speculative import Speculator
from chatkv.errors import OutOfBlocks
from chatkv.kvcache.manager import KVManager

log = logging.getLogger("chatkv.engine.core")

AGE_ROUNDS = 32  # a request passed over this many times goes first, whatever its priority


@dataclass(frozen=True)
class NeedsBlocks:
    """``schedule(relievable=True)``'s answer when blocks ran short: ``blocks`` more could not be
    freed by eviction. Whoever drives the steps frees them (spills idle conversations) and
    schedules again; nothing was preempted or failed for it."""

    blocks: int


class Scheduler:
    def __init__(
        self,
        kv: KVManager,
        max_batch_tokens: int,
        max_running: int,
        age_rounds: int = AGE_ROUNDS,
        speculator: Speculator | None = None,
    ):
        self.kv = kv
        self.speculator = speculator  # None: no speculative decoding
        self.age_rounds = age_rounds
        self.max_batch_tokens = max_batch_tokens
        self.max_running = max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def sequences(self) -> list[Sequence]:
        """Every sequence that may hold KV (for integrity checks)."""
        return list(self.waiting) + self.running

    def counts(self) -> tuple[int, int]:
        """(running, waiting) requests now."""
        return len(self.running), len(self.waiting)

    # -- ending requests ------------------------------------------------------------

    def _finish(self, seq: Sequence, reason: str, error: Exception | None = None) -> None:
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED  # first: a failure below must not leave it queued
        seq.finish_reason = seq.finish_reason or reason
        seq.error = error
        seq.finish_time = time.perf_counter()
        try:
            seq.out.finish()
        finally:  # a finished sequence holds no KV, whatever the detokenizer raised
            seq.retained = self.kv.release(seq, retain=seq.retain and reason != "error")
            self._hand_over(seq)

    @staticmethod
    def _hand_over(seq: Sequence) -> None:
        """Call the finished sequence's owner (once): a session turn takes its retained KV now, on
        this thread, so no KV is ever in transit. A failing owner never breaks the scheduler."""
        owner, seq.on_finish = seq.on_finish, None
        if owner is None:
            return
        try:
            owner(seq)
        except Exception as e:  # noqa: BLE001 - the retained KV stays on seq, which its owner ends
            log.warning("request %s: its finish callback failed (%s: %s)", seq.seq_id, type(e).__name__, e)

    def abort(self, seq: Sequence) -> None:
        """End a request now, waiting or running; what it generated so far stays in its result."""
        if not seq.finished:
            self._finish(seq, "aborted")

    def fail(self, seq: Sequence, error: Exception) -> None:
        """End a request with an error of its own (it is raised to whoever drives it)."""
        if not seq.finished:
            self._finish(seq, "error", error)

    def fail_all(self, error: Exception) -> None:
        """End every request with ``error`` (a step that raised: a bug, not a request's own error)."""
        for seq in self.sequences():
            self.fail(seq, error)

    # -- admission --------------------------------------------------------------------

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Attach the cached prefix and reserve blocks for a first chunk; 0 if it cannot start now."""
        self.kv.attach(seq)
        chunk = min(len(seq.token_ids) - seq.num_computed, budget)
        try:
            ok = self.kv.reserve(seq.kv, chunk)
        except BaseException:
            self.kv.release(seq)  # it waits on, holding nothing
            raise
        if not ok:
            self.kv.release(seq)  # its tail block (if it took one) goes into the tree or back to the pool
            return 0
        if seq.num_cached < 0:
            seq.num_cached = seq.num_computed
        return chunk

    def schedule(self, relievable: bool = False) -> list[tuple[Sequence, int]] | NeedsBlocks:
        """Return ``(sequence, tokens to compute)`` pairs for the next step, in batch order.

        ``relievable``: memory held elsewhere may be freed on request (idle conversations): where
        blocks run short, before preempting or failing anyone for them, return ``NeedsBlocks``
        (what was reserved stays reserved; a second pass reuses it)."""
        self.kv.shortfall = 0
        plan: list[tuple[Sequence, int]] = []
        budget = self.max_batch_tokens
        for seq in list(self.running):
            if seq not in self.running:  # preempted below on behalf of an older sequence
                continue
            want = min(len(seq.token_ids) - seq.num_computed, max(budget, 1))
            while not self.kv.reserve(seq.kv, want):
                if relievable and self.kv.shortfall:
                    return NeedsBlocks(self.kv.shortfall)
                victim = self.running[-1]
                self._preempt(victim)
                plan = [(s, n) for s, n in plan if s is not victim]
                if victim is seq:
                    break
            else:
                plan.append((seq, want))
                budget -= want
        blocked = None  # the sequence whose turn it was and that could not start for want of blocks
        if self.waiting and budget > 0 and len(self.running) < self.max_running:
            ranked = sorted(self.waiting, key=self._rank)
            for seq in ranked:
                if budget <= 0 or len(self.running) >= self.max_running:
                    break
                chunk = self._admit(seq, budget)
                if chunk == 0:
                    if relievable and self.kv.shortfall:
                        return NeedsBlocks(self.kv.shortfall)
                    blocked = seq
                    break
                self.waiting.remove(seq)
                seq.status = Status.RUNNING
                self.running.append(seq)
                plan.append((seq, chunk))
                budget -= chunk
            for seq in self.waiting:  # passed over this round
                seq.passed_over += 1
        if not plan and self.waiting and not self.running and self._free_waiting_prefixes(blocked):
            return plan  # KV handed to waiting requests went down a tier: the next step retries
        if not plan and self.waiting and not self.running:
            # nothing runs and the one whose turn it was cannot start: it never will (not waiting[0],
            # which may rank behind it and fit)
            seq = blocked if blocked is not None else self.waiting[0]
            pool = self.kv.pool
            locked = self.kv.cache.cached_blocks - self.kv.cache.evictable_blocks
            self.fail(
                seq,
                OutOfBlocks(
                    f"request {seq.seq_id} ({len(seq.token_ids)} tokens so far) cannot fit in the KV pool: "
                    f"{pool.num_blocks} blocks of {pool.block_size} tokens, {locked} locked by open sessions and "
                    f"pinned prefixes, {pool.num_free} free; close idle sessions, lower max_tokens or raise "
                    "kv_cache_bytes / num_blocks"
                ),
            )
        if self.speculator is not None and plan:
            plan = self._speculate(plan, budget)
        return plan

    def _speculate(self, plan: list[tuple[Sequence, int]], budget: int) -> list[tuple[Sequence, int]]:
        """Give decoding sequences of ``plan`` proposals to verify, within ``budget`` tokens and the
        free blocks; such a sequence's entry becomes ``1 + len(draft)`` tokens."""
        decodes = [s for s, n in plan if n == 1 and s.num_computed + 1 == len(s.token_ids) and s.num_generated > 0]
        if not decodes:
            return plan
        drafts = self.speculator.assign(decodes, sum(n for _, n in plan), budget)
        if not drafts:
            return plan
        bs, pool = self.kv.block_size, self.kv.pool
        for seq, draft in drafts.items():
            held = len(seq.block_table) * bs - seq.num_computed - 1  # room in the blocks it holds
            extra = max(len(draft) - held, 0)
            if -(-extra // bs) > pool.num_free:  # only free blocks: speculation never evicts
                draft = draft[: held + pool.num_free * bs]
            if draft and self.kv.reserve(seq.kv, 1 + len(draft)):
                seq.draft = list(draft)
        return [(s, n + len(s.draft)) for s, n in plan]

    def _rank(self, seq: Sequence) -> tuple:
        """Admission order: requests passed over ``age_rounds`` times first (nothing starves),
        then lower ``priority`` (interactive turns 0 before batch jobs 1), then the longest
        cached prefix (those cost the least to start), then arrival."""
        aged = seq.passed_over >= self.age_rounds
        return (not aged, seq.priority, -self.kv.cached_len(seq.token_ids, seq.namespace), seq.seq_id)

    def _free_waiting_prefixes(self, keep: Sequence | None) -> bool:
        """Nothing runs and a request cannot start: the KV other waiting requests were handed
        (their conversations' histories, locked while they wait) moves down a tier (host memory,
        else evictable; its snapshot is on disk) so blocks come free. True if any did."""
        freed = False
        for seq in reversed(self.waiting):
            if seq is not keep and seq.prefix is not None:
                self.kv.offload(seq.prefix)
                seq.prefix = None
                freed = True
        return freed

    # -- after the forward --------------------------------------------------------------

    def postprocess(self, plan: list[tuple[Sequence, int]], sampled: dict[Sequence, int | Exception]) -> list[Sequence]:
        """Account the computed tokens, append each sampled token (or fail its sequence), and
        finish the sequences that are done. Returns the sequences that finished."""
        for seq, n in plan:
            if seq.draft:
                n = 1  # its draft's KV counts once verified (below)
            seq.num_computed += n
            if seq.first_token_time is None:
                seq.num_prefilled += n
        finished = []
        for seq, token in sampled.items():
            try:
                if isinstance(token, Exception):
                    seq.draft = []
                    self.fail(seq, token)
                elif isinstance(token, list):
                    if not self._append_verified(seq, token):
                        continue
                elif self._append(seq, token):
                    self._finish(seq, seq.finish_reason)
                else:
                    continue
            except Exception as err:  # its own failure (e.g. its detokenizer): the rest of the batch goes on
                self._failed(seq, err)
            finished.append(seq)
        return finished

    def _failed(self, seq: Sequence, err: Exception) -> None:
        """End ``seq`` with ``err`` after its postprocessing raised; its KV is released either way."""
        if seq.finished:  # it raised while finishing, after its KV was released
            seq.finish_reason, seq.error = "error", err
            return
        try:
            self.fail(seq, err)
        except Exception:  # its text stream failed again while settling: recorded and released already
            pass

    def _append_verified(self, seq: Sequence, tokens: list[int]) -> bool:
        """Append a verification step's tokens one at a time, as plain decoding would have, up to
        the first that ends the sequence; count the accepted proposals' KV as computed and give
        back the blocks past it. True when it finished."""
        draft, seq.draft = seq.draft, []
        self.speculator.observe(seq, len(draft), len(tokens) - 1)
        seq.num_computed += len(tokens) - 1  # the accepted proposals: their KV is the model's own
        done = False
        for token in tokens:
            if self._append(seq, token):
                done = True
                break
        seq.num_computed = min(seq.num_computed, len(seq.token_ids) - 1)  # the last token never has KV
        if done:
            self._finish(seq, seq.finish_reason)
        else:
            self.kv.trim(seq.kv)
        return done

    def _append(self, seq: Sequence, token: int) -> bool:
        """Add a sampled token; return True when the sequence is done (finish_reason set)."""
        if seq.first_token_time is None:
            seq.first_token_time = time.perf_counter()
        seq.token_ids.append(token)
        if seq.matcher is not None and not seq.matcher.advance(token):  # masked: only a forced token
            raise RuntimeError(f"token {token} breaks the request's constraint")
        if token in seq.stop_ids:
            seq.finish_reason = "stop"
        elif seq.out.add(token):
            seq.finish_reason = "stop"  # a stop string
        elif seq.matcher is not None and seq.matcher.is_done():
            seq.finish_reason = "stop"  # the constraint is complete: nothing but EOS could follow
        elif seq.num_generated >= seq.params.max_tokens or len(seq.token_ids) >= seq.max_total_tokens:
            seq.finish_reason = "length"
        return seq.finish_reason is not None
