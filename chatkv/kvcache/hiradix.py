"""HiRadixCache: the radix cache with a host-memory tier below the device (SGLang's
HiRadixCache over its RadixCache).

Given a ``HostPool``, a node is either *device-resident* (``block_ids``) or *host-resident*
(``host_ids``, its KV in host memory). The device-resident nodes form a rooted,
prefix-closed subtree: a host node's descendants are all on host, and host nodes are never
locked. ``evict`` takes LRU unlocked *device leaves* (device nodes whose children are all
on host), copies their KV to host blocks and keeps them in the tree as host nodes; to make
room on host it first removes LRU host leaves (their KV survives only in disk snapshots,
if any). ``match`` reports the device hit as the plain tree does plus how far the match
continues on host; ``load`` copies such a continuation back into device blocks; ``insert``
of tokens a host node holds promotes it with the caller's blocks. ``offload`` moves a path
to host eagerly. The tree owns every host block of its host nodes (``HostPool`` ownership
is a flag).

Everything else (the walk, splits, locks, LRU order, namespaces) is ``RadixCache``'s; this
class adds the tier through its hooks and keeps its own counters.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from chatkv.kvcache.block_pool import BlockPool
from chatkv.kvcache.host_pool import HostPool
from chatkv.kvcache.prefix_cache import MatchResult, Node
from chatkv.kvcache.radix import RadixCache


class HiRadixCache(RadixCache):
    def __init__(self, pool: BlockPool, host: HostPool) -> None:
        super().__init__(pool)
        self.host = host
        self._host_cached = 0  # host blocks held by the tree
        self._host_heap: list | None = None  # LRU host leaves, built lazily within one evict/offload
        # lifetime counters, in blocks
        self.evicted_to_host = 0  # device blocks whose KV was copied to host by evict/offload
        self.host_hits = 0  # host blocks copied back to the device by load
        self.host_evicted = 0  # host blocks dropped to make room on host (LRU)

    @property
    def host_blocks(self) -> int:
        """Host blocks held by host-resident nodes."""
        return self._host_cached

    def tier_stats(self) -> dict[str, int]:
        return {"evicted_to_host": self.evicted_to_host, "host_hits": self.host_hits, "host_evicted": self.host_evicted}

    # ------------------------------------------------------------------ the tier
    def load(self, m: MatchResult, block_ids: list[int]) -> MatchResult:
        """Copy the first ``len(block_ids)`` blocks of ``m``'s host continuation into
        ``block_ids`` (freshly allocated: the tree takes over their one reference); those nodes
        become device-resident again, their host blocks freed. ``m`` must be a match made
        since the last change to the tree. Returns ``m`` extended by the loaded blocks."""
        assert len(block_ids) * self.block_size <= m.host_tokens
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
        assert not node.host_ids, "lock of a host-resident node (load it back first)"
        super().lock(node)

    def evict(self, num_blocks: int) -> int:
        """As ``RadixCache.evict``, from unlocked device leaves, each to host (kept in the tree,
        host-resident) when the host tier can hold it, else out of the tree with its host
        descendants."""
        if num_blocks <= 0:
            return 0
        self._host_heap = None
        return self._evict(num_blocks, self._spill)

    def offload(self, node: Node) -> int:
        """Move ``node``, then each ancestor, to host while it is an unlocked device leaf and
        the host tier can hold it (making room there by dropping LRU host leaves). Returns
        the device blocks that became free."""
        self._host_heap = None
        freed = 0
        while self._is_leaf(node) and node.parent is not None:
            parent = node.parent
            if not self._host_room(len(node.block_ids)):
                break
            freed += self._to_host(node)
            node = parent
        return freed

    def clear(self) -> None:
        """Release every unlocked node and every host-resident one (shutdown). Locked paths stay."""
        self._host_heap = None
        super().clear()
        for node in [n for n in self.nodes() if n.host_ids and n.parent is not None]:
            if node.parent is not None:  # not already gone with a host ancestor
                self._remove(node)

    # ---------------------------------------------------------- RadixCache's hooks
    def _result(self, root: Node, path: list[Node], pos: int) -> MatchResult:
        node, blocks = root, []
        for p in path:
            if p.host_ids:  # prefix closure: everything below is on host too
                break
            node = p
            blocks.extend(p.block_ids)
        on_device = len(blocks) * self.block_size
        host_node = path[-1] if pos > on_device else None
        return MatchResult(node, blocks, on_device, host_node, pos - on_device)

    def _cover(self, path: list[Node], block_ids: Sequence[int]) -> None:
        """Host nodes on an insert's path are promoted with the caller's blocks (same KV)."""
        first, bs = 0, self.block_size
        for p in path:
            k = len(p.tokens) // bs
            if p.host_ids:
                self._promote(p, list(block_ids[first : first + k]))
            first += k

    def _split(self, node: Node, k: int) -> Node:
        host_ids = node.host_ids
        upper = super()._split(node, k)
        upper.host_ids, node.host_ids = host_ids[:k], host_ids[k:]  # the upper half inherits residency
        return upper

    def _is_leaf(self, node: Node) -> bool:
        """A device leaf: an unlocked, non-root, device-resident node whose children are all on host."""
        return (
            not node.is_root
            and not node.host_ids
            and node.lock_ref == 0
            and all(c.host_ids for c in node.children.values())
        )

    def _release_kv(self, node: Node) -> int:
        if not node.host_ids:
            return super()._release_kv(node)
        self.host.free(node.host_ids)
        self._host_cached -= len(node.host_ids)
        return 0

    def _check_node(self, node: Node) -> bool:
        if not node.host_ids:
            return True
        assert not node.block_ids, "a node both on the device and on host"
        assert len(node.host_ids) == len(node.tokens) // self.block_size, "block count != tokens / block_size"
        assert node.lock_ref == 0, "a locked host-resident node"
        assert all(c.host_ids for c in node.children.values()), "a device node below a host node"
        for h in node.host_ids:
            assert self.host.used[h], f"tree host block {h} is free in the host pool"
        return False

    # ---------------------------------------------------------------- internals
    def _spill(self, node: Node) -> int:
        """Evict one device leaf: to host if it can hold it, else out of the tree."""
        if self._host_room(len(node.block_ids)):
            return self._to_host(node)
        return self._remove(node)

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

    # ---------------------------------------------------------------- integrity
    def check_integrity(self) -> None:
        """``RadixCache``'s invariants, and the tier's: no host block twice, the host-block
        count, and the host pool's blocks in use exactly those of host-resident nodes."""
        super().check_integrity()
        host_seen: set[int] = set()
        for node in self.nodes():
            for h in node.host_ids:
                assert h not in host_seen, f"host block {h} appears twice in the tree"
                host_seen.add(h)
        assert len(host_seen) == self._host_cached, f"host_blocks {self._host_cached} != {len(host_seen)} in the tree"
        self.host.check_integrity()
        used = {h for h, u in enumerate(self.host.used) if u}
        assert used == host_seen, f"host pool blocks in use {sorted(used - host_seen)[:8]} belong to no host node"
