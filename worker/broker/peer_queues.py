"""Work a worker with free slots may take from its peers' queues, so no request waits behind a
busy worker while another idles, and none is stranded in a dead worker's queue.

Routers place most requests on one worker's own queue (cache-aware routing). A job there that
has waited `steal_after_s` (its worker's batch is full, or its step is long) may be taken by a
live peer of the same model; every job in a dead peer's queue may be taken at once. Ages are
measured against rq's `enqueued_at` on this host's clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import redis
from rq import Queue
from rq.job import Job

from shared import keys
from shared.liveness import read_roster
from shared.wire import MsgpackSerializer

log = logging.getLogger("mlxcel.worker.peers")

# How often a worker with free slots and nothing of its own queued looks at its peers' queues.
STEAL_CHECK_INTERVAL_S = 0.25
# How many queued jobs of one peer are looked at per check.
PEEK = 64


@dataclass(frozen=True)
class Waiting:
    """A peer's queue and how many jobs at its head this worker may take."""

    queue: Queue
    takeable: int
    dead: bool


class PeerQueues:
    def __init__(
        self,
        connection: redis.Redis,
        worker_id: str,
        model_id: str,
        steal_after_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.r = connection
        self.worker_id = worker_id
        self.model_id = model_id
        self.steal_after_s = steal_after_s
        self.clock = clock
        self._next_check = 0.0

    def due(self, now: float) -> bool:
        if now < self._next_check:
            return False
        self._next_check = now + STEAL_CHECK_INTERVAL_S
        return True

    def waiting(self) -> list[Waiting]:
        """Peers' queues with jobs this worker may take, dead peers' first."""
        peers = read_roster(
            self.r,
            ("model",),
            lambda pipe, wid: pipe.lrange(_queue_key(wid), 0, PEEK - 1),
            skip=self.worker_id,
        )
        found: list[Waiting] = []
        for peer in peers:
            ids = [j.decode() for j in peer.extra[0]]
            if not ids:
                continue
            if not peer.alive:
                if self._model_of(ids[0]) not in (None, self.model_id):
                    continue
                found.append(Waiting(self._queue(peer.worker_id), len(ids), True))
            elif peer.info.get("model") == self.model_id:
                old = self._old_prefix(ids)
                if old:
                    found.append(Waiting(self._queue(peer.worker_id), old, False))
        found.sort(key=lambda w: not w.dead)
        return found

    def _old_prefix(self, job_ids: list[str]) -> int:
        """How many jobs at the queue's head have waited at least steal_after_s (FIFO: the old
        ones come first)."""
        with self.r.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hget(Job.key_for(job_id), "enqueued_at")
            stamps = pipe.execute()
        cutoff = self.clock() - self.steal_after_s
        n = 0
        for raw in stamps:
            at = _parse_time(raw)
            if at is None or at > cutoff:
                break
            n += 1
        return n

    def _model_of(self, job_id: str) -> str | None:
        try:
            job = Job.fetch(job_id, connection=self.r, serializer=MsgpackSerializer)
            request = job.kwargs.get("request") or {}
            model = request.get("model") if isinstance(request, dict) else None
        except redis.RedisError:
            raise
        except Exception:  # gone meanwhile, or unreadable: intake fails an unreadable job
            return None
        return model if isinstance(model, str) else None

    def _queue(self, wid: str) -> Queue:
        return Queue(keys.worker_queue_name(wid), connection=self.r, serializer=MsgpackSerializer)


def _queue_key(wid: str) -> str:
    return keys.rq_queue_key(keys.worker_queue_name(wid))


def _parse_time(raw: bytes | None) -> float | None:
    if not raw:
        return None
    text = raw.decode().rstrip("Z")
    try:
        return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None
