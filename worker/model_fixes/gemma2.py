"""Gemma 2's attention with a batch's mask (mlx-lm 0.32's `gemma2.Attention`).

With grouped-query heads (repeats > 1) mlx-lm's Gemma 2 attention splits the queries, and so the
scores, into (B, kv heads, repeats, L, K) but applies the mask as given, shaped (B, 1, L, K) for
a batch (`BatchKVCache.make_mask`): broadcasting lines the mask's batch axis up with the KV heads,
so three sequences or more raise in `broadcast_shapes` and two silently mask KV head i of both
with sequence i's padding. A single sequence's mask is (L, K) and broadcasts correctly.

`install(model)` gives each of the model's Gemma 2 attention layers a subclass whose `__call__`
inserts the repeats axis into a 4-D mask, (B, h, L, K) -> (B, kv heads, h // kv heads or 1, L, K),
before mlx-lm's own code runs; nothing else changes (gemma2 computes its attention inline, so
`cpu_ops.install`, which swaps module-level functions, leaves it alone either way).
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import mlx.core as mx

_MODULE = "mlx_lm.models.gemma2"


def with_repeats_axis(mask: Any, n_kv_heads: int, repeats: int) -> Any:
    """`mask` shaped to broadcast against scores split as (B, kv heads, repeats, L, K)."""
    if repeats <= 1 or not isinstance(mask, mx.array) or mask.ndim != 4:
        return mask
    b, heads, n_q, n_k = mask.shape
    if heads == 1:
        return mx.expand_dims(mask, 2)
    return mask.reshape(b, n_kv_heads, heads // n_kv_heads, n_q, n_k)


@functools.cache
def _fixed_attention(base: type) -> type:
    """The one subclass of mlx-lm's `gemma2.Attention` that reshapes its mask first."""

    class BatchMaskAttention(base):  # type: ignore[misc, valid-type]
        def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
            mask = with_repeats_axis(mask, self.n_kv_heads, self.repeats)
            return super().__call__(x, mask, cache)

    return BatchMaskAttention


def install(model: Any) -> int:
    """Fix every Gemma 2 attention layer in `model`; how many were fixed (0 for other models,
    and for one already fixed)."""
    module = sys.modules.get(_MODULE)
    if module is None:  # no Gemma 2 model has been built in this process
        return 0
    base = module.Attention
    fixed = _fixed_attention(base)
    n = 0
    for layer in model.modules():
        if type(layer) is base:
            layer.__class__ = fixed  # same layout: only the method lookup changes
            n += 1
    return n
