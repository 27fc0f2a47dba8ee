"""The event loop's hot-path Redis commands, pipelined on one connection.

Every request costs the router a few small commands of its own (its start and release scripts,
its stream's DEL, the stream hub's wake). Sent one by one through redis-py's asyncio client, the
client's own machinery (the pool, the retry wrapper, the timeouts, one write and one wake-up a
command) cost many times the command. Here every command asked for while the previous write is
on its way goes out in the next write, as one pipeline; the replies are read back in order and
each caller's await gets its own, or its own error.

A command Redis may have read is never sent again: a connection lost while its replies are
read fails every command of that write with the ConnectionError (Redis may have applied them).
A write that could not be sent at all (no connection, Redis restarting) is tried again on a new
one, and a script Redis does not know (NOSCRIPT: it did not run) is sent again as EVAL.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import hiredis
import redis
import redis.asyncio as aioredis
from redis.commands.core import AsyncScript, Script
from redis.exceptions import NoScriptError

from router.cancellation import stop_if_cancelled

log = logging.getLogger(__name__)

Arg = str | bytes | int | float

# A write that could not be sent (no connection: Redis restarting) is tried again this many
# times in all, after 10, 20, 40 ms: the commands never reached Redis, so nothing runs twice.
SEND_TRIES = 4
SEND_BACKOFF_S = 0.01


@dataclass(slots=True)
class _Call:
    args: tuple[Arg, ...]
    reply: asyncio.Future[Any]
    script: AsyncScript | Script | None = None  # an EVALSHA: sent again as EVAL on NOSCRIPT
    # The command as RESP, packed by hiredis (redis-py's own packing cost several times more
    # for a command of many arguments: a prompt's block members).
    packed: bytes = b""

    def pack(self) -> None:
        """Raises TypeError (to the caller) for an argument RESP cannot carry."""
        self.packed = hiredis.pack_command(self.args)


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
        self, script: AsyncScript | Script, keys: Sequence[Arg], args: Sequence[Arg]
    ) -> asyncio.Future[Any]:
        """A registered script's EVALSHA (its EVAL when Redis no longer has it), from either
        client's register_script: only its sha and text are used."""
        call = _Call(
            ("EVALSHA", script.sha, len(keys), *keys, *args),
            asyncio.get_running_loop().create_future(),
            script,
        )
        return self._add(call)

    async def transaction(self, commands: Sequence[Sequence[Arg]]) -> Any:
        """The commands between MULTI and EXEC, side by side in one write; EXEC's reply, or the
        first error (a command Redis refused, EXECABORT, a lost connection)."""
        replies = await asyncio.gather(
            self.call("MULTI"),
            *[self.call(*command) for command in commands],
            self.call("EXEC"),
            return_exceptions=True,
        )
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        for reply in replies[-1] or ():  # a command that failed when EXEC ran it
            if isinstance(reply, BaseException):
                raise reply
        return replies[-1]

    def _add(self, call: _Call) -> asyncio.Future[Any]:
        call.pack()
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
        packed = b"".join([c.packed for c in calls])
        for attempt in range(SEND_TRIES):
            try:
                conn = await self._connection()
                await conn.send_packed_command(packed, check_health=False)
                break
            except (redis.ConnectionError, OSError) as exc:
                # Not sent (no connection, or Redis had closed this one): sent on a new one.
                await self._drop()
                if attempt + 1 == SEND_TRIES:
                    await self._fail(calls, exc)
                    return again
                await asyncio.sleep(SEND_BACKOFF_S * 2**attempt)
            except redis.RedisError as exc:
                await self._fail(calls, exc)
                return again
        # One stall bound for the whole write's replies (a read's own would cost a timeout
        # context a reply): math.inf tells redis-py not to set its own.
        try:
            async with asyncio.timeout(conn.socket_timeout):
                return await self._replies(conn, calls, again)
        except TimeoutError:
            stalled = redis.TimeoutError("Timeout reading the command batch's replies")
            await self._fail(calls, stalled)
            return again

    async def _replies(self, conn: Any, calls: list[_Call], again: list[_Call]) -> list[_Call]:
        for i, call in enumerate(calls):
            try:
                reply = await conn.read_response(disable_decoding=True, timeout=math.inf)
            except NoScriptError:
                assert call.script is not None
                script = call.script
                call.args = ("EVAL", script.script, *call.args[2:])
                call.script = None
                call.pack()
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

    async def _connection(self) -> Any:
        """The held connection, or a new one from the pool when there is none or Redis closed
        it meanwhile (a restart: its end of the socket reads as EOF before any send)."""
        conn = self._conn
        if conn is not None:
            try:
                stale = await conn.can_read()
            except (redis.RedisError, OSError):
                stale = True
            if stale:
                await self._drop()
                conn = None
        if conn is None:
            conn = self._conn = await self._pool.get_connection()
        return conn

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
