"""The same load through the three generation APIs agents speak, side by side in one run:
`/v1/chat/completions`, `/v1/responses` and `/v1/messages`, all streamed, on one pool.

Each round sends C concurrent streams of one API, each stream `--sequential` requests one after
another (distinct short chat prompts, temperature 0, `max_tokens` each, the prompt cache off so
no API gains from another's prompts); the APIs take
turns round by round, order rotated per repeat. Per API and concurrency: aggregate tokens/s
(the usage's output tokens over the round's wall time), median TTFT (send -> first text
delta), and the router's CPU per relayed token (psutil: every router process, over the round).
Ratios are against chat completions measured in the same run.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_api_dialects.py [--quick]
        [--concurrency 1,8] [--repeats 3] [--max-tokens 64] [--model bench|tiny] [--json F]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from common import (
    announce,
    bench_model_dir,
    distinct_prompts,
    load_hf_tokenizer,
    median,
    new_client,
    output_args,
    ratio,
    table,
    tiny_model_dir,
    write_json,
)
from results import Results

from tests.pool_fixture import running_pool


@dataclass
class Reply:
    start: float
    first: float | None = None
    end: float = 0.0
    output_tokens: int = 0
    text: str = ""

    @property
    def ttft(self) -> float:
        return (self.first or self.end) - self.start


def _chat(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _responses(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "input": prompt,
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "store": False,
    }


def _messages(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


def _on_chat(reply: Reply, event: str | None, data: dict[str, Any], now: float) -> None:
    for choice in data.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") or ""
        if text:
            reply.first = reply.first or now
            reply.text += text
    if data.get("usage"):
        reply.output_tokens = int(data["usage"]["completion_tokens"])


def _on_responses(reply: Reply, event: str | None, data: dict[str, Any], now: float) -> None:
    kind = data.get("type")
    if kind == "response.output_text.delta" and data.get("delta"):
        reply.first = reply.first or now
        reply.text += data["delta"]
    elif kind in ("response.completed", "response.incomplete"):
        reply.output_tokens = int(data["response"]["usage"]["output_tokens"])


def _on_messages(reply: Reply, event: str | None, data: dict[str, Any], now: float) -> None:
    kind = data.get("type")
    if kind == "content_block_delta" and data["delta"].get("type") == "text_delta":
        if data["delta"]["text"]:
            reply.first = reply.first or now
            reply.text += data["delta"]["text"]
    elif kind == "message_delta":
        reply.output_tokens = int(data["usage"]["output_tokens"])


Body = Callable[[str, str, int], dict[str, Any]]
OnEvent = Callable[[Reply, str | None, dict[str, Any], float], None]
APIS: dict[str, tuple[str, Body, OnEvent]] = {
    "chat": ("/v1/chat/completions", _chat, _on_chat),
    "responses": ("/v1/responses", _responses, _on_responses),
    "messages": ("/v1/messages", _messages, _on_messages),
}


async def one(client: Any, api: str, model: str, prompt: str, max_tokens: int) -> Reply:
    path, body, on_event = APIS[api]
    reply = Reply(start=time.perf_counter())
    async with client.post(path, json=body(model, prompt, max_tokens)) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{api} -> {resp.status}: {(await resp.text())[:300]}")
        event: str | None = None
        async for raw in resp.content:
            line = raw.strip()
            if line.startswith(b"event: "):
                event = line[7:].decode()
            elif line.startswith(b"data: "):
                data = line[6:]
                if data == b"[DONE]":
                    break
                on_event(reply, event, json.loads(data), time.perf_counter())
    reply.end = time.perf_counter()
    return reply


@dataclass
class Round:
    api: str
    concurrency: int
    wall_s: float
    tokens: int
    ttfts: list[float]
    router_cpu_s: float
    texts: list[str] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else float("nan")

    @property
    def cpu_us_per_token(self) -> float:
        return self.router_cpu_s / self.tokens * 1e6 if self.tokens else float("nan")


def _router_cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            leader = psutil.Process(pid)
            for p in (leader, *leader.children(recursive=True)):
                t = p.cpu_times()
                total += t.user + t.system
        except psutil.Error:
            pass
    return total


async def run_round(
    url: str,
    router_pids: list[int],
    api: str,
    model: str,
    streams: list[list[str]],
    max_tokens: int,
) -> Round:
    """Each stream sends its prompts one after another; the streams run side by side."""

    async def stream(client: Any, prompts: list[str]) -> list[Reply]:
        return [await one(client, api, model, p, max_tokens) for p in prompts]

    async with new_client(url, len(streams)) as client:
        cpu0, t0 = _router_cpu_s(router_pids), time.perf_counter()
        per_stream = await asyncio.gather(*(stream(client, ps) for ps in streams))
        wall, cpu1 = time.perf_counter() - t0, _router_cpu_s(router_pids)
    replies = [r for rs in per_stream for r in rs]
    return Round(
        api,
        len(streams),
        wall,
        sum(r.output_tokens for r in replies),
        [r.ttft for r in replies],
        cpu1 - cpu0,
        [r.text for r in replies],
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--sequential", type=int, default=4, help="requests per stream per round")
    p.add_argument("--model", choices=["bench", "tiny"], default="bench")
    p.add_argument("--quick", action="store_true", help="tiny model, 1 repeat, 16 tokens")
    output_args(p, "write the rounds here", work_dir=False)
    args = p.parse_args()
    if args.quick:
        args.model, args.repeats, args.max_tokens, args.sequential = "tiny", 1, 16, 1
    levels = [int(c) for c in args.concurrency.split(",")]
    results = Results("api_dialects")
    machine = announce()
    model_dir = bench_model_dir() if args.model == "bench" else tiny_model_dir()
    tok = load_hf_tokenizer(model_dir)
    env = {"MLXCEL_PROMPT_CACHE_ENABLED": "false"}
    overrides = {"router": {"processes": 1}}
    rounds: list[Round] = []
    with (
        tempfile.TemporaryDirectory(prefix="mlxcel-bench-") as tmp,
        running_pool(model_dir, Path(tmp), env=env, overrides=overrides) as pool,
    ):
        model = httpx.get(f"{pool.url}/v1/models", timeout=10).json()["data"][0]["id"]
        pids = [pool.pid("router")]
        warm = distinct_prompts(tok, 2, 24, seed=1)
        for api in APIS:  # every path's first request (imports, parsers) out of the figures
            asyncio.run(run_round(pool.url, pids, api, model, [warm], 4))
        seed = 100
        for c in levels:
            for rep in range(args.repeats):
                order = list(APIS)[rep % 3 :] + list(APIS)[: rep % 3]
                for api in order:
                    seed += 1
                    flat = distinct_prompts(tok, c * args.sequential, 32, seed=seed)
                    prompts = [flat[i::c] for i in range(c)]
                    rnd = asyncio.run(
                        run_round(pool.url, pids, api, model, prompts, args.max_tokens)
                    )
                    rounds.append(rnd)
                    print(
                        f"c={c} rep={rep} {api:9s} {rnd.tok_s:7.1f} tok/s  "
                        f"ttft p50 {median(rnd.ttfts) * 1000:6.1f} ms  "
                        f"router {rnd.cpu_us_per_token:6.1f} us/token",
                        flush=True,
                    )
    rows = []
    for c in levels:
        per = {a: [r for r in rounds if r.api == a and r.concurrency == c] for a in APIS}
        base_tps = median([r.tok_s for r in per["chat"]])
        base_ttft = median([median(r.ttfts) for r in per["chat"]])
        for api, rs in per.items():
            tps = median([r.tok_s for r in rs])
            ttft = median([median(r.ttfts) for r in rs])
            cpu = median([r.cpu_us_per_token for r in rs])
            rows.append(
                [c, api, tps, ratio(tps, base_tps), ttft * 1000, ratio(ttft, base_ttft), cpu]
            )
    print()
    print(
        table(["streams", "api", "tok/s", "vs chat", "ttft ms", "vs chat", "router us/tok"], rows)
    )
    data = {"machine": machine, "args": vars(args), "rounds": rounds, "table": rows}
    write_json(args.json, data)
    results.finish(data, None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
