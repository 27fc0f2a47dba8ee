"""The tiny built-in embedding model: the tiny Llama (devmodel.builder) under its own name, with
`"mlxcel_task": "embedding"` and its pooling in config.json, which is what makes a worker started
on it serve `/v1/embeddings` (worker/embedding/task.py) instead of generation.

Random float32 weights: its vectors mean nothing, but they are deterministic and cheap, so the
pool's embedding path is testable end to end on any machine.
"""

from __future__ import annotations

# This module imports mlx through the builder: preload OpenBLAS (worker.mlx_cpu.blas) first.
import fcntl
import json
from pathlib import Path

from devmodel.builder import build_model
from devmodel.paths import is_built, model_dir_name

EMBED_SIZE = "tiny"
EMBED_POOLING = "mean"


def embedding_model_dir(cache_dir: Path, seed: int = 0) -> Path:
    """`<cache_dir>/models/mlxcel-tiny-embed-s<seed>`: its directory name is its model id."""
    return Path(cache_dir) / "models" / model_dir_name(f"{EMBED_SIZE}-embed", seed)


def build_embedding_model(out_dir: Path, seed: int = 0, pooling: str = EMBED_POOLING) -> Path:
    """The tiny model built into `out_dir`, its config marked as an embedding model."""
    out = build_model(out_dir, EMBED_SIZE, seed)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.update({"mlxcel_task": "embedding", "mlxcel_pooling": pooling})
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def ensure_embedding_model(cache_dir: Path, seed: int = 0) -> Path:
    """The tiny embedding model's directory, built once across processes (as ensure_model)."""
    model_dir = embedding_model_dir(cache_dir, seed)
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    if _is_embedding_build(model_dir):
        return model_dir
    with open(model_dir.parent / f".{model_dir.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not _is_embedding_build(model_dir):
                build_embedding_model(model_dir, seed)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return model_dir


def _is_embedding_build(model_dir: Path) -> bool:
    # The config is marked after the build is renamed into place: an unmarked one is rebuilt.
    if not is_built(model_dir):
        return False
    try:
        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return config.get("mlxcel_task") == "embedding"
