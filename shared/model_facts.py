"""What the router and the worker both need to know about a model, read from its directory in
one place so the two sides can never disagree: its id, context length and vocabulary size."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Used only when config.json names no context length (the caller logs it).
FALLBACK_CONTEXT = 4096
# In order of preference, as HF configs of the architectures mlx-lm loads spell it.
CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "n_positions",
    "seq_length",
)


class ModelConfigError(ValueError):
    """config.json is missing or unreadable."""


@dataclass(frozen=True)
class ModelFacts:
    model_id: str
    context_length: int
    vocab_size: int | None  # the embedding table's size; None when config.json names none
    context_from_config: bool  # False: FALLBACK_CONTEXT was assumed


def model_id_for(path: Path, configured_id: str = "") -> str:
    """The id clients send as `model`: the configured one, else the directory's name."""
    return configured_id or Path(path).resolve().name


def _sections(config: dict[str, Any]) -> list[dict[str, Any]]:
    # Multimodal configs nest the language model's settings under text_config.
    nested = config.get("text_config")
    return [config, nested] if isinstance(nested, dict) else [config]


def _positive_int(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for section in _sections(config):
        for key in keys:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def context_length_of(config: dict[str, Any]) -> int | None:
    """The model's context length as its config names it (top level first, then text_config)."""
    return _positive_int(config, CONTEXT_KEYS)


def vocab_size_of(config: dict[str, Any]) -> int | None:
    """The embedding table's size: it bounds valid token ids (it may exceed the tokenizer's)."""
    return _positive_int(config, ("vocab_size",))


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelConfigError(f"{path} does not hold a JSON object")
    return config


def model_facts(model_dir: Path, configured_id: str = "") -> ModelFacts:
    config = read_config(model_dir)
    context = context_length_of(config)
    return ModelFacts(
        model_id=model_id_for(model_dir, configured_id),
        context_length=context or FALLBACK_CONTEXT,
        vocab_size=vocab_size_of(config),
        context_from_config=context is not None,
    )


def configured_model_dir(model_path: str, cache_dir: Path) -> Path:
    """The model directory a process serves: the configured path, else the built-in model's
    (`devmodel.paths`); the same answer for the supervisor, the router and the worker."""
    from devmodel.paths import built_model_dir

    if model_path:
        return Path(model_path).expanduser()
    return built_model_dir(cache_dir)
