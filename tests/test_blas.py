"""worker.mlx_cpu.blas: OpenBLAS preload must happen before mlx.core is imported.

Each case runs in a fresh interpreter, because whether mlx is already imported is the point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parents[1]

# Any of these present means preload_openblas() must find one on this machine.
KNOWN_OPENBLAS = [
    Path(d) / name
    for d in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu")
    for name in ("openblas-pthread/libopenblas.so.0", "libopenblas.so.0")
]

PRELOAD_THEN_IMPORT = """
import json
from worker.mlx_cpu import blas
info = blas.preload_openblas()
assert blas.preload_openblas() is info  # idempotent
import mlx.core
print(json.dumps({"path": info.path, "too_late": info.too_late, "backend": info.backend,
                  "gflops": blas.measure_matmul_gflops()}))
"""

IMPORT_THEN_PRELOAD = """
import json
import mlx.core
from worker.mlx_cpu import blas
info = blas.preload_openblas()
print(json.dumps({"path": info.path, "too_late": info.too_late, "backend": info.backend}))
"""

REPORT = """
import logging
from worker.mlx_cpu import blas
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
blas.report(logging.getLogger("blas-test"))
"""


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    # Drop any override from the caller's shell so each test controls it explicitly.
    base = {k: v for k, v in os.environ.items() if k != "MLXCEL_OPENBLAS_PATH"}
    full_env = {**base, "PYTHONPATH": str(REPO), **env}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def _json(code: str, **env: str) -> dict[str, object]:
    return json.loads(_run(code, **env).stdout.strip().splitlines()[-1])


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")
def test_preload_before_import_loads_openblas() -> None:
    result = _json(PRELOAD_THEN_IMPORT)
    assert result["too_late"] is False
    if any(p.exists() for p in KNOWN_OPENBLAS):
        assert result["backend"] == "openblas"
        assert result["path"] and Path(str(result["path"])).exists()
    gflops = result["gflops"]
    assert isinstance(gflops, float) and gflops > 0


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")
def test_preload_after_mlx_import_is_too_late() -> None:
    result = _json(IMPORT_THEN_PRELOAD)
    assert result == {"path": None, "too_late": True, "backend": "reference"}


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")
def test_env_override_takes_precedence() -> None:
    existing = [p for p in KNOWN_OPENBLAS if p.exists()]
    if not existing:
        pytest.skip("no OpenBLAS on this machine")
    chosen = existing[-1]  # not the default first choice, so the override is what picked it
    result = _json(PRELOAD_THEN_IMPORT, MLXCEL_OPENBLAS_PATH=str(chosen))
    assert result["path"] == str(chosen)


def test_missing_override_falls_back_without_raising() -> None:
    result = _json(PRELOAD_THEN_IMPORT, MLXCEL_OPENBLAS_PATH="/nonexistent/libopenblas.so.0")
    assert result["too_late"] is False
    assert result["path"] != "/nonexistent/libopenblas.so.0"


def test_report_logs_speed() -> None:
    logs = _run(REPORT).stderr
    assert "INFO BLAS:" in logs and "GFLOPS" in logs


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")
def test_report_warns_loudly_when_too_late() -> None:
    logs = _run("import mlx.core\n" + REPORT).stderr
    assert "WARNING" in logs
    assert "apt-get install libopenblas0-pthread" in logs
    assert "make openblas" in logs


THREAD_TIMEOUT = """
import os
from worker.mlx_cpu import blas
blas.preload_openblas()
print(os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
"""


def _last_line(code: str, env: dict[str, str]) -> str:
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS uses Accelerate")
def test_preload_sets_a_short_openblas_spin_unless_the_operator_set_one() -> None:
    base = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    base["PYTHONPATH"] = str(REPO)
    assert _last_line(THREAD_TIMEOUT, base) == "20"
    assert _last_line(THREAD_TIMEOUT, {**base, "OPENBLAS_THREAD_TIMEOUT": "25"}) == "25"
