"""A lone batch's first tokens in the step its prompts end, where MLX computes on the CPU.

mlx-lm's generation batch runs a pass ahead: a step feeds the tokens sampled the step before,
starts the next forward pass with `mx.async_eval`, and only then returns the tokens it fed,
which is meant to overlap the host's work with a device's. On MLX's CPU stream `async_eval`
returns only once about a hundred tasks are left queued, for a decode pass near its end, so a
sequence's first token reaches the engine one whole pass after it was computed.

Here a batch that joins an empty generation batch (a lone request, or a burst that starts
together) steps once before it joins without that `async_eval`: its next pass is built, not
started, and the step returns the first tokens it computed. Its next step computes the built
pass and the following one, so the second tokens come when they came before, and every token
reaches the engine no later than mlx-lm's own way. A batch joining sequences that are already
decoding keeps mlx-lm's way: its built pass would run apart from theirs, one pass more for the
batch, where mlx-lm folds it into their next one.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch

# The module itself: the package's `generate` attribute is a function of the same name.
_GENERATE = sys.modules[BatchGenerator.__module__]


class _NoAsyncEval(ModuleType):
    """mlx.core as mlx-lm's generate module sees it, with `async_eval` doing nothing."""

    def __init__(self, real: ModuleType) -> None:
        super().__init__(real.__name__)
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @staticmethod
    def async_eval(*_arrays: Any) -> None:
        return None


@contextmanager
def _passes_built_not_started() -> Iterator[None]:
    """Within it, mlx-lm's steps build their next pass and leave it for the next step's eval.
    The engine's steps run on one thread, so no other step sees the swap."""
    real = _GENERATE.mx
    _GENERATE.mx = _NoAsyncEval(real)
    try:
        yield
    finally:
        _GENERATE.mx = real


class _FirstTokenBatch(GenerationBatch):
    """The generation batch: a batch joining it while it is empty steps once first, and that
    step's responses (the first tokens; any sequence they end has left the batch, as in any
    step) wait in `joined` until the generator's step hands them on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.joined: list[GenerationBatch.Response] = []
        super().__init__(*args, **kwargs)

    def extend(self, batch: GenerationBatch) -> None:
        if batch.uids and not self.uids:
            with _passes_built_not_started():
                self.joined += batch.next()
        if batch.uids:
            super().extend(batch)


class FirstTokenBatchGenerator(BatchGenerator):
    """mlx-lm's BatchGenerator whose step also returns the first tokens of a batch that joined
    an empty generation batch in it: generated tokens of a decode step, as mlx-lm counts them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._generation_batch = _FirstTokenBatch.empty(self.model, self.sampler)

    def _next(self) -> tuple[list[Any], list[Any]]:
        prompt_responses, generation_responses = super()._next()
        batch = self._generation_batch
        assert isinstance(batch, _FirstTokenBatch)
        joined, batch.joined = batch.joined, []
        if joined:
            self._counters.generation_tokens += len(joined)
            if not generation_responses:  # nothing decoded before they joined: a step uncounted
                self._counters.generation_steps += 1
            generation_responses = [*generation_responses, *joined]
        return prompt_responses, generation_responses


def generator_class() -> type[BatchGenerator]:
    """The generator the engine runs (and the batch-invariance check and the benchmarks build
    as it does): this one where MLX computes on the CPU, mlx-lm's own elsewhere."""
    if mx.default_device().type == mx.DeviceType.cpu:
        return FirstTokenBatchGenerator
    return BatchGenerator
