"""Router and worker must hash prompts alike, or routing by the workers' caches silently finds
nothing: whichever starts second compares the canary and refuses on a mismatch. A real worker
process and a real Redis; the router's side on the same records a worker writes."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from router.admission.tokenization import load_tokenizer
from shared import keys
from shared.block_hash import BlockHasher, canary
from shared.canary_check import CanaryMismatch, check_against_workers
from tests.conftest import WorkerProcess
from tests.streams import TINY_MODEL

MODEL = TINY_MODEL


def test_a_worker_refuses_to_start_when_the_routers_hash_differently(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(redis_url)
    r.hset(keys.routing_canary(), MODEL, "sha256/16/0000000000000000")  # another router's
    w = WorkerProcess(redis_url, tiny_model_dir, "w1", tmp_path)
    assert w.proc.wait(60) == 2
    assert "hashes prompts of 'mlxcel-tiny-s0' as sha256/16/" in w.log()
    assert not r.exists(keys.worker_info("w1"))  # it never registered


def test_a_worker_and_this_router_agree_and_a_mismatch_stops_the_router(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    r = redis.Redis.from_url(redis_url)
    w = WorkerProcess(redis_url, tiny_model_dir, "w1", tmp_path)
    w.wait_ready()
    try:
        theirs = r.hget(keys.worker_info("w1"), "canary").decode()
        tok = load_tokenizer(tiny_model_dir)
        mine = canary(tok.hf, MODEL, BlockHasher(16, "sha256"))
        assert theirs == mine  # mlx-lm's tokenizer wrapper and transformers' agree
        check_against_workers(r, MODEL, mine)  # no error, and recorded for later workers
        assert r.hget(keys.routing_canary(), MODEL).decode() == mine
        other = canary(tok.hf, MODEL, BlockHasher(32, "sha256"))  # APC_BLOCK_SIZE=32 here
        with pytest.raises(CanaryMismatch, match="worker w1 hashes prompts"):
            check_against_workers(r, MODEL, other)
    finally:
        w.stop()
