"""The worker's one Redis round trip per step.

Each step's pipeline carries: every request's new stream events (each stream's XADDs and its TTL
in one atomic write, so no stream ever exists without a TTL, and one a router deleted is never
created again by a later step's events; one EXPIRE per stream per step, not per token),
the rq bookkeeping of jobs that ended (as `JobEnd` data), the drained counter deltas (HINCRBY on
a hash that never expires, so counts never go backwards or vanish with the worker), the last
reject, rq's busy state, liveness and gauges (at most once a second, through `presence`), and
the reads the loop needs: cancel flags of running requests, control commands, how many jobs are
queued, and whether a peer has found this worker dead (read with the cancel flags, so the loop
never acts on what this publish read without knowing it).

What a steady decode step sends (the appends, the counters that moved, the reads) is one script,
`STEP_LUA`, as one EVALSHA: redis-py packs and parses one command per step instead of one per
stream, counter and read, CPU the worker's own threads need. The rarer parts (block index, job
ends, the last reject, busy changes, the beat) stay ordinary commands around it.

A steady step is also sent without a thread (`send`): the loop's thread writes the script and
reads its reply after the model's next step (`SentStep.result`), when it has long arrived. No
thread is woken to send it and none waits for the reply: on a machine whose cores the model's
threads fill, each wake-up takes a core from a step (bench/README.md, "One stream").
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import redis

from shared import keys
from shared.wire import STREAM_FIELD, ControlCommand, WireError
from worker.broker.intake import APPEND_LUA, JobEnd, RqIntake, TakenJob
from worker.broker.presence import WorkerPresence


@dataclass
class Liveness:
    """Sent once per heartbeat interval: the gauges and the jobs whose executions to extend."""

    gauges: dict[str, Any]
    running: list[TakenJob]


@dataclass
class StepWrites:
    """Everything one step sends, as data (the publisher thread owns no other state)."""

    streams: list[tuple[TakenJob, list[bytes]]] = field(default_factory=list)  # packed events
    # Jobs whose events continue a stream this worker started in an earlier step: written only
    # while that stream exists (a router's delete is final).
    ongoing: set[str] = field(default_factory=set)
    ended: list[JobEnd] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    last_reject: dict[str, Any] | None = None
    busy: bool = False
    liveness: Liveness | None = None
    watched: list[str] = field(default_factory=list)  # running request ids: read cancel flags
    index: dict[bytes, bool] = field(default_factory=dict)  # block index changes
    index_full: list[bytes] | None = None  # every block held: the index was found lost
    # The members of `index` and `index_full` that are a prompt's first block: the worker is
    # listed under each in the pool's holders sets (keys.routing_holders) while it holds it.
    index_firsts: set[bytes] = field(default_factory=set)

    def beyond_script(self, busy_was: bool) -> bool:
        """Whether the step sends anything the step script does not carry (streams, ongoing,
        counters and watched are the script's; `busy` only when it changed). A field added
        above that `publish`'s pipeline writes belongs here too, or a steady step drops it."""
        return bool(
            self.index
            or self.index_full is not None
            or self.liveness is not None
            or self.ended
            or self.last_reject is not None
            or self.busy != busy_was
        )


@dataclass
class PublishResult:
    cancelled: list[str] = field(default_factory=list)
    commands: list[ControlCommand] = field(default_factory=list)
    queued: int = 0
    # The block set was gone: Redis lost it (restart, flush), a peer's reaper deleted it, or it
    # lapsed; the loop reads the worker's standing to tell which.
    index_lost: bool = False
    reaped: bool = False  # a peer's reaper has found this worker dead (its claim is there)

    def merge(self, later: PublishResult) -> PublishResult:
        """Two publishes' reads as one (nothing read may be lost); `queued` is the later one."""
        return PublishResult(
            [*self.cancelled, *later.cancelled],
            [*self.commands, *later.commands],
            later.queued,
            self.index_lost or later.index_lost,
            self.reaped or later.reaped,
        )


# One step's appends, counter deltas and reads. Each stream's events go through intake's
# `append` (the one stream rule); the counters only add (HINCRBY), so nothing counts twice; the
# reads come after the script's writes (the job ends and the beat sent after it write nothing
# they read). KEYS: the reaped claim, the control list, the counters hash, the queues (nq), each
# stream and its cancel flag (ns pairs), the watched requests' cancel flags (nw). ARGV: the
# stream TTL, the event field, nq, ns, nw, the number of counters nc, nc (name, delta) pairs,
# then per stream its first flag, its push channel ('' for none), its event count n and its n
# packed events. Returns {reaped 0/1, a 0/1 per watched id, the control commands popped, the
# jobs queued}.
#
# The events appended to a stream whose request names a push channel (its router's stream hub,
# shared.keys.router_push) also go to that channel, one PUBLISH a channel a step:
# cmsgpack of [stream key, the id of the entry before them ('0-0': none), entries] per stream,
# each entry [id, [field, event]] as XREAD answers it. The stream stays the record; the hub
# takes a push only where it follows what it has read (the entry before it is its last), so the
# push spares it re-arming a read a token.
STEP_LUA = (
    APPEND_LUA
    + """
local ttl, fld = ARGV[1], ARGV[2]
local nq, ns, nw, nc = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local k, a = 4 + nq, 7 + 2 * nc
local pushes, channels = {}, {}
for _ = 1, ns do
  local ch, n = ARGV[a + 1], tonumber(ARGV[a + 2])
  if ch == '' then
    append(KEYS[k], KEYS[k + 1], ttl, fld, ARGV[a], ARGV, a + 3, a + 2 + n)
  else
    local before = redis.call('XREVRANGE', KEYS[k], '+', '-', 'COUNT', 1)
    local ids = {}
    if append(KEYS[k], KEYS[k + 1], ttl, fld, ARGV[a], ARGV, a + 3, a + 2 + n, ids) == 1 then
      local batch = pushes[ch]
      if batch == nil then
        batch = {}
        pushes[ch] = batch
        channels[#channels + 1] = ch
      end
      local entries = {}
      for i = 1, n do
        entries[i] = {ids[i], {fld, ARGV[a + 2 + i]}}
      end
      batch[#batch + 1] = KEYS[k]
      batch[#batch + 1] = before[1] and before[1][1] or '0-0'
      batch[#batch + 1] = entries
    end
  end
  k, a = k + 2, a + 3 + n
end
for _, ch in ipairs(channels) do
  redis.pcall('PUBLISH', ch, cmsgpack.pack(pushes[ch]))  -- refused (an ACL): the reads relay
end
for c = 7, 6 + 2 * nc, 2 do
  redis.call('HINCRBY', KEYS[3], ARGV[c], ARGV[c + 1])
end
local reaped = redis.call('EXISTS', KEYS[1])
local cancelled = {}
if nw > 0 then
  local flags = redis.call('MGET', unpack(KEYS, k, k + nw - 1))
  for i = 1, nw do
    cancelled[i] = flags[i] and 1 or 0
  end
end
local commands = redis.call('LPOP', KEYS[2], 16) or {}
local queued = 0
for q = 4, 3 + nq do
  queued = queued + redis.call('LLEN', KEYS[q])
end
return {reaped, cancelled, commands, queued}
"""
)
STEP_SHA = hashlib.sha1(STEP_LUA.encode()).hexdigest()


class Publisher:
    def __init__(self, presence: WorkerPresence, intake: RqIntake) -> None:
        self.r: redis.Redis = presence.connection
        self.presence = presence
        self.intake = intake
        self._k_counters = keys.worker_cache_counters(presence.worker_id)
        self._k_control = keys.worker_control(presence.worker_id)
        self._k_reaped = keys.worker_reaped(presence.worker_id)

    def send(self, writes: StepWrites) -> SentStep | None:
        """A steady step (the script alone: nothing for the block index, no job end, no last
        reject, no beat, rq's busy state unchanged) written to Redis now, its reply read by the
        result's `result()`; None for any other step, which `publish` sends whole."""
        if writes.beyond_script(self.presence.busy):
            return None
        command = self._step_command(writes)
        pool = self.r.connection_pool
        conn = pool.get_connection()
        try:
            conn.send_command(*command)
        except BaseException:
            # Not retried here: a connection lost on the loop's own thread is how the loop
            # learns that Redis restarted or failed over (shared/redis_clients.py), and a
            # silent retry on a new primary would hide it. The loop reconnects instead.
            _drop(pool, conn)
            raise
        return SentStep(self, command, writes.watched, conn)

    def publish(self, writes: StepWrites) -> PublishResult:
        """Send one step's writes and reads in a single pipeline, and read what it read."""
        sent = self.send(writes)
        if sent is not None:
            return sent.result()
        blocks = keys.worker_blocks(self.presence.worker_id, self.presence.epoch)
        check_index = (
            bool(writes.index) or writes.index_full is not None or (writes.liveness is not None)
        )
        with self.r.pipeline(transaction=False) as pipe:
            if check_index:  # first, so this pipeline's own SADDs cannot hide a lost set
                pipe.expire(blocks, keys.LIVENESS_TTL_S)
            _write_index(pipe, blocks, writes, self.presence.worker_id)
            at, step_command = len(pipe), self._step_command(writes)
            pipe.execute_command(*step_command)
            for end in writes.ended:
                self.intake.end(pipe, end)
            if writes.last_reject is not None:
                last = {f"last_reject_{k}": v for k, v in writes.last_reject.items()}
                pipe.hset(
                    self._k_counters,
                    mapping={k: "" if v is None else str(v) for k, v in last.items()},
                )
            self.presence.set_busy(writes.busy, pipe)
            if writes.liveness is not None:
                self.presence.beat(pipe, writes.liveness.gauges, writes.liveness.running)
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if isinstance(reply, Exception) and reply is not replies[at]:
                raise reply
        res = _parse_step(self._step_reply(replies[at], step_command), writes.watched)
        res.index_lost = check_index and not replies[0]
        return res

    def _step_reply(self, reply: Any, command: list[Any]) -> Any:
        """The step script's reply; raised if it is an error."""
        if isinstance(reply, redis.exceptions.NoScriptError):
            # Redis lost its script cache (SCRIPT FLUSH, a restart the connection came back from):
            # the script did not run at all, so running it once more applies it once.
            reply = self.r.execute_command("EVAL", STEP_LUA, *command[2:])
        if isinstance(reply, Exception):
            raise reply
        return reply

    def _step_command(self, writes: StepWrites) -> list[Any]:
        """The step script's call: EVALSHA, except with job ends, where EVAL (the script's
        body) never meets a lost script cache, so a job's last events always precede its end."""
        # A zero delta changes nothing: a step sends the counters that moved (about 3 of 31 for
        # a decoding sequence); a heartbeat's publish sends every field, so each exists from the
        # worker's first beat on.
        every = writes.liveness is not None
        counters = [(n, d) for n, d in writes.counters.items() if d or every]
        streams = [(t, p) for t, p in writes.streams if p]
        queues = self.intake.queue_keys
        key_list: list[Any] = [self._k_reaped, self._k_control, self._k_counters, *queues]
        args: list[Any] = [
            keys.REQUEST_TTL_S,
            STREAM_FIELD,
            len(queues),
            len(streams),
            len(writes.watched),
            len(counters),
        ]
        for name, delta in counters:
            args += (name, delta)
        for taken, packed in streams:
            key_list += (keys.request_stream(taken.id), keys.request_cancel(taken.id))
            push = taken.request.relay_channel if taken.request is not None else ""
            args += ("0" if taken.id in writes.ongoing else "1", push, len(packed), *packed)
        key_list += [keys.request_cancel(rid) for rid in writes.watched]
        head = ["EVAL", STEP_LUA] if writes.ended else ["EVALSHA", STEP_SHA]
        return [*head, len(key_list), *key_list, *args]

    def reply(self, reply_key: str, payload: bytes) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            pipe.rpush(reply_key, payload)
            pipe.expire(reply_key, keys.CONTROL_TTL_S)
            pipe.execute()


@dataclass
class SentStep:
    """A steady step's script, written on a connection taken from the client's pool and held
    until its reply is read (`conn`; None once `reply` is read or the step is dropped)."""

    publisher: Publisher
    command: list[Any]
    watched: list[str]
    conn: Any | None
    reply: Any = None

    def result(self) -> PublishResult:
        """Read the script's reply (once), as `publish` would have returned it."""
        conn, self.conn = self.conn, None
        if conn is not None:
            pool = self.publisher.r.connection_pool
            try:
                self.reply = conn.read_response()
            except redis.exceptions.NoScriptError as exc:
                pool.release(conn)
                self.reply = exc
            except BaseException:
                # A lost connection is the loop's to act on, never retried here (see `send`:
                # the script may have run, and a new primary may lack it); a timeout leaves a
                # reply unread on the connection, which is never reused.
                _drop(pool, conn)
                raise
            else:
                pool.release(conn)
        return _parse_step(self.publisher._step_reply(self.reply, self.command), self.watched)

    def drop(self) -> None:
        """Forget it unread: its connection is closed, so no later command reads its reply."""
        conn, self.conn = self.conn, None
        if conn is not None:
            _drop(self.publisher.r.connection_pool, conn)


def _drop(pool: Any, conn: Any) -> None:
    conn.disconnect()
    pool.release(conn)


# Members per SADD when a whole block set is written (keeps each command's reply small).
INDEX_CHUNK = 10_000


def _write_index(pipe: Any, blocks: str, writes: StepWrites, worker_id: str) -> None:
    """The block set's changes, and the holders sets of the first blocks among them: a worker
    is listed as a holder only after the block is in its set, and unlisted before it leaves, so
    a holder found there holds the block in its set unless the entry is from an earlier life."""
    firsts = writes.index_firsts
    gone = [m for m, held in writes.index.items() if not held]
    for m in gone:
        if m in firsts:
            pipe.srem(keys.routing_holders(m.hex()), worker_id)
    if writes.index_full is not None:
        full = writes.index_full
        pipe.sadd(blocks, keys.INDEX_MARKER)
        for i in range(0, len(full), INDEX_CHUNK):
            pipe.sadd(blocks, *full[i : i + INDEX_CHUNK])
        pipe.expire(blocks, keys.LIVENESS_TTL_S)
    added = [m for m, held in writes.index.items() if held]
    if added:
        pipe.sadd(blocks, *added)
    if gone:
        pipe.srem(blocks, *gone)
    for m in firsts:
        if writes.index.get(m, True):  # added now, or held when the index is written whole
            holders = keys.routing_holders(m.hex())
            pipe.sadd(holders, worker_id)
            pipe.expire(holders, keys.HOLDERS_TTL_S)


def _parse_step(reply: list[Any], watched: list[str]) -> PublishResult:
    reaped, flags, raw_commands, queued = reply
    res = PublishResult(reaped=bool(reaped), queued=int(queued))
    res.cancelled = [rid for rid, flag in zip(watched, flags, strict=True) if flag]
    for raw in raw_commands:
        try:
            res.commands.append(ControlCommand.from_wire(raw))
        except (WireError, ValueError):
            continue  # a malformed command is dropped, never executed
    return res
