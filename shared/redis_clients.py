"""Redis clients as the pool makes them: never a blind retry, a stall bound, a blocking pool.

- No command is retried after a timeout: Redis may already have applied it, and an XADD
  pipeline or an enqueue applied twice is what turns into duplicated text. A dropped
  connection (a restart, an idle timeout) is retried on a fresh one, a few times with a short
  backoff (redis-py's asyncio client did not do this for pipelines, so both get it here).
- The socket timeout is the stall bound (`redis.stall_timeout_s`): a Redis that answers
  nothing for that long fails the command, and the requests it carried end with a clear
  error. Every blocking read in the pool blocks for much less, so none times out early.
- The connection pool blocks: a caller past `redis.max_connections` waits for a free
  connection, up to the stall bound, instead of failing as if Redis were down.
- A `redis+sentinel://` URL (shared.redis_sentinel) names a Sentinel-managed primary: the same
  options and the same blocking bound (redis-py's Sentinel pool, made blocking here), and each
  new connection asks a sentinel where the primary is; a pool also asks every FOLLOW_S, since
  after a manual failover the old primary stays writable until a sentinel demotes it (seconds
  later), and what is written there is lost. Connections to the old primary fail, or, demoted,
  answer READONLY (a script's refused write too), which is a ConnectionError here: nothing was
  applied. Either way the next connection goes to the new primary.
- The worker's client (`report_failover`) reports a failover as a lost connection, as a
  restart is, even where every command could move on unharmed: once the pool knows the primary
  moved, the next command of the thread that made it (the worker's loop, which takes the jobs)
  raises ConnectionError, once, unless that thread's last command lost its connection already
  (it is reconnecting: it knows); its other threads move on. The new primary may lack the old
  one's last writes (replication is asynchronous): a job's start, a stream's last entries. A
  worker that merely moved on could take such a job again and run it twice; on the error it
  drops what runs and registers again, exactly as after a restart (worker.loop). The router's
  clients move on silently: a request whose job or events the old primary took along ends
  with the error the router already gives for that (the job gone, a gap in its events).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.sentinel as aiosentinel
import redis.sentinel
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from shared.config import RedisConfig
from shared.redis_sentinel import SentinelTarget, is_sentinel_url, parse_sentinel_url

log = logging.getLogger(__name__)

RETRIES = 3
CONNECT_TIMEOUT_S = 5.0
_RETRY_ON: tuple[type[Exception], ...] = (redis.ConnectionError,)


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=0.5, base=0.01)


def _options(config: RedisConfig) -> dict[str, Any]:
    return {
        "max_connections": config.max_connections,
        "timeout": config.stall_timeout_s,  # how long a caller waits for a free connection
        "socket_timeout": config.stall_timeout_s,
        "socket_connect_timeout": min(CONNECT_TIMEOUT_S, config.stall_timeout_s),
        "retry_on_error": list(_RETRY_ON),
    }


def sync_client(config: RedisConfig, report_failover: bool = False) -> redis.Redis:
    """`report_failover` (the worker's): on a Sentinel URL, a primary that moved raises
    ConnectionError once in the calling thread (see the module's doc)."""
    retry = Retry(_backoff(), RETRIES, supported_errors=_RETRY_ON)
    if is_sentinel_url(config.url):
        target = parse_sentinel_url(config.url)
        sentinel = redis.sentinel.Sentinel(
            target.sentinels,
            sentinel_kwargs=_sentinel_options(config, target, Retry(_backoff(), 1, _RETRY_ON)),
        )
        return sentinel.master_for(
            target.service_name,
            connection_pool_class=_BlockingSentinelPool,
            connection_class=_SentinelConnection,
            retry=retry,
            report_failover=report_failover,
            **_primary_options(target),
            **_options(config),
        )
    pool = redis.BlockingConnectionPool.from_url(config.url, retry=retry, **_options(config))
    return redis.Redis(connection_pool=pool)


def async_client(config: RedisConfig) -> aioredis.Redis:
    retry = AsyncRetry(_backoff(), RETRIES, supported_errors=_RETRY_ON)
    if is_sentinel_url(config.url):
        target = parse_sentinel_url(config.url)
        sentinel = aiosentinel.Sentinel(
            target.sentinels,
            sentinel_kwargs=_sentinel_options(config, target, AsyncRetry(_backoff(), 1, _RETRY_ON)),
        )
        return sentinel.master_for(
            target.service_name,
            connection_pool_class=_AsyncBlockingSentinelPool,
            connection_class=_AsyncSentinelConnection,
            retry=retry,
            **_primary_options(target),
            **_options(config),
        )
    pool = aioredis.BlockingConnectionPool.from_url(config.url, retry=retry, **_options(config))
    return aioredis.Redis(connection_pool=pool)


# -- Sentinel ------------------------------------------------------------------------------

# How often a pool asks a sentinel whether the primary moved, though no new connection needs it:
# after a manual failover the old primary stays writable until its sentinel demotes it (seconds
# later), and writes a pool kept sending there would be lost.
FOLLOW_S = 1.0
# A check that found no primary and took longer (sentinels that do not answer) is not made
# in-line again for a while: the caller that made it waited for it.
SLOW_FOLLOW_S = 0.5
SLOW_FOLLOW_PAUSE_S = 30.0
# The sentinels' own clients: a sentinel answers at once, or is down and the next is asked.
SENTINEL_TIMEOUT_S = 1.0
# A script's write refused by a demoted primary: redis-py's Sentinel connection only knows the
# READONLY reply of a plain command.
_SCRIPT_READONLY = "READONLY You can't write against a read only replica"


class _SentinelConnection(redis.sentinel.SentinelManagedConnection):
    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if self.connection_pool.is_master and _SCRIPT_READONLY in str(exc):
                self.disconnect()  # nothing was written: as a connection lost, retried
                raise redis.ConnectionError("the previous primary is now a replica") from exc
            raise


class _AsyncSentinelConnection(aiosentinel.SentinelManagedConnection):
    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except redis.ResponseError as exc:
            if self.connection_pool.is_master and _SCRIPT_READONLY in str(exc):
                await self.disconnect()
                raise redis.ConnectionError("the previous primary is now a replica") from exc
            raise


class _Follow:
    """When a pool next asks where the primary is, the primary it last knew, and
    (report_failover) the one the thread that made the pool last saw."""

    def __init__(self, report_failover: bool = False) -> None:
        self.next_at = 0.0
        self.known: tuple[str, int] | None = None
        self.owner = threading.get_ident() if report_failover else None
        self.primary: tuple[str, int] | None = None
        self.owner_ok = True  # the owner's last command kept its connection: it lost nothing

    def due(self) -> float | None:
        """The time a check starts, if one is due now (it is planned FOLLOW_S on)."""
        now = time.monotonic()
        if now < self.next_at:
            return None
        self.next_at = now + FOLLOW_S
        return now

    def failed(self, started: float) -> None:
        """A check that found no primary; one that also took long (sentinels that do not
        answer) is not made in-line again for a while: its caller waited for it."""
        if time.monotonic() - started > SLOW_FOLLOW_S:
            self.next_at = time.monotonic() + SLOW_FOLLOW_PAUSE_S

    def released(self, connected: bool) -> None:
        if self.owner == threading.get_ident():
            self.owner_ok = connected

    def report(self, address: tuple[str, int] | None) -> None:
        """Log a primary that moved; with report_failover, raise ConnectionError once, in the
        thread that made the pool, for a primary that moved since that thread last used it,
        unless its last command already lost its connection (it knows; see the module's
        doc)."""
        if address is None:
            return
        if address != self.known:
            if self.known is not None:
                log.warning(
                    "Redis primary moved (Sentinel failover): %s", _moved(self.known, address)
                )
            self.known = address
        if self.owner != threading.get_ident() or address == self.primary:
            return
        before, self.primary = self.primary, address
        if before is not None and self.owner_ok:
            raise redis.ConnectionError(
                f"the Redis primary moved (Sentinel failover): {_moved(before, address)}"
            )


def _moved(before: tuple[str, int], after: tuple[str, int]) -> str:
    return f"{before[0]}:{before[1]} -> {after[0]}:{after[1]}"


class _BlockingSentinelPool(redis.sentinel.SentinelConnectionPool, redis.BlockingConnectionPool):
    """redis-py's Sentinel pool (it asks where the primary is for each new connection, drops its
    idle connections when the answer changes and busy ones when they come back) with the
    blocking pool's wait for a free connection, asking at least every FOLLOW_S and reporting a
    move (_Follow.report); closing it closes the sentinels' clients too."""

    def __init__(self, *args: Any, report_failover: bool = False, **kwargs: Any) -> None:
        self.follow = _Follow(report_failover)
        super().__init__(*args, **kwargs)

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        started = self.follow.due()
        if started is not None:
            try:
                self.get_master_address()
            except (redis.ConnectionError, redis.TimeoutError):  # the connect will say so
                self.follow.failed(started)
        self.follow.report(self.master_address)
        return super().get_connection(*args, **kwargs)

    def release(self, connection: Any) -> None:
        self.follow.released(connection.is_connected)
        super().release(connection)

    def close(self) -> None:
        super().close()
        self.sentinel_manager.close()


class _AsyncBlockingSentinelPool(
    aiosentinel.SentinelConnectionPool, aioredis.BlockingConnectionPool
):
    """As _BlockingSentinelPool. redis-py's asyncio pool keeps a connection to the old primary
    that comes back after the primary moved; this one drops it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.follow = _Follow()
        super().__init__(*args, **kwargs)

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        started = self.follow.due()
        if started is not None:
            try:
                await self.get_master_address()
            except (redis.ConnectionError, redis.TimeoutError):
                self.follow.failed(started)
        self.follow.report(self.master_address)
        return await super().get_connection(*args, **kwargs)

    async def release(self, connection: Any) -> None:
        address = self.master_address
        moved = address is not None and (connection.host, connection.port) != address
        if moved and connection.is_connected:
            await connection.disconnect()  # the old primary's: the next use asks a sentinel
        await super().release(connection)

    async def aclose(self) -> None:
        await super().aclose()
        await self.sentinel_manager.aclose()


def _primary_options(target: SentinelTarget) -> dict[str, Any]:
    return {"db": target.db, "username": target.username, "password": target.password}


def _sentinel_options(config: RedisConfig, target: SentinelTarget, retry: Any) -> dict[str, Any]:
    quick = min(SENTINEL_TIMEOUT_S, config.stall_timeout_s)
    return {
        "socket_timeout": quick,
        "socket_connect_timeout": quick,
        "username": target.sentinel_username,
        "password": target.sentinel_password,
        "retry": retry,
        "retry_on_error": list(_RETRY_ON),
    }
