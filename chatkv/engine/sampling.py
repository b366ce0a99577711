"""Sampling parameters and the sampler (greedy, temperature, top-k, top-p, repetition, presence and
frequency penalties, logit bias, seed), and the log probabilities of the tokens sampled.

(A few lines past 400 on purpose: the parameters, their validation and the sampler that reads
them are one contract, read together.)
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, Protocol, Sequence

import torch

from chatkv.errors import InvalidRequest
from chatkv.outputs import TokenLogprob

SEED_LIMIT = 2**63  # seeds are stored with the conversation (SQLite integers are signed 64-bit)
MAX_LOGPROBS = 20  # the most likely alternatives reported per token at most (OpenAI's top_logprobs bound)
MAX_LOGIT_BIAS = 1024  # logit_bias entries at most
LOGIT_BIAS_RANGE = 100.0  # each bias in [-100, 100] (OpenAI's)
PENALTY_RANGE = 2.0  # presence_penalty and frequency_penalty in [-2, 2] (OpenAI's)
_F32_MAX = torch.finfo(torch.float32).max


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_finite(x: Any) -> bool:
    """A finite real that converts to a float (an int past float's range does not)."""
    try:
        return _is_real(x) and math.isfinite(x)
    except OverflowError:
        return False


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature == 0`` means greedy.

    ``validate()`` accepts exactly these values and raises ``InvalidRequest``, naming the
    field and the value, for anything else (bool is never taken for a number):

    - ``max_tokens``: an int >= 1 (not a float, not a str, not a bool).
    - ``temperature``: a finite real >= 0 (an int is fine); 0 = greedy. Any finite value
      works, however large or small: the sampler never produces nan probabilities.
    - ``top_k``: an int >= 0; 0 = off.
    - ``top_p``: a finite real in (0, 1]; 1 = off.
    - ``repetition_penalty``: a finite real > 0; 1 = off (transformers' semantics).
    - ``presence_penalty``, ``frequency_penalty``: finite reals in [-2, 2]; 0 = off. As OpenAI
      documents them: ``logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty``,
      ``count[j]`` the times token ``j`` was generated so far in this reply (the prompt not counted).
    - ``logit_bias``: None or a mapping of token id (an int >= 0; the engine also checks it is in
      the vocabulary) to a finite real in [-100, 100], added to that token's logit; at most 1024
      entries. Applied first (vLLM's order: bias, then the repetition penalty, then presence and
      frequency, then temperature, top-k, top-p).
    - ``logprobs``: None (off) or an int in [0, 20]: each generated token's log probability is
      reported (``GenerationResult.logprobs``) with this many most likely alternatives. It is the
      float32 log-softmax of the raw logits, before bias, penalties, temperature and constraint.
    - ``seed``: None (a fresh random seed) or an int in [0, 2**63).
    - ``stop``: a list (or tuple) of non-empty str, each encodable as UTF-8 (no lone surrogates).
    - ``stop_token_ids``: a list (or tuple) of ints >= 0 (an id the vocabulary lacks never matches).
    - ``ignore_eos``: a bool.
    - at most one constraint (chatkv.engine.constraints; the output is valid when it ends by stop):
      ``json_schema`` (a JSON schema: a dict, or a str holding one), ``regex`` (a str; the
      whole output matches it), ``choice`` (a non-empty list of non-empty str; the output is
      one of them), ``grammar`` (a lark or GBNF grammar, a str) or ``json_object=True`` (any
      JSON object). A schema or grammar that cannot be enforced (invalid, or a keyword it
      cannot keep) is refused with the reason. A constraint ends the output itself, so it
      does not combine with ``ignore_eos``; ``stop`` strings still end it where they match
      (finish_reason "stop", the output cut there), and ``stop_token_ids`` are allowed only
      where the constraint may end.

    Build from untrusted key/value input with ``SamplingParams.from_dict``, which also names
    unknown keys instead of raising ``TypeError`` and reads ``logit_bias`` keys that are strings
    of digits (JSON's, as OpenAI sends them and a session's stored settings hold them) as ids.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0  # transformers' semantics: >1 discourages tokens already in the sequence
    seed: int | None = None
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the output text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    json_schema: dict | str | None = None  # constraints: at most one (chatkv.engine.constraints)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token generated so far
    frequency_penalty: float = 0.0  # OpenAI's: subtracted once per time a token was generated so far
    logit_bias: Mapping[int, float] | None = None  # token id -> added to its logit
    logprobs: int | None = None  # report each token's logprob and this many alternatives (None: off)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SamplingParams":
        """Validated params from a mapping of field names; unknown keys raise ``InvalidRequest``."""
        if not isinstance(d, Mapping):
            raise InvalidRequest(f"sampling params must be a mapping of field names, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(repr(k) for k in d if k not in known)
        if unknown:
            raise InvalidRequest(
                f"unknown sampling parameter{'s' if len(unknown) > 1 else ''}: {', '.join(unknown)} "
                f"(known: {', '.join(sorted(known))})"
            )
        bias = d.get("logit_bias")
        if isinstance(bias, Mapping) and len(bias) <= MAX_LOGIT_BIAS:  # JSON keys: token ids as strings
            d = {**d, "logit_bias": {_token_key(k): v for k, v in bias.items()}}
        params = cls(**d)
        params.validate()
        return params

    def validate(self) -> None:
        def bad(name: str, rule: str) -> InvalidRequest:
            value = getattr(self, name)
            shown = repr(value)
            if len(shown) > 80:
                shown = shown[:77] + "..."
            return InvalidRequest(f"{name} must be {rule}, got {shown} ({type(value).__name__})")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "an int >= 1")
        if not _is_finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", "an int >= 0 (0 = off)")
        if not _is_finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1]")
        rp = self.repetition_penalty
        if not _is_finite(rp) or rp <= 0:
            raise bad("repetition_penalty", "a finite number > 0 (1 = off)")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_LIMIT):
            raise bad("seed", "None or an int in [0, 2**63)")
        if not isinstance(self.stop, (list, tuple)):
            raise bad("stop", "a list of non-empty strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise bad("stop", "a list of non-empty strings")
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise bad("stop", "a list of valid Unicode strings (no lone surrogates)") from None
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "a list of ints >= 0")
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a bool")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_finite(v) or not -PENALTY_RANGE <= v <= PENALTY_RANGE:
                raise bad(name, "a number in [-2, 2] (0 = off)")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"None or an int in [0, {MAX_LOGPROBS}] (the alternatives reported per token)")
        self._validate_logit_bias()
        self._validate_constraint(bad)

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, Mapping):
            raise InvalidRequest(f"logit_bias must be a mapping of token id to bias, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias may hold at most {MAX_LOGIT_BIAS} entries, got {len(bias)}")
        for k, v in bias.items():
            if not _is_int(k) or k < 0:
                raise InvalidRequest(f"logit_bias keys must be token ids (ints >= 0), got {_short(k)}")
            if not _is_finite(v) or not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE:
                raise InvalidRequest(f"logit_bias[{k}] must be a number in [-100, 100], got {_short(v)}")

    def check_vocab(self, vocab: int) -> None:
        """``InvalidRequest`` when a ``logit_bias`` token id is outside the vocabulary ``[0, vocab)``."""
        bad = sorted(k for k in self.logit_bias or () if k >= vocab)
        if bad:
            raise InvalidRequest(f"logit_bias token id(s) {bad[:5]} outside the vocabulary [0, {vocab})")

    @property
    def adjusts_logits(self) -> bool:
        """True when anything but temperature, top-k and top-p changes the logits before a pick."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0
            or self.frequency_penalty != 0
            or bool(self.logit_bias)
        )

    @property
    def constrained(self) -> bool:
        """True when a constraint limits the output (json_schema, regex, choice, grammar, json_object)."""
        return (
            self.json_schema is not None
            or self.regex is not None
            or self.choice is not None
            or self.grammar is not None
            or self.json_object is True
        )

    def _validate_constraint(self, bad) -> None:
        if not isinstance(self.json_object, bool):
            raise bad("json_object", "a bool")
        given = [n for n in ("json_schema", "regex", "choice", "grammar") if getattr(self, n) is not None]
        if self.json_object:
            given.append("json_object")
        if not given:
            return
        if len(given) > 1:
            raise InvalidRequest(f"at most one constraint per request; got {' and '.join(given)}")
        if self.ignore_eos:
            raise InvalidRequest(f"ignore_eos cannot be combined with {given[0]}: the constraint ends the output")
        if self.json_schema is not None:
            schema = self.json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as err:
                    raise InvalidRequest(f"json_schema is a str that is not JSON: {err}") from None
            if not isinstance(schema, dict):
                raise bad("json_schema", "a JSON schema object (a dict, or a str holding one)")
            try:
                json.dumps(schema)
            except (TypeError, ValueError) as err:
                raise InvalidRequest(f"json_schema is not JSON-serialisable: {err}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise bad(name, "a non-empty str")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise bad("choice", "a non-empty list of non-empty strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise bad("choice", "a non-empty list of non-empty strings")
        from chatkv.engine.constraints import check, constraint_of

        check(constraint_of(self))


def _token_key(k: Any) -> Any:
    """A ``logit_bias`` key as JSON gives it ("42") as the token id it names; anything else as it is."""
    return int(k) if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 10 else k


def _short(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def _penalize(logits: torch.Tensor, history: list[int], penalty: float) -> torch.Tensor:
    """transformers' ``RepetitionPenaltyLogitsProcessor``: a seen token's logit is divided by
    ``penalty`` when positive, multiplied when negative, in the logits' dtype. An extreme (finite)
    penalty can overflow that dtype, or give 0 * inf; such results are kept finite at their limit."""
    penalty = float(penalty)  # a valid int penalty may be past what torch takes as an integer scalar
    idx = torch.tensor(sorted(set(history)), dtype=torch.long)
    picked = logits[idx]
    new = torch.where(picked < 0, picked * penalty, picked / penalty)
    finite = torch.isfinite(picked)
    new = torch.where(picked == 0, picked, new)
    hi = torch.finfo(logits.dtype).max
    new = torch.where(finite, new.clamp(-hi, hi), new)
    out = logits.clone()
    out[idx] = new
    return out


def adjust(logits: torch.Tensor, params: SamplingParams, history: list[int], num_prompt: int = 0) -> torch.Tensor:
    """The logits a pick is made from: ``logit_bias`` added, then the repetition penalty (over all of
    ``history``), then the presence and frequency penalties over the tokens generated so far
    (``history[num_prompt:]``), as vLLM orders them. ``logits`` itself is never changed; with none of
    them set it is returned as it is."""
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        bias = torch.tensor([float(v) for v in params.logit_bias.values()], dtype=logits.dtype)
        logits = logits.index_add(0, ids, bias)
    if params.repetition_penalty != 1.0 and history:
        logits = _penalize(logits, history, params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and len(history) > num_prompt:
        generated = torch.tensor(history[num_prompt:], dtype=torch.long)
        ids, counts = torch.unique(generated, return_counts=True)
        cut = counts.to(logits.dtype) * float(params.frequency_penalty) + float(params.presence_penalty)
        logits = logits.index_add(0, ids, -cut)
    return logits


def probabilities(
    logits: torch.Tensor, params: SamplingParams, history: list[int], num_prompt: int = 0
) -> torch.Tensor:
    """The distribution ``sample`` draws from when ``temperature > 0`` (float64 ``[vocab]``).

    ``adjust``'s logit bias and penalties (``num_prompt``: how many leading tokens of ``history``
    are the prompt), then temperature, top-k, top-p. Computed as
    ``softmax((x - max x) / T)`` in float64, so any finite temperature gives finite
    probabilities: a huge one tends to uniform over the tokens top-k/top-p keep, a tiny one to
    the argmax. Logits the model made nan never get picked; if some are +inf, the draw is
    uniform over those; if every token is -inf, uniform over the vocabulary.
    """
    logits = adjust(logits, params, history, num_prompt)
    x = logits.double()
    neg_inf = float("-inf")
    x = torch.where(torch.isnan(x), neg_inf, x)
    if bool(torch.isposinf(x).any()):
        x = torch.zeros_like(x).masked_fill(
            ~torch.isposinf(x), neg_inf
        )  # float64 still: where() of two scalars is float32, and T=1e300 overflowed it to nan
    top = x.max()
    if top == neg_inf:
        x = torch.zeros_like(x)
        top = x.max()
    if 0 < params.top_k < x.shape[-1]:  # on the unscaled logits: the same set, even where x / T underflows
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, neg_inf)
    z = (x - top) / float(params.temperature)  # every value in [-inf, 0], the best exactly 0: no overflow, no nan
    if params.top_p < 1.0:
        z = _nucleus(x, z, params.top_p)
    return torch.softmax(z, dim=-1)


NUCLEUS_CANDIDATES = 1024  # top-p looks at this many best tokens first; the whole vocabulary only if they fall short


def _nucleus(x: torch.Tensor, z: torch.Tensor, top_p: float) -> torch.Tensor:
    """``z`` with every token outside the top-p nucleus at -inf: the most probable tokens, as few
    as possible, whose mass reaches ``top_p`` (the token whose mass crosses it is kept), ranked
    by the unscaled logits ``x`` (the same order as ``z``'s, even where ``x / T`` underflows).

    Sorting a 49,152-token vocabulary costs ~4 ms a token on one core, more than a decode step's
    share; the nucleus is almost always within the best few hundred tokens. So the best
    ``NUCLEUS_CANDIDATES`` are taken with ``topk`` first; when the mass before the last of them
    already reaches ``top_p``, every token past them is dropped too and the result is the full
    sort's. Otherwise (a flat distribution) the whole vocabulary is sorted."""
    neg_inf = float("-inf")
    p = torch.softmax(z, dim=-1)
    if x.shape[-1] > NUCLEUS_CANDIDATES:
        idx = torch.topk(x, NUCLEUS_CANDIDATES).indices
        top = p[idx]
        before = top.cumsum(-1) - top
        if float(before[-1]) >= top_p:
            return torch.full_like(z, neg_inf).scatter(0, idx, z[idx].masked_fill(before >= top_p, neg_inf))
    order = torch.sort(x, descending=True).indices
    sorted_p = p[order]
    drop = sorted_p.cumsum(-1) - sorted_p >= top_p  # keep the token whose mass crosses top_p
    return z.scatter(0, order, z[order].masked_fill(drop, neg_inf))


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    history: list[int],
    generator: torch.Generator | None,
    num_prompt: int = 0,
) -> int:
    """Pick the next token from float32 ``logits [vocab]`` of one sequence (``history``: its
    tokens so far, the first ``num_prompt`` of them its prompt).

    ``temperature == 0``: the argmax after ``adjust``'s bias and penalties (with the repetition
    penalty alone, what transformers' greedy search picks). Otherwise one draw, with
    ``generator``, from ``probabilities(...)``.
    """
    if params.temperature == 0:
        if params.adjusts_logits:
            logits = adjust(logits, params, history, num_prompt)
        return int(torch.argmax(logits))
    probs = probabilities(logits, params, history, num_prompt)
    return int(torch.multinomial(probs, 1, generator=generator))


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """``TokenLogprob`` of ``tokens[i]`` picked from row ``i`` of ``logits [rows, vocab]`` (the raw
    model logits, before ``adjust`` and any constraint's mask): the float32 log-softmax, with the
    ``top`` most likely tokens of the row, best first."""
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    picked = lp[torch.arange(len(tokens)), torch.tensor(list(tokens), dtype=torch.long)].tolist()
    if top > 0:
        values, ids = torch.topk(lp, min(top, lp.shape[-1]), dim=-1)
        alts = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        alts = [[] for _ in tokens]
    return [TokenLogprob(int(t), p, a) for t, p, a in zip(tokens, picked, alts)]


class RowMask(Protocol):
    """What masks one row of logits: chatkv.engine.constraints.Matcher."""

    def mask_into(self, logits: torch.Tensor) -> None: ...


def mask_rows(logits: torch.Tensor, masks: Sequence[RowMask | None]) -> list[Exception | None]:
    """Mask, in place, each row ``i`` of the batch's ``logits [rows, vocab]`` whose ``masks[i]``
    is not None (a constrained request's matcher) before its token is sampled; the others are
    not touched, and a batch with no constrained row costs one pass over ``masks``.

    Returns, per row, the error its matcher raised (that request's alone) or None."""
    errors: list[Exception | None] = [None] * len(masks)
    for row, m in enumerate(masks):
        if m is None:
            continue
        try:
            m.mask_into(logits[row])
        except (RuntimeError, ValueError) as err:
            errors[row] = err
    return errors
