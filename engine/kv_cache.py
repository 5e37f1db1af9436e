"""The paged KV cache: block tensors allocated once, and the free-list that hands blocks out.

A sequence owns a block table (list of block ids); position ``p`` of the
sequence lives in slot ``table[p // block_size] * block_size + p % block_size``.
The allocator never grows: when it runs out, the scheduler makes requests wait
or preempts one (recompute), so a full cache slows requests down but never
loses one.
"""

from __future__ import annotations

import torch


class BlockAllocator:
    """Free-list of KV block ids ``0 .. num_blocks - 1``."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        assert num_blocks <= len(self._free), "allocate() without can_allocate()"
        taken = self._free[len(self._free) - num_blocks:]
        del self._free[len(self._free) - num_blocks:]
        taken.reverse()
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVCache:
    """Key and value tensors for every layer: ``[num_layers, Hkv, num_blocks, block_size, D]``.

    NOTE: head-major, so gathering a sequence's blocks yields ``(Hkv, B, L, D)``
    whose (L, D) planes are contiguous — SDPA runs about twice as fast on that
    as on a token-major gather. Allocated zeroed once (a masked-out slot must
    never hold NaN, since SDPA multiplies it by a zero weight).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str = "cpu") -> None:
        shape = (num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @property
    def num_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ``[T, Hkv, D]`` at flat slots ``[T]`` of ``layer``."""
        kl, vl = self.k[layer], self.v[layer]
        heads, dim = kl.shape[0], kl.shape[-1]
        kl.view(heads, -1, dim).index_copy_(1, slots, k.transpose(0, 1))
        vl.view(heads, -1, dim).index_copy_(1, slots, v.transpose(0, 1))
