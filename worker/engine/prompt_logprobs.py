"""Prompt logprobs (completions `echo` with `logprobs`): each prompt token's log-probability
given the tokens before it, with the k most likely alternatives at its position.

One forward pass over the prompt but its last token, outside the batch, with a fresh cache, in
chunks of `prefill_step_size` positions: each chunk's logits (positions x vocabulary) give the
entries of the tokens that follow them. The pass is also the request's prefill: its cache, which
then covers the prompt but its last token, is what the request starts decoding from, so the
prompt is computed once. It adopts nothing from the prompt cache (every position's logits are
wanted, and a cached prefix keeps no logits), and it runs whole, at admission, in the worker's
loop: the batch's running streams get no token until it ends (a batched prefill is spread over
steps, this pass is not), which takes the prompt's whole prefill plus the vocabulary-wide logits
and log-softmax of every position (a chunk's logits are `prefill_step_size x vocab` floats).

The numbers are the model's own log-softmax (no penalties, bias or grammar: those shape what
the request samples, not what the prompt was), which for neutral controls is exactly what a
greedy continuation reports for the same tokens.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from worker.engine.sampling import LogprobEntry, logprob_entries


def score_prompt(
    model: Any, prompt: list[int], top_k: int, chunk: int
) -> tuple[list[Any] | None, list[LogprobEntry]]:
    """(per-layer caches covering `prompt[:-1]`, one entry per token of `prompt[1:]`); (None,
    []) for a one-token prompt, whose only token has no logprob."""
    inputs = prompt[:-1]
    if not inputs:
        return None, []
    cache = make_prompt_cache(model)
    entries: list[LogprobEntry] = []
    for start in range(0, len(inputs), max(chunk, 1)):
        part = inputs[start : start + chunk]
        logits = model(mx.array([part]), cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = prompt[start + 1 : start + 1 + len(part)]
        entries += logprob_entries([(logprobs[i], t, top_k) for i, t in enumerate(targets)])
        mx.eval([c.state for c in cache])
    return cache, entries
