"""The worker's CPU ops (worker/mlx_cpu/cpu_ops.py) against mlx-lm's own attention and SwiGLU, by
the size of the work: where each is the faster, and what the threshold that picks between them
(`cpu_ops.MLX_BELOW`) makes of a decode step and a prefill.

`bench_pool_throughput.py`'s engine side (mlx-lm's BatchGenerator with the worker's batch
settings, this process, no Redis, router or client) runs C distinct random-token prompts of P
tokens greedy to `--max-tokens` (96), three ways on the same model object, their order rotated
each round: `ours` (our ops at every size), `threshold` (as the worker runs: mlx-lm's functions
under `MLX_BELOW` scores or elements, ours from there up) and `mlx` (mlx-lm's own at every
size). Printed, medians over the rounds: each way's time a token after a sequence's first (a
decode step) and its TTFT (insert to first token: the prefill), and each over `ours`'.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_cpu_ops.py [--quick]
        [--concurrency 1,4,8,16] [--prompt-tokens 64] [--max-tokens 96] [--repeats 4]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

from bench_pool_throughput import Engine, Sampling
from common import announce, bench_model_dir, median, output_args, ratio, table, write_json

from worker.mlx_cpu import cpu_ops

WAYS = ("ours", "threshold", "mlx")


@dataclass
class Run:
    way: str
    concurrency: int
    prompt_tokens: int
    itl_ms: float
    ttft_ms: float


def use(engine: Engine, way: str, threshold: int) -> None:
    """The model's module calls our functions or mlx-lm's; ours hand small work to mlx-lm's
    from `threshold` down (0: never)."""
    module = sys.modules[type(engine.model).__module__]
    for name, (theirs, ours) in cpu_ops._REPLACEMENTS.items():
        setattr(module, name, theirs if way == "mlx" else ours)
    cpu_ops.MLX_BELOW = 0 if way == "ours" else threshold


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 16, two rounds")
    p.add_argument("--concurrency", default="1,4,8,16")
    p.add_argument("--prompt-tokens", default="64", help="prompt lengths, comma-separated")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=4, help="rounds, the ways' order rotated")
    output_args(p, "write every run here", work_dir=False)
    args = p.parse_args()
    levels = [1, 16] if args.quick else [int(c) for c in args.concurrency.split(",")]
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    repeats = 2 if args.quick else args.repeats
    machine = announce()
    engine = Engine(bench_model_dir())
    if not engine.cpu_ops:
        print("the CPU ops do not apply to this model here (not float32 on the CPU)")
        return 1
    threshold = cpu_ops.MLX_BELOW
    sampling = Sampling.of("neutral", engine.eos)
    rng = random.Random(0)

    def prompts(c: int, n: int) -> list[list[int]]:
        return [[rng.randrange(100, engine.vocab_size) for _ in range(n)] for _ in range(c)]

    print(f"# engine: {engine.settings()}; MLX_BELOW {threshold}; {args.max_tokens} tokens, greedy")
    for way in WAYS:  # warm: first-call allocations, compiled kernels
        use(engine, way, threshold)
        engine.run(prompts(max(levels), lengths[0]), 8, sampling)
    runs: list[Run] = []
    try:
        for round_ in range(repeats):
            order = WAYS[round_ % 3 :] + WAYS[: round_ % 3]
            for n in lengths:
                for c in levels:
                    for way in order:
                        use(engine, way, threshold)
                        m = engine.run(prompts(c, n), args.max_tokens, sampling)
                        itl = 1000 * median(m.itls)
                        ttft = 1000 * median(m.ttfts)
                        runs.append(Run(way, c, n, itl, ttft))
                        print(
                            f"  round {round_ + 1} c={c} prompt={n} {way:9s} "
                            f"{itl:6.2f} ms a token, TTFT {ttft:7.1f} ms",
                            file=sys.stderr,
                            flush=True,
                        )
    finally:
        use(engine, "threshold", threshold)

    def med(way: str, c: int, n: int, field: str) -> float:
        return median(
            [
                getattr(r, field)
                for r in runs
                if r.way == way and r.concurrency == c and r.prompt_tokens == n
            ]
        )

    rows = []
    for n in lengths:
        for c in levels:
            itl = {w: med(w, c, n, "itl_ms") for w in WAYS}
            ttft = {w: med(w, c, n, "ttft_ms") for w in WAYS}
            rows.append(
                [
                    c,
                    n,
                    " · ".join(f"{itl[w]:.2f}" for w in WAYS),
                    ratio(itl["threshold"], itl["ours"]),
                    ratio(itl["mlx"], itl["ours"]),
                    " · ".join(f"{ttft[w]:.0f}" for w in WAYS),
                    ratio(ttft["threshold"], ttft["ours"]),
                ]
            )
    headers = [
        "conc",
        "prompt",
        "ms a token ours · threshold · mlx",
        "threshold/ours",
        "mlx/ours",
        "TTFT ms ours · threshold · mlx",
        "TTFT threshold/ours",
    ]
    print(table(headers, rows))
    print(
        f"(medians over {repeats} rounds; a token: a sequence's time a token after its first; "
        "TTFT: insert to first token)"
    )
    write_json(args.json, {"machine": machine, "threshold": threshold, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
