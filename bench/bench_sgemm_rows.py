"""A decode step with its products routed by row count (worker/mlx_cpu/sgemm_rows.py: few rows
on OpenBLAS's gemv, awkward counts padded to gemm's tile) against OpenBLAS's gemm for every
product, by batch size: what `MLXCEL_GEMV_ROWS` and `MLXCEL_GEMM_PAD` buy, and their defaults
(the turn measured on the host, and 16).

Each side is a fresh process (the routing is chosen before mlx loads) that preloads OpenBLAS
with a `--sides` entry ROWS/PAD (0/0: gemm for every product, as mlx_lm.server runs; `auto`
ROWS: the worker's load-time probe, worker/mlx_cpu/gemv_turn.py, measures the turn afresh in
that process and the side runs at it), loads the bench model with the worker's CPU ops,
prefills `--context` random tokens for B sequences and times `--steps` decode steps of one token
each (the model's forward and its eval, no sampling).
Then it prefills one prompt of each `--prefill` length, to its last logits as the worker does.
The sides alternate, their order rotated each round. Printed: median ms a step per side and
batch, each over the gemm side's, the products a step that went to gemv or were padded, and the
prefills' median ms.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_sgemm_rows.py [--quick]
        [--batches 1,2,4,8,12,16,24,40] [--prefill 6,12,24,40,64] [--sides 0/0,8/0,8/16,auto/16]
        [--context 64] [--steps 30] [--repeats 3] [--json out.json]
        [--paired auto,8 [--pairs 20]]

`--paired A,B` runs two settings, ROWS or ROWS/PAD each, in one process instead, alternating
step by step on the same caches (`auto`: the probe's turn), and prints the median of the pairs'
ratios a batch: on a machine whose speed drifts between processes it still tells the two apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import REPO, announce, bench_model_dir, median, output_args, ratio, table, write_json

# A prompt's prefill is timed this many times a side (fresh cache each), its median kept.
PREFILL_REPEATS = 7
STEP_CODE = """
import json, sys, time
from worker.mlx_cpu import blas, gemv_turn, sgemm_rows
asked, pad = sys.argv[2].split("/")
auto = asked == "auto"
rows, pad = (sgemm_rows.DEFAULT_ROWS if auto else int(asked)), int(pad)
info = blas.preload_openblas(gemv_rows=rows, gemm_pad=pad)
import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from worker.mlx_cpu import cpu_ops
model, _ = load(sys.argv[1])
cpu_ops.install(model)
context, steps = int(sys.argv[3]), int(sys.argv[4])
out = {"side": f"{info.gemv_rows}/{info.gemm_pad}", "error": info.sgemm_rows_error, "ms": {},
       "gemv": {}, "padded": {}}
if auto:  # measured afresh in this process, as a worker's first start on a host does
    turn = gemv_turn.probe(model)
    out.update(side=f"auto/{info.gemm_pad}", turn=turn.rows, ratios=turn.ratios,
               probe_s=turn.seconds)
for batch in json.loads(sys.argv[5]):
    rng = np.random.default_rng(batch)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(rng.integers(5, 8000, size=(batch, context))), cache=cache))
    token = mx.array(rng.integers(5, 8000, size=(batch, 1)))
    for _ in range(3):
        mx.eval(model(token, cache=cache))
    gemv, padded = sgemm_rows.gemv_products(), sgemm_rows.padded_products()
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(model(token, cache=cache))
    out["ms"][str(batch)] = (time.perf_counter() - start) / steps * 1e3
    out["gemv"][str(batch)] = (sgemm_rows.gemv_products() - gemv) / steps
    out["padded"][str(batch)] = (sgemm_rows.padded_products() - padded) / steps
