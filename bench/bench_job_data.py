"""A generation job's data: what making it costs the router at rq's deflate level and at the
template's (router/relay/job_template.py), how large it comes out, and what writing it back at
the job's end costs the worker.

The router enqueues every request as an rq job whose data is the request (its prompt's token
ids) packed with msgpack and deflated. rq deflates at zlib's default level (6); the template
deflates at DATA_LEVEL (1). At a job's end the worker saves the job's hash, as rq's worker
does: rq's Job.to_dict deflates the data again, the worker's PoolJob writes back the bytes it
read (worker/broker/intake.py). Per prompt, side by side in each round (order alternating):
the data made at each level (msgpack and deflate, us) and its bytes; a job's end (to_dict of
the job as read back from Redis) by rq's Job and by PoolJob; and, once, the template's whole
job, for scale. Prompts: the routing bench's (1,024 uniform ids), English-like text and the
Python source of this repository's router/ (code, as agent stacks send), tokenized by the bench
model's tokenizer, at 1k, 8k and 32k tokens. No pool: one embedded Redis.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_job_data.py [--quick]
        [--rounds 5] [--json out.json]

About 30 s (--quick: 1k and 8k prompts, 3 rounds, about 10 s).
"""

from __future__ import annotations

import argparse
import random
import time
import uuid
import zlib
from typing import Any

import redis
from common import (
    REPO,
    announce,
    bench_model_dir,
    corpus_text,
    load_hf_tokenizer,
    median,
    output_args,
    table,
    write_json,
)
from rq.job import Job
from rq.utils import get_version

from mlxcel_pool.redis_server import start_redis
from router.relay import job_template
from router.relay.dispatch import Dispatcher
from shared.wire import JOB_FUNC, GenerationRequest, MsgpackSerializer
from worker.broker.intake import PoolJob

RQ_LEVEL = zlib.Z_DEFAULT_COMPRESSION


def prompts(quick: bool) -> dict[str, list[int]]:
    tok = load_hf_tokenizer(bench_model_dir())
    rng = random.Random(7)
    english = tok.encode(corpus_text(11, 32_768 * 8), add_special_tokens=False)
    source = "\n".join(p.read_text() for p in sorted((REPO / "router").rglob("*.py")))
    python = tok.encode(source, add_special_tokens=False)
    sizes = (1024, 8192) if quick else (1024, 8192, 32768)
    out = {"uniform ids 1k": [rng.randrange(5, 1024) for _ in range(1024)]}
    for name, ids in (("English", english), ("Python source", python)):
        for n in sizes:
            if len(ids) >= n:
                out[f"{name} {n // 1024}k"] = ids[:n]
    return out


def per_call_us(fn: Any, seconds: float = 0.25) -> float:
    """The median of a few timed batches of calls, in us a call."""
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds / 5:
        fn()
        n += 1
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t) / n * 1e6)
    return median(times)


def measure(dispatcher: Dispatcher, ids: list[int], rounds: int) -> dict[str, float]:
    req = GenerationRequest(uuid.uuid4().hex, "bench-model", ids, max_tokens=64)
    kwargs: dict[str, object] = {"request": req.to_wire()}
    levels = {"rq": RQ_LEVEL, "template": job_template.DATA_LEVEL}
    us: dict[str, list[float]] = {side: [] for side in levels}
    for r in range(rounds):
        for side in sorted(levels, reverse=bool(r % 2)):
            level = levels[side]
            us[side].append(
                per_call_us(
                    lambda level=level: job_template._data(
                        MsgpackSerializer, JOB_FUNC, kwargs, level
                    )
                )
            )
    sizes = {
        s: len(job_template._data(MsgpackSerializer, JOB_FUNC, kwargs, lv))
        for s, lv in levels.items()
    }
    job_us = per_call_us(lambda: dispatcher._job_commands(req, "w1"))
    packed = len(MsgpackSerializer.dumps((JOB_FUNC, None, (), kwargs)))
    rq_us, ours_us = median(us["rq"]), median(us["template"])
    end = job_end_us(dispatcher, req, rounds)
    return {
        "tokens": len(ids),
        "packed_bytes": packed,
        "rq_us": rq_us,
        "template_us": ours_us,
        "us_ratio": ours_us / rq_us,
        "rq_bytes": sizes["rq"],
        "template_bytes": sizes["template"],
        "bytes_ratio": sizes["template"] / sizes["rq"],
        "job_us": job_us,
        "end_rq_us": end["rq"],
        "end_worker_us": end["worker"],
        "end_ratio": end["worker"] / end["rq"],
    }


