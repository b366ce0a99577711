"""BlockPool: the paged KV memory.

One preallocated tensor holds every block of every layer:
``kv[layer, 0|1 (k|v), block, offset, kv_head, head_dim]``. A token's *slot* is
``block * block_size + offset``. Blocks are handed out from a free list and
carry a reference count; a block returns to the free list when its count drops
to zero. Invariant after every public call (see ``check_integrity``):
free + referenced == total and no block is both.
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

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        referenced = {b for b, c in enumerate(self.ref_counts) if c > 0}
        assert all(c >= 0 for c in self.ref_counts), "negative ref count"
        assert not (free & referenced), f"blocks both free and referenced: {sorted(free & referenced)[:8]}"
        assert len(free) + len(referenced) == self.num_blocks, (
            f"free {len(free)} + referenced {len(referenced)} != total {self.num_blocks}"
        )
