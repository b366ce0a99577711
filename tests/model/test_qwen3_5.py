"""chatkv's Qwen3.5 forward (chatkv.model.qwen3_5) against transformers' Qwen3_5ForCausalLM on the same
weights (float32): a tiny seeded model with both layer kinds, driven over hand-made block tables and
StateSlots (not the Engine)."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from chatkv.kernels import build_metadata
from chatkv.model.qwen3_5 import Qwen3_5Model, StateSlots
from tests.support.qwen3_5 import redraw, tiny_config

TOL = 1e-4  # chatkv vs transformers
# chatkv vs chatkv, the same math in other groupings: the matmuls' float32 sums run in another order
# for another number of rows (measured up to 5e-6 here, on logits of magnitude < 5)
SAME = 2e-5
VOCAB = 256


def make_reference(out_dir, seed: int = 0):
    """A seeded Qwen3_5ForCausalLM saved to ``out_dir``: 6 layers, [linear, linear, full] twice, GQA in both
    kinds, partial rotary. Weights are redrawn at scales that give O(1) activations and every norm a
    weight away from its initial value (a ``1 + w`` mistaken for ``w`` would show)."""
    from transformers import Qwen3_5ForCausalLM

    config = tiny_config(VOCAB, eos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(config).eval()
    redraw(model, seed)
    assert config.layer_types == ["linear_attention", "linear_attention", "full_attention"] * 2
    model.save_pretrained(str(out_dir))
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_5")
    ref = make_reference(d)
    return ref, Qwen3_5Model.from_pretrained(d, dtype=torch.float32)


class Driver:
    """chatkv's forward over a KV pool with shuffled block tables and a StateSlots, one slot per sequence."""

    def __init__(self, model: Qwen3_5Model, block_size: int = 5, num_blocks: int = 128, slots: int = 8, seed: int = 0):
        self.model, self.block_size = model, block_size
        self.kv = torch.zeros(
            model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim, dtype=model.dtype
        )
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # tables are never contiguous by accident
        self.states = StateSlots.for_model(model, slots)
        self.free_slots = list(range(slots))
        self.tables: dict[str, list[int]] = {}
        self.done: dict[str, int] = {}
        self.slot: dict[str, int] = {}

    def start(self, name: str, table: list[int] | None = None, done: int = 0, slot: int | None = None) -> None:
        """A sequence, fresh or (``table``, ``done``, ``slot``) resuming over KV and a state already computed."""
        self.tables[name] = list(table or [])
        self.done[name] = done
        if slot is None:
            slot = self.free_slots.pop(0)
            self.states.reset(slot)
        elif slot in self.free_slots:
            self.free_slots.remove(slot)
        self.slot[name] = slot

    def take_slot(self) -> int:
        return self.free_slots.pop(0)

    def step(self, work: list[tuple[str, list[int]]], checkpoints=None, runs: bool = False) -> list[torch.Tensor]:
        """Compute each (sequence, new tokens) in ONE forward; each one's logits for all its new tokens.
        ``runs``: each sequence's tokens go in as one-token items (as a verification's do)."""
        ids, pos, tables, qlens, ctx, slots = [], [], [], [], [], []
        for name, toks in work:
            if name not in self.tables:
                self.start(name)
            start, table = self.done[name], self.tables[name]
            need = -(-(start + len(toks)) // self.block_size) - len(table)
            table.extend(self.free.pop() for _ in range(max(need, 0)))
            pieces = [[t] for t in toks] if runs else [toks]
            at = start
            for piece in pieces:
                ids += piece
                pos += range(at, at + len(piece))
                tables.append(table)
                qlens.append(len(piece))
                ctx.append(at + len(piece))
                slots.append(self.slot[name])
                at += len(piece)
            self.done[name] = at
        meta = build_metadata(tables, qlens, ctx, self.block_size)
        logits = self.model.forward(
            torch.tensor(ids),
            torch.tensor(pos),
            self.kv,
            {None: meta},
            torch.arange(len(ids)),
            states=self.states,
            slots=slots,
            checkpoints=checkpoints,
        )
        return list(torch.split(logits, [len(t) for _, t in work]))


def ref_logits(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float()


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_model_shape(pair):
    """Two of six layers keep KV; four keep states; the rotary part is a quarter of each head."""
    _, model = pair
    assert (model.num_layers, model.attention_layers, model.linear_layers) == (2, [2, 5], [0, 1, 3, 4])
    assert model.rotary_dim == 8
    assert StateSlots.for_model(model, 1).bytes_per_slot == 4 * (160 * 3 + 4 * 16 * 24) * 4


def test_prefill_matches_transformers(pair):
    """One prefill of 150 tokens (blocks of 64 in the delta rule: two whole, one partial)."""
    ref, model = pair
    ids = tokens(150, 1)
    (out,) = Driver(model).step([("a", ids)])
    expected = ref_logits(ref, ids)
    assert err(out, expected) <= TOL
    assert expected.std().item() > 0.5  # logits far from uniform: the comparison says something


def test_chunked_prefill_then_decodes(pair):
    """A prompt in chunks of 7, 13, 1 and 50 tokens (KV and states resumed at each), then 12 decode steps."""
    ref, model = pair
    ids = tokens(71 + 12, 2)
    expected = ref_logits(ref, ids)
    d = Driver(model)
    at = 0
    for n in (7, 13, 1, 50):
        (out,) = d.step([("a", ids[at : at + n])])
        assert err(out, expected[at : at + n]) <= TOL, f"chunk at {at}"
        at += n
    for i in range(at, len(ids)):
        (out,) = d.step([("a", [ids[i]])])
        assert err(out[0], expected[i]) <= TOL, f"decode at {i}"
    assert d.states.tokens[d.slot["a"]] == len(ids)


def test_greedy_generation_matches_transformers_generate(pair):
    """20 greedy tokens: chatkv's prefill and decodes pick what transformers' generate (its own cache) picks."""
    ref, model = pair
    prompt = tokens(12, 3)
    with torch.no_grad():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt) :].tolist()
    d = Driver(model)
    (out,) = d.step([("a", prompt)])
    got = [int(out[-1].argmax())]
    while len(got) < 20:
        (out,) = d.step([("a", [got[-1]])])
        got.append(int(out[-1].argmax()))
    assert got == want
    assert len(set(got)) > 5  # not a degenerate repetition


