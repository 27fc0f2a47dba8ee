"""How many rows a product may have and still go to gemv on this host, for this model: measured
once at load, in whole decode steps, and kept per host.

Where gemv a row stops beating OpenBLAS's gemm depends on the CPU and on the model's product shapes
(bench/README.md, bench_sgemm_rows.py), and a probe of the products alone called it wrong: only a
whole step, with the model's own products back to back, tells. So with `MLXCEL_GEMV_ROWS` unset (or
`auto`) the worker times decode steps of 2 to MAX_ROWS sequences, each step alternately with that
many rows through gemv and through gemm (`sgemm_rows.set_rows`, in the same process, on the same
cache), and sends to gemv the row counts up to the first that gemv does not win by WIN_MARGIN (a
loss is timed twice before it ends the probe). One row always goes to gemv (no machine measured gemm
faster there: it packs the whole weight matrix for one row). The turn is kept in
`<MLXCEL_CACHE_DIR>/gemv_turn/` under a key of everything it depends on (the CPU, the cores this
process may use, the BLAS library and its thread settings, the interposer's source, the gemm
padding, MLX's version, the model's config), so only a host's first start of a model pays for the
probe; workers starting together on one host take turns (a file lock), and those after the first
read its turn.

This module imports mlx only inside `probe` (the caller has preloaded OpenBLAS).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from functools import partial
from importlib import metadata
from pathlib import Path
from typing import Any

from worker.mlx_cpu import sgemm_rows

log = logging.getLogger("mlxcel.worker")

MAX_ROWS = 8  # past this, gemm's one pass won on every machine measured
# Gemv must beat gemm by this much at a row count to take it: within it the two are a coin's
# toss on a busy host, and gemm is what OpenBLAS does on its own.
WIN_MARGIN = 0.03
CONTEXT_TOKENS = 32  # each probe batch's prompt, so the steps attend over a real cache
WARM_STEPS = 2  # a side's first steps on a new batch (buffers, OpenBLAS's threads waking)
PAIRS = 8  # timed steps a side a row count, the sides alternating step by step
# A large model's steps are long: the probe stops trying larger counts past this (the counts it
# won go to gemv, the rest to gemm, as OpenBLAS would).
BUDGET_S = 15.0
SUBDIR = "gemv_turn"
VERSION = 1  # of the probe and its file: a change here measures again


@dataclass(frozen=True)
class Turn:
    """The rows a product may have to go to gemv, and how it was decided."""

    rows: int
    # "probe" (measured now), "cache" (kept from an earlier start) or "default" (the probe
    # failed: sgemm_rows.DEFAULT_ROWS, not kept)
    source: str
    ratios: dict[int, float] = field(default_factory=dict)  # gemv / gemm step time, by rows
    seconds: float = 0.0  # the probe's own time (0 when read from the cache)
    key: str = ""


def wanted() -> bool:
    """Whether the rows are to be measured: `MLXCEL_GEMV_ROWS` unset, empty or `auto`."""
    return os.environ.get(sgemm_rows.ROWS_ENV, "").strip().lower() in ("", sgemm_rows.AUTO)


def will_measure() -> bool:
    """Whether a worker here measures its turn: the interposer is loaded and `wanted()`."""
    return sgemm_rows.loaded() and wanted()


def turn_from(ratios: dict[int, float], margin: float = WIN_MARGIN) -> int:
    """One row always; then each row count in order while gemv wins it by `margin`."""
    rows = 1
    for n in sorted(ratios):
        if n != rows + 1 or ratios[n] > 1.0 - margin:
            break
        rows = n
    return rows


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def host_key(blas_path: str | None, model_dir: Path) -> str:
    """A name for everything the turn depends on."""
    config = model_dir / "config.json"
    parts: dict[str, Any] = {
        "version": VERSION,
        "cpu": _cpu_name(),
        "machine": platform.machine(),
        "cores": len(os.sched_getaffinity(0)),
        "blas": blas_path or "",
        "blas_size": os.path.getsize(blas_path) if blas_path and os.path.exists(blas_path) else 0,
        "threads": [os.environ.get(v, "") for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")],
        "coretype": os.environ.get("OPENBLAS_CORETYPE", ""),
        "interposer": hashlib.sha256(sgemm_rows.SOURCE.read_bytes()).hexdigest(),
        "pad": sgemm_rows.configured_pad(),
        "mlx": _version("mlx"),
        "model": hashlib.sha256(config.read_bytes()).hexdigest() if config.exists() else "",
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return ""


def _store(cache_dir: Path) -> Path:
    return cache_dir / SUBDIR


def cached(cache_dir: Path, key: str) -> Turn | None:
    """The turn kept for `key`, if one is (an unreadable file is measured again)."""
    try:
        data = json.loads((_store(cache_dir) / f"{key}.json").read_text())
        return Turn(
            rows=int(data["rows"]),
            source="cache",
            ratios={int(k): float(v) for k, v in data.get("ratios", {}).items()},
            key=key,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _keep(cache_dir: Path, turn: Turn) -> None:
    """Written whole or not at all (renamed into place)."""
    store = _store(cache_dir)
    record = {**asdict(turn), "measured_at": time.time(), "cpu": _cpu_name()}
    fd, tmp = tempfile.mkstemp(prefix=".turn-", suffix=".json", dir=store)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, sort_keys=True)
        os.replace(tmp, store / f"{turn.key}.json")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@contextlib.contextmanager
def _one_at_a_time(cache_dir: Path) -> Iterator[None]:
    """Workers starting on one host probe one after another: each times its steps alone, and
    those after the first find its turn kept."""
    store = _store(cache_dir)
    store.mkdir(parents=True, exist_ok=True)
    with open(store / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def resolve(model: Any, blas_path: str | None, model_dir: Path, cache_dir: Path) -> Turn:
    """This host's turn for `model` (its CPU ops installed, as it will be served): the kept one,
    else measured now and kept; applied to the interposer either way."""
    key = host_key(blas_path, model_dir)
    try:
        try:
            with _one_at_a_time(cache_dir):
                turn = cached(cache_dir, key)
                if turn is None:
                    turn = probe(model, key)
                    with contextlib.suppress(OSError):
                        _keep(cache_dir, turn)
        except OSError as exc:  # no writable cache dir: measured, not kept
            log.warning("gemv turn: cannot keep it under %s (%s)", cache_dir, exc)
            turn = probe(model, key)
    except Exception:  # a model the probe's plain batches do not fit: never a worker lost
        rows = sgemm_rows.DEFAULT_ROWS
        log.exception("gemv turn: the probe failed; up to %d rows go to gemv", rows)
        turn = Turn(rows, "default", key=key)
    sgemm_rows.set_rows(turn.rows)
    return turn


def probe(model: Any, key: str = "", max_rows: int = MAX_ROWS, pairs: int = PAIRS) -> Turn:
    """Time decode steps of 2..max_rows sequences with their products through gemv and through
    gemm, alternating step by step; the interposer is left at the turn found."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    start = time.perf_counter()
    ratios: dict[int, float] = {}
    rng = np.random.default_rng(0)
    vocab = int(getattr(getattr(model, "args", None), "vocab_size", 0) or 256)
    for rows in range(2, max_rows + 1):
        cache = make_prompt_cache(model)
        prompt = mx.array(rng.integers(0, vocab, size=(rows, CONTEXT_TOKENS)))
        mx.eval(model(prompt, cache=cache))
        token = mx.array(rng.integers(0, vocab, size=(rows, 1)))
        step = partial(_step, model, token, cache)
        for i in range(WARM_STEPS):
            step(rows - i % 2)
        paired = _paired(step, rows, pairs)
        if statistics.median(paired) > 1.0 - WIN_MARGIN:
            # A loss ends the probe: it must hold on a second look, so that one noisy moment
            # does not send every larger count to gemm.
            paired += _paired(step, rows, pairs)
        ratios[rows] = statistics.median(paired)
        if ratios[rows] > 1.0 - WIN_MARGIN:
            break  # the turn: no larger count is tried
        if time.perf_counter() - start > BUDGET_S:
            log.info("gemv turn: the probe stopped at %d rows, its %gs spent", rows, BUDGET_S)
            break
    from worker.mlx_cpu.idle_memory import release_idle_memory

    release_idle_memory()  # the probe's batches leave no buffers behind in an idle worker
    rows = turn_from(ratios)
    sgemm_rows.set_rows(rows)
    return Turn(rows, "probe", ratios, time.perf_counter() - start, key)


def _step(model: Any, token: Any, cache: list[Any], rows: int) -> float:
    """One decode step's time with products of up to `rows` rows through gemv."""
    import mlx.core as mx

    sgemm_rows.set_rows(rows)
    t0 = time.perf_counter()
    mx.eval(model(token, cache=cache))
    return time.perf_counter() - t0


def _paired(step: Callable[[int], float], rows: int, pairs: int) -> list[float]:
    """`pairs` ratios of a step with `rows` rows through gemv over one through gemm, the two
    steps of each pair side by side (a drift cancels out), their order alternating."""
    ratios = []
    for i in range(pairs):
        took: dict[int, float] = {}
        for side in (rows, rows - 1) if i % 2 == 0 else (rows - 1, rows):
            took[side] = step(side)
        ratios.append(took[rows] / took[rows - 1])
    return ratios
