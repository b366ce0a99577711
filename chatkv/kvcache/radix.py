"""RadixCache: the prefix tree that shares KV blocks between requests: a ``PrefixCache``
(prefix_cache.py holds the contract every method keeps; this says how the tree keeps it).

A radix tree keyed by token ids at *block* granularity, one root per namespace. Each node
holds a run of token ids (always a whole number of blocks) and the block ids that hold
their KV. Children are keyed by the tuple of their first block's tokens, so two children
of one node never start with the same block. ``lock_ref`` of a node counts the locks on it
and on its descendants (``lock``/``unlock`` walk to the root).

Recency is a logical clock: every ``match``/``insert`` stamps the nodes of its path with
one tick, so a parent is never older than its children and ``evict`` (LRU over unlocked
leaves) releases the least recently used prefixes first.

No host tier here: ``HiRadixCache`` (hiradix_cache.py) adds one by overriding the hooks
``_result``, ``_cover``, ``_split``, ``_is_leaf``, ``_release_kv`` and ``_check_node``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Sequence

from chatkv.kvcache.block_pool import BlockPool
from chatkv.kvcache.prefix_cache import MatchResult, Node

__all__ = ["MatchResult", "Node", "RadixCache"]  # Node and MatchResult live in prefix_cache; kept importable here


class RadixCache:
    host = None  # no host tier (HiRadixCache has one)

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._roots: dict[Hashable, Node] = {}
        self._clock = itertools.count(1)
        self._cached = 0  # device blocks held by the tree
        self._evictable = 0  # device blocks in nodes with lock_ref == 0

    # ------------------------------------------------------------------ queries
    @property
    def cached_blocks(self) -> int:
        return self._cached

    @property
    def evictable_blocks(self) -> int:
        return self._evictable

    @property
    def host_blocks(self) -> int:
        return 0

    def tier_stats(self) -> dict[str, int]:
        return {}

    def match(self, namespace: Hashable, token_ids: Sequence[int], max_tokens: int | None = None) -> MatchResult:
        """A match ending inside a node splits it, so it ends exactly at a node."""
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max(0, max_tokens))
        limit -= limit % self.block_size
        root = self._root(namespace)
        path, pos = self._walk(root, tuple(token_ids[:limit]), next(self._clock))
        return self._result(root, path, pos)

    # ---------------------------------------------------------------- mutations
    def insert(self, namespace: Hashable, token_ids: Sequence[int], block_ids: Sequence[int]) -> Node:
        """The walk splits where the tokens diverge; the new run hangs below as one node."""
        bs = self.block_size
        n_tok = len(block_ids) * bs
        assert len(token_ids) >= n_tok, f"{len(block_ids)} blocks need {n_tok} tokens, got {len(token_ids)}"
        tokens = tuple(token_ids[:n_tok])
        now = next(self._clock)
        root = self._root(namespace)
        path, pos = self._walk(root, tokens, now)
        self._cover(path, block_ids)
        node = path[-1] if path else root
        if pos < n_tok:
            new = Node(tokens[pos:], list(block_ids[pos // bs :]), parent=node, last_access=now)
            self.pool.incref(new.block_ids)
            node.children[tokens[pos : pos + bs]] = new
            self._cached += len(new.block_ids)
            self._evictable += len(new.block_ids)
            node = new
        return node

    def load(self, m: MatchResult, block_ids: list[int]) -> MatchResult:
        """Without a host tier a match never continues on host: nothing to load."""
        assert not block_ids, "load without a host tier"
        return m

    def lock(self, node: Node) -> None:
        """Counts one lock on ``node`` and each ancestor (``lock_ref``)."""
        self._check_attached(node)
        while node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.block_ids)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        assert node.lock_ref > 0, "unlock of a node that is not locked"
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.block_ids)
            node = node.parent

    def evict(self, num_blocks: int) -> int:
        """Whole unlocked leaves go, LRU first; a parent left a leaf becomes a candidate too."""
        if num_blocks <= 0:
            return 0
        return self._evict(num_blocks, self._remove)

    def offload(self, node: Node) -> int:
        """No host tier: nothing moves, nothing is freed."""
        return 0

    def drop_namespace(self, namespace: Hashable) -> int:
        """The namespace's root goes too once nothing of it is left."""
        root = self._roots.get(namespace)
        if root is None:
            return 0
        freed, stack = 0, [root]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.lock_ref == 0:
                    freed += self._remove(child)
                else:
                    stack.append(child)
        if not root.children and root.lock_ref == 0:
            del self._roots[namespace]
        return freed

    def clear(self) -> None:
        self._evict(None, self._remove)

    def nodes(self, with_roots: bool = False) -> list[Node]:
        out: list[Node] = list(self._roots.values()) if with_roots else []
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    # -------------------------------------------------------- hooks (HiRadixCache)
    def _result(self, root: Node, path: list[Node], pos: int) -> MatchResult:
        """The MatchResult of a walk from ``root`` that matched ``path`` (``pos`` tokens)."""
        return MatchResult(path[-1] if path else root, [b for p in path for b in p.block_ids], pos)

    def _cover(self, path: list[Node], block_ids: Sequence[int]) -> None:
        """``insert`` found ``path`` already cached for the first blocks of ``block_ids``."""

    def _is_leaf(self, node: Node) -> bool:
        """An eviction candidate: an unlocked non-root node with nothing cached below it."""
        return not node.is_root and node.lock_ref == 0 and not node.children

    def _release_kv(self, node: Node) -> int:
        """Drop the tree's hold on the KV of ``node``, leaving the tree. Returns blocks freed."""
        self._cached -= len(node.block_ids)
        self._evictable -= len(node.block_ids)
        return self.pool.decref(node.block_ids)

    def _check_node(self, node: Node) -> bool:
        """Integrity of a node's residency; True if its KV is on the device (checked by the caller)."""
        assert not node.host_ids, "a host-resident node without a host tier"
        return True

    # ---------------------------------------------------------------- internals
    def _root(self, namespace: Hashable) -> Node:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = Node((), [], is_root=True)
        return root

    def _walk(self, node: Node, tokens: tuple[int, ...], now: int) -> tuple[list[Node], int]:
        """Follow ``tokens`` (a block multiple) down from ``node`` as far as the tree has
        them, splitting the last node if the walk ends inside it and stamping the path with
        ``now``. Returns (the nodes matched below ``node``, in order; tokens matched)."""
        bs = self.block_size
        pos, path = 0, []
        node.last_access = now
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            n = len(child.tokens)
            k = n // bs
            if (
                child.tokens != tokens[pos : pos + n]
            ):  # the first block matches (it is the key); find where they diverge
                k = 1
                while k * bs < n and child.tokens[k * bs : (k + 1) * bs] == tokens[pos + k * bs : pos + (k + 1) * bs]:
                    k += 1
                if k < n // bs:
                    child = self._split(child, k)
            child.last_access = now
            path.append(child)
            pos += k * bs
            node = child
        return path, pos

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` blocks; returns the new upper half, which
        takes node's place under its parent and inherits its lock_ref and access time."""
        bs = self.block_size
        cut = k * bs
        upper = Node(node.tokens[:cut], node.block_ids[:k], parent=node.parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[node.tokens[:bs]] = upper
        node.tokens, node.block_ids = node.tokens[cut:], node.block_ids[k:]
        node.parent = upper
        upper.children[node.tokens[:bs]] = node
        return upper

    def _check_attached(self, node: Node) -> None:
        top = node
        while top.parent is not None:
            top = top.parent
        assert top.is_root, "lock of an evicted node (lock right after match, before any evict)"

    def _remove(self, node: Node) -> int:
        """Take ``node`` and its subtree (all unlocked) out of the tree, dropping the tree's
        hold on their KV. Returns the device blocks that became free."""
        assert node.lock_ref == 0, "removal of a locked node"
        del node.parent.children[node.tokens[: self.block_size]]
        freed, stack = 0, [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.parent = None  # detached: a later lock() of it fails loudly
            freed += self._release_kv(n)
        return freed

    def _evict(self, num_blocks: int | None, release: Callable[[Node], int]) -> int:
        """Pass LRU leaves (``_is_leaf``) to ``release`` until ``num_blocks`` device blocks
        became free (None: all of them)."""
        heap = [(n.last_access, id(n), n) for n in self.nodes() if self._is_leaf(n)]  # id: nodes do not compare
        heapq.heapify(heap)
        freed = 0
        while heap and (num_blocks is None or freed < num_blocks):
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            freed += release(node)
            if self._is_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    # ---------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Block multiples, parent links and keys, lock_ref >= the children's, a parent never
        older than its children, no block twice, and the two block counts."""
        bs = self.block_size
        seen: set[int] = set()
        evictable = 0
        for root in self._roots.values():
            assert root.is_root and root.parent is None and not root.tokens and not root.block_ids and not root.host_ids
            stack = [root]
            while stack:
                node = stack.pop()
                assert len(node.tokens) % bs == 0, f"node of {len(node.tokens)} tokens is not a block multiple"
                assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0, "lock_ref < children's"
                if self._check_node(node):
                    assert node.is_root or node.block_ids, "empty non-root node"
                    assert len(node.block_ids) == len(node.tokens) // bs, "block count != tokens / block_size"
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