def test_batched_sequences_match_each_alone(pair):
    """Two sequences in one step (prefills together, then a decode beside a chunk, then decodes together)
    give the logits each gives alone, and transformers'."""
    ref, model = pair
    a, b = tokens(30 + 3, 4), tokens(45 + 9 + 1, 5)
    plan = [
        [("a", a[:30]), ("b", b[:45])],
        [("a", a[30:31]), ("b", b[45:54])],
        [("a", a[31:32]), ("b", b[54:55])],
        [("a", a[32:33])],
    ]
    together = Driver(model, seed=1)
    alone = {"a": Driver(model, seed=2), "b": Driver(model, seed=3)}
    rows = {"a": [], "b": []}
    for step in plan:
        outs = together.step(step)
        for (name, toks), out in zip(step, outs):
            (single,) = alone[name].step([(name, toks)])
            assert err(out, single) <= SAME
            rows[name].append(out)
    for name, ids in (("a", a), ("b", b)):
        assert err(torch.cat(rows[name]), ref_logits(ref, ids)) <= TOL


def test_resume_from_checkpoint(pair):
    """A checkpoint taken inside a prefill chunk (token 25 of 40), copied to a fresh slot and resumed over
    the same first KV blocks, gives the uninterrupted run's logits; a branch with other tokens gives transformers'."""
    ref, model = pair
    ids = tokens(40 + 4, 6)
    d = Driver(model, block_size=5)
    d.start("a")
    keep = d.take_slot()
    (prefill,) = d.step([("a", ids[:40])], checkpoints={d.slot["a"]: [(25, keep)]})
    assert d.states.tokens[keep] == 25
    uninterrupted = [prefill] + [d.step([("a", [t])])[0] for t in ids[40:]]
    uninterrupted = torch.cat(uninterrupted)[25:]

    # resume: the same 5 blocks of KV (tokens 0..24), the checkpoint's state in a slot of its own
    resumed = d.take_slot()
    d.states.copy(keep, resumed)
    d.start("b", table=d.tables["a"][:5], done=25, slot=resumed)
    (chunk,) = d.step([("b", ids[25:40])])
    rest = [d.step([("b", [t])])[0] for t in ids[40:]]
    assert err(torch.cat([chunk, *rest]), uninterrupted) <= SAME

    # branch: other tokens after the checkpoint, against transformers on the branched sequence
    branch = d.take_slot()
    d.states.copy(keep, branch)
    d.start("c", table=d.tables["a"][:5], done=25, slot=branch)
    other = tokens(10, 7)
    (out,) = d.step([("c", other)])
    assert err(out, ref_logits(ref, ids[:25] + other)[25:]) <= TOL


