"""The one hashing of prompts into chained blocks, used by the worker's prompt cache and by the
router's cache-aware routing: if the two ever hashed differently, routing would silently find
no match, so both import this module and compare a canary at start.

A block's hash covers its parent's hash and its own tokens, so equal hashes at block i mean the
whole prefix up to the end of block i is equal. The chain starts from the cache namespace's seed
(model id, adapter, chat-template signature): equal tokens under another model or template never
collide. The session key is not in the seed: the spec lets a longer cross-session match win, so a
system prompt cached for one user is a match for the next.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

HASH_ALGOS = ("sha256", "sha1", "blake2b")
# Bytes of a block hash the routing index stores: 2**64 values keep a collision among a worker's
# blocks out of reach (1e5 blocks: ~1e-10), at a quarter of a sha256's memory in Redis.
INDEX_MEMBER_BYTES = 8


@dataclass(frozen=True)
class CacheNamespace:
    """KV is only reusable under the same weights, adapter and chat template."""

    model_id: str
    adapter_id: str = ""
    template_signature: str = ""

    def seed(self) -> bytes:
        """Bytes that start every hash chain, so equal tokens in two namespaces never collide."""
        return f"{self.model_id}\x00{self.adapter_id}\x00{self.template_signature}".encode()


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
        # The full blocks' tokens as int64 bytes in one conversion, then a slice a block: the
        # same bytes as an array a block, with one conversion a prompt instead of one a block
        # (the router hashes every prompt it admits).
        full = len(tokens) - len(tokens) % self.block_size
        raw = array("q", tokens[:full]).tobytes()
        step = 8 * self.block_size  # an int64 a token
        new = getattr(hashlib, self.algo)
        out: list[bytes] = []
        parent = seed
        for start in range(0, len(raw), step):
            parent = new(parent + raw[start : start + step]).digest()
            out.append(parent)
        return out


def index_members(hashes: Iterable[bytes]) -> list[bytes]:
    """Block hashes as the routing index stores them."""
    return [h[:INDEX_MEMBER_BYTES] for h in hashes]


def template_signature(template: str) -> str:
    """Short stable id of the chat template text actually used (prompt-cache isolation)."""
    return hashlib.sha256(template.encode()).hexdigest()[:16]


CANARY_MESSAGES = [
    {"role": "system", "content": "You are the routing canary. " * 8},
    {"role": "user", "content": "Hash me the same way on every host, router and worker alike."},
]
CANARY_TEXT = "The routing canary: 0 1 2 3 4 5 6 7 8 9, the quick brown fox. " * 4


def canary(tokenizer: Any, model_id: str, hasher: BlockHasher) -> str:
    """Hex digest of a fixed conversation run through the model's own chat template (plain text
    when it has none), its tokenizer and the block chain: router and worker must agree on it."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        text = tokenizer.apply_chat_template(
            CANARY_MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True
        )
        tokens = list(tokenizer.encode(text, add_special_tokens=False))
        signature = template_signature(template)
    else:
        tokens, signature = list(tokenizer.encode(CANARY_TEXT)), ""
    hashes = hasher.chain(tokens, CacheNamespace(model_id, "", signature).seed())
    digest = hashlib.sha256(b"".join(hashes) + f"{len(tokens)}".encode())
    return f"{hasher.algo}/{hasher.block_size}/{digest.hexdigest()[:16]}"
