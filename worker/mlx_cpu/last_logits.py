"""Logits for the last position only, where the model's head allows it.

A warm request's remainder pass needs one row of logits, but mlx-lm's `Model.__call__` applies the
vocabulary head to every position (MLX computes the whole matmul even when only a slice is
used). For models whose `__call__` is exactly "inner model, then lm_head or tied embeddings",
this applies the head to the last hidden row alone: a warm pass then computes one row of the
vocabulary-wide matmul, not one per new token. Any other model (soft-capped logits, extra
scaling, ...) goes through its own `__call__`.
"""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx

# mlx-lm architectures whose Model.__call__ is the plain head (checked against their source).
_PLAIN_HEAD_MODULES = ("llama", "qwen2", "qwen3")


def _plain_head_calls() -> frozenset[Any]:
    calls = set()
    for name in _PLAIN_HEAD_MODULES:
        try:
            module = importlib.import_module(f"mlx_lm.models.{name}")
        except ImportError:
            continue
        calls.add(module.Model.__call__)
    return frozenset(calls)


_PLAIN_HEAD_CALLS = _plain_head_calls()


def last_logits(model: Any, tokens: mx.array, cache: list[Any]) -> mx.array:
    """Logits (batch, vocab) of the last position of `tokens` run over `cache`."""
    if type(model).__call__ not in _PLAIN_HEAD_CALLS:
        return model(tokens, cache=cache)[:, -1, :]
    hidden = model.model(tokens, cache)[:, -1:, :]
    if model.args.tie_word_embeddings:
        return model.model.embed_tokens.as_linear(hidden)[:, -1, :]
    return model.lm_head(hidden)[:, -1, :]
