"""KVManager: the one owner of every KV block's lifetime.

(Past ~400 lines on purpose: every owner's rules - sequences, retained turns, pins, the
tiers, namespaces, moving windows - and the integrity proof that checks them together
share one set of reference and lock counts; split apart, each part would reach into the others'.)

Everything that holds KV memory holds it through this manager; nothing outside it
and ``BlockPool`` touches a reference count, a radix lock or the pool tensor.

Owners and what each holds
--------------------------
* the **radix tree** (a ``PrefixCache``: ``RadixCache``, ``HiRadixCache`` with a host tier,
  ``NoPrefixCache`` when prefix caching is off):
  one pool reference on every block it caches;
* a **sequence** (a request, waiting or running): its ``BlockTable`` (``seq.kv``,
  chatkv.kvcache.types): ``blocks`` (one pool reference per entry) and ``lock_node`` (one lock
  on the path of the cached prefix it attached), filled by ``attach``, grown by ``reserve``,
  cut by ``trim`` and emptied by ``release``. The sequence owns the record; this manager
  reads its token ids and namespace and writes nothing of it but that table (and takes over
  ``seq.prefix``, a ``RetainedKV`` handed to it while it waits);
* a **RetainedKV**: the KV a finished turn leaves for the conversation's next turn:
  ``node`` (one lock on the history's full blocks) and ``tail_block`` (one pool
  reference on the partial last block). Issued by ``release(retain=True)`` or
  ``import_kv``; ended by ``attach`` (which takes it over) or ``drop``;
* a **pin**: one lock on a shared prefix (a system prompt now, documents next),
  counted per token run by ``pin``/``unpin``;
* **chunk KV** (``chunks``, chatkv.rag.chunk_kv, made on first use by chatkv.rag.placement):
  retrieved chunks' KV in a canonical frame, host-memory tensors in an LRU of their own
  (evictable; on disk too). It holds no pool block: placing a chunk copies its rows into a
  request's blocks, whose KV then lives in the conversation's private namespace.

Contracts
---------
* Every method completes, or raises leaving every count as it found it.
* ``check_integrity(sequences, handles)`` proves that the pool's references and the
  tree's locks are exactly the tree's own plus those of the sequences, handles and
  pins given, and that every handle issued and not ended is among ``handles``.
* KV leaves and enters the pool as per-layer tensors ``[tokens, kv_heads, head_dim]``
  (``export_kv``/``import_kv``), independent of the block size.
* ``make_room`` frees blocks by evicting unlocked cached blocks. What eviction could not
  free is its result, ``shortfall`` (the most blocks found missing since the caller last
  zeroed it): the scheduler returns it as "needs N blocks" and the engine spills idle
  conversations between two scheduling passes, never from inside ``reserve``. Only a caller
  that spills for itself (the session layer around its own restore and window move) sets
  ``on_pressure`` for the length of its call: asked after eviction, then eviction again.

Tiers
-----
With a ``HostPool`` (``host``; only with prefix caching) evicted cached blocks move to
host memory instead of away (see ``HiRadixCache``): device -> host -> disk (the session
layer's snapshots). A lookup that continues into host-resident nodes copies them back
into device blocks (``attach``, ``import_kv``; room made first, else only the device
part is used) and records how many tokens came from host (the table's ``num_host``,
``RetainedKV.host_len``). ``offload`` moves an ended handle's path to host eagerly.
Without a host pool everything behaves as if the tier did not exist.

Recurrent state
---------------
A hybrid model (linear-attention layers with a per-sequence state, chatkv.model.qwen3_5) gives
a ``StateCache`` (``states``, chatkv.kvcache.states): ``attach`` then uses a cached prefix only up
to a state checkpoint of exactly that prefix (else nothing of it) and gives the table its state
slots; ``release`` turns its block-boundary state into a checkpoint of the blocks it inserts.
Retained KV across turns, imports and window moves carry no state: they are refused.

Namespaces
----------
Every tree lookup and insert is in a radix namespace: a sequence's ``namespace``, or
the manager's default ``namespace`` when that is None. Namespaces never share nodes;
``drop_namespace`` discards one's unlocked KV.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable, Iterable

import torch

from chatkv.errors import OutOfBlocks, UnsupportedModel
from chatkv.kvcache.block_pool import BlockPool
from chatkv.kvcache.hiradix import HiRadixCache
from chatkv.kvcache.host_pool import HostPool
from chatkv.kvcache.prefix_cache import MatchResult, Node, NoPrefixCache, PrefixCache
from chatkv.kvcache.radix import RadixCache
from chatkv.kvcache.states import StateCache
from chatkv.kvcache.types import BlockTable, RetainedKV, SequenceKV
from chatkv.storage.paths import LOCAL_USER


class KVManager:
    def __init__(
        self,
        pool: BlockPool,
        namespace: Hashable,
        prefix_caching: bool = True,
        host: HostPool | None = None,
        states: StateCache | None = None,
    ):
        """``host``: the host-memory tier (None: no tier; ignored without prefix caching).
        ``states``: a hybrid model's recurrent-state slots (None: a model of attention only)."""
        self.pool = pool
        self.states = states
        self.block_size = pool.block_size
        self.host = host if prefix_caching else None
        self.cache: PrefixCache = (
            NoPrefixCache(pool)
            if not prefix_caching
            else RadixCache(pool)
            if self.host is None
            else HiRadixCache(pool, self.host)
        )
        self.namespace = namespace
        self.sharing = prefix_caching
        self.on_pressure: Callable[[int], None] | None = None  # called with the blocks still missing
        self.shortfall = 0  # the most blocks make_room found missing after eviction (its caller zeroes it)
        self._pins: dict[tuple[int, ...], list] = {}  # token run -> [locked node, pin count]
        self._live: set[RetainedKV] = set()  # handles issued and not yet ended
        self.chunks = None  # the chunk KV owner (chatkv.rag.chunk_kv.ChunkKV), once a turn placed sources

    # -- lookups ------------------------------------------------------------------

    def cached_len(self, token_ids: list[int], namespace: Hashable | None = None) -> int:
        """Tokens of ``token_ids`` whose KV is in the tree, on the device or on host, leaving at
        least one to compute (``namespace`` None: the default one)."""
        ns = self._ns(namespace)
        limit = len(token_ids) - 1
        if self.states is not None:
            limit, _ = self._state_point(ns, token_ids, limit)
        m = self.cache.match(ns, token_ids, max_tokens=limit)
        return m.num_tokens + m.host_tokens

    def _state_point(self, namespace: Hashable, token_ids: list[int], limit: int) -> tuple[int, int | None]:
        """A hybrid model's usable prefix of ``token_ids`` (at most ``limit``): the longest state
        checkpoint whose blocks are all still in the tree (tokens, its slot), else (0, None)."""
        for n, slot in self.states.candidates(namespace, token_ids, limit):
            m = self.cache.match(namespace, token_ids, n)
            if m.num_tokens + m.host_tokens == n:
                return n, slot
        return 0, None

    def _refuse_state(self, what: str) -> None:
        if self.states is not None:
            raise UnsupportedModel(
                f"{what} is not supported for a hybrid model (linear-attention layers with a recurrent state): "
                "its KV alone does not resume a conversation"
            )

    def user_namespace(self, user: str | None) -> Hashable | None:
        """The radix namespace of a user's KV (``chatkv serve``'s API keys are users): None (the
        default one) for the local user (None or "local"), else one of the user's own below the
        default's salt, so two users never share a node (nor the timing of a cache hit)."""
        return None if user is None or user == LOCAL_USER else (self.namespace, "user", user)

    def _ns(self, namespace: Hashable | None) -> Hashable:
        return self.namespace if namespace is None else namespace

    def _match(self, namespace: Hashable, token_ids: list[int], max_tokens: int) -> tuple[MatchResult, int]:
        """``cache.match``, with the part of the match on host copied back to the device as far
        as ``make_room`` finds blocks for it. Returns (the match, tokens copied back). Raises
        only what ``on_pressure`` raises, having changed no reference or lock."""
        m = self.cache.match(namespace, token_ids, max_tokens)
        if not m.host_tokens:
            return m, 0
        self.cache.lock(m.node)  # the device part must stay while room is made for the rest
        try:
            self.make_room(m.host_tokens // self.block_size)
        finally:
            self.cache.unlock(m.node)
        m = self.cache.match(namespace, token_ids, max_tokens)  # room-making may have dropped some of it from host
        n = min(m.host_tokens // self.block_size, self.pool.num_free)
        if n == 0:
            return m, 0
        return self.cache.load(m, self.pool.allocate(n)), n * self.block_size

    # -- sequences ----------------------------------------------------------------

    def attach(self, seq: SequenceKV) -> BlockTable:
        """Fill ``seq.kv`` (empty) with the cached prefix of its tokens in its namespace
        (locked, referenced; a part on host is copied back first, as far as room allows) and,
        when its handed ``seq.prefix`` continues exactly where that prefix ends, that handle's
        own tail block; return the table. The handle is ended either way. Before the first
        admission (``num_cached < 0``) the tokens that came from host are added to the table's
        ``num_host``. Raises only what ``on_pressure`` raises, with ``seq`` unchanged (without a
        host tier it cannot fail)."""
        t = seq.kv
        assert not t.blocks and t.lock_node is None, "attach of a sequence that holds KV"
        ns = self._ns(seq.namespace)
        limit, state = len(seq.token_ids) - 1, None
        if self.states is not None:  # only up to a state checkpoint of exactly that prefix
            limit, state = self._state_point(ns, seq.token_ids, limit)
        m, loaded = self._match(ns, seq.token_ids, limit)
        if state is not None and m.num_tokens != limit:  # not all of it came back from host: from token 0
            m, loaded, state = self.cache.match(ns, seq.token_ids, 0), 0, None
        self.cache.lock(m.node)
        self.pool.incref(m.block_ids)
        t.lock_node, t.blocks, t.num_computed = m.node, list(m.block_ids), m.num_tokens
        p = seq.prefix
        if seq.num_cached < 0:
            t.num_host += loaded + (min(p.host_len, m.num_tokens) if p is not None else 0)
        continues = p is not None and (m.node is p.node if p.node is not None else m.num_tokens == 0)
        if self.states is not None:
            self.states.attach(t, ns, seq.token_ids, m.num_tokens, state)
        elif (
            continues
            and p.tail_block is not None
            and m.num_tokens == p.kv_len - p.tail_len < p.kv_len < len(seq.token_ids)
        ):
            t.blocks.append(p.tail_block)  # the conversation's own partial block continues its history
            t.num_computed = p.kv_len
            p.tail_block = None
        self.drop(p)
        seq.prefix = None
        return t

    def reserve(self, t: BlockTable, num_tokens: int) -> bool:
        """Make a request's table ``t`` cover ``num_computed + num_tokens`` tokens; False if
        blocks lack. Raises only what ``on_pressure`` raises, with ``t`` unchanged."""
        need = -(-(t.num_computed + num_tokens) // self.block_size) - len(t.blocks)
        if need <= 0:
            return True
        if not self.make_room(need):
            return False
        t.blocks.extend(self.pool.allocate(need))
        return True

    def trim(self, t: BlockTable) -> None:
        """Give back the blocks of a request's table ``t`` past its ``num_computed`` tokens (they
        held only rejected speculative tokens' KV; the request's own, never shared)."""
        keep = -(-t.num_computed // self.block_size)
        if len(t.blocks) > keep:
            self.pool.decref(t.blocks[keep:])
            del t.blocks[keep:]

    def release(self, seq: SequenceKV, retain: bool = False) -> RetainedKV | None:
        """End everything ``seq`` holds: its computed full blocks go into the tree first (so a
        later request hits them), then its references and lock are dropped, leaving ``seq.kv``
        empty (its ``num_host`` kept: a count of its first admission). With ``retain`` (and
        sharing on) returns a RetainedKV of its computed tokens for the next turn."""
        self.drop(seq.prefix)
        seq.prefix = None
        t = seq.kv
        bs = self.block_size
        computed = t.num_computed
        full = computed // bs
        table = t.blocks
        node = self.cache.insert(self._ns(seq.namespace), seq.token_ids[: full * bs], table[:full]) if full else None
        if self.states is not None:
            self.states.release(t, self._ns(seq.namespace), seq.token_ids, full * bs)
            retain = False  # a next turn resumes from the checkpoint just taken, not from retained KV
        kept = None
        if retain and self.sharing and computed:
            if node is not None:
                self.cache.lock(node)
            tail_len = computed - full * bs
            tail = table[full] if tail_len else None
            kept = RetainedKV(node, tail, tail_len, computed)
            self._live.add(kept)
            if tail is not None:
                table = table[:full] + table[full + 1 :]
        if t.lock_node is not None:
            self.cache.unlock(t.lock_node)
            t.lock_node = None
        self.pool.decref(table)
        t.blocks = []
        t.num_computed = 0
        return kept

    # -- retained KV ----------------------------------------------------------------

    def drop(self, kept: RetainedKV | None) -> None:
        """End a RetainedKV: unlock its path and drop its tail block (None: nothing to do)."""
        if kept is None:
            return
        if kept.node is not None:
            self.cache.unlock(kept.node)
            kept.node = None
        if kept.tail_block is not None:
            self.pool.decref([kept.tail_block])
            kept.tail_block = None
        self._live.discard(kept)

    def offload(self, kept: RetainedKV | None) -> int:
        """End ``kept`` (as ``drop``) and move its path, from its last node upward while each node
        is unlocked and all below it is on host, to the host tier now, freeing device blocks
        (its partial tail block is dropped: under a block of tokens, recomputed). Returns the
        device blocks freed. Without a host tier it is ``drop``: the path stays, evictable."""
        if kept is None:
            return 0
        node = kept.node
        free = self.pool.num_free
        self.drop(kept)
        if node is not None:
            self.cache.offload(node)
        return self.pool.num_free - free

    def drop_namespace(self, namespace: Hashable) -> int:
        """Discard every unlocked node of ``namespace``, on the device and on host (KV nothing will
        match again), freeing their blocks instead of moving them down a tier. Returns the
        device blocks freed."""
        if self.states is not None:
            self.states.drop_namespace(namespace)
        return self.cache.drop_namespace(namespace)

    def export_kv(self, kept: RetainedKV, start: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer keys and values ``[kv_len - start, kv_heads, row_dim]`` of the tokens
        ``start:kv_len`` of a RetainedKV, in the pool's stored form (quantised rows keep their
        scales; copies; only the blocks holding them are read)."""
        assert 0 <= start <= kept.kv_len, f"export from token {start} of {kept.kv_len}"
        blocks = self._path_blocks(kept.node)
        assert len(blocks) * self.block_size == kept.kv_len - kept.tail_len, "retained path and length disagree"
        if kept.tail_block is not None:
            blocks.append(kept.tail_block)
        first = start // self.block_size
        kv = self.pool.read(blocks[first:], kept.kv_len - first * self.block_size)[
            :, :, start - first * self.block_size :
        ]
        return [kv[i, 0] for i in range(kv.shape[0])], [kv[i, 1] for i in range(kv.shape[0])]

    def import_kv(
        self,
        token_ids: list[int],
        num_tokens: int,
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        namespace: Hashable | None = None,
    ) -> RetainedKV:
        """Put the KV of ``token_ids[:num_tokens]`` (per-layer tensors, at least that long) into
        blocks of ``namespace`` (None: the default), reusing whatever of it the tree already has
        (a part on host is copied back, counted in ``host_len``); return it as a RetainedKV.
        Raises OutOfBlocks (holding nothing new; blocks copied back from host stay cached)
        when there is no room even after ``make_room``."""
        assert self.sharing, "import_kv needs prefix caching: imported blocks live in the tree"
        self._refuse_state("restoring saved KV")
        bs = self.block_size
        ns = self._ns(namespace)
        m, loaded = self._match(ns, token_ids, num_tokens)
        start = m.num_tokens
        need = -(-num_tokens // bs) - start // bs
        self.cache.lock(m.node)  # the part already in memory must stay while we add the rest
        try:
            if not self.make_room(need):
                raise OutOfBlocks(f"no room for {need} KV blocks to restore {num_tokens} tokens")
            new = self.pool.allocate(need)
        finally:
            self.cache.unlock(m.node)
        try:
            self.pool.write(new, 0, [x[start:num_tokens] for x in k], [x[start:num_tokens] for x in v])
        except BaseException:
            self.pool.decref(new)
            raise
        full = num_tokens // bs
        n_new_full = full - start // bs
        node = None
        if full:
            node = self.cache.insert(ns, token_ids[: full * bs], m.block_ids + new[:n_new_full])
            self.cache.lock(node)
        self.pool.decref(new[:n_new_full])  # the tree holds those now
        tail_len = num_tokens - full * bs
        kept = RetainedKV(node, new[-1] if tail_len else None, tail_len, num_tokens, host_len=loaded)
        self._live.add(kept)
        return kept

    def slide(
        self,
        kept: RetainedKV,
        tokens: list[int],
        sink: int,
        drop: int,
        namespace: Hashable,
        shift: Callable[[list[int], int], None],
        old_namespace: Hashable | None = None,
    ) -> RetainedKV | None:
        """Move a conversation's attention-sink window: of the KV in ``kept``, keep tokens
        ``[0, sink)`` as they are and ``[sink + drop, kv_len)`` with their keys moved ``drop``
        positions back (``shift(blocks, delta)`` re-rotates keys in place); the blocks of the
        dropped tokens are released. Returns the kept KV as a RetainedKV of ``tokens`` (the new
        context, ``old[:sink] + old[sink + drop:]``) in radix ``namespace`` (a private one: this
        KV matches no from-scratch computation), or None if none is kept. ``sink`` and ``drop``
        are whole blocks. ``kept`` is ended. ``old_namespace`` (the previous window's private
        namespace) is dropped from the tree: nothing will match it again. A moved block that
        someone else still references (the shared tree, the first time) is copied first.
        Raises OutOfBlocks (with ``kept`` ended and nothing else held) when a copy finds no room."""
        self._refuse_state("moving an attention-sink window")
        bs = self.block_size
        assert sink % bs == 0 and drop % bs == 0, "a window moves by whole blocks"
        blocks = self._path_blocks(kept.node) + ([kept.tail_block] if kept.tail_block is not None else [])
        n = kept.kv_len
        if n > sink + drop:
            head, moved, new_len = blocks[: sink // bs], blocks[(sink + drop) // bs :], n - drop
        else:  # no KV after the dropped part: keep the sink's whole blocks only
            new_len = min(n, sink) // bs * bs
            head, moved = blocks[: new_len // bs], []
        assert new_len <= len(tokens), "the new context is shorter than the KV kept"
        self.pool.incref(head + moved)  # ours while the old owners let go
        self.drop(kept)
        if old_namespace is not None:
            self.drop_namespace(old_namespace)
        table = head + moved
        try:
            # copy-on-write: a block another owner still holds (the shared tree, the first time)
            # is copied, so keys another owner reads are never rotated and no block sits in two
            # namespaces; later moves find the window's blocks its own and rotate them in place
            shared = [i for i, b in enumerate(table) if self.pool.ref_counts[b] > 1]
            if shared:
                if not self.make_room(len(shared)):
                    raise OutOfBlocks(f"no room to copy {len(shared)} KV blocks of a moving window")
                fresh = self.pool.allocate(len(shared))
                self.pool.copy_blocks([table[i] for i in shared], fresh)
                self.pool.decref([table[i] for i in shared])
                for i, b in zip(shared, fresh):
                    table[i] = b
            shift(table[len(head) :], -drop)
        except BaseException:
            self.pool.decref(table)
            raise
        if new_len == 0:
            self.pool.decref(table)
            return None
        full = new_len // bs
        node = None
        if full:
            node = self.cache.insert(namespace, tokens[: full * bs], table[:full])
            self.cache.lock(node)
        self.pool.decref(table[:full])  # the tree holds those now
        tail_len = new_len - full * bs
        new = RetainedKV(node, table[full] if tail_len else None, tail_len, new_len)
        self._live.add(new)
        return new

    # -- pins ---------------------------------------------------------------------

    def pin(self, token_ids: list[int], namespace: Hashable | None = None) -> tuple | None:
        """Keep the block-aligned part of ``token_ids`` (a shared prefix) in ``namespace`` (None:
        the default) from eviction while pinned. Returns the pin's key for ``unpin``, or None if
        none of it is cached in full."""
        n = len(token_ids) // self.block_size * self.block_size
        if n == 0 or not self.sharing:
            return None
        ns = self._ns(namespace)
        key = tuple(token_ids[:n]) if namespace is None else (ns, tuple(token_ids[:n]))
        if key not in self._pins:
            m = self.cache.match(ns, key if namespace is None else key[1])
            if m.num_tokens < n:
                return None
            self.cache.lock(m.node)
            self._pins[key] = [m.node, 0]
        self._pins[key][1] += 1
        return key

    def unpin(self, key: tuple[int, ...] | None) -> None:
        if key is None:
            return
        entry = self._pins[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.cache.unlock(entry[0])
            del self._pins[key]

    # -- memory ---------------------------------------------------------------------

    def make_room(self, need: int) -> bool:
        """Free blocks until ``need`` are free: evict cached blocks (then, when set, ask
        ``on_pressure`` and evict again). True on success; else ``shortfall`` holds at least
        the blocks that eviction could not free."""
        if self.pool.num_free < need:
            self.cache.evict(need - self.pool.num_free)
        if self.pool.num_free < need:
            self.shortfall = max(self.shortfall, need - self.pool.num_free)
        if self.pool.num_free < need and self.on_pressure is not None:
            self.on_pressure(need - self.pool.num_free)
            self.cache.evict(need - self.pool.num_free)
        return self.pool.num_free >= need

    def clear(self) -> None:
        """Release every unlocked cached block and every state checkpoint (shutdown)."""
        if self.states is not None:
            self.states.clear()
        self.cache.clear()

    def stats(self) -> dict[str, int]:
        """Block and tree counts, for status lines and metrics. With a host tier also
        ``host_blocks_total``/``host_blocks_used`` and the lifetime block counters
        ``evicted_to_host`` (device -> host), ``host_hits`` (host -> device) and
        ``host_evicted`` (dropped from host for room)."""
        out = {
            "blocks_total": self.pool.num_blocks,
            "blocks_free": self.pool.num_free,
            "blocks_cached": self.cache.cached_blocks,
            "blocks_evictable": self.cache.evictable_blocks,
            "tree_nodes": len(self.cache.nodes()),
            "pins": len(self._pins),
            "retained": len(self._live),
        }
        if self.chunks is not None:
            out.update(self.chunks.stats())
        if self.states is not None:
            out.update(self.states.stats())
        if self.host is not None:
            out.update(host_blocks_total=self.host.num_blocks, host_blocks_used=self.host.num_used)
            out.update(self.cache.tier_stats())
        return out

    # -- integrity ------------------------------------------------------------------

    def check_integrity(self, sequences: Iterable[SequenceKV], handles: Iterable[RetainedKV | None]) -> None:
        """Assert the pool and tree invariants, and that the references and locks held are
        exactly those of the tree, ``sequences``, ``handles`` and the pins, and the host
        pool's blocks in use exactly those of host-resident nodes (call when idle)."""
        self.pool.check_integrity()
        self.cache.check_integrity()
        sequences = list(sequences)
        if self.states is not None:
            self.states.check_integrity([s.kv for s in sequences])
        handles = [h for h in handles if h is not None]
        owned = {id(h) for h in handles}
        assert len(owned) == len(handles), "one RetainedKV held twice"
        orphans = [h for h in self._live if id(h) not in owned]
        assert not orphans, f"{len(orphans)} retained KV handle(s) held by no live session or request"
        unknown = [h for h in handles if h not in self._live]
        assert not unknown, "a retained KV handle was ended but is still held"
        nodes = self.cache.nodes(with_roots=True)
        refs: Counter[int] = Counter(b for n in nodes for b in n.block_ids)
        locks: Counter[int] = Counter()
        for s in sequences:
            refs.update(s.kv.blocks)
            if s.kv.lock_node is not None:
                locks[id(s.kv.lock_node)] += 1
        for h in handles:
            if h.tail_block is not None:
                refs[h.tail_block] += 1
            if h.node is not None:
                locks[id(h.node)] += 1
        for node, _ in self._pins.values():
            locks[id(node)] += 1
        for b in range(self.pool.num_blocks):
            assert self.pool.ref_counts[b] == refs[b], (
                f"block {b} has {self.pool.ref_counts[b]} references, its owners account for {refs[b]}"
            )
        subtree: Counter[int] = Counter()
        for node in reversed(nodes):  # children before parents
            subtree[id(node)] += locks[id(node)]
            assert node.lock_ref == subtree[id(node)], (
                f"a radix node has {node.lock_ref} locks, its owners account for {subtree[id(node)]}"
            )
            if node.parent is not None:
                subtree[id(node.parent)] += subtree[id(node)]

    def _path_blocks(self, node: Node | None) -> list[int]:
        parts: list[list[int]] = []
        while node is not None and not node.is_root:
            parts.append(node.block_ids)
            node = node.parent
        return [b for part in reversed(parts) for b in part]
