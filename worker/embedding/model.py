"""The pooled forward pass: token lists in, one L2-normalized float32 vector per list out.

What llama.cpp's server does for `--embedding --pooling mean|last|cls` on a decoder: run the
model's backbone (mlx-lm's model class without its LM head, so its last hidden states after the
final norm), pool them per sequence, normalize. A batch is right-padded: attention is causal,
so a real token never sees the padding after it and its hidden state is the one it has alone;
pooling reads only each sequence's own positions.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from worker.embedding.task import Pooling

# A norm below this is taken as this: a zero vector stays zero instead of becoming NaN.
MIN_NORM = 1e-12


def backbone_of(model: Any) -> Any:
    """mlx-lm's model without its LM head: `model.model` (the decoder stack and final norm), or
    a multimodal wrapper's language model's."""
    inner = getattr(model, "model", None)
    if inner is None and hasattr(model, "language_model"):
        inner = getattr(model.language_model, "model", None)
    if inner is None or not callable(inner):
        raise TypeError(f"{type(model).__name__} has no backbone (`.model`) to embed with")
    return inner


class EmbeddingModel:
    """An mlx-lm model used for embeddings; `embed` is the whole computation."""

    def __init__(self, model: Any, pooling: Pooling, dimensions: int) -> None:
        self.backbone = backbone_of(model)
        self.pooling = pooling
        self.dimensions = dimensions

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """The pooled, L2-normalized vectors of `batch` (shape [len(batch), dimensions]).
        Every list must be non-empty and hold valid token ids (the caller checks)."""
        lengths = [len(tokens) for tokens in batch]
        width = max(lengths)
        padded = np.zeros((len(batch), width), dtype=np.int32)  # id 0 pads: never read
        for row, tokens in enumerate(batch):
            padded[row, : len(tokens)] = tokens
        hidden = self.backbone(mx.array(padded)).astype(mx.float32)
        pooled = _pool(hidden, np.asarray(lengths), self.pooling)
        norms = mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), MIN_NORM)
        out = pooled / norms
        mx.eval(out)
        return np.array(out, dtype=np.float32)


def _pool(hidden: mx.array, lengths: np.ndarray, pooling: Pooling) -> mx.array:
    if pooling is Pooling.CLS:
        return hidden[:, 0, :]
    if pooling is Pooling.LAST:
        return hidden[mx.arange(hidden.shape[0]), mx.array(lengths - 1), :]
    positions = np.arange(hidden.shape[1])[None, :] < lengths[:, None]
    mask = mx.array(positions.astype(np.float32))[:, :, None]
    return (hidden * mask).sum(axis=1) / mx.array(lengths.astype(np.float32))[:, None]
