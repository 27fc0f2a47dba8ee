"""Per-request samplers for mlx-lm's BatchGenerator: greedy at temperature 0 (None: the batch's
shared greedy sampler runs as one call), else temperature / top-p with the request's own PRNG key,
so a seeded request samples the same tokens whatever else shares its batch."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p

Sampler = Callable[[mx.array], mx.array]


def make_request_sampler(temperature: float, top_p: float, seed: int | None) -> Sampler | None:
    if temperature <= 0:
        return None
    key = mx.random.key(seed if seed is not None else secrets.randbits(63))
    inv_temp = 1.0 / temperature

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < top_p < 1.0:
            logprobs = apply_top_p(logprobs, top_p)
        return mx.random.categorical(logprobs * inv_temp, key=sub)

    return sample
