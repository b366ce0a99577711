"""Speculative decoding from the request's own tokens (prompt lookup), exact, in continuous batching.

(A few lines past 400 on purpose: the proposer, the verifier and the policy share one step's
cost model and are read together.)

A decoding sequence whose recent text continues something it has already seen (a source being
quoted, code being rewritten, a pinned document, its own reply) gets up to ``k`` proposed
tokens. The scheduler reserves KV for ``[last token + proposals]`` and the model runner
computes all of them in the same step as the rest of the batch (one forward, every row's
logits); ``verify`` keeps the proposals the target model agrees with plus one token of its own,
and the scheduler appends those one at a time through the normal stop/length path and gives
back the KV (and the blocks) of the rest.

Pieces:

* ``Proposer``: proposes up to ``k`` tokens to follow a request's tokens, with a ``key`` naming
  the kind of guess (its acceptance is tracked per key). ``NgramProposer`` is prompt lookup:
  the longest suffix of the tokens (4 tokens down to 1) that occurred before, and what followed
  it there (the latest occurrence; continued periodically when the match runs into the end, so
  a loop proposes its next period). A draft model would be another ``Proposer``.
* ``verify``: the tokens the step emits. At each position ``i`` it draws ``x_i`` from the
  target's distribution exactly as plain decoding would (``sampling.sample`` with the request's
  own generator, the repetition penalty seeing the history plus the tokens accepted before
  ``i``), and accepts the proposal ``d_i`` iff ``x_i == d_i``; the first ``x_i`` that differs
  (or the bonus after all ``k``) is emitted and ends the step. For a point-mass draft this *is*
  rejection sampling: ``d`` is accepted with probability ``p(d)`` and a rejected position's
  token is distributed as ``p`` with ``d`` removed, renormalised, so the output distribution is
  exactly the target's. Greedy is the ``temperature == 0`` case (the argmax). Because it draws
  the same numbers in the same order as plain decoding, a seeded request gives the same tokens
  with speculation on or off. (A draft model with its own distribution ``q`` would need the
  general ``min(1, p/q)`` rule instead.)
* ``Speculator``: the engine's policy. ``speculative="lookup"`` proposes ``k`` tokens whenever a
  match exists; ``"auto"`` (the default) gives each sequence as many proposals as pay: the
  ``j``-th proposal is expected to add ``alpha ** j`` tokens and costs one more row of the step;
  proposals are added best first while they raise the step's expected tokens per second. So
  free-form text (low acceptance) and big batches (a step already worth many tokens) speculate
  little or not at all. Steps never grow past ``max_rows`` (below ``quant_dense_rows``, where
  quantised weights stay on their few-row kernel), past the step's token budget, or into blocks
  that are not free (speculation never evicts, preempts or spills anyone).

  - ``alpha``: the sequence's recent acceptance for that kind of match (its key: the match
    length 1-3, 4-7, or ``LONG_MATCH`` and more), decayed so it is re-probed now and then, with
    the engine-wide acceptance of that kind (``SharedAcceptance``, over all requests) as its
    prior: a new request quoting a source proposes long at once, and a chat does not probe every
    kind at 0.5.
  - the row's cost (``StepCost.row_cost``, relative to a one-row step) is measured on this
    machine from the engine's own decode steps (the model runner reports each one's rows and
    time): the median of estimates from consecutive steps of different rows, so a busy core's
    outlier or a slowly changing load does not move it. Before it is measured: 0.2 on a CPU,
    0.05 where the few-row products run on AMX tiles (chatkv.kernels.cpu_decode.amx).
* Constrained requests (``seq.matcher``, chatkv.engine.constraints) speculate too: a proposal is cut to
  the prefix the constraint accepts (``Matcher.validate``), and ``verify`` masks each position's
  logits with the matcher advanced through the tokens before it, exactly as plain decoding masks
  each step's, then rolls the matcher back (the scheduler advances it again as it appends).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from chatkv.engine.sampling import SamplingParams, sample

MODES = ("auto", "off", "lookup")
MAX_NGRAM = 4
LONG_MATCH = 8  # a match this long (measured past MAX_NGRAM) is its own kind: quoting, mostly
DECAY = 0.9  # weight of past acceptance per verification
IDLE_DECAY = 0.98  # per step a kind of match is not tried: its estimate drifts back to the prior
SHARED_DECAY = 0.98  # the engine-wide acceptance per kind of match (the prior of a new request)
CPU_MAX_BATCH = 4  # auto speculates in CPU steps of at most this many decoding sequences (Speculator.max_batch)
PRIOR_WEIGHT = 2.0  # how many verifications the shared prior counts for in a request's estimate


@dataclass
class Proposal:
    tokens: list[int]
    key: Any  # the kind of guess (NgramProposer: the match length); acceptance is tracked per key


class Proposer(Protocol):
    """Proposes tokens to follow a request's tokens. One per request: it may keep an index of
    the tokens it has seen (they only grow while the request runs)."""

    def propose(self, tokens: list[int], k: int) -> Proposal | None: ...


class NgramProposer:
    """Prompt lookup over the request's own tokens: the longest suffix (``max_n`` tokens down to
    ``min_n``) seen before, continued with what followed its latest occurrence."""

    def __init__(self, max_n: int = MAX_NGRAM, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> the position after its latest occurrence
        self._indexed = 0  # n-grams ending before this position are indexed
        self._seen: list[int] | None = None

    def _extend(self, tokens: list[int]) -> None:
        if self._seen is not tokens or len(tokens) < self._indexed:  # another list: start again
            self._index.clear()
            self._indexed, self._seen = 0, tokens
        idx, top = self._index, self.max_n
        for end in range(max(self._indexed, 1), len(tokens)):  # an n-gram ending at ``end`` has a continuation
            for n in range(1, min(top, end) + 1):
                idx[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, len(tokens))

    def propose(self, tokens: list[int], k: int) -> Proposal | None:
        if k <= 0 or len(tokens) < 2:
            return None
        self._extend(tokens)
        size = len(tokens)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = self._index.get(tuple(tokens[size - n :]))
            if end is None:
                continue
            out: list[int] = []
            for j in range(k):  # past the end the match continues into the proposal itself (a loop)
                pos = end + j
                out.append(tokens[pos] if pos < size else out[pos - size])
            return Proposal(out, n if n < self.max_n else self._kind(tokens, end, n))
        return None

    def _kind(self, tokens: list[int], end: int, n: int) -> int:
        """A full-length match's key: ``max_n``, or ``LONG_MATCH`` when the suffix matches at
        least that many tokens there (a quoted passage is accepted far more than a phrase)."""
        size = len(tokens)
        while n < LONG_MATCH and end - n - 1 >= 0 and tokens[end - n - 1] == tokens[size - n - 1]:
            n += 1
        return LONG_MATCH if n >= LONG_MATCH else self.max_n


class SharedAcceptance:
    """The engine's acceptance per kind of guess over all requests, decayed: the prior a request
    starts from (a quoted passage's long matches are accepted at once, a chat's short ones are
    not probed at 0.5 by every new request)."""

    def __init__(self):
        self.stats: dict = {}  # key -> [accepted, tried], decayed

    def mean(self, key: Any) -> float:
        acc, tried = self.stats.get(key, (0.0, 0.0))
        return (acc + 1.0) / (tried + 2.0)  # a uniform prior: 0.5 before any evidence

    def observe(self, key: Any, accepted: int, trials: int) -> None:
        acc, tried = self.stats.get(key, (0.0, 0.0))
        self.stats[key] = [acc * SHARED_DECAY + accepted, tried * SHARED_DECAY + trials]


@dataclass
class SpecState:
    """One request's speculation: its proposer, its acceptance per kind of match, its counts."""

    proposer: Proposer
    shared: SharedAcceptance = field(default_factory=SharedAcceptance)  # the engine's, its prior
    cost: "StepCost | None" = None  # the engine's step-time model: the model runner reports its steps to it
    stats: dict = field(default_factory=dict)  # key -> [accepted, tried], decayed
    key: Any = None  # the kind of the proposal in flight
    drafts: int = 0  # verification steps
    proposed: int = 0  # proposed tokens
    accepted: int = 0  # of which accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # accepted proposals by position (0 = first)

    def alpha(self, key: Any) -> float:
        """The chance the next proposal of this kind is accepted: this request's own record,
        with the engine-wide rate counting as ``PRIOR_WEIGHT`` verifications."""
        acc, tried = self.stats.get(key, (0.0, 0.0))
        return (acc + PRIOR_WEIGHT * self.shared.mean(key)) / (tried + PRIOR_WEIGHT)

    def observe(self, key: Any, proposed: int, accepted: int) -> None:
        acc, tried = self.stats.get(key, (0.0, 0.0))
        trials = accepted + (1 if accepted < proposed else 0)
        self.stats[key] = [acc * DECAY + accepted, tried * DECAY + trials]
        self.shared.observe(key, accepted, trials)
        self.drafts += 1
        self.proposed += proposed
        self.accepted += accepted
        while len(self.accepted_per_pos) < proposed:
            self.accepted_per_pos.append(0)
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    def idle(self, key: Any) -> None:
        s = self.stats.get(key)
        if s is not None:
            s[0] *= IDLE_DECAY
            s[1] *= IDLE_DECAY


