"""A client that leaves is let go, streaming or not: within a step of its leaving, or (not
streaming) of the router's next read of its stream, which the worker writes every 0.25 s for a
client that reads nothing before the end. Its job is cancelled in rq and the worker stops
generating for it, instead of running to max_tokens for nobody.
Real pool (embedded Redis, router, one worker), real HTTP clients that hang up."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
import redis
from rq.job import Job
from rq.registry import CanceledJobRegistry, FinishedJobRegistry, StartedJobRegistry

from shared import keys
from shared.wire import MsgpackSerializer
from tests.pool_fixture import wait_for
from tests.streams import pool_queues

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

KW = {"serializer": MsgpackSerializer}
# Far more than the worker makes before the client hangs up (this prompt never reaches EOS).
MAX_TOKENS = 1900


@pytest.fixture(scope="module")
def pool(shared_pool: Any) -> Any:
    return shared_pool  # the session's pool: this module needs no settings of its own


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_hangs_up_is_let_go(pool: Any, stream: bool) -> None:
    r = redis.Redis.from_url(pool.redis_url)
    model = httpx.get(f"{pool.url}/health", timeout=10).json()["model"]
    body = {
        "model": model,
        "prompt": "The quick brown fox",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    registries = [
        cls(queue, connection=r, **KW)
        for cls in (StartedJobRegistry, CanceledJobRegistry, FinishedJobRegistry)
        for queue in pool_queues()
    ]

    def jobs() -> set[str]:
        return {job_id for registry in registries for job_id in registry.get_job_ids()}

    before = jobs()

    def generated() -> int:  # the worker's completion tokens so far (the pool is shared)
        return int(r.hget(keys.worker_cache_counters("w1"), "completion_tokens") or 0)

    tokens_before = generated()

    def impatient_client() -> None:
        # Non-streaming: it gives up waiting for the body; streaming: it reads a chunk and
        # hangs up. Either way the connection closes while the worker is still generating.
        with httpx.Client(timeout=httpx.Timeout(10, read=0.25)) as client:
            try:
                with client.stream("POST", f"{pool.url}/v1/completions", json=body) as resp:
                    next(resp.iter_bytes())
            except httpx.ReadTimeout:
                pass

    thread = threading.Thread(target=impatient_client)
    thread.start()
    thread.join(30)
    hung_up = time.monotonic()
    # The job, in whichever registry it is now (a streaming one may be cancelled already).
    (job_id,) = wait_for(lambda: jobs() - before, 10, "its job")
    job = Job.fetch(job_id, connection=r, **KW)
    wait_for(lambda: job.get_status() in ("canceled", "finished"), 30, "its job to end")
    assert job.get_status() == "canceled", (job.get_status(), time.monotonic() - hung_up)
    # Let go within a step or two of the router noticing, not after MAX_TOKENS tokens.
    assert time.monotonic() - hung_up < 3
    assert job.id not in registries[0].get_job_ids()
    tokens = wait_for(lambda: generated() - tokens_before, 10, "counters")
    assert tokens < MAX_TOKENS
