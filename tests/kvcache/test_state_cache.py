"""StateCache (chatkv.kvcache.states) on a real StateSlots: slots handed to tables and back, boundary
states becoming checkpoints, the LRU cap, and the integrity check catching a slot nobody accounts for."""

from __future__ import annotations

import pytest
import torch

from chatkv.kvcache.states import StateCache
from chatkv.kvcache.types import BlockTable
from chatkv.model.deltanet import Dims
from chatkv.model.qwen3_5 import StateSlots

NS = "ns"


def make(num_slots: int = 6, cap: int = 2) -> StateCache:
    return StateCache(StateSlots(num_slots, 2, Dims(1, 2, 4, 3, 4), torch.float32), cap, boundaries=True)


def finish(cache: StateCache, tokens: list[int], boundary_tokens: int, full_tokens: int, fill: float) -> BlockTable:
    """A sequence attached from nothing whose boundary slot holds ``boundary_tokens`` tokens' state
    (``fill`` everywhere), released with ``full_tokens`` tokens of full blocks."""
    t = BlockTable()
    cache.attach(t, NS, tokens, 0, None)
    cache.slots.recurrent[:, t.boundary_slot] = fill
    cache.slots.tokens[t.boundary_slot] = boundary_tokens
    cache.release(t, NS, tokens, full_tokens)
    return t


def test_a_boundary_state_at_the_inserted_blocks_end_becomes_a_checkpoint_and_is_restored():
    cache = make()
    tokens = list(range(40))
    t = finish(cache, tokens, 32, 32, fill=3.0)
    assert t.state_slot is None and t.boundary_slot is None
    assert cache.candidates(NS, tokens + [99], 39) == [(32, cache.checkpoints[(NS, tuple(tokens[:32]))])]
    assert cache.candidates(NS, tokens[:20] + [0] * 20, 39) == []  # diverges inside the key
    assert cache.candidates("other", tokens, 39) == []  # namespaces never share
    n, slot = cache.candidates(NS, tokens, 39)[0]
    again = BlockTable()
    cache.attach(again, NS, tokens, n, slot)
    assert cache.slots.tokens[again.state_slot] == 32
    assert torch.equal(cache.slots.recurrent[:, again.state_slot], torch.full_like(cache.slots.recurrent[:, 0], 3.0))
    assert cache.hits == 1
    cache.check_integrity([again])


def test_a_boundary_state_behind_the_inserted_blocks_is_not_kept():
    cache = make()
    finish(cache, list(range(40)), 16, 32, fill=1.0)  # its last boundary copy missed a block
    finish(cache, list(range(10)), 0, 0, fill=1.0)  # no full block: nothing in the tree to resume
    assert not cache.checkpoints
    cache.check_integrity([])


def test_the_cap_drops_the_least_recently_used():
    cache = make(cap=2)
    a, b, c = ([i] * 16 for i in (1, 2, 3))
    finish(cache, a, 16, 16, 1.0)
    finish(cache, b, 16, 16, 2.0)
    cache.attach(t := BlockTable(), NS, a + [5], 16, cache.checkpoints[(NS, tuple(a))])  # a used: b is older
    cache.release(t, NS, a + [5], 0)
    finish(cache, c, 16, 16, 3.0)
    assert set(cache.checkpoints) == {(NS, tuple(a)), (NS, tuple(c))}
    cache.check_integrity([])
    cache.drop_namespace(NS)
    assert not cache.checkpoints and len(cache.free) == cache.slots.num_slots


def test_integrity_catches_a_slot_held_by_no_live_table():
    cache = make()
    t = BlockTable()
    cache.attach(t, NS, [1, 2, 3], 0, None)
    cache.check_integrity([t])
    with pytest.raises(AssertionError, match="do not account"):
        cache.check_integrity([])  # t's two slots leaked
