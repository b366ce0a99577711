"""The same reply whatever the load: 32 prompts on the default model, greedy and seeded-sampled,
token for token the same alone as batched 8 or 32 at once, with the prefill cut into odd chunks,
on 1 or 2 threads, beside a busy core, with speculation on, and preempted for want of KV blocks.

The deterministic engine (``deterministic=True``, the default) computes every token's numbers from
its own inputs only (chatkv.kernels.cpu_invariant, chatkv.model.fused_decode): these tests are
its contract. Each condition's replies are compared with the prompts run one at a time.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from chatkv.engine.core import Engine
from chatkv.engine.sampling import SamplingParams
from chatkv.engine.speculative import Speculator

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain what a hash table is.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "How do I reverse a list in Python?",
    "Give me a recipe for pancakes.",
    "What is 17 times 23?",
    "Why is the sky blue?",
    "Name a mammal that can fly.",
    "Translate 'good morning' into Spanish.",
    "What does HTTP stand for?",
    "Summarise the plot of Cinderella in one sentence.",
    "What is the boiling point of water in Fahrenheit?",
    "Suggest a name for a pet goldfish.",
    "How many legs does a spider have?",
    "What is photosynthesis?",
    "Write a SQL query that counts rows in a table called users.",
    "What is the largest planet in the solar system?",
    "Tell me a fun fact about octopuses.",
    "How do you make a cup of tea?",
    "What is the square root of 144?",
    "Describe the colour blue to someone who cannot see.",
    "What year did the first person walk on the Moon?",
    "Give two synonyms for happy.",
    "What is a prime number?",
    "Explain recursion in one paragraph.",
    "Which ocean is the largest?",
    "Write a limerick about a cat.",
    "What is the chemical symbol for gold?",
    "How does a rainbow form?",
    "Recommend a book for a long train journey.",
]
TOKENS = 20
DET = True  # the engine option under test (False shows what these tests catch without it)


def _params(i: int) -> SamplingParams:
    """Greedy for most prompts; every fourth samples at temperature 0.8 with its own seed."""
    if i % 4 == 3:
        return SamplingParams(max_tokens=TOKENS, temperature=0.8, top_p=0.95, seed=1000 + i)
    return SamplingParams(max_tokens=TOKENS, temperature=0.0)


@pytest.fixture(scope="module")
def engine(default_model_dir, tmp_path_factory):
    home = str(tmp_path_factory.mktemp("det"))
    eng = Engine.from_pretrained(str(default_model_dir), data_dir=home, speculative="off", deterministic=DET)
    assert eng.model.invariant == DET
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompts(engine):
    """The questions as the chat template renders them, as token ids (what a chat request computes)."""
    return [engine.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(engine, prompts):
    """Each prompt run by itself, on the engine's default threads."""
    return [engine.generate(p, _params(i)) for i, p in enumerate(prompts)]


@pytest.fixture(scope="module")
def alone(reference):
    return [r.token_ids for r in reference]


def _batched(engine, prompts, size: int) -> list[list[int]]:
    out: list[list[int]] = []
    for a in range(0, len(prompts), size):
        results = engine.generate(prompts[a : a + size], [_params(i) for i in range(a, min(len(prompts), a + size))])
        out.extend(r.token_ids for r in results)
    return out


def _differ(got: list[list[int]], want: list[list[int]]) -> list[int]:
    return [i for i, (g, w) in enumerate(zip(got, want)) if g != w]


def test_replies_are_long_enough_to_tell(alone):
    """The reference replies run to their limit or a natural end: the comparisons have tokens to compare."""
    assert sum(len(r) for r in alone) > 0.7 * TOKENS * len(alone)


@pytest.mark.parametrize("size", [8, 32])
def test_batched_replies_equal_alone(engine, prompts, alone, size):
    assert _differ(_batched(engine, prompts, size), alone) == []


def test_prefill_cut_into_odd_chunks(engine, prompts, alone):
    """A step budget of 7 tokens cuts every prompt's prefill into chunks of 7 or fewer, shared with
    the others' decodes: the replies do not change."""
    budget = engine.scheduler.max_batch_tokens
    engine.scheduler.max_batch_tokens = 7
    try:
        assert _differ(_batched(engine, prompts, 8), alone) == []
    finally:
        engine.scheduler.max_batch_tokens = budget


@pytest.mark.parametrize("threads", [1, 2])
def test_thread_count(engine, prompts, alone, threads):
    """The step's thread count pinned to 1 or 2 (what the governor chooses between on 2 cores)."""
    gov = engine.threads
    saved = (gov.enabled, gov._pinned, gov.threads)
    gov.enabled, gov._pinned, gov.threads = False, True, threads
    try:
        assert _differ(_batched(engine, prompts, 8), alone) == []
    finally:
        gov.enabled, gov._pinned, gov.threads = saved
        torch.set_num_threads(saved[2])


def test_beside_a_busy_core(engine, prompts, alone):
    """Another process keeps a core busy (the governor drops to fewer threads while it runs)."""
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        got = _batched(engine, prompts, 8)
    finally:
        burner.kill()
        burner.wait()
    assert _differ(got, alone) == []


def test_speculation_on(engine, prompts, alone):
    """Prompt-lookup speculation proposes tokens and verifies them in one step: what it accepts is
    what plain decoding gives, sampled rows included."""
    saved = engine.scheduler.speculator
    engine.scheduler.speculator = Speculator.from_config(dataclasses.replace(engine.config, speculative="lookup"))
    try:
        got = _batched(engine, prompts, 8)
    finally:
        engine.scheduler.speculator = saved
    assert _differ(got, alone) == []


def test_preempted_for_want_of_blocks(default_model_dir, tmp_path, prompts, alone):
    """A pool too small for 32 requests at once: some are preempted, their KV recomputed as a
    prefill later, and every reply is still its lone run's."""
    eng = Engine.from_pretrained(str(default_model_dir), data_dir=str(tmp_path), speculative="off", num_blocks=40)
    try:
        results = eng.generate(prompts, [_params(i) for i in range(len(prompts))])
        assert sum(r.preemptions for r in results) > 0, "the pool was meant to be too small"
        assert _differ([r.token_ids for r in results], alone) == []
        eng.check_integrity()
    finally:
        eng.close()


def test_32_at_once_over_http(engine, prompts, reference):
    """32 clients at once against ``chatkv serve``'s completions route (the prompts as token ids,
    each with its own sampling options): every reply's text is its lone run's."""
    import openai

    from chatkv.server import create_app
    from tests.support.serving import Running

    server = Running(create_app(engine, model_name="default"))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)

        def ask(i: int) -> str:
            p = _params(i)
            extra = {} if p.seed is None else {"seed": p.seed}
            reply = client.completions.create(
                model="default",
                prompt=prompts[i],
                max_tokens=TOKENS,
                temperature=p.temperature,
                top_p=p.top_p,
                **extra,
            )
            return reply.choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            texts = list(pool.map(ask, range(len(prompts))))
    finally:
        server.stop()
    assert [i for i, (t, r) in enumerate(zip(texts, reference)) if t != r.text] == []