def job_end_us(dispatcher: Dispatcher, req: GenerationRequest, rounds: int) -> dict[str, float]:
    """The job's hash as a worker saves it at the job's end (to_dict, as rq's save calls it),
    by rq's Job and by the worker's PoolJob, each restored from what the template wrote."""
    r = dispatcher.sync_redis
    with r.pipeline(transaction=True) as pipe:
        for command in dispatcher._job_commands(req, "w1"):
            pipe.execute_command(*command)
        pipe.execute()
    raw = r.hgetall(f"rq:job:{req.request_id}")
    jobs: dict[str, Job] = {}
    for side, cls in (("rq", Job), ("worker", PoolJob)):
        job = cls(req.request_id, connection=r, serializer=MsgpackSerializer)
        job.restore(raw)
        jobs[side] = job
    us: dict[str, list[float]] = {side: [] for side in jobs}
    for n in range(rounds):
        for side in sorted(jobs, reverse=bool(n % 2)):
            job = jobs[side]
            us[side].append(per_call_us(lambda job=job: job.to_dict(False, False)))
    return {side: median(v) for side, v in us.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1k and 8k prompts, 3 rounds")
    p.add_argument("--rounds", type=int, default=0, help="rounds a prompt (5; quick 3)")
    output_args(p, "write the figures as JSON here", work_dir=False)
    args = p.parse_args(argv)
    rounds = args.rounds or (3 if args.quick else 5)
    machine = announce()
    server = start_redis()
    try:
        r = redis.Redis.from_url(server.url)
        get_version(r)  # what Dispatcher.warm_rq reads at startup
        d = Dispatcher.__new__(Dispatcher)
        d.sync_redis, d.job_timeout_s, d._queues, d._templates = r, 900, {}, {}
        warm = GenerationRequest(uuid.uuid4().hex, "bench-model", [5] * 64, max_tokens=1)
        for _ in range(200):  # the queue's template made, the code paths warm
            d._job_commands(warm, "w1")
        rows = {name: measure(d, ids, rounds) for name, ids in prompts(args.quick).items()}
    finally:
        server.stop()
    print(
        f"the router: a job's data made (msgpack, then deflate) at rq's level (zlib's default) "
        f"and at the template's (DATA_LEVEL={job_template.DATA_LEVEL}), us and bytes; medians "
        f"of {rounds} rounds, sides alternating"
    )
    print(
        table(
            [
                "prompt",
                "packed B",
                "data us rq",
                "template",
                "template/rq",
                "B rq",
                "template",
                "template/rq",
                "whole job us (once)",
            ],
            [
                [
                    name,
                    m["packed_bytes"],
                    f"{m['rq_us']:.1f}",
                    f"{m['template_us']:.1f}",
                    f"{m['us_ratio']:.3f}",
                    m["rq_bytes"],
                    m["template_bytes"],
                    f"{m['bytes_ratio']:.3f}",
                    f"{m['job_us']:.1f}",
                ]
                for name, m in rows.items()
            ],
        )
    )
    print("(whole job: the template's commands for the job, its data at the template's level)")
    print()
    print(
        "the worker: a job's hash at its end (to_dict as save calls it), by rq's Job (the data "
        f"deflated again) and by PoolJob (the bytes read); us, medians of {rounds} rounds"
    )
    print(
        table(
            ["prompt", "rq's Job us", "PoolJob us", "PoolJob/rq"],
            [
                [
                    name,
                    f"{m['end_rq_us']:.1f}",
                    f"{m['end_worker_us']:.1f}",
                    f"{m['end_ratio']:.3f}",
                ]
                for name, m in rows.items()
            ],
        )
    )
    write_json(args.json, {"machine": machine, "rounds": rounds, "prompts": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
