"""Synthetic pool workers: the real Redis side of a worker with the MLX engine replaced by a
clock. Many workers run in one process, a thread each, so one small machine can stand in for 64.
Imports no mlx (nothing under worker.engine or worker.mlx_cpu).

Each worker registers as `mlxcel-pool worker` does, through `worker.broker.presence`
(WorkerPresence.arrive: the info hash with `model`, `epoch` and the routers' canary, the
roster, rq's worker record, an empty block set), then fills its block set
(`keys.worker_blocks(wid, epoch)`) with `--blocks` random 8-byte members beside INDEX_MARKER in
pipelined SADDs of 10,000, and serves like `worker.loop.WorkerLoop`: every step it takes jobs
with `RqIntake` (blocking up to a second only when idle with nothing to send; when busy only
if the last publish saw jobs queued), and sends ONE `Publisher.publish(StepWrites)` pipeline:
each new job's `start` event, `--tokens-per-step` `delta` events (one token each) per running
sequence, a finished one's `done` event and FINISHED `JobEnd` (rq's status, result and
registries), rq's busy state, cancel-flag reads, and once a second the heartbeat (liveness,
gauges, the running jobs' rq executions, the block set's TTL). A step starts every `--step-ms`
while a worker runs anything; a worker that falls behind skips the lost steps instead of
bursting. A cancelled job ends CANCELED without an event, as the engine ends it.

Driven over stdin by bench/bench_routing_scale.py, one command a line, answered on stdout:

    add w01,w02,...   register, fill and start these workers          -> `ready <n workers>`
    step MS [K]       from now on a step every MS ms, K tokens each    -> `ok`
    stats             tokens, jobs and publishes so far                -> `stats <json>`
    quit              stop every worker (rq death, liveness hash gone) -> `bye`

    .venv/bin/python bench/synthetic_worker.py --redis-url URL [--model mlxcel-tiny-s0]
        [--blocks 100000] [--step-ms 20] [--tokens-per-step 1] [--batch-size 64]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `python bench/x.py` puts bench/ first, not the repo root
    sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from shared import keys  # noqa: E402
from shared.config import RedisConfig  # noqa: E402
from shared.redis_clients import sync_client  # noqa: E402
from shared.wire import StreamEvent  # noqa: E402
from worker.broker.intake import JobEnd, JobOutcome, RqIntake, TakenJob, own_queues  # noqa: E402
from worker.broker.presence import WorkerPresence  # noqa: E402
from worker.broker.publisher import INDEX_CHUNK, Liveness, Publisher, StepWrites  # noqa: E402

log = logging.getLogger("mlxcel.synthetic")

IDLE_BLOCK_S = 1.0  # worker.loop's own
SADDS_PER_ROUND_TRIP = 10  # block-set fill: chunks of INDEX_CHUNK members per pipeline
TOKEN_TEXT = " x"  # each delta's text: non-empty, so the router relays it as a chunk
TOKEN_ID = 7


@dataclass
class Plan:
    model: str
    blocks: int
    step_s: float
    tokens_per_step: int
    batch_size: int


@dataclass(eq=False)
class _Sequence:
    """One running job: the engine's Request, reduced to what a clock needs."""

    taken: TakenJob
    prompt_tokens: int
    max_tokens: int
    produced: int = 0
    next_seq: int = 0

    def event(self, ev: StreamEvent) -> bytes:
        ev.seq = self.next_seq
        self.next_seq += 1
        return ev.to_wire()


@dataclass
class Totals:
    tokens: int = 0
    jobs: int = 0
    publishes: int = 0
    errors: int = 0


