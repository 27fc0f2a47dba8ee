"""How a float32 product's rows reach OpenBLAS: few rows through gemv, awkward counts padded.

MLX's CPU backend sends every float32 product to `cblas_sgemm`. On Debian 12's OpenBLAS
(0.3.21) two kinds of product are slow: a decode step's few rows (one a
sequence), for which gemm packs the whole weight matrix on every call while gemv reads it once;
and a row count just short of a multiple of 16, whose edge tiles make 12 rows slower than 16.
`sgemm_rows.c` puts a `cblas_sgemm` ahead of OpenBLAS's in the process's global symbol scope
that sends products of up to `MLXCEL_GEMV_ROWS` rows (a worker measures the host's turn:
`gemv_turn.py`; `set_rows` moves it) to OpenBLAS's `cblas_sgemv`, a row at a time; pads those
of fewer than 64 rows at least five eighths of a tile past a multiple of `MLXCEL_GEMM_PAD` rows
with zero rows to that multiple; and sends the rest to OpenBLAS's gemm (bench/README.md has the
figures).

`interpose(openblas, rows, pad)` builds the library with the system C compiler (`$CC`, else
`cc`) into `<MLXCEL_CACHE_DIR>/native/`, once per source and compiler, binds it to the OpenBLAS
handle and only then makes it global; it must run after OpenBLAS is loaded but before OpenBLAS
is made global and before anything imports mlx (`blas.preload_openblas` does both). With no
compiler, or both settings 0, nothing is loaded and MLX calls OpenBLAS's gemm as before.

This module must not import mlx (see `blas`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROWS_ENV = "MLXCEL_GEMV_ROWS"
AUTO = "auto"  # MLXCEL_GEMV_ROWS's value for the measured turn (as unset)
PAD_ENV = "MLXCEL_GEMM_PAD"
# Where gemv a row stops beating OpenBLAS 0.3.21's gemm depends on the CPU (bench/README.md,
# bench_sgemm_rows.py): a worker measures it (gemv_turn.py); this serves until then, and in
# processes that do not measure.
DEFAULT_ROWS = 8
# OpenBLAS's float32 gemm tiles are 16 rows tall on the x86-64 kernels measured (12 rows padded
# to 16 was the faster on both CPUs).
DEFAULT_PAD = 16
CACHE_ENV = "MLXCEL_CACHE_DIR"
DEFAULT_CACHE = "~/.cache/mlxcel-pool"
SOURCE = Path(__file__).with_name("sgemm_rows.c")
BUILD_TIMEOUT_S = 60.0

_library: ctypes.CDLL | None = None


@dataclass(frozen=True)
class SgemmRows:
    """What `interpose` did: the rows it sends to gemv and the multiple it pads to (0: off), and
    why neither, when it could not."""

    rows: int
    pad: int
    error: str | None = None


def _count(env: str, default: int) -> int:
    """A count from `env`, else `default`; a value that is not a count turns its path off."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        return max(0, int(raw))
    except ValueError:
        return 0


def configured_rows() -> int:
    """`MLXCEL_GEMV_ROWS` as a count; unset, empty or `auto` (a worker measures the host's turn
    once its model is loaded: gemv_turn.py) is DEFAULT_ROWS until then."""
    if os.environ.get(ROWS_ENV, "").strip().lower() == AUTO:
        return DEFAULT_ROWS
    return _count(ROWS_ENV, DEFAULT_ROWS)


def configured_pad() -> int:
    return _count(PAD_ENV, DEFAULT_PAD)


def _compiler() -> str | None:
    cc = os.environ.get("CC", "").strip() or "cc"
    return shutil.which(cc)


def _build(cc: str) -> Path:
    """The compiled library for this source and compiler, built once (atomically) and reused."""
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + cc.encode() + os.uname().machine.encode()).hexdigest()[:16]
    out_dir = Path(os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)) / "native"
    target = out_dir / f"libsgemm_rows-{tag}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Two processes may build at once: each writes its own file and renames it into place.
    fd, tmp = tempfile.mkstemp(prefix=".sgemm_rows-", suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        subprocess.run(
            [cc, "-O2", "-shared", "-fPIC", "-o", tmp, str(SOURCE), "-ldl"],
            check=True,
            capture_output=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def interpose(openblas: ctypes.CDLL, rows: int, pad: int) -> SgemmRows:
    """Put the row-aware `cblas_sgemm` ahead of `openblas` (loaded, not yet global). Never
    raises."""
    global _library
    rows, pad = max(0, rows), (pad if pad >= 2 else 0)
    if not rows and not pad:
        return SgemmRows(rows=0, pad=0)
    cc = _compiler()
    if cc is None:
        return SgemmRows(rows=0, pad=0, error="no C compiler (cc or $CC) to build sgemm_rows.c")
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
        lib.mlxcel_sgemm_bind.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        if lib.mlxcel_sgemm_bind(ctypes.c_void_p(openblas._handle), rows, pad) != 1:
            return SgemmRows(rows=0, pad=0, error="OpenBLAS has no cblas_sgemm or cblas_sgemv")
        # Bound: only now may MLX resolve `cblas_sgemm` to it.
        _library = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
        _library.mlxcel_sgemm_set_rows.argtypes = [ctypes.c_int]
        _library.mlxcel_sgemm_set_pad.argtypes = [ctypes.c_int]
        _library.mlxcel_gemv_products.restype = ctypes.c_long
        _library.mlxcel_padded_products.restype = ctypes.c_long
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        text = detail.decode(errors="replace").strip()[-300:] if detail else repr(exc)
        return SgemmRows(rows=0, pad=0, error=f"sgemm_rows.c: {text}")
    return SgemmRows(rows=rows, pad=pad)


def loaded() -> bool:
    """Whether the interposer is in this process (bound, and global)."""
    return _library is not None


def set_rows(rows: int) -> bool:
    """Products of up to `rows` rows go to gemv from the next one on (0: none); False, and
    nothing changes, when the library is not loaded."""
    if _library is None:
        return False
    _library.mlxcel_sgemm_set_rows(max(0, rows))
    return True


def set_pad(pad: int) -> bool:
    """Awkward row counts padded to a multiple of `pad` from the next product on (under 2:
    none); False, and nothing changes, when the library is not loaded."""
    if _library is None:
        return False
    _library.mlxcel_sgemm_set_pad(pad)
    return True


def gemv_products() -> int:
    """Products sent to gemv so far in this process (0 when the library is not loaded)."""
    return 0 if _library is None else int(_library.mlxcel_gemv_products())


def padded_products() -> int:
    """Products padded to a multiple of the tile so far in this process."""
    return 0 if _library is None else int(_library.mlxcel_padded_products())
