"""Where one stream's CPU goes: the pool against `mlx_lm.server`, per generated token, by process
and by thread.

One client streams 64-token greedy completions of distinct ~64-token prompts, one at a time, to
each side in turn (the pool: embedded Redis, one router process, one worker, prompt cache off;
`mlx_lm.server` with its defaults), on the bench model. Around the measured requests every
process of the side and this client are sampled (psutil's user + system time), and the process
that holds the model per thread: its three busiest threads are "the model's" (MLX's CPU stream
thread, OpenBLAS's helper, the thread that builds each step's graph), the rest of that process
is what serving adds inside it (the worker's publisher and heartbeat; the server's HTTP
handler). On a machine whose cores the model's threads already fill, every millisecond a token
costs anywhere else is time a step waits for a core: the table shows both sides' milliseconds
outside the model's threads, and their tok/s and inter-token latency side by side. A second
table counts wake-ups a token by process: each thread's voluntary context switches (a switch
that is a sleep, so one wake-up each; the kernel's count, `/proc/<pid>/task/*/status`), summed
over every thread of the process (threads that end before the count is read are not in it).

`--no-stream` asks both sides for whole responses (no inter-token latency then): what the pool
spends on a token its client reads only at the end. `--streams N` runs N clients side by side,
each one request after another (the measured requests, at least N, shared among them): the
same split when the model steps N sequences at once.

    flock /tmp/mlxcel-bench.lock .venv/bin/python bench/bench_one_stream_cpu.py [--quick]
        [--requests 12] [--max-tokens 64] [--repeats 2] [--no-stream] [--streams 1]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from common import (
    announce,
    bench_model_dir,
    completion_body,
    distinct_prompts,
    load_hf_tokenizer,
    median,
    mlx_lm_server,
    new_client,
    output_args,
    pool_side,
    ratio,
    stream_request,
    table,
    write_json,
)

PROMPT_TOKENS = 64
WARMUP_REQUESTS = 2
MODEL_THREADS = 3  # MLX's CPU stream, OpenBLAS's helper, the graph-building thread
SERVER_MODEL = "default_model"  # mlx_lm.server loads any other `model` value as a path
MODEL_PROCESS = "model's process"  # the wake-up table's name for the process holding the model


@dataclass
class Split:
    """One side's run: tokens, wall time, and CPU seconds by where they were spent."""

    side: str
    tokens: int = 0
    tok_s: float = 0.0
    itl_ms: float = 0.0
    cpu_s: dict[str, float] = field(default_factory=dict)
    wakes: dict[str, int] = field(default_factory=dict)  # voluntary context switches, by process

    def ms_per_token(self, part: str) -> float:
        return 1000 * self.cpu_s.get(part, 0.0) / max(self.tokens, 1)

    def wakes_per_token(self, part: str) -> float:
        return self.wakes.get(part, 0) / max(self.tokens, 1)

    @property
    def outside_model_ms(self) -> float:
        return sum(self.ms_per_token(k) for k in self.cpu_s if k != "model threads")


def _cpu(proc: psutil.Process) -> float:
    try:
        t = proc.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return t.user + t.system


def _threads(proc: psutil.Process) -> dict[int, float]:
    try:
        return {t.id: t.user_time + t.system_time for t in proc.threads()}
    except psutil.NoSuchProcess:
        return {}