from worker.mlx_cpu.last_logits import last_logits
out["prefill_ms"] = {}
for length in json.loads(sys.argv[6]):
    prompt = mx.array(np.random.default_rng(length).integers(5, 8000, size=(1, length)))
    times = []
    for _ in range(int(sys.argv[7])):
        cache = make_prompt_cache(model)
        start = time.perf_counter()
        mx.eval(last_logits(model, prompt, cache))
        times.append(time.perf_counter() - start)
    out["prefill_ms"][str(length)] = sorted(times)[len(times) // 2] * 1e3
print(json.dumps(out))
"""

# `--paired A,B`: one process, the two row settings alternating step by step on the same caches
# (each pair's two steps side by side, their order alternating), so a machine whose speed
# drifts between processes and minutes still compares them; `auto` is the worker's probe, run
# first in this process.
PAIRED_CODE = """
import json, statistics, sys, time
from worker.mlx_cpu import blas, gemv_turn, sgemm_rows
info = blas.preload_openblas()
import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
from worker.mlx_cpu import cpu_ops
model, _ = load(sys.argv[1])
cpu_ops.install(model)
names = sys.argv[2].split(",")
context, pairs = int(sys.argv[3]), int(sys.argv[4])
out = {"ms": {}, "ratio": {}}
if any(n.split("/")[0] == "auto" for n in names):
    turn = gemv_turn.probe(model)
    out.update(turn=turn.rows, ratios=turn.ratios, probe_s=turn.seconds)
specs = {n: n.split("/") for n in names}
rows = {n: (out["turn"] if s[0] == "auto" else int(s[0])) for n, s in specs.items()}
pads = {n: (int(s[1]) if len(s) > 1 else info.gemm_pad) for n, s in specs.items()}
out["rows"], out["pad"] = rows, pads
for batch in json.loads(sys.argv[5]):
    rng = np.random.default_rng(batch)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(rng.integers(5, 8000, size=(batch, context))), cache=cache))
    token = mx.array(rng.integers(5, 8000, size=(batch, 1)))
    took = {n: [] for n in names}
    for i in range(2 + pairs):
        for n in (names if i % 2 == 0 else names[::-1]):
            sgemm_rows.set_rows(rows[n])
            sgemm_rows.set_pad(pads[n])
            t0 = time.perf_counter()
            mx.eval(model(token, cache=cache))
            if i >= 2:
                took[n].append(time.perf_counter() - t0)
    a, b = names
    out["ms"][str(batch)] = {n: statistics.median(took[n]) * 1e3 for n in names}
    out["ratio"][str(batch)] = statistics.median(x / y for x, y in zip(took[a], took[b]))