class StepCost:
    """What one more row costs a decode step, relative to a one-row step (``row_cost``), measured
    online from the engine's own steps: a step of ``n`` rows is taken to cost ``t0 * (1 + r * (n - 1))``.

    Each decode-only step reports its rows, its sequences and its seconds (``record``); two
    consecutive steps with as many sequences and different rows give one estimate of ``r`` from
    the ratio of their times (consecutive, so a load that changes slowly cancels out), and
    ``row_cost`` is the median of the last ``window`` estimates (an outlier, a step that waited
    on a busy core, moves it by at most one place), clamped to ``[lo, hi]``. Until ``min_samples``
    estimates exist it is ``prior``. An estimate expires after ``max_age`` decode steps: a cost
    measured high stops speculation, so no new estimates would come; once they expire the prior
    returns, auto probes again and measures anew."""

    def __init__(
        self,
        prior: float,
        window: int = 31,
        min_samples: int = 5,
        lo: float = 0.02,
        hi: float = 2.0,
        max_age: int = 2000,
    ):
        self.prior, self.lo, self.hi, self.min_samples, self.max_age = prior, lo, hi, min_samples, max_age
        self._estimates: deque[tuple[int, float]] = deque(maxlen=window)  # (the step it was taken at, r)
        self._steps = 0  # decode steps recorded
        self._last: tuple[int, int, float] | None = None  # the previous step's (sequences, rows, seconds)
        self._value = prior

    @property
    def row_cost(self) -> float:
        return self._value

    @property
    def samples(self) -> int:
        """Estimates the current value is the median of (0: it is the prior)."""
        return len(self._estimates) if len(self._estimates) >= self.min_samples else 0

    def record(self, seqs: int, rows: int, seconds: float) -> None:
        """A decode-only step: ``seqs`` sequences, ``rows`` rows in all (their proposals included)."""
        if not (seconds > 0 and math.isfinite(seconds)) or rows < seqs or seqs < 1:
            self._last = None
            return
        self._steps += 1
        if self._estimates and self._estimates[0][0] < self._steps - self.max_age:
            while self._estimates and self._estimates[0][0] < self._steps - self.max_age:
                self._estimates.popleft()
            self._update()
        last, self._last = self._last, (seqs, rows, seconds)
        if last is None or last[0] != seqs or last[1] == rows:
            return
        a, b = last[1:], (rows, seconds)
        (n1, t1), (n2, t2) = (a, b) if a[0] < b[0] else (b, a)
        # t2 / t1 = (1 + r (n2 - 1)) / (1 + r (n1 - 1))  =>  r = (q - 1) / ((n2 - 1) - q (n1 - 1))
        q = t2 / t1
        den = (n2 - 1) - q * (n1 - 1)
        r = self.hi if den <= 0 else min(max((q - 1) / den, 0.0), self.hi)
        self._estimates.append((self._steps, r))
        self._update()

    def _update(self) -> None:
        if len(self._estimates) < self.min_samples:
            self._value = self.prior
        else:
            self._value = min(max(statistics.median(r for _, r in self._estimates), self.lo), self.hi)

    def skip(self) -> None:
        """A step that was not decode-only: the next one has no neighbour to compare with."""
        self._last = None


