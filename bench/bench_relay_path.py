"""The relay's own cost a token, alone: the stream hub, each request's watch and the events'
decode over a real Redis, without HTTP, FastAPI or a router process.

One embedded Redis; a writer process stands in for the workers: each of `--writers` (1) owns
every `--writers`-th stream and every `--step-ms` sends ONE pipeline with one script call per
stream XADDing `--tokens` delta events (a worker's publish, `worker.broker.intake.append_events`,
in shape), the writers' steps spread over a step as independent workers' are. This process
runs a StreamHub (under uvloop, as the router does) and, per stream, a Watch over the hub's
feed, taking its events a read at a time and rendering each as an SSE-like chunk. Reported:
tokens relayed a second, this process's CPU a token (the writer's is its own), and the hub's
reads.

`--push on` makes each writer's step one script that also publishes its streams' events to the
hub's channel, as a worker's step script does for a router that named it
(`worker.broker.publisher.STEP_LUA`): the hub takes the pushes and reads nothing a token.
`--push both` measures reads, then pushes, in one run, and prints their ratio. `--writers 1,64`
measures each count in turn in one run and prints what a step's wake-up costs this process: each
writer's step is one push (one read) woken apart from the others', so the CPU a second beyond the
first count's, over the extra steps a second, is what one more step costs (`--tokens` a stream
each, its streams fewer).

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_relay_path.py [--quick]
        [--streams 128] [--step-ms 40] [--tokens 4] [--writers 1[,64]] [--seconds 6]
        [--push off|on|both] [--json out.json]

About 10 s, --quick (a 3 s window) about 6. What bench_routing_scale.py's relay curve adds to
this is the router around it: HTTP, each request's admission, placement and enqueue, each write
through the middlewares.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import sys
import time
from typing import Any

import orjson
import redis
import uvloop
from common import announce, output_args, write_json

from mlxcel_pool.redis_server import start_redis
from router.relay.attempt import Attempt
from router.relay.stream_hub import StreamHub
from router.relay.watch import Watch
from shared import keys
from shared.config import RedisConfig
from shared.wire import STREAM_FIELD, GenerationRequest, StreamEvent

WARM_S = 2.0
APPEND_LUA = """
for i = 2, #ARGV do redis.call('XADD', KEYS[1], '*', ARGV[1], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], 600)
return 1
"""


# One writer's step, pushed: every stream's events appended, then one PUBLISH of them all, in
# STEP_LUA's message shape ([stream key, the entry before, [[id, [field, event]], ...]] per
# stream).
# KEYS: the streams; ARGV: the channel, the event field, events a stream, then the events.
PUSH_LUA = """
local ch, fld, n = ARGV[1], ARGV[2], tonumber(ARGV[3])
local batch, a = {}, 4
for k = 1, #KEYS do
  local before = redis.call('XREVRANGE', KEYS[k], '+', '-', 'COUNT', 1)
  local entries = {}
  for i = 1, n do
    entries[i] = {redis.call('XADD', KEYS[k], '*', fld, ARGV[a]), {fld, ARGV[a]}}
    a = a + 1
  end
  redis.call('EXPIRE', KEYS[k], 600)
  batch[#batch + 1] = KEYS[k]
  batch[#batch + 1] = before[1] and before[1][1] or '0-0'
  batch[#batch + 1] = entries
end
redis.call('PUBLISH', ch, cmsgpack.pack(batch))
return 1
"""


def request_id(i: int) -> str:
    return f"relay-path-{i}"


def writer(
    url: str, streams: int, step_s: float, tokens: int, writers: int, channel: str = ""
) -> None:
    """Workers' publishes: each of `writers` owns the streams i with i % writers == its number,
    and every step sends one pipeline, one script call per stream (`channel`: one script for all
    of them that also publishes there); the writers' steps fall at phases spread over a step,
    as independent workers' do."""
    r = redis.Redis.from_url(url)
    sha = r.script_load(APPEND_LUA)
    push_sha = r.script_load(PUSH_LUA)
    seq = [0] * streams
    start = time.monotonic()
    due = [start + step_s * w / writers for w in range(writers)]
    while True:
        w = min(range(writers), key=due.__getitem__)
        time.sleep(max(0.0, due[w] - time.monotonic()))
        owned = range(w, streams, writers)
        events: dict[int, list[bytes]] = {}
        for i in owned:
            events[i] = []
            for _ in range(tokens):
                ev = StreamEvent(kind="delta", seq=seq[i], text=" tok", token_ids=[5])
                events[i].append(ev.to_wire())
                seq[i] += 1
        if channel:
            stream_keys = [keys.request_stream(request_id(i)) for i in owned]
            all_events = [e for i in owned for e in events[i]]
            r.evalsha(
                push_sha, len(stream_keys), *stream_keys, channel, STREAM_FIELD, tokens, *all_events
            )
        else:
            with r.pipeline(transaction=False) as pipe:
                for i in owned:
                    stream = keys.request_stream(request_id(i))
                    pipe.evalsha(sha, 1, stream, STREAM_FIELD, *events[i])
                pipe.execute()
        due[w] += step_s


async def reader(hub: StreamHub, i: int, counts: list[int]) -> None:
    attempt = Attempt(GenerationRequest(request_id(i), "m", [1], 1))

    async def job_state() -> None:
        return None

    async def unread() -> bool:
        return False

    feed = await hub.subscribe(keys.request_stream(attempt.job_id))
    watch = Watch(attempt, feed, None, False, 600.0, job_state=job_state, unread=unread)
    head, tail = b'data: {"choices":[{"text":', b"}]}\n\n"
    async for batch in watch.batches():
        b"".join([head + orjson.dumps(ev.text) + tail for ev in batch])
        counts[0] += len(batch)


async def measure(
    url: str, args: argparse.Namespace, writers: int, push: bool = False
) -> dict[str, Any]:
    hub = StreamHub(RedisConfig(url=url))
    await hub.start()
    counts = [0]
    tasks = [asyncio.create_task(reader(hub, i, counts)) for i in range(args.streams)]
    step_s, n = args.step_ms / 1000, args.streams
    channel = hub.channel if push else ""
    proc = multiprocessing.get_context("spawn").Process(
        target=writer, args=(url, n, step_s, args.tokens, writers, channel), daemon=True
    )
    proc.start()
    try:
        await asyncio.sleep(WARM_S)
        r = redis.Redis.from_url(url)
        t0, c0, w0 = counts[0], time.process_time(), time.perf_counter()
        x0 = r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)
        await asyncio.sleep(args.seconds)
        t1, c1, w1 = counts[0], time.process_time(), time.perf_counter()
        x1 = r.info("commandstats").get("cmdstat_xread", {}).get("calls", 0)
    finally:
        proc.terminate()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await hub.stop()
    relayed, cpu, wall = t1 - t0, c1 - c0, w1 - w0
    return {
        "push": push,
        "streams": n,
        "writers": writers,
        "steps_s": writers / step_s,
        "offered_tok_s": n * args.tokens / step_s,
        "relayed_tok_s": relayed / wall,
        "cores": cpu / wall,
        "us_per_token": cpu / relayed * 1e6 if relayed else float("nan"),
        "tokens_per_cpu_s": relayed / cpu if cpu else float("nan"),
        "reads_s": (x1 - x0) / wall,
    }


def wake_cost_line(base: dict[str, Any], more: dict[str, Any]) -> str:
    """What a writer's step costs this process beyond the tokens it brings: the CPU a second
    past `base`'s over the steps a second past its, both runs relaying the same tokens."""
    extra_steps = more["steps_s"] - base["steps_s"]
    extra_cpu_us = (more["cores"] - base["cores"]) * 1e6
    per_step = extra_cpu_us / extra_steps if extra_steps else float("nan")
    return (
        f"{'pushed' if more['push'] else 'read'}, {more['writers']} writers against "
        f"{base['writers']}: {more['us_per_token'] / base['us_per_token']:.2f}x the CPU a token; "
        f"a step's wake-up costs {per_step:.1f} us ({extra_steps:.0f} more steps a second, "
        f"{more['cores'] - base['cores']:+.3f} cores)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=128)
    p.add_argument("--step-ms", type=float, default=40.0)
    p.add_argument("--tokens", type=int, default=4, help="delta events a stream a step")
    p.add_argument("--writers", default="1", help="workers writing the streams (1,64: each)")
    p.add_argument("--seconds", type=float, default=None, help="the window (6; --quick 3)")
    p.add_argument("--push", choices=("off", "on", "both"), default="off")
    p.add_argument("--quick", action="store_true")
    output_args(p, "write the numbers here", work_dir=False)
    args = p.parse_args(argv)
    args.seconds = args.seconds or (3.0 if args.quick else 6.0)
    machine = announce(send_costs=True)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.push]
    counts = [int(n) for n in args.writers.split(",")]
    outs = []
    for push, writers in [(push, w) for push in modes for w in counts]:
        server = start_redis()  # each run its own Redis: nothing of the last one left
        try:
            out = uvloop.run(measure(server.url, args, writers, push))
        finally:
            server.stop()
        outs.append(out)
        print(
            f"{'pushed' if push else 'read'}: {out['streams']} streams from {out['writers']} "
            f"writer(s), offered {out['offered_tok_s']:.0f} tok/s: relayed "
            f"{out['relayed_tok_s']:.0f} tok/s at {out['cores']:.3f} cores, "
            f"{out['us_per_token']:.2f} us a token ({out['tokens_per_cpu_s']:.0f} a CPU-second), "
            f"{out['reads_s']:.0f} hub reads a second",
            flush=True,
        )
    if len(modes) == 2 and len(counts) == 1:
        print(f"pushed/read CPU a token: {outs[1]['us_per_token'] / outs[0]['us_per_token']:.3f}")
    for push in modes:
        runs = [o for o in outs if o["push"] == push]
        for more in runs[1:]:
            print(wake_cost_line(runs[0], more), flush=True)
    write_json(
        args.json,
        {"machine": machine, "runs": outs} if len(outs) > 1 else {"machine": machine, **outs[0]},
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
