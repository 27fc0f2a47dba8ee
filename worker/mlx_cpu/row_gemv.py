"""Few-row float32 matmuls through OpenBLAS's gemv instead of its gemm.

A decode step multiplies a few rows (one a sequence) by every weight matrix. MLX's CPU backend
sends each product to `cblas_sgemm`, and OpenBLAS before 0.3.27 (Debian 12 ships 0.3.21) packs
the whole weight matrix on every gemm call, one row or many; gemv reads it once. `row_gemv.c`
puts a `cblas_sgemm` ahead of OpenBLAS's in the process's global symbol scope that sends
products of up to `rows` rows to OpenBLAS's `cblas_sgemv`, a row at a time, and the rest to
OpenBLAS's gemm (bench/README.md has the figures and the row count's choice).

`interpose(openblas, rows)` builds the library with the system C compiler (`$CC`, else `cc`)
into `<MLXCEL_CACHE_DIR>/native/`, once per source and compiler, binds it to the OpenBLAS
handle and only then makes it global; it must run after OpenBLAS is loaded but before OpenBLAS
is made global and before anything imports mlx (`blas.preload_openblas` does both). With no
compiler, or `MLXCEL_GEMV_ROWS=0`, nothing is loaded and MLX calls OpenBLAS's gemm as before.

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
# Up to eight rows a product, a gemv a row is faster than OpenBLAS 0.3.21's gemm on the bench
# model's weights; by sixteen, gemm's one pass is the faster (bench/README.md).
DEFAULT_ROWS = 8
CACHE_ENV = "MLXCEL_CACHE_DIR"
DEFAULT_CACHE = "~/.cache/mlxcel-pool"
SOURCE = Path(__file__).with_name("row_gemv.c")
BUILD_TIMEOUT_S = 60.0

_library: ctypes.CDLL | None = None


@dataclass(frozen=True)
class RowGemv:
    """What `interpose` did: the rows it sends to gemv (0: off), and why not, when it could not."""

    rows: int
    library: str | None = None
    error: str | None = None


def configured_rows() -> int:
    """`MLXCEL_GEMV_ROWS`, else the default; a value that is not a count turns the path off."""
    raw = os.environ.get(ROWS_ENV, "").strip()
    if not raw:
        return DEFAULT_ROWS
    try:
        return max(0, int(raw))
    except ValueError:
        return 0


def _compiler() -> str | None:
    cc = os.environ.get("CC", "").strip() or "cc"
    return shutil.which(cc)


def _build(cc: str) -> Path:
    """The compiled library for this source and compiler, built once (atomically) and reused."""
    source = SOURCE.read_bytes()
    tag = hashlib.sha256(source + cc.encode() + os.uname().machine.encode()).hexdigest()[:16]
    out_dir = Path(os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE)) / "native"
    target = out_dir / f"librow_gemv-{tag}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    # Two processes may build at once: each writes its own file and renames it into place.
    fd, tmp = tempfile.mkstemp(prefix=".row_gemv-", suffix=".so", dir=out_dir)
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


def interpose(openblas: ctypes.CDLL, rows: int) -> RowGemv:
    """Put the few-row `cblas_sgemm` ahead of `openblas` (loaded, not yet global). Never raises."""
    global _library
    if rows <= 0:
        return RowGemv(rows=0)
    cc = _compiler()
    if cc is None:
        return RowGemv(rows=0, error="no C compiler (cc or $CC) to build row_gemv.c")
    try:
        path = _build(cc)
        lib = ctypes.CDLL(str(path), mode=os.RTLD_LOCAL)
        lib.mlxcel_gemv_bind.argtypes = [ctypes.c_void_p, ctypes.c_int]
        if lib.mlxcel_gemv_bind(ctypes.c_void_p(openblas._handle), rows) != 1:
            return RowGemv(rows=0, error="OpenBLAS has no cblas_sgemm or cblas_sgemv")
        # Bound: only now may MLX resolve `cblas_sgemm` to it.
        _library = ctypes.CDLL(str(path), mode=os.RTLD_GLOBAL)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        text = detail.decode(errors="replace").strip()[-300:] if detail else repr(exc)
        return RowGemv(rows=0, error=f"row_gemv.c: {text}")
    return RowGemv(rows=rows, library=str(path))


def products() -> int:
    """Products sent to gemv so far in this process (0 when the path is off)."""
    if _library is None:
        return 0
    _library.mlxcel_gemv_products.restype = ctypes.c_long
    return int(_library.mlxcel_gemv_products())
