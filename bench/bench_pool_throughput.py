"""Pool overhead: aggregate generated tokens/s and TTFT through the whole pool vs the same engine
in-process vs `mlx_lm.server`, on the ~50M-param bench model, at several concurrency levels.

Sides, all on the same model and the same prompts (distinct ~64-token prompts, temperature 0):
  engine  mlx-lm's BatchGenerator in this process with the worker's batch settings; C sequences
          inserted at once and run to completion (TTFT = insert -> first token).
  pool    embedded Redis + router (`--router-processes`, 1) + 1 worker; C concurrent streaming
          /v1/completions requests over aiohttp (TTFT = send -> first content chunk).
          The pool's prompt cache is disabled (MLXCEL_PROMPT_CACHE_ENABLED=false): the prompts
          are distinct anyway, and a hit would skew the comparison.
  server  `mlx_lm.server` with its default batching settings, same requests as the pool.
Sides run back to back at each concurrency level (order rotated per repeat), each level
repeated (REPEATS_AT: more where a round is short) and the median reported. tok/s counts the
tokens actually generated (usage.completion_tokens) over the wall time from the first send to
the last token. A repeat's sides share its prompts and run seconds apart, so each repeat also
gives paired ratios (pool/server, pool/engine): their median and range are the comparison
least moved by a machine whose speed drifts between rounds.
ITL, each side's time a token after a sequence's first (streamed loads), is the per-token time
side by side: the engine's from its own steps, the pool's and the server's from the chunks.

`--load chat` sends chat completions of short user messages (~16 tokens, the chat template
around them; the engine gets the same template's tokens) instead of ~64-token completions;
`--no-stream` asks the pool and mlx_lm.server for whole responses (tok/s over the round's last
response; TTFT is then the whole response's time).

`--sampling`: `neutral` (the default) sends temperature 0 and nothing else; `controls` gives
every request the per-sequence machinery (CONTROLS: temperature, top_k, repetition_penalty and
a small logit_bias that also bans EOS, so every sequence runs to max_tokens): the same request
bodies to the pool and to mlx_lm.server, and the same controls to the engine side through the
worker's own samplers and logits processors (worker/engine/sampling.py); `both` runs neutral
then controls in one run.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_pool_throughput.py [--quick]
        [--concurrency 1,4,16,32] [--max-tokens 128] [--sampling neutral|controls|both]
        [--load completions|chat] [--no-stream] [--repeats N] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import (
    SERVER_DEFAULTS,
    StreamResult,
    announce,
    bench_model_dir,
    chat_body,
    completion_body,
    distinct_prompts,
    load_hf_tokenizer,
    mean,
    median,
    mlx_lm_server,
    new_client,
    output_args,
    pool_side,
    ratio,
    same_gemv_turn,
    stream_request,
    table,
    write_json,
)
from results import Results

from shared.config import load_settings
from shared.wire import GenerationRequest

PROMPT_TOKENS = 64
CHAT_PROMPT_TOKENS = 16  # --load chat: a short user message
# A round at one or four streams is one request (or four) of each side: a few seconds, so
# enough of them that the medians and the paired ratios are not one round's luck.
REPEATS_AT = {1: 9, 4: 5, 16: 3}
GOAL_CONCURRENCY = 16
GOAL_RATIO = 0.95
SIDES = ("engine", "pool", "server")
# Pause before each side: after the in-process engine's run this process's OpenBLAS threads spin
# on for a while, CPU the side measured next would otherwise lose; the pause outlasts the spin.
SETTLE_S = 0.5
SERVER_MODEL = "default_model"  # mlx_lm.server loads any other `model` value as a path / repo
# The controls every request of the `controls` mode carries, besides CONTROL_BIAS. Fields that
# mlx_lm.server reads from a request body too (its repetition penalty looks at the last 20
# tokens, the pool's at the whole sequence). No seed: mlx_lm.server runs a seeded request alone.
CONTROLS: dict[str, Any] = {"temperature": 0.7, "top_k": 40, "repetition_penalty": 1.1}
CONTROL_BIAS = {100: 1.5, 200: -1.5}  # token id -> bias; EOS ids get -100 on top
CONTROLS_GOAL = 1.0  # pool/server with controls, at GOAL_CONCURRENCY (issue)


@dataclass(frozen=True)
class Sampling:
    """A mode of the benchmark: the fields every request body gets on top of temperature 0."""

    name: str
    fields: dict[str, Any]

    @classmethod
    def of(cls, name: str, eos: list[int]) -> Sampling:
        if name == "neutral":
            return cls(name, {})
        bias = {**{t: -100.0 for t in eos}, **CONTROL_BIAS}
        return cls(name, {**CONTROLS, "logit_bias": {str(t): b for t, b in bias.items()}})

    def describe(self) -> str:
        if not self.fields:
            return f"{self.name} (temperature 0, no other control)"
        return f"{self.name} {json.dumps(self.fields, separators=(',', ':'))}"

    def engine_spec(self, i: int, prompt: list[int], max_tokens: int) -> GenerationRequest:
        """The request as the worker would receive it from the router."""
        bias = self.fields.get("logit_bias", {})
        fields = {**self.fields, "logit_bias": {int(t): float(b) for t, b in bias.items()}}
        return GenerationRequest(
            request_id=f"bench-{i}",
            model="bench",
            prompt_tokens=prompt,
            max_tokens=max_tokens,
            **fields,
        )


@dataclass
class Measurement:
    """One side at one concurrency level, one repeat."""

    side: str
    concurrency: int
    tokens: int
    wall_s: float
    ttfts: list[float]
    cached_tokens: int = 0
    retries: int = 0
    # Each sequence's time a token after its first: (last token - first) / (tokens - 1), for
    # those of 2 tokens or more whose tokens came apart (none for whole responses).
    itls: list[float] = field(default_factory=list)

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


# --- the in-process engine -------------------------------------------------------------------


class Engine:
    """mlx-lm's BatchGenerator driven directly, configured like the worker's scheduler."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(str(model_dir))
        self.cfg = load_settings(environ={}).worker
        # The worker's engine includes its CPU ops: the comparison measures plumbing only.
        self.cpu_ops: list[str] = []
        if self.cfg.cpu_fast_ops:
            from worker.mlx_cpu import cpu_ops

            self.cpu_ops = cpu_ops.install(self.model)
        self.eos = sorted(self.tokenizer.eos_token_ids)
        self.vocab_size = int(self.model.args.vocab_size)

    def settings(self) -> str:
        c = self.cfg
        return (
            f"batch_size={c.batch_size} prefill_batch_size={c.prefill_batch_size} "
            f"prefill_step_size={c.prefill_step_size} "
            f"cpu_ops={','.join(self.cpu_ops) or 'mlx'}"
        )

    def generator(self, max_tokens: int) -> Any:
        """A BatchGenerator of the class and configuration the worker's engine makes its own."""
        from worker.engine.first_token import generator_class

        c = self.cfg
        return generator_class()(
            self.model,
            max_tokens=max_tokens,
            stop_tokens=[[t] for t in self.eos],
            completion_batch_size=c.batch_size,
            prefill_batch_size=min(c.prefill_batch_size, c.batch_size),
            prefill_step_size=c.prefill_step_size,
        )

    def run(self, prompts: list[list[int]], max_tokens: int, sampling: Sampling) -> Measurement:
        gen = self.generator(max_tokens)
        try:
            return self._drive(gen, prompts, max_tokens, sampling)
        finally:
            gen.close()

    def _per_sequence(
        self, prompts: list[list[int]], max_tokens: int, sampling: Sampling
    ) -> dict[str, Any]:
        """insert()'s samplers and logits processors, one each per sequence, made as the
        worker's engine makes them; none in the neutral mode (BatchGenerator's defaults)."""
        if not sampling.fields:
            return {}
        from worker.engine.sampling import make_logits_processors, make_request_sampler

        specs = [sampling.engine_spec(i, p, max_tokens) for i, p in enumerate(prompts)]
        return {
            "samplers": [make_request_sampler(s, self.vocab_size) for s in specs],
            "logits_processors": [make_logits_processors(s) for s in specs],
        }

    def _drive(
        self, gen: Any, prompts: list[list[int]], max_tokens: int, sampling: Sampling
    ) -> Measurement:
        per_sequence = self._per_sequence(prompts, max_tokens, sampling)
        start = time.perf_counter()
        gen.insert(prompts, max_tokens=[max_tokens] * len(prompts), **per_sequence)
        first: dict[int, float] = {}
        last: dict[int, float] = {}
        counted: dict[int, int] = {}
        done: set[int] = set()
        tokens = 0
        while len(done) < len(prompts):
            _, responses = gen.next()
            now = time.perf_counter()
            for r in responses:
                first.setdefault(r.uid, now)
                # An EOS that ends a sequence is not a completion token (as in the pool).
                if not (r.finish_reason == "stop" and r.token in self.eos):
                    tokens += 1
                    counted[r.uid] = counted.get(r.uid, 0) + 1
                    last[r.uid] = now
                if r.finish_reason is not None:
                    done.add(r.uid)
        wall = time.perf_counter() - start
        itls = [
            (last[uid] - first[uid]) / (n - 1)
            for uid, n in counted.items()
            if n > 1 and last[uid] > first[uid]
        ]
        return Measurement(
            "engine", len(prompts), tokens, wall, [t - start for t in first.values()], itls=itls
        )


