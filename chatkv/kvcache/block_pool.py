"""BlockPool: the paged KV memory.

One preallocated tensor holds every block of every layer:
``kv[layer, 0|1 (k|v), block, offset, kv_head, head_dim]``. A token's *slot* is
``block * block_size + offset``. Blocks are handed out from a free list and
carry a reference count; a block returns to the free list when its count drops
to zero. Invariant after every public call (see ``check_integrity``):
free + referenced == total and no block is both.

Only this module and the attention kernels (which get ``kv`` from the model
runner) know the tensor's layout: everyone else moves KV in and out with
``read`` and ``write``, as per-token ``[layers, 2, tokens, kv_heads, row_dim]``.

Quantised KV (``quant`` = ``int8`` or ``fp8_e4m3``, chatkv.kernels.kv_quant): the tensor
holds bytes, and a row (one token, one head) is ``head_dim`` quantised values followed by
their float32 scale, so ``row_dim = head_dim + 4``; unquantised, ``row_dim = head_dim``.
``read``, ``write``, ``copy_blocks`` and the host tier move rows as they are, so the
quantised form and its scales travel together wherever KV goes.
"""

from __future__ import annotations

import sys
from collections import deque

import torch

from chatkv.errors import OutOfBlocks
from chatkv.kernels import kv_quant

_FRESH_BYTES = 64 * 2**20  # above glibc's largest mmap threshold: always a fresh, zero-filled mapping


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
        quant: str | None = None,
    ) -> None:
        """``dtype``: the KV's float dtype; with ``quant`` the pool stores quantised rows (uint8)
        instead, which attention dequantises to its queries' dtype."""
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.quant = quant
        self._head_dim = head_dim
        row = kv_quant.row_width(quant, head_dim) if num_layers else head_dim
        # with num_layers == 0 the pool only manages ids (used by cache-only tests)
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, row)
        storage = kv_quant.STORAGE if quant else dtype
        # On Linux, glibc serves an allocation above its largest mmap threshold (32 MiB) with a
        # fresh anonymous mapping, which the kernel fills with zeros page by page as it is first
        # written: ``empty`` then holds the same zeros as ``zeros`` without committing all of it
        # up front (the default 512 MiB pool was resident from start-up; now only the blocks
        # used are). Zeros matter: a decode batch's padded rows read slots never written,
        # masked, and 0 * garbage could be NaN. Smaller pools come from the heap: zeroed.
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=storage).element_size()
        fresh = torch.device(device).type == "cpu" and sys.platform.startswith("linux") and nbytes >= _FRESH_BYTES
        self.kv = (torch.empty if fresh else torch.zeros)(*shape, dtype=storage, device=device)
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
        """The model's head dim (the width of a key or value)."""
        return self._head_dim

    @property
    def row_dim(self) -> int:
        """Elements of one stored row: ``head_dim``, plus 4 scale bytes when quantised."""
        return self.kv.shape[5]

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes in this pool, every layer, keys and values (scales included)."""
        return self.kv.shape[0] * 2 * self.kv.shape[4] * self.kv.shape[5] * self.kv.element_size()

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
                # reused first (LIFO): a long-running engine keeps resident only the most blocks
                # ever in use at once; the pool's never-touched pages stay unallocated
                self._free.appendleft(b)
                freed += 1
        return freed

    # -- moving KV in and out (layout independent) ----------------------------

    def read(self, blocks: list[int], num_tokens: int) -> torch.Tensor:
        """KV of the first ``num_tokens`` tokens held in ``blocks`` (in order), as one new
        tensor ``[layers, 2, num_tokens, kv_heads, row_dim]`` in the stored form (one gather copy)."""
        assert num_tokens <= len(blocks) * self.block_size, "more tokens than the blocks hold"
        return self.kv[:, :, blocks].flatten(2, 3)[:, :, :num_tokens]

    def write(self, blocks: list[int], first: int, k: list[torch.Tensor], v: list[torch.Tensor]) -> None:
        """Store per-layer keys and values ``[tokens, kv_heads, row_dim]`` in the stored form (as
        ``read`` gives them) into consecutive slots of ``blocks``, starting at offset ``first`` of
        ``blocks[0]``. Unquantised, any float dtype is converted; a quantised pool also takes
        float ``[tokens, kv_heads, head_dim]`` and quantises it."""
        n = k[0].shape[0] if k else 0
        assert len(k) == len(v) == self.kv.shape[0], "one key and one value tensor per layer"
        assert first + n <= len(blocks) * self.block_size, "more tokens than the blocks hold"
        bs = self.block_size
        ids = torch.tensor(blocks, dtype=torch.long)  # long even when empty (nothing to write)
        slots = (ids[:, None] * bs + torch.arange(bs)).flatten()[first : first + n].to(self.kv.device)
        flat = self.kv.flatten(2, 3)  # [layers, 2, slots, kv_heads, row_dim], a view
        for i in range(len(k)):
            flat[i, 0].index_copy_(0, slots, self._stored(k[i]))
            flat[i, 1].index_copy_(0, slots, self._stored(v[i]))

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return x.to(self.kv.dtype)
        if x.dtype == self.kv.dtype and x.shape[-1] == self.row_dim:
            return x
        assert x.is_floating_point() and x.shape[-1] == self.head_dim, (
            f"a {self.quant} pool takes stored rows (uint8, {self.row_dim} wide) or floats {self.head_dim} wide, "
            f"not {x.dtype} {x.shape[-1]} wide"
        )
        return kv_quant.quantize(x, self.quant)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy the KV of blocks ``src`` into blocks ``dst`` (pairwise; copy-on-write)."""
        assert len(src) == len(dst)
        if src:
            dev = self.kv.device
            self.kv.index_copy_(
                2, torch.tensor(dst, device=dev), self.kv.index_select(2, torch.tensor(src, device=dev))
            )

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        referenced = {b for b, c in enumerate(self.ref_counts) if c > 0}
        assert all(c >= 0 for c in self.ref_counts), "negative ref count"
        assert not (free & referenced), f"blocks both free and referenced: {sorted(free & referenced)[:8]}"
        assert len(free) + len(referenced) == self.num_blocks, (
            f"free {len(free)} + referenced {len(referenced)} != total {self.num_blocks}"
        )
