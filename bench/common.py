"""Shared helpers for the pool benchmarks: the bench model, prompts, the three sides (the pool,
`mlx_lm.server`, the in-process engine), one streamed request with its timings, and tables.

Import order matters: this module preloads OpenBLAS (an explicit call) before anything imports mlx.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Before the first import of the pool's code: `python bench/x.py` puts bench/ first, not the repo
# root, and the editable install would answer with the checkout it was made from (a worktree's
# benchmark would run another tree's worker code in its own process).
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from worker.mlx_cpu import blas, gemv_turn  # noqa: E402

blas.preload_openblas()  # before anything below imports mlx

import aiohttp  # noqa: E402
import httpx  # noqa: E402
from wake_cost import wake_cost_line  # noqa: E402

from devmodel import corpus  # noqa: E402
from mlxcel_pool.redis_server import free_port  # noqa: E402
from tests.pool_fixture import running_pool  # noqa: E402

BENCH_CACHE_DIR = REPO / ".cache" / "bench"
LOCK_HINT = "run under `flock /tmp/mlxcel-bench.lock ...` (shared 2-core machine)"
# mlx_lm.server's own defaults (server.py), used as they are: they do not cripple batching.
SERVER_DEFAULTS = {
    "decode_concurrency": 32,
    "prompt_concurrency": 8,
    "prefill_step_size": 2048,
    "prompt_cache_size": 10,
}


# --- model, tokenizer, prompts ---------------------------------------------------------------


def bench_model_dir() -> Path:
    from devmodel.builder import ensure_model

    return ensure_model(BENCH_CACHE_DIR, "bench")


def tiny_model_dir() -> Path:
    """The tests' tiny model (built once into the tests' cache dir, shared with them)."""
    from devmodel.builder import ensure_model

    return ensure_model(REPO / ".cache" / "test", "tiny")


def load_hf_tokenizer(model_dir: Path) -> Any:
    """The tokenizer exactly as the router loads it (so token counts match the pool's)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def corpus_text(seed: int, approx_chars: int) -> str:
    """Deterministic English-like text; a different seed gives different words."""
    out: list[str] = []
    size = 0
    for line in corpus.iter_lines(size_bytes=max(4096, approx_chars * 2), seed=seed):
        out.append(line)
        size += len(line) + 1
        if size >= approx_chars:
            break
    return " ".join(out)


def text_of_tokens(tokenizer: Any, seed: int, n_tokens: int) -> str:
    """Text that encodes to about `n_tokens` tokens (cut in token space, decoded back)."""
    text = corpus_text(seed, n_tokens * 8)
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < n_tokens:  # the corpus is short for this seed: append another seed's text
        text += " " + corpus_text(seed + 7919, n_tokens * 8)
        ids = tokenizer.encode(text, add_special_tokens=False)
    return str(tokenizer.decode(ids[:n_tokens]))


def distinct_prompts(tokenizer: Any, count: int, n_tokens: int, seed: int = 1000) -> list[str]:
    return [text_of_tokens(tokenizer, seed + i, n_tokens) for i in range(count)]


# --- one streamed request --------------------------------------------------------------------


@dataclass
class StreamResult:
    """Timings (perf_counter seconds) and usage of one streamed request."""

    start: float
    first: float | None = None  # first non-empty content chunk
    last: float | None = None  # last non-empty content chunk
    end: float = 0.0
    text: str = ""
    chunks: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    finish_reason: str | None = None
    retries: int = 0  # connection resets before any content (retried)

    @property
    def ttft(self) -> float:
        return (self.first or self.end) - self.start

    def decode_tps(self) -> float | None:
        """(completion_tokens - 1) / (last token time - first token time)."""
        if self.first is None or self.last is None or self.last <= self.first:
            return None
        return (self.completion_tokens - 1) / (self.last - self.first)


def completion_body(model: str, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _content(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


def _apply_chunk(res: StreamResult, chunk: dict[str, Any], now: float) -> None:
    for choice in chunk.get("choices") or []:
        text = _content(choice)
        if text:
            res.first = res.first if res.first is not None else now
            res.last = now
            res.text += text
            res.chunks += 1
        res.finish_reason = choice.get("finish_reason") or res.finish_reason
    usage = chunk.get("usage")
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.completion_tokens = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        if "cached_tokens" in details:
            res.cached_tokens = int(details["cached_tokens"])


RETRIES = 3  # mlx_lm.server (http.server, backlog 5) can reset a burst of new connections


async def stream_request(
    client: aiohttp.ClientSession, path: str, body: dict[str, Any]
) -> StreamResult:
    """POST a streaming request; time the first/last content chunks; read usage at the end
    (a body with `stream` false: its whole response, first = last = when it came).
    A connection reset before any content is retried (timings keep the original start)."""
    res = StreamResult(start=time.perf_counter())
    for attempt in range(RETRIES + 1):
        try:
            await _stream_into(res, client, path, body)
            break
        except aiohttp.ClientConnectionError:
            if res.first is not None or attempt == RETRIES:
                raise
            res.retries += 1
            await asyncio.sleep(0.05)
    res.end = time.perf_counter()
    return res


async def _stream_into(
    res: StreamResult, client: aiohttp.ClientSession, path: str, body: dict[str, Any]
) -> None:
    async with client.post(path, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{path} -> {resp.status}: {(await resp.text())[:500]}")
        if not body.get("stream"):  # one JSON body: its whole text arrives at once
            whole = await resp.json()
            now = time.perf_counter()
            for choice in whole.get("choices") or []:
                if "message" in choice:  # chat's: read as a delta (completions' is `text`)
                    choice["delta"] = choice["message"]
            _apply_chunk(res, whole, now)
            return
        async for line in resp.content:  # one SSE line at a time
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            _apply_chunk(res, json.loads(data), time.perf_counter())


def new_client(base_url: str, concurrency: int = 64) -> aiohttp.ClientSession:
    """The load generator's HTTP client. aiohttp, not httpx: the client shares the machine's cores
    with the server it measures, and aiohttp spends less CPU per streamed chunk (bench/README.md),
    time the server sides would otherwise lose."""
    return aiohttp.ClientSession(
        base_url=base_url,
        connector=aiohttp.TCPConnector(limit=concurrency + 8),
        timeout=aiohttp.ClientTimeout(total=600),
    )


# --- the sides -------------------------------------------------------------------------------


@contextmanager
def pool_side(
    model_dir: Path, env: dict[str, str] | None = None, router_processes: int = 2
) -> Iterator[str]:
    """A whole pool (embedded Redis, router processes, 1 worker); yields its base URL."""
    overrides = {"router": {"processes": router_processes}}
    with (
        tempfile.TemporaryDirectory(prefix="mlxcel-bench-") as tmp,
        running_pool(model_dir, Path(tmp), workers=1, env=env, overrides=overrides) as pool,
    ):
        yield pool.url


def same_gemv_turn(pool_url: str) -> int | None:
    """This process's few-row products sent as the pool's worker sends them: its `gemv_rows`
    (measured on its start: worker/mlx_cpu/gemv_turn.py) from `/health`, applied here, so an
    in-process engine side runs the worker's own products. None when it reports none."""
    from worker.mlx_cpu import sgemm_rows

    workers = httpx.get(f"{pool_url}/health", timeout=10).json().get("workers", [])
    rows = {str(w.get("gemv_rows", "")) for w in workers}
    if len(rows) != 1 or not next(iter(rows)).isdigit():
        return None
    turn = int(rows.pop())
    return turn if sgemm_rows.set_rows(turn) else None


def _server_code(model_dir: Path, port: int, extra: Sequence[str]) -> str:
    argv = [
        "mlx_lm.server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--log-level",
        "WARNING",
        *extra,
    ]
    return (
        "from worker.mlx_cpu import blas; blas.preload_openblas(gemv_rows=0, gemm_pad=0); "
        "import sys; "
        "from mlx_lm.server import main; "
        f"sys.argv = {argv!r}; main()"
    )


def _wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"mlx_lm.server exited {proc.returncode}:\n{log.read_text()[-3000:]}"
            )
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"mlx_lm.server not up after {timeout}s:\n{log.read_text()[-3000:]}")


@contextmanager
def mlx_lm_server(model_dir: Path, extra: Sequence[str] = ()) -> Iterator[str]:
    """`mlx_lm.server` in a subprocess (OpenBLAS preloaded, none of the worker's CPU paths: every
    product goes to OpenBLAS's gemm as it is); yields its base URL."""
    port = free_port()
    log = Path(tempfile.mkstemp(prefix="mlx_lm_server-", suffix=".log")[1])
    cmd = [sys.executable, "-c", _server_code(model_dir, port, extra)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/v1/models", proc, log, 120)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --- numbers and output ----------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else float("nan")


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def announce(send_costs: bool = False) -> str:
    """Print the run's header (the machine line, and the lock hint on stderr); returns the
    machine line for the results file. `send_costs`: also the line of what a loopback send
    costs here (bench/wake_cost.py), for a benchmark whose figures rest on processes waking
    each other."""
    machine = machine_line()
    print(f"# {machine}", flush=True)
    if send_costs:
        print(f"# {wake_cost_line()}", flush=True)
    print(f"# {LOCK_HINT}", file=sys.stderr)
    return machine


def output_args(p: Any, json_help: str, work_dir: bool = True) -> None:
    """`--work-dir` (keep the pool's logs) and `--json` (where the run's numbers go)."""
    if work_dir:
        p.add_argument("--work-dir", default=None, help="keep the pool's logs here")
    p.add_argument("--json", default=None, help=json_help)


def machine_line() -> str:
    """Date, cores, CPU model, BLAS backend and measured matmul speed."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = blas.preload_openblas()
    gflops = blas.measure_matmul_gflops()
    # A worker measures its own turn on start (MLXCEL_GEMV_ROWS unset or `auto`): this process's
    # rows are not the pool's then.
    rows = "a worker's measured turn of" if gemv_turn.wanted() else info.gemv_rows
    return (
        f"{time.strftime('%Y-%m-%d %H:%M')}  cores={os.cpu_count()}  cpu={cpu}  "
        f"blas={info.backend} ({gflops:.0f} GFLOPS f32 matmul, gemv up to {rows} "
        f"rows, gemm padded to {info.gemm_pad})"
    )


def write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return str(value)
