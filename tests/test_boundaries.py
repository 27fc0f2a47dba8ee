"""The borders the design fixes: the router never imports MLX, the worker never imports FastAPI,
and shared/ imports neither. Checked statically (every import statement, lazy ones included) and
at run time (what importing the router's app actually loads)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "router": ("mlx", "mlx_lm", "worker"),
    "worker": ("fastapi", "starlette", "uvicorn", "router"),
    "shared": ("mlx", "mlx_lm", "fastapi", "starlette", "uvicorn", "router", "worker"),
}


def _imports(path: Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_crosses_a_border(package: str) -> None:
    bad = []
    for path in sorted((REPO / package).rglob("*.py")):
        for name in _imports(path):
            if name.split(".")[0] in FORBIDDEN[package]:
                bad.append(f"{path.relative_to(REPO)} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.pool
def test_router_app_loads_no_mlx_at_run_time() -> None:
    code = (
        "import sys, router.app, router.serve\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm'))\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == ""


def test_the_rq_keys_we_name_are_rqs_own() -> None:
    """shared.keys names rq's queue keys and job TTLs without importing rq's classes at each use
    site: its names must be rq's."""
    import redis
    from rq import Queue

    from shared import keys

    assert Queue.redis_queue_namespace_prefix == keys.RQ_QUEUE_PREFIX
    unconnected = redis.Redis()  # rq builds the key without a round trip
    queue = Queue("mlxcel:w:w1", connection=unconnected)
    assert keys.rq_queue_key("mlxcel:w:w1") == queue.key
    assert keys.rq_intermediate_key("mlxcel:w:w1") == queue.intermediate_queue_key
