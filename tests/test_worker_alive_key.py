"""A worker's alive key, on a real Redis: written with every refresh of its info hash's TTL (its
arrival, the heartbeat thread's beat, the loop's beat) so that it lapses exactly when the hash's
TTL says the worker stopped counting as alive; placement reads it instead of the hash."""

from __future__ import annotations

import os
import time

import redis

from shared import keys
from shared.liveness import alive_ttl_ms, min_alive_pttl_ms
from tests.streams import TINY_MODEL
from worker.broker.intake import own_queues
from worker.broker.presence import Heartbeat, WorkerPresence

WID = "w-alive"


def _presence(r: redis.Redis) -> WorkerPresence:
    info = {"worker_id": WID, "model": TINY_MODEL, "pid": str(os.getpid()), "host": "h"}
    return WorkerPresence(r, WID, own_queues(r, WID, TINY_MODEL), info)


def _in_step(r: redis.Redis, presence: WorkerPresence) -> None:
    """Its value is the worker's epoch, and it has as long left as the info hash has above the
    alive threshold (the two written in one step: within a few ms of each other)."""
    assert r.get(keys.worker_alive(WID)) == presence.epoch.encode()
    with r.pipeline(transaction=False) as pipe:
        pipe.pttl(keys.worker_alive(WID))
        pipe.pttl(keys.worker_info(WID))
        alive, info = pipe.execute()
    assert alive > alive_ttl_ms() - 1000
    assert abs((info - min_alive_pttl_ms()) - alive) < 200


def test_each_liveness_write_writes_the_alive_key_and_leaving_deletes_it(redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    presence = _presence(r)
    presence.arrive({})
    _in_step(r, presence)
    # The heartbeat thread's beat refreshes both (here after the two were let run low).
    r.pexpire(keys.worker_alive(WID), 300)
    r.pexpire(keys.worker_info(WID), min_alive_pttl_ms() + 300)
    beat = Heartbeat(presence, interval_s=0.05)
    presence.heartbeat_thread = beat
    beat.start()
    deadline = time.monotonic() + 10
    while int(r.pttl(keys.worker_alive(WID))) < 1000 and time.monotonic() < deadline:
        time.sleep(0.02)
    beat.stop()
    _in_step(r, presence)
    # So does the loop's once-a-second beat, in its step's pipeline.
    r.pexpire(keys.worker_alive(WID), 300)
    with r.pipeline(transaction=False) as pipe:
        presence.beat(pipe, {}, [])
        pipe.execute()
    _in_step(r, presence)
    presence.leave()
    assert not r.exists(keys.worker_alive(WID)) and not r.exists(keys.worker_info(WID))


def test_a_heartbeat_never_writes_the_alive_key_of_a_deleted_info_hash(redis_url: str) -> None:
    """A flushed or deleted hash is the loop's to write again (with its arrival): until then the
    worker counts as gone, so its alive key stays gone too."""
    r = redis.Redis.from_url(redis_url)
    presence = _presence(r)
    presence.arrive({})
    r.delete(keys.worker_info(WID), keys.worker_alive(WID))
    beat = Heartbeat(presence, interval_s=0.05)
    beat.start()
    deadline = time.monotonic() + 10
    while not beat.doubt.is_set() and time.monotonic() < deadline:
        time.sleep(0.02)
    beat.stop()
    assert beat.doubt.is_set()  # it beat, and found the registration not whole
    assert not r.exists(keys.worker_alive(WID))
