"""worker.mlx_cpu.row_gemv: few-row float32 products through OpenBLAS's gemv, the same numbers.

The test process itself runs with the path on (conftest preloads with the default rows), so
the in-process cases check MLX's matmuls against numpy across every layout MLX hands BLAS; the
subprocess cases check the switch, the fallback without a compiler, and that a model's decode
step gives the same logits with the path on and off.
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

from worker.mlx_cpu import blas, row_gemv

REPO = Path(__file__).resolve().parents[1]

needs_openblas = pytest.mark.skipif(
    blas.preload_openblas().backend != "openblas", reason="the path interposes on OpenBLAS"
)


def _products_during(fn) -> tuple[int, object]:  # type: ignore[no-untyped-def]
    before = row_gemv.products()
    out = fn()
    return row_gemv.products() - before, out


@needs_openblas
def test_the_test_process_runs_with_the_path_on() -> None:
    info = blas.preload_openblas()
    assert info.gemv_rows == row_gemv.configured_rows() > 0, info.gemv_error


@needs_openblas
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])
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
    assert sent == (1 if rows <= row_gemv.configured_rows() else 0)


@needs_openblas
@pytest.mark.parametrize("rows", [1, 3])
def test_addmm_keeps_alpha_and_beta(rows: int) -> None:
    rng = np.random.default_rng(7)
    a = rng.standard_normal((rows, 64), dtype=np.float32)
    b = rng.standard_normal((64, 48), dtype=np.float32)
    c = rng.standard_normal((rows, 48), dtype=np.float32)
    sent, out = _products_during(
        lambda: np.array(mx.addmm(mx.array(c), mx.array(a), mx.array(b), alpha=0.5, beta=2.0))
    )
    np.testing.assert_allclose(out, 0.5 * (a @ b) + 2.0 * c, rtol=1e-4, atol=1e-4)
    assert sent == 1


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
from worker.mlx_cpu import blas, row_gemv
info = blas.preload_openblas()
import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache
model, _ = load(sys.argv[1])
out = {"rows": info.gemv_rows, "error": info.gemv_error}
for batch in (1, 3, 6):
    cache = make_prompt_cache(model)
    prompt = mx.array(np.random.default_rng(batch).integers(5, 200, size=(batch, 12)))
    mx.eval(model(prompt, cache=cache))
    step = model(prompt[:, -1:], cache=cache)
    out[str(batch)] = np.array(step[:, -1, :]).tolist()
out["products"] = row_gemv.products()
print(json.dumps(out))
"""


def _decode(model_dir: Path, **env: str) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k not in ("MLXCEL_GEMV_ROWS", "CC")}
    done = subprocess.run(
        [sys.executable, "-c", DECODE_STEP, str(model_dir)],
        cwd=REPO,
        env={**base, "PYTHONPATH": str(REPO), **env},
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_openblas
def test_a_decode_step_gives_the_same_logits_on_and_off(tiny_model_dir: Path) -> None:
    on = _decode(tiny_model_dir, MLXCEL_GEMV_ROWS="4")
    off = _decode(tiny_model_dir, MLXCEL_GEMV_ROWS="0")
    assert on["rows"] == 4 and off["rows"] == 0 and off["error"] is None
    assert int(on["products"]) > 0 and off["products"] == 0
    for batch in ("1", "3", "6"):
        a, b = np.array(on[batch]), np.array(off[batch])
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
        assert (a.argmax(-1) == b.argmax(-1)).all()


@needs_openblas
def test_without_a_compiler_the_path_is_off_and_says_why(tiny_model_dir: Path) -> None:
    result = _decode(tiny_model_dir, CC="/nonexistent/cc")
    assert result["rows"] == 0 and result["products"] == 0
    assert "no C compiler" in str(result["error"])


def test_rows_setting_reads_counts_and_turns_off_on_nonsense(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(row_gemv.ROWS_ENV, raising=False)
    assert row_gemv.configured_rows() == row_gemv.DEFAULT_ROWS
    monkeypatch.setenv(row_gemv.ROWS_ENV, "2")
    assert row_gemv.configured_rows() == 2
    monkeypatch.setenv(row_gemv.ROWS_ENV, "lots")
    assert row_gemv.configured_rows() == 0
