"""The model directory a worker or a router serves on this host: the configured one, checked to
exist, else the built-in model, built once per host in a subprocess (so the caller, a router
among them, never imports mlx) under the builder's lock file."""

from __future__ import annotations

import fcntl
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

from devmodel.paths import is_built
from shared.config import ConfigError, Settings
from shared.model_facts import configured_model_dir

# What a model directory holds that each part reads (in a missing directory's message).
WORKER_MODEL_FILES = "the model's whole directory (config.json, tokenizer files, weights)"
ROUTER_MODEL_FILES = "the model's config.json and tokenizer files (the weights are not needed)"


class ModelBuildError(RuntimeError):
    """Building the built-in model failed (the builder's output says why)."""


def ensure_model(
    settings: Settings,
    env: dict[str, str] | None = None,
    output: IO[Any] | None = None,
    needs: str = WORKER_MODEL_FILES,
) -> Path:
    """The model path a worker or a router serves: the configured one (it must exist here; the
    error names what to copy there, `needs`; what is in it the worker and the router check as
    they load it), else the built-in model, built in a subprocess
    when missing (its progress goes to `output`, default stderr), once per host however many
    processes ask at the same time (the builder's lock file)."""
    path = configured_model_dir(settings.model.path, settings.cache_dir).resolve()
    if settings.model.path:
        if not path.is_dir():
            raise ConfigError(
                f"model directory {path} does not exist on this host (MLXCEL_MODEL / --model): "
                f"copy {needs} there, or set MLXCEL_MODEL to where it is"
            )
        return path
    if is_built(path):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # devmodel.builder.ensure_model's lock: a worker building on its own waits for this build.
    with open(path.parent / f".{path.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not is_built(path):
                _build(path, env, output)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return path


def _build(path: Path, env: dict[str, str] | None, output: IO[Any] | None) -> None:
    out = output if output is not None else sys.stderr
    print(f"mlxcel-pool: building the default model into {path}", file=out, flush=True)
    argv = [sys.executable, "-m", "mlxcel_pool", "build-model", "--out", str(path)]
    rc = subprocess.run(argv, env=env, stdout=out, stderr=out, check=False).returncode
    if rc != 0 or not is_built(path):
        raise ModelBuildError(f"building the default model failed (exit {rc}): {' '.join(argv)}")
