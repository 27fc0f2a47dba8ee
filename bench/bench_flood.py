"""Flood: far more concurrent streams than the pool admits, fired at once at two workers on the
tiny model, in three rounds. Not in CI (`make bench` runs it with --quick).

First a lone request's TTFT (the median of sequential requests, time to the first content
chunk). Then each round sends `--flood` streaming completions at once over one aiohttp session
and counts what came back: *accepted* (200, a stream that ends with [DONE] and no error chunk),
*429* (an OpenAI error body of type `rate_limit_error` with a `Retry-After` header), *other*
(anything else: its status and a sample body; a client timeout; a broken or cut stream). During
a round the queue depths (the shared rq queue and each worker's, by LLEN) and the admission
ledger's in-flight count (ZCARD) are sampled every 100 ms; after it, once the pool is idle, the
RSS of every router, worker and Redis process.

Two baselines before the rounds: `--bound` requests at once with no flood (what admission can
at best keep for them), and the same beside a flood the router answers 404 to, a route it does
not have (the floor: what the flood's HTTP exchanges alone cost the accepted requests on this
machine, with the load generator on the same cores). After the rounds, a sustained overload:
the pool held full by long streams while 32 clients send request after request for a few
seconds (refusals a second, and the router's CPU per refusal; `--busy-hold-ms 0` turns the
router's door check off for a side-by-side run).

Goal (issue 11): 0 answers other than 200 and 429, the worst round's p99 TTFT of the accepted
within 2x the lone request's TTFT at the configured bound, and no RSS growth from round 1 to the
last in the router or the workers. Exits 0 either way (a benchmark); the verdict is the last line.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_flood.py [--quick] [--flood 300]
        [--bound N] [--batch-size 32] [--rounds 3] [--busy-hold-ms MS] [--work-dir DIR]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import redis
import redis.asyncio as aioredis
from common import announce, median, output_args, table, tiny_model_dir, write_json
from rq import Queue

from mlxcel_pool.supervisor import REDIS, Pool
from shared import keys
from tests.pool_fixture import running_pool

WORKERS = ("w1", "w2")
# A prompt the tiny model does not end early: every accepted stream runs to MAX_TOKENS, so the
# rounds are alike and a slot frees only when a whole answer is done.
PROMPT = "The quick brown fox"
MAX_TOKENS = 32
SAMPLE_S = 0.1  # queue-depth sampling period
SERIES_POINTS = 16  # how many samples of a round the printed series shows
# One router process: on 2 cores the two workers need the CPU more than a second router. The
# workers give their spare memory back after 1 s idle, so the RSS read after SETTLE_S is a
# round's lasting growth, not a burst's buffers kept for the next (`idle_release_s`, 10 s).
OVERRIDES = {"router": {"processes": 1}, "worker": {"idle_release_s": 1}}
# RSS is read only once the pool is idle (nothing in flight or queued) and then after this
# pause, so a round's last frees and the allocator's trimming are behind it.
SETTLE_S = 2.0
SUSTAINED_CLIENTS = 32  # concurrent clients of the closed-loop overload phase
IDLE_TIMEOUT_S = 60.0
# RSS moves by allocator noise even without a leak; growth past the larger of these is growth.
# A leak of one small object per request (300 a round) shows as a steady rise over rounds,
# which the per-round table makes visible even below the tolerance.
GROWTH_TOLERANCE_MIB = 4.0
GROWTH_TOLERANCE_FRACTION = 0.02

ACCEPTED, REJECTED, OTHER = "accepted", "429", "other"


@dataclass(frozen=True)
class Plan:
    flood: int  # requests fired at once per round
    rounds: int
    lone: int  # sequential requests for the lone TTFT
    bound: int  # MLXCEL_MAX_INFLIGHT
    batch_size: int  # MLXCEL_BATCH_SIZE of each worker
    request_timeout_s: float  # a request unanswered past this counts as `other`
    busy_hold_ms: float | None  # MLXCEL_BUSY_HOLD_MS (None: the pool's default)
    sustained_s: float  # how long the closed-loop overload phase runs

    @classmethod
    def of(cls, args: argparse.Namespace) -> Plan:
        bound = args.bound or len(WORKERS) * args.batch_size
        hold = args.busy_hold_ms
        if args.quick:
            return cls(args.flood or 150, args.rounds, 5, bound, args.batch_size, 60.0, hold, 3.0)
        return cls(args.flood or 300, args.rounds, 10, bound, args.batch_size, 120.0, hold, 6.0)

    def env(self) -> dict[str, str]:
        """The pool bound, and a per-worker bound that gives the same figure while both workers
        are live (it only narrows the bound when one is not)."""
        env = {
            "MLXCEL_MAX_INFLIGHT": str(self.bound),
            "MLXCEL_MAX_INFLIGHT_PER_WORKER": str(math.ceil(self.bound / len(WORKERS))),
            "MLXCEL_BATCH_SIZE": str(self.batch_size),
        }
        if self.busy_hold_ms is not None:
            env["MLXCEL_BUSY_HOLD_MS"] = f"{self.busy_hold_ms:g}"
        return env


@dataclass
class Reply:
    kind: str
    status: int
    answered: float = 0.0  # send -> the response's status line (a 200 waits for the worker)
    ttft: float | None = None  # accepted only: send -> first non-empty content chunk
    total: float | None = None  # accepted only: send -> [DONE]
    completion_tokens: int | None = None
    why: str = ""  # `other`: what came back; 429: the Retry-After value


@dataclass
class Sample:
    t: float  # seconds since the round's first send
    shared: int
    per_worker: list[int]
    inflight: int


@dataclass
class Round:
    number: int
    wall_s: float
    replies: list[Reply]
    samples: list[Sample]
    rss_mib: dict[str, float]
    redis_keys: int  # DBSIZE once idle: what the round left behind, all with TTLs by design

    def of_kind(self, kind: str) -> list[Reply]:
        return [r for r in self.replies if r.kind == kind]

    def ttfts(self) -> list[float]:
        return [r.ttft for r in self.of_kind(ACCEPTED) if r.ttft is not None]


@dataclass
class Sustained:
    """The closed-loop overload phase: the pool held full by long streams while clients send
    request after request; what came back and what the router process spent per refusal."""

    seconds: float
    statuses: dict[int, int]
    router_cpu_s: float

    @property
    def refused(self) -> int:
        return self.statuses.get(429, 0)


@dataclass
class Run:
    lone_ttfts: list[float] = field(default_factory=list)
    at_bound_ttfts: list[float] = field(default_factory=list)  # `bound` at once, no flood
    # `bound` requests at once beside a flood the router answers 404 to (no admission at all)
    floor_ttfts: list[float] = field(default_factory=list)
    sustained: Sustained | None = None
    baseline_rss_mib: dict[str, float] = field(default_factory=dict)
    rounds: list[Round] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): with few values p99 is the largest, not a blend."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


# --- one request -------------------------------------------------------------------------------


def _body(model: str) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _read_stream(resp: aiohttp.ClientResponse, start: float) -> Reply:
    reply = Reply(OTHER, resp.status, why="a stream that ended without [DONE]")
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            if reply.why.startswith("a stream that ended"):
                reply.kind, reply.why = ACCEPTED, ""
                reply.total = time.perf_counter() - start
            break
        chunk = json.loads(data)
        if "error" in chunk:
            reply.why = f"sse error {json.dumps(chunk['error'])[:200]}"
        for choice in chunk.get("choices") or []:
            if choice.get("text") and reply.ttft is None:
                reply.ttft = time.perf_counter() - start
        if chunk.get("usage"):
            reply.completion_tokens = int(chunk["usage"]["completion_tokens"])
    return reply


async def _read_refusal(resp: aiohttp.ClientResponse) -> Reply:
    """A 429 counts as one only when it is the documented refusal: an OpenAI error body of
    type rate_limit_error and a Retry-After header; anything else is `other`."""
    text = await resp.text()
    if resp.status != 429:
        return Reply(OTHER, resp.status, why=text[:200])
    try:
        err = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    retry_after = resp.headers.get("Retry-After")
    if err.get("type") != "rate_limit_error" or not retry_after:
        return Reply(OTHER, 429, why=f"Retry-After={retry_after!r} {text[:160]}")
    return Reply(REJECTED, 429, why=retry_after)


async def send(
    http: aiohttp.ClientSession, model: str, timeout: float, path: str = "/v1/completions"
) -> Reply:
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with http.post(path, json=_body(model)) as resp:
                answered = time.perf_counter() - start
                if resp.status == 200:
                    reply = await _read_stream(resp, start)
                else:
                    reply = await _read_refusal(resp)
                reply.answered = answered
                return reply
    except TimeoutError:
        return Reply(OTHER, 0, why=f"client timeout {timeout:g} s")
    except (aiohttp.ClientError, ValueError) as exc:
        return Reply(OTHER, 0, why=f"{type(exc).__name__}: {exc}"[:200])


# --- the pool's state --------------------------------------------------------------------------


class Depths:
    """LLEN of the shared queue and each worker's queue, and the ledger's in-flight count, in one
    pipeline (read from Redis, not /health: the sampler must not queue behind the flood in the
    router it measures)."""

    def __init__(self, redis_url: str) -> None:
        sync = redis.Redis.from_url(redis_url)
        # rq names its own queue keys; build them through rq, as /health does.
        self.queue_keys = [Queue(keys.model_queue_name("mlxcel-tiny-s0"), connection=sync).key] + [
            Queue(keys.worker_queue_name(w), connection=sync).key for w in WORKERS
        ]
        sync.close()
        self.aredis = aioredis.Redis.from_url(redis_url, socket_timeout=5)

    async def read(self, t: float) -> Sample:
        async with self.aredis.pipeline(transaction=False) as pipe:
            for key in self.queue_keys:
                pipe.llen(key)
            pipe.zcard(keys.admission_inflight())
            values = [int(v) for v in await pipe.execute()]
        return Sample(t, values[0], values[1:-1], values[-1])

    async def sample_until(self, stop: asyncio.Event, t0: float, out: list[Sample]) -> None:
        while not stop.is_set():
            try:
                out.append(await self.read(time.perf_counter() - t0))
            except redis.RedisError as exc:
                print(f"  sampler: {exc}", file=sys.stderr)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), SAMPLE_S)

    async def wait_idle(self, timeout: float) -> bool:
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            s = await self.read(0.0)
            if s.shared == 0 and not any(s.per_worker) and s.inflight == 0:
                return True
            await asyncio.sleep(SAMPLE_S)
        return False


def rss_mib(pool: Pool) -> dict[str, float]:
    """RSS of each router, worker and Redis process: a child's own process and everything it
    started (uvicorn's processes when the router runs more than one), named `name`, `name.1`..."""
    out: dict[str, float] = {}
    for name in ("router", *WORKERS, REDIS):
        try:
            leader = psutil.Process(pool.pid(name))
            procs = [leader, *sorted(leader.children(recursive=True), key=lambda p: p.pid)]
            for i, proc in enumerate(procs):
                out[name if i == 0 else f"{name}.{i}"] = proc.memory_info().rss / 2**20
        except (psutil.Error, KeyError) as exc:
            print(f"  rss of {name}: {exc}", file=sys.stderr)
    return out


# --- the run -----------------------------------------------------------------------------------


async def lone_ttfts(http: aiohttp.ClientSession, model: str, plan: Plan) -> list[float]:
    """Sequential requests on the idle pool, one at a time; the first two only warm it (the
    first passes through the model and the router's paths) and are not counted."""
    out = []
    for i in range(plan.lone + 2):
        reply = await send(http, model, plan.request_timeout_s)
        if reply.kind != ACCEPTED or reply.ttft is None:
            raise RuntimeError(f"a lone request failed: {reply}")
        if i >= 2:
            out.append(reply.ttft)
    return out


async def at_bound_ttfts(http: aiohttp.ClientSession, model: str, plan: Plan) -> list[float]:
    """Exactly `bound` requests at once and no more: the TTFT the accepted requests of a flood
    would have if admission shielded them perfectly from the refused ones."""
    replies = await asyncio.gather(
        *(send(http, model, plan.request_timeout_s) for _ in range(plan.bound))
    )
    return [r.ttft for r in replies if r.kind == ACCEPTED and r.ttft is not None]


# A route the router does not have: Starlette answers 404 before any middleware of ours reads
# the body, so a flood of these costs the router its HTTP exchanges and nothing else.
NO_ROUTE = "/v1/no-such-route"


async def floor_ttfts(http: aiohttp.ClientSession, model: str, plan: Plan) -> list[float]:
    """`bound` requests at once, beside `flood - bound` requests the router answers 404 to:
    the TTFT the accepted requests of a flood would have if every refusal cost the router
    nothing but its HTTP exchange (and the client, on the same cores, its requests)."""
    sends = [send(http, model, plan.request_timeout_s) for _ in range(plan.bound)]
    sends += [
        send(http, model, plan.request_timeout_s, NO_ROUTE)
        for _ in range(max(0, plan.flood - plan.bound))
    ]
    replies = await asyncio.gather(*sends)
    return [r.ttft for r in replies[: plan.bound] if r.kind == ACCEPTED and r.ttft is not None]


def _router_cpu_s(pool: Pool) -> float:
    leader = psutil.Process(pool.pid("router"))
    procs = [leader, *leader.children(recursive=True)]
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


async def sustained(
    pool: Pool, http: aiohttp.ClientSession, depths: Depths, model: str, plan: Plan
) -> Sustained:
    """The pool held at its bound by `bound` long streams (max_tokens 2000), then CLIENTS
    clients each sending the flood's request again as soon as the last one is answered, for
    `sustained_s`: refusals a second, and the router's CPU per refusal."""
    long_body = {**_body(model), "max_tokens": 2000}

    async def hold() -> None:
        async with http.post("/v1/completions", json=long_body) as resp:
            async for _ in resp.content:
                pass

    holders = [asyncio.create_task(hold()) for _ in range(plan.bound)]
    deadline = time.perf_counter() + 30
    while (await depths.read(0.0)).inflight < plan.bound and time.perf_counter() < deadline:
        await asyncio.sleep(SAMPLE_S)
    statuses: Counter[int] = Counter()
    cpu0, t0 = _router_cpu_s(pool), time.perf_counter()

    async def client() -> None:
        while time.perf_counter() - t0 < plan.sustained_s:
            async with http.post("/v1/completions", json=_body(model)) as resp:
                await resp.read()
                statuses[resp.status] += 1

    await asyncio.gather(*(client() for _ in range(SUSTAINED_CLIENTS)))
    seconds, cpu = time.perf_counter() - t0, _router_cpu_s(pool) - cpu0
    for task in holders:
        task.cancel()
    await asyncio.gather(*holders, return_exceptions=True)
    await depths.wait_idle(IDLE_TIMEOUT_S)
    return Sustained(seconds, dict(statuses), cpu)


async def flood_round(
    pool: Pool, http: aiohttp.ClientSession, depths: Depths, model: str, plan: Plan, number: int
) -> Round:
    stop = asyncio.Event()
    samples: list[Sample] = []
    t0 = time.perf_counter()
    sampler = asyncio.create_task(depths.sample_until(stop, t0, samples))
    replies = await asyncio.gather(
        *(send(http, model, plan.request_timeout_s) for _ in range(plan.flood))
    )
    wall = time.perf_counter() - t0
    stop.set()
    await sampler
    if not await depths.wait_idle(IDLE_TIMEOUT_S):
        print(f"  round {number}: pool not idle after {IDLE_TIMEOUT_S:g} s", file=sys.stderr)
    await asyncio.sleep(SETTLE_S)
    dbsize = int(await depths.aredis.dbsize())
    rnd = Round(number, wall, list(replies), samples, rss_mib(pool), dbsize)
    kinds = Counter(r.kind for r in rnd.replies)
    print(f"  round {number}: {dict(kinds)} in {wall:.1f} s", file=sys.stderr)
    return rnd


async def flood(pool: Pool, plan: Plan) -> Run:
    connector = aiohttp.TCPConnector(limit=0)  # every request of a round on its own connection
    depths = Depths(pool.redis_url)
    run = Run()
    try:
        async with aiohttp.ClientSession(base_url=pool.url, connector=connector) as http:
            async with http.get("/health") as resp:
                model = str((await resp.json(content_type=None))["model"])
            run.lone_ttfts = await lone_ttfts(http, model, plan)
            await asyncio.sleep(SETTLE_S)
            run.at_bound_ttfts = await at_bound_ttfts(http, model, plan)
            await asyncio.sleep(SETTLE_S)
            run.floor_ttfts = await floor_ttfts(http, model, plan)
            await asyncio.sleep(SETTLE_S)
            run.baseline_rss_mib = rss_mib(pool)
            for number in range(1, plan.rounds + 1):
                run.rounds.append(await flood_round(pool, http, depths, model, plan, number))
            run.sustained = await sustained(pool, http, depths, model, plan)
    finally:
        await depths.aredis.aclose()
    return run


# --- the report --------------------------------------------------------------------------------


def _series(samples: list[Sample]) -> str:
    """`t:queued/in flight` for up to SERIES_POINTS samples, the time printed with each: the
    sampler shares its event loop with the flood's clients, so the samples are not evenly spaced.
    """
    step = max(1, math.ceil(len(samples) / SERIES_POINTS))
    return " ".join(
        f"{s.t:.1f}:{sum(s.per_worker) + s.shared}/{s.inflight}" for s in samples[::step]
    )


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1000:.0f}" if values else "-"


