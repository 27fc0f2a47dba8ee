"""Whether a model directory is an embedding model, and how its vectors are pooled.

The model's config.json decides: `"mlxcel_task": "embedding"` makes a worker started on it an
embedding worker; `"mlxcel_pooling"` is `mean` (default), `last` or `cls`, as llama.cpp's
`--pooling`. No mlx here: worker.main asks before it loads anything.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

from shared.embedding_wire import TASK_EMBEDDING


class Pooling(enum.StrEnum):
    MEAN = "mean"  # the mean of every token's last hidden state
    LAST = "last"  # the last token's (decoder embedding models: Qwen3-Embedding, e5-mistral)
    CLS = "cls"  # the first token's


class EmbeddingConfigError(ValueError):
    """config.json marks an embedding model but names a pooling this worker cannot do."""


@dataclass(frozen=True)
class EmbeddingTask:
    pooling: Pooling


def embedding_task(model_dir: Path) -> EmbeddingTask | None:
    """The model's embedding task, or None for a generation model (also for an unreadable
    config.json: the generation worker's own checks report that)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get("mlxcel_task") != TASK_EMBEDDING:
        return None
    raw = config.get("mlxcel_pooling", Pooling.MEAN.value)
    try:
        return EmbeddingTask(Pooling(raw))
    except ValueError:
        names = ", ".join(p.value for p in Pooling)
        raise EmbeddingConfigError(
            f"{model_dir}/config.json: mlxcel_pooling {raw!r} is not one of {names}"
        ) from None
