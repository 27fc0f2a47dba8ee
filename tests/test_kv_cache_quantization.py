"""mlx-lm's KV cache quantization settings exist, but only their defaults (off) are accepted: any
other value stops the process at start (exit 2) with one line naming the setting and why, because
mlx-lm's BatchGenerator, which runs every sequence, cannot batch a quantized KV cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.config import ENV_VARS, ConfigError, WorkerConfig, load_settings

REPO = Path(__file__).resolve().parent.parent
WHY = "mlx-lm's BatchGenerator cannot batch a quantized KV cache"
KV_VARS = {
    "MLXCEL_KV_BITS": ("kv_bits", "4"),
    "MLXCEL_KV_GROUP_SIZE": ("kv_group_size", "32"),
    "MLXCEL_QUANTIZED_KV_START": ("quantized_kv_start", "0"),
}


def test_mlx_lm_cannot_batch_a_quantized_cache() -> None:
    """The claim the refusal rests on; this fails once mlx-lm can batch one, to revisit it."""
    from mlx_lm.generate import _merge_caches
    from mlx_lm.models.cache import QuantizedKVCache

    assert not hasattr(QuantizedKVCache, "merge")
    with pytest.raises(ValueError, match="does not yet support batching"):
        _merge_caches([[QuantizedKVCache(group_size=64, bits=4)] for _ in range(2)])


def test_defaults_keep_the_cache_unquantized() -> None:
    w = load_settings(environ={}).worker
    assert (w.kv_bits, w.kv_group_size, w.quantized_kv_start) == (0, 64, 5000)
    # The defaults named explicitly are accepted too.
    env = {"MLXCEL_KV_BITS": "0", "MLXCEL_KV_GROUP_SIZE": "64", "MLXCEL_QUANTIZED_KV_START": "5000"}
    assert load_settings(environ=env).worker == w


@pytest.mark.parametrize("var", sorted(KV_VARS))
def test_a_non_default_value_is_a_configuration_error(var: str) -> None:
    field, value = KV_VARS[var]
    assert ENV_VARS[var] == ("worker", field)
    with pytest.raises(ConfigError) as err:
        load_settings(environ={var: value})
    (line,) = [ln for ln in str(err.value).splitlines() if f"worker.{field}:" in ln]
    assert WHY in line and f"environment variable {var}={value!r}" in line


def test_worker_config_refuses_kv_bits_directly() -> None:
    with pytest.raises(ValueError, match="cannot batch a quantized KV cache"):
        WorkerConfig(kv_bits=8)


def test_worker_with_kv_bits_exits_2(redis_url: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "MLXCEL_MODEL": str(tmp_path),
        "MLXCEL_WORKER_ID": "kvq",
        "MLXCEL_KV_BITS": "4",
    }
    done = subprocess.run(
        [sys.executable, "-m", "mlxcel_pool", "worker"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    (line,) = [ln for ln in done.stderr.splitlines() if "worker.kv_bits" in ln]
    assert WHY in line and "MLXCEL_KV_BITS='4'" in line