def print_round(rnd: Round, plan: Plan) -> None:
    accepted, rejected, other = (rnd.of_kind(k) for k in (ACCEPTED, REJECTED, OTHER))
    ttfts = rnd.ttfts()
    tokens = [r.completion_tokens for r in accepted if r.completion_tokens is not None]
    retry_after = sorted({r.why for r in rejected})
    tokens_range = f"{min(tokens, default=0)}..{max(tokens, default=0)}"
    totals = [r.total for r in accepted if r.total is not None]
    refused_in = [r.answered for r in rejected]
    rows = [
        [
            len(rnd.replies),
            len(accepted),
            len(rejected),
            len(other),
            _ms(ttfts, 50),
            _ms(ttfts, 99),
            _ms(totals, 50),
            _ms(refused_in, 50),
            _ms(refused_in, 99),
            tokens_range,
            f"{rnd.wall_s:.1f}",
        ]
    ]
    print(f"round {rnd.number}")
    print(
        table(
            [
                "sent",
                "accepted",
                "429",
                "other",
                "TTFT p50 ms",
                "TTFT p99 ms",
                "done p50 ms",
                "429 p50 ms",
                "429 p99 ms",
                "tokens",
                "wall s",
            ],
            rows,
        )
    )
    print(f"429 Retry-After values: {', '.join(retry_after) or '-'}")
    for why, n in Counter(f"{r.status} {r.why}" for r in other).most_common(3):
        print(f"  other x{n}: {why}")
    samples = rnd.samples
    max_shared = max((s.shared for s in samples), default=0)
    max_workers = [max((s.per_worker[i] for s in samples), default=0) for i in range(len(WORKERS))]
    max_inflight = max((s.inflight for s in samples), default=0)
    print(
        f"queue depth max: shared {max_shared}, "
        + ", ".join(f"{w} {d}" for w, d in zip(WORKERS, max_workers, strict=True))
        + f"; in flight max {max_inflight} (bound {plan.bound})"
    )
    print(f"s:queued/in flight ({len(samples)} samples): {_series(samples)}")
    print(f"redis keys after the round: {rnd.redis_keys}")
    print()


