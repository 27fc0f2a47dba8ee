"""Prefix reuse on models whose cache cannot be cut back, through the pool's prefill checkpoints
(worker/prompt_cache/checkpoints.py), side by side with `mlx_lm.server` on the same directories.

Two bench-sized models, built offline from mlx-lm's classes with the bench model's tokenizer:
`swa` (the bench Llama with every other layer sliding over 256 tokens: RotatingKVCache + KVCache)
and `hybrid` (Falcon-H1: attention and a Mamba-2 mixer in every layer: CacheList of KVCache and
ArraysCache). For each, both sides get the same requests, one at a time, interleaved:

1. TTFT cold vs warm: a ~1,000-token prompt never seen (cold), then the same prefix with a new
   ~24-token suffix (warm), over distinct prefixes; medians and cached_tokens.
2. The 8-turn chat of bench_prefix_cache.py: TTFT and cached/prompt tokens per turn.
3. Exactness: the pool's greedy completions of the warm prompts, given as token ids, against
   mlx-lm's in-process `stream_generate` on the same directory.
4. Bytes per checkpoint: the pool's checkpoint_bytes / checkpoint_entries after the run.

Goal: warm TTFT <= 0.3x cold on both models, outputs equal to in-process greedy.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_checkpoint_cache.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import httpx
from bench_prefix_cache import (
    FULL,
    QUICK,
    SUFFIX_TOKENS,
    Side,
    Texts,
    _span,
    chat_part,
    complete,
    print_chat,
    ttft_part,
)
from common import (
    BENCH_CACHE_DIR,
    announce,
    bench_model_dir,
    load_hf_tokenizer,
    mlx_lm_server,
    output_args,
    pool_side,
    ratio,
    table,
    write_json,
)
from results import Results

GOAL_WARM_OVER_COLD = 0.3
EXACT_TOKENS = 16
WINDOW = 256

# Falcon-H1 scaled to the bench model's cost class (attention and Mamba-2 in every layer).
HYBRID_SIZE = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1344,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "mamba_d_ssm": 512,
    "mamba_n_heads": 8,
    "mamba_d_head": 64,
    "mamba_d_state": 16,
    "mamba_chunk_size": 128,
}


def swa_model(bench_dir: Path) -> Path:
    """The bench model with sliding-window attention on every other layer (a copy)."""
    out = BENCH_CACHE_DIR / "models" / f"{bench_dir.name}-swa{WINDOW}"
    if not (out / "config.json").exists():
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(bench_dir, tmp)
        cfg = json.loads((tmp / "config.json").read_text())
        layers = cfg["num_hidden_layers"]
        cfg["layer_types"] = ["sliding_attention", "full_attention"] * (layers // 2)
        cfg["sliding_window"] = WINDOW
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        tmp.rename(out)
    return out


def hybrid_model(bench_dir: Path) -> Path:
    from devmodel.zoo import ensure_zoo_model

    return ensure_zoo_model(BENCH_CACHE_DIR, "falcon_h1", size=HYBRID_SIZE, tokenizer_dir=bench_dir)


def exactness(side: Side, model_dir: Path, prompts: list[list[int]]) -> list[bool]:
    """Whether the pool's greedy completion of each prompt (token ids) is mlx-lm's own."""
    from mlx_lm import load, stream_generate

    model, tokenizer = load(str(model_dir))
    same = []
    for prompt in prompts:
        want = "".join(
            r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=EXACT_TOKENS)
        )
        body = {"model": side.model, "prompt": prompt, "max_tokens": EXACT_TOKENS, "temperature": 0}
        got = httpx.post(f"{side.url}/v1/completions", json=body, timeout=300).json()
        same.append(got["choices"][0]["text"] == want)
    return same


def run_model(kind: str, model_dir: Path, texts: Texts, every: int | None) -> dict[str, Any]:
    tokenizer = texts.tokenizer
    env = {"MLXCEL_PROMPT_CACHE_CHECKPOINT_TOKENS": str(every)} if every is not None else None
    with (
        pool_side(model_dir, env) as pool_url,
        mlx_lm_server(model_dir, ["--max-tokens", "256"]) as server_url,
    ):
        sides = [
            Side("pool", pool_url, model_dir.name),
            Side("mlx_lm.server", server_url, "default_model"),
        ]
        for side in sides:  # load, compile, first allocations
            complete(side, texts.suffix(1), 4)
        ttft = ttft_part(sides, texts)
        chat = chat_part(sides, texts)
        prompts = [
            tokenizer.encode(f"{texts.prefix(50_000 + rep)} {texts.suffix(70_000 + rep)}")
            for rep in range(2)
        ]
        exact = exactness(sides[0], model_dir, prompts)
        stats = httpx.get(f"{pool_url}/v1/cache/stats", timeout=30).json()
    entries = stats.get("checkpoint_entries") or 0
    per_checkpoint = stats.get("checkpoint_bytes", 0) / entries if entries else 0.0
    return {
        "kind": kind,
        "model": model_dir.name,
        "ttft": ttft,
        "chat": chat,
        "exact": exact,
        "checkpoint_entries": entries,
        "bytes_per_checkpoint": per_checkpoint,
        "checkpoint_hits": stats.get("checkpoint_hits"),
        "cacheability": stats.get("cacheability"),
        "checkpoint_tokens": stats.get("checkpoint_tokens"),
    }


def print_model(result: dict[str, Any], plan: Any) -> None:
    every = result["checkpoint_tokens"]
    print(
        f"\n## {result['kind']}: {result['model']} ({result['cacheability']}, "
        f"pool checkpoint every {every} tokens)"
    )
    print(
        f"\n1. TTFT, ~{plan.prompt_tokens}-token prompt sharing all but ~{SUFFIX_TOKENS} tokens "
        f"(median of {plan.repeats} distinct prefixes)"
    )
    rows = [
        [
            name,
            s["cold_ms"],
            s["warm_ms"],
            ratio(s["warm_ms"], s["cold_ms"]),
            _span(s["warm_cached"]),
            _span(s["prompt_tokens"]),
        ]
        for name, s in result["ttft"].items()
    ]
    print(table(["side", "cold ms", "warm ms", "warm/cold", "warm cached", "prompt"], rows))
    print_chat(result["chat"], plan)
    pool = result["ttft"]["pool"]
    warm_over_cold = ratio(pool["warm_ms"], pool["cold_ms"])
    exact = result["exact"]
    print(
        table(
            ["pool", "value"],
            [
                ["outputs equal to in-process greedy", f"{sum(exact)}/{len(exact)}"],
                ["checkpoints held", result["checkpoint_entries"]],
                ["bytes per checkpoint", int(result["bytes_per_checkpoint"])],
            ],
        )
    )
    ok = warm_over_cold <= GOAL_WARM_OVER_COLD and all(exact)
    print(
        f"goal {result['kind']}: warm/cold {warm_over_cold:.3f} <= {GOAL_WARM_OVER_COLD} and "
        f"outputs exact -> {'MET' if ok else 'MISSED'}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats, ~512-token prompts")
    p.add_argument("--models", default="swa,hybrid", help="which of swa,hybrid")
    p.add_argument("--checkpoint-tokens", type=int, help="the pool's checkpoint interval")
    output_args(p, "write the results here", work_dir=False)
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    results = Results("checkpoint_cache")
    machine = announce()
    bench_dir = bench_model_dir()
    texts = Texts(load_hf_tokenizer(bench_dir), plan)
    builders = {"swa": swa_model, "hybrid": hybrid_model}
    out = []
    for kind in args.models.split(","):
        model_dir = builders[kind](bench_dir)
        print(f"# {kind}: {model_dir}", file=sys.stderr)
        out.append(run_model(kind, model_dir, texts, args.checkpoint_tokens))
    for result in out:
        print_model(result, plan)
    data = {"machine": machine, "plan": plan, "models": out}
    write_json(args.json, data)
    results.finish(data, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
