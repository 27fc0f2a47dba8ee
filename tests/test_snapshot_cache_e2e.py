"""A model whose KV cache cannot be cut back (sliding-window layers): the worker's load-time check
says so, its prompt cache restores whole-prefix snapshots and prefill checkpoints, giving the cold
run's output, and the router's predictions for it are what its workers reuse."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from shared import keys
from tests.conftest import MlxReference
from tests.pool_fixture import Pool, complete_tokens, running_pool, wait_for
from tests.streams import enqueue, generated_tokens, read_events

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

MODEL = "mlxcel-tiny-swa"


@pytest.fixture(scope="module")
def pool(tiny_swa_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    with running_pool(tiny_swa_model_dir, tmp_path_factory.mktemp("swa-pool"), workers=2) as p:
        yield p


@pytest.fixture(scope="module")
def reference(tiny_swa_model_dir: Path) -> MlxReference:
    return MlxReference(tiny_swa_model_dir)


def _complete(pool: Pool, tokens: list[int]) -> dict:
    return complete_tokens(pool, tokens, 10, MODEL).json()


def _cached(out: dict) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def _stats(pool: Pool) -> dict:
    return httpx.get(f"{pool.url}/v1/cache/stats", timeout=10).json()


def test_snapshot_restore_through_the_pool(pool: Pool, reference: MlxReference) -> None:
    health = httpx.get(f"{pool.url}/health", timeout=10).json()
    stats = _stats(pool)
    assert stats["cacheability"] == "snapshot" and stats["storage_mode"] == "snapshot"
    assert "snapshot" in str(health)

    r = redis.Redis.from_url(pool.redis_url)
    prompt = [10 + (i * 11) % 700 for i in range(80)]
    first = read_events(r, enqueue(r, prompt, max_tokens=6, queue=keys.model_queue_name(MODEL)))
    history = prompt + generated_tokens(first)  # the snapshot holds exactly these tokens
    worker = first[0].worker_id

    # Diverges inside the snapshot, before its one checkpoint (64): nothing can be restored.
    partial = _complete(pool, prompt[:60] + [5, 6, 7])
    assert _cached(partial) == 0
    follow_up = history + [20, 21, 22, 23]
    out = _complete(pool, follow_up)
    assert _cached(out) == len(history)
    want_text, _ = reference.run(follow_up, 10)
    assert out["choices"][0]["text"] == want_text
    worker_stats = _stats(pool)["workers"][worker]
    assert worker_stats["snapshot_hits"] == 1 and worker_stats["snapshot_inserts"] >= 1


SHARED = [(17 + i * 13) % 1000 + 5 for i in range(300)]


def test_a_shared_prefix_is_reused_and_predicted_exactly(
    pool: Pool, reference: MlxReference
) -> None:
    before = _stats(pool)["routing"]
    prompts = [SHARED + [7 + i for i in range(24)], SHARED + [400 + i for i in range(24)]]
    outs = [_complete(pool, p) for p in [*prompts, prompts[0]]]
    # Cold; then from the checkpoint at 256 (the share ends at 300); then an identical prompt
    # from its last checkpoint, 320, short of its last token.
    assert [_cached(o) for o in outs] == [0, 256, 320]
    for out, prompt in zip(outs, [*prompts, prompts[0]], strict=True):
        assert out["choices"][0]["text"] == reference.run(prompt, 10)[0]
    after = _stats(pool)
    routing = after["routing"]
    predicted = routing["predicted_tokens"] - before["predicted_tokens"]
    reused = routing["reused_tokens"] - before["reused_tokens"]
    assert predicted == reused == 256 + 320
    assert after["checkpoint_hits"] >= 2  # counters go out with each step's events
    # Gauges go out with the worker's once-a-second beat: the three requests may beat it.
    assert wait_for(lambda: _stats(pool)["checkpoint_bytes"] > 0, 10, "checkpoint bytes")
