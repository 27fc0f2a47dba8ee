"""worker.mlx_cpu.sgemm_rows: float32 products routed by row count (few rows to gemv, awkward
counts padded to gemm's tile), the same numbers.

The test process itself runs with both paths on (conftest preloads with the defaults), so the
in-process cases check MLX's matmuls against numpy across every layout MLX hands BLAS and the
row counts each path takes; the subprocess cases check the switches, the fallback without a
compiler, and that a model's decode step gives the same logits with the paths on and off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from worker.mlx_cpu import blas, sgemm_rows

REPO = Path(__file__).resolve().parents[1]

# macOS's MLX uses Accelerate: nothing to interpose on. Everywhere else the install puts OpenBLAS
# in place (make install), and a test process without it fails here rather than skipping.
needs_openblas = pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")


def _counted(counter, fn) -> tuple[int, object]:  # type: ignore[no-untyped-def]
    """What `fn()` returns, and how far `counter()` (one of sgemm_rows's) moved during it."""
    before = counter()
    out = fn()
    return counter() - before, out


def _products_during(fn) -> tuple[int, object]:  # type: ignore[no-untyped-def]
    return _counted(sgemm_rows.gemv_products, fn)


def _padded_during(fn) -> tuple[int, object]:  # type: ignore[no-untyped-def]
    return _counted(sgemm_rows.padded_products, fn)


@needs_openblas
def test_the_test_process_runs_with_both_paths_on() -> None:
    info = blas.preload_openblas()
    assert info.backend == "openblas", info.error
    assert info.gemv_rows == sgemm_rows.configured_rows() > 0, info.sgemm_rows_error
    assert info.gemm_pad == sgemm_rows.configured_pad() > 0


@needs_openblas
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("layout", ["x@w.T", "x@w", "xT.T@w.T", "xT.T@w"])
def test_products_match_numpy_and_few_rows_take_gemv(rows: int, layout: str) -> None:
    rng = np.random.default_rng(rows)
    k, n = 96, 80
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    mx_x, mx_w = mx.array(x), mx.array(w)
    mx_xt = mx.array(np.ascontiguousarray(x.T))  # stored k x rows: MLX passes it transposed
    lhs = mx_x if layout.startswith("x@") else mx_xt.T
    rhs = mx_w.T if layout.endswith("w.T") else mx.array(np.ascontiguousarray(w.T))
    sent, out = _products_during(lambda: np.array(lhs @ rhs))
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-4, atol=1e-4)
    assert sent == (1 if rows <= sgemm_rows.configured_rows() else 0)


# With gemm's tile of 16: 10, 12, 26 and 42 rows are five eighths of a tile or more past a
# multiple of 16 and are padded; 9, 24 and 40 (half a tile past), 17 and 33 are not, nor is 16
# itself, nor 64 and up (a prefill's).
PADDED = {
    9: False, 10: True, 12: True, 16: False, 17: False, 24: False, 26: True, 33: False,
    40: False, 42: True, 72: False,
}  # fmt: skip


@needs_openblas
@pytest.mark.parametrize("rows", sorted(PADDED))
@pytest.mark.parametrize("layout", ["x@w.T", "x@w"])
def test_awkward_row_counts_are_padded_to_the_tile_with_the_same_product(
    rows: int, layout: str
) -> None:
    rng = np.random.default_rng(rows)
    k, n = 72, 56
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    rhs = mx.array(w).T if layout == "x@w.T" else mx.array(np.ascontiguousarray(w.T))
    padded, out = _padded_during(lambda: np.array(mx.array(x) @ rhs))
    np.testing.assert_allclose(out, x @ w.T, rtol=1e-4, atol=1e-4)
    assert padded == (1 if PADDED[rows] and sgemm_rows.configured_pad() == 16 else 0)


@needs_openblas
def test_a_padded_product_of_a_strided_operand_is_the_same_product() -> None:
    """A product over every other row of a larger array (MLX passes such rows `lda` apart or
    copies them first; either way the padding must copy exactly the product's rows)."""
    rng = np.random.default_rng(11)
    big = rng.standard_normal((26, 2, 40), dtype=np.float32)
    w = rng.standard_normal((40, 30), dtype=np.float32)
    rows = mx.array(big)[:, 0, :]  # 26 rows, each 80 floats apart
    padded, out = _padded_during(lambda: np.array(rows @ mx.array(w)))
    np.testing.assert_allclose(out, big[:, 0, :] @ w, rtol=1e-4, atol=1e-4)
    assert padded == 1


@needs_openblas
@pytest.mark.parametrize("rows", [1, 3, 12])
def test_addmm_keeps_alpha_and_beta(rows: int) -> None:
    rng = np.random.default_rng(7)
    a = rng.standard_normal((rows, 64), dtype=np.float32)
    b = rng.standard_normal((64, 48), dtype=np.float32)
    c = rng.standard_normal((rows, 48), dtype=np.float32)
    before = sgemm_rows.gemv_products() + sgemm_rows.padded_products()
    out = np.array(mx.addmm(mx.array(c), mx.array(a), mx.array(b), alpha=0.5, beta=2.0))
    np.testing.assert_allclose(out, 0.5 * (a @ b) + 2.0 * c, rtol=1e-4, atol=1e-4)
    assert sgemm_rows.gemv_products() + sgemm_rows.padded_products() - before == 1