# --- HTTP sides ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Load:
    """What the HTTP sides are sent: completions of ~64-token prompts or chat completions of
    short user messages, streamed or whole."""

    chat: bool = False
    stream: bool = True

    @property
    def prompt_tokens(self) -> int:
        return CHAT_PROMPT_TOKENS if self.chat else PROMPT_TOKENS

    def describe(self) -> str:
        what = "chat completions" if self.chat else "completions"
        how = "streamed" if self.stream else "whole responses"
        return f"{what} of ~{self.prompt_tokens}-token prompts, {how}"

    def request(self, model: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
        if self.chat:
            path = "/v1/chat/completions"
            body = chat_body(model, [{"role": "user", "content": prompt}], max_tokens)
        else:
            path, body = "/v1/completions", completion_body(model, prompt, max_tokens)
        if not self.stream:
            body["stream"] = False
            del body["stream_options"]
        return path, body

    def engine_tokens(self, tokenizer: Any, prompt: str) -> list[int]:
        """The prompt's tokens as the router makes them (the chat template's, for chat)."""
        if self.chat:
            messages = [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
            return list(tokenizer.encode(text, add_special_tokens=False))
        return list(tokenizer.encode(prompt))


async def _http_round(
    url: str, model: str, prompts: list[str], max_tokens: int, fields: dict[str, Any], load: Load
) -> list[StreamResult]:
    async with new_client(url, len(prompts)) as client:
        requests = [load.request(model, p, max_tokens) for p in prompts]
        return list(
            await asyncio.gather(
                *(stream_request(client, path, {**body, **fields}) for path, body in requests)
            )
        )


def http_measure(
    side: str,
    url: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    fields: dict[str, Any],
    load: Load,
) -> Measurement:
    start = time.perf_counter()
    results = asyncio.run(_http_round(url, model, prompts, max_tokens, fields, load))
    wall = max(r.last or r.end for r in results) - start
    return Measurement(
        side,
        len(prompts),
        sum(r.completion_tokens for r in results),
        wall,
        [r.ttft for r in results],
        sum(r.cached_tokens or 0 for r in results),
        sum(r.retries for r in results),
        [1 / tps for r in results if (tps := r.decode_tps())],
    )


# --- the run ---------------------------------------------------------------------------------


@dataclass
class Sides:
    engine: Engine
    pool_url: str
    server_url: str
    model: str
    tokenizer: Any
    load: Load

    def runner(
        self, side: str, prompts: list[str], max_tokens: int, sampling: Sampling
    ) -> Callable[[], Measurement]:
        if side == "engine":
            ids = [self.load.engine_tokens(self.tokenizer, p) for p in prompts]
            return lambda: self.engine.run(ids, max_tokens, sampling)
        url, model = (
            (self.pool_url, self.model) if side == "pool" else (self.server_url, SERVER_MODEL)
        )
        fields = sampling.fields
        return lambda: http_measure(side, url, model, prompts, max_tokens, fields, self.load)


def warm_up(sides: Sides, tokenizer: Any, sampling: Sampling) -> None:
    prompts = distinct_prompts(tokenizer, 2, 16, seed=1)
    for side in SIDES:
        sides.runner(side, prompts, 4, sampling)()


def run_level(
    sides: Sides, c: int, max_tokens: int, seed: int, sampling: Sampling, repeats: int = 0
) -> dict[str, list[Measurement]]:
    out: dict[str, list[Measurement]] = {s: [] for s in SIDES}
    for rep in range(repeats or REPEATS_AT.get(c, 1)):
        # Fresh prompts per repeat (no side can reuse a cached prompt), the same for every side.
        n_tokens = sides.load.prompt_tokens
        prompts = distinct_prompts(sides.tokenizer, c, n_tokens, seed=seed + 100 * rep)
        order = SIDES[rep % 3 :] + SIDES[: rep % 3]
        for side in order:
            time.sleep(SETTLE_S)
            m = sides.runner(side, prompts, max_tokens, sampling)()
            out[side].append(m)
            print(
                f"  {sampling.name} c={c} rep={rep + 1} {side:6s} {m.tokens:5d} tok in "
                f"{m.wall_s:6.2f}s = {m.tps:7.1f} tok/s, "
                f"mean TTFT {mean(m.ttfts) * 1000:7.1f} ms, "
                f"cached {m.cached_tokens}, retries {m.retries}",
                file=sys.stderr,
            )
    return out


def summarize(c: int, runs: dict[str, list[Measurement]]) -> dict[str, Any]:
    row: dict[str, Any] = {"concurrency": c, "repeats": len(runs["engine"])}
    for side, ms in runs.items():
        row[f"{side}_tps"] = median([m.tps for m in ms])
        ttfts = [t for m in ms for t in m.ttfts]
        row[f"{side}_ttft_mean_ms"] = mean(ttfts) * 1000
        row[f"{side}_ttft_p50_ms"] = median(ttfts) * 1000
        itls = [t for m in ms for t in m.itls]
        row[f"{side}_itl_ms"] = mean(itls) * 1000 if itls else None
        row[f"{side}_tokens"] = [m.tokens for m in ms]
        row[f"{side}_cached_tokens"] = sum(m.cached_tokens for m in ms)
        row[f"{side}_retries"] = sum(m.retries for m in ms)
    row["pool_over_engine"] = ratio(row["pool_tps"], row["engine_tps"])
    row["server_over_engine"] = ratio(row["server_tps"], row["engine_tps"])
    row["pool_over_server"] = ratio(row["pool_tps"], row["server_tps"])
    for a, b in (("pool", "server"), ("pool", "engine")):
        pairs = [ratio(x.tps, y.tps) for x, y in zip(runs[a], runs[b], strict=True)]
        row[f"{a}_over_{b}_paired"] = pairs
    return row


def paired(pairs: list[float]) -> str:
    """A level's paired ratios: their median and range."""
    return f"{median(pairs):.3f} ({min(pairs):.2f}-{max(pairs):.2f})"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def goal_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((r for r in rows if r["concurrency"] == GOAL_CONCURRENCY), None)


def print_report(
    rows: list[dict[str, Any]], max_tokens: int, sampling: Sampling, load: Load
) -> None:
    headers = [
        "conc",
        "reps",
        "engine tok/s",
        "pool tok/s",
        "pool/engine",
        "server tok/s",
        "server/engine",
        "pool/server",
        "paired pool/server",
        "paired pool/engine",
        "TTFT ms engine mean/p50",
        "pool mean/p50",
        "server mean/p50",
        "ITL ms engine · pool · server",
    ]
    body = [
        [
            r["concurrency"],
            r["repeats"],
            r["engine_tps"],
            r["pool_tps"],
            r["pool_over_engine"],
            r["server_tps"],
            r["server_over_engine"],
            r["pool_over_server"],
            paired(r["pool_over_server_paired"]),
            paired(r["pool_over_engine_paired"]),
            *(f"{r[f'{s}_ttft_mean_ms']:.0f}/{r[f'{s}_ttft_p50_ms']:.0f}" for s in SIDES),
            " · ".join(_ms(r[f"{s}_itl_ms"]) for s in SIDES),
        ]
        for r in rows
    ]
    print(f"## sampling: {sampling.describe()}; load: {load.describe()}")
    print(table(headers, body))
    print(
        f"(tok/s: median over repeats; max_tokens={max_tokens}, prompts ~{load.prompt_tokens} "
        "tokens, distinct per request and per repeat; paired: each repeat's own ratio (the same "
        "prompts, the sides seconds apart), median (lowest-highest); ITL: a sequence's time a "
        "token after its first, mean over every sequence of every repeat, '-' for whole "
        "responses)"
    )
    cached = {s: sum(r[f"{s}_cached_tokens"] for r in rows) for s in ("pool", "server")}
    print(
        f"prompt-cache hits reported by usage.cached_tokens, all levels: pool {cached['pool']} "
        f"(its prompt cache is disabled for this benchmark), mlx_lm.server {cached['server']}"
    )
    goal = goal_row(rows)
    if goal is not None:
        key, want, what = (
            ("pool_over_engine", GOAL_RATIO, "pool/engine")
            if not sampling.fields
            else ("pool_over_server", CONTROLS_GOAL, "pool/server")
        )
        verdict = "MET" if goal[key] >= want else "MISSED"
        print(
            f"goal {what} >= {want} at concurrency {GOAL_CONCURRENCY} ({sampling.name}): "
            f"{goal[key]:.3f} -> {verdict}"
        )


def print_side_by_side(runs: dict[str, list[dict[str, Any]]]) -> None:
    """`--sampling both`: the issue's two numbers on one line (at concurrency 16, else at the
    highest level run; both modes run the same levels)."""
    at = {name: goal_row(rows) or rows[-1] for name, rows in runs.items()}
    print(
        f"controls pool/server {at['controls']['pool_over_server']:.3f} "
        f"(goal >= {CONTROLS_GOAL}); neutral pool/engine "
        f"{at['neutral']['pool_over_engine']:.3f} "
        f"(concurrency {at['controls']['concurrency']})"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="concurrency 1,4 and max_tokens 32")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--max-tokens", type=int, default=128)
    output_args(p, "write the results here", work_dir=False)
    # One by default: on a 2-core machine the worker needs both cores, and a second router
    # process takes CPU from it (bench/README.md).
    p.add_argument("--router-processes", type=int, default=1)
    p.add_argument(
        "--sampling",
        choices=("neutral", "controls", "both"),
        default="neutral",
        help="neutral: temperature 0 only; controls: every request with CONTROLS "
        "(top_k, a penalty, logit_bias); both: neutral, then controls",
    )
    p.add_argument("--load", choices=("completions", "chat"), default="completions")
    p.add_argument("--no-stream", action="store_true", help="whole responses, not SSE streams")
    p.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="repeats at every level (default: REPEATS_AT's, else 1)",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.max_tokens = "1,4", 32
    args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    machine = announce(send_costs=True)
    results = Results("pool_throughput")
    model_dir = bench_model_dir()
    tokenizer = load_hf_tokenizer(model_dir)
    engine = Engine(model_dir)
    modes = ["neutral", "controls"] if args.sampling == "both" else [args.sampling]
    samplings = [Sampling.of(name, engine.eos) for name in modes]
    server_args = ["--max-tokens", str(args.max_tokens)]
    print(
        f"# model {model_dir.name}; engine/pool worker: {engine.settings()}; pool prompt cache "
        f"OFF (MLXCEL_PROMPT_CACHE_ENABLED=false); router processes={args.router_processes}, "
        "workers=1"
    )
    print(f"# mlx_lm.server: its defaults {SERVER_DEFAULTS}; OpenBLAS gemm for every product")
    print(f"# sampling {args.sampling}: " + "; then ".join(s.describe() for s in samplings))
    load = Load(chat=args.load == "chat", stream=not args.no_stream)
    print(f"# load: {load.describe()}")
    env = {"MLXCEL_PROMPT_CACHE_ENABLED": "false"}
    runs: dict[str, list[dict[str, Any]]] = {}
    with (
        pool_side(model_dir, env, args.router_processes) as pool_url,
        mlx_lm_server(model_dir, server_args) as srv,
    ):
        turn = same_gemv_turn(pool_url)
        if turn is None:
            print("# the pool's worker reported no gemv turn: the engine side keeps its own rows")
        else:
            print(f"# pool worker and engine: products of up to {turn} rows to gemv")
        sides = Sides(engine, pool_url, srv, model_dir.name, tokenizer, load)
        for m, sampling in enumerate(samplings):
            warm_up(sides, tokenizer, sampling)
            # Each mode its own prompts: mlx_lm.server's prompt cache never sees one twice.
            runs[sampling.name] = [
                summarize(
                    c,
                    run_level(
                        sides,
                        c,
                        args.max_tokens,
                        seed=10_000 * (i + 1) + 1_000_000 * m,
                        sampling=sampling,
                        repeats=args.repeats,
                    ),
                )
                for i, c in enumerate(args.levels)
            ]
    for sampling in samplings:
        print_report(runs[sampling.name], args.max_tokens, sampling, load)
    if len(runs) == 2:
        print_side_by_side(runs)
    data = {
        "machine": machine,
        "max_tokens": args.max_tokens,
        "sampling": args.sampling,
        "load": args.load,
        "stream": load.stream,
        "controls": samplings[-1].fields,
        "rows": runs[modes[0]],
        "runs": runs,
    }
    write_json(args.json, data)
    results.finish(data, lambda ax: plot_throughput(ax, runs, machine))
    return 0


def plot_throughput(ax: Any, runs: dict[str, list[dict[str, Any]]], machine: str) -> None:
    """Aggregate tok/s against concurrency, one line a side (dashed: with controls)."""
    for name, rows in runs.items():
        xs = [r["concurrency"] for r in rows]
        style, suffix = ("--", " (controls)") if name == "controls" else ("-", "")
        for side, label in (
            ("engine", "in-process engine"),
            ("pool", "pool"),
            ("server", "mlx_lm.server"),
        ):
            ax.plot(
                xs,
                [r[f"{side}_tps"] for r in rows],
                marker="o",
                linestyle=style,
                label=label + suffix,
            )
    ax.set(
        xlabel="concurrent streams",
        ylabel="aggregate tokens/s",
        xscale="log",
        title=f"throughput vs concurrency\n{machine}",
    )
    xs = sorted({r["concurrency"] for rows in runs.values() for r in rows})
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.legend()


if __name__ == "__main__":
    sys.exit(main())
