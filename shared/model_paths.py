"""Where locally built default models live (both sides need the path; only the worker builds)."""

from __future__ import annotations

from pathlib import Path

DEFAULT_SIZE = "tiny"
DEFAULT_SEED = 0


def built_model_dir(cache_dir: Path, size: str = DEFAULT_SIZE, seed: int = DEFAULT_SEED) -> Path:
    return cache_dir / "models" / f"mlxcel-{size}-s{seed}"


def model_id_for(path: Path, configured_id: str = "") -> str:
    """The id clients send as `model`: the configured one, else the directory's name."""
    return configured_id or path.resolve().name
