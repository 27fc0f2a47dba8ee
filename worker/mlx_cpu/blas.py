"""Make MLX's CPU backend use OpenBLAS instead of the wheel's reference BLAS.

The Linux ``mlx[cpu]`` wheel links the netlib reference BLAS, far too slow to serve a model
(bench/README.md has the figures). Loading a system OpenBLAS with ``RTLD_GLOBAL`` *before*
``mlx.core`` is first imported makes the dynamic linker resolve ``sgemm_`` & co. to OpenBLAS. Once
``mlx.core`` is imported its symbols are bound, so preloading afterwards has no effect: we record
that.

This module must not import mlx at module level (that would defeat the preload).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from worker.mlx_cpu import sgemm_rows

ENV_OVERRIDE = "MLXCEL_OPENBLAS_PATH"
MIN_GFLOPS = 20.0

_MULTIARCH_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
)
# openblas-pthread first: it is the variant apt installs by default and scales across cores.
_OPENBLAS_NAMES = (
    "openblas-pthread/libopenblas.so.0",
    "libopenblas.so.0",
    "openblas-openmp/libopenblas.so.0",
    "openblas-serial/libopenblas.so.0",
    "libopenblas.so",
)
_GFORTRAN_NAMES = ("libgfortran.so.5",)


@dataclass(frozen=True)
class BlasInfo:
    """Outcome of :func:`preload_openblas` (and, via :func:`report`, a measured speed)."""

    path: str | None  # OpenBLAS library loaded into the global namespace, if any
    too_late: bool  # mlx.core was already imported, so no preload was attempted
    backend: str  # "openblas", "accelerate" or "reference"
    error: str | None = None  # why loading failed, when it did
    gflops: float | None = None  # filled in by report()
    gemv_rows: int = 0  # products of up to this many rows go to gemv (sgemm_rows; 0: none)
    gemm_pad: int = 0  # awkward row counts padded to a multiple of this (sgemm_rows; 0: none)
    sgemm_rows_error: str | None = None  # why those paths are off when they were asked for


_info: BlasInfo | None = None


def _candidates() -> list[Path]:
    """OpenBLAS paths to try, env override first."""
    found: list[Path] = []
    override = os.environ.get(ENV_OVERRIDE)
    if override:
        found.append(Path(override))
    for d in _MULTIARCH_DIRS:
        for name in _OPENBLAS_NAMES:
            found.append(Path(d) / name)
    return found


def _load_gfortran(openblas: Path) -> None:
    """Load libgfortran globally first: Debian's OpenBLAS needs it and may not find it alone."""
    for d in (openblas.parent, openblas.parent.parent, *map(Path, _MULTIARCH_DIRS)):
        for name in _GFORTRAN_NAMES:
            lib = d / name
            if lib.exists():
                try:
                    ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
                    return
                except OSError:
                    continue


# OpenBLAS's idle threads spin 2**N cycles before they sleep; its default (N=28) keeps a core busy
# long after every matmul, a core that on a small machine the router, Redis and the clients then
# wait for. 2**20 cycles still spans the gaps between one forward pass's matmuls. Read when
# OpenBLAS loads; an operator's own value wins.
THREAD_TIMEOUT_ENV = "OPENBLAS_THREAD_TIMEOUT"
THREAD_TIMEOUT_DEFAULT = "20"


def _try_load(gemv_rows: int, gemm_pad: int) -> BlasInfo:
    os.environ.setdefault(THREAD_TIMEOUT_ENV, THREAD_TIMEOUT_DEFAULT)
    errors: list[str] = []
    for lib in _candidates():
        if not lib.exists():
            continue
        try:
            _load_gfortran(lib)
            # Loaded locally first: sgemm_rows's cblas_sgemm must enter the global scope before
            # OpenBLAS's does, or MLX would resolve the name to OpenBLAS.
            handle = ctypes.CDLL(str(lib), mode=os.RTLD_LOCAL)
            rows = sgemm_rows.interpose(handle, gemv_rows, gemm_pad)
            ctypes.CDLL(str(lib), mode=os.RTLD_GLOBAL)
        except OSError as exc:
            errors.append(f"{lib}: {exc}")
            continue
        return BlasInfo(
            path=str(lib),
            too_late=False,
            backend="openblas",
            gemv_rows=rows.rows,
            gemm_pad=rows.pad,
            sgemm_rows_error=rows.error,
        )
    error = "; ".join(errors) if errors else "no OpenBLAS library found"
    return BlasInfo(path=None, too_late=False, backend="reference", error=error)


