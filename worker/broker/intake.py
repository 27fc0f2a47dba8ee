"""rq intake: take MANY jobs into the running batch through rq's queues and registries.

rq's own worker forks one child per job and runs one job at a time, which defeats batching. This
keeps rq's dequeue and registries (see ../shared/notes/rq-batching.md) so that `rq info` and
rq-dashboard show the truth: a job is in the StartedJobRegistry from the moment it joins the
batch, then in the Finished, Failed or Canceled registry. Endings are written with rq's public
job, result and registry calls into the caller's pipeline (the step's one round trip); the
worker's own registration lives in `presence`.

Left out (as rq's job features go): success/failure callbacks, dependents, retries. A job's
`timeout` becomes its request's deadline in the engine.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from rq import Queue
from rq.exceptions import DequeueTimeout, DeserializationError
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.registry import CanceledJobRegistry, FailedJobRegistry, clean_registries
from rq.results import Result
from rq.utils import current_timestamp, now, utcformat

from shared import keys
from shared.errors import ErrorKind
from shared.wire import STREAM_FIELD, GenerationRequest, MsgpackSerializer, StreamEvent
from worker.broker.presence import WorkerPresence

log = logging.getLogger("mlxcel.worker.intake")

# A failed job's record lives keys.JOB_FAILURE_TTL_S when its job names no failure_ttl; a job no
# router would write gets keys.MALFORMED_JOB_TTL_S.
RESULT_TTL_S = keys.JOB_RESULT_TTL_S
FAILURE_TTL_S = keys.JOB_FAILURE_TTL_S
# A burst's jobs arrive a few ms apart (the router tokenizes and enqueues each): a pause this long
# ends the burst while a request placed on this worker has not come (its enqueue failed, or a
# router died between placing and enqueueing it). One whose placed requests are all in hand ends
# at once.
GATHER_GAP_S = 0.008

# A job taken off its queue whose start never landed goes back to the front of that queue, in
# one step, only while Redis still shows it queued and on no queue: a job the start did reach,
# one the lost primary's take never reached (still on its queue), or one already given back
# stays as it is. rq's dequeue of one queue moves the job to the queue's intermediate list, of
# several pops it outright: either way it leaves that list here.
# KEYS: the queue, its intermediate list, the job's hash. ARGV: the job id, rq's queued status.
GIVE_BACK_LUA = """
redis.call('LREM', KEYS[2], 0, ARGV[1])
if redis.call('HGET', KEYS[3], 'status') ~= ARGV[2] then return 0 end
if redis.call('LPOS', KEYS[1], ARGV[1]) then return 0 end
redis.call('LPUSH', KEYS[1], ARGV[1])
return 1
"""

# A take's look at the queues, in one step: up to ARGV[1] ids off the queues in their order (each
# queue's oldest first), each with its job hash; first the hash of the job a blocking pop just
# took (ARGV[3], off the queue KEYS[ARGV[4]]), when there is one; and the request ids the
# routers' placements name for this worker (the hash ARGV[5]), when asked. rq's dequeue pops one
# queue at a time and fetches each job it found by itself, a round trip for each, and an idle
# worker's take paid them, and its look at the placements, before its first step. A popped id
# whose hash is gone comes back with an empty one (rq skips it), and so does one whose key holds
# no hash. A queue key that is no list fails the look before any pop, and no call after the
# first pop can fail it: a script's error keeps what it did before, and a job popped by a
# failing call would be in no one's hands.
# A take that pops records its id (ARGV[7], new for each take) and what it popped in the
# worker's take key (ARGV[6]): the worker's client sends a command again when its connection
# drops, and the same take sent again after Redis ran it (its reply lost on the way) finds its
# record and answers with those jobs, read again, instead of popping others and leaving the
# first ones off their queues in no one's hands.
# KEYS: the queues. ARGV: how many jobs at most (the popped one included), rq's job key prefix,
# the popped job's id and its queue's index in KEYS ('' and 0: none), the placements' key (''
# for none), the take key, this take's id, the take key's TTL. Returns {{{queue's index in
# KEYS, job id, {field, value, ...}}, ...}, {placed ids}}.
TAKE_QUEUED_LUA = """
for q = 1, #KEYS do
  local kind = redis.call('TYPE', KEYS[q]).ok
  if kind ~= 'list' and kind ~= 'none' then
    return redis.error_reply('WRONGTYPE the queue ' .. KEYS[q] .. ' is a ' .. kind)
  end
