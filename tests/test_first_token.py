"""worker/engine/first_token.py: on the CPU, a batch that starts alone gets its first tokens in
the step its prompts end, and no token comes later or differs from mlx-lm's own generator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.generate import BatchGenerator

from worker.engine import first_token
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


def test_a_lone_prompt_gets_its_first_token_in_the_step_that_ends_it(model: Any) -> None:
    plan = {0: [(PROMPT_A, 6)]}
    counted = [_Counted(model), _Counted(model)]
    ours = _arrivals(_run(_gen(FirstTokenBatchGenerator, counted[0]), plan))
    theirs = _arrivals(_run(_gen(BatchGenerator, counted[1]), plan))
    (a,), (b,) = ours.values(), theirs.values()
    assert [t for _, t in a] == [t for _, t in b] and len(a) == 6
    assert a[0][0] == b[0][0] - 1  # one step sooner
    assert all(sa <= sb for (sa, _), (sb, _) in zip(a, b, strict=True))  # none later
    assert a[-1][0] == b[-1][0] - 1  # and one step fewer in all
    assert counted[0].passes == counted[1].passes  # the same passes, the first's result sooner


def test_a_burst_starting_together_gets_its_first_tokens_sooner(model: Any) -> None:
    plan = {0: [(PROMPT_A, 5), (PROMPT_B, 5)]}
    ours = _arrivals(_run(_gen(FirstTokenBatchGenerator, model), plan))
    theirs = _arrivals(_run(_gen(BatchGenerator, model), plan))
    for uid in theirs:
        assert [t for _, t in ours[uid]] == [t for _, t in theirs[uid]]
        assert ours[uid][0][0] == theirs[uid][0][0] - 1


def test_a_prompt_joining_running_sequences_keeps_mlx_lms_steps(model: Any) -> None:
    """B joins while A decodes: every token of both at the same step as mlx-lm's (an unpipelined
    first step for B alone would cost the batch a pass)."""
    plan = {0: [(PROMPT_A, 12)], 3: [(PROMPT_B, 5)]}
    counted = [_Counted(model), _Counted(model)]
    ours = _arrivals(_run(_gen(FirstTokenBatchGenerator, counted[0]), plan))
    theirs = _arrivals(_run(_gen(BatchGenerator, counted[1]), plan))
    uid_a, uid_b = sorted(theirs)
    assert ours[uid_b] == theirs[uid_b]
    # A started alone, so all its steps came one sooner; the same tokens.
    assert [(i + 1, t) for i, t in ours[uid_a]] == theirs[uid_a]
    assert counted[0].passes == counted[1].passes  # no pass more


def test_a_first_token_that_ends_its_sequence(model: Any) -> None:
    """max_tokens 1, and a first token that is a stop token: the sequence ends in the step its
    prompt ends, with its KV cache and tokens, and the generator serves the next prompt as
    mlx-lm's does."""
    (first,) = _run(_gen(BatchGenerator, model), {0: [(PROMPT_A, 1)]}, steps=4)[2]
    for stop_tokens, reason in (([], "length"), ([[first.token]], "stop")):
        gen = _gen(FirstTokenBatchGenerator, model, stop_tokens)
        steps = _run(gen, {0: [(PROMPT_A, 1 if reason == "length" else 8)]}, steps=3)
        (r,) = steps[1]
        assert (r.token, r.finish_reason) == (first.token, reason)
        assert r.prompt_cache is not None and r.all_tokens == [*PROMPT_A, first.token]
        assert steps[2] == [] and len(gen._generation_batch) == 0
        again = _arrivals(_run(gen, {0: [(PROMPT_B, 4)]}, steps=8))
        plain = _arrivals(_run(_gen(BatchGenerator, model, stop_tokens), {0: [(PROMPT_B, 4)]}))
        assert [t for _, t in next(iter(again.values()))] == [
            t for _, t in next(iter(plain.values()))
        ]


def test_the_first_tokens_logprobs_are_mlx_lms(model: Any) -> None:
    ours = _run(_gen(FirstTokenBatchGenerator, model), {0: [(PROMPT_A, 3)]}, steps=3)[1]
    theirs = _run(_gen(BatchGenerator, model), {0: [(PROMPT_A, 3)]}, steps=3)[2]
    assert mx.allclose(ours[0].logprobs, theirs[0].logprobs).item()


def test_async_eval_comes_back_when_the_first_step_fails(model: Any) -> None:
    """A logits processor that fails in the first step (its second call: the first feeds the
    prompt's last token) leaves mlx-lm's module with the real mlx.core."""
    calls: list[int] = []

    def failing(tokens: mx.array, logits: mx.array) -> mx.array:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("processor failed")
        return logits

    gen = _gen(FirstTokenBatchGenerator, model)
    gen.insert([PROMPT_A], max_tokens=[4], logits_processors=[[failing]])
    with pytest.raises(RuntimeError, match="processor failed"):
        for _ in range(4):
            gen.next()
    assert first_token._GENERATE.mx is mx


@pytest.mark.parametrize("joins_at", range(1, 8))
def test_decode_steps_and_tokens_are_counted_once(model: Any, joins_at: int) -> None:
    """Whatever step B joins in (one of them is the step A's last token ends A, so the batch is
    empty again when B joins): a decode step counted for each step that returned tokens, and
    each token once."""
    gen = _gen(FirstTokenBatchGenerator, model)
    with gen.stats() as stats:
        steps = _run(gen, {0: [(PROMPT_A, 4)], joins_at: [(PROMPT_B, 3)]}, steps=14)
    assert stats.generation_steps == sum(1 for responses in steps if responses)
    assert stats.generation_tokens == sum(len(responses) for responses in steps) == 7
