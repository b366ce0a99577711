"""RadixCache: the prefix tree that shares KV blocks between requests.

(Past ~400 lines on purpose: the host tier's moves - evict to host, load back, promote,
offload, drop a namespace - must each keep the same counters and the one prefix-closure
invariant, and belong next to the walk and split they share.)

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

Host tier (SGLang's HiRadixCache): given a ``HostPool``, a node is either
*device-resident* (``block_ids``) or *host-resident* (``host_ids``, its KV in host
memory). The device-resident nodes form a rooted, prefix-closed subtree: a host
node's descendants are all on host, and host nodes are never locked. ``evict`` then
takes LRU unlocked *device leaves* (device nodes whose children are all on host),
copies their KV to host blocks and keeps them in the tree as host nodes; to make
room on host it first removes LRU host leaves (their KV survives only in disk
snapshots, if any). ``match`` reports the device hit as before plus how far the
match continues on host; ``load`` copies such a continuation back into device
blocks; ``insert`` of tokens a host node holds promotes it with the caller's blocks.
The tree owns every host block of its host nodes (``HostPool`` ownership is a flag).

"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from chatkv.block_pool import BlockPool

if TYPE_CHECKING:
    from chatkv.host_pool import HostPool


@dataclass(eq=False, slots=True)
class Node:
    tokens: tuple[int, ...]  # a whole number of blocks; empty only for a root
    block_ids: list[int]  # device blocks: len(tokens) // block_size ids, or [] when on host
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    is_root: bool = False
    host_ids: list[int] = field(default_factory=list)  # host blocks when host-resident, else []

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


class RadixCache:
    def __init__(self, pool: BlockPool, host: HostPool | None = None) -> None:
        self.pool = pool
        self.host = host
        self.block_size = pool.block_size
        self._roots: dict[Hashable, Node] = {}
        self._clock = itertools.count(1)
        self._cached = 0  # device blocks held by the tree
        self._evictable = 0  # device blocks in nodes with lock_ref == 0
        self._host_cached = 0  # host blocks held by the tree
        self._host_heap: list | None = None  # LRU host leaves, built lazily within one evict/offload
        # lifetime counters, in blocks
        self.evicted_to_host = 0  # device blocks whose KV was copied to host by evict/offload
        self.host_hits = 0  # host blocks copied back to the device by load
        self.host_evicted = 0  # host blocks dropped to make room on host (LRU)

    # ------------------------------------------------------------------ queries
    @property
    def cached_blocks(self) -> int:
        """Device blocks the tree holds a reference on."""
        return self._cached

    @property
    def evictable_blocks(self) -> int:
        """Device blocks in unlocked nodes: what ``evict`` could release if nobody else holds them."""
        return self._evictable

    @property
    def host_blocks(self) -> int:
        """Host blocks held by host-resident nodes."""
        return self._host_cached

    def match(self, namespace: Hashable, token_ids: Sequence[int], max_tokens: int | None = None) -> MatchResult:
        """Longest cached prefix of ``token_ids``, in whole blocks, capped at ``max_tokens``
        (rounded down to a block multiple): its device-resident part (``node``, ``block_ids``,
        ``num_tokens``) and the host-resident rest (``host_node``, ``host_tokens``). If the
        match ends inside a node the node is split, so the match ends exactly at a node. Stamps
        the path as recently used. Does not change any reference count."""
        limit = len(token_ids) if max_tokens is None else min(len(token_ids), max(0, max_tokens))
        limit -= limit % self.block_size
        root = self._root(namespace)
        path, pos = self._walk(root, tuple(token_ids[:limit]), next(self._clock))
        node, blocks = root, []
        for p in path:
            if p.host_ids:  # prefix closure: everything below is on host too
                break
            node = p
            blocks.extend(p.block_ids)
        on_device = len(blocks) * self.block_size
        host_node = path[-1] if pos > on_device else None
        return MatchResult(node, blocks, on_device, host_node, pos - on_device)

    # ---------------------------------------------------------------- mutations
    def insert(self, namespace: Hashable, token_ids: Sequence[int], block_ids: Sequence[int]) -> Node:
        """Cache ``block_ids``, which hold the KV of the first ``len(block_ids)`` full blocks
        of ``token_ids`` (extra trailing tokens are ignored). Blocks whose token run is
        already cached on the device keep the tree's ids (the caller's duplicates are not
        adopted); new blocks, and those of runs the tree holds only on host (the host node
        is promoted back to the device, its host blocks freed), are adopted and the tree
        takes its own reference (``pool.incref``). The caller keeps and later drops its own
        references either way. Returns the node ending at the last inserted block (the root
        if ``block_ids`` is empty)."""
        bs = self.block_size
        n_tok = len(block_ids) * bs
        assert len(token_ids) >= n_tok, f"{len(block_ids)} blocks need {n_tok} tokens, got {len(token_ids)}"
        tokens = tuple(token_ids[:n_tok])
        now = next(self._clock)
        root = self._root(namespace)
        path, pos = self._walk(root, tokens, now)
        first = 0
        for p in path:
            k = len(p.tokens) // bs
            if p.host_ids:
                self._promote(p, list(block_ids[first : first + k]))
            first += k
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
        """Copy the first ``len(block_ids)`` blocks of ``m``'s host continuation into
        ``block_ids`` (freshly allocated: the tree takes over their one reference); those nodes
        become device-resident again, their host blocks freed. ``m`` must be a match made
        since the last change to the tree. Returns ``m`` extended by the loaded blocks."""
        assert self.host is not None and len(block_ids) * self.block_size <= m.host_tokens
        if not block_ids:
            return m
        path = []
        node = m.host_node
        while node is not m.node:
            assert node is not None and node.host_ids, "stale match: its host path changed"
            path.append(node)
            node = node.parent
        host_ids, dev_ids, done = [], [], 0
        for node in reversed(path):
            left = len(block_ids) - done
            if left == 0:
                break
            if left < len(node.host_ids):
                node = self._split(node, left)  # the upper half is loaded, the rest stays on host
            k = len(node.host_ids)
            host_ids += node.host_ids
            dev_ids += block_ids[done : done + k]
            node.block_ids, node.host_ids = list(block_ids[done : done + k]), []
            done += k
            last = node
        self.host.load(self.pool, host_ids, dev_ids)  # before the free: a freed block may be reused
        self.host.free(host_ids)
        self._host_cached -= done
        self._cached += done
        self._evictable += done  # host nodes are never locked
        self.host_hits += done
        n = done * self.block_size
        rest = m.host_node if m.host_tokens > n else None
        return MatchResult(last, m.block_ids + list(block_ids), m.num_tokens + n, rest, m.host_tokens - n)

    def lock(self, node: Node) -> None:
        """Pin ``node`` and its ancestors: none of them is evicted until ``unlock``."""
        self._check_attached(node)
        assert not node.host_ids, "lock of a host-resident node (load it back first)"
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
        """Free device blocks from unlocked device leaves, least recently used first (a parent
        left as an unlocked device leaf becomes a candidate too), until at least ``num_blocks``
        blocks became free or nothing is evictable. Whole nodes go: with a host tier to host
        (kept in the tree, host-resident) when it can hold them, else out of the tree with
        their host descendants. Returns how many device blocks became free (blocks someone
        else still references don't)."""
        if num_blocks <= 0:
            return 0
        return self._evict(num_blocks, to_host=self.host is not None)

    def offload(self, node: Node) -> int:
        """Move ``node``, then each ancestor, to host while it is an unlocked device leaf and
        the host tier can hold it (making room there by dropping LRU host leaves). Returns
        the device blocks that became free (0 without a host tier)."""
        if self.host is None:
            return 0
        self._host_heap = None
        freed = 0
        while self._is_device_leaf(node) and node.parent is not None:
            parent = node.parent
            if not self._host_room(len(node.block_ids)):
                break
            freed += self._to_host(node)
            node = parent
        return freed

    def drop_namespace(self, namespace: Hashable) -> int:
        """Remove every unlocked node of ``namespace``, device and host, freeing their blocks
        (not moving them to host: KV never to be matched again). Locked paths stay; the
        namespace's root goes once nothing of it is left. Returns the device blocks freed."""
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
        """Release every unlocked node and every host-resident one (shutdown). Locked paths stay."""
        self._evict(None, to_host=False)
        for node in [n for n in self.nodes() if n.host_ids and n.parent is not None]:
            if node.parent is not None:  # not already gone with a host ancestor
                self._remove(node)

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
            if child.tokens != tokens[pos : pos + n]:  # the first block matches (it is the key); find where they diverge
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
        takes node's place under its parent and inherits its residency, lock_ref and
        access time."""
        bs = self.block_size
        cut = k * bs
        upper = Node(node.tokens[:cut], node.block_ids[:k], parent=node.parent, host_ids=node.host_ids[:k])
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[node.tokens[:bs]] = upper
        node.tokens, node.block_ids, node.host_ids = node.tokens[cut:], node.block_ids[k:], node.host_ids[k:]
        node.parent = upper
        upper.children[node.tokens[:bs]] = node
        return upper

    def _check_attached(self, node: Node) -> None:
        top = node
        while top.parent is not None:
            top = top.parent
        assert top.is_root, "lock of an evicted node (lock right after match, before any evict)"

    def _is_device_leaf(self, node: Node) -> bool:
        """An unlocked, non-root, device-resident node whose children are all on host."""
        return (
            not node.is_root and not node.host_ids and node.lock_ref == 0
            and all(c.host_ids for c in node.children.values())
        )

    def _promote(self, node: Node, block_ids: list[int]) -> None:
        """A host node takes the caller's device blocks for its tokens (same KV); its host blocks go."""
        assert len(block_ids) == len(node.host_ids)
        self.pool.incref(block_ids)
        self.host.free(node.host_ids)
        self._host_cached -= len(block_ids)
        node.host_ids, node.block_ids = [], block_ids
        self._cached += len(block_ids)
        self._evictable += len(block_ids)  # host nodes are never locked

    def _to_host(self, node: Node) -> int:
        """Copy an unlocked device leaf's KV into host blocks (room made by the caller) and
        drop its device blocks; it stays in the tree, host-resident. Returns blocks freed."""
        k = len(node.block_ids)
        host_ids = self.host.allocate(k)
        self.host.save(self.pool, node.block_ids, host_ids)
        freed = self.pool.decref(node.block_ids)
        node.block_ids, node.host_ids = [], host_ids
        self._cached -= k
        self._evictable -= k
        self._host_cached += k
        self.evicted_to_host += k
        if self._host_heap is not None and not node.children:
            heapq.heappush(self._host_heap, (node.last_access, id(node), node))
        return freed

    def _host_room(self, need: int) -> bool:
        """Make ``need`` host blocks free by removing LRU host leaves. False if it cannot."""
        host = self.host
        if need > host.num_blocks:
            return False
        if host.num_free >= need:
            return True
        if self._host_heap is None:
            self._host_heap = [(n.last_access, id(n), n) for n in self.nodes() if n.host_ids and not n.children]
            heapq.heapify(self._host_heap)
        heap = self._host_heap
        while host.num_free < need and heap:
            _, _, node = heapq.heappop(heap)
            if node.parent is None or node.children or not node.host_ids:
                continue  # gone (with an ancestor) since it was pushed
            parent = node.parent
            self.host_evicted += len(node.host_ids)
            self._remove(node)
            if parent.host_ids and not parent.children:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return host.num_free >= need

    def _remove(self, node: Node) -> int:
        """Take ``node`` and its subtree (all unlocked) out of the tree, dropping the tree's
        device references and host blocks. Returns the device blocks that became free."""
        assert node.lock_ref == 0, "removal of a locked node"
        del node.parent.children[node.tokens[: self.block_size]]
        freed, stack = 0, [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            n.parent = None  # detached: a later lock() of it fails loudly
            if n.host_ids:
                self.host.free(n.host_ids)
                self._host_cached -= len(n.host_ids)
            else:
                freed += self.pool.decref(n.block_ids)
                self._cached -= len(n.block_ids)
                self._evictable -= len(n.block_ids)
        return freed

    def _evict(self, num_blocks: int | None, to_host: bool) -> int:
        """Evict LRU unlocked device leaves until ``num_blocks`` became free (None: all of
        them), to host if ``to_host`` and it has room, else out of the tree."""
        self._host_heap = None
        heap = []
        for root in self._roots.values():
            stack = [c for c in root.children.values() if not c.host_ids]
            while stack:
                node = stack.pop()
                stack.extend(c for c in node.children.values() if not c.host_ids)
                if self._is_device_leaf(node):
                    heap.append((node.last_access, id(node), node))  # id: nodes do not compare
        heapq.heapify(heap)
        freed = 0
        while heap and (num_blocks is None or freed < num_blocks):
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            if to_host and self._host_room(len(node.block_ids)):
                freed += self._to_host(node)
            else:
                freed += self._remove(node)
            if self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    # ---------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """Assert the tree's invariants (cheap enough to run when the engine is idle)."""
        bs = self.block_size
        seen: set[int] = set()
        host_seen: set[int] = set()
        evictable = 0
        for root in self._roots.values():
            assert root.is_root and root.parent is None and not root.tokens and not root.block_ids and not root.host_ids
            stack = [root]
            while stack:
                node = stack.pop()
                assert len(node.tokens) % bs == 0, f"node of {len(node.tokens)} tokens is not a block multiple"
                assert node.is_root or node.block_ids or node.host_ids, "empty non-root node"
                assert not (node.block_ids and node.host_ids), "a node both on the device and on host"
                assert len(node.block_ids or node.host_ids) == len(node.tokens) // bs, "block count != tokens / block_size"
                assert node.lock_ref >= sum(c.lock_ref for c in node.children.values()) >= 0, "lock_ref < children's"
                if node.host_ids:
                    assert self.host is not None, "a host-resident node without a host tier"
                    assert node.lock_ref == 0, "a locked host-resident node"
                    assert all(c.host_ids for c in node.children.values()), "a device node below a host node"
                    for h in node.host_ids:
                        assert h not in host_seen, f"host block {h} appears twice in the tree"
                        assert self.host.used[h], f"tree host block {h} is free in the host pool"
                        host_seen.add(h)
                elif node.lock_ref == 0:
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
        assert len(host_seen) == self._host_cached, f"host_blocks {self._host_cached} != {len(host_seen)} in the tree"
        if self.host is not None:
            self.host.check_integrity()
            used = {h for h, u in enumerate(self.host.used) if u}
            assert used == host_seen, (
                f"host pool blocks in use {sorted(used - host_seen)[:8]} belong to no host node"
            )


class NoPrefixCache:
    """The cache of an engine with prefix caching off: it never shares and never holds a block.

    Same interface as ``RadixCache``: ``match`` finds nothing, ``insert`` adopts nothing
    (the caller's references are the only ones, so blocks go back to the pool when it
    drops them), locks are no-ops on one root that is never evicted. No host tier.
    """

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

    def check_integrity(self) -> None:
        assert not self._root.children and not self._root.lock_ref, "the no-sharing cache grew a node"
