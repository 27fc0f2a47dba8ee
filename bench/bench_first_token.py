"""A sequence's first token in the step its prompt ends (worker/engine/first_token.py) against
mlx-lm's BatchGenerator, in this process, on the same model object, with no Redis or HTTP.

Each side keeps C sequences running (closed loop: one that ends is replaced at once) until
`--requests` have run: distinct ~64-token prompts, greedy, max_tokens drawn once from 32..96
(the same prompts and lengths on both sides). At one stream every request starts alone; at 4
and 16 the first C start together and the rest join sequences that are decoding. Printed,
medians over the rounds (the sides' order alternating each round): a request's time to its
first token and to its last (from its insert), tokens a second, each as the change's over
mlx-lm's, and whether every request's tokens were the same.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_first_token.py [--quick]
        [--concurrency 1,4,16] [--requests 24] [--repeats 3] [--json out.json]

About 4 minutes on 2 cores (--quick about 1).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench_pool_throughput import Engine as Bare
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
from mlx_lm.generate import BatchGenerator

from worker.engine.first_token import FirstTokenBatchGenerator

PROMPT_TOKENS = 64
MAX_TOKENS = (32, 96)
SIDES: dict[str, type[BatchGenerator]] = {
    "mlx-lm": BatchGenerator,
    "first-token": FirstTokenBatchGenerator,
}


@dataclass
class Run:
    side: str
    concurrency: int
    ttft_ms: float  # mean over the requests
    e2e_ms: float
    tok_s: float
    tokens: list[list[int]] = field(repr=False)


def closed_loop(
    make: Callable[[], Any], prompts: list[list[int]], lengths: list[int], concurrency: int
) -> tuple[list[float], list[float], float, list[list[int]]]:
    """Each request's seconds to its first token and to its last, the tokens a second over the
    whole loop, and each request's tokens."""
    gen = make()
    todo = list(range(len(prompts)))
    started: dict[int, tuple[int, float]] = {}  # uid -> (request, insert time)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    tokens: list[list[int]] = [[] for _ in prompts]

    def start(n: int) -> None:
        for _ in range(n):
            if todo:
                i = todo.pop(0)
                (uid,) = gen.insert([prompts[i]], max_tokens=[lengths[i]])
                started[uid] = (i, time.perf_counter())

    try:
        began = time.perf_counter()
        start(concurrency)
        done = 0
        while done < len(prompts):
            _, responses = gen.next()
            now, ended = time.perf_counter(), 0
            for r in responses:
                i, at = started[r.uid]
                first.setdefault(i, now - at)
                last[i] = now - at
                tokens[i].append(r.token)
                if r.finish_reason is not None:
                    done, ended = done + 1, ended + 1
            start(ended)
        wall = time.perf_counter() - began
    finally:
        gen.close()
    order = range(len(prompts))
    return [first[i] for i in order], [last[i] for i in order], sum(map(len, tokens)) / wall, tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 4, two rounds")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", type=int, default=24, help="requests a side a round")
    p.add_argument("--repeats", type=int, default=3, help="rounds, the sides' order alternating")
    output_args(p, "write every run here", work_dir=False)
    args = p.parse_args()
    levels = [1, 4] if args.quick else [int(c) for c in args.concurrency.split(",")]
    repeats = 2 if args.quick else args.repeats
    requests = 8 if args.quick else args.requests
    machine = announce()
    model_dir = bench_model_dir()
    bare = Bare(model_dir)
    c = bare.cfg
    print(f"# generators: {bare.settings()}; greedy, max_tokens {MAX_TOKENS[0]}..{MAX_TOKENS[1]}")
    tokenizer = load_hf_tokenizer(model_dir)
    texts = distinct_prompts(tokenizer, requests * (repeats + 1), PROMPT_TOKENS)
    prompts = [tokenizer.encode(t) for t in texts]
    lengths = [random.Random(i).randint(*MAX_TOKENS) for i in range(len(prompts))]

    def maker(cls: type[BatchGenerator]) -> Callable[[], Any]:
        return lambda: cls(
            bare.model,
            max_tokens=MAX_TOKENS[1],
            stop_tokens=[],  # every request runs to its max_tokens: the same work on both sides
            completion_batch_size=c.batch_size,
            prefill_batch_size=min(c.prefill_batch_size, c.batch_size),
            prefill_step_size=c.prefill_step_size,
        )

    for cls in SIDES.values():  # warm: first-call allocations, compiled kernels
        closed_loop(maker(cls), prompts[:4], [8] * 4, 4)
    runs: list[Run] = []
    for round_ in range(repeats):
        lo = requests * (round_ + 1)
        batch, sizes = prompts[lo : lo + requests], lengths[lo : lo + requests]
        for level in levels:
            names = list(SIDES) if round_ % 2 == 0 else list(SIDES)[::-1]
            for side in names:
                ttfts, ends, tok_s, toks = closed_loop(maker(SIDES[side]), batch, sizes, level)
                ttft, e2e = 1000 * sum(ttfts) / len(ttfts), 1000 * sum(ends) / len(ends)
                runs.append(Run(side, level, ttft, e2e, tok_s, toks))
    rows = []
    for level in levels:
        at = [r for r in runs if r.concurrency == level]
        base = [r for r in at if r.side == "mlx-lm"]
        ours = [r for r in at if r.side == "first-token"]
        same = all(a.tokens == b.tokens for a, b in zip(base, ours, strict=True))

        def med(rs: list[Run], key: str) -> float:
            return median([getattr(r, key) for r in rs])

        rows.append(
            [
                level,
                len(base),
                f"{med(base, 'ttft_ms'):.1f}",
                f"{med(ours, 'ttft_ms'):.1f}",
                f"{ratio(med(ours, 'ttft_ms'), med(base, 'ttft_ms')):.3f}",
                f"{med(base, 'e2e_ms'):.1f}",
                f"{med(ours, 'e2e_ms'):.1f}",
                f"{ratio(med(ours, 'e2e_ms'), med(base, 'e2e_ms')):.3f}",
                f"{med(base, 'tok_s'):.1f}",
                f"{med(ours, 'tok_s'):.1f}",
                f"{ratio(med(ours, 'tok_s'), med(base, 'tok_s')):.3f}",
                "yes" if same else "NO",
            ]
        )
    headers = [
        "conc",
        "rounds",
        "TTFT ms mlx-lm",
        "first-token",
        "ratio",
        "to last token ms mlx-lm",
        "first-token",
        "ratio",
        "tok/s mlx-lm",
        "first-token",
        "ratio",
        "same tokens",
    ]
    print(table(headers, rows))
    print(
        f"({requests} requests a side a round; TTFT and to-last-token: a request's mean from its "
        "insert; tok/s: every token over the loop's time; medians over the rounds; ratio: "
        "first-token / mlx-lm)"
    )
    write_json(args.json, {"machine": machine, "runs": [r.__dict__ for r in runs]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