end
local function read(key, command)
  local reply = redis.pcall(command, key)
  if reply.err then return {} end
  return reply
end
local left, out = tonumber(ARGV[1]), {}
if ARGV[3] ~= '' then
  out[1] = {tonumber(ARGV[4]), ARGV[3], read(ARGV[2] .. ARGV[3], 'HGETALL')}
  left = left - 1
end
local record = redis.call('GET', ARGV[6])
local head = ARGV[7] .. '\\n'
if record and string.sub(record, 1, #head) == head then
  for _, row in ipairs(cjson.decode(string.sub(record, #head + 1))) do
    out[#out + 1] = {row[1], row[2], read(ARGV[2] .. row[2], 'HGETALL')}
  end
  left = 0
end
local popped = {}
for q = 1, #KEYS do
  if left <= 0 then break end
  local ids = redis.call('LPOP', KEYS[q], left)
  if ids then
    for _, id in ipairs(ids) do
      out[#out + 1] = {q, id, read(ARGV[2] .. id, 'HGETALL')}
      popped[#popped + 1] = {q, id}
    end
    left = left - #ids
  end
end
if #popped > 0 then  -- pcall: a record Redis refuses (out of memory) leaves the take whole
  redis.pcall('SET', ARGV[6], head .. cjson.encode(popped), 'EX', ARGV[8])
end
local placed = {}
if ARGV[5] ~= '' then placed = read(ARGV[5], 'HKEYS') end
return {out, placed}
"""


@dataclass(eq=False)
class TakenJob:
    """The Redis side's handle on one job: rides on the engine's Request as its ticket."""

    job: Job
    execution: Execution
    request: GenerationRequest | None  # None: the payload was malformed (failed right away)
    error: str = ""

    @property
    def id(self) -> str:
        return self.job.id

    @property
    def timeout_s(self) -> float | None:
        timeout = self.job.timeout
        return float(timeout) if isinstance(timeout, int | float) and timeout > 0 else None


class JobOutcome(enum.Enum):
    FINISHED = "finished"
    FAILED = "failed"
    CANCELED = "canceled"


@dataclass(frozen=True)
class JobEnd:
    """One job's end, as data: the publisher applies it to rq in the step's pipeline."""

    taken: TakenJob
    outcome: JobOutcome
    result: dict[str, Any] | None = None
    error: str = ""
    failure_ttl_s: int | None = None  # None: the job's own failure_ttl, else FAILURE_TTL_S


class MalformedJobHash(ValueError):
    """A job hash rq would skip without a word (it has no `data`): failed and logged instead."""


class PoolJob(Job):
    """rq's Job, except that a hash without `data` is an error naming it, not a silent skip
    (rq's dequeue drops such an id and leaves the hash `queued` for ever), and that its data,
    unchanged since it was read, is written back as it was read: a job's end saves the whole
    hash (as rq's own worker does), where rq deflates the data again, which for a long prompt
    took milliseconds of the cores the model runs on."""

    # (the data as read, inflated; as read) while the job's data is the one it was read with.
    _read_data: tuple[bytes, bytes] | None = None

    def restore(self, raw_data: Any) -> Any:
        if raw_data and b"data" not in raw_data and "data" not in raw_data:
            raise MalformedJobHash("the job hash has no data field")
        restored = super().restore(raw_data)
        stored = raw_data.get(b"data", raw_data.get("data")) if raw_data else None
        # Kept only when rq inflated it: data rq read as it was (not deflated) goes its way.
        if isinstance(stored, bytes) and isinstance(self._data, bytes) and self._data is not stored:
            self._read_data = (self._data, stored)
        return restored

    def to_dict(self, include_meta: bool = True, include_result: bool = True) -> dict[str, Any]:
        read = self._read_data
        if read is None or self._data is not read[0]:  # never read, or its call was changed
            return super().to_dict(include_meta, include_result)
        # rq's to_dict deflates `self.data` again: it gets nothing to deflate, and the hash
        # gets the bytes it held. One thread writes a job's end, and nothing reads an ended
        # job's data, so no reader sees it emptied meanwhile.
        self._data = b""
        try:
            obj = super().to_dict(include_meta, include_result)
        finally:
            self._data = read[0]
        obj["data"] = read[1]
        return obj


# One stream's events of a step and its TTL, in one atomic write: a stream is never created
# without a TTL; it is created only by the events that start it (`seq` 0 among them), so a late
# write after its router deleted it (the request ended, or the pool failed it and moved on) never
# brings it back; and it is never written once the request's cancel flag is up (its router has
# moved on: a worker that was found dead and goes on, for the step before it notices, writes
# nothing for nobody). `append(stream, cancel, ttl, field, first, args, from, to)` writes
# args[from..to]; `first` is '1' when these events start the stream (else '0'). The publisher's
# step script (worker.broker.publisher) calls the same function, so both keep one rule.
APPEND_LUA = """
local function append(stream, cancel, ttl, fld, first, args, from, to, ids)
  if redis.call('EXISTS', cancel) == 1 then return 0 end
  if first ~= '1' and redis.call('EXISTS', stream) == 0 then return 0 end
  for i = from, to do
    local id = redis.call('XADD', stream, '*', fld, args[i])
    if ids then ids[#ids + 1] = id end
  end
  redis.call('EXPIRE', stream, ttl)
  return 1
end
"""
# KEYS: the stream, the request's cancel flag; ARGV: its TTL, the event field, the first flag,
# the packed events.
_APPEND_SCRIPT = (
    APPEND_LUA + "return append(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], ARGV, 4, #ARGV)\n"
)


def append_events(
    pipe: Any, request_id: str, packed: list[bytes], starts_stream: bool = True
) -> None:
    """XADD each packed event to the request's stream and set its TTL (keys.REQUEST_TTL_S),
    atomically, unless its cancel flag is up; `starts_stream` False (the worker wrote to it
    before): only while the stream still exists."""
    if packed:
        stream, cancel = keys.request_stream(request_id), keys.request_cancel(request_id)
        first = "1" if starts_stream else "0"
        pipe.eval(
            _APPEND_SCRIPT, 2, stream, cancel, keys.REQUEST_TTL_S, STREAM_FIELD, first, *packed
        )


def _new_job(job_id: str, connection: redis.Redis) -> PoolJob:
    """The job of this id, its hash not read yet (ValueError: an id rq refuses)."""
    return PoolJob(job_id, connection=connection, serializer=MsgpackSerializer)


def _queue_keys(job: Job) -> tuple[str, str]:
    """The job's queue's key and that queue's intermediate list (rq's dequeue of one queue moves
    a job there), from the queue it was enqueued on."""
    return keys.rq_queue_key(job.origin), keys.rq_intermediate_key(job.origin)


def own_queues(connection: redis.Redis, worker_id: str, model_id: str) -> list[Queue]:
    """The worker's own queue first (routing places work there), then its model's shared one."""
    return [
        Queue(name, connection=connection, serializer=MsgpackSerializer)
        for name in (keys.worker_queue_name(worker_id), keys.model_queue_name(model_id))
    ]


class RqIntake:
    def __init__(self, presence: WorkerPresence) -> None:
        self.presence = presence
        self.connection = presence.connection
        self.queues: list[Queue] = list(presence.queues)
        # Jobs dequeued whose start pipeline has not been applied: a Redis error between the
        # two (a failover mid-take) would leave them in no one's hands, queued in rq's eyes but
        # on no queue, so the router would wait on them until its timeout. give_back() returns
        # them.
        self._in_hand: dict[str, Job] = {}
        self._give_back = self.connection.register_script(GIVE_BACK_LUA)
        self._take_queued = self.connection.register_script(TAKE_QUEUED_LUA)

    @property
    def name(self) -> str:
        return self.presence.name

    @property
    def queue_keys(self) -> list[str]:
        return [q.key for q in self.queues]

    def still_started(self, taken: list[TakenJob]) -> list[bool]:
        """For each job, whether rq still records it as started, in one round trip: one that is
        not was ended by the pool meanwhile (a peer's reaper failed it, Redis lost it), and
        this worker must leave its records and stream alone."""
        started = JobStatus.STARTED.value.encode()
        return [status == started for status in self._statuses(taken)]

    def _statuses(self, taken: list[TakenJob]) -> list[bytes | None]:
        """Each job's status as Redis holds it now, in one round trip."""
        if not taken:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for job in taken:
                pipe.hget(job.job.key, "status")
            return pipe.execute()

    def reclaim_unstarted(self, taken: list[TakenJob]) -> list[bool]:
        """For each job this worker took, whether Redis shows it taken but never started (still
        `queued`, in its queue's intermediate list: the start pipeline was lost to a failover or
        a restart from a snapshot). Each such job leaves the intermediate list here, so nobody
        holds it but this worker, which must fail it: no router would hear of it again. One that
        is `queued` in no list (rq pops outright from several queues, as a worker's own and its
        model's) goes back to the front of its queue instead, as a take cut short does
        (give_back): it runs again, and its router relays what it had not relayed yet."""
        queued = JobStatus.QUEUED.value.encode()
        statuses = self._statuses(taken)
        waiting = [job for job, status in zip(taken, statuses, strict=True) if status == queued]
        if not waiting:
            return [False] * len(taken)
        with self.connection.pipeline(transaction=False) as pipe:
            for job in waiting:
                pipe.lrem(_queue_keys(job.job)[1], 0, job.id)
            removed = dict(zip((job.id for job in waiting), pipe.execute(), strict=True))
        back = sum(self._return(job.job) for job in waiting if not removed[job.id])
        if back:
            log.warning("gave back %d job(s) whose start Redis lost to their queues", back)
        return [bool(removed.get(job.id)) for job in taken]

    def clean_registries(self) -> None:
        """rq's own registry maintenance for this worker's queues (its workers run it every few
        minutes): a job whose worker died (its execution no longer heartbeats) moves from the
        StartedJobRegistry to the FailedJobRegistry, so `rq info` and rq-dashboard stop calling it
        started."""
        for queue in self.queues:
            clean_registries(queue)

    def take(self, max_jobs: int, block_s: float | None) -> list[TakenJob]:
        """Dequeue up to `max_jobs` jobs: block up to `block_s` for the first one (None: don't
        block), then take what is already queued. Each job taken is marked started (Execution,
        StartedJobRegistry) in one pipeline."""
        popped = None
        if block_s is not None:
            popped = self._blocking_pop(max(1, round(block_s)))
            if popped is None:
                return []
        taken, _ = self._look(max_jobs, popped)
        return self._start(taken) if taken else []

    def take_from(self, queue: Queue, max_jobs: int) -> list[TakenJob]:
        """Take up to `max_jobs` jobs from another worker's queue (peer_queues), without
        blocking, through the same dequeue and start as this worker's own."""
        taken: list[tuple[Job, Queue]] = []
        while len(taken) < max_jobs:
            got = self._dequeue(None, [queue])
            if got is None:
                break
            taken.append(got)
        return self._start(taken) if taken else []

    def gather(self, max_jobs: int, window_s: float, held: set[str]) -> list[TakenJob]:
        """Take the jobs of a burst still arriving, so they prefill as one batch with what was
        just admitted. A burst is on its way only while a router has placed on this worker a
        request it does not hold yet (`held`: the ids it runs); otherwise what is queued now is
        taken and nothing is waited for: a lone request (a single user's) starts at once, and
        a burst stops being gathered once every placed request is in hand. A request's other
        choices are not in the placements: one that comes a step late starts from its
        group-mate's computed prompt (worker/engine/shared_prompt.py), as any late group-mate
        does. Every look takes what is queued and reads the placements in one round trip."""
        if max_jobs <= 0 or window_s <= 0:
            return []
        taken, placed = self._look(max_jobs, placements=True)
        held = held | {job.id for job, _ in taken}
        if len(taken) < max_jobs and any(rid not in held for rid in placed):
            taken = self._take_more(taken, max_jobs, window_s, held)
        return self._start(taken) if taken else []

    def _take_more(
        self, taken: list[tuple[Job, Queue]], max_jobs: int, window_s: float, held: set[str]
    ) -> list[tuple[Job, Queue]]:
        """What arrives, a look a ms, until every placed request is in hand, the arrivals
        pause for GATHER_GAP_S (a placement whose job never comes) or the window ends."""
        deadline = time.monotonic() + window_s
        quiet_until = time.monotonic() + min(GATHER_GAP_S, window_s)
        while len(taken) < max_jobs:
            got, placed = self._look(max_jobs - len(taken), placements=True)
            now = time.monotonic()
            taken += got
            held = held | {job.id for job, _ in got}
            if all(rid in held for rid in placed):
                break
            if got:
                quiet_until = now + GATHER_GAP_S
            elif now >= min(deadline, quiet_until):
                break
            else:
                time.sleep(0.001)
        return taken

    def _blocking_pop(self, timeout: int) -> tuple[PoolJob, Queue] | None:
        """rq's blocking dequeue of several queues (Queue.dequeue_any's BLPOP), the job not
        fetched yet (the look after it fetches it): in hand from here, so a take cut short
        gives it back. A pop whose reply a dropped connection lost is sent again and pops the
        next job, if one comes: the lost one is left queued on no queue, which its router's
        job checks find (Dispatcher._off_queue) and enqueue again."""
        got = self.connection.blpop(self.queue_keys, timeout)
        if got is None:
            return None
        key, raw_id = got
        (queue,) = [q for q in self.queues if q.key == key.decode()]
        try:
            job = _new_job(raw_id.decode(), self.connection)
        except Exception as exc:  # an id rq refuses (no router writes one)
            job_id = raw_id.decode(errors="replace")
            self._fail_unloadable(job_id, queue, _cannot_load(job_id, exc))
            return None
        job.origin = queue.name
        self._in_hand[job.id] = job
        return job, queue

    def _look(
        self,
        max_jobs: int,
        popped: tuple[PoolJob, Queue] | None = None,
        placements: bool = False,
    ) -> tuple[list[tuple[Job, Queue]], list[str]]:
        """Up to `max_jobs` jobs (`popped`, a blocking pop's, first), in the queues' order,
        and with `placements` the ids the routers placed on this worker, in one round trip
        (TAKE_QUEUED_LUA): what rq's dequeue gives a call at a time. As there, an id whose hash
        is gone is skipped, and a job rq cannot load is failed here and counts as nothing
        taken; only Redis errors raise."""
        first, index = (
            ("", 0) if popped is None else (popped[0].id, 1 + self.queues.index(popped[1]))
        )
        prefill = keys.worker_prefill(self.presence.worker_id) if placements else ""
        # A new id for each take; the client's sending this call again repeats it (the script).
        take = uuid.uuid4().hex
        rows, placed = self._take_queued(
            keys=self.queue_keys,
            args=[
                max_jobs,
                Job.redis_job_namespace_prefix,
                first,
                index,
                prefill,
                keys.worker_take(self.presence.worker_id),
                take,
                keys.TAKE_TTL_S,
            ],
        )
        got: list[tuple[Job, Queue]] = []
        unloadable: list[tuple[str, Queue, str]] = []
        for row, (q, raw_id, flat) in enumerate(rows):
            queue, job_id = self.queues[int(q) - 1], raw_id.decode(errors="replace")
            job = None
            if popped is not None and row == 0:
                job = self._in_hand.pop(popped[0].id)  # back in hand only once restored
            if not flat:
                continue
            try:
                if job is None:
                    job = _new_job(job_id, self.connection)
                job.restore(dict(zip(flat[::2], flat[1::2], strict=True)))
            except Exception as exc:
                unloadable.append((job_id, queue, _cannot_load(job_id, exc)))
                continue
            self._in_hand[job.id] = job
            got.append((job, queue))
        # After every loaded job is in hand: a Redis error here leaves none of them unheld.
        for job_id, queue, error in unloadable:
            self._fail_unloadable(job_id, queue, error)
        return got, [rid.decode(errors="replace") for rid in placed]

    def _dequeue(
        self, timeout: int | None, queues: list[Queue] | None = None
    ) -> tuple[Job, Queue] | None:
        """The next job, or None. A job rq itself cannot load (a hand-made hash: a bad date, an
        unknown status) is failed here and counts as nothing taken; only Redis errors raise."""
        try:
            got = Queue.dequeue_any(
                queues or self.queues,
                timeout,
                connection=self.connection,
                job_class=PoolJob,
                serializer=MsgpackSerializer,
            )
            if got is not None:
                self._in_hand[got[0].id] = got[0]
            return got
        except DequeueTimeout:
            return None
        except redis.RedisError:
            raise
        except Exception as exc:  # rq attaches the popped job's id and queue to the error
            job_id, queue = getattr(exc, "job_id", None), getattr(exc, "queue", None)
            error = _cannot_load(str(job_id), exc)
            if isinstance(job_id, str) and isinstance(queue, Queue):
                self._fail_unloadable(job_id, queue, error)
            return None

    def _start(self, taken: list[tuple[Job, Queue]]) -> list[TakenJob]:
        """Mark each job started (an Execution in the StartedJobRegistry, status started), in
        one pipeline. A queue entry whose job is no longer queued (an enqueue applied twice,
        already taken elsewhere) is dropped, so no job runs twice."""
        out: list[TakenJob] = []
        with self.connection.pipeline(transaction=False) as pipe:
            for job, queue in taken:
                pipe.lrem(queue.intermediate_queue_key, 0, job.id)
                if job.get_status(refresh=False) != JobStatus.QUEUED:
                    log.warning(
                        "job %s is %s, not queued: a duplicate entry, dropped",
                        job.id,
                        job.get_status(refresh=False),
                    )
                    continue
                try:
                    execution = Execution.create(
                        job, self.presence.execution_ttl_s, pipeline=pipe, worker_name=self.name
                    )
                    job.prepare_for_execution(self.name, pipeline=pipe)
                except redis.RedisError:
                    raise
                except Exception as exc:  # a job whose fields rq loads but cannot use
                    log.warning("job %s: cannot start it: %s", job.id, exc)
                    self._fail_unloadable(job.id, queue, _describe(exc), pipe)
                    continue
                out.append(self._parse(job, execution))
            pipe.execute()
        for job, _ in taken:
            self._in_hand.pop(job.id, None)
        return out

    def give_back(self) -> int:
        """Return the jobs taken off their queues whose start never landed (a Redis error cut
        the take short) to the front of those queues, where this worker or a peer takes them
        again; returns how many went back. A job whose start did land is this worker's in rq's
        registry and is failed with the other leftovers (worker.loop); one still on its queue
        (the primary that saw the take was lost) is taken again as it is."""
        back = 0
        for job_id, job in list(self._in_hand.items()):
            back += self._return(job)
            del self._in_hand[job_id]
        return back

    def _return(self, job: Job) -> int:
        """GIVE_BACK_LUA for one job: 1 if it went back to the front of its queue."""
        queue_key, aside = _queue_keys(job)
        return int(
            self._give_back(keys=[queue_key, aside, job.key], args=[job.id, JobStatus.QUEUED.value])
        )

    @staticmethod
    def _parse(job: Job, execution: Execution) -> TakenJob:
        try:
            kwargs = job.kwargs
        except DeserializationError as exc:  # rq's own error says nothing: its cause does
            cause, data = exc.__cause__ or exc, job.data or b""
            error = f"data is not msgpack: {_describe(cause)} ({len(data)} bytes: {data[:8]!r}...)"
            return TakenJob(job, execution, None, error)
        except Exception as exc:
            return TakenJob(job, execution, None, f"data is unreadable: {_describe(exc)}")
        try:
            if not isinstance(kwargs, dict):
                raise ValueError(f"the job's kwargs are a {type(kwargs).__name__}, not a map")
            request = GenerationRequest.from_wire(kwargs.get("request"))
        except Exception as exc:  # our decoder: any payload we did not write
            return TakenJob(job, execution, None, f"malformed job payload: {_describe(exc)}")
        return TakenJob(job, execution, request)

    def _fail_unloadable(self, job_id: str, queue: Queue, error: str, pipe: Any = None) -> None:
        """Fail a job rq cannot load as a Job: its hash says failed, it joins the queue's
        FailedJobRegistry, and its stream (if a router waits on one) gets the error."""
        p = pipe if pipe is not None else self.connection.pipeline(transaction=False)
        ttl = keys.MALFORMED_JOB_TTL_S
        reason = f"malformed job: {error}"
        job_key = Job.key_for(job_id)
        p.hset(job_key, mapping={"status": JobStatus.FAILED.value, "ended_at": utcformat(now())})
        p.expire(job_key, ttl)
        # The reason as rq records a failure (what `latest_result()`, rq-dashboard and the router
        # read), written without loading the job rq cannot load.
        failure = Result(
            job_id,
            Result.Type.FAILED,
            self.connection,
            exc_string=reason,
            worker_name=self.name,
            serializer=MsgpackSerializer,
        )
        failure.save(ttl, pipeline=p)
        registry = FailedJobRegistry(
            queue.name, connection=self.connection, serializer=MsgpackSerializer
        )
        p.zadd(registry.key, {job_id: current_timestamp() + ttl})
        p.lrem(queue.intermediate_queue_key, 0, job_id)
        event = StreamEvent(kind="error", error=reason, error_type=ErrorKind.INVALID_REQUEST)
        append_events(p, job_id, [event.to_wire()])
        if pipe is None:
            p.execute()

    # -- ending jobs: each writes into the caller's pipeline (the publisher's per-step one) --------

    def end(self, pipe: Any, end: JobEnd, count: bool = True) -> None:
        """Record a job's end in rq: its status, its Result, the matching registry; `count`:
        also in this worker's own job counts (not for a dead peer's job the reaper ends)."""
        job, execution = end.taken.job, end.taken.execution
        job.ended_at = now()
        execution.delete(job, pipe)  # leaves the StartedJobRegistry
        if count and job.started_at is not None:  # rq-dashboard shows total working time
            self.presence.increment_total_working_time(job.ended_at - job.started_at, pipe)
        stamps = {
            "worker_name": execution.worker_name or self.name,
            "pipeline": pipe,
            "execution_id": execution.id,
            "execution_started_at": execution.created_at,
            "execution_ended_at": job.ended_at,
        }
        if end.outcome is JobOutcome.FINISHED:
            job.set_status(JobStatus.FINISHED, pipeline=pipe)
            job.save(pipeline=pipe, include_meta=False, include_result=False)
            Result.create(job, Result.Type.SUCCESSFUL, RESULT_TTL_S, end.result, **stamps)
            job.finished_job_registry.add(job, RESULT_TTL_S, pipe)
            job.cleanup(RESULT_TTL_S, pipeline=pipe, remove_from_queue=False)
            if count:
                self.presence.increment_successful_job_count(pipeline=pipe)
        elif end.outcome is JobOutcome.FAILED:
            ttl = end.failure_ttl_s or (
                job.failure_ttl if job.failure_ttl and job.failure_ttl > 0 else FAILURE_TTL_S
            )
            job.set_status(JobStatus.FAILED, pipeline=pipe)
            job.failed_job_registry.add(job, ttl=ttl, exc_string=end.error, pipeline=pipe)
            Result.create_failure(job, ttl, end.error, **stamps)
            if count:
                self.presence.increment_failed_job_count(pipe)
        else:
            job.set_status(JobStatus.CANCELED, pipeline=pipe)
            CanceledJobRegistry(
                job.origin, connection=self.connection, serializer=MsgpackSerializer
            ).add(job, ttl=RESULT_TTL_S, pipeline=pipe)


def _cannot_load(job_id: str, exc: BaseException) -> str:
    """A job rq cannot load, logged; its failure's reason."""
    log.warning("job %s: rq cannot load it: %s: %s", job_id, type(exc).__name__, exc)
    return _describe(exc)


def _describe(exc: BaseException) -> str:
    """An exception as a reason: its text, or its type when it has none."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
