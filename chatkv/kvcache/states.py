"""StateCache: who holds each recurrent-state slot of a hybrid model, and its turn-end checkpoints.

A hybrid model (chatkv.model.qwen3_5: linear-attention layers beside full attention) keeps, per
sequence, a fixed-size state besides its KV: ``StateSlots`` (chatkv.model.qwen3_5), a preallocated
tensor of ``num_slots`` slots. The radix tree's KV blocks alone cannot resume a sequence: a prefix
hit also needs the state after exactly that prefix. This owner hands slots out and keeps them:

* a **running sequence** (its ``BlockTable``) holds ``state_slot``, its live state (the tokens its
  KV holds), and, with prefix caching, ``boundary_slot``: the state at its last block boundary,
  refreshed by each step that crosses one (the model copies it there inside the forward,
  chatkv.engine.model_runner). Both are taken by ``attach`` and given back by ``release``;
* a **checkpoint**: when a sequence ends (finished, aborted, preempted), its boundary slot is
  the state after its last full block, exactly where the radix node its release inserts ends.
  It becomes a checkpoint keyed by (namespace, those tokens), in an LRU of at most
  ``max_checkpoints``. A later sequence whose tokens continue such a key (a conversation's next
  turn re-sending its history; a preempted sequence re-admitted) attaches the tree's blocks up to
  that point only and starts from a copy of the checkpoint; anywhere else it computes from token 0.

A checkpoint whose blocks left the tree is skipped (the KV manager matches before using one) and
ages out of the LRU. Slots are sized by the model runner so that the running sequences and the
checkpoints never run out (``max_running`` sequences each holding one or two).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from chatkv.kvcache.types import BlockTable


class StateCache:
    def __init__(self, slots, max_checkpoints: int, boundaries: bool):
        """``slots``: a StateSlots (``num_slots``, ``tokens``, ``reset``, ``copy``, ``bytes_per_slot``).
        ``boundaries``: each sequence keeps its block-boundary state (prefix caching on)."""
        self.slots = slots
        self.max_checkpoints = max_checkpoints if boundaries else 0
        self.boundaries = boundaries
        self.free: list[int] = list(range(slots.num_slots - 1, -1, -1))
        self.checkpoints: OrderedDict[tuple[Hashable, tuple[int, ...]], int] = OrderedDict()
        self.hits = 0  # sequences started from a checkpoint

    def _take(self) -> int:
        assert self.free, "no free state slot: the model runner sized them for max_running sequences"
        return self.free.pop()

    def candidates(self, namespace: Hashable, token_ids: list[int], limit: int) -> list[tuple[int, int]]:
        """(tokens, slot) of the checkpoints of ``namespace`` whose tokens begin ``token_ids``, at most
        ``limit`` long, longest first."""
        out = []
        for (ns, key), slot in self.checkpoints.items():
            n = len(key)
            if ns == namespace and n <= limit and tuple(token_ids[:n]) == key:
                out.append((n, slot))
        return sorted(out, reverse=True)

    def attach(self, t: BlockTable, namespace: Hashable, token_ids: list[int], start: int, slot: int | None) -> None:
        """Give ``t`` its slots: the live one a copy of checkpoint ``slot`` (its first ``start``
        tokens), or the empty state when ``slot`` is None."""
        assert t.state_slot is None and t.boundary_slot is None, "attach of a table that holds state slots"
        live = self._take()
        if slot is None:
            self.slots.reset(live)
        else:
            self.slots.copy(slot, live)
            assert self.slots.tokens[live] == start, "checkpoint and its tokens disagree"
            self.checkpoints.move_to_end((namespace, tuple(token_ids[:start])))
            self.hits += 1
        t.state_slot = live
        if self.boundaries:
            t.boundary_slot = self._take()
            self.slots.tokens[t.boundary_slot] = 0  # no boundary state yet

    def release(self, t: BlockTable, namespace: Hashable, token_ids: list[int], full_tokens: int) -> None:
        """Take ``t``'s slots back; its boundary state becomes the checkpoint of its first
        ``full_tokens`` tokens (the KV its release put in the tree) when it holds exactly those."""
        live, boundary = t.state_slot, t.boundary_slot
        t.state_slot = t.boundary_slot = None
        if live is not None:
            self.free.append(live)
        if boundary is None:
            return
        if 0 < full_tokens == self.slots.tokens[boundary] and self.max_checkpoints > 0:
            key = (namespace, tuple(token_ids[:full_tokens]))
            if key in self.checkpoints:  # the same state, already kept
                self.checkpoints.move_to_end(key)
            else:
                if len(self.checkpoints) >= self.max_checkpoints:
                    self.free.append(self.checkpoints.popitem(last=False)[1])
                self.checkpoints[key] = boundary
                return
        self.free.append(boundary)

    def drop_namespace(self, namespace: Hashable) -> None:
        """Forget the checkpoints of ``namespace`` (its KV will never match again)."""
        for key in [k for k in self.checkpoints if k[0] == namespace]:
            self.free.append(self.checkpoints.pop(key))

    def clear(self) -> None:
        """Forget every checkpoint (shutdown)."""
        self.free.extend(self.checkpoints.values())
        self.checkpoints.clear()

    def stats(self) -> dict[str, int]:
        return {
            "state_slots": self.slots.num_slots,
            "state_slots_free": len(self.free),
            "state_checkpoints": len(self.checkpoints),
            "state_checkpoint_hits": self.hits,
            "state_bytes_per_slot": self.slots.bytes_per_slot,
        }

    def check_integrity(self, tables: list[BlockTable]) -> None:
        """Every slot is free, a checkpoint, or held by exactly one of ``tables`` (the live sequences)."""
        held = [s for t in tables for s in (t.state_slot, t.boundary_slot) if s is not None]
        owners = held + list(self.checkpoints.values()) + self.free
        assert sorted(owners) == list(range(self.slots.num_slots)), (
            f"state slots: {len(held)} held by sequences, {len(self.checkpoints)} checkpoints, {len(self.free)} free "
            f"do not account for the {self.slots.num_slots} slots exactly once"
        )
        assert len(self.checkpoints) <= self.max_checkpoints, "more checkpoints than the cap"
        for (_, key), slot in self.checkpoints.items():
            assert self.slots.tokens[slot] == len(key), "a checkpoint's state and its tokens disagree"
