"""Per-request sampling for mlx-lm's BatchGenerator, which takes one sampler and one list of
logits processors per sequence: each request's controls apply to its own row of the batch while
the other rows use theirs.

At each step a sequence's logits go through, in order:

1. its logits processors (`make_logits_processors`), over the sequence's own tokens as
   BatchGenerator passes them (prompt and generated so far, never another sequence's):
   `repetition_penalty` over the prompt and the completion (HF transformers' and vLLM's rule:
   a seen token's logit is divided by the penalty when positive, multiplied when negative),
   then `frequency_penalty` (minus the penalty per occurrence) and `presence_penalty` (minus it
   once) over the completion only (OpenAI's and vLLM's rule), then `logit_bias` (added last, so
   +100 forces a token and -100 bans it whatever the penalties did); with `min_tokens` the
   engine appends the mask of the tokens that would end the sequence early
   (worker/engine/stopping.py), and with a response_format its grammar's mask after them all
   (worker/engine/grammar.py), so no bias can bring back a token the grammar bans;
2. a log-softmax: THE DISTRIBUTION THAT LOGPROBS REPORT (BatchGenerator's `Response.logprobs`).
   It is the model's distribution after this request's processors and before temperature and
   top-k/top-p/min-p truncation; with neutral penalties and no bias it is exactly the model's
   own log-softmax, which is what OpenAI and vLLM report by default, and greedy decoding takes
   its argmax. (A truncated, tempered distribution would make every greedy logprob 0.)
3. its sampler (`make_request_sampler`): greedy at temperature 0 (None: the batch's shared
   greedy sampler, one call for every greedy row); else temperature first, then top-k, top-p and
   min-p on the tempered distribution (the order of HF transformers and vLLM), then a categorical
   draw with the request's own PRNG key, so a seeded request samples the same tokens whatever
   else shares its batch.

A request with neutral values gets no processors and (greedy) no sampler: its path through the
batch is the one it took before these controls existed, token for token.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from shared.wire import LOGPROB_FLOOR, GenerationRequest

Sampler = Callable[[mx.array], mx.array]
# (the sequence's tokens so far as an int array, logits of shape (1, vocab)) -> logits
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def make_request_sampler(spec: GenerationRequest, vocab_size: int) -> Sampler | None:
    """The request's sampler; None for greedy (temperature 0: truncation cannot change an
    argmax, and the seed has nothing to draw)."""
    if spec.temperature <= 0:
        return None
    key = mx.random.key(spec.seed if spec.seed is not None else secrets.randbits(63))
    inv_temp = 1.0 / spec.temperature
    top_k = spec.top_k if 0 < spec.top_k < vocab_size else 0  # >= vocab keeps every token
    top_p, min_p = spec.top_p, spec.min_p

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        # Scaled log-probabilities are unnormalized; every filter below compares within a row
        # (top-p normalizes its own mass), and the categorical draw takes logits.
        logits = logprobs * inv_temp if inv_temp != 1.0 else logprobs
        if top_k:
            logits = apply_top_k(logits, top_k)
        if 0 < top_p < 1.0:
            logits = apply_top_p(logits, top_p)
        if min_p > 0:
            logits = apply_min_p(logits, min_p)
        return mx.random.categorical(logits, key=sub)

    return sample


def make_logits_processors(spec: GenerationRequest) -> list[LogitsProcessor]:
    """The request's processors, in the order the module docstring gives; empty when every
    control is neutral. `tokens` is the whole sequence so far; the completion is what follows
    the request's prompt."""
    processors: list[LogitsProcessor] = []
    prompt_len = len(spec.prompt_tokens)
    rep = spec.repetition_penalty
    if rep != 1.0:

        def repetition(tokens: mx.array, logits: mx.array) -> mx.array:
            seen = logits[:, tokens]  # repeats read and write the same value
            logits[:, tokens] = mx.where(seen < 0, seen * rep, seen / rep)
            return logits

        processors.append(repetition)
    freq, pres = spec.frequency_penalty, spec.presence_penalty
    if freq or pres:

        def penalties(tokens: mx.array, logits: mx.array) -> mx.array:
            if tokens.shape[0] <= prompt_len:
                return logits  # nothing generated yet
            generated = tokens[prompt_len:]
            if freq:
                logits = logits.at[:, generated].subtract(freq)  # once per occurrence
            if pres:
                logits[:, generated] = logits[:, generated] - pres  # once per distinct token
            return logits

        processors.append(penalties)
    if spec.logit_bias:
        ids = mx.array(list(spec.logit_bias), dtype=mx.int32)
        values = mx.array(list(spec.logit_bias.values()), dtype=mx.float32)

        def bias(tokens: mx.array, logits: mx.array) -> mx.array:
            return logits.at[:, ids].add(values.astype(logits.dtype))

        processors.append(bias)
    return processors


def apply_processors(
    processors: list[LogitsProcessor], tokens: list[int], logits: mx.array
) -> mx.array:
    """Run `processors` as BatchGenerator does, for a step the engine computes itself."""
    if processors:
        context = mx.array(tokens, dtype=mx.int32)
        for processor in processors:
            logits = processor(context, logits)
    return logits


# One sampled token's logprob entry, as StreamEvent.logprobs carries it.
LogprobEntry = list  # [logprob, [top ids], [top logprobs]]


def logprob_entries(rows: list[tuple[mx.array, int, int]]) -> list[LogprobEntry]:
    """For each (log-probabilities over the vocab, sampled token, k): the sampled token's
    logprob and the k most likely tokens with theirs (most likely first, ties by id), all rows
    evaluated in one go. A logprob below LOGPROB_FLOOR (or -inf, or NaN) is the floor."""
    if not rows:
        return []
    stacked = mx.stack([lp.reshape(-1) for lp, _, _ in rows]).astype(mx.float32)
    tokens = mx.array([t for _, t, _ in rows], dtype=mx.int32)
    chosen = mx.take_along_axis(stacked, tokens[:, None], axis=-1)[:, 0]
    k = min(max(k for _, _, k in rows), stacked.shape[-1])
    if k > 0:
        top_ids = mx.argpartition(-stacked, kth=k - 1, axis=-1)[:, :k]
        top_lps = mx.take_along_axis(stacked, top_ids, axis=-1)
        mx.eval(chosen, top_ids, top_lps)
        ids_rows, lps_rows = top_ids.tolist(), top_lps.tolist()
    else:
        mx.eval(chosen)
        ids_rows = lps_rows = [[] for _ in rows]
    out: list[LogprobEntry] = []
    for (_, _, want), lp, ids, lps in zip(rows, chosen.tolist(), ids_rows, lps_rows, strict=True):
        ranked = sorted(zip(ids, map(_floor, lps), strict=True), key=lambda p: (-p[1], p[0]))
        ranked = ranked[:want]
        out.append([_floor(lp), [i for i, _ in ranked], [v for _, v in ranked]])
    return out


def _floor(value: float) -> float:
    return value if value >= LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN fails the comparison