def verify(
    logits: torch.Tensor,
    draft: list[int],
    params: SamplingParams,
    history: list[int],
    generator: torch.Generator | None,
    matcher: Any = None,
    num_prompt: int = 0,
) -> list[int]:
    """The tokens a verification step emits, from ``logits [len(draft) + 1, vocab]`` (row ``i``:
    the target's logits after the history and ``draft[:i]``): the accepted proposals, then the
    target's own token at the first disagreement (or after all of them). See the module doc.
    ``matcher``: a constrained request's; row ``i`` is masked in place as plain decoding would
    mask it, and the matcher is left where it was. ``num_prompt``: the leading tokens of ``history``
    that are the prompt (presence and frequency penalties count the rest, as ``sample`` does)."""
    out: list[int] = []
    try:
        for i in range(len(draft) + 1):
            if matcher is not None:
                matcher.mask_into(logits[i])
            token = sample(logits[i], params, history + out if out else history, generator, num_prompt)
            if matcher is not None and not matcher.advance(token):
                raise RuntimeError(f"token {token} breaks the request's constraint")
            out.append(token)
            if i == len(draft) or token != draft[i] or (matcher is not None and matcher.is_done()):
                break
    finally:
        if matcher is not None:
            matcher.rollback(len(out))  # the scheduler's append advances it through these again
    return out


def eligible(seq: Any) -> int:
    """How many tokens ``seq`` may have proposed now (0: it does not speculate this step)."""
    left = min(seq.params.max_tokens - seq.num_generated, seq.max_total_tokens - len(seq.token_ids))
    return max(left - 1, 0)  # the step also emits the target's own token after the proposals


