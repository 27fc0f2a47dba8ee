"""Routing at scale: what cache-aware routing costs as workers double, on synthetic workers.

One machine stands in for up to 64 workers: bench/synthetic_worker.py runs them as threads of
one process, each with the real Redis side of a worker (WorkerPresence, RqIntake, Publisher:
registration, heartbeats, rq's bookkeeping, one pipeline per step) and the MLX engine replaced
by a clock that emits tokens to every running sequence each step. Each worker's block set
holds `--blocks` random 8-byte members (100,000; --quick 20,000) and INDEX_MARKER, plus one
prefix family of its own: 512 tokens some prompts start with, hashed as the router hashes them.
One Redis and ONE router process (`tests/pool_fixture.running_pool` with no real workers; the
tiny model only for its tokenizer) serve everything, with admission bounds far above what is
sent (no 429). Workers are added doubling, 1, 2, 4, ... 64 (--quick: 1, 4, 16), and at each
count:

1. Decisions: `AdmissionLedger.reserve` (router/placement/placement.lua over real Redis) timed from
this process, one at a time, for 1,024-token prompts (64 blocks): 3 of 4 start with a random
worker's family, the rest match nothing. Each reservation is released right after, through EVAL (the
ledger's own keys and arguments), so INFO commandstats' EVALSHA line times the placement script
alone. Reported: p50/p99 of reserve's round trip, the script's own Redis time per call, and Redis
CPU per reserve + release (INFO cpu used_cpu_sys + used_cpu_user, less Redis's idle rate measured
just before), with the outcomes; and the floor, right after the first pass: the same calls (their
arguments built and sent, the reply parsed) to a script that only answers, timed the same way, so
the p99 shows what this machine's round trip holds before any placing. 2. Relay cost: streaming
/v1/completions (token-id prompts of the same shape) from `--streams` (32) closed-loop clients, a
synthetic step every 20 ms with 1 token (50 tokens/s a stream), in two windows after a warm-up:
max_tokens 1, then max_tokens 32..96 (64 on average). The router's CPU (psutil: its process and
children) and Redis's are split into a cost per routed request and one per relayed token by solving
cpu = a * requests + b * tokens over the two windows.

Then, all workers up, the relay curve: streams of max_tokens 128..384 (256 on average) at rising
concurrency (8, 32, 128, 256; --quick 16, 64), the workers now emitting 4 tokens (4 delta
events: the router still relays one event per token) every 40 ms, 100 tokens/s a stream
(25,600 offered at 256 streams): relayed tokens/s, each stream's pace, and where the cores
went (router, Redis, the synthetic workers' process, this load generator). Clients start
spread over the warm-up and lengths vary, so streams do not run in lockstep. The most tokens/s
one router process relays is the curve's peak; where the four share two cores, relayed tokens
per router CPU-second is what it would relay with a core to itself. The workers compute
nothing, so no prompt-cache effect is measured, only routing and relaying.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_routing_scale.py [--quick]
        [--blocks N] [--streams 32] [--stages 1,8,64] [--relay-streams 8,256]
        [--work-dir DIR] [--json out.json]

Full run ~5 minutes on 2 cores, --quick about 1. Progress goes to stderr, tables to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, astuple, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import redis
import redis.asyncio as aioredis
from common import REPO, announce, output_args, table, tiny_model_dir, write_json

from router.placement.ledger import PLACE_KEYS, RELEASE_LUA, AdmissionLedger
from router.placement.place_call import Placement, parse_reply
from shared import keys
from shared.block_hash import BlockHasher, CacheNamespace, index_members
from shared.config import Settings, load_settings
from shared.liveness import min_alive_pttl_ms
from tests.pool_fixture import running_pool, wait_for

MODEL = "mlxcel-tiny-s0"
PROMPT_TOKENS = 1024  # 64 blocks of 16
PREFIX_TOKENS = 512  # a prefix family: the first 32 blocks, held by one worker
FAMILY_SHARE = 0.75  # prompts that start with some worker's family; the rest match nothing
VOCAB = (5, 1024)  # token ids drawn from [5, 1024): the tiny model's vocabulary, no specials
WARMUP_DECISIONS = 20
# Reservations a worker holds while the second pass is timed: with 1-2 requests' routed marks
# (64-128 members) a worker's routed zset is still a listpack, where ZMSCORE scans.
HELD_PER_WORKER = 2
# The floor's script: the placement reply's shape (admitted to the shared queue), no work.
NOOP_PLACE_LUA = "return {1, 'no_worker', '', 0, 0, 0, 0, 0}"
BODIES = 512  # distinct request bodies per setting, cycled
DEFAULT_STEP_MS = 20.0  # synthetic decode step (50 tokens/s a stream) while workers double
# The relay curve: 100 tokens/s a stream, as 4 tokens (4 delta events: the router still relays
# one event per token) every 40 ms, so the workers' process spends a quarter of the pipelines.
RELAY_STEP_MS = 40.0
RELAY_TOKENS_PER_STEP = 4
ENV = {  # bounds far above anything this sends: nothing is refused with a 429
    "MLXCEL_MAX_INFLIGHT": "100000",
    "MLXCEL_MAX_INFLIGHT_PER_WORKER": "4096",
    "MLXCEL_MAX_QUEUED_PROMPT_TOKENS": "0",
}
OVERRIDES = {"router": {"processes": 1}}
STARTED = time.perf_counter()


def progress(message: str) -> None:
    print(f"  [{time.perf_counter() - STARTED:5.0f}s] {message}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Plan:
    stages: tuple[int, ...]
    blocks: int
    decisions: int
    streams: int
    warm_s: float
    window_s: float
    relay_streams: tuple[int, ...]
    relay_max_tokens: int
    relay_warm_s: float
    relay_window_s: float
    batch_size: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> Plan:
        if args.quick:
            plan = cls(
                (1, 4, 16),
                args.blocks or 20_000,
                300,
                args.streams,
                1.5,
                2.5,
                (16, 64),
                256,
                3.0,
                5.0,
                256,
            )
        else:
            plan = cls(
                (1, 2, 4, 8, 16, 32, 64),
                args.blocks or 100_000,
                1000,
                args.streams,
                2.0,
                6.0,
                (8, 32, 128, 256),
                256,
                5.0,
                10.0,
                256,
            )
        if args.stages:
            plan = replace(plan, stages=_counts(args.stages))
        if args.relay_streams:
            plan = replace(plan, relay_streams=_counts(args.relay_streams))
        return plan


def _counts(text: str) -> tuple[int, ...]:
    return tuple(sorted(int(n) for n in text.split(",")))


# --- prompts ---------------------------------------------------------------------------------


@dataclass
class Prompts:
    """Each worker's prefix family and prompts built on them, with their block index members
    exactly as the router computes them (model id, no adapter, no chat template)."""

    hasher: BlockHasher
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    families: dict[str, list[int]] = field(default_factory=dict)  # worker id -> prefix tokens

    def _tokens(self, n: int) -> list[int]:
        return self.rng.choices(range(*VOCAB), k=n)

    def members(self, tokens: list[int]) -> list[bytes]:
        return index_members(self.hasher.chain(tokens, CacheNamespace(MODEL).seed()))

    def family_for(self, wid: str) -> list[bytes]:
        """A new prefix family for the worker: its block members (to put in its block set)."""
        prefix = self.families[wid] = self._tokens(PREFIX_TOKENS)
        return self.members(prefix)

    def prompt(self, wids: list[str]) -> tuple[list[int], str]:
        """A prompt and the worker whose family it starts with ("" none)."""
        if self.rng.random() < FAMILY_SHARE:
            wid = self.rng.choice(wids)
            return self.families[wid] + self._tokens(PROMPT_TOKENS - PREFIX_TOKENS), wid
        return self._tokens(PROMPT_TOKENS), ""


# --- the synthetic workers -------------------------------------------------------------------


class SyntheticWorkers:
    """bench/synthetic_worker.py in a subprocess, driven over its stdin."""

    def __init__(self, redis_url: str, plan: Plan, step_ms: float, log_path: Path) -> None:
        cmd = [
            sys.executable,
            str(REPO / "bench" / "synthetic_worker.py"),
            "--redis-url",
            redis_url,
            "--model",
            MODEL,
            "--blocks",
            str(plan.blocks),
            "--step-ms",
            str(step_ms),
            "--batch-size",
            str(plan.batch_size),
        ]
        self.log = log_path.open("ab")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True
        )
        self.ids: list[str] = []

    def _ask(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer:
            raise RuntimeError(
                f"the synthetic workers exited ({self.proc.poll()}); see {self.log.name}"
            )
        return answer

    def add(self, wids: list[str]) -> None:
        answer = self._ask("add " + ",".join(wids))
        if answer != f"ready {len(self.ids) + len(wids)}":
            raise RuntimeError(f"synthetic workers: {answer!r}")
        self.ids += wids

    def step(self, ms: float, tokens: int) -> None:
        answer = self._ask(f"step {ms:g} {tokens}")
        if answer != "ok":
            raise RuntimeError(f"synthetic workers: {answer!r}")

    def stats(self) -> dict[str, int]:
        answer = self._ask("stats")
        return dict(json.loads(answer.partition(" ")[2]))

    def cpu_s(self) -> float:
        t = psutil.Process(self.proc.pid).cpu_times()
        return t.user + t.system

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._ask("quit")
                self.proc.wait(30)
            except (RuntimeError, OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def worker_ids(n: int) -> list[str]:
    return [f"s{i:02d}" for i in range(1, n + 1)]


def seed_families(r: redis.Redis, prompts: Prompts, wids: list[str]) -> None:
    """Each new worker's block set also holds its prefix family (under its current epoch), and
    the worker is listed as a holder of the family's first block, as a worker lists itself."""
    with r.pipeline(transaction=False) as pipe:
        for wid in wids:
            pipe.hget(keys.worker_info(wid), "epoch")
        epochs = pipe.execute()
    with r.pipeline(transaction=False) as pipe:
        for wid, epoch in zip(wids, epochs, strict=True):
            if not epoch:
                raise RuntimeError(f"synthetic worker {wid} has no epoch in its info hash")
            family = prompts.family_for(wid)
            pipe.sadd(keys.worker_blocks(wid, epoch.decode()), *family)
            pipe.sadd(keys.routing_holders(family[0].hex()), wid)
        pipe.execute()


