"""Paged-mode mechanics only: fixed-size KV blocks, refcounts, hash dedupe, a free list, a budget.

The pool answers *how* (allocate, share, clone, pin, free) and never *whom*: which entry to evict
to make room is the store's decision. A block holds, per layer, K and V for `block_size` tokens,
batch dim 1. A block's chained hash (namespace seed + all tokens up to its end) makes a second
entry with the same prefix share the block instead of copying it. Block storage is allocated
lazily; a freed block's id goes back on the free list and its arrays are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from worker.prompt_cache.apc import BlockHasher


@dataclass(eq=False)
class _Block:
    block_id: int
    keys: list[mx.array]
    values: list[mx.array]
    block_hash: bytes
    nbytes: int
    ref_cnt: int = 0


@dataclass(eq=False)
class CacheLease:
    """A running sequence's hold on the paged blocks it adopted from; `release` gives them back
    once (a second call, or one after the pool was reset, does nothing)."""

    pool: BlockPool
    block_ids: list[int]
    generation: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.pool._unpin(self)


@dataclass
class PoolCounts:
    allocated: int  # block ids the pool has handed out so far (live + on the free list)
    live: int  # blocks holding KV (ref_cnt > 0)
    free: int  # blocks that can still be filled before the budget is hit
    bytes_reserved: int  # allocated ids x the block size in bytes
    bytes_in_use: int  # live blocks' bytes
    budget: int  # the block budget (0 = not yet known: set by the first block's size)


@dataclass
class BlockPool:
    block_size: int = 32
    hash_algo: str = "sha256"
    budget_blocks: int = 0
    capacity_bytes: int = 0
    _blocks: dict[int, _Block] = field(default_factory=dict)
    _by_hash: dict[bytes, int] = field(default_factory=dict)
    _free_ids: list[int] = field(default_factory=list)
    _next_id: int = 0
    _block_nbytes: int = 0
    _bytes_in_use: int = 0
    _generation: int = 0  # bumped by reset: leases taken before it hold nothing

    @property
    def block_nbytes(self) -> int:
        return self._block_nbytes

    @property
    def budget(self) -> int:
        """Explicit budget, else what the byte capacity holds once a block's size is known."""
        if self.budget_blocks:
            return self.budget_blocks
        return self.capacity_bytes // self._block_nbytes if self._block_nbytes else 0

    @property
    def live(self) -> int:
        return len(self._blocks)

    @property
    def bytes_in_use(self) -> int:
        return self._bytes_in_use

    def over_budget(self) -> bool:
        return self.live > self.budget or self._bytes_in_use > self.capacity_bytes

    def store(self, seed: bytes, tokens: list[int], layer_caches: list[Any]) -> list[int]:
        """Split the KV of `tokens` into full blocks (the partial tail is dropped), sharing any
        block whose chained hash is already held. Returns block ids, each holding one ref."""
        n_blocks = min(len(tokens), min(c.offset for c in layer_caches)) // self.block_size
        hashes = BlockHasher(self.block_size, self.hash_algo).chain(
            tokens[: n_blocks * self.block_size], seed
        )
        ids: list[int] = []
        try:
            for i, h in enumerate(hashes):
                block_id = self._by_hash.get(h)
                if block_id is None:
                    block_id = self._new_block(h, layer_caches, i * self.block_size)
                self._blocks[block_id].ref_cnt += 1
                ids.append(block_id)
        except Exception:
            self.free(ids)
            raise
        return ids

    def _new_block(self, block_hash: bytes, layer_caches: list[Any], start: int) -> int:
        end = start + self.block_size
        # mx.contiguous copies the strided slice, so the block does not keep the sequence's
        # whole buffer alive.
        keys = [mx.contiguous(c.keys[..., start:end, :]) for c in layer_caches]
        values = [mx.contiguous(c.values[..., start:end, :]) for c in layer_caches]
        mx.eval(keys, values)
        nbytes = sum(k.nbytes for k in keys) + sum(v.nbytes for v in values)
        block_id = self._free_ids.pop() if self._free_ids else self._take_new_id()
        self._blocks[block_id] = _Block(block_id, keys, values, block_hash, nbytes)
        self._by_hash[block_hash] = block_id
        self._block_nbytes = self._block_nbytes or nbytes
        self._bytes_in_use += nbytes
        return block_id

    def _take_new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one ref from each block; a block with no refs goes back on the free list."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                del self._blocks[block_id]
                del self._by_hash[block.block_hash]
                self._bytes_in_use -= block.nbytes
                self._free_ids.append(block_id)

    def clone(self, block_ids: list[int]) -> list[KVCache]:
        """Fresh per-layer KVCache objects holding the blocks' KV back to back, with one
        KVCache.step of room after them: the remainder's KV then lands in place instead of
        KVCache reallocating (and copying) the whole prefix on its first update."""
        if not block_ids:
            raise ValueError("nothing to clone")
        blocks = [self._blocks[b] for b in block_ids]
        out = []
        for layer in range(len(blocks[0].keys)):
            cache = KVCache()
            keys = [b.keys[layer] for b in blocks]
            values = [b.values[layer] for b in blocks]
            room = (*keys[0].shape[:2], cache.step, keys[0].shape[3])
            cache.keys = mx.concatenate([*keys, mx.zeros(room, keys[0].dtype)], axis=2)
            room = (*values[0].shape[:2], cache.step, values[0].shape[3])
            cache.values = mx.concatenate([*values, mx.zeros(room, values[0].dtype)], axis=2)
            cache.offset = len(blocks) * self.block_size
            out.append(cache)
        return out

    def pin(self, block_ids: list[int]) -> CacheLease:
        """Hold the blocks for a running sequence until the lease is released, so eviction
        cannot free them; the lease is the only record of the hold."""
        for block_id in block_ids:
            self._blocks[block_id].ref_cnt += 1
        return CacheLease(self, list(block_ids), self._generation)

    def _unpin(self, lease: CacheLease) -> None:
        # A reset dropped every block (and so every hold): ids from before it may be reused.
        if lease.generation == self._generation:
            self.free(lease.block_ids)

    def counts(self) -> PoolCounts:
        allocated = self._next_id
        budget = self.budget
        return PoolCounts(
            allocated=allocated,
            live=self.live,
            free=max(budget - self.live, 0),
            bytes_reserved=allocated * self._block_nbytes,
            bytes_in_use=self._bytes_in_use,
            budget=budget,
        )

    def reset(self) -> int:
        """Drop every block and pin (adopted sequences hold clones, not the blocks themselves).
        Returns the bytes freed."""
        freed = self._bytes_in_use
        self._blocks.clear()
        self._by_hash.clear()
        self._generation += 1
        self._free_ids = list(range(self._next_id))
        self._bytes_in_use = 0
        return freed
