"""The event loop's hot-path Redis commands, pipelined on one connection.

Every request costs the router a few small commands of its own (its start and release scripts,
its stream's DEL, the stream hub's wake). Sent one by one through redis-py's asyncio client, the
client's own machinery (the pool, the retry wrapper, the timeouts, one write and one wake-up a
command) cost many times the command. Here every command asked for while the previous write is
on its way goes out in the next write, as one pipeline; the replies are read back in order and
each caller's await gets its own, or its own error.

A command is sent once, never retried: a lost connection fails every command of that write with
the ConnectionError (Redis may have applied them), as redis-py's client does for a command it
must not retry. A script Redis does not know (NOSCRIPT: it did not run) is sent again whole.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from router.cancellation import stop_if_cancelled

log = logging.getLogger(__name__)

Arg = str | bytes | int | float


@dataclass(slots=True)
class _Call:
    args: tuple[Arg, ...]
    reply: asyncio.Future[Any]
    script: AsyncScript | None = None  # an EVALSHA: sent again as EVAL on NOSCRIPT


class RedisBatch:
    """One connection of `aredis`'s pool, held while the batch runs; `call`/`script` from the
    event loop only. Its task starts with the first command and ends at stop()."""

    def __init__(self, aredis: aioredis.Redis) -> None:
        self._pool = aredis.connection_pool
        self._waiting: list[_Call] = []
        self._in_flight: list[_Call] = []
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        self._conn: Any = None

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
        stopping = redis.ConnectionError("the router is stopping")
        for call in (*self._in_flight, *self._waiting):
            if not call.reply.done():
                call.reply.set_exception(stopping)
        self._waiting, self._in_flight = [], []
        await self._drop()

    def call(self, *args: Arg) -> asyncio.Future[Any]:
        """One command; the future holds its reply (raw bytes) or its error."""
        return self._add(_Call(args, asyncio.get_running_loop().create_future()))

    def script(
        self, script: AsyncScript, keys: Sequence[Arg], args: Sequence[Arg]
    ) -> asyncio.Future[Any]:
        """A registered script's EVALSHA (its EVAL when Redis no longer has it)."""
        call = _Call(
            ("EVALSHA", script.sha, len(keys), *keys, *args),
            asyncio.get_running_loop().create_future(),
            script,
        )
        return self._add(call)

    def _add(self, call: _Call) -> asyncio.Future[Any]:
        if self._stopped:
            call.reply.set_exception(redis.ConnectionError("the router is stopping"))
            return call.reply
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="redis-batch")
        self._waiting.append(call)
        self._ready.set()
        return call.reply

    async def _run(self) -> None:
        while True:
            stop_if_cancelled()
            if not self._waiting:
                self._ready.clear()
                await self._ready.wait()
            self._in_flight, self._waiting = self._waiting, []
            try:
                again = await self._send(self._in_flight)
            except Exception as exc:  # never a caller left waiting on a reply that cannot come
                await self._fail(self._in_flight, exc)
                again = []
            self._in_flight = []
            # Scripts Redis did not know go first in the next write, in their order.
            self._waiting[:0] = again

    async def _send(self, calls: list[_Call]) -> list[_Call]:
        """One write of every call, and their replies; the NOSCRIPT ones, as EVALs, returned."""
        again: list[_Call] = []
        try:
            if self._conn is None:
                self._conn = await self._pool.get_connection()
            conn = self._conn
            await conn.send_packed_command(
                conn.pack_commands([c.args for c in calls]), check_health=False
            )
        except (redis.RedisError, OSError) as exc:
            await self._fail(calls, exc)
            return again
        for i, call in enumerate(calls):
            try:
                reply = await conn.read_response(disable_decoding=True)
            except NoScriptError:
                assert call.script is not None
                script = call.script
                call.args = ("EVAL", script.script, *call.args[2:])
                call.script = None
                again.append(call)
                continue
            except redis.ResponseError as exc:  # this command's own error: the rest follow
                if not call.reply.done():
                    call.reply.set_exception(exc)
                continue
            except (redis.RedisError, OSError) as exc:
                await self._fail(calls[i:], exc)
                return again
            if not call.reply.done():  # its caller may have stopped waiting
                call.reply.set_result(reply)
        return again

    async def _fail(self, calls: list[_Call], exc: BaseException) -> None:
        log.warning("redis batch: %d command(s) failed: %s", len(calls), exc)
        error = exc if isinstance(exc, redis.RedisError) else redis.ConnectionError(repr(exc))
        for call in calls:
            if not call.reply.done():
                call.reply.set_exception(error)
        await self._drop()

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with suppress(Exception):
                await conn.disconnect()
            with suppress(Exception):
                await self._pool.release(conn)