@dataclass(eq=False)
class SyntheticWorker:
    conn: redis.Redis
    worker_id: str
    plan: Plan
    canary: str
    totals: Totals = field(default_factory=Totals)
    running: dict[str, _Sequence] = field(default_factory=dict)
    _queued: int = 0  # jobs waiting in this worker's queues, as the last publish read
    _cancelled: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        info = {
            "worker_id": self.worker_id,
            "model": self.plan.model,
            "pid": str(os.getpid()),
            "host": socket.gethostname(),
            "started_at": f"{time.time():.3f}",
            "batch_size": str(self.plan.batch_size),
            "storage_modes": "synthetic",
            "canary": self.canary,
        }
        queues = own_queues(self.conn, self.worker_id, self.plan.model)
        self.presence = WorkerPresence(self.conn, self.worker_id, queues, info)
        self.intake = RqIntake(self.presence)
        self.publisher = Publisher(self.presence, self.intake)

    # -- life --------------------------------------------------------------------------------

    def arrive(self) -> None:
        """Register, fill the block set, start the loop's thread."""
        self.presence.arrive(self._gauges())
        fill_blocks(
            self.conn, keys.worker_blocks(self.worker_id, self.presence.epoch), self.plan.blocks
        )
        self._thread = threading.Thread(target=self._run, name=self.worker_id, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()
        try:
            self.presence.leave()
        except redis.RedisError as exc:
            log.warning("%s: could not unregister: %s", self.worker_id, exc)

    def _run(self) -> None:
        next_step = time.monotonic()
        while not self._stop.is_set():
            if self.running:  # a decode step takes step_s
                now = time.monotonic()
                if next_step > now:
                    time.sleep(next_step - now)
                next_step = max(next_step + self.plan.step_s, time.monotonic())
            try:
                self.iterate()
            except Exception:  # a bench helper: say so loudly, keep serving
                self.totals.errors += 1
                log.exception("%s: step failed", self.worker_id)
                time.sleep(0.5)
            else:
                if not self.running:
                    next_step = time.monotonic()

    def iterate(self) -> None:
        """One step, as worker.loop.WorkerLoop.iterate: decode, act on reads, take, send."""
        writes = StepWrites()
        self._decode(writes)
        self._take(writes)
        running = list(self.running.values())
        writes.busy = bool(running)
        writes.watched = [s.taken.id for s in running]
        if self.presence.beat_due(time.monotonic()):
            writes.liveness = Liveness(self._gauges(), [s.taken for s in running])
        reads = self.publisher.publish(writes)
        self.totals.publishes += 1
        self._queued = reads.queued
        self._cancelled += reads.cancelled

    # -- the engine's part, by the clock --------------------------------------------------------

    def _decode(self, writes: StepWrites) -> None:
        for rid in self._cancelled:
            seq = self.running.pop(rid, None)
            if seq is not None:
                writes.ended.append(JobEnd(seq.taken, JobOutcome.CANCELED))
        self._cancelled.clear()
        for rid, seq in list(self.running.items()):
            packed: list[bytes] = []
            n = min(self.plan.tokens_per_step, seq.max_tokens - seq.produced)
            for _ in range(n):
                packed.append(
                    seq.event(StreamEvent(kind="delta", text=TOKEN_TEXT, token_ids=[TOKEN_ID]))
                )
            seq.produced += n
            self.totals.tokens += n
            if seq.produced >= seq.max_tokens:
                packed.append(
                    seq.event(
                        StreamEvent(
                            kind="done",
                            finish_reason="length",
                            prompt_tokens=seq.prompt_tokens,
                            completion_tokens=seq.produced,
                            cached_tokens=0,
                        )
                    )
                )
                result = {
                    "finish_reason": "length",
                    "prompt_tokens": seq.prompt_tokens,
                    "completion_tokens": seq.produced,
                    "cached_tokens": 0,
                    "worker_id": self.worker_id,
                }
                writes.ended.append(JobEnd(seq.taken, JobOutcome.FINISHED, result))
                del self.running[rid]
                self.totals.jobs += 1
            writes.streams.append((seq.taken, packed))

    def _take(self, writes: StepWrites) -> None:
        slots = self.plan.batch_size - len(self.running)
        idle = not self.running
        if slots <= 0 or (not idle and self._queued <= 0):
            return
        block = IDLE_BLOCK_S if idle and not (writes.streams or writes.ended) else None
        for taken in self.intake.take(slots, block):
            req = taken.request
            if req is None:  # a payload the router would never have written
                event = StreamEvent(
                    kind="error", error=taken.error, error_type="invalid_request_error"
                )
                writes.streams.append((taken, [event.to_wire()]))
                writes.ended.append(JobEnd(taken, JobOutcome.FAILED, error=taken.error))
                continue
            seq = _Sequence(taken, len(req.prompt_tokens), req.max_tokens)
            self.running[taken.id] = seq
            start = StreamEvent(
                kind="start",
                prompt_tokens=seq.prompt_tokens,
                cached_tokens=0,
                worker_id=self.worker_id,
            )
            writes.streams.append((taken, [seq.event(start)]))

    def _gauges(self) -> dict[str, Any]:
        return {
            "batch_current_size": len(self.running),
            "enabled": "1",
            "apc_enabled": "1",
            "storage_mode": "synthetic",
        }


def fill_blocks(conn: redis.Redis, blocks_key: str, n: int) -> None:
    """`n` random 8-byte members (and INDEX_MARKER) in pipelined SADDs of INDEX_CHUNK."""
    raw = os.urandom(8 * n)
    members = [raw[i : i + 8] for i in range(0, len(raw), 8)]
    per_trip = INDEX_CHUNK * SADDS_PER_ROUND_TRIP
    for start in range(0, max(len(members), 1), per_trip):
        with conn.pipeline(transaction=False) as pipe:
            if start == 0:
                pipe.sadd(blocks_key, keys.INDEX_MARKER)
            part = members[start : start + per_trip]
            for i in range(0, len(part), INDEX_CHUNK):
                pipe.sadd(blocks_key, *part[i : i + INDEX_CHUNK])
            pipe.expire(blocks_key, keys.LIVENESS_TTL_S)
            pipe.execute()


def _answer(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def serve(args: argparse.Namespace) -> int:
    plan = Plan(args.model, args.blocks, args.step_ms / 1000, args.tokens_per_step, args.batch_size)
    conn = sync_client(RedisConfig(url=args.redis_url))
    theirs = conn.hget(keys.routing_canary(), plan.model)
    canary = theirs.decode() if theirs else ""
    workers: list[SyntheticWorker] = []
    for line in sys.stdin:
        cmd, _, rest = line.strip().partition(" ")
        if cmd == "add":
            for wid in filter(None, rest.split(",")):
                worker = SyntheticWorker(conn, wid, plan, canary)
                worker.arrive()
                workers.append(worker)
            _answer(f"ready {len(workers)}")
        elif cmd == "step":  # every worker's steps from its next one on
            ms, _, tokens = rest.partition(" ")
            plan.step_s = float(ms) / 1000
            plan.tokens_per_step = int(tokens or plan.tokens_per_step)
            _answer("ok")
        elif cmd == "stats":
            totals = Totals()
            for w in workers:
                for name in vars(totals):
                    setattr(totals, name, getattr(totals, name) + getattr(w.totals, name))
            _answer(f"stats {json.dumps(vars(totals))}")
        elif cmd == "quit":
            break
        elif cmd:
            _answer(f"error unknown command {cmd!r}")
    for w in workers:
        w.stop()
    for w in workers:
        w.join()
    _answer("bye")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--redis-url", required=True)
    p.add_argument("--model", default="mlxcel-tiny-s0", help="the model id workers serve")
    p.add_argument("--blocks", type=int, default=100_000, help="random members per block set")
    p.add_argument("--step-ms", type=float, default=20.0, help="one decode step's duration")
    p.add_argument("--tokens-per-step", type=int, default=1, help="tokens per sequence per step")
    p.add_argument("--batch-size", type=int, default=64, help="most sequences per worker")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
