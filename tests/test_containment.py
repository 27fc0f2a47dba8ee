"""No request holds the loop (issue 19): in-process through the Engine on the tiny model, as
tests/test_engine.py runs it.

A long prompt scored for its logprobs runs a chunk (prefill_step_size positions) a step, in all,
beside the batch's decode step: a stream already decoding gets a token every step, and the
logprobs equal the pass run whole. The `n` choices of requests with one big schema compile it
once, on the grammar executor, while the decoding stream goes on; they start on the step after
the compile is done, and a grammar that does not compile fails its requests alone.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import numpy as np
import pytest
from llguidance import LLMatcher

from tests.test_engine import Model, Run, make_engine, run_until_done, settings, spec
from worker.engine.engine import Engine
from worker.engine.grammar_compile import grammar_thread
from worker.engine.prompt_logprobs import score_prompt
from worker.engine.request import RequestStatus

CHUNK = settings().worker.prefill_step_size
LONG_PROMPT = [(7 + i * 31) % 1000 + 5 for i in range(2000)]  # 2,000 ids: 8 chunks of 256
RUNNING = [5, 6, 7, 8, 9, 10]
# router/admission/structured_output.py's JSON options (compact JSON), not imported: the engine's
# tests need no router.
JSON_DEFAULTS = {"whitespace_flexible": False}
# A 1,200-property schema, every property required (a choice's 6 tokens end it early).
FIELDS = [f"field_{i}" for i in range(1200)]
BIG_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {name: {"type": "string", "maxLength": 8} for name in FIELDS},
    "required": FIELDS,
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Any) -> Model:
    from mlx_lm import load

    from shared.model_facts import model_facts

    model, tokenizer = load(str(tiny_model_dir))
    facts = model_facts(tiny_model_dir)
    return Model(model, tokenizer, facts.model_id, facts.context_length)


def no_eos(tiny: Model) -> dict[int, float]:
    """A logit_bias that keeps a stream decoding to its max_tokens."""
    return {int(t): -100.0 for t in tiny.tokenizer.eos_token_ids}


def start_running(engine: Engine, tiny: Model, run: Run, max_tokens: int = 40) -> None:
    """A stream decoding a token a step before the test's request: its first two tokens out
    (its first comes in the step its prompt ends, and the step that feeds it gives none:
    worker/engine/first_token.py)."""
    run.add(engine.admit(spec("run", RUNNING, max_tokens, logit_bias=no_eos(tiny))))
    while len(run.tokens("run")) < 2:
        run.add(engine.step())


def step_watching(
    engine: Engine, run: Run, until: Callable[[], bool] | None = None, limit: int = 64
) -> int:
    """Step until `until()` (None: `limit` steps); every step must give the running stream
    exactly one token and compute at most one chunk of prompt positions. The steps taken."""
    for steps in range(1, limit + 1):
        before = len(run.tokens("run"))
        out = run.add(engine.step())
        assert len(run.tokens("run")) == before + 1, f"step {steps} gave the stream no token"
        assert out.counters.get("batch_prefill_tokens", 0) <= CHUNK, out.counters
        if until is not None and until():
            return steps
    if until is not None:
        raise AssertionError(f"not done in {limit} steps")
    return limit


def assert_same_entries(got: list[Any], want: list[Any], atol: float = 1e-4) -> None:
    """Equal within float tolerance: the logprobs, and the alternatives in the same order but
    where two of them tie within tolerance (either order is then right)."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose([g[0], *g[2]], [w[0], *w[2]], atol=atol)
        assert len(g[1]) == len(w[1])
        for i, (gi, wi) in enumerate(zip(g[1], w[1], strict=True)):
            if gi != wi:
                near = [v for j, v in enumerate(w[2]) if j != i and abs(v - w[2][i]) <= 2 * atol]
                assert near or i == len(w[1]) - 1, (g, w)


def started(run: Run, rid: str) -> bool:
    return "start" in run.kinds(rid)


