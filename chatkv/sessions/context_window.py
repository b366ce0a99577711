"""Conversations longer than the context: what a session's KV window keeps, and how it moves.

A session's KV covers its *context tokens* (the conversation's stored ``token_ids``).
While the whole history fits the window they are the whole history; beyond it the
session's overflow policy decides, before any work is done:

- ``error``: the turn is refused with :class:`ContextOverflow`, naming the sizes.
- ``truncate``: the oldest whole turns are dropped. Everything before the first user
  turn (the system prompt and pinned documents) is kept. The shortened context is
  recomputed once (its system prefix still hits the shared cache); its KV is then
  exactly what a fresh conversation with those turns computes, so it stays shareable.
- ``sink`` (StreamingLLM, Xiao et al. 2023): keep the first ``sink`` tokens (at least
  ``sink_tokens``, always the whole system prefix, rounded up to a block) and the most
  recent ones. The dropped tokens' blocks are freed and the kept recent keys are
  re-rotated in place to their new positions (RoPE rotations compose), so positions stay
  inside the model's range forever. Such a window's KV differs from any from-scratch
  computation, so it lives in a radix namespace of its own (conversation + epoch) and is
  never shared with another conversation.

The stored messages are never deleted: only the KV window moves. The state below is
stored with ``token_ids`` in one transaction (``conversations.context``).

Sizes: a turn keeps room for its reply, ``min(max_tokens, window // 4)`` tokens (a reply
that runs longer is cut at the window, finish_reason "length"). A sink window moves by
at least ``window // 8`` tokens at a time, and truncation drops turns until that much is
free too where it can, so the window moves (the snapshot gets a new epoch, truncation
recomputes) once every several turns rather than every turn. Drops are whole blocks, so the
kept blocks are reused as they are and only their keys are rotated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from chatkv.config import OVERFLOW_POLICIES
from chatkv.errors import ContextOverflow, InvalidRequest  # noqa: F401 (ContextOverflow: its old import path)


def check_overflow(policy) -> str:
    if policy not in OVERFLOW_POLICIES:
        raise InvalidRequest(f"overflow must be one of {', '.join(OVERFLOW_POLICIES)}, got {policy!r}")
    return policy


@dataclass
class ContextState:
    """What a conversation's KV window holds (JSON in ``conversations.context``)."""

    policy: str
    turns: list[int] = field(default_factory=list)  # where each kept user turn starts in the context tokens
    prefix: int | None = None  # end of the fixed prefix (system prompt, documents); None: unknown (older data)
    sink: int = 0  # sink mode: leading tokens that never move (set at the first move)
    dropped_tokens: int = 0  # tokens dropped from the window so far
    dropped_turns: int = 0  # turns whose start was dropped so far
    epoch: int = 0  # bumped at every sink move: the KV's private radix namespace
    private: bool = False  # keys re-rotated (sink): this KV is never shared

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data, default_policy: str) -> "ContextState":
        """The stored state; anything missing or malformed (older data, a hand edit) gives
        a fresh state with unknown turn boundaries rather than an error."""
        if not isinstance(data, dict):
            return cls(policy=default_policy)
        try:
            st = cls(
                policy=data.get("policy", default_policy),
                turns=[int(t) for t in data.get("turns", [])],
                prefix=None if data.get("prefix") is None else int(data["prefix"]),
                sink=int(data.get("sink", 0)),
                dropped_tokens=int(data.get("dropped_tokens", 0)),
                dropped_turns=int(data.get("dropped_turns", 0)),
                epoch=int(data.get("epoch", 0)),
                private=bool(data.get("private", False)),
            )
        except (TypeError, ValueError):
            return cls(policy=default_policy)
        if st.policy not in OVERFLOW_POLICIES:
            st.policy = default_policy
        return st


@dataclass
class ContextInfo:
    """What a turn's KV window kept and dropped (``Reply.context``)."""

    policy: str
    window: int  # tokens the window may hold
    context_tokens: int  # tokens the model saw for this turn's prompt
    dropped_tokens: int = 0  # dropped before this turn
    dropped_turns: int = 0
    total_dropped_tokens: int = 0  # over the whole conversation
    total_dropped_turns: int = 0
    sink_tokens: int = 0  # sink mode: the leading tokens kept
    recomputed: bool = False  # truncate: the shortened context was computed again

    def summary(self) -> str:
        if not self.total_dropped_tokens:
            return f"context {self.context_tokens}/{self.window} tokens"
        now = f"dropped {self.dropped_tokens} tokens ({self.dropped_turns} turns) now, " if self.dropped_tokens else ""
        kept = f"{self.sink_tokens} sink + recent" if self.policy == "sink" else "system prompt + recent turns"
        return (
            f"context {self.context_tokens}/{self.window} tokens ({self.policy}: {now}"
            f"{self.total_dropped_tokens} dropped in all; keeping {kept})"
        )