def all_live(r: redis.Redis, wids: list[str]) -> bool:
    with r.pipeline(transaction=False) as pipe:
        for wid in wids:
            pipe.pttl(keys.worker_info(wid))
        return all(int(p) > min_alive_pttl_ms() for p in pipe.execute())


# --- CPU accounting --------------------------------------------------------------------------


def redis_cpu_s(r: redis.Redis) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def tree_cpu_s(pid: int) -> float:
    proc = psutil.Process(pid)
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


@dataclass
class Cpu:
    """CPU seconds so far of each side, and the wall clock."""

    t: float
    router: float
    redis: float
    workers: float
    client: float

    @classmethod
    def now(cls, r: redis.Redis, router_pid: int, workers: SyntheticWorkers) -> Cpu:
        me = psutil.Process().cpu_times()
        return cls(
            time.perf_counter(),
            tree_cpu_s(router_pid),
            redis_cpu_s(r),
            workers.cpu_s(),
            me.user + me.system,
        )

    def __sub__(self, other: Cpu) -> Cpu:
        return Cpu(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


def evalsha_stats(r: redis.Redis) -> tuple[int, float]:
    """(calls, usec) of EVALSHA since Redis started (INFO commandstats)."""
    stats = r.info("commandstats").get("cmdstat_evalsha") or {}
    return int(stats.get("calls", 0)), float(stats.get("usec", 0))


# --- 1. decisions ----------------------------------------------------------------------------


@dataclass
class Pass:
    """One pass of timed decisions."""

    p50_ms: float
    p99_ms: float
    script_us: float  # the placement script's own time in Redis, per call
    redis_cpu_ms: float  # Redis CPU per reserve + release, less the idle rate
    outcomes: dict[str, int]
    on_family: float  # family prompts placed on the worker holding their family


@dataclass
class Decisions:
    workers: int
    blocks: int
    n: int
    hash_us: float  # the router's share before the script: 64 block hashes, p50
    idle: Pass  # nothing else in flight
    held: int  # reservations held during the second pass (their load, their routed marks)
    loaded: Pass
    floor: tuple[float, float]  # p50, p99 ms of the first pass's calls to a do-nothing script


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))] if s else float("nan")


