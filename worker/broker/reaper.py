"""The reaper: a live worker fails a dead peer's running jobs in rq as soon as the death is sure.

rq alone learns of a dead worker only when that worker's executions stop heartbeating (their
TTL, EXECUTION_TTL_S, has to outlast any Redis stall), so `rq info` would call its jobs started
for a minute or more. Every live worker looks at its peers' heartbeats (shared.liveness) on each
pass; a peer seen dead on DEAD_CONFIRMATIONS passes in a row is reaped once, by whichever live
worker claims it first: the claim (`keys.worker_reaped`, its value the reaper's id and the
reason) is the pool's one verdict, which routers read instead of judging heartbeats themselves;
then its running jobs are failed (status, FailedJobRegistry, a Result whose text starts with
WORKER_LOST_MARK, so the router may still run the request again) and its rq registration is
retired. No stream event is written: the router decides what the client sees, and sets each
request's cancel flag, so a worker that was only stopped drops the request when it goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis
from rq.executions import Execution
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.results import Result

from shared import keys
from shared.liveness import (
    DEAD_CONFIRMATIONS,
    WORKER_LOST_MARK,
    heartbeat_age_s,
    read_roster,
    reaped_value,
)
from shared.wire import MsgpackSerializer
from worker.broker.intake import FAILURE_TTL_S, JobEnd, JobOutcome, RqIntake, TakenJob
from worker.broker.presence import RqWorkerRecord, WorkerPresence

log = logging.getLogger("mlxcel.worker.reaper")

# How often a worker looks at its peers' heartbeats (each pass is one pipeline of PTTLs).
REAP_INTERVAL_S = 1.0


class Reaper:
    def __init__(
        self,
        presence: WorkerPresence,
        intake: RqIntake,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.presence = presence
        self.intake = intake
        self.r: redis.Redis = presence.connection
        self.clock = clock
        self.model_id = presence.info.get("model", "")
        # peer id -> (passes in a row it looked dead, when the last of them counted)
        self._suspects: dict[str, tuple[int, float]] = {}

    def reap(self) -> list[str]:
        """One pass; the ids of the jobs it failed. A pass counts towards a peer's death only
        REAP_INTERVAL_S after the last one that did: passes run back to back after a Redis
        stall, when every heartbeat looks old until the peers write again."""
        peers = read_roster(
            self.r,
            per_worker=lambda pipe, wid: pipe.exists(keys.worker_reaped(wid)),
            skip=self.presence.worker_id,
        )
        failed: list[str] = []
        now = self.clock()
        for peer in peers:
            wid, pttl, reaped = peer.worker_id, peer.pttl_ms, bool(peer.extra[0])
            if peer.alive or reaped:
                self._suspects.pop(wid, None)
                continue
            seen, counted_at = self._suspects.get(wid, (0, float("-inf")))
            if now - counted_at >= REAP_INTERVAL_S:
                seen, counted_at = seen + 1, now
                self._suspects[wid] = (seen, counted_at)
            if seen < DEAD_CONFIRMATIONS:
                continue
            since = _since(heartbeat_age_s(pttl))
            if self._claim(wid, since):
                failed += self._reap(wid, since)
        return failed

    def reap_own_past(self) -> list[str]:
        """At process start: fail the jobs this worker id's previous process left started (a
        crash, then a restart faster than peers could see the death), before serving."""
        return self.reap_own_leftovers("restarted", "its last process left running")

    def reap_own_leftovers(self, why: str, what: str) -> list[str]:
        """Fail the jobs rq shows started by this worker id, or taken from its own queue and not
        started, while this process runs none of them: a previous process's (a restart), or
        ones whose end Redis lost (a failover, or a restart from a snapshot, brings a job back
        as it was when the copy was taken). Failed as lost, so each router runs its request
        again or ends it, instead of waiting on a job nobody holds. `why` completes "worker W
        ... while running this job"; `what` the log's "failed N job(s) ..."."""
        wid = self.presence.worker_id
        ended = self._running_on(keys.rq_worker_name(wid), wid)
        self._fail_in_transit(wid, why)
        if ended:
            self._end(ended, f"{WORKER_LOST_MARK} worker {wid} {why} while running this job")
            log.warning("worker %s: failed %d job(s) %s", wid, len(ended), what)
        return [taken.id for taken in ended]

    def _end(self, ended: list[TakenJob], error: str) -> None:
        with self.r.pipeline(transaction=False) as pipe:
            for taken in ended:
                self.intake.end(pipe, JobEnd(taken, JobOutcome.FAILED, error=error), count=False)
            pipe.execute()

    def _claim(self, wid: str, since: str) -> bool:
        verdict = reaped_value(self.presence.worker_id, since)
        return bool(self.r.set(keys.worker_reaped(wid), verdict, nx=True, ex=keys.REAPED_TTL_S))

    def _reap(self, wid: str, since: str) -> list[str]:
        name = keys.rq_worker_name(wid)
        error = f"{WORKER_LOST_MARK} worker {wid} stopped while running this job ({since})"
        ended = self._running_on(name, wid)
        if ended:
            self._end(ended, error)
        self._fail_in_transit(wid, since)
        self._retire(name)
        self._forget_index(wid)
        log.warning("worker %s is dead (%s): failed its %d running job(s)", wid, since, len(ended))
        return [taken.id for taken in ended]

    def _running_on(self, worker_name: str, wid: str) -> list[TakenJob]:
        """The started jobs whose execution belongs to that worker, in its model's shared queue
        (as far as this worker's own model's) and in the dead worker's own queue."""
        found: list[TakenJob] = []
        for queue_name in (keys.model_queue_name(self.model_id), keys.worker_queue_name(wid)):
            registry = StartedJobRegistry(
                queue_name, connection=self.r, serializer=MsgpackSerializer
            )
            for job_id, execution_id in registry.get_job_and_execution_ids(cleanup=False):
                try:
                    execution = Execution.fetch(execution_id, job_id, self.r)
                    if execution.worker_name != worker_name:
                        continue
                    job = Job.fetch(job_id, connection=self.r, serializer=MsgpackSerializer)
                except redis.RedisError:
                    raise
                except Exception:  # gone meanwhile, or a record rq cannot load: leave it to rq
                    continue
                if job.get_status(refresh=False) == JobStatus.STARTED:
                    found.append(TakenJob(job, execution, None))
        return found

    def _fail_in_transit(self, wid: str, since: str) -> int:
        """Jobs taken from the lost worker's queue but not started yet, in rq's intermediate
        list (rq's dequeue of one queue, a peer's take of it, moves a job there until its
        start): failed as lost, so each router runs its request again under a new id, as for a
        started job, instead of waiting on a job nobody holds. A job started meanwhile is left
        to its starter. (A worker's own take pops its queues outright: a job it held unstarted
        when it was lost is on no list, and its router's job check finds it.)"""
        queue = Queue(keys.worker_queue_name(wid), connection=self.r, serializer=MsgpackSerializer)
        error = (
            f"{WORKER_LOST_MARK} worker {wid} took this job and was lost before it ran ({since})"
        )
        failed = 0
        with self.r.pipeline(transaction=False) as pipe:
            for raw in self.r.lrange(queue.intermediate_queue_key, 0, -1):
                job_id = raw.decode()
                pipe.lrem(queue.intermediate_queue_key, 0, job_id)
                try:
                    job = Job.fetch(job_id, connection=self.r, serializer=MsgpackSerializer)
                except redis.RedisError:
                    raise
                except Exception:  # gone, or a record rq cannot load: nothing waits on it here
                    continue
                if job.get_status(refresh=False) != JobStatus.QUEUED:
                    continue
                job.set_status(JobStatus.FAILED, pipeline=pipe)
                job.failed_job_registry.add(job, ttl=FAILURE_TTL_S, exc_string=error, pipeline=pipe)
                Result.create_failure(
                    job, FAILURE_TTL_S, error, worker_name=keys.rq_worker_name(wid), pipeline=pipe
                )
                failed += 1
            pipe.execute()
        if failed:
            log.warning("worker %s: failed %d job(s) it had taken but not started", wid, failed)
        return failed

    def _forget_index(self, wid: str) -> None:
        """The dead worker's routing entries go (routers stopped counting them when its
        heartbeat stopped); its block set, if the info hash still names its epoch, too."""
        epoch = self.r.hget(keys.worker_info(wid), "epoch")
        doomed = [keys.worker_routed(wid), keys.worker_load(wid), keys.worker_prefill(wid)]
        if epoch:
            doomed.append(keys.worker_blocks(wid, epoch.decode()))
        self.r.delete(*doomed)

    def _retire(self, worker_name: str) -> None:
        """rq's death for the dead worker's registration, so `rq info` stops listing it."""
        key = RqWorkerRecord.redis_worker_namespace_prefix + worker_name  # rq's own key scheme
        stale = RqWorkerRecord.find_by_key(key, connection=self.r, serializer=MsgpackSerializer)
        if stale is not None:
            stale.register_death()


def _since(age: float | None) -> str:
    return "its liveness key is gone" if age is None else f"no heartbeat for {age:.0f}s"