def preload_openblas(gemv_rows: int | None = None, gemm_pad: int | None = None) -> BlasInfo:
    """Load OpenBLAS globally before mlx is imported. Idempotent; never raises.

    `gemv_rows`: products of up to this many rows go to OpenBLAS's gemv; `gemm_pad`: products
    of fewer than 64 rows at least half this many past a multiple of it are padded to it
    (`sgemm_rows`; 0: neither). None reads `MLXCEL_GEMV_ROWS` and `MLXCEL_GEMM_PAD`.
    """
    global _info
    if _info is not None:
        return _info
    try:
        if sys.platform == "darwin":
            # mlx on macOS uses Accelerate; nothing to do.
            _info = BlasInfo(path=None, too_late=False, backend="accelerate")
        elif "mlx.core" in sys.modules:
            _info = BlasInfo(
                path=None,
                too_late=True,
                backend="reference",
                error="mlx.core was imported before preload_openblas()",
            )
        else:
            rows = sgemm_rows.configured_rows() if gemv_rows is None else gemv_rows
            pad = sgemm_rows.configured_pad() if gemm_pad is None else gemm_pad
            _info = _try_load(rows, pad)
    except Exception as exc:  # a failed preload must never break startup
        _info = BlasInfo(path=None, too_late=False, backend="reference", error=repr(exc))
    return _info


def measure_matmul_gflops(n: int = 512, repeats: int = 3) -> float:
    """Best-of-``repeats`` float32 ``n x n`` matmul GFLOPS on the CPU (i.e. through BLAS)."""
    import mlx.core as mx  # late import: the module must stay importable before preload

    a = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.key(0))
    b = mx.random.normal((n, n), dtype=mx.float32, key=mx.random.key(1))
    mx.eval(a, b, mx.matmul(a, b, stream=mx.cpu))  # warm-up: allocation, BLAS thread start
    best = float("inf")
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        mx.eval(mx.matmul(a, b, stream=mx.cpu))
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 / max(best, 1e-9) / 1e9


def _warning_lines(info: BlasInfo, gflops: float) -> list[str]:
    reason = (
        "mlx.core was imported before worker.mlx_cpu.blas.preload_openblas()"
        if info.too_late
        else f"OpenBLAS not loaded ({info.error})"
        if info.path is None
        else f"OpenBLAS loaded from {info.path} but matmul is slow"
    )
    return [
        "=" * 72,
        f"SLOW CPU BLAS: float32 matmul runs at {gflops:.1f} GFLOPS (want >= {MIN_GFLOPS:.0f}).",
        f"Reason: {reason}.",
        "Generation will be 10-40x slower than it should be. To fix:",
        "  sudo apt-get install libopenblas0-pthread   (or: make openblas)",
        f"  or point {ENV_OVERRIDE} at a libopenblas.so.0,",
        "  and make sure the process calls preload_openblas() before anything imports mlx.",
        "=" * 72,
    ]


def report(logger: logging.Logger, turn_measured: bool = False) -> BlasInfo:
    """Log which BLAS mlx uses and how fast it is; warn loudly when it is the slow one.
    `turn_measured`: the caller measures the gemv turn next (gemv_turn.py), which it logs."""
    info = preload_openblas()
    try:
        gflops = measure_matmul_gflops()
    except Exception as exc:  # reporting must not take the worker down
        logger.warning("could not measure BLAS speed: %r", exc)
        return info
    info = replace(info, gflops=gflops)
    where = f" ({info.path})" if info.path else ""
    logger.info("BLAS: %s%s, float32 matmul %.1f GFLOPS", info.backend, where, gflops)
    if info.gemv_rows or info.gemm_pad:
        logger.info(
            "BLAS: products of up to %s rows go to gemv; under 64 rows, a count at least 5/8 of a "
            "tile past a multiple of %d is padded to it",
            "the measured turn's" if turn_measured else info.gemv_rows,
            info.gemm_pad,
        )
    elif info.sgemm_rows_error:
        logger.warning("BLAS: every product goes to gemm as it is: %s", info.sgemm_rows_error)
    if info.backend != "accelerate" and (info.path is None or gflops < MIN_GFLOPS):
        logger.warning("\n".join(_warning_lines(info, gflops)))
    return info
