"""Redis clients as the pool makes them: a connection that Redis dropped (a restart, an idle
timeout) is retried on a fresh one, a few times with a short backoff, instead of failing the
call. redis-py's synchronous client does this by default; its asyncio client did not for
pipelines (the first pipeline after a Redis restart failed), so both get it here."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

RETRIES = 3
_RETRY_ON = [redis.ConnectionError, redis.TimeoutError]


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=0.5, base=0.01)


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, retry=Retry(_backoff(), RETRIES), retry_on_error=_RETRY_ON)


def async_client(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        url, retry=AsyncRetry(_backoff(), RETRIES), retry_on_error=_RETRY_ON
    )