# -- prompt scoring a chunk a step ---------------------------------------------------------------
def test_a_long_scored_prompt_runs_a_chunk_a_step_beside_a_decoding_stream(tiny: Model) -> None:
    engine = make_engine(tiny)
    run = Run()
    start_running(engine, tiny, run)
    admitted = run.add(engine.admit(spec("s", LONG_PROMPT, 4, prompt_logprobs=2, echo=True)))
    assert admitted.prefill_pending and run.kinds("s") == []
    assert engine.find("s").status is RequestStatus.SCORING
    steps = step_watching(engine, run, lambda: started(run, "s"))
    assert steps == -(-(len(LONG_PROMPT) - 1) // CHUNK)  # one chunk a step, none wasted
    run_until_done(engine, 80, run)

    # The chunked pass gives what the whole pass at once gives (one chunk of 1,999 positions).
    _, whole = score_prompt(tiny.model, LONG_PROMPT, 2, len(LONG_PROMPT))
    assert_same_entries(run.events["s"][0].prompt_logprobs, whole)
    # The pass was the prefill: the continuation is the one of the prompt alone, and the
    # stream beside it decoded as it does alone.
    lone = make_engine(tiny)
    alone_run = Run()
    alone_run.add(lone.admit(spec("s", LONG_PROMPT, 4, echo=True)))
    alone_run.add(lone.admit(spec("run", RUNNING, 40, logit_bias=no_eos(tiny))))
    run_until_done(lone, 80, alone_run)
    assert run.tokens("s") == alone_run.tokens("s") and run.text("s") == alone_run.text("s")
    assert run.tokens("run") == alone_run.tokens("run")
    assert run.counters["batch_prefill_tokens"] == alone_run.counters["batch_prefill_tokens"]


def test_several_scored_requests_share_one_chunk_a_step(tiny: Model) -> None:
    prompts = [[(11 + i * 7 + j * 13) % 1000 + 5 for i in range(300 + 50 * j)] for j in range(4)]
    engine = make_engine(tiny)
    run = Run()
    start_running(engine, tiny, run, max_tokens=40)
    for j, prompt in enumerate(prompts):
        run.add(engine.admit(spec(f"s{j}", prompt, 1, logprobs=5, prompt_logprobs=5, echo=True)))
    steps = step_watching(engine, run, lambda: all(f"s{j}" in run.ended for j in range(4)))
    total = sum(len(p) - 1 for p in prompts)
    assert steps <= -(-total // CHUNK) + 1  # the budget is spent, not one request a step
    for j, prompt in enumerate(prompts):
        assert_same_entries(
            run.events[f"s{j}"][0].prompt_logprobs,
            score_prompt(tiny.model, prompt, 5, len(prompt))[1],
        )
        assert run.last(f"s{j}").finish_reason == "length" and len(run.tokens(f"s{j}")) == 1


def test_cancel_and_expiry_while_scoring_end_that_request_alone(tiny: Model) -> None:
    from tests.test_engine import FakeClock

    clock = FakeClock()
    engine = make_engine(tiny, clock=clock)
    run = Run()
    start_running(engine, tiny, run)
    run.add(engine.admit(spec("c", LONG_PROMPT, 2, prompt_logprobs=1)))
    run.add(engine.admit(spec("t", LONG_PROMPT[:1500], 2, prompt_logprobs=1), timeout_s=5))
    step_watching(engine, run, lambda: engine.find("c").scoring.position > 0)
    run.add(engine.cancel("c"))
    assert run.ended["c"].status is RequestStatus.CANCELLED and run.kinds("c") == []
    clock.advance(6)
    step_watching(engine, run, lambda: "t" in run.ended)
    assert run.last("t").error_type == "timeout"
    run_until_done(engine, 80, run)
    assert run.last("run").finish_reason == "length" and len(run.tokens("run")) == 40


def test_group_mates_arriving_while_the_first_scores_wait_for_it(tiny: Model) -> None:
    engine = make_engine(tiny)
    run = Run()
    start_running(engine, tiny, run)
    prompt = LONG_PROMPT[:700]
    for i in range(3):
        run.add(engine.admit(spec(f"g{i}", prompt, 4, group="g0", prompt_logprobs=1, echo=True)))
    assert [engine.find(f"g{i}").status for i in range(3)] == [
        RequestStatus.SCORING,
        RequestStatus.WAITING,
        RequestStatus.WAITING,
    ]
    step_watching(engine, run, lambda: started(run, "g2"))
    run_until_done(engine, 80, run)
    starts = [run.events[f"g{i}"][0] for i in range(3)]
    assert starts[0].prompt_logprobs == starts[1].prompt_logprobs == starts[2].prompt_logprobs
    assert [s.cached_tokens for s in starts] == [0, len(prompt) - 1, len(prompt) - 1]
    assert len({tuple(run.tokens(f"g{i}")) for i in range(3)}) == 1  # greedy: alike


# -- grammars compiled off the loop --------------------------------------------------------------
class ManualExecutor(Executor):
    """Holds each job until the test runs it: a compile pending for as many steps as wanted."""

    def __init__(self) -> None:
        self.jobs: list[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = []
        self.submitted = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        self.jobs.append((future, fn, args))
        self.submitted += 1
        return future

    def run_all(self) -> None:
        for future, fn, args in self.jobs:
            try:
                future.set_result(fn(*args))
            except Exception as exc:
                future.set_exception(exc)
        self.jobs = []


def big_grammar() -> str:
    return LLMatcher.grammar_from_json_schema(BIG_SCHEMA, defaults=JSON_DEFAULTS)


def choices(prompt_no: int, n: int, grammar: str) -> list[Any]:
    prompt = [(13 + i * 17 + prompt_no * 101) % 1000 + 5 for i in range(40)]
    group = f"p{prompt_no}c0"
    return [
        spec(
            f"p{prompt_no}c{i}",
            prompt,
            6,
            grammar=grammar,
            group=group,
            temperature=0.8,
            seed=100 * prompt_no + i,
        )
        for i in range(n)
    ]


def test_n_choices_of_one_big_schema_compile_once_while_the_batch_decodes(tiny: Model) -> None:
    executor = ManualExecutor()
    engine = Engine(
        tiny.model,
        tiny.tokenizer,
        settings().worker.model_copy(update={"batch_size": 17}),
        model_id=tiny.model_id,
        worker_id="w-containment",
        context_length=tiny.context_length,
        prompt_cache=None,
        grammar_executor=executor,
    )
    run = Run()
    start_running(engine, tiny, run)
    grammar = big_grammar()
    specs = [s for p in range(4) for s in choices(p, 4, grammar)]
    for s in specs:
        admitted = run.add(engine.admit(s))
        assert admitted.prefill_pending
    assert executor.submitted == 1  # one compile for the 16 choices of 4 prompts
    assert engine.active == 17 and engine.free_slots == 0
    step_watching(engine, run, limit=3)  # the compile stays pending...
    assert all(engine.find(s.request_id).status is RequestStatus.COMPILING for s in specs)
    assert all(run.kinds(s.request_id) == [] for s in specs)
    executor.run_all()
    step_watching(engine, run, limit=1)  # ...and they start on the next step
    # The first of each prompt prefilled it (one chunk) in that step, its mates copied it.
    assert all(started(run, s.request_id) for s in specs)
    mates = [s.request_id for s in specs if not s.request_id.endswith("c0")]
    assert {run.events[rid][0].cached_tokens for rid in mates} == {len(specs[0].prompt_tokens) - 1}
    matchers = {id(engine.find(s.request_id).grammar.matcher) for s in specs}
    assert len(matchers) == 16  # each choice its own copy of the one compiled grammar
    step_watching(engine, run, lambda: all(s.request_id in run.ended for s in specs))
    run_until_done(engine, 80, run)
    for s in specs:
        rid = s.request_id
        assert run.last(rid).kind == "done", run.last(rid)
        assert run.last(rid).finish_reason == "length"
        text, head = run.text(rid), '{"field_0":"'  # the schema's only way to begin
        assert text and (head.startswith(text) or text.startswith(head)), text
    # A later request with that grammar starts at once: it is compiled already.
    run.add(engine.admit(spec("late", RUNNING, 4, grammar=grammar)))
    assert executor.submitted == 1 and run.kinds("late")[:1] == ["start"]
    run_until_done(engine, 40, run)


def test_a_grammar_that_does_not_compile_fails_its_requests_alone(tiny: Model) -> None:
    executor = ManualExecutor()
    engine = make_engine(tiny, grammar_executor=executor)
    run = Run()
    start_running(engine, tiny, run)
    for s in choices(0, 2, "start: undefined_rule"):
        run.add(engine.admit(s))
    step_watching(engine, run, limit=2)
    executor.run_all()
    step_watching(engine, run, lambda: "p0c0" in run.ended and "p0c1" in run.ended, limit=1)
    for rid in ("p0c0", "p0c1"):
        assert run.kinds(rid) == ["error"] and run.last(rid).error_type == "invalid_request_error"
    assert executor.submitted == 1
    run_until_done(engine, 80, run)
    assert len(run.tokens("run")) == 40


def test_a_request_cancelled_while_its_grammar_compiles_just_leaves(tiny: Model) -> None:
    executor = ManualExecutor()
    engine = make_engine(tiny, grammar_executor=executor)
    run = Run()
    run.add(engine.admit(spec("g", RUNNING, 4, grammar=big_grammar())))
    assert engine.active == 1 and engine.find("g").status is RequestStatus.COMPILING
    run.add(engine.cancel("g"))
    assert run.ended["g"].status is RequestStatus.CANCELLED and engine.active == 0
    executor.run_all()
    run.add(engine.step())
    assert run.kinds("g") == []


def test_a_real_compile_thread_keeps_the_stream_going(tiny: Model) -> None:
    """The default executor (one thread): the running stream gets a token every step from
    admission until the choices are done, and the choices start once compiled."""
    executor = grammar_thread()
    try:
        engine = make_engine(tiny, grammar_executor=executor)
        run = Run()
        start_running(engine, tiny, run, max_tokens=60)
        grammar = big_grammar()
        specs = choices(0, 4, grammar)
        for s in specs:
            run.add(engine.admit(s))
        # Bounded in steps (step_watching's limit), each one giving the stream its token.
        step_watching(engine, run, lambda: all(s.request_id in run.ended for s in specs))
        for s in specs:
            assert run.last(s.request_id).kind == "done"
    finally:
        executor.shutdown(wait=True)
