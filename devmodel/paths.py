"""Where the development models live and whether one is built: no mlx here, so the supervisor
and the router can ask without loading MLX. `devmodel.builder` writes what this module reads."""

from __future__ import annotations

import json
from pathlib import Path

# Bump when anything that changes the built files changes, so cached models get rebuilt.
BUILDER_VERSION = 2  # 2: the chat template renders tools and tool calls
BUILD_INFO_FILE = "mlxcel_build.json"
WEIGHTS_FILE = "model.safetensors"
DEFAULT_SIZE = "tiny"
DEFAULT_SEED = 0


def model_dir_name(size: str = DEFAULT_SIZE, seed: int = DEFAULT_SEED) -> str:
    return f"mlxcel-{size}-s{seed}"


def built_model_dir(cache_dir: Path, size: str = DEFAULT_SIZE, seed: int = DEFAULT_SEED) -> Path:
    """`<cache_dir>/models/mlxcel-<size>-s<seed>`: where `ensure_model` builds that model."""
    return Path(cache_dir) / "models" / model_dir_name(size, seed)


def is_built(model_dir: Path) -> bool:
    """True when `model_dir` holds a complete build from this builder version (the builder
    renames a finished build into place, so the info file exists only for a complete one)."""
    try:
        info = json.loads((Path(model_dir) / BUILD_INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info.get("builder_version") == BUILDER_VERSION and (model_dir / WEIGHTS_FILE).exists()
