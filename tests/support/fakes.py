"""Stand-ins for the model side, for tests that drive the KV manager or the scheduler
directly: a tokenizer with one lowercase letter per id, and a request (``Sequence``) made
from token ids."""

from __future__ import annotations

from chatkv.engine.detokenize import TextStream
from chatkv.engine.sampling import SamplingParams
from chatkv.engine.sequence import Sequence
from chatkv.kvcache.types import RetainedKV


class FakeTokenizer:
    """One lowercase letter per id."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def make_seq(
    tokens,
    prefix: RetainedKV | None = None,
    retain: bool = False,
    seq_id: int = 0,
    *,
    params: SamplingParams | None = None,
    stop: list[str] | None = None,
    stop_ids=(),
    max_total: int = 10**6,
) -> Sequence:
    """A waiting request for ``tokens`` (the prompt): ``params`` (default SamplingParams()),
    its text streamed through a FakeTokenizer with the stop strings ``stop``."""
    return Sequence(
        seq_id=seq_id,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=params if params is not None else SamplingParams(),
        generator=None,
        stop_ids=frozenset(stop_ids),
        max_total_tokens=max_total,
        out=TextStream(FakeTokenizer(), stop),
        retain=retain,
        prefix=prefix,
    )
