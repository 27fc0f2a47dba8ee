"""The router's command batch (router/redis_batch.py) on a real Redis: each caller gets its own
reply in order, a command's own error is its alone, a script Redis forgot runs once as EVAL,
and a lost connection fails only the commands it carried."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis

from mlxcel_pool.redis_server import EmbeddedRedis
from router.redis_batch import RedisBatch
from shared.config import RedisConfig
from shared.redis_clients import async_client


def _run(redis_url: str, body: Callable[[RedisBatch, Any], Awaitable[Any]]) -> Any:
    async def run() -> Any:
        aredis = async_client(RedisConfig(url=redis_url))
        batch = RedisBatch(aredis)
        try:
            return await body(batch, aredis)
        finally:
            await batch.stop()
            await aredis.aclose()

    return asyncio.run(run())


def test_commands_issued_together_get_their_own_replies_in_order(redis_url: str) -> None:
    async def body(batch: RedisBatch, _: Any) -> list[Any]:
        return await asyncio.gather(*[batch.call("INCR", "counter") for _ in range(50)])

    assert _run(redis_url, body) == list(range(1, 51))


def test_a_commands_own_error_is_its_alone(redis_url: str) -> None:
    redis.Redis.from_url(redis_url).set("text", "not a number")

    async def body(batch: RedisBatch, _: Any) -> list[Any]:
        return await asyncio.gather(
            batch.call("SET", "a", "1"),
            batch.call("INCR", "text"),
            batch.call("GET", "a"),
            return_exceptions=True,
        )

    ok, failed, got = _run(redis_url, body)
    assert ok == b"OK" and got == b"1"
    assert isinstance(failed, redis.ResponseError) and "not an integer" in str(failed)


def test_an_argument_resp_cannot_carry_is_the_callers_error_alone(redis_url: str) -> None:
    async def body(batch: RedisBatch, _: Any) -> Any:
        fine = batch.call("SET", "a", "1")
        with pytest.raises(TypeError):
            batch.call("SET", "b", None)  # type: ignore[arg-type]
        return await fine

    assert _run(redis_url, body) == b"OK"
    assert redis.Redis.from_url(redis_url).exists("b") == 0


def test_a_script_redis_forgot_runs_once_as_eval(
    redis_url: str, redis_server: EmbeddedRedis
) -> None:
    async def body(batch: RedisBatch, aredis: Any) -> tuple[Any, Any]:
        script = aredis.register_script("return redis.call('INCR', KEYS[1])")
        first = await batch.script(script, ["runs"], [])
        redis.Redis.from_url(redis_server.admin_url).script_flush()
        return first, await batch.script(script, ["runs"], [])

    assert _run(redis_url, body) == (1, 2)
    assert redis.Redis.from_url(redis_url).get("runs") == b"2"  # never twice


def test_a_lost_connection_fails_what_it_carried_and_the_next_write_reconnects(
    redis_url: str, redis_server: EmbeddedRedis
) -> None:
    admin = redis.Redis.from_url(redis_server.admin_url)

    async def body(batch: RedisBatch, _: Any) -> tuple[Any, Any]:
        blocked = batch.call("BLPOP", "nothing", 30)
        deadline = time.monotonic() + 5
        while not [c for c in admin.client_list() if c.get("cmd") == "blpop"]:
            assert time.monotonic() < deadline, "the BLPOP never reached Redis"
            await asyncio.sleep(0.02)
        admin.client_kill_filter(_type="normal", skipme=True)
        lost = await asyncio.gather(blocked, return_exceptions=True)
        return lost[0], await batch.call("PING")

    lost, pong = _run(redis_url, body)
    assert isinstance(lost, redis.ConnectionError)
    assert pong == b"PONG"


def test_a_connection_redis_closed_while_idle_is_replaced_before_the_next_write(
    redis_url: str, redis_server: EmbeddedRedis
) -> None:
    """A restart or a kill between writes: the next write finds the socket closed and goes out
    on a new connection instead of failing."""
    admin = redis.Redis.from_url(redis_server.admin_url)

    async def body(batch: RedisBatch, _: Any) -> list[Any]:
        first = await batch.call("INCR", "n")
        admin.client_kill_filter(_type="normal", skipme=True)
        await asyncio.sleep(0.1)
        return [first, await batch.call("INCR", "n")]

    assert _run(redis_url, body) == [1, 2]


def test_a_stopped_batch_fails_waiting_and_later_commands_at_once(redis_url: str) -> None:
    async def body(batch: RedisBatch, _: Any) -> list[Any]:
        blocked = batch.call("BLPOP", "nothing", 30)
        await asyncio.sleep(0.2)
        await batch.stop()
        later = batch.call("PING")
        return await asyncio.gather(blocked, later, return_exceptions=True)

    started = time.monotonic()
    outcomes = _run(redis_url, body)
    assert time.monotonic() - started < 10
    assert all(isinstance(o, redis.ConnectionError) for o in outcomes), outcomes


@pytest.mark.parametrize("protocol", [2, 3])
def test_replies_are_raw_under_either_protocol(redis_url: str, protocol: int) -> None:
    async def body(batch: RedisBatch, _: Any) -> list[Any]:
        await batch.call("HSET", "h", "f", "v")
        return await asyncio.gather(batch.call("HGET", "h", "f"), batch.call("HGETALL", "h"))

    got, whole = _run(f"{redis_url}?protocol={protocol}", body)
    assert got == b"v"
    assert whole in ([b"f", b"v"], {b"f": b"v"})
