"""Real parts only: a real redis-server per test session on a free loopback port, a real MLX model
built by the project's own builder, real processes and HTTP for the pool tests."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from mlxcel_pool.redis_server import EmbeddedRedis, start_redis
from worker.mlx_cpu import blas, sgemm_rows

# Every process of the suite sends the same products to gemv, whatever turn this host would
# measure (worker/mlx_cpu/gemv_turn.py): a test comparing two processes' tokens must not depend
# on a timing. The turn's own tests (test_gemv_turn.py) set `auto` in the processes they start.
os.environ.setdefault(sgemm_rows.ROWS_ENV, str(sgemm_rows.DEFAULT_ROWS))

# An explicit call, before any test module imports mlx: OpenBLAS must be loaded first.
blas.preload_openblas()

REPO = Path(__file__).resolve().parent.parent
# Built models are kept between runs here (ignored by git); a fresh clone builds them once.
TEST_CACHE_DIR = Path(os.environ.get("MLXCEL_TEST_CACHE_DIR", REPO / ".cache" / "test"))


# Fixtures that start a process (the session's redis-server, or worker processes): a test using
# one, directly or through another fixture, is a `pool` test. Tests that start processes some
# other way (running_pool, subprocess) carry the mark themselves, by module or by test.
PROCESS_FIXTURES = frozenset({"redis_server", "redis_url", "start_worker", "shared_pool"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.pool)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    server = start_redis()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """A clean database for each test (flushed as the admin user: the pool's URL, returned, cannot
    FLUSHALL)."""
    redis.Redis.from_url(redis_server.admin_url).flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def cache_dir() -> Path:
    TEST_CACHE_DIR.mkdir(parents=True, exist_ok=True)
    return TEST_CACHE_DIR


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    from devmodel.builder import ensure_model

    return ensure_model(cache_dir, "tiny")


@pytest.fixture(scope="session")
def tiny_embed_model_dir(cache_dir: Path) -> Path:
    """The tiny embedding model (devmodel.embedding): a worker started on it serves embeddings."""
    from devmodel.embedding import ensure_embedding_model

    return ensure_embedding_model(cache_dir)


class WorkerProcess:
    """A real `mlxcel-pool worker` process against the test Redis."""

    def __init__(
        self,
        redis_url: str,
        model_dir: Path,
        worker_id: str,
        log_dir: Path,
        env: dict[str, str] | None = None,
        argv: list[str] | None = None,
    ) -> None:
        import subprocess
        import sys

        self.worker_id = worker_id
        self.log_path = log_dir / f"worker-{worker_id}.log"
        full_env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "MLXCEL_MODEL": str(model_dir),
            "MLXCEL_WORKER_ID": worker_id,
            "PROMETHEUS_MULTIPROC_DIR": str(log_dir / "prom"),
            **(env or {}),
        }
        (log_dir / "prom").mkdir(exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", *(argv or ["mlxcel_pool", "worker"])],
            env=full_env,
            stdout=self.log_path.open("w"),
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        self.redis = redis.Redis.from_url(redis_url)

    def wait_ready(self, timeout: float = 60.0) -> None:
        import time

        from shared import keys

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited {self.proc.returncode}:\n{self.log()}")
            if self.redis.exists(keys.worker_info(self.worker_id)):
                return
            time.sleep(0.1)
        raise TimeoutError(f"worker not ready:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self, sig: int | None = None) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(sig or signal.SIGTERM)
            try:
                self.proc.wait(20)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def start_worker(tmp_path: Path, tiny_model_dir: Path):
    """Factory: start_worker(redis_url, worker_id="w1", env={...}) -> a ready WorkerProcess."""
    started: list[WorkerProcess] = []

    def _start(
        redis_url: str,
        worker_id: str = "w1",
        env: dict[str, str] | None = None,
        model_dir: Path | None = None,
        argv: list[str] | None = None,
    ) -> WorkerProcess:
        w = WorkerProcess(redis_url, model_dir or tiny_model_dir, worker_id, tmp_path, env, argv)
        started.append(w)
        w.wait_ready()
        return w

    yield _start
    for w in started:
        w.stop()


class MlxReference:
    """mlx-lm's own generation on the same model: what the pool's greedy output must equal."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load

        self.model, self.tokenizer = load(str(model_dir))

    def run(self, prompt_tokens: list[int], max_tokens: int) -> tuple[str, int]:
        """(text, completion tokens a client sees) for greedy decoding of `prompt_tokens`. The
        text continues the prompt's, as OpenAI and vLLM return it (a first leading space kept,
        which mlx-lm's own streamed text drops): the decoded whole less the decoded prompt."""
        from mlx_lm import stream_generate

        tokens: list[int] = []
        for resp in stream_generate(
            self.model, self.tokenizer, prompt_tokens, max_tokens=max_tokens
        ):
            if resp.finish_reason == "stop" and resp.token in self.tokenizer.eos_token_ids:
                break  # the EOS token is not a completion token a client sees
            tokens.append(resp.token)
        return continuation(self.tokenizer, prompt_tokens, tokens), len(tokens)


def continuation(tokenizer: Any, prompt: list[int], completion: list[int]) -> str:
    """The text `completion` adds after `prompt`, as OpenAI and vLLM return a completion's text
    (decode(prompt + completion) less decode(prompt)), by mlx-lm's streaming detokenizer fed
    the prompt first: its byte quirks are the worker's too, and its leading space is kept."""
    detok = tokenizer.detokenizer
    for token in prompt:
        detok.add_token(token)
    detok.finalize()
    head = len(detok.text)
    for token in completion:
        detok.add_token(token)
    detok.finalize()
    return detok.text[head:]


@pytest.fixture(scope="session")
def mlx_reference(tiny_model_dir: Path) -> MlxReference:
    return MlxReference(tiny_model_dir)


@pytest.fixture(scope="session")
def zoo_model_dir(cache_dir: Path) -> Callable[[str], Path]:
    """Factory: zoo_model_dir(name) -> the directory of `devmodel.zoo.ZOO[name]`, built once."""
    from devmodel.zoo import ensure_zoo_model

    def _dir(name: str) -> Path:
        return ensure_zoo_model(cache_dir, name)

    return _dir


@pytest.fixture(scope="session")
def tiny_swa_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with sliding-window attention on every other layer: its cache (mlx-lm's
    RotatingKVCache) cannot be cut back, so the prompt cache must use whole-prefix snapshots."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("swa") / "mlxcel-tiny-swa"
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * (cfg["num_hidden_layers"] // 2)
    cfg["sliding_window"] = 48
    (out / "config.json").write_text(json.dumps(cfg))
    return out


# The settings of the one pool that every test able to share it shares (`shared_pool`): tests
# that need other settings, or that kill, stall or flush, start their own.
SHARED_POOL_ENV = {"MLXCEL_TRUST_REQUEST_CHAT_TEMPLATE": "true"}
SHARED_POOL_OVERRIDES = {"worker": {"batch_size": 8}, "router": {"processes": 2}}


@pytest.fixture(scope="session")
def shared_pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One pool for the session (1 worker of the tiny model, 2 router processes, no API keys):
    a test using it must leave it as it found it (no kills, no flushes, no settings of its own)."""
    from tests.pool_fixture import running_pool

    work = tmp_path_factory.mktemp("shared-pool")
    with running_pool(
        tiny_model_dir, work, env=SHARED_POOL_ENV, overrides=SHARED_POOL_OVERRIDES
    ) as pool:
        yield pool
