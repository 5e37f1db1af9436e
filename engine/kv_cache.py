"""The paged KV cache: block tensors allocated once, and the block pool that hands blocks out.

A sequence owns a block table (list of block ids); position ``p`` of the
sequence lives in slot ``table[p // block_size] * block_size + p % block_size``.
The pool never grows: when it runs out, the scheduler makes requests wait
or preempts one (recompute), so a full cache slows requests down but never
loses one.

Automatic prefix caching (``engine.enable_prefix_caching``, as in vLLM V1):
a full block is named by a chain hash, ``hash(parent block's hash, its token
ids)``, so two blocks with equal hashes hold the K/V of equal whole prefixes.
Blocks are reference-counted; a block whose last reference goes and that has
a hash is kept, still findable, on an LRU of evictable blocks instead of going
back to the free list. Allocation takes truly free blocks first, then evicts
the least recently released cached block (dropping its hash). A block that is
referenced is never handed out, and cached blocks are only ever read: a
sequence that reuses a prefix writes its next tokens into fresh blocks, so no
copy-on-write is needed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import torch

ROOT_HASH = b""  # the parent of a sequence's first block


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chain hash of one full block: equal hashes mean equal prefixes up to its end.

    NOTE: SHA-256 rather than Python's ``hash``: a 64-bit hash can be collided on
    purpose, and a collision would serve one user's K/V to another's prompt.
    """
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_size: int) -> None:
    """Append the hashes of the full blocks of ``token_ids`` not hashed yet (in place)."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size]))


class BlockAllocator:
    """Reference-counted KV block ids ``0 .. num_blocks - 1``, with a prefix-cache index.

    Without :meth:`register` it is a plain free-list (low ids first), which is
    exactly what the engine runs with prefix caching off.

    Example (block_size irrelevant here; hashes are opaque keys)::

        a = BlockAllocator(4)
        [b0, b1] = a.allocate(2)          # [0, 1]
        a.register(b0, h0)                # b0 holds a full, computed block
        a.free([b0, b1])                  # b1 -> free list, b0 -> evictable LRU
        a.lookup([h0, h1]) == [0]         # b0 is still findable
        a.take([0])                       # reused by another sequence: refcount 1
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # block -> its hash (registered blocks)
        self._block_of: dict[bytes, int] = {}  # hash -> the block holding it
        self._evictable: dict[int, None] = {}  # unreferenced registered blocks, LRU first

    @property
    def num_free(self) -> int:
        """Blocks that :meth:`allocate` can hand out: free plus evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache (referenced or evictable)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """Referenced blocks / all blocks (cached but unreferenced blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free

    def allocate(self, num_blocks: int) -> list[int]:
        """``num_blocks`` fresh blocks (refcount 1), free ones first, then evicting LRU ones."""
        assert num_blocks <= self.num_free, "allocate() without can_allocate()"
        from_free = min(num_blocks, len(self._free))
        taken = self._free[len(self._free) - from_free:]
        del self._free[len(self._free) - from_free:]
        taken.reverse()
        for _ in range(num_blocks - from_free):
            taken.append(self._evict())
        for block in taken:
            self._refs[block] = 1
        return taken

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block; the last reference frees or parks it.

        NOTE: released tail first, so a sequence's last blocks (least likely to be
        shared) are evicted before its first ones.
        """
        for block in reversed(blocks):
            assert self._refs[block] > 0, f"block {block} freed more often than taken"
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    # -- the prefix cache -------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks of the longest run of ``hashes`` from the start (no side effect)."""
        found = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def num_evictable(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` are unreferenced: taking them shrinks :attr:`num_free`."""
        return sum(1 for b in blocks if self._refs[b] == 0)

    def take(self, blocks: Sequence[int]) -> None:
        """Add a reference to each cached block (a prefix hit), taking it off the LRU."""
        for block in blocks:
            assert block in self._hash_of, f"block {block} is not cached"
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1

    def register(self, block: int, block_hash: bytes) -> None:
        """Make a referenced, fully computed block findable under ``block_hash``.

        A block already registered keeps its hash; a hash already held by another
        block keeps that block (this one stays private and is freed normally).
        """
        assert self._refs[block] > 0, f"register() of unreferenced block {block}"
        if block in self._hash_of or block_hash in self._block_of:
            return
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block

    def reset(self) -> int:
        """Forget every cached hash (parked blocks become free); returns how many.

        Safe while sequences run: a referenced block only loses its name, so it is
        not found again and goes to the free list when released.
        """
        num_dropped = len(self._hash_of)
        self._free.extend(sorted(self._evictable, reverse=True))
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()
        return num_dropped

    def _evict(self) -> int:
        block = next(iter(self._evictable))
        del self._evictable[block]
        del self._block_of[self._hash_of.pop(block)]
        return block


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