def test_verification_run_keeps_every_state(pair):
    """One-token items of one slot in one step (a verification) compute as plain decodes do, and a
    checkpoint after each token holds the state plain decoding has there: rolling back to it and
    decoding on gives the logits of a sequence that never had the rejected tokens."""
    ref, model = pair
    ids = tokens(20 + 4, 8)
    plain = Driver(model, seed=4)
    plain.step([("a", ids[:20])])
    plain_rows = torch.cat([plain.step([("a", [t])])[0] for t in ids[20:]])

    d = Driver(model, seed=5)
    d.step([("a", ids[:20])])
    slot = d.slot["a"]
    after = [d.take_slot() for _ in range(5)]  # the state after 20, 21, ..., 24 tokens
    (rows,) = d.step([("a", ids[20:])], checkpoints={slot: [(20 + i, s) for i, s in enumerate(after)]}, runs=True)
    assert err(rows, plain_rows) <= SAME
    assert [d.states.tokens[s] for s in after] == [20, 21, 22, 23, 24]

    # reject the last two: back to the state after 22 tokens, then a different token
    d.states.copy(after[2], slot)
    d.done["a"] = 22
    (out,) = d.step([("a", [5])])
    assert err(out[0], ref_logits(ref, ids[:22] + [5])[-1]) <= TOL


def test_misplaced_state_is_an_error(pair):
    """An item that does not start where its slot's state ends is refused before anything is computed."""
    _, model = pair
    d = Driver(model)
    d.step([("a", tokens(10, 9))])
    d.done["a"] = 8  # as if two tokens were dropped from the KV but not from the state
    with pytest.raises(ValueError, match="holds 10 tokens; its item starts at token 8"):
        d.step([("a", [3])])
    assert d.states.tokens[d.slot["a"]] == 10


def test_bfloat16_rounds_as_transformers(pair, tmp_path):
    """In bfloat16 (a prefill of 60, then 40 decodes) chatkv's logits are as near the float32 ones as
    transformers' own bfloat16 logits are, and nearer those than either is to float32."""
    ref, _ = pair
    ref.save_pretrained(str(tmp_path))
    model = Qwen3_5Model.from_pretrained(tmp_path, dtype=torch.bfloat16)
    ids = tokens(100, 10)
    exact = ref_logits(ref, ids)
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    theirs = ref_logits(ref16, ids)
    d = Driver(model)
    ours = torch.cat([d.step([("a", ids[:60])])[0]] + [d.step([("a", [t])])[0] for t in ids[60:]])
    theirs_err = (theirs - exact).abs().mean().item()
    assert (ours - exact).abs().mean().item() <= 1.25 * theirs_err
    assert (ours - theirs).abs().mean().item() <= 0.5 * theirs_err