class Speculator:
    def __init__(
        self,
        mode: str = "auto",
        max_k: int = 5,
        row_cost: float = 0.2,
        max_rows: int = 15,
        proposer=NgramProposer,
        max_batch: int | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"speculative must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.max_k, self.max_rows = mode, max_k, max_rows
        # auto's batch bound (None: none). The cost model prices a row as measured in steps of the
        # same batch, and at large batches on CPU several sequences' verified rows in one step
        # cost more than it prices (benchmarks/bench_speculative.py); so on CPU, batches of <= 4 only
        self.max_batch = max_batch
        self.proposer = proposer  # a factory: one Proposer per request
        self.shared = SharedAcceptance()
        self.cost = StepCost(row_cost)  # row_cost: its prior, until the engine's steps measured it

    @property
    def row_cost(self) -> float:
        return self.cost.row_cost

    @classmethod
    def from_config(cls, config) -> "Speculator | None":
        """The engine's speculator (None when ``speculative="off"``)."""
        if config.speculative == "off" or config.num_speculative_tokens == 0:
            return None
        from chatkv.kernels import cpu_decode

        on_cpu = str(config.device).startswith("cpu")
        max_rows = config.quant_dense_rows - 1 if config.quant_dense_rows > 1 else 32
        prior = (0.05 if cpu_decode.amx() else 0.2) if on_cpu else 0.02  # AMX tiles: a row ~0.05 (bench_verify_rows)
        return cls(
            config.speculative,
            config.num_speculative_tokens,
            prior,
            max_rows,
            max_batch=CPU_MAX_BATCH if on_cpu else None,
        )

    def state(self, seq: Any) -> SpecState:
        if seq.spec is None:
            seq.spec = SpecState(self.proposer(), self.shared, self.cost)
        return seq.spec

    def assign(self, decodes: list[Any], rows: int, budget: int) -> dict[Any, list[int]]:
        """Proposals for some of ``decodes`` (sequences decoding one token this step, in a step
        of ``rows`` rows with ``budget`` tokens left): ``{seq: proposed tokens}``. The caller
        reserves their KV and may shorten them; ``observe`` takes the outcome."""
        room = min(budget, self.max_rows - rows)
        if room <= 0 or (self.mode == "auto" and self.max_batch is not None and len(decodes) > self.max_batch):
            return {}  # auto does not speculate in a step this big: no lookups (their index catches up later)
        offers = []
        for seq in decodes:
            k = min(eligible(seq), self.max_k)
            if k <= 0:
                continue
            st = self.state(seq)
            p = st.proposer.propose(seq.token_ids, k)
            if p is not None and seq.matcher is not None:  # only what the constraint accepts can be accepted
                p.tokens = p.tokens[: seq.matcher.validate(p.tokens)]
            if p is not None and p.tokens:
                offers.append((seq, st, p))
        if self.mode == "lookup":
            out = {}
            for seq, st, p in offers:
                take = min(len(p.tokens), room)
                if take <= 0:
                    break
                out[seq], st.key, room = p.tokens[:take], p.key, room - take
            return out
        return self._auto(offers, len(decodes), rows, room)

    def _auto(self, offers, tokens: int, rows: int, room: int) -> dict[Any, list[int]]:
        """Add proposals best first (expected tokens ``alpha ** j``) while each adds more tokens
        per unit of step time than the step yields on average; none in a step of more than
        ``max_batch`` decoding sequences (``assign`` does not look them up)."""
        r = self.row_cost
        gain, cost = float(tokens), 1.0 + r * max(rows - 1, 0)
        heap, alphas, taken = [], {}, {}
        for i, (seq, st, p) in enumerate(offers):
            a = st.alpha(p.key)
            alphas[i] = a
            heap.append((-a, i, 1))
        heapq.heapify(heap)
        while heap and room > 0:
            neg_e, i, j = heapq.heappop(heap)
            e = -neg_e
            if e * cost <= r * gain:  # the best one left does not pay: none after it does
                break
            taken[i] = j
            gain, cost, room = gain + e, cost + r, room - 1
            if j < len(offers[i][2].tokens):
                heapq.heappush(heap, (-(e * alphas[i]), i, j + 1))
        out = {}
        for i, (seq, st, p) in enumerate(offers):
            if i in taken:
                out[seq], st.key = p.tokens[: taken[i]], p.key
            else:
                st.idle(p.key)
        return out

    @staticmethod
    def observe(seq: Any, proposed: int, accepted: int) -> None:
        seq.spec.observe(seq.spec.key, proposed, accepted)
