"""One reader per router process for every request's stream.

Each streaming request used to hold its own blocked XREAD: one Redis connection and one command
per request per decode step. The hub issues ONE `XREAD BLOCK` over all active request streams and
hands each entry to its subscriber's queue, so a step of a 16-sequence batch costs the router one
read, not sixteen, and connections no longer grow with the number of open streams.

A blocked XREAD cannot learn of a new stream, so a new subscription XADDs to this process's own
wake stream, which every read includes.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import suppress
from dataclasses import dataclass, field

import redis

from shared import keys
from shared.config import RedisConfig
from shared.redis_clients import async_client

log = logging.getLogger(__name__)

BLOCK_MS = 1000
READ_COUNT = 512
RETRY_S = 0.5

Entry = tuple[bytes, dict[bytes, bytes]]


@dataclass
class _Subscription:
    last_id: bytes | str = "0-0"
    queue: asyncio.Queue[Entry] = field(default_factory=asyncio.Queue)


class StreamHub:
    def __init__(self, config: RedisConfig) -> None:
        # The blocking read has a client of its own (its block is far below the client's stall
        # bound, so it never times out early); wake-ups go through another.
        self._reader = async_client(config)
        self._writer = async_client(config)
        self._wake_key = keys.router_wake(uuid.uuid4().hex)
        self._wake_last: bytes | str = "$"
        self._subs: dict[str, _Subscription] = {}
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stream-hub")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        with suppress(redis.RedisError):
            await self._writer.delete(self._wake_key)
        await self._reader.aclose()
        await self._writer.aclose()

    async def subscribe(self, stream: str) -> asyncio.Queue[Entry]:
        sub = self._subs.setdefault(stream, _Subscription())
        self._changed.set()
        # MULTI/EXEC: the wake stream never exists without its TTL, even if this connection drops
        # between the two commands.
        async with self._writer.pipeline(transaction=True) as pipe:
            pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1)
            pipe.expire(self._wake_key, keys.REQUEST_TTL_S)
            await pipe.execute()
        return sub.queue

    def unsubscribe(self, stream: str) -> None:
        self._subs.pop(stream, None)

    async def _run(self) -> None:
        while True:
            if not self._subs:
                self._changed.clear()
                await self._changed.wait()
            streams: dict[str, bytes | str] = {self._wake_key: self._wake_last}
            streams.update({k: s.last_id for k, s in self._subs.items()})
            try:
                reply = await self._reader.xread(streams, count=READ_COUNT, block=BLOCK_MS)
            except redis.RedisError as exc:  # Redis restarting: keep trying, requests time out
                log.warning("stream hub: XREAD failed (%s); retrying", exc)
                await asyncio.sleep(RETRY_S)
                continue
            self._dispatch(reply or [])

    def _dispatch(self, reply: list[tuple[bytes, list[Entry]]]) -> None:
        for raw_key, entries in reply:
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            if key == self._wake_key:
                self._wake_last = entries[-1][0]
                continue
            sub = self._subs.get(key)
            if sub is None:
                continue
            for entry in entries:
                sub.queue.put_nowait(entry)
            sub.last_id = entries[-1][0]
