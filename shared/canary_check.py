"""At start, router and worker compare how they hash a canary prompt (shared.block_hash.canary):
had they hashed differently (another tokenizer, chat template or APC setting), routing by the
workers' caches would silently find nothing. A mismatch is a hard error on whichever side starts
second."""

from __future__ import annotations

import redis

from shared import keys
from shared.liveness import read_roster


class CanaryMismatch(RuntimeError):
    pass


def check_against_workers(r: redis.Redis, model_id: str, mine: str) -> None:
    """A hard error when a live worker of the model hashes the canary differently; otherwise the
    router's canary is recorded, and workers starting later check themselves against it."""
    for w in read_roster(r, ("model", "canary")):
        theirs = w.info.get("canary")
        if not w.alive or w.info.get("model") != model_id or not theirs:
            continue
        if theirs != mine:
            raise CanaryMismatch(
                f"worker {w.worker_id} hashes prompts of {model_id!r} as {theirs}, this router "
                f"as {mine}: tokenizer, chat template or APC_BLOCK_SIZE/APC_HASH differ"
            )
    r.hset(keys.routing_canary(), model_id, mine)


def check_against_routers(r: redis.Redis, model_id: str, mine: str) -> None:
    """A worker's check: a hard error when the pool's routers recorded another canary."""
    theirs = r.hget(keys.routing_canary(), model_id)
    if theirs is not None and theirs.decode() != mine:
        raise CanaryMismatch(
            f"this worker hashes prompts of {model_id!r} as {mine}, the pool's routers as "
            f"{theirs.decode()}: tokenizer, chat template or APC_BLOCK_SIZE/APC_HASH differ"
        )
