"""Quality gate of the quantised KV dtypes on the default model: the CI-sized run of
benchmarks/kv_quality.py (its functions, its goals), int8 and fp8 against bf16 KV.

The full gate (20 chat prompts x 256 tokens, perplexity over 4,096 tokens, 5 needles in
~4k-token prompts) takes minutes on 2 cores, and its figures are in docs/reference/kv-dtypes.md; here the
same measurements run smaller (``CI`` below):

- teacher-forced top-1 agreement with bf16 KV's greedy tokens (int8 >= 98%), through the
  same batched decode steps as the free run, so bf16 against itself is exactly 100%;
- perplexity over the first tokens of Python's pydoc topics (int8 within 1% of bf16, fp8
  within 3%), prefilled in chunks of 512 so later tokens read earlier tokens' stored KV;
- needles (a passphrase early in a long prompt, asked for at the end): every needle bf16
  retrieves, int8 and fp8 retrieve too (and bf16 retrieves at least one, or the test proves
  nothing).

At this size (4 prompts x 48 tokens, perplexity over 1,024 tokens, 1 needle in ~1.5k tokens)
fp8 must pass its goals, and int8 its perplexity and needle goals with agreement >= 97%, a
regression floor: int8 misses the 98% agreement goal, here (97.92%) as in the full gate: its
agreement over 256 tokens was 97.58% (< 98%; docs/reference/kv-dtypes.md, "KV cache dtypes: int8
and fp8"). Runtime: 68 s on the 2-core machine with another CPU-bound process running.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from chatkv.config import EngineConfig
from chatkv.engine.core import Engine

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import kv_quality  # noqa: E402

CI = dict(prompts=4, tokens=48, ppl_tokens=1024, needles=1, needle_tokens=1536)


@pytest.fixture(scope="module")
def gate(tmp_path_factory, default_model_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model_dir = default_model_dir  # converted once for the run (conftest)
        engine = Engine(
            model_dir, EngineConfig(data_dir=str(tmp_path_factory.mktemp("data")), num_blocks=8, host_cache_bytes=0)
        )
        with torch.inference_mode():
            return kv_quality.run_gate(
                engine.model, engine.tokenizer, ["bf16", "int8", "fp8"], **CI, log=lambda *a: None
            )
    finally:
        torch.set_num_threads(before)


def test_bf16_is_its_own_reference_and_finds_a_needle(gate):
    base = gate["bf16"]
    assert base.agree == (CI["prompts"] * CI["tokens"],) * 2
    assert base.free_run == CI["tokens"]
    assert any(base.needles), base.replies


def test_fp8_meets_its_goals(gate):
    assert kv_quality.verdicts(gate)["fp8"] == [], (gate["fp8"], gate["bf16"].ppl)


def test_int8_meets_its_perplexity_and_needle_goals_and_stays_near_its_agreement_goal(gate):
    """int8 misses its 98% agreement goal (the full gate: 97.58%; docs/reference/kv-dtypes.md); here its
    perplexity and needle goals hold, and agreement may not fall below 97% (a regression floor,
    not the goal: this size measured 97.92%, 188 of 192)."""
    misses = [m for m in kv_quality.verdicts(gate)["int8"] if not m.startswith("agreement")]
    assert misses == [], (gate["int8"], gate["bf16"].ppl)
    assert gate["int8"].agreement >= 0.97, gate["int8"]


def test_quantised_kv_is_not_bf16(gate):
    """The runs really stored quantised KV: perplexity moves (by little)."""
    for kv in ("int8", "fp8"):
        assert gate[kv].ppl != gate["bf16"].ppl, kv
