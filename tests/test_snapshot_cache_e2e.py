"""A model whose KV cache cannot be cut back (sliding-window layers): the worker's load-time check
says so, and its prompt cache restores whole-prefix snapshots only, giving the cold run's output."""

from __future__ import annotations

from pathlib import Path

import httpx
import redis

from shared import keys
from tests.conftest import MlxReference
from tests.pool_fixture import running_pool
from tests.streams import enqueue, generated_tokens, read_events

MODEL = "mlxcel-tiny-swa"


def test_snapshot_restore_through_the_pool(tiny_swa_model_dir: Path, tmp_path: Path) -> None:
    with running_pool(tiny_swa_model_dir, tmp_path) as pool:
        health = httpx.get(f"{pool.url}/health", timeout=10).json()
        stats = httpx.get(f"{pool.url}/v1/cache/stats", timeout=10).json()
        assert stats["cacheability"] == "snapshot" and stats["storage_mode"] == "snapshot"
        assert "snapshot" in str(health)

        r = redis.Redis.from_url(pool.redis_url)
        prompt = [10 + (i * 11) % 700 for i in range(80)]
        first = read_events(r, enqueue(r, prompt, max_tokens=6, queue=keys.model_queue_name(MODEL)))
        history = prompt + generated_tokens(first)  # the snapshot holds exactly these tokens

        def complete(tokens: list[int]) -> dict:
            resp = httpx.post(
                f"{pool.url}/v1/completions",
                timeout=60,
                json={"model": MODEL, "prompt": tokens, "max_tokens": 10, "temperature": 0},
            )
            assert resp.status_code == 200, resp.text
            return resp.json()

        # Not a whole-prefix match (diverges inside the snapshot): nothing can be restored.
        partial = complete(prompt[:60] + [5, 6, 7])
        assert partial["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        follow_up = history + [20, 21, 22, 23]
        out = complete(follow_up)
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == len(history)
        want_text, _ = MlxReference(tiny_swa_model_dir).run(follow_up, 10)
        assert out["choices"][0]["text"] == want_text
        stats = httpx.get(f"{pool.url}/v1/cache/stats", timeout=10).json()
        assert stats["snapshot_hits"] == 1 and stats["snapshot_inserts"] >= 1