def idle_rate(r: redis.Redis, seconds: float = 1.0) -> float:
    """Redis CPU seconds per second while nothing but the workers' heartbeats runs."""
    c0, t0 = redis_cpu_s(r), time.perf_counter()
    time.sleep(seconds)
    return (redis_cpu_s(r) - c0) / (time.perf_counter() - t0)


def release_eval(ledger: AdmissionLedger, r: redis.Redis, rid: str) -> None:
    """The ledger's own release, sent as EVAL: the same script and the same work, but counted
    apart from EVALSHA in INFO commandstats, which then times the placement script alone."""
    call = ledger._release_call(rid)
    r.eval(RELEASE_LUA, len(call["keys"]), *call["keys"], *call["args"])


def reserve(ledger: AdmissionLedger, rid: str, members: list[bytes]) -> Placement:
    placed = ledger.reserve(rid, PROMPT_TOKENS, MODEL, members)
    if not isinstance(placed, Placement):
        raise RuntimeError(f"a decision was refused: {placed}")
    return placed


def floor_call(ledger: AdmissionLedger, noop: Any, members: list[bytes]) -> float:
    """Seconds for reserve's call to the do-nothing script: its arguments built, the call, the
    reply parsed (what reserve does but place)."""
    t0 = time.perf_counter()
    call = ledger._place_call(uuid.uuid4().hex, PROMPT_TOKENS, MODEL, ())
    parse_reply(noop(keys=PLACE_KEYS, args=call.argv(members)))
    return time.perf_counter() - t0


