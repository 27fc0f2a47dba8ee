"""A sequence's first token in the step its prompt ends, where MLX computes on the CPU.

mlx-lm's generation batch runs a pass ahead: a step feeds the tokens sampled the step before,
starts the next forward pass with `mx.async_eval`, and only then returns the tokens it fed,
which is meant to overlap the host's work with a device's. On MLX's CPU stream `async_eval`
returns only near the end of the work it was given (bench/README.md, bench_first_token), so a
sequence's first token reached the engine a whole step after it was computed: after the next
decode pass, and after any prefill that step also ran.

Here the first tokens of a batch that joins the generation batch are read as it joins (its
sampling pass was started when mlx-lm built it) and returned in that step, ending the
sequences they end as mlx-lm's next step would have: by max_tokens or a stop sequence. The
rest join; the step that feeds them their first token returns it again, and that return is
dropped. No pass is added or moved, and every token reaches the engine no later than before.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch


class _FirstTokenBatch(GenerationBatch):
    """The generation batch. `first` holds the first-token responses of the batches that
    joined it in the generator's current step; `fed` the uids whose first token the step that
    feeds it will return again."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.first: list[GenerationBatch.Response] = []
        self.fed: set[int] = set()
        super().__init__(*args, **kwargs)

    def extend(self, batch: GenerationBatch) -> None:
        if batch.uids:
            self.first += self._first_tokens(batch)
        if batch.uids:  # unless every first token ended its sequence
            super().extend(batch)

    def _first_tokens(self, batch: GenerationBatch) -> list[GenerationBatch.Response]:
        """`batch`'s first tokens as GenerationBatch.next() would return them, and the
        sequences they end taken out of it: their KV covers the prompt, and their tokens are
        the prompt's (the token that ended them was never fed)."""
        mx.eval(batch._next_tokens, batch._next_logprobs)
        out, keep = [], []
        for i, token in enumerate(batch._next_tokens.tolist()):
            reason = None
            if batch._num_tokens[i] + 1 >= batch.max_tokens[i]:
                reason = "length"
            if copy.copy(batch._matchers[i]).advance(token):  # next() advances the real one
                reason = "stop"
            cache, tokens = None, None
            if reason is None:
                keep.append(i)
                self.fed.add(batch.uids[i])
            else:
                cache, tokens = batch.extract_cache(i), list(batch.tokens[i])
            logprobs = batch._next_logprobs[i]
            out.append(self.Response(batch.uids[i], token, logprobs, reason, cache, tokens))
        if len(keep) < len(batch.uids):
            batch.filter(keep)
        return out


class FirstTokenBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator whose step returns each sequence's first token in the step its
    prompt ends, and not again in the step after."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._generation_batch = _FirstTokenBatch.empty(self.model, self.sampler)

    def _next(self) -> tuple[list[Any], list[Any]]:
        batch = self._generation_batch
        assert isinstance(batch, _FirstTokenBatch)
        again, batch.fed = batch.fed, set()  # fed in this step: their first tokens come back
        prompt_responses, generation_responses = super()._next()
        if again:
            kept = [r for r in generation_responses if r.uid not in again]
            self._counters.generation_tokens -= len(generation_responses) - len(kept)
            generation_responses = kept
        first, batch.first = batch.first, []
        if first:  # the same decode steps as mlx-lm's (no pass moved), and each token once
            self._counters.generation_tokens += len(first)
            generation_responses = [*generation_responses, *first]
        return prompt_responses, generation_responses


def generator_class() -> type[BatchGenerator]:
    """The generator the engine runs (and the batch-invariance check and the benchmarks build
    as it does): this one where MLX computes on the CPU, mlx-lm's own elsewhere."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return FirstTokenBatchGenerator
    return BatchGenerator
