"""What a decode step pays for work done beside it: waiting against CPU, on this machine's cores.

The pool's worker runs the model's step asynchronously (mlx-lm's BatchGenerator evaluates step
N+1 while the loop handles step N), so time the loop spends *waiting* (a Redis reply, a sleeping
thread) should hide behind the step, while *CPU* spent anywhere (the loop's Python, the
publisher, the router, Redis, the client) takes a core from the model's threads. This measures
both, side by side in one run, on the in-process engine (`bench_pool_throughput.Engine`: the
bench model, the worker's batch settings and CPU ops, no HTTP or Redis), at each concurrency:

  none     the engine alone;
  wait     the loop's thread sleeps `--ms` after every step (no CPU);
  busy     the loop's thread runs Python for `--ms` after every step (CPU, holding the GIL);
  other    another process keeps `--other-share` of one core busy the whole time (as the
           router, Redis and the client do), in 1 ms slices.

Printed: ms a step (first token to last, per sequence), the ratio to `none` in the same round,
and the engine process's cores. Rounds alternate the loads' order; medians over `--repeats`.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_step_contention.py [--quick]
        [--concurrency 1,4,16] [--ms 3] [--other-share 0.1] [--max-tokens 64] [--repeats 3]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psutil
from bench_pool_throughput import Engine
from common import (
    announce,
    bench_model_dir,
    distinct_prompts,
    load_hf_tokenizer,
    median,
    output_args,
    ratio,
    table,
    write_json,
)

PROMPT_TOKENS = 64
LOADS = ("none", "wait", "busy", "other")


@dataclass
class Step:
    """One load at one concurrency in one round."""

    load: str
    concurrency: int
    ms_per_step: float
    cores: float


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


# Busy `share` of every millisecond, asleep the rest, until killed (a process of its own: a
# fork of this one, whose MLX and OpenBLAS threads hold locks, can hang in the child).
_DUTY_CYCLE = """
import sys, time
share = float(sys.argv[1])
while True:
    end = time.perf_counter() + share / 1000
    while time.perf_counter() < end:
        pass
    time.sleep((1 - share) / 1000)
"""


@contextmanager
def _other_process(share: float) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", _DUTY_CYCLE, str(share)])
    try:
        time.sleep(0.3)  # started and in its slices before the measured steps
        yield
    finally:
        proc.kill()
        proc.wait()


def _run(
    engine: Engine, prompts: list[list[int]], max_tokens: int, between: Callable[[], None]
) -> float:
    """ms a decode step: each sequence's first token to its last, over its tokens, median."""
    gen = engine.generator(max_tokens)
    try:
        gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        first: dict[int, float] = {}
        spans: list[float] = []
        counts: dict[int, int] = {}
        while len(spans) < len(prompts):
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                first.setdefault(r.uid, now)
                counts[r.uid] = counts.get(r.uid, 0) + 1
                if r.finish_reason is not None and counts[r.uid] > 1:
                    spans.append((now - first[r.uid]) / (counts[r.uid] - 1))
                elif r.finish_reason is not None:
                    spans.append(float("nan"))
            between()
        return 1000 * median([s for s in spans if s == s])
    finally:
        gen.close()


@dataclass
class Window:
    """One bare decode step at a batch size: how long `mx.async_eval` held the caller, and how
    much of the step was still computing when it returned (the loop's time to overlap)."""

    concurrency: int
    step_ms: float
    held_ms: float
    left_ms: float


