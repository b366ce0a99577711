"""chatkv's paged forward against transformers' own forward on the same weights (fp32, max abs err <= 1e-4)."""

from __future__ import annotations

import random

import pytest
import torch

from chatkv.config import EngineConfig
from chatkv.engine.model_runner import BatchItem, ModelRunner
from chatkv.model.forward import LlamaModel
from tests.support.tiny import VOCAB, make_model

TOL = 1e-4
MODEL_TYPES = ["llama", "qwen2", "qwen3", "mistral"]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def pair(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    ref = make_model(d, request.param, seed=MODEL_TYPES.index(request.param))
    return ref, LlamaModel.from_pretrained(d, dtype=torch.float32)


class Runner:
    """Drives chatkv's ModelRunner with hand-made block tables taken from a shuffled pool."""

    def __init__(self, model: LlamaModel, block_size: int, num_blocks: int = 256, seed: int = 0):
        self.runner = ModelRunner(model, EngineConfig(block_size=block_size, num_blocks=num_blocks))
        self.pool = self.runner.pool
        # take blocks out of order so block tables are never contiguous by accident
        random.Random(seed).shuffle(self.pool._free)
        self.tables: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}

    def step(self, work: list[tuple[str, list[int]]]) -> list[torch.Tensor]:
        """Compute each (sequence, new tokens) in ONE forward; return each one's logits for all its new tokens."""
        items = []
        bs = self.pool.block_size
        for name, toks in work:
            start = self.done.get(name, 0)
            table = self.tables.setdefault(name, [])
            need = -(-(start + len(toks)) // bs) - len(table)
            table.extend(self.pool.allocate(max(need, 0)))
            items.append(BatchItem(toks, start, table, logits="all"))
            self.done[name] = start + len(toks)
        logits = self.runner.forward(self.runner.build_batch(items))
        return list(torch.split(logits, [len(t) for _, t in work]))


def ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_fresh_prefill(pair, block_size):
    ref, model = pair
    ids = tokens(37, 1)  # 37 is not a multiple of 16 or 5
    (out,) = Runner(model, block_size).step([("a", ids)])
    assert (out - ref_logits(ref, ids)).abs().max().item() <= TOL


@pytest.mark.parametrize("block_size,prefix", [(16, 21), (16, 32), (5, 13), (1, 9)])
def test_prefill_over_cached_prefix(pair, block_size, prefix):
    """The prefix is computed first; the rest attends to it through the block table (hit mid-block or on a boundary)."""
    ref, model = pair
    ids = tokens(50, 2)
    r = Runner(model, block_size)
    r.step([("a", ids[:prefix])])
    (out,) = r.step([("a", ids[prefix:])])
    assert (out - ref_logits(ref, ids)[prefix:]).abs().max().item() <= TOL


@pytest.mark.parametrize("block_size", [16, 5])
def test_32_decode_steps(pair, block_size):
    ref, model = pair
    ids = tokens(19 + 32, 3)
    expected = ref_logits(ref, ids)
    r = Runner(model, block_size)
    r.step([("a", ids[:19])])
    for i in range(19, 19 + 32):
        (out,) = r.step([("a", [ids[i]])])
        assert (out[0] - expected[i]).abs().max().item() <= TOL, f"decode step {i - 19}"


@pytest.mark.parametrize("block_size", [1, 16, 5])
def test_mixed_batch_of_five(pair, block_size):
    """One step holding two decodes, a prefill chunk over a cached prefix and two fresh prefills."""
    ref, model = pair
    seqs = {n: tokens(L, 10 + i) for i, (n, L) in enumerate([("a", 24), ("b", 41), ("c", 13), ("d", 7), ("e", 30)])}
    r = Runner(model, block_size)
    r.step([("a", seqs["a"][:23]), ("b", seqs["b"][:30]), ("d", seqs["d"][:6])])
    outs = r.step(
        [
            ("a", seqs["a"][23:]),  # decode
            ("b", seqs["b"][30:]),  # chunk of 11 over a 30-token prefix
            ("c", seqs["c"]),  # fresh
            ("d", seqs["d"][6:]),  # decode
            ("e", seqs["e"]),  # fresh
        ]
    )
    starts = {"a": 23, "b": 30, "c": 0, "d": 6, "e": 0}
    for (name, start), out in zip(starts.items(), outs):
        err = (out - ref_logits(ref, seqs[name])[start:]).abs().max().item()
        assert err <= TOL, f"sequence {name}: max abs err {err}"
    r.pool.check_integrity()


def test_sliding_window_matches_transformers(tmp_path):
    """Mistral with a window shorter than the prompt: prefill and decodes honour it."""
    ref = make_model(tmp_path, "mistral", seed=7, sliding_window=8)
    ref.config._attn_implementation = "eager"
    model = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    ids = tokens(30, 4)
    expected = ref_logits(ref, ids)
    r = Runner(model, 5)
    (out,) = r.step([("a", ids[:20])])
    assert (out - expected[:20]).abs().max().item() <= TOL
    for i in range(20, 30):
        (out,) = r.step([("a", [ids[i]])])
        assert (out[0] - expected[i]).abs().max().item() <= TOL


@pytest.mark.parametrize("block_size", [5, 16])
def test_sliding_window_batched_decodes_of_unequal_lengths(tmp_path, block_size):
    """Decodes of different lengths in one step, some past the window: per-row key ranges and padding."""
    ref = make_model(tmp_path, "mistral", seed=8, sliding_window=8)
    ref.config._attn_implementation = "eager"
    model = LlamaModel.from_pretrained(tmp_path, dtype=torch.float32)
    seqs = {n: tokens(L, 20 + i) for i, (n, L) in enumerate([("a", 26), ("b", 6), ("c", 13)])}
    expected = {n: ref_logits(ref, ids) for n, ids in seqs.items()}
    r = Runner(model, block_size)
    r.step([(n, ids[:-4]) for n, ids in seqs.items()])
    for back in range(4, 0, -1):
        outs = r.step([(n, [ids[-back]]) for n, ids in seqs.items()])
        for (n, ids), out in zip(seqs.items(), outs):
            err = (out[0] - expected[n][len(ids) - back]).abs().max().item()
            assert err <= TOL, f"sequence {n}, {back} from the end: max abs err {err}"