def floor_pass(
    ledger: AdmissionLedger, r: redis.Redis, cases: list[tuple[list[bytes], str]]
) -> tuple[float, float]:
    """(p50, p99) ms of the cases' calls to the do-nothing script, one after another."""
    noop = r.register_script(NOOP_PLACE_LUA)
    floor_call(ledger, noop, cases[0][0])  # loads the script (NOSCRIPT once)
    took = [floor_call(ledger, noop, members) for members, _ in cases]
    return percentile(took, 50) * 1000, percentile(took, 99) * 1000


def timed_pass(
    ledger: AdmissionLedger, r: redis.Redis, cases: list[tuple[list[bytes], str]], idle: float
) -> Pass:
    """Each case reserved (timed) and released at once, one after another."""
    calls0, usec0 = evalsha_stats(r)
    cpu0, wall0 = redis_cpu_s(r), time.perf_counter()
    took: list[float] = []
    outcomes: dict[str, int] = {}
    family_hits = family_total = 0
    for members, family in cases:
        rid = uuid.uuid4().hex
        t0 = time.perf_counter()
        placed = reserve(ledger, rid, members)
        took.append(time.perf_counter() - t0)
        outcomes[placed.outcome] = outcomes.get(placed.outcome, 0) + 1
        if family:
            family_total += 1
            family_hits += placed.worker_id == family
        release_eval(ledger, r, rid)
    wall = time.perf_counter() - wall0
    redis_cpu = redis_cpu_s(r) - cpu0 - idle * wall
    calls1, usec1 = evalsha_stats(r)
    if calls1 - calls0 != len(cases):
        progress(f"note: {calls1 - calls0} EVALSHA calls for {len(cases)} decisions")
    return Pass(
        p50_ms=percentile(took, 50) * 1000,
        p99_ms=percentile(took, 99) * 1000,
        script_us=(usec1 - usec0) / max(calls1 - calls0, 1),
        redis_cpu_ms=redis_cpu / len(cases) * 1000,
        outcomes=outcomes,
        on_family=family_hits / family_total if family_total else float("nan"),
    )


def time_decisions(
    ledger: AdmissionLedger, r: redis.Redis, prompts: Prompts, wids: list[str], n: int, blocks: int
) -> Decisions:
    """A pass with nothing in flight, then one while HELD_PER_WORKER reservations a worker are
    held (placed by the same script: load, prefill entries, routed marks), then released."""
    cases: list[tuple[list[bytes], str]] = []
    hash_s: list[float] = []
    for _ in range(n + WARMUP_DECISIONS):
        tokens, family = prompts.prompt(wids)
        t0 = time.perf_counter()
        members = prompts.members(tokens)
        hash_s.append(time.perf_counter() - t0)
        cases.append((members, family))
    warmup, cases = cases[:WARMUP_DECISIONS], cases[WARMUP_DECISIONS:]
    for members, _ in warmup:  # loads the script (NOSCRIPT once), warms up
        rid = uuid.uuid4().hex
        reserve(ledger, rid, members)
        release_eval(ledger, r, rid)
    idle = idle_rate(r)
    quiet = timed_pass(ledger, r, cases, idle)
    floor = floor_pass(ledger, r, cases)
    held = [uuid.uuid4().hex for _ in range(HELD_PER_WORKER * len(wids))]
    for rid in held:
        reserve(ledger, rid, prompts.members(prompts.prompt(wids)[0]))
    try:
        loaded = timed_pass(ledger, r, cases, idle)
    finally:
        for rid in held:
            release_eval(ledger, r, rid)
    hash_us = percentile(hash_s, 50) * 1e6
    return Decisions(len(wids), blocks, n, hash_us, quiet, len(held), loaded, floor)


# --- 2. relaying -----------------------------------------------------------------------------


@dataclass
class Flow:
    """What the load generator saw, counted as it happens (read at the window's edges)."""

    requests: int = 0
    tokens: int = 0
    errors: int = 0
    mismatched: int = 0  # usage.completion_tokens differs from the content chunks received
    paced: int = 0  # finished requests of 2 tokens or more
    pace: float = 0.0  # their tokens/s (first to last token), summed
    stop: bool = False
    last_error: str = ""


