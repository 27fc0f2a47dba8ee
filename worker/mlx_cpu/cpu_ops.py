"""Attention and SwiGLU for mlx-lm models on the CPU device, without MLX's slow CPU `exp`.

In the mlx CPU wheel `mx.exp` (and `sigmoid`, which uses it) is far slower than numpy's, while
`mx.power`, `add` and `matmul` are fast, so attention's softmax over (queries x keys) and SwiGLU's
sigmoid dominate a prefill (figures in bench/README.md). These versions compute 2**x with
`mx.power` (log2(e) folded into the scale), mask by adding a bias (converted once per pass, by
arithmetic rather than `where`), and divide by the softmax sum after the value matmul; they match
mlx-lm's own functions within the tolerances tests/test_cpu_ops.py checks. A prefill's large score
matrices go further: numpy computes their exp (`_exp_on_host`).

`install(model)` swaps them into the model's module (mlx-lm models call these module-level
names) when the model runs in float32 on the CPU; anything they do not handle (attention sinks,
quantized KV, additive float masks, other dtypes) goes to mlx-lm's own functions, and so does
work too small for them to pay (`MLX_BELOW`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import activations, base

log = logging.getLogger("mlxcel.worker.mlx_cpu")

LOG2E = 1.4426950408889634
_LOWEST = float(mx.finfo(mx.float32).min)
# A prefill's softmax goes to numpy (see `_exp_on_host`) from this many scores up; decode steps
# (one query a sequence) never do, so their graph stays lazy for mlx-lm's async eval.
HOST_SOFTMAX_MIN_QUERIES = 2
HOST_SOFTMAX_MIN_SCORES = 1 << 17
# Under this many scores (attention) or elements (SwiGLU), mlx-lm's own function is the faster:
# there are too few exps for `mx.power` to save what our extra ops cost a call (a decode step of
# a few sequences over a short context; bench/README.md has the crossover).
MLX_BELOW = 1 << 13
_mlx_sdpa = base.scaled_dot_product_attention
_mlx_swiglu = activations.swiglu


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `base.scaled_dot_product_attention`, for float32 on the CPU."""
    if (
        sinks is not None
        or hasattr(cache, "bits")
        or queries.dtype != mx.float32
        or not (mask is None or (isinstance(mask, str) and mask == "causal") or _bool_mask(mask))
    ):
        return _mlx_sdpa(queries, keys, values, cache, scale, mask, sinks)
    b, n_q_heads, n_q, dim = queries.shape
    n_kv_heads, n_k = keys.shape[1], keys.shape[2]
    n_scores = b * n_q_heads * n_q * n_k
    if n_scores < MLX_BELOW:
        return _mlx_sdpa(queries, keys, values, cache, scale, mask, sinks)
    group = n_q_heads // n_kv_heads
    on_host = n_q >= HOST_SOFTMAX_MIN_QUERIES and n_scores >= HOST_SOFTMAX_MIN_SCORES
    # Grouped-query heads share their KV head: one matmul per KV head, no repeated keys.
    scores = (queries * (scale if on_host else scale * LOG2E)).reshape(
        b, n_kv_heads, group * n_q, dim
    )
    scores = scores @ keys.swapaxes(-1, -2)
    if mask is not None:
        if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] not in (1, n_q_heads):
            return _mlx_sdpa(queries, keys, values, cache, scale, mask, sinks)
        bias = _bias(mask, n_q, n_k)
        if bias.ndim == 4:  # (b, 1 or q heads, q, k) -> the (kv head, group) split
            if bias.shape[1] == 1:
                bias = mx.expand_dims(bias, 2)
            else:
                bias = bias.reshape(bias.shape[0], n_kv_heads, group, n_q, n_k)
        scores = (scores.reshape(b, n_kv_heads, group, n_q, n_k) + bias).reshape(
            b, n_kv_heads, group * n_q, n_k
        )
    if on_host:
        weights, sums = _exp_on_host(scores)
    else:
        weights = mx.power(2.0, scores - mx.max(scores, axis=-1, keepdims=True))
        sums = mx.sum(weights, axis=-1, keepdims=True)
    out = (weights @ values) / sums
    return out.reshape(b, n_q_heads, n_q, dim)


def _exp_on_host(scores: mx.array) -> tuple[mx.array, mx.array]:
    """exp(scores - row max) and the row sums, computed by numpy in the scores' own buffer.

    numpy's vectorized exp beats `mx.power`, but it costs a synchronous eval per layer, which only
    a prefill's large score matrices repay; hence the thresholds above (bench/README.md).
    Writing in place is safe: `scores` is a fresh intermediate only this function holds.
    """
    mx.eval(scores)
    host = np.array(scores, copy=False)
    host -= host.max(axis=-1, keepdims=True)
    np.exp(host, out=host)
    return scores, mx.array(host.sum(axis=-1, keepdims=True))


# Every layer of one forward pass gets the same mask: convert it once (one entry is enough).
_bias_memo: tuple[Any, mx.array] | None = None


def _bias(mask: Any, n_q: int, n_k: int) -> mx.array:
    """The mask as an additive bias: 0 where attending, the lowest finite float where masked (not
    -inf: a row with every key masked, as left padding makes, then averages its values as mlx's
    own attention does, instead of turning into NaN). Arithmetic, not `where`, which is slower on
    the CPU."""
    global _bias_memo
    key = ("causal", n_q, n_k) if isinstance(mask, str) else mask
    if _bias_memo is not None:
        seen = _bias_memo[0]
        if seen is key or (isinstance(key, tuple) and isinstance(seen, tuple) and seen == key):
            return _bias_memo[1]
    if isinstance(mask, str):  # "causal": query i sits at position n_k - n_q + i
        mask = mx.arange(n_k - n_q, n_k)[:, None] >= mx.arange(n_k)[None]
    bias = (1.0 - mask.astype(mx.float32)) * _LOWEST
    _bias_memo = (key, bias)
    return bias


def _bool_mask(mask: Any) -> bool:
    return isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim in (2, 4)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x = gate * x / (1 + 2**(-gate * log2 e))."""
    if gate.dtype != mx.float32 or gate.size < MLX_BELOW:
        return _mlx_swiglu(gate, x)
    return gate * x / (1.0 + mx.power(2.0, gate * -LOG2E))


_REPLACEMENTS = {
    "scaled_dot_product_attention": (_mlx_sdpa, scaled_dot_product_attention),
    "swiglu": (_mlx_swiglu, swiglu),
}


def install(model: Any) -> list[str]:
    """Swap these in for the model's module when it runs float32 on the CPU; the names swapped."""
    if mx.default_device() != mx.cpu:
        return []
    dtypes = {p.dtype for _, p in tree_flatten(model.parameters())}
    if dtypes != {mx.float32}:
        return []
    module = sys.modules.get(type(model).__module__)
    swapped = []
    for name, (theirs, ours) in _REPLACEMENTS.items():
        if module is not None and getattr(module, name, None) is theirs:
            setattr(module, name, ours)
            swapped.append(name)
    if swapped:
        log.info("CPU ops: %s use pow-based exp in %s", ", ".join(swapped), module.__name__)
    return swapped
