"""The prefix-cache contract, written once: ``PrefixCache``, the types in its signatures
(``Node``, ``MatchResult``) and its no-sharing implementation ``NoPrefixCache``.

Implementations: ``RadixCache`` (radix_cache.py: shares full blocks between requests),
``HiRadixCache`` (hiradix_cache.py: the same with a host-memory tier below the device) and
``NoPrefixCache`` (here: prefix caching off). The KV manager names only ``PrefixCache``.

Imports nothing of chatkv at run time: a leaf every KV module may import.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from chatkv.kvcache.block_pool import BlockPool
    from chatkv.kvcache.host_pool import HostPool


@dataclass(eq=False, slots=True)
class Node:
    """One run of cached tokens: a whole number of blocks (empty only for a namespace root)
    and the device blocks holding their KV. A lock handle for ``PrefixCache.lock``."""

    tokens: tuple[int, ...]  # a whole number of blocks; empty only for a root
    block_ids: list[int]  # device blocks: len(tokens) // block_size ids, or [] when on host
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0  # locks on this node and on its descendants
    last_access: int = 0  # logical clock of its last match/insert
    is_root: bool = False
    host_ids: list[int] = field(default_factory=list)  # a host tier's blocks when host-resident, else []

    @property
    def on_host(self) -> bool:
        return bool(self.host_ids)


@dataclass
class MatchResult:
    node: Node  # deepest device-resident node of the match (the namespace root if none); pass it to lock/unlock
    block_ids: list[int]  # device block ids holding the matched tokens, in order
    num_tokens: int  # == len(block_ids) * block_size
    host_node: Node | None = None  # deepest host-resident node where the match continues on host
    host_tokens: int = 0  # tokens matched beyond num_tokens, in host-resident nodes (a block multiple)


@runtime_checkable
class PrefixCache(Protocol):
    """A cache of KV blocks keyed by the token ids they hold, in namespaces.

    Contract, for every implementation:

    * **Blocks.** Only whole blocks of tokens are cached; a sequence's partial last block
      stays its owner's. The cache holds one pool reference on every device block it caches
      (``cached_blocks`` of them), taken in ``insert``/``load`` and dropped when a block
      leaves (``evict``, ``offload``, ``drop_namespace``, ``clear``). A caller's references
      stay the caller's: it drops them itself, whatever the cache adopted.
    * **Namespaces.** Every lookup and insert is in a namespace (model, kv dtype, tenant
      salt, ...); two namespaces never share a node, even for identical tokens.
    * **Locks.** ``lock(node)`` pins ``node`` and its ancestors; a locked node is never
      evicted, offloaded nor dropped. Lock the node a ``match``/``insert`` returned before
      anything can call ``evict``, or its blocks may be gone. Every ``lock`` is undone by
      exactly one ``unlock`` (a cache that holds nothing, ``NoPrefixCache``, ignores both).
    * **Leaving a token to compute** is the caller's rule, not the cache's: a caller that
      must compute at least one token passes ``max_tokens=len(tokens) - 1`` to ``match``.
    * **Host tier.** ``host`` is a ``HostPool`` or None. Without one, a match never
      continues on host (``host_tokens == 0``), ``load`` takes no blocks and ``offload``
      frees none.
    * ``check_integrity`` asserts every invariant above that the cache can see alone.
    """

    block_size: int
    host: HostPool | None

    @property
    def cached_blocks(self) -> int:
        """Device blocks the cache holds a reference on."""
        ...

    @property
    def evictable_blocks(self) -> int:
        """Device blocks in unlocked nodes: what ``evict`` could release if nobody else holds them."""
        ...

    @property
    def host_blocks(self) -> int:
        """Host blocks held by host-resident nodes (0 without a host tier)."""
        ...

    def match(self, namespace: Hashable, token_ids: Sequence[int], max_tokens: int | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids``, in whole blocks, capped at ``max_tokens``
        (rounded down to a block multiple): its device part (``node``, ``block_ids``,
        ``num_tokens``) and how far it continues on host (``host_node``, ``host_tokens``).
        Marks the path recently used; changes no reference count and no lock."""
        ...

    def insert(self, namespace: Hashable, token_ids: Sequence[int], block_ids: Sequence[int]) -> Node:
        """Cache ``block_ids``, which hold the KV of the first ``len(block_ids)`` full blocks of
        ``token_ids`` (extra trailing tokens are ignored). Runs already cached on the device
        keep the cache's blocks; the rest are adopted with a reference of the cache's own.
        Returns the node ending at the last inserted block (a root if ``block_ids`` is empty):
        the handle to ``lock``."""
        ...

    def load(self, m: MatchResult, block_ids: list[int]) -> MatchResult:
        """Copy the first ``len(block_ids)`` blocks of ``m``'s host continuation into the
        freshly allocated ``block_ids`` (the cache takes over their one reference each); ``m``
        must be a match made since the last change to the cache. Returns ``m`` extended."""
        ...

    def lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors until ``unlock``. ``node`` must be in the cache and
        device-resident."""
        ...

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``; unlocking a node that is not locked is an AssertionError."""
        ...

    def evict(self, num_blocks: int) -> int:
        """Release unlocked cached blocks, least recently used first, until at least
        ``num_blocks`` device blocks became free or nothing more is evictable. Returns the
        device blocks that became free (blocks someone else still references don't)."""
        ...

    def offload(self, node: Node) -> int:
        """Move ``node``, then each ancestor, to the host tier while it is unlocked and all
        below it is on host already. Returns the device blocks that became free."""
        ...

    def drop_namespace(self, namespace: Hashable) -> int:
        """Remove every unlocked node of ``namespace``, device and host, freeing its blocks
        (KV never to be matched again). Returns the device blocks freed."""
        ...

    def clear(self) -> None:
        """Release every unlocked node and everything on host (shutdown). Locked paths stay."""
        ...

    def nodes(self, with_roots: bool = False) -> list[Node]:
        """Every node below the namespace roots (and the roots, if asked), parents before children."""
        ...

    def tier_stats(self) -> dict[str, int]:
        """Lifetime block counters of the host tier ({} without one): ``evicted_to_host``
        (device -> host), ``host_hits`` (host -> device), ``host_evicted`` (dropped from host)."""
        ...

    def check_integrity(self) -> None:
        """Assert the cache's invariants (cheap enough to run when the engine is idle)."""
        ...