@dataclass
class Window:
    streams: int
    max_tokens: int
    requests: int
    tokens: int
    errors: int
    mismatched: int
    cpu: Cpu  # CPU seconds over the window (t: its wall seconds)
    pace: float  # tokens/s a stream, first to last token, mean over the finished
    redis_time: list[tuple[str, float, int]] = field(default_factory=list)  # by command

    @property
    def tok_s(self) -> float:
        return self.tokens / self.cpu.t

    @property
    def req_s(self) -> float:
        return self.requests / self.cpu.t

    def cores(self, side: str) -> float:
        return float(getattr(self.cpu, side)) / self.cpu.t


def redis_time(
    before: dict[str, Any], after: dict[str, Any], top: int = 6
) -> list[tuple[str, float, int]]:
    """(command, seconds, calls) of the commands Redis spent most time in between two INFO
    commandstats; a script's line includes the commands it called, which also have their own."""
    out = []
    for name, now in after.items():
        then = before.get(name, {})
        usec = float(now["usec"]) - float(then.get("usec", 0))
        calls = int(now["calls"]) - int(then.get("calls", 0))
        if calls:
            out.append((name.removeprefix("cmdstat_"), usec / 1e6, calls))
    return sorted(out, key=lambda c: -c[1])[:top]


def spread(max_tokens: int) -> str:
    """The max_tokens range `bodies` draws from, as text."""
    return f"{max(1, max_tokens // 2)}..{max(1, max_tokens * 3 // 2)}"


