"""worker/engine/first_token.py: on the CPU a sequence's first token comes in the step its prompt
ends, two steps before mlx-lm's own generator gives it, and every other token a step before
mlx-lm's: the same tokens, over the same passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from worker.engine.first_token import FirstTokenBatchGenerator, generator_class

PROMPT_A = [5, 17, 42, 99, 3, 250, 61, 7, 8, 120, 33, 12]
PROMPT_B = [200, 9, 14, 77, 301, 6, 2, 45]


class _Counted:
    """The model, counting the forward passes the generator builds."""

    def __init__(self, model: Any) -> None:
        self._model, self.passes = model, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.passes += 1
        return self._model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    loaded, _ = load(str(tiny_model_dir))
    return loaded


def _gen(cls: type[BatchGenerator], model: Any, stop_tokens: list[list[int]] | None = None) -> Any:
    return cls(
        model,
        max_tokens=64,
        stop_tokens=stop_tokens or [],
        completion_batch_size=8,
        prefill_batch_size=8,
        prefill_step_size=64,
    )


Plan = dict[int, list[tuple[list[int], int]]]


def _run(gen: Any, plan: Plan, steps: int = 40) -> list[list[Any]]:
    """Each step's responses; `plan`: step index -> prompts (with max_tokens) inserted before it."""
    out: list[list[Any]] = []
    for i in range(steps):
        for prompt, max_tokens in plan.get(i, []):
            gen.insert([prompt], max_tokens=[max_tokens])
        _, responses = gen.next()
        out.append(responses)
    return out


def _arrivals(steps: list[list[Any]]) -> dict[int, list[tuple[int, int]]]:
    """uid -> (step index, token) of each of its tokens."""
    got: dict[int, list[tuple[int, int]]] = {}
    for i, responses in enumerate(steps):
        for r in responses:
            got.setdefault(r.uid, []).append((i, r.token))
    return got


def test_the_engine_runs_it_on_the_cpu() -> None:
    assert mx.default_device().type == mx.DeviceType.cpu
    assert generator_class() is FirstTokenBatchGenerator


def _compare(
    model: Any, plan: Plan, stop_tokens: list[list[int]] | None = None
) -> tuple[dict[int, list[tuple[int, int]]], dict[int, list[tuple[int, int]]]]:
    """Both generators over `plan`: each one's arrivals, with the same passes asserted."""
    counted = [_Counted(model), _Counted(model)]
    gen = _gen(FirstTokenBatchGenerator, counted[0], stop_tokens)
    ours = _arrivals(_run(gen, plan))
    theirs = _arrivals(_run(_gen(BatchGenerator, counted[1], stop_tokens), plan))
    # No pass added; a pass fewer for each lone prompt prefilled with its last token.
    assert counted[0].passes + gen.folded == counted[1].passes
    assert ours.keys() == theirs.keys()
    return ours, theirs


def _sooner(ours: list[tuple[int, int]], theirs: list[tuple[int, int]]) -> None:
    """The same tokens; the first two steps sooner (in the step its prompt ends), every other
    a step sooner (the sequence joined the generation batch a step sooner)."""
    assert [t for _, t in ours] == [t for _, t in theirs]
    assert ours[0][0] == theirs[0][0] - 2
    assert [i for i, _ in ours[1:]] == [i - 1 for i, _ in theirs[1:]]


def test_a_lone_prompt_gets_its_first_token_in_the_step_that_ends_it(model: Any) -> None:
    ours, theirs = _compare(model, {0: [(PROMPT_A, 6)]})
    ((uid, tokens),) = theirs.items()
    assert len(tokens) == 6
    _sooner(ours[uid], tokens)


def test_a_burst_starting_together_gets_its_first_tokens_sooner(model: Any) -> None:
    ours, theirs = _compare(model, {0: [(PROMPT_A, 5), (PROMPT_B, 5)]})
    for uid in theirs:
        _sooner(ours[uid], theirs[uid])


@pytest.mark.parametrize("joins_at", range(1, 9))
def test_a_prompt_joining_at_any_step(model: Any, joins_at: int) -> None:
    """B joins A decoding, or in the step A's last token ends it (the batch empty again), or
    after: both get their first token two steps sooner and the rest a step sooner; mlx-lm's
    decode steps, and each token counted once."""
    plan = {0: [(PROMPT_A, 4)], joins_at: [(PROMPT_B, 3)]}
    ours, theirs = _compare(model, plan)
    for uid in theirs:
        _sooner(ours[uid], theirs[uid])
    stats = []
    for cls in (FirstTokenBatchGenerator, BatchGenerator):
        gen = _gen(cls, model)
        with gen.stats() as counted:
            steps = _run(gen, plan, steps=14)
        assert counted.generation_tokens == sum(len(responses) for responses in steps) == 7
        stats.append(counted.generation_steps)
    assert stats[0] == stats[1]


