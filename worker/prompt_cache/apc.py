"""Automatic prefix caching: chained block hashes, and clamping a match to agreeing blocks.

A block's hash covers its parent's hash and its own tokens, so two equal hashes at block i mean the
whole prefix up to the end of block i is equal (no need to compare the tokens again).
"""

from __future__ import annotations

from collections.abc import Sequence

from shared.block_hash import HASH_ALGOS, BlockHasher

__all__ = ["HASH_ALGOS", "BlockHasher", "agreeing_blocks", "clamp_to_blocks"]


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