@dataclass
class Plan:
    kind: str  # "none" | "truncate" | "sink"
    drop: int = 0  # tokens dropped
    turns: int = 0  # turns dropped
    sink: int = 0  # sink: leading tokens kept
    cut: int = 0  # truncate: context[prefix:cut] is dropped


def reply_room(max_tokens: int, window: int) -> int:
    return max(1, min(max_tokens, window // 4))


def plan(
    st: ContextState, context_len: int, new_len: int, reserve: int, window: int, block_size: int, sink_tokens: int
) -> Plan:
    """How to fit a turn of ``new_len`` tokens after ``context_len`` context tokens into
    ``window``, leaving ``reserve`` tokens for the reply where history can be dropped for
    it (``error`` needs room for one token only). Raises ContextOverflow."""
    total = context_len + new_len
    if st.policy == "error" or not context_len:
        if total < window:
            return Plan("none")
        if st.policy == "error" and context_len:
            raise ContextOverflow(
                f"the conversation holds {context_len} tokens and the message {new_len}: {total} tokens, and the "
                f"context window holds {window} with room for the reply (overflow='error'). Start a new "
                f"conversation, or use overflow='truncate' or 'sink'"
            )
        raise ContextOverflow(f"the message takes {total} tokens; the context window holds {window}. Shorten it")
    if total + reserve <= window:
        return Plan("none")
    if st.policy == "truncate" and st.prefix is not None and st.turns:
        prefix = st.prefix
        cuts = sorted(t for t in st.turns if t > prefix) + [context_len]
        for room in (reserve + window // 8, reserve):  # room to spare first: the next turns need no recompute
            for n, cut in enumerate(cuts, start=1):
                if prefix + context_len - cut + new_len + room <= window:
                    return Plan("truncate", drop=cut - prefix, turns=n, cut=cut)
        if prefix + new_len < window:  # only a shorter reply fits: drop every earlier turn
            return Plan("truncate", drop=context_len - prefix, turns=len(cuts), cut=context_len)
        raise ContextOverflow(
            f"the message takes {new_len} tokens; after the system prompt ({prefix} tokens) the context window "
            f"of {window} has no room for it. Shorten the message"
        )
    # sink (also truncate without known turn boundaries: conversations from before they were recorded)
    bs = block_size
    sink = st.sink or -(-max(sink_tokens, st.prefix or 0) // bs) * bs
    avail = max(0, (context_len - sink) // bs * bs)
    drop = min(-(-max(total + reserve - window, window // 8) // bs) * bs, avail)
    if total - drop >= window:
        raise ContextOverflow(
            f"the message takes {new_len} tokens; with the {sink} sink tokens kept (system prompt included) "
            f"the context window of {window} has no room for it. Shorten the message or the system prompt"
        )
    return Plan("sink", drop=drop, sink=sink) if drop else Plan("none")


def apply(st: ContextState, p: Plan, context: list[int]) -> list[int]:
    """Update ``st`` for plan ``p`` and return the new context tokens."""
    if p.kind == "truncate":
        prefix = st.prefix or 0
        shift = p.cut - prefix
        st.turns = [t for t in st.turns if t < prefix] + [t - shift for t in st.turns if t >= p.cut]
        st.dropped_tokens += p.drop
        st.dropped_turns += p.turns
        st.private, st.sink = False, 0  # recomputed from scratch: shareable again
        return context[:prefix] + context[p.cut :]
    if p.kind == "sink":
        s, d = p.sink, p.drop
        gone = [t for t in st.turns if s <= t < s + d]
        st.turns = [t for t in st.turns if t < s] + [t - d for t in st.turns if t >= s + d]
        st.sink = s
        st.dropped_tokens += d
        st.dropped_turns += len(gone)
        st.epoch += 1
        st.private = True
        return context[:s] + context[s + d :]
    return context
