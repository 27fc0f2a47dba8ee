"""Router and worker must hash prompts alike, or routing by the workers' caches silently finds
nothing: whichever starts second compares the canary and refuses on a mismatch. A real worker
process and a real Redis; the router's side on the same records a worker writes."""

from __future__ import annotations

import hashlib
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


@pytest.mark.parametrize(
    ("algo", "block_size", "count", "digest", "blocks"),
    [
        ("sha256", 16, 48, "1fb1a4a5df53b1a1", 3),
        ("sha1", 16, 48, "33d4272d56c98b53", 3),
        ("blake2b", 16, 48, "13651514cacdb2dc", 3),
        ("sha256", 5, 23, "324c756b64455ae0", 4),  # a partial tail: no hash of its own
    ],
)
def test_the_block_chain_hashes_as_every_release_has(
    algo: str, block_size: int, count: int, digest: str, blocks: int
) -> None:
    """Routers and workers of two releases share one index while an upgrade rolls: the chain's
    bytes are pinned (each block: its parent's hash, then its tokens as little-endian int64)."""
    tokens = list(range(-3, -3 + count))
    seed = b"m\x00\x00" if block_size == 16 else b""
    chain = BlockHasher(block_size, algo).chain(tokens, seed)
    assert len(chain) == blocks
    assert hashlib.sha256(b"".join(chain)).hexdigest()[:16] == digest
