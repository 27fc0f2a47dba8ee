"""A decode step with few-row products on OpenBLAS's gemv (worker/mlx_cpu/row_gemv.py) against
OpenBLAS's gemm, by batch size: what `MLXCEL_GEMV_ROWS` buys and where its default comes from.

Each side is a fresh process (the path is chosen before mlx loads) that preloads OpenBLAS with
`--rows` R (0: gemm for every product, as mlx_lm.server runs), loads the bench model with the
worker's CPU ops, prefills `--context` random tokens for B sequences and times `--steps` decode
steps of one token each (the model's forward and its eval, no sampling). The sides alternate,
their order rotated each round. Printed: median ms a step per side and batch, each over the
gemm side's, and the products that went to gemv a step.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_row_gemv.py [--quick]
        [--batches 1,2,4,8,16] [--rows 0,4,8] [--context 64] [--steps 30] [--repeats 3]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import REPO, announce, bench_model_dir, median, output_args, ratio, table, write_json

STEP_CODE = """
import json, sys, time
from worker.mlx_cpu import blas, row_gemv
rows = int(sys.argv[2])
info = blas.preload_openblas(gemv_rows=rows)
import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from worker.mlx_cpu import cpu_ops
model, _ = load(sys.argv[1])
cpu_ops.install(model)
context, steps = int(sys.argv[3]), int(sys.argv[4])
out = {"rows": info.gemv_rows, "error": info.gemv_error, "ms": {}, "products": {}}
for batch in json.loads(sys.argv[5]):
    rng = np.random.default_rng(batch)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(rng.integers(5, 8000, size=(batch, context))), cache=cache))
    token = mx.array(rng.integers(5, 8000, size=(batch, 1)))
    for _ in range(3):
        mx.eval(model(token, cache=cache))
    before = row_gemv.products()
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(token, cache=cache))
    out["ms"][str(batch)] = (time.perf_counter() - start) / steps * 1e3
    out["products"][str(batch)] = (row_gemv.products() - before) / steps
print(json.dumps(out))
"""


def run_side(rows: int, batches: list[int], context: int, steps: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            STEP_CODE,
            str(bench_model_dir()),
            str(rows),
            str(context),
            str(steps),
            json.dumps(batches),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="batches 1 and 4, rows 0 and 4, 2 rounds")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--rows", default="0,4,8", help="the sides' MLXCEL_GEMV_ROWS; 0 is gemm")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    output_args(p, "write every side's run here", work_dir=False)
    args = p.parse_args()
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    sides = [0, 4] if args.quick else [int(r) for r in args.rows.split(",")]
    repeats = 2 if args.quick else args.repeats
    if 0 not in sides:
        sides = [0, *sides]
    announce()
    print(f"# bench model, {args.context}-token context, {args.steps} decode steps a batch")
    runs: dict[int, list[dict]] = {r: [] for r in sides}
    for rnd in range(repeats):
        order = sides[rnd % len(sides) :] + sides[: rnd % len(sides)]
        for rows in order:
            result = run_side(rows, batches, args.context, args.steps)
            if result["rows"] != rows:
                print(f"  rows {rows}: the path is off ({result['error']})")
            runs[rows].append(result)
            steps_ms = "  ".join(f"B{b} {result['ms'][str(b)]:6.2f}" for b in batches)
            print(f"  round {rnd + 1} rows {rows}: ms a step  {steps_ms}")
    headers = ["batch"]
    for rows in sides:
        headers.append("gemm ms" if rows == 0 else f"rows<={rows} ms")
    headers += [f"rows<={r}/gemm" for r in sides if r] + [
        f"gemv products a step (rows<={r})" for r in sides if r
    ]
    lines = []
    summary: dict[str, dict[str, float]] = {}
    for b in batches:
        ms = {r: median([run["ms"][str(b)] for run in runs[r]]) for r in sides}
        row = [b, *(f"{ms[r]:.2f}" for r in sides)]
        row += [f"{ratio(ms[r], ms[0]):.3f}" for r in sides if r]
        row += [f"{median([run['products'][str(b)] for run in runs[r]]):.0f}" for r in sides if r]
        lines.append(row)
        summary[str(b)] = {str(r): ms[r] for r in sides}
    print(table(headers, lines))
    print("(medians over the rounds; a ratio under 1 is a faster step)")
    write_json(args.json, {"runs": runs, "median_ms": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
