"""HostPool: the host-memory tier of KV blocks, between the device pool and disk.

Blocks of the same geometry as the device ``BlockPool`` they back
(``kv[layer, 0|1 (k|v), block, offset, kv_head, row_dim]``, same dtype: quantised KV stays
quantised, its scales in its rows), in host
memory, with their own count (``for_pool`` derives it from a byte budget) and free
list. A host block has at most one owner, a host-resident radix node, so ownership
is a flag, not a count. Invariant (``check_integrity``): free + used == total and no
block is both.

Copies (``save``: device -> host, ``load``: host -> device) move whole blocks:

* on CUDA the host tensor is pinned and every copy runs on a side stream. The side
  stream first waits for the current stream (the KV to save was written by kernels
  queued there; the device blocks to load into may still be read by them), gathers or
  scatters on the device through a staging tensor, and copies to/from pinned memory
  with ``non_blocking``. The current stream then waits on the side stream's work
  that touches the pool's blocks (after ``save``: the gather; after ``load``: the
  scatter), so nothing queued later overwrites a freed block before it was read nor
  reads a loaded one before it was written, while the device -> host transfer itself
  overlaps later work. All host-tensor traffic is on the one side stream, in order,
  so a host block freed and reused is never written before an earlier copy read it.
  The CPU never reads or writes the host tensor's bytes itself.
* on CPU the host tensor is a second CPU tensor and copies are plain strided tensor
  copies: the same calls, tested here.
"""

from __future__ import annotations

from collections import deque

import torch

from chatkv.errors import OutOfBlocks
from chatkv.kvcache.block_pool import BlockPool


class HostPool:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        """``device``: the device of the pool this tier backs (the host tensor itself is always on the CPU)."""
        assert num_blocks > 0 and block_size > 0
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.num_blocks = num_blocks
        self.block_size = block_size
        # empty, not zeros: a free block's bytes are never read, and untouched pages cost no memory
        self.kv = torch.empty(
            num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, pin_memory=self.cuda
        )
        self.used = [False] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._stream = torch.cuda.Stream(self.device) if self.cuda else None

    @classmethod
    def for_pool(cls, pool: BlockPool, budget_bytes: int) -> "HostPool | None":
        """A host tier for ``pool`` holding as many of its blocks as ``budget_bytes`` allow;
        None if that is not a single block (the tier is off)."""
        per_block = pool.kv[:, :, :1].numel() * pool.kv.element_size()
        n = budget_bytes // per_block if per_block else 0
        if n < 1:
            return None
        return cls(n, pool.block_size, pool.num_layers, pool.num_kv_heads, pool.row_dim, pool.kv.dtype, pool.kv.device)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free host blocks. Raises OutOfBlocks if fewer are free."""
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} host KV blocks, only {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self.used[b] = True
        return ids

    def free(self, ids: list[int]) -> None:
        for b in ids:
            assert self.used[b], f"free of host block {b}, which is not in use"
            self.used[b] = False
            self._free.append(b)

    # -- copies -------------------------------------------------------------------

    def save(self, pool: BlockPool, block_ids: list[int], host_ids: list[int]) -> None:
        """Copy the device blocks ``block_ids`` of ``pool`` into the host blocks ``host_ids``
        (pairwise). On return the device blocks may be freed and reused by later work."""
        assert len(block_ids) == len(host_ids)
        if not block_ids:
            return
        if not self.cuda:
            _copy_runs(pool.kv, block_ids, self.kv, host_ids)
            return
        current = torch.cuda.current_stream(self.device)
        side = self._stream
        side.wait_stream(current)  # the KV to save may still be being written by queued kernels
        with torch.cuda.stream(side):
            idx = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            staged = pool.kv.index_select(2, idx)  # contiguous [layers, 2, n, ...] on the device
            gathered = torch.cuda.Event()
            gathered.record(side)
            for start, first, n in _runs(host_ids):
                for layer in range(self.kv.shape[0]):
                    for kv in (0, 1):  # kv[layer, kv, a:b] is contiguous on both sides: one async memcpy
                        self.kv[layer, kv, first : first + n].copy_(
                            staged[layer, kv, start : start + n], non_blocking=True
                        )
        # later kernels may overwrite the freed device blocks once they were gathered; the
        # transfer of ``staged`` (allocated on the side stream, so not reused before it) goes on
        current.wait_event(gathered)

    def load(self, pool: BlockPool, host_ids: list[int], block_ids: list[int]) -> None:
        """Copy the host blocks ``host_ids`` into the device blocks ``block_ids`` of ``pool``
        (pairwise). Work queued after return sees the loaded KV; the host blocks may be freed."""
        assert len(block_ids) == len(host_ids)
        if not block_ids:
            return
        if not self.cuda:
            _copy_runs(self.kv, host_ids, pool.kv, block_ids)
            return
        current = torch.cuda.current_stream(self.device)
        side = self._stream
        side.wait_stream(current)  # queued kernels may still read the device blocks we overwrite
        with torch.cuda.stream(side):
            idx = torch.tensor(block_ids, dtype=torch.long).to(self.device, non_blocking=True)
            shape = list(self.kv.shape)
            shape[2] = len(host_ids)
            staged = torch.empty(shape, dtype=self.kv.dtype, device=self.device)
            for start, first, n in _runs(host_ids):
                for layer in range(self.kv.shape[0]):
                    for kv in (0, 1):
                        staged[layer, kv, start : start + n].copy_(
                            self.kv[layer, kv, first : first + n], non_blocking=True
                        )
            pool.kv.index_copy_(2, idx, staged)
        current.wait_stream(side)  # the forward that reads these blocks runs after the scatter

    # -- integrity ------------------------------------------------------------------

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a host block is on the free list twice"
        used = {b for b, u in enumerate(self.used) if u}
        assert not (free & used), f"host blocks both free and used: {sorted(free & used)[:8]}"
        assert len(free) + len(used) == self.num_blocks, (
            f"host free {len(free)} + used {len(used)} != total {self.num_blocks}"
        )


def _copy_runs(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor, dst_ids: list[int]) -> None:
    """``dst[:, :, dst_ids] = src[:, :, src_ids]`` (same device) as one strided copy per run of
    ids consecutive on both sides: no temporary, unlike index_select + index_copy_ (several
    times slower on CPU for this 6-d layout)."""
    i = 0
    while i < len(src_ids):
        n = 1
        while i + n < len(src_ids) and src_ids[i + n] == src_ids[i] + n and dst_ids[i + n] == dst_ids[i] + n:
            n += 1
        dst[:, :, dst_ids[i] : dst_ids[i] + n].copy_(src[:, :, src_ids[i] : src_ids[i] + n])
        i += n


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Split ``ids`` into runs of consecutive ids: (index in ids, first id, length)."""
    out: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if out and out[-1][1] + out[-1][2] == b:
            s, f, n = out[-1]
            out[-1] = (s, f, n + 1)
        else:
            out.append((i, b, 1))
    return out
