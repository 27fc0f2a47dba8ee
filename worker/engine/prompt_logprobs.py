"""Prompt logprobs (completions `echo` with `logprobs`): each prompt token's log-probability
given the tokens before it, with the k most likely alternatives at its position.

A forward pass over the prompt but its last token, outside the batch, with a fresh cache: each
chunk of positions' logits (positions x vocabulary) give the entries of the tokens that follow
them (`score_chunk`). The pass is also the request's prefill: its cache, which then covers the
prompt but its last token, is what the request starts decoding from, so the prompt is computed
once. It adopts nothing from the prompt cache (every position's logits are wanted, and a cached
prefix keeps no logits). The engine runs it a chunk a step beside the batch's decode step
(worker/engine/scoring.py), so running streams pause by one chunk, not by the whole prompt;
`score_prompt` is the same pass run whole.

The numbers are the model's own log-softmax (no penalties, bias or grammar: those shape what
the request samples, not what the prompt was), which for neutral controls is exactly what a
greedy continuation reports for the same tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from worker.engine.sampling import LogprobEntry, logprob_entries


def score_chunk(
    model: Any, cache: list[Any], prompt: list[int], start: int, count: int, top_k: int
) -> list[LogprobEntry]:
    """Run positions [start, start + count) of `prompt` through the model on `cache` (which
    covers exactly `prompt[:start]`) and return the entries of `prompt[start + 1 :][:count]`;
    the cache then covers `prompt[: start + count]` and is evaluated."""
    part = prompt[start : start + count]
    logits = model(mx.array([part]), cache=cache)[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    targets = prompt[start + 1 : start + 1 + len(part)]
    entries = logprob_entries([(logprobs[i], t, top_k) for i, t in enumerate(targets)])
    mx.eval([c.state for c in cache])
    return entries


def score_prompt(
    model: Any, prompt: list[int], top_k: int, chunk: int
) -> tuple[list[Any] | None, list[LogprobEntry]]:
    """The whole pass at once, in chunks of `chunk` positions: (per-layer caches covering
    `prompt[:-1]`, one entry per token of `prompt[1:]`); (None, []) for a one-token prompt,
    whose only token has no logprob."""
    inputs = len(prompt) - 1
    if inputs <= 0:
        return None, []
    cache = make_prompt_cache(model)
    entries: list[LogprobEntry] = []
    step = max(chunk, 1)
    for start in range(0, inputs, step):
        entries += score_chunk(model, cache, prompt, start, min(step, inputs - start), top_k)
    return cache, entries