print(json.dumps(out))
"""


def _in_fresh_process(code: str, *args: object) -> dict:
    """`code` run by a fresh interpreter (OpenBLAS is preloaded before mlx loads): its last
    line of output, as JSON."""
    done = subprocess.run(
        [sys.executable, "-c", code, str(bench_model_dir()), *map(str, args)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
        timeout=900,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def run_paired(names: str, batches: list[int], context: int, pairs: int) -> int:
    a, b = names.split(",")
    out = _in_fresh_process(PAIRED_CODE, names, context, pairs, json.dumps(batches))
    print(
        f"# {a} = gemv up to {out['rows'][a]} rows, pad {out['pad'][a]}; {b} = gemv up to "
        f"{out['rows'][b]} rows, pad {out['pad'][b]}; {pairs} pairs of steps a batch, side by "
        "side in one process"
    )
    if "turn" in out:
        measured = " · ".join(f"{n} {r:.3f}" for n, r in out["ratios"].items())
        print(f"# the probe: up to {out['turn']} rows, in {out['probe_s']:.2f}s ({measured})")
    lines = [
        [
            batch,
            f"{out['ms'][str(batch)][a]:.2f}",
            f"{out['ms'][str(batch)][b]:.2f}",
            f"{out['ratio'][str(batch)]:.3f}",
        ]
        for batch in batches
    ]
    print(table(["batch", f"{a} ms", f"{b} ms", f"{a}/{b} (paired)"], lines))
    print("(medians of each side's steps, and of the pairs' ratios)")
    return 0


def run_side(side: str, batches: list[int], context: int, steps: int, prefill: list[int]) -> dict:
    return _in_fresh_process(
        STEP_CODE,
        side,
        context,
        steps,
        json.dumps(batches),
        json.dumps(prefill),
        PREFILL_REPEATS,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="batches 1, 4, 12; sides 0/0, auto/16; 2 rounds"
    )
    p.add_argument("--batches", default="1,2,4,8,12,16,24,40")
    p.add_argument(
        "--sides",
        default="0/0,8/0,8/16,auto/16",
        help="ROWS/PAD: MLXCEL_GEMV_ROWS (a count, or auto), MLXCEL_GEMM_PAD",
    )
    p.add_argument("--prefill", default="6,12,24,40,64", help="one prompt's lengths, prefilled")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--paired",
        default="",
        help="A,B (e.g. auto,8 or 5/16,5/0): two ROWS[/PAD] settings alternating step by step "
        "in one process instead of the sides",
    )
    p.add_argument("--pairs", type=int, default=20, help="--paired's pairs of steps a batch")
    output_args(p, "write every side's run here", work_dir=False)
    args = p.parse_args()
    if args.paired:
        announce()
        batches = [int(b) for b in args.batches.split(",")]
        return run_paired(args.paired, batches, args.context, args.pairs)
    batches = [1, 4, 12] if args.quick else [int(b) for b in args.batches.split(",")]
    prefill = [12, 40] if args.quick else [int(n) for n in args.prefill.split(",")]
    sides = ["0/0", "auto/16"] if args.quick else args.sides.split(",")
    repeats = 2 if args.quick else args.repeats
    if "0/0" not in sides:
        sides = ["0/0", *sides]
    announce()
    print(f"# bench model, {args.context}-token context, {args.steps} decode steps a batch")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for rnd in range(repeats):
        order = sides[rnd % len(sides) :] + sides[: rnd % len(sides)]
        for side in order:
            result = run_side(side, batches, args.context, args.steps, prefill)
            if result["side"] != side:
                print(f"  side {side}: ran as {result['side']} ({result['error']})")
            runs[side].append(result)
            steps_ms = "  ".join(f"B{b} {result['ms'][str(b)]:6.2f}" for b in batches)
            print(f"  round {rnd + 1} side {side}: ms a step  {steps_ms}", flush=True)
            if "turn" in result:
                measured = " · ".join(f"{n} {r:.3f}" for n, r in result["ratios"].items())
                print(
                    f"    its probe: up to {result['turn']} rows to gemv, in "
                    f"{result['probe_s']:.2f}s (gemv/gemm step by rows: {measured})"
                )
    others = [side for side in sides if side != "0/0"]
    headers = ["batch", "gemm ms", *(f"{side} ms" for side in others)]
    headers += [f"{side}/gemm" for side in others]
    headers += [f"{side} gemv · padded a step" for side in others]
    lines = []
    summary: dict[str, dict[str, float]] = {}
    for b in batches:
        ms = {side: median([run["ms"][str(b)] for run in runs[side]]) for side in sides}
        row: list[object] = [b, *(f"{ms[side]:.2f}" for side in sides)]
        row += [f"{ratio(ms[side], ms['0/0']):.3f}" for side in others]
        row += [
            f"{runs[side][0]['gemv'][str(b)]:.0f} · {runs[side][0]['padded'][str(b)]:.0f}"
            for side in others
        ]
        lines.append(row)
        summary[str(b)] = ms
    print(table(headers, lines))
    print("(medians over the rounds; a ratio under 1 is a faster step)")
    lines = []
    for n in prefill:
        ms = {side: median([run["prefill_ms"][str(n)] for run in runs[side]]) for side in sides}
        lines.append([n, *(f"{ms[side]:.2f}" for side in sides)])
        lines[-1] += [f"{ratio(ms[side], ms['0/0']):.3f}" for side in others]
        summary[f"prefill {n}"] = ms
    print(
        table(
            ["prompt tokens", "gemm ms", *(f"{side} ms" for side in others)]
            + [f"{side}/gemm" for side in others],
            lines,
        )
    )
    print(f"(one prompt's prefill to its last logits, median of {PREFILL_REPEATS} a round, then")
    print(" of the rounds)")
    write_json(args.json, {"runs": runs, "median_ms": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
