"""The plain types the KV manager shares with the modules that hold KV: no behaviour.

* ``RetainedKV``: the KV a finished turn leaves for its conversation's next turn. The KV
  manager issues and ends it; a Sequence (``prefix``, ``retained``), a Session and the
  snapshots only carry it.
* ``BlockTable``: the record of what one request holds in the pool - its blocks, the radix
  lock of its cached prefix, how many tokens have KV. The request owns it (``Sequence.kv``);
  the KV manager takes it and gives it back filled (``attach``), grown (``reserve``), cut
  (``trim``) or emptied (``release``), and writes nothing else of the request but the handle
  it takes over (``prefix``).
* ``SequenceKV``: what the KV manager reads of a request - its token ids, namespace, handed
  prefix and first-admission mark - and its block table. ``chatkv.engine.sequence.Sequence`` is one;
  the KV manager names this protocol, never the Sequence class, so the two modules do not
  import each other.

The radix ``Node`` these name is the lock handle of ``chatkv.kvcache.prefix_cache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Protocol

if TYPE_CHECKING:
    from chatkv.kvcache.prefix_cache import Node


@dataclass(eq=False)
class RetainedKV:
    """KV a conversation holds between turns: the locked radix ``node`` ending at its last
    full block (None if it had none), and its own partial last block ``tail_block`` holding
    ``tail_len`` tokens. ``kv_len = full blocks * block_size + tail_len`` tokens have KV.
    ``host_len``: how many of them ``import_kv`` copied back from the host tier."""

    node: Node | None
    tail_block: int | None
    tail_len: int
    kv_len: int
    host_len: int = 0


@dataclass(eq=False)
class BlockTable:
    """What one request holds in the pool, as one record: one pool reference per entry of
    ``blocks`` (block ``i`` holds tokens ``i * block_size`` onward), one lock on the path of
    ``lock_node`` (the cached prefix it attached; None: none), and ``num_computed`` leading
    tokens whose KV is in those blocks. ``num_host`` of its tokens came from the host tier at
    its first admission. Empty (``blocks == []``, ``lock_node is None``) while it holds nothing.
    The scheduler advances ``num_computed`` as steps compute KV into the blocks it reserved.
    A hybrid model's request also holds state slots (``state_slot``, ``boundary_slot``)."""

    blocks: list[int] = field(default_factory=list)
    lock_node: Node | None = None
    num_computed: int = 0
    num_host: int = 0
    # a hybrid model's recurrent-state slots (chatkv.kvcache.states): the live state of its
    # ``num_computed`` tokens, and the state at its last block boundary; None: none held
    state_slot: int | None = None
    boundary_slot: int | None = None

    @property
    def empty(self) -> bool:
        return not self.blocks and self.lock_node is None


class SequenceKV(Protocol):
    """The fields of a request the KV manager uses (see kv_manager.py's "Owners")."""

    token_ids: list[int]  # read: what the KV is of
    namespace: Hashable | None  # read: its radix namespace (None: the manager's default)
    prefix: RetainedKV | None  # taken over (set to None) by ``attach`` and ``release``
    num_cached: int  # read: prefix-hit tokens at first admission (-1: not admitted yet)
    kv: BlockTable  # what it holds in the pool: filled, grown, cut and emptied by the manager