class NoPrefixCache:
    """The ``PrefixCache`` of an engine with prefix caching off: it never shares and never
    holds a block. ``match`` finds nothing, ``insert`` adopts nothing (the caller's
    references are the only ones, so blocks go back to the pool when it drops them), locks
    are no-ops on one root that is never evicted. No host tier."""

    host = None

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._root = Node((), [], is_root=True)
        self.cached_blocks = 0
        self.evictable_blocks = 0
        self.host_blocks = 0

    def match(self, namespace: Hashable, token_ids: Sequence[int], max_tokens: int | None = None) -> MatchResult:
        return MatchResult(self._root, [], 0)

    def insert(self, namespace: Hashable, token_ids: Sequence[int], block_ids: Sequence[int]) -> Node:
        return self._root

    def load(self, m: MatchResult, block_ids: list[int]) -> MatchResult:
        assert not block_ids, "load without a host tier"
        return m

    def lock(self, node: Node) -> None:
        pass

    def unlock(self, node: Node) -> None:
        pass

    def evict(self, num_blocks: int) -> int:
        return 0

    def offload(self, node: Node) -> int:
        return 0

    def drop_namespace(self, namespace: Hashable) -> int:
        return 0

    def clear(self) -> None:
        pass

    def nodes(self, with_roots: bool = False) -> list[Node]:
        return []  # its one root takes no locks

    def tier_stats(self) -> dict[str, int]:
        return {}

    def check_integrity(self) -> None:
        assert not self._root.children and not self._root.lock_ref, "the no-sharing cache grew a node"