def bodies(prompts: Prompts, wids: list[str], max_tokens: int) -> list[bytes]:
    """Request bodies; max_tokens varies from half to 1.5 times the given mean, so closed-loop
    streams drift out of step instead of starting and ending together."""
    out = []
    for _ in range(BODIES):
        tokens, _ = prompts.prompt(wids)
        n = prompts.rng.randint(max(1, max_tokens // 2), max(1, max_tokens * 3 // 2))
        body = {
            "model": MODEL,
            "prompt": tokens,
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        out.append(json.dumps(body).encode())
    return out


async def client_loop(
    http: aiohttp.ClientSession, todo: list[bytes], start: int, delay_s: float, flow: Flow
) -> None:
    """Requests one after another until told to stop; a light SSE reader (no JSON per chunk)."""
    await asyncio.sleep(delay_s)
    i = start
    headers = {"Content-Type": "application/json"}
    while not flow.stop:
        body = todo[i % len(todo)]
        i += 1
        try:
            async with http.post("/v1/completions", data=body, headers=headers) as resp:
                if resp.status != 200:
                    flow.errors += 1
                    flow.last_error = f"{resp.status} {(await resp.text())[:200]}"
                    await asyncio.sleep(0.05)
                    continue
                n, usage, first, last = 0, None, 0.0, 0.0
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    if line.startswith(b"data: [DONE]"):
                        break
                    if b'"finish_reason":null' in line:
                        n += 1
                        flow.tokens += 1
                        last = time.perf_counter()
                        first = first or last
                    elif b'"usage":{' in line:
                        usage = json.loads(line[6:])["usage"]
                    elif b'"error"' in line:
                        flow.errors += 1
                        flow.last_error = line.decode(errors="replace")[:200]
                flow.requests += 1
                if n > 1 and last > first:
                    flow.paced += 1
                    flow.pace += (n - 1) / (last - first)
                if usage is None or int(usage["completion_tokens"]) != n:
                    flow.mismatched += 1
        except (aiohttp.ClientError, TimeoutError) as exc:
            flow.errors += 1
            flow.last_error = f"{type(exc).__name__}: {exc}"


async def relay_window(
    url: str,
    todo: list[bytes],
    streams: int,
    warm_s: float,
    window_s: float,
    snap: Any,
    r: redis.Redis | None = None,
) -> Window:
    """`streams` closed-loop clients, started spread over the first 3/4 of the warm-up; the
    window's counts and CPU seconds."""
    flow = Flow()
    connector = aiohttp.TCPConnector(limit=streams + 8)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(base_url=url, connector=connector, timeout=timeout) as http:
        tasks = [
            asyncio.create_task(client_loop(http, todo, k * 7, 0.75 * warm_s * k / streams, flow))
            for k in range(streams)
        ]
        await asyncio.sleep(warm_s)
        c0, before = snap(), Flow(**{k: v for k, v in vars(flow).items()})
        s0 = r.info("commandstats") if r is not None else {}
        await asyncio.sleep(window_s)
        c1 = snap()
        s1 = r.info("commandstats") if r is not None else {}
        done, paced = flow.requests - before.requests, flow.paced - before.paced
        pace = (flow.pace - before.pace) / paced if paced else float("nan")
        window = Window(
            streams,
            0,
            done,
            flow.tokens - before.tokens,
            flow.errors - before.errors,
            flow.mismatched - before.mismatched,
            c1 - c0,
            pace,
            redis_time(s0, s1),
        )
        flow.stop = True
        await asyncio.gather(*tasks)
    if flow.errors:
        progress(f"{flow.errors} error(s); last: {flow.last_error}")
    return window


@dataclass
class RelayCost:
    workers: int
    streams: int
    short: Window  # max_tokens 1
    long: Window  # max_tokens LONG_TOKENS
    router_ms_per_req: float
    router_us_per_tok: float
    redis_ms_per_req: float
    redis_us_per_tok: float


LONG_TOKENS = 64


def split(short: Window, long: Window, side: str) -> tuple[float, float]:
    """(CPU s per request, CPU s per token) solving cpu = a * requests + b * tokens over the
    two windows."""
    cs, cl = getattr(short.cpu, side), getattr(long.cpu, side)
    det = short.requests * long.tokens - long.requests * short.tokens
    if not det:
        return float("nan"), float("nan")
    a = (cs * long.tokens - cl * short.tokens) / det
    b = (short.requests * cl - long.requests * cs) / det
    return a, b


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Run:
    plan: Plan
    decisions: list[Decisions] = field(default_factory=list)
    costs: list[RelayCost] = field(default_factory=list)
    relay: list[Window] = field(default_factory=list)
    relay_workers: int = 0
    fill_s: dict[int, float] = field(default_factory=dict)
    redis_used_mib: float = 0.0
    worker_totals: dict[str, int] = field(default_factory=dict)


def make_ledger(settings: Settings, r: redis.Redis) -> AdmissionLedger:
    aredis = aioredis.Redis.from_url(settings.redis.url)  # never awaited here: release is EVAL
    return AdmissionLedger(settings.admission, settings.routing, settings.prompt_cache, r, aredis)


def bench(pool: Any, plan: Plan, work: Path) -> Run:
    run = Run(plan)
    settings = load_settings(environ={**ENV, "REDIS_URL": pool.redis_url})
    r = redis.Redis.from_url(pool.redis_url)
    pc = settings.prompt_cache
    prompts = Prompts(BlockHasher(pc.apc_block_size, pc.apc_hash))
    ledger = make_ledger(settings, r)
    router_pid = pool.pid("router")
    workers = SyntheticWorkers(pool.redis_url, plan, DEFAULT_STEP_MS, work / "synthetic.log")

    def snap() -> Cpu:
        return Cpu.now(r, router_pid, workers)

    try:
        for n in plan.stages:
            wids = worker_ids(n)
            t0 = time.perf_counter()
            workers.add(wids[len(workers.ids) :])
            run.fill_s[n] = time.perf_counter() - t0
            seed_families(r, prompts, [w for w in wids if w not in prompts.families])
            wait_for(lambda wids=wids: all_live(r, wids), 30, f"{n} synthetic workers live")
            progress(f"{n} workers up ({run.fill_s[n]:.1f}s to add)")
            dec = time_decisions(ledger, r, prompts, wids, plan.decisions, plan.blocks)
            run.decisions.append(dec)
            progress(
                f"decisions: p50 {dec.idle.p50_ms:.2f} ms, {dec.loaded.p50_ms:.2f} ms with "
                f"{dec.held} held"
            )
            run.costs.append(relay_cost(pool.url, prompts, wids, plan, snap))
        run.redis_used_mib = float(r.info("memory")["used_memory"]) / 2**20
        # The relay curve: every worker up, stepping faster.
        workers.step(RELAY_STEP_MS, RELAY_TOKENS_PER_STEP)
        run.relay_workers = len(workers.ids)
        todo = bodies(prompts, workers.ids, plan.relay_max_tokens)
        for streams in plan.relay_streams:
            w = asyncio.run(
                relay_window(
                    pool.url, todo, streams, plan.relay_warm_s, plan.relay_window_s, snap, r
                )
            )
            w.max_tokens = plan.relay_max_tokens
            run.relay.append(w)
            progress(
                f"relay {streams} streams: {w.tok_s:.0f} tok/s, router "
                f"{w.cores('router'):.2f} cores"
            )
        run.worker_totals = workers.stats()
    finally:
        workers.close()
    return run


def relay_cost(url: str, prompts: Prompts, wids: list[str], plan: Plan, snap: Any) -> RelayCost:
    short = asyncio.run(
        relay_window(url, bodies(prompts, wids, 1), plan.streams, plan.warm_s, plan.window_s, snap)
    )
    short.max_tokens = 1
    long = asyncio.run(
        relay_window(
            url, bodies(prompts, wids, LONG_TOKENS), plan.streams, plan.warm_s, plan.window_s, snap
        )
    )
    long.max_tokens = LONG_TOKENS
    ra, rb = split(short, long, "router")
    da, db = split(short, long, "redis")
    progress(
        f"relay cost: {short.req_s:.0f} req/s at max_tokens 1, {long.tok_s:.0f} tok/s at "
        f"{LONG_TOKENS}"
    )
    return RelayCost(len(wids), plan.streams, short, long, ra * 1000, rb * 1e6, da * 1000, db * 1e6)


# --- the report ------------------------------------------------------------------------------


def print_report(run: Run) -> None:
    plan = run.plan
    print()
    print(
        f"Routing decisions: AdmissionLedger.reserve, {PROMPT_TOKENS}-token prompts "
        f"({PROMPT_TOKENS // 16} blocks; {FAMILY_SHARE:.0%} start with a worker's "
        f"{PREFIX_TOKENS}-token family), {plan.decisions} a pass, one at a time"
    )
    rows = []
    for d in run.decisions:
        q, h = d.idle, d.loaded
        mix = "/".join(str(q.outcomes.get(k, 0)) for k in ("cache", "load", "spill"))
        held_mix = "/".join(str(h.outcomes.get(k, 0)) for k in ("cache", "load", "spill"))
        rows.append(
            [
                d.workers,
                d.blocks,
                f"{q.p50_ms:.3f}",
                f"{q.p99_ms:.3f}",
                f"{d.floor[0]:.3f} / {d.floor[1]:.3f}",
                f"{q.script_us:.0f}",
                f"{q.redis_cpu_ms:.3f}",
                mix,
                f"{q.on_family:.0%}",
                d.held,
                f"{h.p50_ms:.3f}",
                f"{h.p99_ms:.3f}",
                f"{h.script_us:.0f}",
                f"{h.redis_cpu_ms:.3f}",
                held_mix,
            ]
        )
    print(
        table(
            [
                "workers",
                "blocks/worker",
                "p50 ms",
                "p99 ms",
                "floor p50 / p99",
                "script us",
                "Redis CPU ms",
                "cache/load/spill",
                "on family",
                "held",
                "p50 ms",
                "p99 ms",
                "script us",
                "Redis CPU ms",
                "cache/load/spill",
            ],
            rows,
        )
    )
    hash_us = [d.hash_us for d in run.decisions]
    print(
        "(left: nothing else in flight; right of `held`: the same decisions while that many "
        f"reservations are held, {HELD_PER_WORKER} a worker. p50/p99: reserve's round trip "
        "from Python; floor: the same calls right after to a script that only answers (the "
        "machine's round trip before any placing); script us: Redis's own time in the "
        "placement script a call (INFO "
        "commandstats); Redis CPU ms: INFO cpu per reserve + release, less Redis's idle "
        "rate; on family: family prompts placed on the worker holding it. Hashing a "
        f"prompt's 64 blocks before: p50 {min(hash_us):.0f}-{max(hash_us):.0f} us)"
    )
    print(
        f"Redis used_memory with {plan.stages[-1]} block sets: {run.redis_used_mib:.0f} MiB; "
        "seconds to add the workers of a row (register + fill): "
        + ", ".join(f"{n}: {s:.1f}" for n, s in run.fill_s.items())
    )
    print()
    print(
        f"Relay cost per routed request and per relayed token: one router process, "
        f"{plan.streams} closed-loop streams, a step every {DEFAULT_STEP_MS:g} ms; a "
        f"max_tokens 1 and a max_tokens {spread(LONG_TOKENS)} window of "
        f"{plan.window_s:g}s each"
    )
    rows = []
    for c in run.costs:
        bad = c.short.errors + c.long.errors + c.short.mismatched + c.long.mismatched
        rows.append(
            [
                c.workers,
                f"{c.short.req_s:.0f}",
                f"{c.short.cores('router'):.2f}",
                f"{c.long.tok_s:.0f}",
                f"{c.long.cores('router'):.2f}",
                f"{c.router_ms_per_req:.2f}",
                f"{c.router_us_per_tok:.1f}",
                f"{c.redis_ms_per_req:.3f}",
                f"{c.redis_us_per_tok:.1f}",
                f"{c.long.cores('redis'):.2f}",
                bad,
            ]
        )
    print(
        table(
            [
                "workers",
                "req/s @1",
                "router cores @1",
                f"tok/s @{LONG_TOKENS}",
                f"router cores @{LONG_TOKENS}",
                "router ms/req",
                "router us/tok",
                "Redis ms/req",
                "Redis us/tok",
                f"Redis cores @{LONG_TOKENS}",
                "errors",
            ],
            rows,
        )
    )
    print(
        "(ms/req, us/tok: CPU = a x requests + b x tokens, solved over the two windows; "
        "cores: CPU seconds a second; @1, @64: the max_tokens of the window)"
    )
    print()
    offered = 1000 / RELAY_STEP_MS * RELAY_TOKENS_PER_STEP
    print(
        f"Relay curve: {run.relay_workers} workers, a step every {RELAY_STEP_MS:g} ms with "
        f"{RELAY_TOKENS_PER_STEP} tokens ({offered:.0f} tokens/s a stream), max_tokens "
        f"{spread(plan.relay_max_tokens)}, one router process, windows of "
        f"{plan.relay_window_s:g}s"
    )
    rows = []
    for w in run.relay:
        per_router_s = w.tokens / w.cpu.router if w.cpu.router else float("nan")
        rows.append(
            [
                w.streams,
                f"{w.streams * offered:.0f}",
                f"{w.tok_s:.0f}",
                f"{w.req_s:.1f}",
                f"{w.pace:.0f}",
                f"{w.cores('router'):.2f}",
                f"{w.cpu.router / max(w.tokens, 1) * 1e6:.1f}",
                f"{per_router_s:.0f}",
                f"{w.cores('redis'):.2f}",
                f"{w.cores('workers'):.2f}",
                f"{w.cores('client'):.2f}",
                w.errors + w.mismatched,
            ]
        )
    print(
        table(
            [
                "streams",
                "offered tok/s",
                "relayed tok/s",
                "req/s",
                "tok/s a stream",
                "router cores",
                "router us/tok",
                "tok/router-CPU-s",
                "Redis cores",
                "workers cores",
                "client cores",
                "errors",
            ],
            rows,
        )
    )
    print(
        f"(tok/s a stream: first to last token of each request, mean; the workers' clock "
        f"alone gives {offered:.0f}. router us/tok: all its CPU, requests included, per "
        "relayed token; tok/router-CPU-s: relayed tokens per CPU second of the router, what "
        "it would relay with a core to itself)"
    )
    best = max(run.relay, key=lambda w: w.tok_s, default=None)
    if best is not None:
        ceiling = max(w.tokens / w.cpu.router for w in run.relay if w.cpu.router)
        print(
            f"most tokens/s one router process relayed: {best.tok_s:.0f} ({best.streams} "
            f"streams, the router at {best.cores('router'):.2f} cores); tokens per router "
            f"CPU-second: up to {ceiling:.0f}"
        )
    print(
        "Redis time by command in each relay window: share of the window's wall time (us a "
        "call x calls); a script's line includes the commands it called"
    )
    for w in run.relay:
        busy = w.cpu.t
        print(
            f"  {w.streams:>4} streams: "
            + ", ".join(
                f"{name} {s / busy:.0%} ({s / calls * 1e6:.0f} us x {calls})"
                for name, s, calls in w.redis_time
            )
        )
    print(f"synthetic workers' totals: {run.worker_totals}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1, 4, 16 workers; shorter windows")
    p.add_argument("--blocks", type=int, default=0, help="block set size (100000; quick 20000)")
    p.add_argument("--streams", type=int, default=32, help="streams while workers double")
    p.add_argument("--stages", default="", help="worker counts instead, e.g. 1,8,64")
    p.add_argument("--relay-streams", default="", help="the relay curve's stream counts")
    output_args(p, "write every number here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan.of(args)
    announce(send_costs=True)
    model_dir = tiny_model_dir()
    print(f"# load average before: {' '.join(f'{x:.2f}' for x in psutil.getloadavg())}")
    print(
        f"# model {MODEL} (tokenizer only); synthetic workers {', '.join(map(str, plan.stages))}"
        f" with {plan.blocks} blocks each; 1 router process; "
        f"{' '.join(f'{k}={v}' for k, v in ENV.items())}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="mlxcel-routing-scale-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        with running_pool(model_dir, work, workers=0, env=ENV, overrides=OVERRIDES) as pool:
            run = bench(pool, plan, work)
            tracebacks = pool.logs("router").count("Traceback")
        synthetic = sum(
            p.read_text(errors="replace").count("Traceback") for p in work.glob("synthetic*.log")
        )
        progress(f"logs in {work}; tracebacks: router {tracebacks}, synthetic workers {synthetic}")
    print_report(run)
    print(f"# load average after: {' '.join(f'{x:.2f}' for x in psutil.getloadavg())}")
    write_json(
        args.json,
        {
            "plan": asdict(plan),
            "decisions": run.decisions,
            "costs": run.costs,
            "relay": run.relay,
            "worker_totals": run.worker_totals,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
