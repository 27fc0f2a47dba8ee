"""A sequence's first token in the step its prompt ends, where MLX computes on the CPU.

mlx-lm's generation batch runs a pass ahead: a step feeds the tokens sampled the step before,
starts the next forward pass with `mx.async_eval`, and only then returns the tokens it fed,
which is meant to overlap the host's work with a device's. On MLX's CPU stream `async_eval`
returns only near the end of the work it was given (bench/README.md, bench_first_token), so a
sequence's first token reached the engine a whole step after it was computed: after the next
decode pass, and after any prefill that step also ran.

mlx-lm also holds a prompt's last token back from its prefill and moves the sequence into the
generation batch (a pass over that token, which samples the first) only at the start of the next
step, after that step's decode pass: a step late again.

Here a sequence joins the generation batch in the step its prefill ends (mlx-lm's own split,
run at that step's end), and the first tokens of a batch that joins are read as it joins (its
sampling pass was started when mlx-lm built it) and returned in that step, ending the
sequences they end as mlx-lm's next step would have: by max_tokens or a stop sequence. The
rest join; the step that feeds them their first token returns it again, and that return is
dropped. No pass is added: a sequence's first token comes two steps sooner than mlx-lm's and
every other token one step sooner, the same tokens. A lone cold prompt that fits one prefill
chunk, with nothing else to run, is prefilled with its last token and sampled from that pass:
a pass fewer.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import KVCache

from worker.engine.shared_prompt import prompt_kv_copies
from worker.mlx_cpu.last_logits import last_logits


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
        # uid -> (caches, tokens) at the prompt's end, its last token aside, of the sequences
        # that joined the generation batch in this step (see extract_cache): lazy slices of the
        # prompt batch's arrays, which they keep alive until the next step.
        self._prompt_ends: dict[int, tuple[list[Any], list[int]]] = {}
        self.folded = 0  # lone prompts prefilled with their last token (a pass fewer each)

    def _next(self) -> tuple[list[Any], list[Any]]:
        batch = self._generation_batch
        assert isinstance(batch, _FirstTokenBatch)
        again, batch.fed = batch.fed, set()  # fed in this step: their first tokens come back
        self._prompt_ends = {}
        folded = self._fold_lone_prompt()
        if folded:  # nothing else ran: the generation batch was empty, no other prompt waited
            first, batch.first = batch.first, []
            self._counters.generation_tokens += len(first)
            return folded, first
        prompt_responses, generation_responses = super()._next()
        prompt_responses += self._start_ended_prompts()
        if again:
            kept = [r for r in generation_responses if r.uid not in again]
            self._counters.generation_tokens -= len(generation_responses) - len(kept)
            generation_responses = kept
        first, batch.first = batch.first, []
        if first:  # the same decode steps as mlx-lm's (no pass moved), and each token once
            self._counters.generation_tokens += len(first)
            generation_responses = [*generation_responses, *first]
        return prompt_responses, generation_responses

    def _start_ended_prompts(self) -> list[PromptProcessingBatch.Response]:
        """The sequences this step's prefill left with their last token alone join the
        generation batch now, as mlx-lm's next step would have them join before anything else
        (its split, word for word): their first tokens come in this step, not after the next
        step's decode pass and prefill. Their prompt-end responses come with this step's."""
        split = [
            i
            for i, seq in enumerate(self._currently_processing)
            if len(seq[0]) == 1 and len(seq[0][0]) == 1
        ]
        if not split or len(self._generation_batch) >= self.completion_batch_size:
            return []
        chosen = set(split)
        batch = self._prompt_batch
        self._prompt_ends = {
            batch.uids[i]: (batch.extract_cache(i), list(batch.tokens[i])) for i in split
        }
        last_inputs = [self._currently_processing[i][0][0] for i in split]
        progress = [(self._currently_processing[i][2],) * 2 for i in split]
        self._currently_processing = [
            seq for i, seq in enumerate(self._currently_processing) if i not in chosen
        ]
        gen_batch = batch.split(split).generate(last_inputs)
        responses = [
            PromptProcessingBatch.Response(gen_batch.uids[i], p, True, True)
            for i, p in enumerate(progress)
        ]
        self._generation_batch.extend(gen_batch)
        return responses

    def _fold_lone_prompt(self) -> list[PromptProcessingBatch.Response]:
        """A lone cold prompt, with nothing decoding and nothing else waiting, that fits one
        prefill chunk: one pass over all of it, its last token included, and its first token
        sampled from that pass's last row, instead of mlx-lm's prefill of all but the last
        token and a pass of its own over that one. The sequence joins the generation batch as
        mlx-lm's split makes it (the same sampler, processors and stop rules; its first step
        given the pass's logits), and the responses are those mlx-lm's two steps give: the
        prefill's end of segment, then the prompt's end. Only plain KV caches: their state at
        the prompt's end but its last token is a slice (extract_cache)."""
        if len(self._generation_batch) or len(self._prompt_batch):
            return []
        if len(self._unprocessed_sequences) != 1:
            return []
        _, segments, _, caches, cached, *_ = self._unprocessed_sequences[0]
        if (
            cached
            or len(segments) != 2
            or len(segments[1]) != 1
            or len(segments[0]) + 1 > self.prefill_step_size
            or any(type(c) is not KVCache or c.offset for c in caches)
        ):
            return []
        batch = self._make_batch(1)
        seq = self._currently_processing.pop()
        head, last = seq[0]
        total = seq[2]
        batch.tokens[0] += head  # what the KV holds but the last token (the first step adds it)
        self._counters.prompt_tokens += len(head)
        logits = last_logits(self.model, mx.array([head + last]), batch.prompt_cache)
        held = prompt_kv_copies([c.extract(0) for c in batch.prompt_cache], len(head), 1)
        assert held is not None  # plain KV caches, holding the whole prompt
        joining = GenerationBatch(
            _Given(logits),
            batch.uids,
            mx.array(last),
            batch.prompt_cache,
            batch.tokens,
            batch.samplers,
            batch.fallback_sampler,
            batch.logits_processors,
            batch.stop_sequences,
            batch.max_tokens,
        )
        joining.model = self.model
        uid = joining.uids[0]
        self._prompt_ends = {uid: (held[0], list(head))}
        self._generation_batch.extend(joining)
        self.folded += 1
        return [
            PromptProcessingBatch.Response(uid, (total - 1, total), True, False),
            PromptProcessingBatch.Response(uid, (total, total), True, True),
        ]

    def extract_cache(self, uids: Any) -> dict[int, Any]:
        """mlx-lm's, but a sequence that joined the generation batch in this step answers, until
        the next step, with its state where mlx-lm's would still hold it in this step: at the
        prompt's end but its last token (what the engine keeps as a prefill checkpoint and
        copies for a request's group-mates, whatever the cache's kind)."""
        found = super().extract_cache(uids)
        for uid in uids:
            if uid in self._prompt_ends:
                found[uid] = self._prompt_ends[uid]
        return found


class _Given:
    """A joining batch's model for its first step only: the logits a pass already computed
    (the KV cache holds that pass's tokens)."""

    def __init__(self, logits: mx.array) -> None:
        self._logits = logits

    def __call__(self, inputs: mx.array, cache: Any = None) -> mx.array:
        return self._logits[:, None, :]


def generator_class() -> type[BatchGenerator]:
    """The generator the engine runs (and the batch-invariance check and the benchmarks build
    as it does): this one where MLX computes on the CPU, mlx-lm's own elsewhere."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return FirstTokenBatchGenerator
    return BatchGenerator
