"""One reader per router process for every request's stream.

Each streaming request used to hold its own blocked XREAD: one Redis connection and one command
per request per decode step. The hub issues ONE `XREAD BLOCK` over all active request streams and
hands each stream's entries of a read to its subscriber's Feed at once, so a step of a 16-sequence
batch costs the router one read and one wake-up per stream, not one per event.

A blocked XREAD cannot learn of a new stream, so a new subscription XADDs to this process's own
wake stream, which every read includes; a subscription made while the read in flight already
names it (or while one wake is on its way) needs none, and nor does one pushed from its first
entry (below: `expect_push`).

A worker that can also publishes each step's events to this process's channel
(shared.keys.router_push; worker.broker.publisher.STEP_LUA), with the id of the entry before
them. A push that follows what the hub has of its stream (that entry is its last) is taken, and
the stream is left out of the reads from then on: a token costs no read re-armed, no write of the
router's and no wake-up of Redis's. Anything else falls back to the reads, which resume from the
last entry taken: a push with a gap before it, a lost push channel (every stream goes back to
them; one that leaves a PING unanswered past the stall bound is dropped and subscribed again),
and what a look every PUSH_CHECK_S finds in a pushed stream beyond its last entry (an
entry written without a push). Each stream's entries reach its feed once and in order, whichever
way they came: an entry at or before the last one taken is dropped.

The read is packed and read here, not by redis-py: a read names every open stream, and redis-py's
packing of a few hundred arguments cost more than the reply's parse. Each stream's key is packed
once, at its subscription, and its last id once per read that moved it. redis-py opens the read
connection (its handshake, a Sentinel's primary); then the hub owns its transport, and each
reply is parsed by hiredis and dispatched in the callback that received it, where the next read
is sent: redis-py's send and read cost a task, a timer and two loop passes a read, which at one
stream was the larger part of the router's time a token.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Callable
from contextlib import suppress
from typing import Any

import hiredis
import msgpack
import redis

from router.cancellation import stop_if_cancelled
from router.redis_batch import RedisBatch
from shared import keys
from shared.config import RedisConfig
from shared.redis_clients import async_client

log = logging.getLogger(__name__)

BLOCK_MS = 1000
READ_COUNT = 512
RETRY_S = 0.5
# How long the next read waits after one that found its entries waiting (see _run): a small
# part of a decode step, and no wait at all for an entry that comes later than that.
READ_GATHER_S = 0.002
# How often the read connection is looked at for a reply overdue past its block and the stall
# bound (a few wake-ups a minute: the reads themselves are timed by nothing).
STALL_CHECK_S = 5.0
# How early a deadline counts as reached: uvloop rounds a timer's delay down to whole
# milliseconds, so the pass planned for a deadline can run just before it.
DUE_SLACK_S = 0.002
# How late a reader waiting for its stream's next entries may learn that its wait is over.
TICK_S = 0.1
# How often the pushed streams are read once for what no push brought (an entry written
# without one): the most such an entry waits.
PUSH_CHECK_S = 1.0
# How long a push channel Redis refused (an ACL without this channel) waits to be asked again:
# the reads serve meanwhile, and the refusal is logged once, not every RETRY_S.
PUSH_REFUSED_RETRY_S = 60.0

# A wake-up: one entry on the wake stream and its TTL, in one script (one command, and the
# stream never exists without its TTL).
WAKE_LUA = """
redis.call('XADD', KEYS[1], 'MAXLEN', '1', '*', 'w', '1')
redis.call('EXPIRE', KEYS[1], ARGV[1])
return 1
"""

# One stream entry as the reply holds it: [id, [field, value, field, value, ...]].
RawEntry = list[Any]


def _bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


def _entry_id(raw: bytes) -> tuple[int, int]:
    ms, _, seq = raw.partition(b"-")
    return int(ms), int(seq or 0)


def _after(entries: list[RawEntry], last: bytes) -> list[RawEntry]:
    """The entries after `last`, by id."""
    bound = _entry_id(last)
    return [e for e in entries if _entry_id(e[0]) > bound]


class Deadlines:
    """The feeds waiting with a deadline, woken at it (at most TICK_S late) by one timer of the
    loop, planned for the earliest deadline and passes at least TICK_S apart: a timer per wait,
    set and cancelled for every read's worth of events, cost more than the wait itself, and a
    fixed tick woke the process ten times a second for deadlines a second away."""

    def __init__(self) -> None:
        self._waiting: dict[Feed, float] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._at = math.inf  # when the planned pass runs (inf: none is planned)
        self._last = -math.inf  # when the last pass ran

    def add(self, feed: Feed, deadline: float) -> None:
        self._waiting[feed] = deadline
        if deadline + TICK_S < self._at:  # the pass planned would wake it too late
            self._plan(deadline)

    def discard(self, feed: Feed) -> None:
        self._waiting.pop(feed, None)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._at = None, math.inf

    def _plan(self, deadline: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._at = max(deadline, self._last + TICK_S)
        self._timer = asyncio.get_running_loop().call_at(self._at, self._pass)

    def _pass(self) -> None:
        """Wake every feed past its deadline; plan the next pass for the earliest left."""
        now = asyncio.get_running_loop().time()
        self._timer, self._at, self._last = None, math.inf, now
        due = [f for f, deadline in self._waiting.items() if deadline <= now + DUE_SLACK_S]
        for feed in due:
            del self._waiting[feed]
            feed.wake()
        if self._waiting:
            self._plan(min(self._waiting.values()))


# A feed's sink while its reader waits: takes a read's entries whole, relaying them where they
# came (True), or leaves them all to the reader (False).
Sink = Callable[[list[RawEntry]], bool]


class Feed:
    """One stream's entries, appended by the hub a read at a time and taken whole by the
    stream's one reader: a wake-up per read, not per entry. A reader may wait with a sink
    (router.relay.direct_lane), which is offered each read that finds nothing waiting for it,
    until it refuses one or the reader wakes."""

    __slots__ = ("_entries", "_waiter", "_deadlines", "_sink")

    def __init__(self, deadlines: Deadlines) -> None:
        self._entries: list[RawEntry] = []
        self._waiter: asyncio.Future[None] | None = None
        self._deadlines = deadlines
        self._sink: Sink | None = None

    def push(self, entries: list[RawEntry]) -> None:
        sink, waiter = self._sink, self._waiter
        # The sink is offered a read only while its reader waits (not woken, not cancelled)
        # with nothing taken; taken, the reader's wait goes on.
        if (
            sink is not None
            and waiter is not None
            and not waiter.done()
            and not self._entries
            and sink(entries)
        ):
            return
        self._entries.extend(entries)
        self.wake()

    def wake(self) -> None:
        # The reader runs next: what comes after this waits for it, behind what it takes.
        self._sink = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def take(self) -> list[RawEntry]:
        """Every entry not taken yet, oldest first (an empty list when none came)."""
        entries, self._entries = self._entries, []
        return entries

    async def wait(self, timeout_s: float, sink: Sink | None = None) -> bool:
        """Whether entries are there to take, waiting up to about `timeout_s` for them (its
        Deadlines wakes it at most TICK_S late); `sink` is offered what comes meanwhile."""
        if self._entries:
            return True
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        self._deadlines.add(self, loop.time() + timeout_s)
        self._sink = sink
        try:
            await waiter
        finally:
            self._sink = None
            self._waiter = None
            self._deadlines.discard(self)
        return bool(self._entries)


class _Subscription:
    __slots__ = ("feed", "key_arg", "id_arg", "last", "pushed", "mixed")

    def __init__(self, key: bytes, deadlines: Deadlines) -> None:
        self.feed = Feed(deadlines)
        self.key_arg = _bulk(key)
        self.last = b"0-0"  # every entry the stream has: a worker may write first
        self.id_arg = _bulk(self.last)
        self.pushed = False  # its entries come by push: the reads leave it out
        self.mixed = False  # a push has brought some: a read's entries are checked by id

    def take(self, entries: list[RawEntry]) -> None:
        """New entries, in order, to the feed."""
        self.last = entries[-1][0]
        self.id_arg = _bulk(self.last)
        self.feed.push(entries)

    def take_push(self, before: bytes, entries: list[RawEntry]) -> bool:
        """A push's entries (the stream's entry `before` them first): those after the last taken,
        if they follow it; False for a push with a gap before it (the reads fetch what it lacks)."""
        if before != self.last:
            at = next((i for i, e in enumerate(entries) if e[0] == self.last), None)
            if at is None:
                return _entry_id(entries[-1][0]) <= _entry_id(self.last)  # all taken already
            entries = entries[at + 1 :]
        self.pushed = self.mixed = True
        if entries:
            self.take(entries)
        return True


class _ReadProtocol(asyncio.Protocol):
    """The hub's read connection once redis-py has opened it (its handshake done: AUTH, HELLO,
    SELECT, a Sentinel's primary found): each reply is handled in the callback that received it,
    so a read costs no task, future or timer of its own; `lost` is set when the connection ends
    or fails."""

    def __init__(self, on_reply: Callable[[Any], None], lost: asyncio.Future[None]) -> None:
        self._reader = hiredis.Reader()
        self._on_reply = on_reply
        self.lost = lost

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        try:
            while (reply := self._reader.gets()) is not False:
                if isinstance(reply, hiredis.ReplyError):
                    raise redis.ResponseError(str(reply))
                self._on_reply(reply)
        except Exception as exc:  # a reply error, a protocol error: this connection is done
            self.fail(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(exc or redis.ConnectionError("Redis closed the connection"))

    def fail(self, exc: BaseException) -> None:
        if not self.lost.done():
            self.lost.set_exception(exc)


class _PushProtocol(_ReadProtocol):
    """The push channel's connection: each message to `on_message`, the subscription's
    confirmation to `on_subscribed`; `heard` is when Redis last said anything on it (a message,
    the confirmation, the answer to a PING)."""

    def __init__(
        self,
        on_message: Callable[[bytes], None],
        on_subscribed: Callable[[], None],
        lost: asyncio.Future[None],
    ) -> None:
        super().__init__(self._on_push_reply, lost)
        self._on_message = on_message
        self._on_subscribed = on_subscribed
        self.heard = asyncio.get_running_loop().time()

    def _on_push_reply(self, reply: Any) -> None:
        self.heard = asyncio.get_running_loop().time()
        # RESP2 and RESP3 alike: [b"message", channel, data], [b"subscribe", channel, count]
        # (a PING's answer in subscribed mode is [b"pong", b""]).
        if isinstance(reply, list) and len(reply) == 3:
            if reply[0] == b"message":
                self._on_message(reply[2])
            elif reply[0] == b"subscribe":
                self._on_subscribed()


class StreamHub:
    def __init__(self, config: RedisConfig, batch: RedisBatch | None = None) -> None:
        # The blocking read has a connection of its own, opened by a client of its own and then
        # read through _ReadProtocol; the push channel another (_PushProtocol); wake-ups go
        # through another client, in the process's command batch (one of its own when none is
        # given: it stops with the hub).
        self._reader = async_client(config)
        self._pusher = async_client(config)
        self._writer = async_client(config)
        self._stall_s = config.stall_timeout_s
        self._own_batch = batch is None
        self._batch = batch if batch is not None else RedisBatch(self._writer)
        hub_id = uuid.uuid4().hex
        self._wake_key = keys.router_wake(hub_id)
        # Workers publish here what they append to this process's streams (GenerationRequest's
        # relay_channel).
        self.channel = keys.router_push(hub_id)
        # Subscribed to it now: requests name it to their workers only then (a Redis user
        # refused the channel, or a connection down, and they are relayed by reads alone).
        self.pushing = False
        self._push_refused = ""
        self._wake_bkey = self._wake_key.encode()
        self._wake_arg = _bulk(self._wake_bkey)
        # From the start: the wake stream is this hub's alone (a new id), and a wake that Redis
        # applies before the read it was meant for is still read.
        self._wake_id_arg = _bulk(b"0-0")
        self._subs: dict[bytes, _Subscription] = {}
        self._wake = self._writer.register_script(WAKE_LUA)
        self._task: asyncio.Task[None] | None = None
        self._push_task: asyncio.Task[None] | None = None
        self._check_task: asyncio.Task[None] | None = None
        self._stopping = False
        self._deadlines = Deadlines()
        self._transport: asyncio.Transport | None = None
        # A read is in flight, and it names every stream subscribed before it was sent; a wake
        # is on its way to it (one wake brings it back for every subscription made meanwhile);
        # the next read waits for its gather (see _on_reply).
        self._reading = False
        self._wake_sent = False
        self._gather: asyncio.TimerHandle | None = None
        self._sent_at = 0.0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="stream-hub")
        self._push_task = asyncio.create_task(self._run_push(), name="stream-hub-push")
        self._check_task = asyncio.create_task(self._check_pushed(), name="stream-hub-check")

    async def stop(self) -> None:
        self._stopping = True
        for task in (self._task, self._push_task, self._check_task):
            if task is not None:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
        self._deadlines.close()
        if self._own_batch:
            await self._batch.stop()
        with suppress(redis.RedisError):
            await self._writer.delete(self._wake_key)
        await self._reader.aclose()
        await self._pusher.aclose()
        await self._writer.aclose()

    def expect_push(self, stream: str) -> None:
        """A stream whose worker is told this process's channel, subscribed before its job is
        enqueued (so before its first entry): every push follows what the hub has from the
        first, and no read names it nor wakes for it. With the channel down, nothing (the relay's
        subscribe reads it). Its owner unsubscribes it, also when the enqueue fails."""
        key = stream.encode()
        if self.pushing and key not in self._subs:
            sub = self._subs[key] = _Subscription(key, self._deadlines)
            sub.pushed = sub.mixed = True

    async def subscribe(self, stream: str) -> Feed:
        key = stream.encode()
        sub = self._subs.get(key)
        if sub is None:
            sub = self._subs[key] = _Subscription(key, self._deadlines)
        elif sub.pushed:  # expected by push (expect_push): no read names it
            return sub.feed
        woken = self._bring_back()
        if woken is not None:
            await woken
        return sub.feed

    def _bring_back(self) -> asyncio.Future[Any] | None:
        """A read that names every stream the reads cover now: the read in flight, sent before
        one of them was among them, brought back by a wake (its future; None when no wake was
        sent); or, the hub idle (no stream to read), a read sent now."""
        if self._reading:
            if not self._wake_sent:
                self._wake_sent = True
                return self._batch.script(
                    self._wake, keys=[self._wake_key], args=[keys.REQUEST_TTL_S]
                )
        elif self._gather is None:
            self._send()
        return None

    def unsubscribe(self, stream: str) -> None:
        self._subs.pop(stream.encode(), None)

    def _command(self, subs: list[_Subscription]) -> bytes:
        n = 1 + len(subs)
        head = b"*%d\r\n$5\r\nXREAD\r\n$5\r\nCOUNT\r\n%b$5\r\nBLOCK\r\n%b$7\r\nSTREAMS\r\n" % (
            6 + 2 * n,
            _bulk(b"%d" % READ_COUNT),
            _bulk(b"%d" % BLOCK_MS),
        )
        return b"".join(
            [
                head,
                self._wake_arg,
                *[s.key_arg for s in subs],
                self._wake_id_arg,
                *[s.id_arg for s in subs],
            ]
        )

    def _send(self) -> None:
        """The next read, if the connection is up and a stream is open. Built and sent in one
        callback: a subscription either is in this command or finds _reading set."""
        self._gather = None
        transport = self._transport
        if self._reading or transport is None or transport.is_closing():
            return
        subs = [s for s in self._subs.values() if not s.pushed]
        if not subs:
            return
        self._wake_sent = False
        self._reading = True
        self._sent_at = asyncio.get_running_loop().time()
        transport.write(self._command(subs))

    def _on_reply(self, reply: Any) -> None:
        self._reading = False
        if not reply:
            self._send()
            return
        self._dispatch(reply)
        # A read that found its entries waiting means writes land faster than reads: the next
        # one waits for more to land (the readers just woken run meanwhile), so many workers'
        # steps cost a read or two each, not one for every few streams. A read that blocked was
        # woken by one worker's step, which is one script: the rest of it is there now (even if
        # the woken read's reply named only some of its streams), and a wait would be one more
        # wake-up a step for nothing.
        loop = asyncio.get_running_loop()
        if loop.time() - self._sent_at < READ_GATHER_S:
            self._gather = loop.call_later(READ_GATHER_S, self._send)
        else:
            self._send()

    async def _run(self) -> None:
        """Open the read connection, read through it until it fails, open another: Redis
        restarting, a failover, a read that stalls past the stall bound."""
        pool = self._reader.connection_pool
        loop = asyncio.get_running_loop()
        while True:
            stop_if_cancelled()  # a stop swallowed by the last connection's handshake ends it
            conn = None
            lost: asyncio.Future[None] = loop.create_future()
            try:
                conn = await pool.get_connection()
                transport = conn._writer.transport
                transport.set_protocol(_ReadProtocol(self._on_reply, lost))
                self._transport = transport
                self._send()
                await self._watch(lost)
            except (redis.RedisError, OSError) as exc:
                log.warning("stream hub: XREAD failed (%s); retrying", exc)
            except Exception:  # a reply it cannot parse, a bug: still no process without reads
                log.exception("stream hub: the read connection failed; retrying")
            finally:
                self._reading = False
                if self._gather is not None:
                    self._gather.cancel()
                    self._gather = None
                transport, self._transport = self._transport, None
                await _let_go(pool, conn, transport, lost)
            await asyncio.sleep(RETRY_S)

    async def _watch(self, lost: asyncio.Future[None]) -> None:
        """Until the connection is lost (its error raised here), looking every few seconds for
        a read that has waited past the block and the stall bound (a Redis that stopped
        answering, or a host gone without a word)."""
        loop = asyncio.get_running_loop()
        bound = BLOCK_MS / 1000 + self._stall_s
        while True:
            stop_if_cancelled()  # a stop swallowed by the connection's handshake ends it here
            done, _ = await asyncio.wait([lost], timeout=min(bound, STALL_CHECK_S))
            if done:
                lost.result()
                return
            if self._reading and loop.time() - self._sent_at > bound:
                raise redis.TimeoutError(f"no reply to XREAD in {bound:g}s")

    def _dispatch(self, reply: list[Any] | dict[bytes, Any]) -> None:
        """The reply's entries to their feeds: RESP2 answers a list of [key, entries], RESP3 a
        map of key to entries."""
        pairs = reply.items() if isinstance(reply, dict) else reply
        for key, entries in pairs:
            if not entries:
                continue
            sub = self._subs.get(key)
            if sub is None:
                if key == self._wake_bkey:
                    self._wake_id_arg = _bulk(entries[-1][0])
                continue
            if sub.mixed:  # a push may have brought these first
                entries = _after(entries, sub.last)
                if not entries:
                    continue
            sub.take(entries)

    # -- the push channel ---------------------------------------------------------------------

    def _on_push(self, data: bytes) -> None:
        """One worker's step for this process's streams: [stream key, the entry before, its
        entries] per stream, each entry [id, [field, event]] as a read's. A push with a gap
        before it puts its stream back in the reads."""
        items = msgpack.unpackb(data, raw=True, use_list=True)
        gap = False
        for i in range(0, len(items) - 2, 3):
            sub = self._subs.get(items[i])
            entries = items[i + 2]
            if sub is None or not entries:
                continue
            if not sub.take_push(items[i + 1], entries) and sub.pushed:
                # Not named by the read in flight: that read is brought back to name it.
                sub.pushed = False
                gap = True
        if gap:
            self._bring_back_soon()

    def _bring_back_soon(self) -> None:
        woken = self._bring_back()
        if woken is not None:
            woken.add_done_callback(_retrieved)

    def _demote_all(self) -> None:
        """Every stream back to the reads (the push channel was lost)."""
        if self._stopping:
            return
        demoted = False
        for sub in self._subs.values():
            demoted = demoted or sub.pushed
            sub.pushed = False
        if demoted:
            self._bring_back_soon()

    def _subscribed(self) -> None:
        self.pushing = True
        if self._push_refused:
            self._push_refused = ""
            log.info("stream hub: the push channel %s is subscribed again", self.channel)

    async def _run_push(self) -> None:
        """Subscribe to this process's channel and take its pushes until the connection fails,
        then again; while it is down every stream is read."""
        pool = self._pusher.connection_pool
        loop = asyncio.get_running_loop()
        while True:
            stop_if_cancelled()  # a stop swallowed by the last connection's handshake ends it
            conn = None
            transport = None
            pause = RETRY_S
            lost: asyncio.Future[None] = loop.create_future()
            try:
                conn = await pool.get_connection()
                transport = conn._writer.transport
                protocol = _PushProtocol(self._on_push, self._subscribed, lost)
                transport.set_protocol(protocol)
                transport.write(hiredis.pack_command(("SUBSCRIBE", self.channel)))
                await self._watch_push(transport, protocol, lost)
            except redis.ResponseError as exc:  # refused (an ACL): not asked again for a while
                pause = PUSH_REFUSED_RETRY_S
                if str(exc) != self._push_refused:
                    self._push_refused = str(exc)
                    log.warning(
                        "stream hub: Redis refused the push channel %s (%s); streams are relayed "
                        "by reads alone (allow the channel, `&*` in the user's ACL, to push)",
                        self.channel,
                        exc,
                    )
            except (redis.RedisError, OSError) as exc:
                log.warning("stream hub: the push channel failed (%s); reading instead", exc)
            except Exception:
                log.exception("stream hub: the push channel failed; reading instead")
            finally:
                self.pushing = False
                self._demote_all()
                await _let_go(pool, conn, transport, lost)
            await asyncio.sleep(pause)

    async def _watch_push(
        self, transport: asyncio.Transport, protocol: _PushProtocol, lost: asyncio.Future[None]
    ) -> None:
        """Until the push connection is lost (its error raised here), a PING on it every
        STALL_CHECK_S; one that Redis left unanswered past the stall bound ends the connection,
        as a stalled read does (a host gone without a word would otherwise leave the hub
        subscribed to nothing, naming its channel to workers whose pushes reach no one)."""
        loop = asyncio.get_running_loop()
        bound = STALL_CHECK_S + self._stall_s
        ping = hiredis.pack_command(("PING",))
        while True:
            stop_if_cancelled()  # a stop swallowed by the connection's handshake ends it here
            done, _ = await asyncio.wait([lost], timeout=STALL_CHECK_S)
            if done:
                lost.result()
                return
            if loop.time() - protocol.heard > bound:
                raise redis.TimeoutError(f"the push channel answered nothing in {bound:g}s")
            transport.write(ping)

    async def _check_pushed(self) -> None:
        """Every PUSH_CHECK_S, the pushed streams read once from their last entries: what no
        push brought is taken, and its stream goes back to the reads."""
        while True:
            stop_if_cancelled()
            await asyncio.sleep(PUSH_CHECK_S)
            pushed = [(k, s) for k, s in self._subs.items() if s.pushed]
            if not pushed:
                continue
            args = [b"XREAD", b"COUNT", READ_COUNT, b"STREAMS"]
            args += [k for k, _ in pushed] + [s.last for _, s in pushed]
            try:
                reply = await self._batch.call(*args)
            except redis.RedisError as exc:
                log.debug("stream hub: the pushed streams' check failed (%s)", exc)
                continue
            if not reply:
                continue
            before = {k: s.last for k, s in pushed}
            self._dispatch(reply)  # what a push brought meanwhile is dropped there
            missed = [s for k, s in pushed if s.last != before[k] and s.pushed]
            for sub in missed:
                sub.pushed = False
            if missed:
                self._bring_back_soon()


async def _let_go(
    pool: Any, conn: Any, transport: asyncio.Transport | None, lost: asyncio.Future[None]
) -> None:
    """A connection the hub took over, closed and given back to its pool."""
    if not lost.done():  # the abort's own connection_lost is no news to anyone
        lost.cancel()
    if transport is not None:
        transport.abort()
    if conn is not None:
        with suppress(Exception):
            await conn.disconnect(nowait=True)
        with suppress(Exception):
            await pool.release(conn)


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.debug("stream hub: a wake failed (%s)", future.exception())
