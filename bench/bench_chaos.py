"""Chaos: two workers under steady load while a worker is SIGKILLed, another SIGTERMed (a drain
and rolling restart), Redis paused 10 s (SIGSTOP/SIGCONT) and then SIGKILLed (the supervisor
restarts it empty on the same port). Then requests that used to escape their own request
(issue 19): a JSON schema whose $refs chain through 3,000 definitions (it crashed llguidance in
the router), a prompt-logprob scoring pass over 16 prompts of 2,000 tokens, a 1,200-property
schema for 4 prompts x n 16 (64 matchers), and a forged job whose data is not msgpack. Not in
CI: it takes minutes and real signals.

Every greedy answer is checked against the same prompt run alone through the pool before any
fault: same text and completion_tokens, or a clean failure (HTTP 503 `redis_unavailable`, or a
streamed error chunk `redis_unavailable` / `job_failed` / `worker_lost` after a prefix of the
reference text). Each fault's time to clear is from its injection until /health lists both
workers with their current process ids and a probe request gets its reference answer.

Goal (issue 10): 0 wrong answers, 0 hung requests (client timeout), 0 5xx other than the
documented 503s, 0 `mlxcel:*` keys without a TTL beyond the documented ones (docs/redis-keys.md),
and every fault cleared. Goal (issue 19), for the request faults: 0 other requests failed, 0
false deaths (no worker restarted, no `worker_lost`), 0 requests run twice (no `<id>-1` job),
and the longest pause between two chunks of another stream reported (at most one prefill chunk).
Exits 0 either way (a benchmark); the verdict is the last lines.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_chaos.py [--quick]
        [--clients 6] [--work-dir DIR (kept: the pool's logs)] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from common import REPO, announce, output_args, table, tiny_model_dir, write_json  # preloads BLAS

from mlxcel_pool.supervisor import REDIS, Pool, PoolError
from tests.pool_fixture import running_pool

WORKERS = ("w1", "w2")
# Prompts the tiny model does not end early, so a fault lands mid-stream, not between requests.
PROMPTS = [
    ("The quick brown fox", 64),
    ("1, 2, 3, 4, 5,", 96),
    ("import numpy as np\n", 64),
    ("The capital of France is", 48),
    ("In the beginning there was", 80),
    ("Redis is an in-memory data store that", 96),
    ("Once upon a time", 32),
    ("def fibonacci(n):", 72),
]
PROBE = ("Dear diary,", 4)
# The codes a fault may end a request with (docs/architecture.md, "Faults"): Redis lost, the
# stream lost events, or its worker died after tokens reached the client.
CLEAN_STREAM_CODES = ("redis_unavailable", "job_failed", "worker_lost")
OVERRIDES = {
    # One router process: on 2 cores the two workers need the CPU more than a second router.
    "router": {"processes": 1},
    # Short restart backoff: time to clear measures the pool's recovery, not the supervisor's wait.
    "supervisor": {"restart_backoff_s": 0.2, "restart_backoff_max_s": 1.0},
}
# A request still unanswered after this is hung: the slowest honest one is a 96-token answer
# held up by the 10 s Redis pause, far below it (the report prints the slowest correct one).
HUNG_AFTER_S = 30.0
RETRY_AFTER_S = 0.5  # a client's pause after a failure (a 503 says Retry-After: 1)

CORRECT, WRONG, CLEAN, SERVER_ERROR, HUNG, OTHER = (
    "correct",
    "wrong",
    "clean",
    "5xx-other",
    "hung",
    "other",
)
KINDS = (CORRECT, CLEAN, WRONG, SERVER_ERROR, HUNG, OTHER)


@dataclass(frozen=True)
class Plan:
    clients: int
    warmup_s: float  # steady load before the first fault
    gap_s: float  # steady load after a fault cleared, before the next one
    pause_s: float  # how long Redis stays stopped
    request_timeout_s: float  # past this a request counts as hung
    clear_timeout_s: float  # a fault not cleared by then is reported as such
    max_requests: int

    @classmethod
    def of(cls, args: argparse.Namespace) -> Plan:
        if args.quick:
            return cls(args.clients, 3.0, 3.0, 10.0, HUNG_AFTER_S, 90.0, 3000)
        return cls(args.clients, 10.0, 10.0, 10.0, HUNG_AFTER_S, 120.0, 20000)


@dataclass(frozen=True)
class Ref:
    prompt: str
    max_tokens: int
    text: str
    tokens: int


@dataclass
class Reply:
    """What came back for one request, before it is judged."""

    status: int
    text: str = ""
    tokens: int | None = None
    error: dict[str, Any] | None = None  # an error body, or a streamed error chunk
    done: bool = False  # a stream's [DONE], or a JSON body
    max_gap: float = 0.0  # a stream's longest wait between two content chunks, seconds


@dataclass
class Outcome:
    start: float
    end: float
    prompt: int
    stream: bool
    kind: str
    why: str = ""  # the clean failure's kind, or what went wrong
    max_gap: float = 0.0


# --- one request -------------------------------------------------------------------------------


def _body(model: str, ref: Ref | tuple[str, int], stream: bool) -> dict[str, Any]:
    prompt, max_tokens = (ref.prompt, ref.max_tokens) if isinstance(ref, Ref) else ref
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def _read_sse(resp: aiohttp.ClientResponse) -> Reply:
    reply = Reply(resp.status)
    last: float | None = None
    async for line in resp.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            reply.done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            reply.error = chunk["error"]
        for choice in chunk.get("choices") or []:
            reply.text += choice.get("text") or ""
        now = time.perf_counter()
        if last is not None:
            reply.max_gap = max(reply.max_gap, now - last)
        last = now
        if chunk.get("usage"):
            reply.tokens = int(chunk["usage"]["completion_tokens"])
    return reply


async def _read_json(resp: aiohttp.ClientResponse) -> Reply:
    try:
        body = await resp.json(content_type=None)
    except ValueError:
        return Reply(resp.status, error={"message": (await resp.text())[:200]})
    if resp.status == 200:
        text = body["choices"][0]["text"]
        return Reply(200, text, int(body["usage"]["completion_tokens"]), done=True)
    return Reply(resp.status, error=body.get("error") or {"message": str(body)[:200]})


async def send(http: aiohttp.ClientSession, body: dict[str, Any], timeout: float) -> Reply | str:
    """The reply, or why there is none: `hung` (the client's timeout) or a connection error."""
    try:
        async with asyncio.timeout(timeout):
            async with http.post("/v1/completions", json=body) as resp:
                if body["stream"] and resp.status == 200:
                    return await _read_sse(resp)
                return await _read_json(resp)
    except TimeoutError:
        return HUNG
    except (aiohttp.ClientError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


def judge(reply: Reply | str, ref: Ref) -> tuple[str, str]:
    """(kind, why) of one request against its reference."""
    if reply == HUNG:
        return HUNG, ""
    if isinstance(reply, str):
        return OTHER, reply
    err = reply.error or {}
    code, message = err.get("code"), str(err.get("message", ""))[:160]
    if reply.status == 200 and not err:
        if not reply.done:
            return OTHER, "a stream that ended without [DONE] or an error"
        if reply.text == ref.text and reply.tokens == ref.tokens:
            return CORRECT, ""
        return WRONG, f"{reply.tokens} tokens {reply.text[:60]!r}, want {ref.tokens}"
    if reply.status == 200:  # a streamed error chunk: what came before it must be the model's
        if not ref.text.startswith(reply.text):
            return WRONG, f"prefix {reply.text[:60]!r} before error {code}"
        if code in CLEAN_STREAM_CODES:
            return CLEAN, f"sse {code}"
        return SERVER_ERROR, f"sse {code}: {message}"
    if reply.status == 503 and code == "redis_unavailable":
        return CLEAN, "503 redis_unavailable"
    if reply.status >= 500:
        return SERVER_ERROR, f"{reply.status} {code}: {message}"
    return OTHER, f"{reply.status} {code}: {message}"


# --- the pool's state --------------------------------------------------------------------------


async def health(http: aiohttp.ClientSession) -> dict[str, Any] | None:
    try:
        async with asyncio.timeout(3), http.get("/health") as resp:
            return dict(await resp.json(content_type=None))
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


def both_workers_current(pool: Pool, body: dict[str, Any] | None) -> bool:
    """/health lists exactly our workers, each with the pid of the process running now (right
    after a kill the dead worker still looks alive for DEAD_AFTER_S: its pid tells it apart)."""
    if body is None or body.get("workers_alive") != len(WORKERS):
        return False
    seen = {(w.get("worker_id"), str(w.get("pid"))) for w in body.get("workers", [])}
    return seen == {(wid, str(pool.pid(wid))) for wid in WORKERS}


async def wait_cleared(
    pool: Pool,
    http: aiohttp.ClientSession,
    model: str,
    probe: Ref,
    replaced: dict[str, int],
    deadline: float,
    wrong: list[str],
) -> float | None:
    """perf_counter time at which the fault cleared (None: not by `deadline`): every child in
    `replaced` runs under a new pid, both workers are live, and a probe gets its reference."""
    while time.perf_counter() < deadline:
        if all(pool.pid(name) != old for name, old in replaced.items()) and both_workers_current(
            pool, await health(http)
        ):
            kind, why = judge(await send(http, _body(model, probe, False), 10.0), probe)
            if kind == CORRECT:
                return time.perf_counter()
            if kind == WRONG:
                wrong.append(f"probe: {why}")
        await asyncio.sleep(0.25)
    return None


def documented_without_ttl(doc: Path = REPO / "docs" / "redis-keys.md") -> list[re.Pattern[str]]:
    """The key patterns the docs' key table gives the TTL `none` (they never expire by design),
    `<placeholder>` standing for one key segment. Read from the docs, not listed here, so a key
    counts as documented exactly when the docs say so."""
    patterns = []
    for line in doc.read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 5 and cells[1].startswith("`mlxcel:") and cells[4].startswith("none"):
            key = re.escape(cells[1].strip("`"))
            patterns.append(re.compile(re.sub(r"<[^>]+>", "[^:]+", key) + "$"))
    return patterns


def keys_without_ttl(url: str) -> set[str]:
    """`mlxcel:*` keys without a TTL, beyond the documented never-expiring ones; a key must be
    so on two scans a second apart (a writer sets a TTL right after the write)."""
    r = redis.Redis.from_url(url, socket_timeout=5)
    documented = documented_without_ttl()

    def scan() -> set[str]:
        found = {k.decode() for k in r.scan_iter("mlxcel:*", count=1000) if r.ttl(k) == -1}
        return {k for k in found if not any(p.match(k) for p in documented)}

    try:
        first = scan()
        time.sleep(1.0)
        return first & scan()
    except redis.RedisError as exc:
        return {f"(scan failed: {exc})"}


# --- faults ------------------------------------------------------------------------------------


def _signal_worker(sig: int) -> Callable[[Pool, str], Awaitable[dict[str, int]]]:
    async def inject(pool: Pool, wid: str) -> dict[str, int]:
        pid = pool.pid(wid)
        os.killpg(pid, sig)  # each child leads its own process group
        return {wid: pid}

    return inject


async def _pause_redis(pool: Pool, seconds: float) -> dict[str, int]:
    pid = pool.pid(REDIS)
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    return {}


async def _kill_redis(pool: Pool) -> dict[str, int]:
    pid = pool.pid(REDIS)
    os.kill(pid, signal.SIGKILL)
    return {REDIS: pid}


@dataclass
class FaultResult:
    name: str
    injected: float
    ended: float  # when the fault itself was over (SIGCONT for the pause; else = injected)
    cleared: float | None
    request: bool = False  # a request fault: its own answer is in `answer`
    answer: str = ""


REF_CHAIN = 3000  # definitions in the $ref chain (llguidance crashed past ~2,520)
SCORED_PROMPTS, SCORED_TOKENS = 16, 2000
BIG_SCHEMA_PROPERTIES, BIG_SCHEMA_PROMPTS, BIG_SCHEMA_N = 1200, 4, 16


def _ref_chain_body(model: str) -> dict[str, Any]:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(REF_CHAIN)}
    defs[f"d{REF_CHAIN}"] = {"type": "integer"}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    return {"model": model, "prompt": "x", "max_tokens": 4, "response_format": _format(schema)}


def _format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _scoring_body(model: str) -> dict[str, Any]:
    prompts = [
        [5 + (i * 7 + j * 13) % 900 for j in range(SCORED_TOKENS)] for i in range(SCORED_PROMPTS)
    ]
    return {"model": model, "prompt": prompts, "max_tokens": 1, "echo": True, "logprobs": 5}


def _big_schema_body(model: str) -> dict[str, Any]:
    props = {f"p{i}": {"type": "integer"} for i in range(BIG_SCHEMA_PROPERTIES)}
    schema = {"type": "object", "properties": props}
    prompts = [f"Record {i}:" for i in range(BIG_SCHEMA_PROMPTS)]
    return {
        "model": model,
        "prompt": prompts,
        "n": BIG_SCHEMA_N,
        "max_tokens": 8,
        "temperature": 0,
        "response_format": _format(schema),
    }


def _forge_job(url: str, model: str) -> str:
    """A job hash no router would write (its data is not msgpack), pushed onto the model's
    queue as a forger with the Redis password would: it must fail alone."""
    from shared import keys

    r = redis.Redis.from_url(url, socket_timeout=5)
    rid = f"forged-{os.urandom(6).hex()}"
    queue = keys.model_queue_name(model)
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    fields = {"data": b"\xc1\xff not msgpack", "status": "queued", "origin": queue}
    r.hset(f"rq:job:{rid}", mapping={**fields, "created_at": now, "enqueued_at": now})
    r.rpush(f"rq:queue:{queue}", rid)
    return rid


async def _post(http: aiohttp.ClientSession, body: dict[str, Any]) -> str:
    try:
        async with asyncio.timeout(HUNG_AFTER_S * 4):
            async with http.post("/v1/completions", json=body) as resp:
                text = await resp.text()
                return f"{resp.status} {text[:120]!r}"
    except TimeoutError:
        return HUNG
    except aiohttp.ClientError as exc:
        return f"{type(exc).__name__}: {exc}"[:200]


@dataclass(frozen=True)
class RequestFault:
    """A request (or a forged job) that must fail or finish alone, the pool serving on."""

    name: str
    send: Callable[[aiohttp.ClientSession, str, str], Awaitable[str]]


def request_faults() -> list[RequestFault]:
    async def forged(http: aiohttp.ClientSession, model: str, url: str) -> str:
        return await asyncio.to_thread(_forge_job, url, model)

    return [
        RequestFault(f"$ref chain of {REF_CHAIN}", lambda h, m, u: _post(h, _ref_chain_body(m))),
        RequestFault(
            f"scoring {SCORED_PROMPTS} x {SCORED_TOKENS} tokens (echo, logprobs 5)",
            lambda h, m, u: _post(h, _scoring_body(m)),
        ),
        RequestFault(
            f"{BIG_SCHEMA_PROPERTIES}-property schema, {BIG_SCHEMA_PROMPTS} prompts x n "
            f"{BIG_SCHEMA_N}",
            lambda h, m, u: _post(h, _big_schema_body(m)),
        ),
        RequestFault("forged job (data not msgpack)", forged),
    ]


@dataclass(frozen=True)
class Fault:
    name: str
    # Does it and returns the pids of the children it ends (a restart gives each a new one).
    inject: Callable[[Pool], Awaitable[dict[str, int]]]
    empties_redis: bool = False  # keys are scanned before it: afterwards they are gone


def fault_plan(plan: Plan) -> list[Fault]:
    kill, term = _signal_worker(signal.SIGKILL), _signal_worker(signal.SIGTERM)
    return [
        Fault("SIGKILL worker w1", lambda p: kill(p, "w1")),
        Fault("SIGTERM worker w2 (drain, restart)", lambda p: term(p, "w2")),
        Fault(
            f"SIGSTOP redis {plan.pause_s:g} s, SIGCONT", lambda p: _pause_redis(p, plan.pause_s)
        ),
        Fault("SIGKILL redis (restarted empty)", _kill_redis, empties_redis=True),
    ]


# --- the run -----------------------------------------------------------------------------------


@dataclass
class Run:
    """Everything the report needs; times are perf_counter seconds."""

    t0: float
    refs: list[Ref] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[FaultResult] = field(default_factory=list)
    stray_keys: set[str] = field(default_factory=set)
    probe_wrong: list[str] = field(default_factory=list)
    started: int = 0
    restarted_in_request_faults: list[str] = field(default_factory=list)
    ran_twice: int = 0  # `<id>-1` jobs: requests enqueued again after a (false) death


async def references(http: aiohttp.ClientSession, model: str) -> list[Ref]:
    """Each prompt alone (one request at a time, before any fault): the answers to match."""
    refs = []
    for prompt, max_tokens in [*PROMPTS, PROBE]:
        reply = await send(http, _body(model, (prompt, max_tokens), False), 120.0)
        if not isinstance(reply, Reply) or reply.status != 200 or reply.tokens is None:
            raise RuntimeError(f"reference for {prompt!r} failed: {reply}")
        refs.append(Ref(prompt, max_tokens, reply.text, reply.tokens))
        print(f"  reference {prompt!r}: {reply.tokens} tokens", file=sys.stderr)
    return refs


async def client_loop(
    http: aiohttp.ClientSession,
    model: str,
    run: Run,
    plan: Plan,
    rng: random.Random,
    stop: asyncio.Event,
) -> None:
    prompts = run.refs[: len(PROMPTS)]
    while not stop.is_set() and run.started < plan.max_requests:
        run.started += 1
        i, stream = rng.randrange(len(prompts)), rng.random() < 0.5
        start = time.perf_counter()
        reply = await send(http, _body(model, prompts[i], stream), plan.request_timeout_s)
        kind, why = judge(reply, prompts[i])
        gap = reply.max_gap if isinstance(reply, Reply) else 0.0
        run.outcomes.append(Outcome(start, time.perf_counter(), i, stream, kind, why, gap))
        if kind != CORRECT:
            print(
                f"  [{start - run.t0:6.1f}s] {kind}: {why} (prompt {i}, "
                f"{'streamed' if stream else 'not streamed'})",
                file=sys.stderr,
            )
            await asyncio.sleep(RETRY_AFTER_S)


async def wait_both_workers(pool: Pool, http: aiohttp.ClientSession, timeout: float) -> None:
    deadline = time.perf_counter() + timeout
    while not both_workers_current(pool, await health(http)):
        if time.perf_counter() > deadline:
            raise PoolError(f"two live workers not seen in /health within {timeout:g} s")
        await asyncio.sleep(0.25)


async def chaos(pool: Pool, plan: Plan, seed: int) -> Run:
    connector = aiohttp.TCPConnector(limit=plan.clients + 8)
    async with aiohttp.ClientSession(base_url=pool.url, connector=connector) as http:
        await wait_both_workers(pool, http, 120)
        model = str((await health(http) or {})["model"])
        refs = await references(http, model)
        run = Run(time.perf_counter(), refs)
        stop = asyncio.Event()
        loops = [
            asyncio.create_task(
                client_loop(http, model, run, plan, random.Random(seed * 1000 + i), stop)
            )
            for i in range(plan.clients)
        ]
        await asyncio.sleep(plan.warmup_s)
        for fault in fault_plan(plan):
            if fault.empties_redis:
                run.stray_keys |= await asyncio.to_thread(keys_without_ttl, pool.redis_url)
            injected = time.perf_counter()
            print(f"  [{injected - run.t0:6.1f}s] {fault.name}", file=sys.stderr)
            replaced = await fault.inject(pool)
            ended = time.perf_counter()
            cleared = await wait_cleared(
                pool,
                http,
                model,
                run.refs[-1],
                replaced,
                ended + plan.clear_timeout_s,
                run.probe_wrong,
            )
            run.faults.append(FaultResult(fault.name, injected, ended, cleared))
            took = f"{cleared - injected:.1f}s" if cleared else "NOT cleared"
            print(f"  [{time.perf_counter() - run.t0:6.1f}s] cleared: {took}", file=sys.stderr)
            if cleared is None:
                break  # the pool did not recover: later faults would measure nothing
            await asyncio.sleep(plan.gap_s)
        if all(f.cleared for f in run.faults):
            await request_phase(pool, http, model, run, plan)
        stop.set()
        await asyncio.gather(*loops)
    run.stray_keys |= await asyncio.to_thread(keys_without_ttl, pool.redis_url)
    run.ran_twice = await asyncio.to_thread(_retried_jobs, pool.redis_url)
    return run


async def request_phase(
    pool: Pool, http: aiohttp.ClientSession, model: str, run: Run, plan: Plan
) -> None:
    """Each request fault beside the steady load; no worker may restart meanwhile."""
    pids = {wid: pool.pid(wid) for wid in WORKERS}
    for fault in request_faults():
        injected = time.perf_counter()
        print(f"  [{injected - run.t0:6.1f}s] {fault.name}", file=sys.stderr)
        answer = await fault.send(http, model, pool.redis_url)
        ended = time.perf_counter()
        print(f"  [{ended - run.t0:6.1f}s] answered: {answer}", file=sys.stderr)
        cleared = await wait_cleared(
            pool, http, model, run.refs[-1], {}, ended + plan.clear_timeout_s, run.probe_wrong
        )
        run.faults.append(FaultResult(fault.name, injected, ended, cleared, True, answer))
        await asyncio.sleep(plan.gap_s)
    run.restarted_in_request_faults = [w for w in WORKERS if pool.pid(w) != pids[w]]


def _retried_jobs(url: str) -> int:
    r = redis.Redis.from_url(url, socket_timeout=5)
    return sum(1 for k in r.scan_iter("rq:job:*-[0-9]", count=1000))


# --- the report --------------------------------------------------------------------------------


def phase_of(o: Outcome, faults: list[FaultResult]) -> str:
    """The first fault whose window (injection to clear) the request overlapped, else steady."""
    for f in faults:
        if o.start <= (f.cleared or float("inf")) and o.end >= f.injected:
            return f.name
    return "steady"


def print_report(run: Run, plan: Plan, retried: int, restarts: list[str], failure: str) -> bool:
    rows = [
        [
            f.name,
            f"{f.injected - run.t0:.1f}",
            f"{f.cleared - f.injected:.1f}" if f.cleared else "NOT cleared",
            f"{f.cleared - f.ended:.1f}" if f.cleared else "-",
        ]
        for f in run.faults
    ]
    print(table(["fault", "at s", "time to clear s", "after it ended s"], rows))
    phases = ["steady", *(f.name for f in run.faults)]
    by_phase = {
        p: Counter(o.kind for o in run.outcomes if phase_of(o, run.faults) == p) for p in phases
    }
    print()
    phase_rows = [[p, sum(c.values()), *(c[k] for k in KINDS)] for p, c in by_phase.items()]
    print(table(["requests by phase", "total", *KINDS], phase_rows))
    kinds = Counter(o.kind for o in run.outcomes)
    clean = Counter(o.why for o in run.outcomes if o.kind == CLEAN)
    wrong = kinds[WRONG] + len(run.probe_wrong)
    streamed = sum(o.stream for o in run.outcomes)
    print()
    print(
        f"requests total      {len(run.outcomes)} ({streamed} streamed, "
        f"{len(run.outcomes) - streamed} not)"
    )
    slowest = max((o.end - o.start for o in run.outcomes if o.kind == CORRECT), default=0.0)
    print(f"completed-correct   {kinds[CORRECT]} (slowest {slowest:.1f} s)")
    print(f"retried             {retried} (router log: 'enqueued again')")
    print(
        f"failed cleanly      {kinds[CLEAN]}"
        + "".join(f"; {why} {n}" for why, n in sorted(clean.items()))
    )
    print(f"wrong               {wrong}" + (" (probes included)" if run.probe_wrong else ""))
    print(f"5xx-other           {kinds[SERVER_ERROR]}")
    print(f"hung                {kinds[HUNG]} (client timeout {plan.request_timeout_s:g} s)")
    print(f"other               {kinds[OTHER]} (4xx, connection errors, truncated streams)")
    print(
        f"keys without TTL    {len(run.stray_keys)}"
        + "".join(f"\n  {k}" for k in sorted(run.stray_keys))
    )
    for kind in (WRONG, SERVER_ERROR, OTHER):
        examples = Counter(o.why for o in run.outcomes if o.kind == kind)
        for why, n in examples.most_common(5):
            print(f"  {kind} x{n}: {why}")
    for why in run.probe_wrong[:5]:
        print(f"  wrong: {why}")
    print(
        f"supervisor: {'; '.join(restarts) or 'no restarts'}" + (f"; {failure}" if failure else "")
    )
    expected = len(fault_plan(plan)) + len(request_faults())
    all_cleared = len(run.faults) == expected and all(f.cleared for f in run.faults)
    met = all_cleared and not (wrong or kinds[HUNG] or kinds[SERVER_ERROR] or run.stray_keys)
    print(
        f"goal: 0 wrong, 0 hung, 0 5xx other than documented 503s, 0 keys without TTL, every "
        f"fault cleared -> {'MET' if met else 'MISSED'}"
    )
    return met and print_request_faults(run)


def print_request_faults(run: Run) -> bool:
    """Issue 19's goal over the request faults' windows: the others are untouched."""
    faults = [f for f in run.faults if f.request]
    rows = []
    others_failed = 0
    longest = 0.0
    for f in faults:
        during = [o for o in run.outcomes if phase_of(o, run.faults) == f.name]
        failed = sum(o.kind != CORRECT for o in during)
        gap = max((o.max_gap for o in during if o.stream), default=0.0)
        others_failed += failed
        longest = max(longest, gap)
        rows.append([f.name, f.answer[:48], len(during), failed, f"{gap * 1000:.0f}"])
    steady = [o.max_gap for o in run.outcomes if o.stream and phase_of(o, run.faults) == "steady"]
    steady.sort()
    if steady:  # what a stream waits between two chunks under this load with no fault at all
        p99 = steady[min(len(steady) - 1, int(len(steady) * 0.99))]
        rows.append(
            [
                "(steady, no fault)",
                f"p99 {p99 * 1000:.0f} ms",
                len(steady),
                0,
                f"{steady[-1] * 1000:.0f}",
            ]
        )
    print()
    headers = ["request fault", "its answer", "others", "others failed", "longest gap ms"]
    print(table(headers, rows))
    lost = sum("worker_lost" in o.why for o in run.outcomes if phase_of(o, faults) != "steady")
    print(
        f"false deaths        {len(run.restarted_in_request_faults)} restarted "
        f"{run.restarted_in_request_faults or ''}, {lost} worker_lost during request faults"
    )
    print(f"requests run twice  {run.ran_twice} (jobs enqueued again as <id>-1)")
    print(f"longest pause       {longest * 1000:.0f} ms between two chunks of another stream")
    met = bool(faults) and not (others_failed or lost or run.restarted_in_request_faults)
    verdict = "MET" if met and not run.ran_twice else "MISSED"
    print(
        "goal (issue 19): 0 other requests failed, 0 false deaths, 0 run twice, the longest "
        f"pause reported -> {verdict}"
    )
    return met and not run.ran_twice


def supervise_in_background(
    pool: Pool, stop: threading.Event, restarts: list[str], failure: list[str]
) -> threading.Thread:
    def log(message: str) -> None:
        restarts.append(message.split(";")[0])
        print(f"  supervisor: {message}", file=sys.stderr)

    def run() -> None:
        try:
            pool.supervise(stop, log=log)
        except PoolError as exc:  # a crash loop: the faults that follow will not clear
            failure.append(str(exc).splitlines()[0])

    thread = threading.Thread(target=run, name="supervise", daemon=True)
    thread.start()
    return thread


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 s of steady load between faults")
    p.add_argument("--clients", type=int, default=6, help="concurrent client loops")
    p.add_argument("--seed", type=int, default=0)
    output_args(p, "write every request's outcome here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan.of(args)
    announce()
    model_dir = tiny_model_dir()
    print(
        f"# model {model_dir.name}; 2 workers, 1 router process, supervised (restart backoff "
        f"0.2 s); {plan.clients} clients, random prompt of {len(PROMPTS)}, streamed or not; "
        f"steady load {plan.warmup_s:g} s before and {plan.gap_s:g} s after each fault",
        flush=True,
    )
    restarts: list[str] = []
    failure: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mlxcel-chaos-") as tmp:
        work = Path(args.work_dir) if args.work_dir else Path(tmp)
        with running_pool(model_dir, work, workers=len(WORKERS), overrides=OVERRIDES) as pool:
            stop = threading.Event()
            thread = supervise_in_background(pool, stop, restarts, failure)
            try:
                run = asyncio.run(chaos(pool, plan, args.seed))
            finally:
                stop.set()
                thread.join()
            retried = pool.logs("router").count("enqueued again")
            tracebacks = {n: pool.logs(n).count("Traceback") for n in ("router", *WORKERS)}
        print(f"  logs in {work / 'logs'}; tracebacks: {tracebacks}", file=sys.stderr)
    met = print_report(run, plan, retried, restarts, "; ".join(failure))
    write_json(
        args.json,
        {
            "plan": plan,
            "goal_met": met,
            "retried": retried,
            "faults": run.faults,
            "stray_keys": sorted(run.stray_keys),
            "outcomes": run.outcomes,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