@needs_openblas
def test_a_batched_product_of_one_row_each_takes_gemv() -> None:
    """Attention's scores in a decode step: one query row a head, one product a head."""
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 1, 32), dtype=np.float32)
    keys = rng.standard_normal((2, 3, 40, 32), dtype=np.float32)
    sent, out = _products_during(
        lambda: np.array(mx.array(q) @ mx.array(keys).transpose(0, 1, 3, 2))
    )
    np.testing.assert_allclose(out, q @ keys.transpose(0, 1, 3, 2), rtol=1e-4, atol=1e-4)
    assert sent == 6


DECODE_STEP = """
import json, sys
from worker.mlx_cpu import blas, sgemm_rows
info = blas.preload_openblas()
import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
model, _ = load(sys.argv[1])
out = {"rows": info.gemv_rows, "pad": info.gemm_pad, "error": info.sgemm_rows_error}
for batch in (1, 3, 6, 12):
    cache = make_prompt_cache(model)
    prompt = mx.array(np.random.default_rng(batch).integers(5, 200, size=(batch, 12)))
    mx.eval(model(prompt, cache=cache))
    step = model(prompt[:, -1:], cache=cache)
    out[str(batch)] = np.array(step[:, -1, :]).tolist()
out["products"] = sgemm_rows.gemv_products()
out["padded"] = sgemm_rows.padded_products()
print(json.dumps(out))
"""


def _run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter (the routing is chosen before mlx loads), with `env` over
    this process's environment less the settings under test."""
    drop = ("MLXCEL_GEMV_ROWS", "MLXCEL_GEMM_PAD", "CC")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=REPO,
        env={**base, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )


def _decode(model_dir: Path, **env: str) -> dict[str, object]:
    return json.loads(_run(DECODE_STEP, str(model_dir), **env).stdout.strip().splitlines()[-1])


@needs_openblas
def test_a_decode_step_gives_the_same_logits_on_and_off(tiny_model_dir: Path) -> None:
    on = _decode(tiny_model_dir, MLXCEL_GEMV_ROWS="4", MLXCEL_GEMM_PAD="16")
    off = _decode(tiny_model_dir, MLXCEL_GEMV_ROWS="0", MLXCEL_GEMM_PAD="0")
    assert (on["rows"], on["pad"]) == (4, 16) and (off["rows"], off["pad"]) == (0, 0)
    assert off["error"] is None
    assert int(on["products"]) > 0 and int(on["padded"]) > 0
    assert off["products"] == 0 and off["padded"] == 0
    for batch in ("1", "3", "6", "12"):
        a, b = np.array(on[batch]), np.array(off[batch])
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        assert (a.argmax(-1) == b.argmax(-1)).all()


@needs_openblas
def test_without_a_compiler_the_path_is_off_and_says_why(tiny_model_dir: Path) -> None:
    result = _decode(tiny_model_dir, CC="/nonexistent/cc")
    assert result["rows"] == 0 and result["pad"] == 0
    assert result["products"] == 0 and result["padded"] == 0
    assert "no C compiler" in str(result["error"])


@needs_openblas
def test_set_pad_moves_awkward_counts_between_padded_and_not_at_once() -> None:
    x, w = mx.ones((12, 72)), mx.ones((72, 56))
    try:
        assert sgemm_rows.set_pad(0)
        padded, out = _padded_during(lambda: np.array(x @ w))
        assert padded == 0
        np.testing.assert_allclose(out, np.full((12, 56), 72.0))
        assert sgemm_rows.set_pad(16)
        padded, out = _padded_during(lambda: np.array(x @ w))
        assert padded == 1
        np.testing.assert_allclose(out, np.full((12, 56), 72.0))
    finally:
        sgemm_rows.set_pad(sgemm_rows.configured_pad())


def test_settings_read_counts_and_turn_off_on_nonsense(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(sgemm_rows.ROWS_ENV, raising=False)
    monkeypatch.delenv(sgemm_rows.PAD_ENV, raising=False)
    assert sgemm_rows.configured_rows() == sgemm_rows.DEFAULT_ROWS
    assert sgemm_rows.configured_pad() == sgemm_rows.DEFAULT_PAD
    monkeypatch.setenv(sgemm_rows.ROWS_ENV, "2")
    monkeypatch.setenv(sgemm_rows.PAD_ENV, "8")
    assert (sgemm_rows.configured_rows(), sgemm_rows.configured_pad()) == (2, 8)
    monkeypatch.setenv(sgemm_rows.ROWS_ENV, " Auto ")  # measured by a worker: 8 until then
    assert sgemm_rows.configured_rows() == sgemm_rows.DEFAULT_ROWS
    monkeypatch.setenv(sgemm_rows.ROWS_ENV, "lots")
    monkeypatch.setenv(sgemm_rows.PAD_ENV, "-3")
    assert (sgemm_rows.configured_rows(), sgemm_rows.configured_pad()) == (0, 0)


REPORT = """
import logging
from worker.mlx_cpu import blas
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
blas.report(logging.getLogger("t"))
"""


def _report_logs(**env: str) -> str:
    return _run(REPORT, **env).stderr


@needs_openblas
def test_the_worker_s_blas_report_names_both_paths_or_why_not() -> None:
    logs = _report_logs()
    assert "up to 8 rows go to gemv" in logs and "multiple of 16 is padded" in logs
    off = _report_logs(CC="/nonexistent/cc")
    assert "WARNING BLAS: every product goes to gemm as it is: no C compiler" in off
