"""Automatic prefix caching: chained block hashes, and clamping a match to agreeing blocks.

A block's hash covers its parent's hash and its own tokens, so two equal hashes at block i mean the
whole prefix up to the end of block i is equal (no need to compare the tokens again).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

HASH_ALGOS = ("sha256", "sha1", "blake2b")


@dataclass(frozen=True)
class BlockHasher:
    block_size: int = 16
    algo: str = "sha256"

    def __post_init__(self) -> None:
        if self.algo not in HASH_ALGOS:
            raise ValueError(f"unknown APC hash {self.algo!r}; expected one of {HASH_ALGOS}")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")

    def chain(self, tokens: Sequence[int], seed: bytes = b"") -> list[bytes]:
        """The chained hash of every *full* block of `tokens` (a partial tail has no hash)."""
        bs = self.block_size
        out: list[bytes] = []
        parent = seed
        for start in range(0, len(tokens) - bs + 1, bs):
            block = array("q", tokens[start : start + bs]).tobytes()
            parent = hashlib.new(self.algo, parent + block).digest()
            out.append(parent)
        return out


def agreeing_blocks(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading chained hashes agree (once one differs, every later one does too)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def clamp_to_blocks(
    matched: int, entry_hashes: Sequence[bytes], prompt_hashes: Sequence[bytes], block_size: int
) -> int:
    """Clamp a token match to whole blocks whose chained hashes agree."""
    blocks = min(matched // block_size, agreeing_blocks(entry_hashes, prompt_hashes))
    return blocks * block_size
