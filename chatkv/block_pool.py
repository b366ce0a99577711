"""BlockPool: the paged KV memory.

One preallocated tensor holds every block of every layer:
``kv[layer, 0|1 (k|v), block, offset, kv_head, head_dim]``. A token's *slot* is
``block * block_size + offset``. Blocks are handed out from a free list and
carry a reference count; a block returns to the free list when its count drops
to zero. Invariant after every public call (see ``check_integrity``):
free + referenced == total and no block is both.

Only this module and the attention kernels (which get ``kv`` from the model
runner) know the tensor's layout: everyone else moves KV in and out with
``read`` and ``write``, as per-token ``[layers, 2, tokens, kv_heads, head_dim]``.
"""

from __future__ import annotations

from collections import deque

import torch

from chatkv.errors import OutOfBlocks


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int = 0,
        num_kv_heads: int = 0,
        head_dim: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        # with num_layers == 0 the pool only manages ids (used by cache-only tests)
        self.kv = torch.zeros(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv.shape[4]

    @property
    def head_dim(self) -> int:
        return self.kv.shape[5]

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with ref count 1. Raises OutOfBlocks if fewer are free."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, only {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for b in ids:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def decref(self, ids: list[int]) -> int:
        """Drop one reference from each block; returns how many blocks became free."""
        freed = 0
        for b in ids:
            assert self.ref_counts[b] > 0, f"decref of free block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
                freed += 1
        return freed

    # -- moving KV in and out (layout independent) ----------------------------

    def read(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """KV of the first ``num_tokens`` tokens held in ``blocks`` (in order), as one new
        tensor ``[layers, 2, num_tokens, kv_heads, head_dim]`` (one gather copy)."""
        assert num_tokens <= len(blocks) * self.block_size, "more tokens than the blocks hold"
        return self.kv[:, :, blocks].flatten(2, 3)[:, :, :num_tokens]

    def write(self, blocks: list[int], first: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Store per-layer keys and values ``[tokens, kv_heads, head_dim]`` into consecutive slots of
        ``blocks``, starting at offset ``first`` of ``blocks[0]`` (converted to the pool's dtype)."""
        n = k[0].shape[0] if k else 0
        assert len(k) == len(v) == self.kv.shape[0], "one key and one value tensor per layer"
        assert first + n <= len(blocks) * self.block_size, "more tokens than the blocks hold"
        bs = self.block_size
        ids = torch.tensor(blocks, dtype=torch.long)  # long even when empty (nothing to write)
        slots = (ids[:, None] * bs + torch.arange(bs)).flatten()[first : first + n].to(self.kv.device)
        flat = self.kv.flatten(2, 3)  # [layers, 2, slots, kv_heads, head_dim], a view
        for i in range(len(k)):
            flat[i, 0].index_copy_(0, slots, k[i].to(flat.dtype))
            flat[i, 1].index_copy_(0, slots, v[i].to(flat.dtype))

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy the KV of blocks ``src`` into blocks ``dst`` (pairwise; copy-on-write)."""
        assert len(src) == len(dst)
        if src:
            dev = self.kv.device
            self.kv.index_copy_(2, torch.tensor(dst, device=dev), self.kv.index_select(2, torch.tensor(src, device=dev)))

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        referenced = {b for b, c in enumerate(self.ref_counts) if c > 0}
        assert all(c >= 0 for c in self.ref_counts), "negative ref count"
        assert not (free & referenced), f"blocks both free and referenced: {sorted(free & referenced)[:8]}"
        assert len(free) + len(referenced) == self.num_blocks, (
            f"free {len(free)} + referenced {len(referenced)} != total {self.num_blocks}"
        )
