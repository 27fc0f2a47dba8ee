"""How a sequence's tokens end it: the model's EOS tokens and the request's `stop_token_ids`
(vLLM's `ignore_eos`, `min_tokens` and `stop_token_ids`), per sequence of the batch.

A token in `StopRule.ends` ends its sequence with finish_reason "stop" and is not part of the
output (no text, not a completion token), as an EOS always was. BatchGenerator finds it with
the sequence's own `StopSequences` (one single-token sequence per end), so a batch mixing rules
stops each row by its own. Before `min_tokens` completion tokens exist, the ends are masked to
-inf after every other processor but the grammar (vLLM's MinTokensLogitsProcessor), so no bias
or sampling draw can end the sequence early; stop strings wait for them too (TextStream).

With a grammar (response_format, a forced tool call) the grammar decides where the output ends:
once complete it allows only EOS, so EOS stays an end whatever `ignore_eos` says and is never
masked (a mask over the only allowed tokens would leave nothing to sample).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.generate import StopSequences

from shared.wire import GenerationRequest
from worker.engine.sampling import LogitsProcessor


@dataclass(frozen=True)
class StopRule:
    ends: frozenset[int]  # token ids that end the sequence (finish "stop", not in the output)
    held: frozenset[int]  # the ends masked while fewer than min_tokens completion tokens exist
    min_tokens: int = 0


def stop_rule(spec: GenerationRequest, eos: frozenset[int]) -> StopRule:
    constrained = spec.grammar is not None
    model_ends = eos if constrained or not spec.ignore_eos else frozenset()
    extra = frozenset(spec.stop_token_ids)
    held = extra | (frozenset() if constrained else model_ends)
    return StopRule(model_ends | extra, held if spec.min_tokens else frozenset(), spec.min_tokens)


@functools.lru_cache(maxsize=64)
def stop_sequences(ends: frozenset[int]) -> StopSequences:
    """BatchGenerator's matcher of `ends`, built once per distinct set (immutable: shared)."""
    return StopSequences([[t] for t in sorted(ends)] or None)


def min_tokens_mask(rule: StopRule, prompt_len: int, vocab_size: int) -> LogitsProcessor | None:
    """The processor that keeps `rule.held` from being sampled until `rule.min_tokens`
    completion tokens exist (`tokens` is the sequence so far: prompt, then completion); None
    when nothing is held."""
    held = sorted(t for t in rule.held if t < vocab_size)
    if not rule.min_tokens or not held:
        return None
    ids = mx.array(held, dtype=mx.int32)
    until = prompt_len + rule.min_tokens

    def mask(tokens: mx.array, logits: mx.array) -> mx.array:
        if tokens.shape[0] >= until:
            return logits
        logits[:, ids] = mx.array(-mx.inf, dtype=logits.dtype)
        return logits

    return mask
