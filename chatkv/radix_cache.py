"""RadixCache: the prefix tree that shares KV blocks between requests.

A radix tree keyed by token ids at *block* granularity. Each node holds a run of
token ids (always a whole number of blocks) and the block ids that hold their
KV. Only full blocks ever enter the tree; a sequence's partial last block stays
its owner's. Children are keyed by the tuple of their first block's tokens, so
two children of one node never start with the same block.

Namespaces (model, kv dtype, tenant salt, ...) each get their own root; two
namespaces never share a node, even for identical tokens.

Reference counts:
  * the tree holds one pool reference on every block it caches (taken in
    ``insert``, dropped in ``evict``/``clear``);
  * ``lock_ref`` of a node counts the locks on it and on its descendants
    (``lock``/``unlock`` walk to the root). Nodes with ``lock_ref > 0`` are
    never evicted. Lock the node a ``match`` returned *before* anything can call
    ``evict``, or its blocks may be gone.

Recency is a logical clock: every ``match``/``insert`` stamps the nodes of its
path with one tick, so a parent is never older than its children and ``evict``
(LRU over unlocked leaves) releases the least recently used prefixes first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from chatkv.block_pool import BlockPool


@dataclass(eq=False, slots=True)
class Node:
    tokens: tuple[int, ...]  # a whole number of blocks; empty only for a root
    block_ids: list[int]  # len(tokens) // block_size ids
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    is_root: bool = False


@dataclass
class MatchResult:
    node: Node  # deepest node of the match (the namespace root if nothing matched); pass it to lock/unlock
    block_ids: list[int]  # block ids holding the matched tokens, in order
    num_tokens: int  # == len(block_ids) * block_size


class RadixCache:
    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._roots: dict[Hashable, Node] = {}
        self._clock = itertools.count(1)
        self._cached = 0  # blocks held by the tree
        self._evictable = 0  # blocks in nodes with lock_ref == 0

    # ------------------------------------------------------------------ queries
    @property
    def cached_blocks(self) -> int:
        """Blocks the tree holds a reference on."""
        return self._cached

    @property
    def evictable_blocks(self) -> int:
        """Blocks in unlocked nodes: what ``evict`` could release if nobody else holds them."""
        return self._evictable

    def match(self, namespace: Hashable, token_ids: Sequence[int], max_tokens: int | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids``, in whole blocks, capped at ``max_tokens``
        (rounded down to a block multiple). If the match ends inside a node the node is
        split, so ``result.node`` ends exactly at the match. Stamps the path as recently
        used. Does not change any reference count."""
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max(0, max_tokens))
        limit -= limit % self.block_size
        node, pos, blocks = self._walk(self._root(namespace), tuple(token_ids[:limit]), next(self._clock))
        return MatchResult(node, blocks, pos)

    # ---------------------------------------------------------------- mutations
    def insert(self, namespace: Hashable, token_ids: Sequence[int], block_ids: Sequence[int]) -> Node:
        """Cache ``block_ids``, which hold the KV of the first ``len(block_ids)`` full blocks
        of ``token_ids`` (extra trailing tokens are ignored). Blocks whose token run is
        already cached keep the tree's ids (the caller's duplicates are not adopted); new
        blocks are adopted and the tree takes its own reference (``pool.incref``). The
        caller keeps and later drops its own references either way. Returns the node
        ending at the last inserted block (the root if ``block_ids`` is empty)."""
        bs = self.block_size
        n_tok = len(block_ids) * bs
        assert len(token_ids) >= n_tok, f"{len(block_ids)} blocks need {n_tok} tokens, got {len(token_ids)}"
        tokens = tuple(token_ids[:n_tok])
        now = next(self._clock)
        node, pos, _ = self._walk(self._root(namespace), tokens, now)
        if pos < n_tok:
            new = Node(tokens[pos:], list(block_ids[pos // bs :]), parent=node, last_access=now)
            self.pool.incref(new.block_ids)
            node.children[tokens[pos : pos + bs]] = new
            self._cached += len(new.block_ids)
            self._evictable += len(new.block_ids)
            node = new
        return node

    def lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors: none of them is evicted until ``unlock``."""
        self._check_attached(node)
        while node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.block_ids)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``. Unlocking a node that is not locked is an AssertionError."""
        assert node.lock_ref > 0, "unlock of a node that is not locked"
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.block_ids)
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Remove unlocked leaves, least recently used first (a parent left as an unlocked
        leaf becomes a candidate too), dropping the tree's reference on their blocks, until
        at least ``num_blocks`` blocks became free or nothing is evictable. Whole nodes go.
        Returns how many blocks became free (blocks someone else still references don't)."""
        if num_blocks <= 0:
            return 0
        return self._evict(num_blocks)

    def clear(self) -> None:
        """Release every unlocked node (shutdown). Locked paths stay."""
        self._evict(None)

    def nodes(self, with_roots: bool = False) -> list[Node]:
        """Every node below the namespace roots (and the roots, if asked), parents before children."""
        out: list[Node] = list(self._roots.values()) if with_roots else []
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # ---------------------------------------------------------------- internals
    def _root(self, namespace: Hashable) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node((), [], is_root=True)
        return root

    def _walk(self, node: Node, tokens: tuple[int, ...], now: int) -> tuple[Node, int, list[int]]:
        """Follow ``tokens`` (a block multiple) down from ``node`` as far as the tree has
        them, splitting the last node if the walk ends inside it and stamping the path with
        ``now``. Returns (deepest node, tokens matched, their block ids)."""
        bs = self.block_size
        pos, blocks = 0, []
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            n = len(child.tokens)
            if child.tokens == tokens[pos : pos + n]:
                k = len(child.block_ids)
            else:  # the first block matches (it is the key); find where they diverge
                k = 1
                while k * bs < n and child.tokens[k * bs : (k + 1) * bs] == tokens[pos + k * bs : pos + (k + 1) * bs]:
                    k += 1
                if k < len(child.block_ids):
                    child = self._split(child, k)
            child.last_access = now
            blocks.extend(child.block_ids)
            pos += k * bs
            node = child
        return node, pos, blocks

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` blocks; returns the new upper half, which
        takes node's place under its parent and inherits its lock_ref and access time."""
        bs = self.block_size
        cut = k * bs
        upper = Node(node.tokens[:cut], node.block_ids[:k], parent=node.parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[node.tokens[:bs]] = upper
        node.tokens, node.block_ids, node.parent = node.tokens[cut:], node.block_ids[k:], upper
        upper.children[node.tokens[:bs]] = node
        return upper

    def _check_attached(self, node: Node) -> None:
        top = node
        while top.parent is not None:
            top = top.parent
        assert top.is_root, "lock of an evicted node (lock right after match, before any evict)"

    def _evict(self, num_blocks: int | None) -> int:
        """Evict LRU unlocked leaves until ``num_blocks`` became free (None: all of them)."""
        heap = []
        tie = itertools.count()  # nodes do not compare; keeps heap entries totally ordered
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                if node.children:
                    stack.extend(node.children.values())
                elif node.lock_ref == 0:
                    heap.append((node.last_access, next(tie), node))
        heapq.heapify(heap)
        freed = 0
        while heap and (num_blocks is None or freed < num_blocks):
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.tokens[: self.block_size]]
            node.parent = None  # detached: a later lock() of it fails loudly
            freed += self.pool.decref(node.block_ids)
            self._cached -= len(node.block_ids)
            self._evictable -= len(node.block_ids)
            if not parent.is_root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(tie), parent))
        return freed

    # ---------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Assert the tree's invariants (cheap enough to run when the engine is idle)."""
        bs = self.block_size
        seen: set[int] = set()
        evictable = 0
        for root in self._roots.values():
            assert root.is_root and root.parent is None and not root.tokens and not root.block_ids
            stack = [root]
            while stack:
                node = stack.pop()
                assert len(node.tokens) % bs == 0, f"node of {len(node.tokens)} tokens is not a block multiple"
                assert len(node.block_ids) == len(node.tokens) // bs, "block count != tokens / block_size"
                assert node.is_root or node.block_ids, "empty non-root node"
                assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0, "lock_ref < children's"
                if node.lock_ref == 0:
                    evictable += len(node.block_ids)
                for b in node.block_ids:
                    assert b not in seen, f"block {b} appears twice in the tree"
                    assert self.pool.ref_counts[b] >= 1, f"tree block {b} is free in the pool"
                    seen.add(b)
                for key, child in node.children.items():
                    assert child.parent is node and not child.is_root, "broken parent link"
                    assert key == child.tokens[:bs], "child keyed by something other than its first block"
                    assert child.last_access <= node.last_access, "child used more recently than its parent"
                    stack.append(child)
        assert len(seen) == self._cached, f"cached_blocks {self._cached} != {len(seen)} blocks in the tree"
        assert evictable == self._evictable, f"evictable_blocks {self._evictable} != {evictable}"


class NoPrefixCache:
    """The cache of an engine with prefix caching off: it never shares and never holds a block.

    Same interface as ``RadixCache``: ``match`` finds nothing, ``insert`` adopts nothing
    (the caller's references are the only ones, so blocks go back to the pool when it
    drops them), locks are no-ops on one root that is never evicted.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._root = Node((), [], is_root=True)
        self.cached_blocks = 0
        self.evictable_blocks = 0

    def match(self, namespace: Hashable, token_ids: Sequence[int], max_tokens: int | None = None) -> MatchResult:
        return MatchResult(self._root, [], 0)

    def insert(self, namespace: Hashable, token_ids: Sequence[int], block_ids: Sequence[int]) -> Node:
        return self._root

    def lock(self, node: Node) -> None:
        pass

    def unlock(self, node: Node) -> None:
        pass

    def evict(self, num_blocks: int) -> int:
        return 0

    def clear(self) -> None:
        pass

    def nodes(self, with_roots: bool = False) -> list[Node]:
        return []  # its one root takes no locks

    def check_integrity(self) -> None:
        assert not self._root.children and not self._root.lock_ref, "the no-sharing cache grew a node"
