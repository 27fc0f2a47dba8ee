"""The kinds of stored KV, sharing one small protocol the store and policy use.

The store never looks inside an entry: it asks for `nbytes`, `num_tokens`, `release()`. The policy
asks for `materialise(n)`: fresh per-layer cache objects holding KV for exactly `tokens[:n]`, which
mlx-lm's BatchGenerator may consume and mutate. A new storage kind is a new class here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.models.cache import KVCache

DENSE = "dense"
PAGED = "paged"
SNAPSHOT = "snapshot"


class StoredKV(Protocol):
    mode: str
    tokens: tuple[int, ...]
    whole_only: bool
    checkpoint: bool  # kept mid-prefill (a snapshot of the prompt so far), not at a finish

    @property
    def nbytes(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    def is_empty(self) -> bool: ...

    def materialise(self, n_tokens: int) -> list[Any]: ...

    def release(self) -> None: ...


def resume_points(entry: StoredKV, chain: list[bytes], block_size: int) -> list[bytes]:
    """The block hashes (of `chain`, the entry's own) a prompt may resume this entry at: every
    block of one that can be cut back; only its end, when that is a block boundary, of one
    restored only whole. What the routing index learns is exactly what a hit can use."""
    if not entry.whole_only:
        return chain
    if entry.num_tokens % block_size or len(chain) * block_size != entry.num_tokens:
        return []
    return chain[-1:]


def kv_length(layer_caches: list[Any]) -> int:
    """Tokens the per-layer caches cover (the smallest layer, to be safe)."""
    return min((int(getattr(c, "offset", 0)) for c in layer_caches), default=0)


def _sliced(cache: Any, n: int) -> tuple[mx.array, mx.array]:
    return cache.keys[..., :n, :], cache.values[..., :n, :]


@dataclass(eq=False)
class DenseEntry:
    """A finished sequence's own per-layer KVCache objects (contiguous KV)."""

    tokens: tuple[int, ...]
    layers: list[Any]
    whole_only: bool = False
    checkpoint: bool = False
    mode: str = DENSE
    _nbytes: int = 0

    @classmethod
    def detach(cls, tokens: list[int], layer_caches: list[Any]) -> DenseEntry:
        """Take the KV out of the finished sequence, cut to exactly what `tokens` covers."""
        n = min(len(tokens), kv_length(layer_caches))
        layers = []
        for c in layer_caches:
            fresh = KVCache()
            if c.keys is not None:
                fresh.keys, fresh.values = _sliced(c, n)
                fresh.offset = n
            layers.append(fresh)
        entry = cls(tokens=tuple(tokens[:n]), layers=layers)
        entry._nbytes = sum(c.nbytes for c in layers)
        return entry

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def is_empty(self) -> bool:
        return not self.layers or any(c.keys is None for c in self.layers)

    def materialise(self, n_tokens: int) -> list[Any]:
        """Trim in place: a dense entry has already left the store when this is called."""
        for c in self.layers:
            if c.offset < n_tokens or c.keys.shape[2] < n_tokens:
                raise ValueError(f"layer holds {c.offset} tokens, cannot give {n_tokens}")
            c.trim(c.offset - n_tokens)
        return self.layers

    def release(self) -> None:
        self.layers = []


@dataclass(eq=False)
class PagedEntry:
    """Block ids in a BlockPool; the blocks are shared and refcounted there."""

    tokens: tuple[int, ...]
    block_ids: list[int]
    block_size: int
    block_nbytes: int
    clone: Callable[[list[int]], list[Any]]
    free: Callable[[list[int]], None]
    whole_only: bool = False
    checkpoint: bool = False
    mode: str = PAGED

    @property
    def nbytes(self) -> int:
        return len(self.block_ids) * self.block_nbytes

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def is_empty(self) -> bool:
        return not self.block_ids

    def materialise(self, n_tokens: int) -> list[Any]:
        if n_tokens % self.block_size:
            raise ValueError(f"{n_tokens} is not a multiple of the block size {self.block_size}")
        return self.clone(self.block_ids[: n_tokens // self.block_size])

    def release(self) -> None:
        ids, self.block_ids = self.block_ids, []
        self.free(ids)


def _copy_leaf(x: Any) -> Any:
    # A new array object: slice assignment on the restored cache must not reach the snapshot.
    return mx.array(x) if isinstance(x, mx.array) else x


@dataclass(eq=False)
class SnapshotEntry:
    """A full copy of cache state that cannot be cut back (rotating KV, recurrent/SSM state):
    of a finished sequence, or a checkpoint of a prompt while it was prefilled."""

    tokens: tuple[int, ...]
    classes: list[type]
    states: list[Any]
    whole_only: bool = True
    checkpoint: bool = False
    mode: str = SNAPSHOT
    _nbytes: int = 0

    @classmethod
    def capture(
        cls, tokens: list[int], layer_caches: list[Any], checkpoint: bool = False
    ) -> SnapshotEntry:
        states = [tree_map(_copy_leaf, c.state) for c in layer_caches]
        # Computed now: the copies must not keep the running batch's graph (or buffers) alive.
        mx.eval(states)
        entry = cls(
            tokens=tuple(tokens),
            classes=[type(c) for c in layer_caches],
            states=states,
            checkpoint=checkpoint,
        )
        entry._nbytes = sum(int(c.nbytes) for c in layer_caches)
        return entry

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def is_empty(self) -> bool:
        return not self.states or self._nbytes == 0

    def materialise(self, n_tokens: int) -> list[Any]:
        if n_tokens != len(self.tokens):
            raise ValueError("a snapshot restores only whole")
        return [
            klass.from_state(tree_map(_copy_leaf, state))
            for klass, state in zip(self.classes, self.states, strict=True)
        ]

    def release(self) -> None:
        self.states = []