def _wakes(proc: psutil.Process) -> int:
    """The voluntary context switches of every thread of `proc` so far: each thread's sleeps,
    so its wake-ups."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{proc.pid}/task")
    except OSError:
        return 0
    for tid in tids:
        try:
            with open(f"/proc/{proc.pid}/task/{tid}/status") as status:
                for line in status:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
                        break
        except OSError:  # the thread ended
            continue
    return total


def _pool_parts() -> tuple[psutil.Process, dict[str, list[psutil.Process]]]:
    """The worker (the model's process) and the pool's other processes, by role."""
    parts: dict[str, list[psutil.Process]] = {"router": [], "redis": []}
    worker = None
    for proc in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "mlxcel_pool worker" in cmd:
            worker = proc
        elif "redis-server" in cmd:
            parts["redis"].append(proc)
        elif "mlxcel_pool router" in cmd or "multiprocessing" in cmd:
            parts["router"].append(proc)  # uvicorn's processes and their spawn helpers
    if worker is None:
        raise RuntimeError("the pool's worker process was not found")
    return worker, parts


def _server_parts() -> tuple[psutil.Process, dict[str, list[psutil.Process]]]:
    children = psutil.Process().children(recursive=True)
    if not children:
        raise RuntimeError("mlx_lm.server's process was not found")
    return children[0], {}


def _body(model: str, prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    body = completion_body(model, prompt, max_tokens)
    if not stream:
        del body["stream_options"]
        body["stream"] = False
    return body


async def _measure(
    url: str,
    model: str,
    prompts: list[str],
    max_tokens: int,
    find: Callable[[], tuple[psutil.Process, dict[str, list[psutil.Process]]]],
    side: str,
    stream: bool,
    streams: int = 1,
) -> Split:
    async with new_client(url) as client:
        for prompt in prompts[:WARMUP_REQUESTS]:
            await stream_request(
                client, "/v1/completions", _body(model, prompt, max_tokens, stream)
            )
        holder, others = find()
        me = psutil.Process()
        groups = {**others, "client": [me]}
        before = {k: sum(_cpu(p) for p in ps) for k, ps in groups.items()}
        wakes_before = {k: sum(_wakes(p) for p in ps) for k, ps in groups.items()}
        wakes_before[MODEL_PROCESS] = _wakes(holder)
        threads_before = _threads(holder)
        left = [_body(model, p, max_tokens, stream) for p in prompts[WARMUP_REQUESTS:]]
        results = []

        async def one_client() -> None:
            while left:  # each client one request after another, the next body left
                results.append(await stream_request(client, "/v1/completions", left.pop(0)))

        await asyncio.gather(*[one_client() for _ in range(streams)])
        threads_after = _threads(holder)
        after = {k: sum(_cpu(p) for p in ps) for k, ps in groups.items()}
        wakes_after = {k: sum(_wakes(p) for p in ps) for k, ps in groups.items()}
        wakes_after[MODEL_PROCESS] = _wakes(holder)
    spent = sorted(
        (threads_after[t] - threads_before.get(t, 0.0) for t in threads_after), reverse=True
    )
    split = Split(side)
    split.cpu_s["model threads"] = sum(spent[:MODEL_THREADS])
    split.cpu_s["rest of the model's process"] = sum(spent[MODEL_THREADS:])
    for k in groups:
        split.cpu_s[k] = after[k] - before[k]
    split.wakes = {k: wakes_after[k] - wakes_before[k] for k in wakes_after}
    split.tokens = sum(r.completion_tokens for r in results)
    wall = max(r.end for r in results) - min(r.start for r in results)
    split.tok_s = split.tokens / wall
    itls = [1000 / tps for r in results if (tps := r.decode_tps())]
    split.itl_ms = median(itls) if itls else 0.0  # whole responses: none
    return split


@contextmanager
def _side(side: str, model_dir: Path) -> Iterator[tuple[str, str]]:
    if side == "pool":
        env = {"MLXCEL_PROMPT_CACHE_ENABLED": "false"}
        with pool_side(model_dir, env=env, router_processes=1) as url:
            yield url, model_dir.name
    else:
        with mlx_lm_server(model_dir) as url:
            yield url, SERVER_MODEL


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="6 requests a side, one repeat")
    p.add_argument("--requests", type=int, default=12, help="measured requests a side")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="rounds, sides alternating")
    p.add_argument("--no-stream", action="store_true", help="whole responses, not SSE streams")
    p.add_argument("--streams", type=int, default=1, help="clients side by side")
    output_args(p, "write the splits here", work_dir=False)
    args = p.parse_args()
    requests, repeats = (6, 1) if args.quick else (args.requests, args.repeats)
    requests = max(requests, args.streams)
    machine = announce(send_costs=True)
    model_dir = bench_model_dir()
    count = WARMUP_REQUESTS + requests
    prompts = distinct_prompts(load_hf_tokenizer(model_dir), count, PROMPT_TOKENS)
    splits: list[Split] = []
    for round_ in range(repeats):
        for side in ("pool", "server") if round_ % 2 == 0 else ("server", "pool"):
            finder = _pool_parts if side == "pool" else _server_parts
            with _side(side, model_dir) as (url, model):
                split = asyncio.run(
                    _measure(
                        url,
                        model,
                        prompts,
                        args.max_tokens,
                        finder,
                        side,
                        not args.no_stream,
                        args.streams,
                    )
                )
            splits.append(split)
            print(f"  round {round_ + 1} {side}: {split.tok_s:.1f} tok/s", file=sys.stderr)
    parts = list(dict.fromkeys(k for s in splits for k in s.cpu_s))
    headers = ["side", "tok/s", "ITL ms", *[f"{k} ms/tok" for k in parts], "outside model"]
    rows = [
        [
            s.side,
            s.tok_s,
            s.itl_ms,
            *[s.ms_per_token(k) if k in s.cpu_s else "" for k in parts],
            s.outside_model_ms,
        ]
        for s in splits
    ]
    print(table(headers, rows))
    woken = list(dict.fromkeys(k for s in splits for k in s.wakes))
    print("wake-ups a token (voluntary context switches, every thread of each process):")
    print(
        table(
            ["side", *woken, "all"],
            [
                [
                    s.side,
                    *[s.wakes_per_token(k) if k in s.wakes else "" for k in woken],
                    sum(s.wakes_per_token(k) for k in s.wakes),
                ]
                for s in splits
            ],
        )
    )

    def med(side: str, value: Callable[[Split], float]) -> float:
        return median([value(s) for s in splits if s.side == side])

    tok_ratio = ratio(med("pool", lambda s: s.tok_s), med("server", lambda s: s.tok_s))
    print(
        f"pool/server tok/s {tok_ratio:.3f}"
        f"; CPU outside the model's threads a token: pool "
        f"{med('pool', lambda s: s.outside_model_ms):.2f} ms, server "
        f"{med('server', lambda s: s.outside_model_ms):.2f} ms; model threads: pool "
        f"{med('pool', lambda s: s.ms_per_token('model threads')):.1f} ms, server "
        f"{med('server', lambda s: s.ms_per_token('model threads')):.1f} ms"
    )
    write_json(args.json, {"machine": machine, "splits": splits})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
