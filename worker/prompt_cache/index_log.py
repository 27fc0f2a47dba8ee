"""What the routing index must learn about the cache's blocks since the last step's publish.

The main shelf reports a block hash when the first entry holding it arrives and when the last one
holding it leaves; the engine drains the changes into each StepResult, and the publisher applies
them to the worker's block set in Redis (shared.keys.worker_blocks) in the step's pipeline. A
hash that is a prompt's first block (the first of its chain) is also told apart: the publisher
lists the worker under it in the pool's holders set (shared.keys.routing_holders), where a
placement decision finds a prompt's holders without reading every worker's block set.
"""

from __future__ import annotations

from shared.block_hash import INDEX_MEMBER_BYTES


class BlockIndexLog:
    def __init__(self) -> None:
        # index member -> held now (True) or no longer (False); the latest change wins
        self._changes: dict[bytes, bool] = {}
        self._held: dict[bytes, int] = {}  # index member -> chained hashes behind it
        # Members that are a prompt's first block, held now or changed since the last take (a
        # hash's place in its chain is its own: the first block's hash is never a later one's).
        self._firsts: set[bytes] = set()

    def add(self, block_hash: bytes, first: bool = False) -> None:
        m = block_hash[:INDEX_MEMBER_BYTES]
        n = self._held.get(m, 0)
        self._held[m] = n + 1
        if first:
            self._firsts.add(m)
        if n == 0:
            self._changes[m] = True

    def remove(self, block_hash: bytes) -> None:
        m = block_hash[:INDEX_MEMBER_BYTES]
        n = self._held.get(m, 0) - 1
        if n > 0:
            self._held[m] = n
            return
        self._held.pop(m, None)
        self._changes[m] = False

    def take(self) -> tuple[dict[bytes, bool], set[bytes]]:
        """The changes since the last take, and which of their members are first blocks."""
        changes, self._changes = self._changes, {}
        firsts = {m for m in changes if m in self._firsts}
        for m in firsts:
            if not changes[m]:
                self._firsts.discard(m)
        return changes, firsts

    def held(self) -> list[bytes]:
        """Every member held now: what a worker writes when it finds its index lost."""
        return list(self._held)

    def held_firsts(self) -> set[bytes]:
        """The members held now that are first blocks."""
        return {m for m in self._firsts if m in self._held}

    def __len__(self) -> int:
        return len(self._held)
