"""A model directory the worker cannot serve stops `mlxcel-pool worker` at start with exit code 2
and a message naming the file and the field, never a worker that registers and fails every
request. Each bad directory is the tiny model's, copied and broken one way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import pytest
import redis

from shared import keys

REPO = Path(__file__).resolve().parent.parent


def _edit_config(d: Path, **changes: object) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _edit_weights(d: Path, drop: str | None = None, add: str | None = None) -> None:
    path = d / "model.safetensors"
    weights = dict(mx.load(str(path)))
    if drop:
        del weights[drop]
    if add:
        weights[add] = mx.zeros((4,))
    mx.save_safetensors(str(path), weights)


def _add_token(d: Path) -> None:
    tok = json.loads((d / "tokenizer.json").read_text())
    n = max(t["id"] for t in tok["added_tokens"])
    n = max(n, *tok["model"]["vocab"].values()) + 1
    tok["added_tokens"].append(
        {
            "id": n,
            "content": "<|extra|>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
    )
    (d / "tokenizer.json").write_text(json.dumps(tok))


# name -> (how to break the copy, what the message must name)
CASES: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "missing_config": (lambda d: (d / "config.json").unlink(), ("config.json", "is missing")),
    "unknown_model_type": (
        lambda d: _edit_config(d, model_type="no_such_arch"),
        ("config.json", "`model_type`", "'no_such_arch'", "not an architecture"),
    ),
    "no_model_type": (
        lambda d: _edit_config(d, model_type=None),
        ("config.json", "no `model_type` field"),
    ),
    "no_weights": (
        lambda d: (d / "model.safetensors").unlink(),
        ("no weights", "model*.safetensors"),
    ),
    "missing_weight": (
        lambda d: _edit_weights(d, drop="model.norm.weight"),
        ("model.safetensors", "1 weights missing", "'llama'", "model.norm.weight"),
    ),
    "extra_weight": (
        lambda d: _edit_weights(d, add="model.extra.weight"),
        ("model.safetensors", "1 extra weights", "model.extra.weight"),
    ),
    "tokenizer_too_big": (
        _add_token,
        ("tokenizer.json", "1025 tokens", "config.json", "`vocab_size` 1024"),
    ),
    "eos_out_of_range": (
        lambda d: _edit_config(d, eos_token_id=[1, 5000]),
        ("config.json", "eos token id 5000", "`eos_token_id`", "`vocab_size` 1024"),
    ),
}


@pytest.fixture
def bad_model_dir(tiny_model_dir: Path, tmp_path: Path) -> Callable[[str], Path]:
    def make(case: str) -> Path:
        d = tmp_path / f"bad-{case}"
        shutil.copytree(tiny_model_dir, d)
        CASES[case][0](d)
        return d

    return make


def _run_worker(redis_url: str, model_dir: Path, worker_id: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "MLXCEL_MODEL": str(model_dir),
        "MLXCEL_WORKER_ID": worker_id,
    }
    return subprocess.run(
        [sys.executable, "-m", "mlxcel_pool", "worker"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_model_dir_stops_the_worker(
    case: str, bad_model_dir: Callable[[str], Path], redis_url: str
) -> None:
    d = bad_model_dir(case)
    worker_id = f"bad-{case.replace('_', '-')}"
    done = _run_worker(redis_url, d, worker_id)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    error = [line for line in out.splitlines() if " ERROR " in line]
    assert len(error) == 1, out
    for words in CASES[case][1]:
        assert words in error[0], error[0]
    assert "Traceback" not in out
    # It never registered: no worker a router could send requests to.
    assert not redis.Redis.from_url(redis_url).exists(keys.worker_info(worker_id))


def test_missing_model_dir_stops_the_worker(tmp_path: Path, redis_url: str) -> None:
    done = _run_worker(redis_url, tmp_path / "nowhere", "bad-nowhere")
    assert done.returncode == 2, done.stderr
    assert f"model directory {tmp_path / 'nowhere'} does not exist" in done.stderr