def overlap_window(engine: Engine, prompts: list[list[int]], tries: int = 8) -> Window:
    """mx.async_eval returns only when the step's last few ops are queued (MLX bounds the tasks
    in flight), so what follows it overlaps just the step's tail; medians over `tries` steps."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(engine.model)
    width = min(len(p) for p in prompts)
    mx.eval(engine.model(mx.array([p[:width] for p in prompts]), cache=cache))
    token = mx.array([[p[0]] for p in prompts])
    held, left = [], []
    for _ in range(tries):
        logits = engine.model(token, cache=cache)[:, -1, :]
        t0 = time.perf_counter()
        mx.async_eval(logits)
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        held.append(1000 * (t1 - t0))
        left.append(1000 * (t2 - t1))
    h, rest = median(held), median(left)
    return Window(len(prompts), h + rest, h, rest)


def measure(engine: Engine, prompts: list[list[int]], load: str, args: argparse.Namespace) -> Step:
    me = psutil.Process()
    seconds = args.ms / 1000

    def between() -> None:
        if load == "wait":
            time.sleep(seconds)
        elif load == "busy":
            _spin(seconds)

    cpu0, wall0 = me.cpu_times(), time.perf_counter()
    if load == "other":
        with _other_process(args.other_share):
            cpu0, wall0 = me.cpu_times(), time.perf_counter()
            ms = _run(engine, prompts, args.max_tokens, between)
    else:
        ms = _run(engine, prompts, args.max_tokens, between)
    cpu1, wall1 = me.cpu_times(), time.perf_counter()
    cores = (cpu1.user + cpu1.system - cpu0.user - cpu0.system) / (wall1 - wall0)
    return Step(load, len(prompts), ms, cores)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 16, one round")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--ms", type=float, default=3.0, help="the loop's wait or CPU a step")
    p.add_argument("--other-share", type=float, default=0.1, help="of one core, 0..1")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    output_args(p, "write every step figure here", work_dir=False)
    args = p.parse_args()
    levels = [1, 16] if args.quick else [int(c) for c in args.concurrency.split(",")]
    repeats = 1 if args.quick else args.repeats
    machine = announce()
    model_dir = bench_model_dir()
    engine = Engine(model_dir)
    tokenizer = load_hf_tokenizer(model_dir)
    print(
        f"# engine: {engine.settings()}; loads: wait/busy {args.ms:g} ms a step, other "
        f"{args.other_share:g} of a core; {args.max_tokens} tokens a sequence"
    )
    count = sum(levels) * repeats * len(LOADS) + max(levels)
    texts = distinct_prompts(tokenizer, count, PROMPT_TOKENS)
    prompts = [tokenizer.encode(t) for t in texts]
    _run(engine, prompts[: max(levels)], 8, lambda: None)  # warm: first-call allocations
    windows = [overlap_window(engine, prompts[:c]) for c in levels]
    steps: list[Step] = []
    used = max(levels)
    for round_ in range(repeats):
        order = LOADS[round_ % len(LOADS) :] + LOADS[: round_ % len(LOADS)]
        for c in levels:
            for load in order:
                batch, used = prompts[used : used + c], used + c
                step = measure(engine, batch, load, args)
                steps.append(step)
                print(
                    f"  round {round_ + 1} c={c} {load:5s} {step.ms_per_step:7.2f} ms a step, "
                    f"{step.cores:.2f} cores",
                    flush=True,
                )

    def med(c: int, load: str, value: Callable[[Step], float]) -> float:
        return median([value(s) for s in steps if s.concurrency == c and s.load == load])

    rows = []
    for c in levels:
        base = med(c, "none", lambda s: s.ms_per_step)
        for load in LOADS:
            ms = med(c, load, lambda s: s.ms_per_step)
            rows.append([c, load, ms, ratio(ms, base), ms - base, med(c, load, lambda s: s.cores)])
    print(table(["conc", "load", "ms a step", "vs none", "ms added", "engine cores"], rows))
    print(
        f"(wait/busy: {args.ms:g} ms a step on the loop's thread; other: another process at "
        f"{args.other_share:g} of a core; medians over {repeats} round(s))"
    )
    print(
        table(
            ["conc", "bare step ms", "async_eval held ms", "left after it ms"],
            [[w.concurrency, w.step_ms, w.held_ms, w.left_ms] for w in windows],
        )
    )
    print("(a bare decode step of the model, timed around mx.async_eval and the eval after it)")
    write_json(
        args.json, {"machine": machine, "args": vars(args), "steps": steps, "windows": windows}
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