def rss_rows(run: Run) -> tuple[list[str], list[list[Any]], dict[str, float]]:
    """(headers, rows, growth from round 1 to the last, MiB, per process)."""
    names = list(run.baseline_rss_mib)
    for rnd in run.rounds:
        names += [n for n in rnd.rss_mib if n not in names]
    headers = ["RSS MiB", "before", *(f"round {r.number}" for r in run.rounds), "growth 1->last"]
    growth: dict[str, float] = {}
    rows = []
    for name in names:
        values = [run.baseline_rss_mib.get(name), *(r.rss_mib.get(name) for r in run.rounds)]
        first, last = values[1], values[-1]
        if first is not None and last is not None:
            growth[name] = last - first
        rows.append(
            [
                name,
                *(f"{v:.1f}" if v is not None else "-" for v in values),
                f"{growth[name]:+.1f}" if name in growth else "-",
            ]
        )
    return headers, rows, growth


def grew(name: str, growth: float, run: Run) -> bool:
    first = run.rounds[0].rss_mib.get(name, 0.0)
    return growth > max(GROWTH_TOLERANCE_MIB, GROWTH_TOLERANCE_FRACTION * first)


def print_report(run: Run, plan: Plan) -> bool:
    lone = median(run.lone_ttfts)
    low, high = min(run.lone_ttfts) * 1000, max(run.lone_ttfts) * 1000
    print(
        f"lone request TTFT: median {lone * 1000:.0f} ms over {len(run.lone_ttfts)} "
        f"(min {low:.0f}, max {high:.0f})"
    )
    print()
    for rnd in run.rounds:
        print_round(rnd, plan)
    headers, rows, growth = rss_rows(run)
    print(table(headers, rows))
    print(
        f"(after each round, once nothing is in flight or queued, +{SETTLE_S:g} s; redis is "
        "shown, not judged)"
    )
    print()
    others = sum(len(r.of_kind(OTHER)) for r in run.rounds)
    worst_p99 = max((percentile(r.ttfts(), 99) for r in run.rounds), default=float("nan"))
    ttft_ratio = worst_p99 / lone if lone else float("nan")
    judged = {n: g for n, g in growth.items() if not n.startswith(REDIS)}
    growing = [n for n, g in judged.items() if grew(n, g, run)]
    totals = Counter(r.kind for rnd in run.rounds for r in rnd.replies)
    print(
        f"requests            {sum(totals.values())}: accepted {totals[ACCEPTED]}, "
        f"429 {totals[REJECTED]}, other {totals[OTHER]}"
    )
    print(f"errors other than 429  {others}")
    print(
        f"p99 TTFT accepted / lone TTFT  {ttft_ratio:.2f} (worst round p99 "
        f"{worst_p99 * 1000:.0f} ms, lone {lone * 1000:.0f} ms; bound {plan.bound})"
    )
    at_bound = percentile(run.at_bound_ttfts, 99)
    print(
        f"p99 TTFT accepted / p99 of {plan.bound} requests at once without a flood  "
        f"{worst_p99 / at_bound:.2f} ({at_bound * 1000:.0f} ms: what admission can at best "
        f"keep; {len(run.at_bound_ttfts)} of {plan.bound} accepted)"
    )
    floor = percentile(run.floor_ttfts, 99)
    print(
        f"floor: p99 TTFT of {plan.bound} requests beside {plan.flood - plan.bound} the router "
        f"answers 404 (no admission)  {floor * 1000:.0f} ms = {floor / lone:.2f}x lone "
        f"({len(run.floor_ttfts)} of {plan.bound} accepted): the least a flood of this size "
        "costs the accepted here, whatever admission does"
    )
    if run.sustained is not None:
        sus = run.sustained
        per = sus.router_cpu_s / max(1, sum(sus.statuses.values())) * 1000
        print(
            f"sustained overload ({SUSTAINED_CLIENTS} clients, closed loop, pool held full, "
            f"{sus.seconds:.1f} s): {sus.refused / sus.seconds:.0f} refusals/s, statuses "
            f"{dict(sorted(sus.statuses.items()))}, router CPU {per:.2f} ms a request "
            f"(busy hold {plan.busy_hold_ms if plan.busy_hold_ms is not None else 'default'} "
            "ms)"
        )
    print(
        "RSS growth round 1 -> last: "
        + ", ".join(f"{n} {g:+.1f} MiB" for n, g in judged.items())
        + f" (tolerance max({GROWTH_TOLERANCE_MIB:g} MiB, "
        f"{GROWTH_TOLERANCE_FRACTION:.0%}))"
    )
    met = others == 0 and ttft_ratio <= 2.0 and not growing and len(run.rounds) == plan.rounds
    print(
        f"goal: 0 errors other than 429 ({others}), p99 TTFT accepted <= 2x lone "
        f"({ttft_ratio:.2f}x), no RSS growth in router or workers "
        f"({', '.join(growing) or 'none grew'}) -> {'MET' if met else 'MISSED'}"
    )
    return met


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="150 requests a round, 5 lone ones")
    p.add_argument("--flood", type=int, default=0, help="requests per round (300; quick 150)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--bound",
        type=int,
        default=0,
        help="MLXCEL_MAX_INFLIGHT (default: 2 workers x --batch-size)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="MLXCEL_BATCH_SIZE per worker")
    p.add_argument(
        "--busy-hold-ms", type=float, default=None, help="MLXCEL_BUSY_HOLD_MS (default: the pool's)"
    )
    output_args(p, "write every reply and sample here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan.of(args)
    announce()
    model_dir = tiny_model_dir()
    env = plan.env()
    print(
        f"# model {model_dir.name}; {len(WORKERS)} workers, 1 router process; "
        f"{' '.join(f'{k}={v}' for k, v in env.items())}; {plan.flood} streams at once per "
        f"round x {plan.rounds} rounds, prompt {PROMPT!r}, max_tokens {MAX_TOKENS}, client "
        f"timeout {plan.request_timeout_s:g} s",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="mlxcel-flood-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        with running_pool(
            model_dir, work, workers=len(WORKERS), env=env, overrides=OVERRIDES
        ) as pool:
            run = asyncio.run(flood(pool, plan))
            tracebacks = {n: pool.logs(n).count("Traceback") for n in ("router", *WORKERS)}
        print(f"  logs in {work / 'logs'}; tracebacks: {tracebacks}", file=sys.stderr)
    met = print_report(run, plan)
    write_json(
        args.json,
        {
            "plan": plan,
            "goal_met": met,
            "lone_ttfts": run.lone_ttfts,
            "at_bound_ttfts": run.at_bound_ttfts,
            "floor_ttfts": run.floor_ttfts,
            "sustained": run.sustained,
            "baseline_rss_mib": run.baseline_rss_mib,
            "rounds": run.rounds,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
