"""Routing hit ratio: how much of a multi-tenant, multi-turn workload's prompt the workers' prompt
caches reuse under each routing policy (MLXCEL_ROUTING_POLICY = cache_aware | least_loaded |
round_robin), with 1, 2 and 4 workers, on the tiny model (CPU). Not in CI (`make bench` runs it
with --quick).

Measures, per (workers, policy), on a fresh pool each time (one pool at a time, 1 router
process): requests, prompt tokens and cached prompt tokens (`usage.prompt_tokens` and
`usage.prompt_tokens_details.cached_tokens` as the workers report them: what they really
reused, not what the router predicted), hit ratio = cached / prompt (all turns, turn 1 alone and
the later turns alone), TTFT p50/p99, the requests each worker served (`X-Mlxcel-Worker`), and the
routing decisions the placement script counted in the Redis hash `mlxcel:routing:stats`
(`decisions:<outcome>`). With 1 worker only one policy runs: every policy picks the one worker.

The workload (seeded, identical for every run): `--tenants` tenants, each with its own system
prompt of 256-512 token ids; `--users` users per tenant, each one conversation of `--turns`
turns. Turn k's prompt is the system prompt, then every earlier turn's user message (16-48 ids)
and assistant reply (24-64 ids), then turn k's user message. Token ids are drawn from 5..1023
(0-4 are the tiny model's special tokens); the longest prompt stays under 1,000 of the model's
2,048 positions. Requests go to /v1/completions with `prompt` as a token-id list, streamed,
`max_tokens` 8, temperature 0, no `user` or `prompt_cache_key` (those would split the cache
per session). The conversations start in a seeded shuffled order (tenants interleaved);
`--concurrency` conversations run at once, each one's turns strictly in order (a turn is sent
when the previous one's stream ended, no think time).

The assistant replies are synthetic ids of our own, not the model's output: the API returns
text, not token ids, and the text of the tiny model's random-weight BPE output need not
re-encode to the ids it came from. A worker caches what it ran (prompt + generated ids), so
the next turn matches that entry up to the end of the previous prompt (in whole 32-token
blocks) and misses the previous reply and the new user message. Real chat would also reuse
the previous reply (when its text re-encodes to the same ids), so the hits here are a slight
*under*-estimate, and the same one for every policy: every reported hit is a real reuse by a
worker, none is inflated.

Warm-up (excluded from every figure): 2 requests per worker at once, each a distinct 48-id
prompt that shares nothing with the workload (max_tokens 2), so each worker's first model pass
is not in the TTFT; the routing counters are read before and after the workload and the
difference is shown. TTFT: from sending the request to the first streamed chunk that carries a
choice (normally the first token's text; the finish chunk if no text came before it).

Also printed: what an unbounded single cache would reuse serving the same requests one at a
time (whole 32-token blocks, as the paged store keeps them; a match of at least 32 tokens, at
most prompt - 1), a ceiling for the 1-worker row (which also loses the concurrent first requests
of a tenant: none can reuse a prefix still being prefilled), and the system prompts' share of the
prompt tokens. `predicted tok` is what the router expected the workers to reuse
(`predicted_tokens:<worker>` in the same hash; it counts 16-token blocks and prefixes still on
their way to a worker, so it runs above `cached tok`).

Goal (issue): with 4 workers cache_aware keeps at least 0.9 of the 1-worker hit ratio and at
least 2.5x round robin's. Exits 0 either way (a benchmark); the verdict is the last line.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_routing_hit_ratio.py [--quick]
        [--workers 1,2,4] [--policies cache_aware,least_loaded,round_robin] [--tenants 5]
        [--users 12] [--turns 4] [--concurrency 8] [--seed 7] [--max-entries N]
        [--work-dir DIR] [--json out.json]

`--max-entries N` bounds each worker's prompt cache (MLXCEL_PROMPT_CACHE_MAX_ENTRIES): with more
tenants than one worker's cache holds, a policy that spreads every tenant over every worker
(round robin) keeps evicting what cache-aware routing keeps on one worker.

`--quick`: 3 tenants x 3 users x 2 turns, concurrency 4, 1 and 2 workers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import redis
from common import announce, completion_body, output_args, table, tiny_model_dir, write_json
from results import Results

from shared import keys
from shared.liveness import min_alive_pttl_ms
from tests.pool_fixture import running_pool, wait_for

POLICIES = ("cache_aware", "least_loaded", "round_robin")
# router.relay.streams.WORKER_HEADER (not imported: that pulls in the router's whole stack)
WORKER_HEADER = "X-Mlxcel-Worker"
FIRST_ID, VOCAB = 5, 1024  # ids 0-4 are the tiny model's special tokens
SYSTEM_TOKENS = (256, 512)
USER_TOKENS = (16, 48)
REPLY_TOKENS = (24, 64)
MAX_TOKENS = 8
WARMUP_TOKENS = 48
WARMUP_PER_WORKER = 2
# The paged store (storage `auto` with batch_size > 1) keeps whole 32-token blocks
# (prompt_cache.paged_block_size): a hit is a multiple of 32, though the router's block index
# counts 16 (apc_block_size). A worker adopts no match under min_prefix_tokens (32).
BLOCK, MIN_MATCH = 32, 32
REQUEST_TIMEOUT_S = 120.0
# One router process: on 2 cores the workers need the CPU more than a second router.
OVERRIDES = {"router": {"processes": 1}}
GOAL_OF_ONE_WORKER = 0.9
GOAL_OVER_ROUND_ROBIN = 2.5
GOAL_WORKERS = 4


@dataclass(frozen=True)
class Plan:
    tenants: int
    users: int  # per tenant: one conversation each
    turns: int
    concurrency: int  # conversations at once
    workers: tuple[int, ...]
    policies: tuple[str, ...]
    seed: int
    max_entries: int = 0  # per worker's prompt cache; 0: the default (1024)

    @classmethod
    def of(cls, args: argparse.Namespace) -> Plan:
        quick = args.quick
        workers = args.workers or ("1,2" if quick else "1,2,4")
        return cls(
            tenants=args.tenants or (3 if quick else 5),
            users=args.users or (3 if quick else 12),
            turns=args.turns or (2 if quick else 4),
            concurrency=args.concurrency or (4 if quick else 8),
            workers=tuple(sorted({int(w) for w in workers.split(",")})),
            policies=tuple(p for p in POLICIES if p in args.policies.split(",")),
            seed=args.seed,
            max_entries=args.max_entries,
        )

    def runs(self) -> list[tuple[int, str]]:
        """(workers, policy) in the order they run; 1 worker: one policy (they all agree)."""
        out = []
        for n in self.workers:
            out += [(n, p) for p in (self.policies[:1] if n == 1 else self.policies)]
        return out


# --- the workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conversation:
    tenant: int
    user: int
    system: tuple[int, ...]
    turns: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (user message, reply) per turn

    @property
    def name(self) -> str:
        return f"t{self.tenant}u{self.user}"

    def prompt(self, k: int) -> list[int]:
        """Turn k's prompt (0-based): system, every earlier (user, reply), turn k's user."""
        out = list(self.system)
        for user, reply in self.turns[:k]:
            out += user + reply
        return out + list(self.turns[k][0])


def _ids(rng: random.Random, bounds: tuple[int, int]) -> tuple[int, ...]:
    return tuple(rng.randrange(FIRST_ID, VOCAB) for _ in range(rng.randint(*bounds)))


def build_workload(plan: Plan) -> list[Conversation]:
    """Every conversation, in the seeded order they start (tenants interleaved)."""
    rng = random.Random(plan.seed)
    systems = [_ids(rng, SYSTEM_TOKENS) for _ in range(plan.tenants)]
    convs = [
        Conversation(
            t,
            u,
            systems[t],
            tuple((_ids(rng, USER_TOKENS), _ids(rng, REPLY_TOKENS)) for _ in range(plan.turns)),
        )
        for t in range(plan.tenants)
        for u in range(plan.users)
    ]
    rng.shuffle(convs)
    return convs


def ideal_reuse(convs: list[Conversation]) -> tuple[int, int, int]:
    """(prompt tokens, what one unbounded cache reuses serving the requests one at a time, each
    conversation's turns in a row; system prompt tokens). A worker caches what it ran, and the
    generated ids never match the synthetic replies, so each earlier prompt is what counts."""
    seen: set[tuple[int, ...]] = set()
    prompt_total = cached_total = system_total = 0
    for conv in convs:
        for k in range(len(conv.turns)):
            prompt = conv.prompt(k)
            prefixes = [tuple(prompt[: b * BLOCK]) for b in range(1, len(prompt) // BLOCK + 1)]
            held = 0
            while held < len(prefixes) and prefixes[held] in seen:
                held += 1
            cached = min(held * BLOCK, len(prompt) - 1)
            cached_total += cached if cached >= MIN_MATCH else 0
            prompt_total += len(prompt)
            system_total += len(conv.system)
            seen.update(prefixes)
    return prompt_total, cached_total, system_total


# --- one request -------------------------------------------------------------------------------


@dataclass
class Reply:
    conversation: str
    turn: int
    prompt_len: int
    status: int = 0
    worker: str = ""
    ttft: float | None = None
    total: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


async def send(
    http: aiohttp.ClientSession, model: str, prompt: list[int], reply: Reply, max_tokens: int
) -> Reply:
    start = time.perf_counter()
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            async with http.post(
                "/v1/completions", json=completion_body(model, prompt, max_tokens)
            ) as resp:
                reply.status = resp.status
                reply.worker = resp.headers.get(WORKER_HEADER, "")
                if resp.status != 200:
                    reply.error = (await resp.text())[:200]
                    return reply
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    _apply(reply, json.loads(data), time.perf_counter() - start)
    except TimeoutError:
        reply.error = f"client timeout {REQUEST_TIMEOUT_S:g} s"
    except (aiohttp.ClientError, ValueError) as exc:
        reply.error = f"{type(exc).__name__}: {exc}"[:200]
    reply.total = time.perf_counter() - start
    return reply


def _apply(reply: Reply, chunk: dict[str, Any], t: float) -> None:
    if chunk.get("error"):
        reply.error = str(chunk["error"])[:200]
    if chunk.get("choices") and reply.ttft is None:
        reply.ttft = t
    usage = chunk.get("usage")
    if usage:
        reply.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        reply.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        reply.cached_tokens = int(details.get("cached_tokens") or 0)


def ok(reply: Reply) -> bool:
    return reply.status == 200 and not reply.error and reply.prompt_tokens > 0


# --- one run -----------------------------------------------------------------------------------


@dataclass
class Run:
    workers: int
    policy: str
    wall_s: float = 0.0
    replies: list[Reply] = field(default_factory=list)
    decisions: dict[str, int] = field(default_factory=dict)
    predicted_tokens: int = 0  # what the router expected the workers to reuse
    warmup_served: dict[str, int] = field(default_factory=dict)
    tracebacks: dict[str, int] = field(default_factory=dict)

    def good(self, turns: str = "all") -> list[Reply]:
        out = [r for r in self.replies if ok(r)]
        if turns == "first":
            return [r for r in out if r.turn == 0]
        if turns == "later":
            return [r for r in out if r.turn > 0]
        return out

    def hit_ratio(self, turns: str = "all") -> float:
        good = self.good(turns)
        prompt = sum(r.prompt_tokens for r in good)
        return sum(r.cached_tokens for r in good) / prompt if prompt else float("nan")


def _stats(r: redis.Redis) -> dict[str, int]:
    return {k.decode(): int(v) for k, v in r.hgetall(keys.routing_stats()).items()}


def _all_live(r: redis.Redis, workers: int) -> bool:
    floor = min_alive_pttl_ms()
    return all(r.pttl(keys.worker_info(f"w{i}")) > floor for i in range(1, workers + 1))


async def warm_up(http: aiohttp.ClientSession, model: str, workers: int) -> dict[str, int]:
    rng = random.Random(-1)  # not the workload's seed: these share nothing with it
    prompts = [
        [rng.randrange(FIRST_ID, VOCAB) for _ in range(WARMUP_TOKENS)]
        for _ in range(WARMUP_PER_WORKER * workers)
    ]
    replies = await asyncio.gather(
        *(send(http, model, p, Reply("warmup", 0, len(p)), 2) for p in prompts)
    )
    bad = [r for r in replies if not ok(r)]
    if bad:
        raise RuntimeError(f"a warm-up request failed: {bad[0]}")
    return dict(Counter(r.worker for r in replies))


async def drive(
    http: aiohttp.ClientSession, model: str, convs: list[Conversation], concurrency: int
) -> list[Reply]:
    """`concurrency` sessions, each taking the next conversation and sending its turns in
    order; a failed turn ends its conversation (the next turn's prompt would build on it)."""
    queue = list(reversed(convs))
    replies: list[Reply] = []

    async def session() -> None:
        while queue:
            conv = queue.pop()
            for k in range(len(conv.turns)):
                prompt = conv.prompt(k)
                reply = await send(
                    http, model, prompt, Reply(conv.name, k, len(prompt)), MAX_TOKENS
                )
                replies.append(reply)
                if not ok(reply):
                    print(
                        f"    {conv.name} turn {k + 1}: {reply.status} {reply.error}",
                        file=sys.stderr,
                    )
                    break

    await asyncio.gather(*(session() for _ in range(concurrency)))
    return replies


def one_run(
    model_dir: Path, work: Path, workers: int, policy: str, convs: list[Conversation], plan: Plan
) -> Run:
    run = Run(workers, policy)
    env = {"MLXCEL_ROUTING_POLICY": policy}
    if plan.max_entries:  # a cache smaller than the working set: what production caches are
        env["MLXCEL_PROMPT_CACHE_MAX_ENTRIES"] = str(plan.max_entries)
    with running_pool(model_dir, work, workers=workers, env=env, overrides=OVERRIDES) as pool:
        r = redis.Redis.from_url(pool.redis_url)
        try:
            wait_for(lambda: _all_live(r, workers), 120, f"all {workers} workers live")

            async def go() -> None:
                connector = aiohttp.TCPConnector(limit=0)
                timeout = aiohttp.ClientTimeout(total=None)
                async with aiohttp.ClientSession(
                    base_url=pool.url, connector=connector, timeout=timeout
                ) as http:
                    async with http.get("/health") as resp:
                        model = str((await resp.json(content_type=None))["model"])
                    run.warmup_served = await warm_up(http, model, workers)
                    before = _stats(r)
                    t0 = time.perf_counter()
                    run.replies = await drive(http, model, convs, plan.concurrency)
                    run.wall_s = time.perf_counter() - t0
                    after = _stats(r)
                    delta = {k: v - before.get(k, 0) for k, v in sorted(after.items())}
                    run.decisions = {
                        k.removeprefix("decisions:"): v
                        for k, v in delta.items()
                        if k.startswith("decisions:") and v
                    }
                    run.predicted_tokens = sum(
                        v for k, v in delta.items() if k.startswith("predicted_tokens:")
                    )

            asyncio.run(go())
        finally:
            r.close()
        names = ["router", *(f"w{i}" for i in range(1, workers + 1))]
        run.tracebacks = {n: pool.logs(n).count("Traceback") for n in names}
    return run


# --- the report --------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): with few values p99 is the largest, not a blend."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ms(values: Sequence[float], q: float) -> str:
    return f"{percentile(values, q) * 1000:.0f}" if values else "-"


def _ratio(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.3f}"


def row(run: Run) -> list[Any]:
    good = run.good()
    ttfts = [r.ttft if r.ttft is not None else r.total for r in good]
    served = Counter(r.worker for r in good)
    spread = " ".join(f"{w}:{served[w]}" for w in sorted(served))
    decisions = " ".join(f"{k}:{v}" for k, v in run.decisions.items())
    return [
        run.workers,
        run.policy if run.workers > 1 else "(any)",
        len(run.replies),
        len(run.replies) - len(good),
        sum(r.prompt_tokens for r in good),
        sum(r.cached_tokens for r in good),
        run.predicted_tokens,
        _ratio(run.hit_ratio()),
        _ratio(run.hit_ratio("first")),
        _ratio(run.hit_ratio("later")),
        _ms(ttfts, 50),
        _ms(ttfts, 99),
        f"{run.wall_s:.1f}",
        spread,
        decisions,
    ]


HEADERS = [
    "workers",
    "policy",
    "requests",
    "errors",
    "prompt tok",
    "cached tok",
    "predicted tok",
    "hit ratio",
    "turn 1",
    "turns 2+",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "wall s",
    "served",
    "decisions",
]


def verdict(runs: list[Run]) -> tuple[str, bool]:
    """The goal line, judged at 4 workers (at the largest count run, not judged, if fewer)."""
    by = {(r.workers, r.policy): r for r in runs}
    one = next((r for r in runs if r.workers == 1), None)
    n = max(r.workers for r in runs)
    ca, rr = by.get((n, "cache_aware")), by.get((n, "round_robin"))
    if one is None or ca is None or rr is None or n == 1:
        missing = "goal: needs the 1-worker run, and cache_aware and round_robin with more workers"
        return f"{missing} -> NOT JUDGED", False
    of_one = ca.hit_ratio() / one.hit_ratio()
    over_rr = ca.hit_ratio() / rr.hit_ratio() if rr.hit_ratio() else float("inf")
    met = n == GOAL_WORKERS and of_one >= GOAL_OF_ONE_WORKER and over_rr >= GOAL_OVER_ROUND_ROBIN
    judged = "MET" if met else "MISSED"
    if n != GOAL_WORKERS:
        judged = f"NOT JUDGED (the goal is at {GOAL_WORKERS} workers; this run's largest is {n})"
    line = (
        f"goal: ratio(cache_aware, {n} workers) / ratio(1 worker) = {ca.hit_ratio():.3f} / "
        f"{one.hit_ratio():.3f} = {of_one:.2f} (>= {GOAL_OF_ONE_WORKER}) and ratio("
        f"cache_aware, {n}) / ratio(round_robin, {n}) = {ca.hit_ratio():.3f} / "
        f"{rr.hit_ratio():.3f} = {over_rr:.2f} (>= {GOAL_OVER_ROUND_ROBIN})"
    )
    return f"{line} -> {judged}", met


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="3 tenants x 3 users x 2 turns, concurrency 4, workers 1,2",
    )
    p.add_argument("--workers", default="", help="worker counts (1,2,4; quick 1,2)")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--tenants", type=int, default=0, help="system prompts (5; quick 3)")
    p.add_argument("--users", type=int, default=0, help="conversations per tenant (12; quick 3)")
    p.add_argument("--turns", type=int, default=0, help="turns per conversation (4; quick 2)")
    p.add_argument("--concurrency", type=int, default=0, help="conversations at once (8; quick 4)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--max-entries",
        type=int,
        default=0,
        help="each worker's prompt-cache entry bound (default: the pool's, 1024)",
    )
    output_args(p, "write every reply here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = Plan.of(args)
    if not plan.policies:
        sys.exit(f"--policies: none of {', '.join(POLICIES)}")
    results = Results("routing_hit_ratio")
    announce()
    model_dir = tiny_model_dir()
    convs = build_workload(plan)
    prompt_total, ideal, system_total = ideal_reuse(convs)
    requests = len(convs) * plan.turns
    print(
        f"# model {model_dir.name}; 1 router process; {plan.tenants} tenants (system prompts "
        f"{SYSTEM_TOKENS[0]}-{SYSTEM_TOKENS[1]} ids) x {plan.users} users x {plan.turns} turns "
        f"= {requests} requests, {prompt_total} prompt tokens ({system_total / prompt_total:.0%}"
        f" system prompt); {plan.concurrency} conversations at once; streamed, max_tokens "
        f"{MAX_TOKENS}; seed {plan.seed}; prompt-cache entries per worker "
        f"{plan.max_entries or 'default (1024)'}",
        flush=True,
    )
    print(
        f"# an unbounded single cache serving these one at a time would reuse {ideal} "
        f"({ideal / prompt_total:.3f})",
        flush=True,
    )
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="mlxcel-routing-") as tmp:
        base = Path(args.work_dir) if args.work_dir else Path(tmp)
        for workers, policy in plan.runs():
            started = time.perf_counter()
            work = base / f"{workers}w-{policy}"
            work.mkdir(parents=True, exist_ok=True)
            run = one_run(model_dir, work, workers, policy, convs, plan)
            runs.append(run)
            print(
                f"  {workers} worker(s) {policy}: hit ratio {_ratio(run.hit_ratio())}, "
                f"{len(run.good())}/{len(run.replies)} ok, warm-up served "
                f"{run.warmup_served}, tracebacks {run.tracebacks} "
                f"[{time.perf_counter() - started:.1f}s]",
                file=sys.stderr,
            )
    print(table(HEADERS, [row(r) for r in runs]))
    print(
        "(hit ratio = cached / prompt tokens as the workers report them; TTFT = send -> first "
        "streamed chunk with a choice; warm-up excluded; decisions: mlxcel:routing:stats "
        "during the workload)"
    )
    line, met = verdict(runs)
    data = {
        "plan": plan,
        "goal_met": met,
        "ideal_cached": ideal,
        "prompt_tokens": prompt_total,
        "runs": runs,
    }
    write_json(args.json, data)
    print(line)
    results.finish(
        {k: v for k, v in data.items() if k != "runs"}
        | {
            "rows": [
                {"workers": r.workers, "policy": r.policy, "hit_ratio": r.hit_ratio()} for r in runs
            ]
        },
        lambda ax: plot_hit_ratio(ax, runs),
    )
    return 0


def plot_hit_ratio(ax: Any, runs: list[Run]) -> None:
    """Hit ratio per routing policy, grouped by worker count."""
    counts = sorted({r.workers for r in runs})
    width = 0.8 / len(POLICIES)
    for i, policy in enumerate(POLICIES):
        ys = [
            next(
                (r.hit_ratio() for r in runs if r.workers == n and (r.policy == policy or n == 1)),
                0.0,
            )
            for n in counts
        ]
        ax.bar([j + (i - 1) * width for j in range(len(counts))], ys, width, label=policy)
    ax.set_xticks(range(len(counts)), [f"{n} worker(s)" for n in counts])
    ax.set(ylabel="cached / prompt tokens", ylim=(0, 1), title="hit ratio per routing policy")
    ax.legend()


if __name__ == "__main__":
    sys.exit(main())
