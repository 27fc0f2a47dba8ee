"""What the worker's engine adds to a decode step: `worker.engine.Engine` (admission, text
streams, stop rules, events, counters) against the bare BatchGenerator it drives, in this
process, on the same model object, with no Redis, router or client.

Both sides run C distinct ~64-token prompts greedy to `--max-tokens` (64) from one insert (the
engine: C admits, then steps), alternating which goes first each round. Printed, medians over
the rounds: ms a step (a sequence's first token to the batch's last, over its tokens), the
engine's time over the bare generator's, and the difference in ms. The bare side is
`bench_pool_throughput.py`'s `engine` (the worker's batch settings and CPU ops): what this
shows is how much of the pool's gap to that side the worker's own Python explains.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_engine_overhead.py [--quick]
        [--concurrency 1,4,16] [--max-tokens 64] [--repeats 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

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

from shared.wire import GenerationRequest
from worker.engine.engine import Engine

PROMPT_TOKENS = 64
CONTEXT_LENGTH = 4096  # past any prompt and output here
SIDES = ("bare", "engine")


@dataclass
class Run:
    side: str
    concurrency: int
    tokens: int
    ms_per_step: float


def run_bare(bare: Bare, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """(tokens, seconds from the first token to the last) of the bare generator."""
    gen = bare.generator(max_tokens)
    eos = set(bare.eos)
    try:
        gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        done: set[int] = set()
        tokens, first = 0, 0.0
        while len(done) < len(prompts):
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                first = first or now
                # An EOS that ends a sequence is not a completion token (as in the pool).
                if not (r.finish_reason == "stop" and r.token in eos):
                    tokens += 1
                if r.finish_reason is not None:
                    done.add(r.uid)
        return tokens, time.perf_counter() - first
    finally:
        gen.close()


def run_engine(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """(tokens, seconds from the first token to the last) of the worker's engine."""
    stamp = time.time_ns()
    for i, prompt in enumerate(prompts):
        spec = GenerationRequest(
            request_id=f"b{stamp}-{i}", model="m", prompt_tokens=prompt, max_tokens=max_tokens
        )
        engine.admit(spec)
    ended, tokens, first = 0, 0, 0.0
    while ended < len(prompts):
        result = engine.step()
        now = time.perf_counter()
        for events in result.events.values():
            for event in events:
                if event.kind == "delta" and event.token_ids:
                    first = first or now
                    tokens += len(event.token_ids)
        ended += len(result.ended)
    return tokens, time.perf_counter() - first


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="concurrency 1 and 16, two rounds")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=4, help="rounds, the sides' order alternating")
    output_args(p, "write every run here", work_dir=False)
    args = p.parse_args()
    levels = [1, 16] if args.quick else [int(c) for c in args.concurrency.split(",")]
    repeats = 2 if args.quick else args.repeats
    machine = announce()
    model_dir = bench_model_dir()
    bare = Bare(model_dir)
    # The worker's engine on the same model object (its CPU ops installed) and tokenizer.
    engine = Engine(
        bare.model,
        bare.tokenizer,
        bare.cfg,
        model_id=model_dir.name,
        worker_id="bench",
        context_length=CONTEXT_LENGTH,
        prompt_cache=None,
    )
    print(f"# bare generator: {bare.settings()}; {args.max_tokens} tokens a sequence, greedy")
    tokenizer = load_hf_tokenizer(model_dir)
    texts = distinct_prompts(tokenizer, max(levels) * (repeats + 1), PROMPT_TOKENS)
    prompts = [tokenizer.encode(t) for t in texts]
    sides: dict[str, Callable[[list[list[int]]], tuple[int, float]]] = {
        "bare": lambda ps: run_bare(bare, ps, args.max_tokens),
        "engine": lambda ps: run_engine(engine, ps, args.max_tokens),
    }
    for side in SIDES:  # warm: first-call allocations, compiled kernels
        sides[side](prompts[: max(levels)])
    runs: list[Run] = []
    for round_ in range(repeats):
        batch = prompts[max(levels) * (round_ + 1) :]
        for c in levels:
            for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
                tokens, seconds = sides[side](batch[:c])
                ms = 1000 * seconds / max(tokens / c, 1)
                runs.append(Run(side, c, tokens, ms))
                print(f"  round {round_ + 1} c={c} {side:6s} {ms:7.2f} ms a step", flush=True)

    def med(side: str, c: int) -> float:
        return median([r.ms_per_step for r in runs if r.side == side and r.concurrency == c])

    rows = []
    for c in levels:
        bare_ms, engine_ms = med("bare", c), med("engine", c)
        rows.append([c, bare_ms, engine_ms, ratio(engine_ms, bare_ms), engine_ms - bare_ms])
    print(table(["conc", "bare ms a step", "engine ms a step", "engine/bare", "ms added"], rows))
    print(f"(medians over {repeats} rounds; a step: a sequence's first token to the last, a token)")
    write_json(args.json, {"machine": machine, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
