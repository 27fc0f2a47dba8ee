"""A worker's rq intake on the tests' real Redis, registered and with its queues empty: what the
intake tests take jobs through (worker/broker/intake.py)."""

from __future__ import annotations

import os

import redis

from tests.streams import TINY_MODEL
from worker.broker.intake import RqIntake, own_queues
from worker.broker.presence import WorkerPresence


def registered_intake(r: redis.Redis, worker_id: str) -> RqIntake:
    info = {"worker_id": worker_id, "model": TINY_MODEL, "pid": str(os.getpid()), "host": "h"}
    presence = WorkerPresence(r, worker_id, own_queues(r, worker_id, TINY_MODEL), info)
    presence.arrive({})
    intake = RqIntake(presence)
    for q in intake.queues:
        r.delete(q.key, q.intermediate_queue_key)
    return intake
