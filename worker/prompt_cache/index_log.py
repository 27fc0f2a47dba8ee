"""What the routing index must learn about the cache's blocks since the last step's publish.

The main shelf reports a block hash when the first entry holding it arrives and when the last one
holding it leaves; the engine drains the changes into each StepResult, and the publisher applies
them to the worker's block set in Redis (shared.keys.worker_blocks) in the step's pipeline.
"""

from __future__ import annotations

from shared.block_hash import INDEX_MEMBER_BYTES


class BlockIndexLog:
    def __init__(self) -> None:
        # index member -> held now (True) or no longer (False); the latest change wins
        self._changes: dict[bytes, bool] = {}
        self._held: dict[bytes, int] = {}  # index member -> chained hashes behind it

    def add(self, block_hash: bytes) -> None:
        m = block_hash[:INDEX_MEMBER_BYTES]
        n = self._held.get(m, 0)
        self._held[m] = n + 1
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

    def take(self) -> dict[bytes, bool]:
        changes, self._changes = self._changes, {}
        return changes

    def held(self) -> list[bytes]:
        """Every member held now: what a worker writes when it finds its index lost."""
        return list(self._held)

    def __len__(self) -> int:
        return len(self._held)
