"""The event loop's hot-path Redis commands, pipelined: one write at a time, on a connection of
the pool.

Every request costs the router a few small commands of its own (its start and release scripts,
its stream's DEL, the stream hub's wake). Sent one by one through redis-py's asyncio client, the
client's own machinery (the pool, the retry wrapper, the timeouts, one write and one wake-up a
command) cost many times the command. Here every command asked for while the previous write is
on its way goes out in the next write, as one pipeline; the replies are read back in order and
each caller's await gets its own, or its own error.

A command Redis may have run is never sent again: a connection lost while a write goes out or
its replies are read fails every command of that write not answered yet with the
ConnectionError (Redis may have applied them). What Redis cannot have run is: a write that
found no connection (Redis restarting) waits and tries again, a script Redis does not know
(NOSCRIPT) is sent again as EVAL, and a write a demoted primary refused (READONLY: the primary
moved under the connection) is sent once more, to the new one.
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
from redis.exceptions import NoScriptError, ReadOnlyError

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
    resent: bool = False  # sent once more after a demoted primary refused it

    def pack(self) -> None:
        """Raises TypeError (to the caller) for an argument RESP cannot carry."""
        self.packed = hiredis.pack_command(self.args)


async def _fresh(conn: Any) -> None:
    """Reconnect a connection Redis closed while it sat in the pool (a restart, a kill): its
    socket reads as EOF before any send. redis-py's pool checks this only with maintenance
    notifications off, and leaves the rest to its retry, which the batch does not make."""
    try:
        stale = await conn.can_read()
    except (redis.RedisError, OSError):
        stale = True
    if stale:
        await conn.disconnect()
        await conn.connect()


def _refused_by_replica(exc: BaseException) -> bool:
    """Whether a lost connection is redis-py's (or shared.redis_clients') answer to READONLY:
    a primary demoted under the connection refused the write."""
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, ReadOnlyError):  # a plain command's (redis-py strips the prefix)
        return True
    return isinstance(cause, redis.ResponseError) and "READONLY" in str(cause)  # a script's


class RedisBatch:
    """A connection of `aredis`'s pool a write, taken and given back; `call`/`script` from
    the event loop only. Its task starts with the first command and ends at stop()."""

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
        loop = asyncio.get_running_loop()
        calls = [_Call(tuple(c), loop.create_future()) for c in (("MULTI",), *commands, ("EXEC",))]
        for call in calls:  # all packed before any is added: never a MULTI without its EXEC
            call.pack()
        replies = await asyncio.gather(*[self._add(c) for c in calls], return_exceptions=True)
        for reply in replies:
            if isinstance(reply, BaseException):
                raise reply
        for reply in replies[-1] or ():  # a command that failed when EXEC ran it
            if isinstance(reply, BaseException):
                raise reply
        return replies[-1]

    def _add(self, call: _Call) -> asyncio.Future[Any]:
        if not call.packed:
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
            # What goes again goes first in the next write, in its order.
            self._waiting[:0] = again

    async def _send(self, calls: list[_Call]) -> list[_Call]:
        """One write of every call, and their replies; the calls to send again (NOSCRIPT ones
        as EVALs, and those a demoted primary refused) returned. The connection comes from the
        pool and goes back to it each write, so the pool's own checks hold: a socket Redis
        closed is replaced, and a Sentinel pool follows the primary when it moves."""
        again: list[_Call] = []
        for attempt in range(SEND_TRIES):
            try:
                if self._conn is None:
                    self._conn = await self._pool.get_connection()
                await _fresh(self._conn)
                break
            except (redis.ConnectionError, OSError) as exc:  # nothing was sent: try again
                if attempt + 1 == SEND_TRIES:
                    await self._fail(calls, exc)
                    return again
                await asyncio.sleep(SEND_BACKOFF_S * 2**attempt)
        conn = self._conn
        try:
            # A failed write may have reached Redis in part: from here nothing is sent again
            # but what Redis refused. One stall bound covers the write and all its replies (a
            # read's own would cost a timeout context a reply: math.inf tells redis-py not to
            # set its own); the write goes straight to the connection's stream (redis-py's send
            # wraps it in a task and a timer of its own).
            async with asyncio.timeout(conn.socket_timeout):
                conn._writer.write(b"".join([c.packed for c in calls]))
                await conn._writer.drain()
                await self._replies(conn, calls, again)
        except (TimeoutError, redis.RedisError, OSError) as exc:
            if isinstance(exc, TimeoutError) and not isinstance(exc, redis.RedisError):
                exc = redis.TimeoutError("Timeout writing the command batch or reading its replies")
            elif isinstance(exc, OSError):
                exc = redis.ConnectionError(f"Error writing the command batch: {exc!r}")
            going = {id(c) for c in again}  # not run: they go again, not fail
            # _fail drops the connection: replies still due on it are never read as a later
            # write's.
            await self._fail([c for c in calls if id(c) not in going], exc)
            return again
        self._conn = None
        await self._pool.release(conn)
        return again

    async def _replies(self, conn: Any, calls: list[_Call], again: list[_Call]) -> None:
        """Each call's reply to its future, in order; raises what ends the write (the calls
        not answered yet fail with it), having moved to `again` the ones to send again."""
        for i, call in enumerate(calls):
            try:
                reply = await conn.read_response(disable_decoding=True, timeout=math.inf)
            except NoScriptError:
                assert call.script is not None
                call.args = ("EVAL", call.script.script, *call.args[2:])
                call.script = None
                call.pack()
                if not call.reply.done():  # its caller may have stopped waiting
                    again.append(call)
                continue
            except redis.ResponseError as exc:  # this command's own error: the rest follow
                if not call.reply.done():
                    call.reply.set_exception(exc)
                continue
            except redis.ConnectionError as exc:
                if _refused_by_replica(exc):
                    # The primary moved: this write went to a replica, which ran none of its
                    # commands (every one writes). Sent once more, to the new primary.
                    again += [c for c in calls[i:] if not c.resent and not c.reply.done()]
                    for c in calls[i:]:
                        c.resent = True
                raise
            if not call.reply.done():  # its caller may have stopped waiting
                call.reply.set_result(reply)

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
