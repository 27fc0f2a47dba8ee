"""Prefix (prompt) cache through the whole pool vs `mlx_lm.server`'s own prompt cache, on the
~50M-param bench model. Sides: the pool with its default storage (`auto` = paged, since
batch_size > 1), the pool with MLXCEL_SERVER_DECODE_STORAGE=dense, and `mlx_lm.server` (defaults).
Every side gets the same requests, one at a time, interleaved side by side.

1. TTFT cold vs warm: a ~1,000-token prompt whose long prefix was never seen (cold), then the same
   prefix with a different ~24-token suffix after the first request finished (warm); repeated with
   distinct prefixes; medians, cold/warm ratio and usage.prompt_tokens_details.cached_tokens.
2. An 8-turn chat (/v1/chat/completions): each turn appends the previous assistant reply and a
   new ~40-token user message; TTFT and cached_tokens per turn, turn-8 / turn-1 TTFT.
3. Decode speed after a hit: a ~1,000-token prompt with max_tokens 256, cold vs warm;
   decode tok/s = (completion_tokens - 1) / (last token time - first token time).

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_prefix_cache.py [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from common import (
    SERVER_DEFAULTS,
    StreamResult,
    announce,
    bench_model_dir,
    chat_body,
    completion_body,
    load_hf_tokenizer,
    median,
    mlx_lm_server,
    new_client,
    output_args,
    pool_side,
    ratio,
    stream_request,
    table,
    text_of_tokens,
    write_json,
)
from results import Results

GOAL_RATIO = 20.0
SUFFIX_TOKENS = 24
USER_TURN_TOKENS = 40


@dataclass(frozen=True)
class Plan:
    prompt_tokens: int
    repeats: int
    turns: int
    decode_max_tokens: int
    decode_repeats: int
    ttft_max_tokens: int = 4
    chat_max_tokens: int = 32


FULL = Plan(prompt_tokens=1000, repeats=5, turns=8, decode_max_tokens=256, decode_repeats=2)
QUICK = Plan(prompt_tokens=512, repeats=3, turns=4, decode_max_tokens=64, decode_repeats=1)


@dataclass(frozen=True)
class Side:
    name: str
    url: str
    model: str


def one(side: Side, path: str, body: dict[str, Any]) -> StreamResult:
    async def go() -> StreamResult:
        async with new_client(side.url, 1) as client:
            return await stream_request(client, path, body)

    return asyncio.run(go())


def complete(side: Side, prompt: str, max_tokens: int) -> StreamResult:
    return one(side, "/v1/completions", completion_body(side.model, prompt, max_tokens))


# --- prompts ---------------------------------------------------------------------------------


@dataclass
class Texts:
    tokenizer: Any
    plan: Plan

    def prefix(self, seed: int) -> str:
        return text_of_tokens(self.tokenizer, seed, self.plan.prompt_tokens - SUFFIX_TOKENS)

    def suffix(self, seed: int) -> str:
        return text_of_tokens(self.tokenizer, seed, SUFFIX_TOKENS)

    def user_turn(self, seed: int) -> str:
        return text_of_tokens(self.tokenizer, seed, USER_TURN_TOKENS)


# --- 1. TTFT cold vs warm --------------------------------------------------------------------


def ttft_part(sides: list[Side], texts: Texts) -> dict[str, dict[str, Any]]:
    runs: dict[str, list[tuple[StreamResult, StreamResult]]] = {s.name: [] for s in sides}
    for rep in range(texts.plan.repeats):
        prefix = texts.prefix(50_000 + rep)  # never seen by any side before
        cold_prompt = f"{prefix} {texts.suffix(60_000 + rep)}"
        warm_prompt = f"{prefix} {texts.suffix(70_000 + rep)}"
        for side in sides:
            cold = complete(side, cold_prompt, texts.plan.ttft_max_tokens)
            warm = complete(side, warm_prompt, texts.plan.ttft_max_tokens)
            runs[side.name].append((cold, warm))
            print(
                f"  ttft rep={rep + 1} {side.name:12s} cold {cold.ttft * 1000:7.1f} ms "
                f"(cached {cold.cached_tokens}) warm {warm.ttft * 1000:6.1f} ms "
                f"(cached {warm.cached_tokens}/{warm.prompt_tokens})",
                file=sys.stderr,
            )
    return {name: _ttft_summary(pairs) for name, pairs in runs.items()}


def _ttft_summary(pairs: list[tuple[StreamResult, StreamResult]]) -> dict[str, Any]:
    cold = median([c.ttft for c, _ in pairs]) * 1000
    warm = median([w.ttft for _, w in pairs]) * 1000
    return {
        "cold_ms": cold,
        "warm_ms": warm,
        "ratio": ratio(cold, warm),
        "cold_cached": [c.cached_tokens for c, _ in pairs],
        "warm_cached": [w.cached_tokens for _, w in pairs],
        "prompt_tokens": [w.prompt_tokens for _, w in pairs],
    }


def print_ttft(summary: dict[str, dict[str, Any]], plan: Plan) -> None:
    print(
        f"\n1. TTFT, ~{plan.prompt_tokens}-token prompt sharing all but ~{SUFFIX_TOKENS} tokens "
        f"(median of {plan.repeats} distinct prefixes, max_tokens {plan.ttft_max_tokens})"
    )
    headers = [
        "side",
        "cold ms",
        "warm ms",
        "cold/warm",
        "cold cached",
        "warm cached",
        "prompt tokens",
    ]
    rows = [
        [
            name,
            s["cold_ms"],
            s["warm_ms"],
            s["ratio"],
            _span(s["cold_cached"]),
            _span(s["warm_cached"]),
            _span(s["prompt_tokens"]),
        ]
        for name, s in summary.items()
    ]
    print(table(headers, rows))
    server = summary.get("mlx_lm.server", {}).get("ratio", float("nan"))
    for name, s in summary.items():
        if name.startswith("pool"):
            ok = s["ratio"] >= GOAL_RATIO and s["ratio"] >= server
            print(
                f"goal {name}: cold/warm {s['ratio']:.1f}x >= {GOAL_RATIO:.0f}x and >= "
                f"mlx_lm.server {server:.1f}x -> {'MET' if ok else 'MISSED'}"
            )


def _span(values: list[Any]) -> str:
    nums = [v for v in values if v is not None]
    if not nums:
        return "n/a"
    lo, hi = min(nums), max(nums)
    return str(lo) if lo == hi else f"{lo}..{hi}"


# --- 2. multi-turn chat ----------------------------------------------------------------------


def chat_part(sides: list[Side], texts: Texts) -> dict[str, list[StreamResult]]:
    out: dict[str, list[StreamResult]] = {}
    for side in sides:
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        results: list[StreamResult] = []
        for turn in range(texts.plan.turns):
            messages.append({"role": "user", "content": texts.user_turn(80_000 + turn)})
            body = chat_body(side.model, messages, texts.plan.chat_max_tokens)
            res = one(side, "/v1/chat/completions", body)
            results.append(res)
            messages.append({"role": "assistant", "content": res.text})
        out[side.name] = results
        print(
            f"  chat {side.name:12s} " + " ".join(f"{r.ttft * 1000:.0f}" for r in results) + " ms",
            file=sys.stderr,
        )
    return out


def print_chat(results: dict[str, list[StreamResult]], plan: Plan) -> None:
    print(
        f"\n2. {plan.turns}-turn chat (+~{USER_TURN_TOKENS}-token user message per turn, "
        f"max_tokens {plan.chat_max_tokens}): TTFT ms (cached/prompt tokens)"
    )
    names = list(results)
    rows = [
        [turn + 1] + [_turn_cell(results[n][turn]) for n in names] for turn in range(plan.turns)
    ]
    rows.append([f"T{plan.turns}/T1"] + [f"{_turn_ratio(results[n]):.2f}" for n in names])
    print(table(["turn", *names], rows))


def _turn_cell(r: StreamResult) -> str:
    return f"{r.ttft * 1000:.0f} ({r.cached_tokens}/{r.prompt_tokens})"


def _turn_ratio(results: list[StreamResult]) -> float:
    return ratio(results[-1].ttft, results[0].ttft)


# --- 3. decode speed after a hit -------------------------------------------------------------


def decode_part(sides: list[Side], texts: Texts) -> dict[str, dict[str, Any]]:
    runs: dict[str, list[tuple[StreamResult, StreamResult]]] = {s.name: [] for s in sides}
    for rep in range(texts.plan.decode_repeats):
        prefix = texts.prefix(90_000 + rep)
        prompts = (
            f"{prefix} {texts.suffix(91_000 + rep)}",
            f"{prefix} {texts.suffix(92_000 + rep)}",
        )
        for side in sides:
            cold, warm = (complete(side, p, texts.plan.decode_max_tokens) for p in prompts)
            runs[side.name].append((cold, warm))
            print(
                f"  decode rep={rep + 1} {side.name:12s} cold {cold.decode_tps():.1f} warm "
                f"{warm.decode_tps():.1f} tok/s (cached {warm.cached_tokens})",
                file=sys.stderr,
            )
    return {name: _decode_summary(pairs) for name, pairs in runs.items()}


def _decode_summary(pairs: list[tuple[StreamResult, StreamResult]]) -> dict[str, Any]:
    cold = median([c.decode_tps() or 0.0 for c, _ in pairs])
    warm = median([w.decode_tps() or 0.0 for _, w in pairs])
    return {
        "cold_tps": cold,
        "warm_tps": warm,
        "ratio": ratio(warm, cold),
        "completion_tokens": [w.completion_tokens for _, w in pairs],
        "warm_cached": [w.cached_tokens for _, w in pairs],
    }


def print_decode(summary: dict[str, dict[str, Any]], plan: Plan) -> None:
    print(
        f"\n3. decode tok/s of one ~{plan.prompt_tokens}-token request, max_tokens "
        f"{plan.decode_max_tokens}, cold vs warm (median of {plan.decode_repeats})"
    )
    headers = ["side", "cold tok/s", "warm tok/s", "warm/cold", "warm cached", "completion"]
    rows = [
        [
            n,
            s["cold_tps"],
            s["warm_tps"],
            s["ratio"],
            _span(s["warm_cached"]),
            _span(s["completion_tokens"]),
        ]
        for n, s in summary.items()
    ]
    print(table(headers, rows))


# --- the run ---------------------------------------------------------------------------------


@contextmanager
def all_sides(model_dir: Any, max_tokens: int) -> Iterator[list[Side]]:
    with ExitStack() as stack:
        paged = stack.enter_context(pool_side(model_dir))
        dense = stack.enter_context(pool_side(model_dir, {"MLXCEL_SERVER_DECODE_STORAGE": "dense"}))
        server = stack.enter_context(mlx_lm_server(model_dir, ["--max-tokens", str(max_tokens)]))
        yield [
            Side("pool(paged)", paged, model_dir.name),
            Side("pool(dense)", dense, model_dir.name),
            Side("mlx_lm.server", server, "default_model"),
        ]


def warm_up(sides: list[Side], texts: Texts) -> None:
    for side in sides:
        complete(side, texts.suffix(1), 4)
        messages = [{"role": "user", "content": texts.suffix(2)}]
        one(side, "/v1/chat/completions", chat_body(side.model, messages, 4))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats, ~512-token prompts")
    output_args(p, "write the results here", work_dir=False)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    results = Results("prefix_cache")
    machine = announce()
    model_dir = bench_model_dir()
    texts = Texts(load_hf_tokenizer(model_dir), plan)
    print(
        f"# model {model_dir.name}; pools: 1 worker, router processes=2, prompt cache on "
        f"(storage auto=paged, and dense); mlx_lm.server defaults {SERVER_DEFAULTS}"
    )
    with all_sides(model_dir, plan.decode_max_tokens) as sides:
        warm_up(sides, texts)
        ttft = ttft_part(sides, texts)
        chat = chat_part(sides, texts)
        decode = decode_part(sides, texts)
    print_ttft(ttft, plan)
    print_chat(chat, plan)
    print_decode(decode, plan)
    data = {"machine": machine, "plan": plan, "ttft": ttft, "chat": chat, "decode": decode}
    write_json(args.json, data)
    results.finish(data, lambda ax: plot_ttft(ax, ttft, machine))
    return 0


def plot_ttft(ax: Any, ttft: dict[str, dict[str, Any]], machine: str) -> None:
    """TTFT cold and warm (a cache hit) per side, side by side."""
    names = list(ttft)
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [ttft[n]["cold_ms"] for n in names], 0.4, label="cold")
    ax.bar([x + 0.2 for x in xs], [ttft[n]["warm_ms"] for n in names], 0.4, label="warm (hit)")
    ax.set_xticks(list(xs), names)
    ax.set(ylabel="TTFT ms (median)", title=f"TTFT cold vs warm\n{machine}")
    ax.legend()


if __name__ == "__main__":
    sys.exit(main())