def test_a_first_token_that_ends_its_sequence(model: Any) -> None:
    """max_tokens 1, and a first token that is a stop token: the sequence ends in the step its
    prompt ends, with a KV cache of its prompt and the prompt's tokens (the token that ended it
    was never fed), alone or beside a sequence that decodes on unchanged; and the generator
    serves the next prompt as it serves any."""
    (first,) = _run(_gen(BatchGenerator, model), {0: [(PROMPT_A, 1)]}, steps=4)[2]
    for stop_tokens, reason in (([], "length"), ([[first.token]], "stop")):
        max_tokens = 1 if reason == "length" else 8
        gen = _gen(FirstTokenBatchGenerator, model, stop_tokens)
        steps = _run(gen, {0: [(PROMPT_A, max_tokens)]}, steps=3)
        (r,) = steps[0]
        assert (r.token, r.finish_reason) == (first.token, reason)
        assert r.all_tokens == PROMPT_A and r.prompt_cache[0].offset == len(PROMPT_A)
        assert steps[1:] == [[], []] and len(gen._generation_batch) == 0
        plan = {0: [(PROMPT_B, 4)]}
        again = _arrivals(_run(gen, plan, steps=8))
        plain = _arrivals(_run(_gen(BatchGenerator, model, stop_tokens), plan))
        _sooner(list(again.values())[0], list(plain.values())[0])
        # Beside B decoding: A ends as it joins; B's tokens come as they do alone.
        plan = {0: [(PROMPT_B, 10)], 3: [(PROMPT_A, max_tokens)]}
        ours, theirs = _compare(model, plan, stop_tokens)
        uid_b, uid_a = sorted(theirs)
        _sooner(ours[uid_a], theirs[uid_a])
        _sooner(ours[uid_b], theirs[uid_b])
        assert len(ours[uid_a]) == 1


def test_the_first_tokens_logprobs_are_mlx_lms(model: Any) -> None:
    ours = _run(_gen(FirstTokenBatchGenerator, model), {0: [(PROMPT_A, 3)]}, steps=3)[0]
    theirs = _run(_gen(BatchGenerator, model), {0: [(PROMPT_A, 3)]}, steps=3)[2]
    assert mx.allclose(ours[0].logprobs, theirs[0].logprobs).item()


def test_the_state_at_the_prompts_end_is_still_there_in_the_step_it_joins(model: Any) -> None:
    """In the step a prompt's prefill ends (and, here, its sequence joins the generation batch
    and gets its first token), extract_cache gives what mlx-lm's gives in that step: the KV of
    the prompt but its last token, and those tokens (the engine's prefill checkpoint and its
    group-mates' copies are taken from it); the step after, the sequence's own state."""
    caches, tokens = [], []
    for cls in (FirstTokenBatchGenerator, BatchGenerator):
        gen = _gen(cls, model)
        (uid,) = gen.insert([PROMPT_A], max_tokens=[8])
        gen.next()
        layers, held = gen.extract_cache([uid])[uid]
        caches.append(layers)
        tokens.append(held)
        if cls is FirstTokenBatchGenerator:
            gen.next()
            later, later_tokens = gen.extract_cache([uid])[uid]
            # Its prompt and its first token, fed by that step.
            assert later_tokens[:-1] == PROMPT_A and later[0].offset == len(PROMPT_A) + 1
    assert tokens[0] == tokens[1] == PROMPT_A[:-1]
    assert caches[0][0].offset == caches[1][0].offset == len(PROMPT_A) - 1
    for ours, theirs in zip(caches[0], caches[1], strict=True):
        # Computed by a pass over the whole prompt here, by one over all but its last token
        # there: the same positions' keys, to float32's rounding.
        assert mx.allclose(ours.state[0], theirs.state[0], rtol=1e-4, atol=1e-5).item()


def test_a_lone_cold_prompt_is_prefilled_with_its_last_token(model: Any) -> None:
    """Alone, with nothing decoding: one pass over the whole prompt gives the first token (a
    pass fewer than mlx-lm's), the same tokens with a logits processor that reads what came
    before; two prompts at once are prefilled as mlx-lm does."""
    from mlx_lm.sample_utils import make_logits_processors

    processors = make_logits_processors(repetition_penalty=1.3)
    tokens, passes, folded = [], [], []
    for cls in (FirstTokenBatchGenerator, BatchGenerator):
        counted = _Counted(model)
        gen = _gen(cls, counted)
        gen.insert([PROMPT_A], max_tokens=[6], logits_processors=[processors])
        got = [r.token for _ in range(10) for r in gen.next()[1]]
        tokens.append(got)
        passes.append(counted.passes)
        folded.append(getattr(gen, "folded", 0))
    assert tokens[0] == tokens[1] and len(tokens[0]) == 6
    assert folded == [1, 0] and passes[0] == passes[1] - 1
    gen = _gen(FirstTokenBatchGenerator, model)
    _run(gen, {0: [(PROMPT_A, 4), (PROMPT_B, 4)]}, steps=8)
    assert gen.folded == 0
