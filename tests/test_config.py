"""Configuration layering (defaults < environment < CLI flags), validation, and the trace rule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import ENV_VARS, ConfigError, load_settings, trace_enabled

REPO = Path(__file__).resolve().parent.parent


def test_defaults_load() -> None:
    s = load_settings(environ={})
    assert s.redis.url == ""
    assert s.router.port == 8000
    assert s.worker.batch_size == 32
    assert s.prompt_cache.trace is False
    assert s.multiproc_dir == s.cache_dir / "prom_multiproc"


def test_env_overrides_defaults() -> None:
    env = {
        "MLXCEL_PORT": "9001",
        "MLXCEL_BATCH_SIZE": "4",
        "APC_HASH": "blake2b",
        "MLXCEL_PROMPT_CACHE_ENABLED": "false",
        "REDIS_URL": "redis://h:1/0",
    }
    s = load_settings(environ=env)
    assert (s.router.port, s.worker.batch_size) == (9001, 4)
    assert s.prompt_cache.apc_hash == "blake2b"
    assert s.prompt_cache.enabled is False
    assert s.redis.url == "redis://h:1/0"


def test_cli_overrides_win_over_env() -> None:
    env = {"MLXCEL_PORT": "9001", "MLXCEL_WORKER_ID": "from-env"}
    s = load_settings(overrides={"router": {"port": 9002}, "worker": {"id": "w7"}}, environ=env)
    assert s.router.port == 9002
    assert s.worker.id == "w7"


def test_unset_cli_flag_keeps_env() -> None:
    s = load_settings(overrides={"router": {"port": None}}, environ={"MLXCEL_PORT": "9001"})
    assert s.router.port == 9001


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("MLXCEL_PORT", "eighty"),
        ("MLXCEL_BATCH_SIZE", "0"),
        ("APC_HASH", "md5"),
        ("REDIS_URL", "http://nope"),
        ("MLXCEL_WORKER_ID", "bad id"),
        ("MLXCEL_SERVER_DECODE_STORAGE", "sparse"),
    ],
)
def test_bad_env_value_names_the_variable(var: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(environ={var: value})
    assert var in str(info.value)
    section, key = ENV_VARS[var]
    assert f"{section}.{key}" in str(info.value)


def test_bad_cli_value_names_the_option() -> None:
    with pytest.raises(ConfigError, match="command-line option for router.port"):
        load_settings(overrides={"router": {"port": 70000}}, environ={})


@pytest.mark.parametrize(
    ("value", "on"),
    [
        ("1", True),
        ("true", False),
        ("yes", False),
        (" 1", False),
        ("1 ", False),
        ("0", False),
        ("", False),
        (None, False),
    ],
)
def test_apc_trace_exact_rule(value: str | None, on: bool) -> None:
    env = {} if value is None else {"MLXCEL_APC_TRACE": value}
    assert trace_enabled(env) is on
    assert load_settings(environ=env).prompt_cache.trace is on


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    return subprocess.run(
        [sys.executable, "-m", "mlxcel_pool", *args],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.pool
def test_worker_with_bad_env_exits_2_before_loading() -> None:
    proc = _cli(["worker"], {"REDIS_URL": "redis://127.0.0.1:1/0", "MLXCEL_BATCH_SIZE": "lots"})
    assert proc.returncode == 2, proc.stderr
    assert "MLXCEL_BATCH_SIZE" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.pool
def test_router_without_redis_url_exits_2() -> None:
    proc = _cli(["router"], {})
    assert proc.returncode == 2, proc.stderr
    assert "REDIS_URL is not set" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.pool
def test_cli_module_does_not_import_mlx() -> None:
    code = "import sys, mlxcel_pool.cli; sys.exit(int(any(m.startswith('mlx.') or m == 'mlx' "
    code += "for m in sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, timeout=60)
    assert proc.returncode == 0
