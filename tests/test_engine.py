"""The batch engine in-process: the real tiny model, a real PromptCache (dense and paged), a fake
clock; no subprocess, no Redis. Admit, step, stop, cancel, deadline, per-sequence failures, a
failing batched step, fail_all, adopt/donate and the fast start."""

from __future__ import annotations

import gc
from collections import Counter
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from shared.config import load_settings
from shared.model_facts import model_facts
from shared.wire import GenerationRequest, StreamEvent
from tests.conftest import continuation
from worker.engine.engine import FAST_START_MAX_TOKENS, Engine
from worker.engine.grammar_compile import InlineExecutor
from worker.engine.request import RequestStatus
from worker.engine.results import Ended, StepResult
from worker.main import _prompt_cache
from worker.prompt_cache.entries import PagedEntry
from worker.prompt_cache.policy import PromptCache

WORKER_ID = "w-engine"
MAX_TOKENS = 12
# Prompts (token ids) the tiny model answers with no EOS within 24 tokens (checked against
# mlx-lm in test_greedy_tokens_equal_mlx_lm_batched); lengths differ so batching pads them.
P1 = [5, 6, 7, 8, 9, 10]
P2 = [11, 12, 13]
P3 = list(range(30, 100))
LONG = [(17 + i * 13) % 1000 + 5 for i in range(60)]  # 60 tokens: two paged blocks with output


@dataclass
class Model:
    model: Any
    tokenizer: Any
    model_id: str
    context_length: int


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Model:
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_dir))
    facts = model_facts(tiny_model_dir)
    return Model(model, tokenizer, facts.model_id, facts.context_length)


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def settings(storage: str = "dense", **cache: Any):
    """The worker's settings as it loads them (defaults.toml, no environment), a small batch."""
    overrides = {
        "worker": {"batch_size": 8, "prefill_batch_size": 8},
        "prompt_cache": {"storage": storage, "min_prefix_tokens": 16, **cache},
    }
    return load_settings(overrides=overrides, environ={})


def make_cache(tiny: Model, storage: str) -> PromptCache:
    """Built as worker/main.py builds it: the cacheability check, then the storage mode."""
    cache, reported = _prompt_cache(settings(storage), tiny.model, tiny.model_id, WORKER_ID)
    assert cache is not None and reported["storage_mode"] == storage
    return cache


def make_engine(
    tiny: Model,
    prompt_cache: PromptCache | None = None,
    clock: FakeClock | None = None,
    grammar_executor: Executor | None = None,
) -> Engine:
    """An engine on the tiny model; grammars compile at admission (InlineExecutor) unless a
    test passes its own executor."""
    return Engine(
        tiny.model,
        tiny.tokenizer,
        settings().worker,
        model_id=tiny.model_id,
        worker_id=WORKER_ID,
        context_length=tiny.context_length,
        prompt_cache=prompt_cache,
        clock=(clock or FakeClock()).now,
        grammar_executor=grammar_executor or InlineExecutor(),
    )


def spec(rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS, **kw: Any) -> GenerationRequest:
    return GenerationRequest(
        request_id=rid, model="tiny", prompt_tokens=list(prompt), max_tokens=max_tokens, **kw
    )


@dataclass
class Run:
    """Everything the engine handed back, per request id, plus the drained counters summed."""

    events: dict[str, list[StreamEvent]] = field(default_factory=dict)
    ended: dict[str, Ended] = field(default_factory=dict)
    counters: Counter[str] = field(default_factory=Counter)

    def add(self, result: StepResult) -> StepResult:
        for req, evs in result.events.items():
            self.events.setdefault(req.id, []).extend(evs)
        for e in result.ended:
            assert e.request.id not in self.ended, f"{e.request.id} ended twice"
            self.ended[e.request.id] = e
        self.counters.update(result.counters)
        return result

    def kinds(self, rid: str) -> list[str]:
        return [e.kind for e in self.events.get(rid, [])]

    def tokens(self, rid: str) -> list[int]:
        return [t for e in self.events.get(rid, []) if e.kind == "delta" for t in e.token_ids]

    def text(self, rid: str) -> str:
        return "".join(e.text for e in self.events.get(rid, []) if e.kind == "delta")

    def last(self, rid: str) -> StreamEvent:
        return self.events[rid][-1]


def run_until_done(engine: Engine, max_steps: int, run: Run | None = None) -> Run:
    """Step until nothing runs; fails if that takes more than `max_steps` steps."""
    run = run or Run()
    for _ in range(max_steps):
        if engine.active == 0:
            return run
        run.add(engine.step())
    assert engine.active == 0, f"still running after {max_steps} steps"
    return run


def step_until(engine: Engine, run: Run, rid: str, deltas: int, max_steps: int = 40) -> None:
    """Step until request `rid` has streamed at least `deltas` tokens."""
    for _ in range(max_steps):
        if len(run.tokens(rid)) >= deltas:
            return
        run.add(engine.step())
    raise AssertionError(f"{rid} streamed {len(run.tokens(rid))} tokens in {max_steps} steps")


def alone(tiny: Model, s: GenerationRequest, prompt_cache: PromptCache | None = None) -> Run:
    """`s` run by itself on a fresh engine."""
    engine = make_engine(tiny, prompt_cache)
    run = Run()
    run.add(engine.admit(s))
    return run_until_done(engine, 4 * s.max_tokens + 8, run)


def reference(tiny: Model, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    """mlx-lm's own greedy tokens, EOS left out, and their text continuing the prompt's (as
    tests/conftest.py MlxReference runs it)."""
    from mlx_lm import stream_generate

    tokens = []
    for resp in stream_generate(tiny.model, tiny.tokenizer, prompt, max_tokens=max_tokens):
        if resp.finish_reason == "stop" and resp.token in tiny.tokenizer.eos_token_ids:
            break
        tokens.append(resp.token)
    return tokens, continuation(tiny.tokenizer, prompt, tokens)


def reference_tokens(tiny: Model, prompt: list[int], max_tokens: int) -> list[int]:
    return reference(tiny, prompt, max_tokens)[0]


def assert_failed(run: Run, rid: str, error_type: str) -> None:
    ended = run.ended[rid]
    assert ended.status is RequestStatus.FAILED
    assert ended.request.error_type == error_type and ended.request.error
    last = run.last(rid)
    assert (last.kind, last.error_type) == ("error", error_type)
    assert run.kinds(rid).count("error") == 1 and "done" not in run.kinds(rid)


def assert_length_finish(run: Run, rid: str, want_tokens: list[int]) -> None:
    assert run.ended[rid].status is RequestStatus.FINISHED
    assert run.tokens(rid) == want_tokens
    done = run.last(rid)
    assert (done.kind, done.finish_reason) == ("done", "length")
    assert done.completion_tokens == len(want_tokens)


# -- admit, step, finish ----------------------------------------------------------------------
def test_admit_and_step_to_a_length_finish(tiny: Model) -> None:
    engine = make_engine(tiny)
    run = Run()
    admitted = run.add(engine.admit(spec("r1", P1)))
    assert admitted.prefill_pending and engine.active == 1 and run.kinds("r1") == ["start"]
    run_until_done(engine, 40, run)

    kinds = run.kinds("r1")
    assert kinds == ["start"] + ["delta"] * MAX_TOKENS + ["done"]
    start, *deltas, done = run.events["r1"]
    assert (start.prompt_tokens, start.cached_tokens, start.worker_id) == (len(P1), 0, WORKER_ID)
    assert all(len(d.token_ids) == 1 for d in deltas)
    assert (run.tokens("r1"), run.text("r1")) == reference(tiny, P1, MAX_TOKENS)
    assert done.finish_reason == "length"
    assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (
        len(P1),
        MAX_TOKENS,
        0,
    )
    ended = run.ended["r1"]
    assert ended.status is RequestStatus.FINISHED
    assert ended.result() == {
        "finish_reason": "length",
        "prompt_tokens": len(P1),
        "completion_tokens": MAX_TOKENS,
        "cached_tokens": 0,
    }
    assert engine.active == 0 and engine.find("r1") is None
    c = run.counters
    assert (c["requests"], c["prompt_tokens"], c["completion_tokens"]) == (1, len(P1), MAX_TOKENS)
    assert c["batch_decode_tokens"] == MAX_TOKENS and c["batch_decode_steps"] == MAX_TOKENS
    assert c["batch_prefill_tokens"] > 0
    assert engine.step().counters == {}  # nothing left to drain, nothing runs


def test_greedy_tokens_equal_mlx_lm_batched(tiny: Model) -> None:
    engine = make_engine(tiny)
    run = Run()
    prompts = {"a": P1, "b": P2, "c": P3}
    for rid, prompt in prompts.items():
        run.add(engine.admit(spec(rid, prompt, max_tokens=24)))
    assert engine.active == 3
    run_until_done(engine, 80, run)
    for rid, prompt in prompts.items():
        want, want_text = reference(tiny, prompt, 24)
        assert len(want) == 24, "the prompt must not reach EOS (pick another)"
        assert_length_finish(run, rid, want)
        assert run.text(rid) == want_text
    assert run.counters["requests"] == 3
    assert run.counters["completion_tokens"] == 3 * 24


def test_stop_string_ends_one_request_and_the_batch_runs_on(tiny: Model) -> None:
    free = alone(tiny, spec("probe", P1, max_tokens=20))
    full_text = free.text("probe")
    head = "".join(e.text for e in free.events["probe"][1:4])  # the first three deltas' text
    stop = full_text[len(head) :][:3]
    cut = full_text.find(stop)
    assert len(stop) == 3 and cut > 0, f"no usable stop string in {full_text!r}"

    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(spec("s", P1, max_tokens=20, stop=[stop])))
    run.add(engine.admit(spec("o", P2)))
    run_until_done(engine, 60, run)

    done = run.last("s")
    assert (done.kind, done.finish_reason) == ("done", "stop")
    assert run.ended["s"].status is RequestStatus.FINISHED
    assert run.ended["s"].result()["finish_reason"] == "stop"
    assert run.text("s") == full_text[:cut] and stop not in run.text("s")
    got = run.tokens("s")
    assert got == free.tokens("probe")[: len(got)] and len(got) < 20
    assert done.completion_tokens == len(got)
    assert_length_finish(run, "o", alone(tiny, spec("o", P2)).tokens("o"))


EOS_PROMPT = [100, 200, 300, 400]  # the tiny model's greedy answer ends with EOS at token 21


def test_an_eos_finish_is_stop_with_no_delta_for_the_eos(tiny: Model) -> None:
    want, want_text = reference(tiny, EOS_PROMPT, 24)
    assert len(want) < 23, "the prompt must reach EOS (pick another)"
    run = alone(tiny, spec("e", EOS_PROMPT, max_tokens=24))
    kinds = run.kinds("e")
    assert kinds[0] == "start" and kinds[-1] == "done" and set(kinds[1:-1]) == {"delta"}
    # One delta per token the client sees, at most one more with the detokenizer's tail text.
    ids = [e.token_ids for e in run.events["e"][1:-1]]
    assert ids[: len(want)] == [[t] for t in want] and all(i == [] for i in ids[len(want) :])
    assert (run.tokens("e"), run.text("e")) == (want, want_text)
    assert not set(run.tokens("e")) & set(tiny.tokenizer.eos_token_ids)
    assert run.last("e").finish_reason == "stop"
    assert run.ended["e"].status is RequestStatus.FINISHED


def test_an_eos_finish_counts_only_the_tokens_the_client_sees(
    tiny: Model, mlx_reference: Any
) -> None:
    want_text, want_n = mlx_reference.run(EOS_PROMPT, 24)
    run = alone(tiny, spec("e", EOS_PROMPT, max_tokens=24))
    assert run.text("e") == want_text and len(run.tokens("e")) == want_n
    assert run.last("e").completion_tokens == want_n
    assert run.ended["e"].result()["completion_tokens"] == want_n
    assert run.counters["completion_tokens"] == want_n


# -- ending one request early -------------------------------------------------------------------
def test_cancel_one_of_two_mid_stream(tiny: Model) -> None:
    pc = make_cache(tiny, "dense")
    engine = make_engine(tiny, pc)
    run = Run()
    run.add(engine.admit(spec("x", LONG[:24])))
    run.add(engine.admit(spec("y", LONG[24:48])))
    step_until(engine, run, "x", 3)
    before = len(run.tokens("x"))

    cancelled = run.add(engine.cancel("x"))
    assert [e.request.id for e in cancelled.ended] == ["x"] and not cancelled.events
    assert cancelled.counters.get("inserts", 0) == 0 and len(pc.store.main) == 0
    assert engine.active == 1 and engine.find("x") is None
    assert engine.cancel("x").ended == []  # a second cancel finds nothing
    run_until_done(engine, 40, run)

    ended = run.ended["x"]
    assert ended.status is RequestStatus.CANCELLED and ended.request.finish_reason == "cancelled"
    assert "error" not in run.kinds("x") and "done" not in run.kinds("x")
    assert len(run.tokens("x")) == before  # nothing streamed after the cancel
    assert_length_finish(run, "y", alone(tiny, spec("y", LONG[24:48])).tokens("y"))
    assert run.counters["inserts"] == 1 and len(pc.store.main) == 1  # y's donation only
    (slot,) = pc.store.main.slots()
    assert list(slot.entry.tokens[:24]) == LONG[24:48]


def test_deadline_fails_only_the_late_request(tiny: Model) -> None:
    clock = FakeClock()
    engine = make_engine(tiny, clock=clock)
    run = Run()
    run.add(engine.admit(spec("late", P1), timeout_s=5))
    run.add(engine.admit(spec("free", P2)))
    step_until(engine, run, "late", 2)
    clock.advance(4.9)
    run.add(engine.step())
    assert "late" not in run.ended
    clock.advance(0.2)
    expired = run.add(engine.step())

    assert [e.request.id for e in expired.ended] == ["late"]
    assert_failed(run, "late", "timeout")
    assert "5s" in run.ended["late"].request.error
    assert engine.active == 1
    run_until_done(engine, 40, run)
    assert_length_finish(run, "free", alone(tiny, spec("free", P2)).tokens("free"))


# -- one sequence failing while others run ------------------------------------------------------
def bad_admission(tiny: Model, case: str) -> tuple[GenerationRequest, str]:
    """A request that fails at admit, and the error type it fails with."""
    if case == "token_out_of_vocab":
        vocab = int(tiny.model.args.vocab_size)
        return spec("bad", [5, 6, vocab]), "invalid_request_error"
    if case == "over_context":
        over = tiny.context_length - len(P1) + 1
        return spec("bad", P1, max_tokens=over), "invalid_request_error"
    assert case == "sampler_raises"
    return spec("bad", P1, temperature=1.0, seed=-1), "server_error"


def test_seed_minus_one_makes_the_sampler_raise() -> None:
    with pytest.raises(TypeError):
        mx.random.key(-1)


@pytest.mark.parametrize("case", ["token_out_of_vocab", "over_context", "sampler_raises"])
def test_a_failed_admission_leaves_the_batch_alone(tiny: Model, case: str) -> None:
    bad_spec, error_type = bad_admission(tiny, case)
    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(spec("good", P3)))
    step_until(engine, run, "good", 2)
    running = engine.running

    bad = run.add(engine.admit(bad_spec))
    assert [e.request.id for e in bad.ended] == ["bad"] and not bad.prefill_pending
    assert run.kinds("bad") == ["error"]  # no start: it never ran
    assert_failed(run, "bad", error_type)
    assert bad.counters == {}  # not counted as a request, no tokens
    assert engine.running == running and engine.active == 1
    run_until_done(engine, 40, run)
    assert_length_finish(run, "good", alone(tiny, spec("good", P3)).tokens("good"))


def test_a_sequence_whose_text_fails_ends_alone(tiny: Model) -> None:
    engine = make_engine(tiny)
    run = Run()
    for rid, prompt in (("a", P1), ("b", P2), ("c", P3)):
        run.add(engine.admit(spec(rid, prompt)))
    step_until(engine, run, "b", 2)
    victim = engine.find("b")
    assert victim is not None

    def broken(token: int) -> Any:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    victim.text.push = broken  # type: ignore[method-assign]
    failed = run.add(engine.step())
    assert [e.request.id for e in failed.ended] == ["b"]
    assert_failed(run, "b", "server_error")
    assert engine.active == 2
    run_until_done(engine, 40, run)
    assert_length_finish(run, "a", alone(tiny, spec("a", P1)).tokens("a"))
    assert_length_finish(run, "c", alone(tiny, spec("c", P3)).tokens("c"))


def test_fail_all_then_serve_normally(tiny: Model) -> None:
    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(spec("a", P1)))
    run.add(engine.admit(spec("b", P2)))
    step_until(engine, run, "a", 2)

    failed = run.add(engine.fail_all("redis went away"))
    assert sorted(e.request.id for e in failed.ended) == ["a", "b"]
    for rid in ("a", "b"):
        assert_failed(run, rid, "server_error")
        assert run.ended[rid].request.error == "redis went away"
    assert engine.active == 0 and engine.step().ended == []

    after = Run()
    after.add(engine.admit(spec("c", P1)))
    run_until_done(engine, 40, after)
    assert_length_finish(after, "c", reference_tokens(tiny, P1, MAX_TOKENS))


def test_a_failing_batched_step_fails_all_and_the_engine_goes_on(
    tiny: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(spec("a", P1)))
    run.add(engine.admit(spec("b", P3)))
    step_until(engine, run, "a", 2)
    calls = []

    def boom() -> Any:
        calls.append(1)
        raise RuntimeError("device lost")

    broken_gen = engine.gen
    monkeypatch.setattr(broken_gen, "next", boom)
    failed = run.add(engine.step())
    assert calls == [1]
    assert sorted(e.request.id for e in failed.ended) == ["a", "b"]
    for rid in ("a", "b"):
        assert_failed(run, rid, "server_error")
        assert "RuntimeError: device lost" in run.ended[rid].request.error
    assert engine.active == 0 and engine.gen is not broken_gen

    after = Run()
    after.add(engine.admit(spec("c", P2)))
    run_until_done(engine, 40, after)
    assert calls == [1]
    assert_length_finish(after, "c", reference_tokens(tiny, P2, MAX_TOKENS))


# -- the prompt cache: donate on finish, adopt on admission ---------------------------------------
def block_refs_held_by_entries(pc: PromptCache) -> dict[int, int]:
    held: Counter[int] = Counter()
    for slot in pc.store.main.slots():
        assert isinstance(slot.entry, PagedEntry)
        held.update(slot.entry.block_ids)
    return dict(held)


def block_refs(pc: PromptCache) -> dict[int, int]:
    assert pc.store.pool is not None
    return {b: blk.ref_cnt for b, blk in pc.store.pool._blocks.items()}


@pytest.mark.parametrize("extra", [5, FAST_START_MAX_TOKENS + 16], ids=["fast", "chunked"])
@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_donate_then_adopt_matches_cold(tiny: Model, storage: str, extra: int) -> None:
    pc = make_cache(tiny, storage)
    engine = make_engine(tiny, pc)
    first = Run()
    first.add(engine.admit(spec("A", LONG)))
    run_until_done(engine, 40, first)
    assert first.ended["A"].status is RequestStatus.FINISHED
    assert first.counters["inserts"] == 1 and first.counters["lookups"] == 1
    assert first.counters["misses"] == 1 and first.counters["hits"] == 0
    assert len(pc.store.main) == 1

    history = LONG + first.tokens("A")  # what A's KV covers
    prompt_b = history + [(7 * i + 3) % 1000 + 5 for i in range(extra)]
    second = Run()
    admitted = second.add(engine.admit(spec("B", prompt_b)))
    start = second.events["B"][0]
    assert start.kind == "start" and 0 < start.cached_tokens <= len(history)
    # The parameter picks the path: a short remainder starts in admit, a long one is chunked.
    assert admitted.prefill_pending is (extra > FAST_START_MAX_TOKENS)
    assert admitted.prefill_pending is (len(prompt_b) - start.cached_tokens > FAST_START_MAX_TOKENS)
    if storage == "paged":
        assert start.cached_tokens % pc.config.paged_block_size == 0
    c = admitted.counters
    assert (c["lookups"], c["hits"], c.get("misses", 0)) == (1, 1, 0)
    assert c["prefix_tokens_reused"] == start.cached_tokens
    req_b = engine.find("B")
    assert req_b is not None and req_b.cached_tokens == start.cached_tokens
    if storage == "paged":
        assert req_b.lease is not None and len(pc.store.main) == 1  # the entry stays
        refs, held = block_refs(pc), block_refs_held_by_entries(pc)
        for b in req_b.lease.block_ids:
            assert refs[b] == held[b] + 1  # the entry's ref and B's pin
    else:
        assert req_b.lease is None and len(pc.store.main) == 0  # dense: the entry left

    run_until_done(engine, 40, second)
    cold = alone(tiny, spec("B", prompt_b))
    assert_length_finish(second, "B", cold.tokens("B"))
    done = second.last("B")
    assert done.cached_tokens == start.cached_tokens
    assert second.ended["B"].result()["cached_tokens"] == start.cached_tokens
    assert second.counters["inserts"] == 1  # B donated in turn
    if storage == "paged":
        assert req_b.lease is None  # released at B's finish
        assert block_refs(pc) == block_refs_held_by_entries(pc)
        assert len(pc.store.main) == 2


def test_fast_start_streams_from_admit(tiny: Model) -> None:
    pc = make_cache(tiny, "dense")
    engine = make_engine(tiny, pc)
    cold = Run()
    admitted = cold.add(engine.admit(spec("A", LONG)))
    assert admitted.prefill_pending and cold.kinds("A") == ["start"]
    run_until_done(engine, 40, cold)

    prompt_b = LONG + cold.tokens("A") + [42, 43, 44]
    warm = Run()
    admitted = warm.add(engine.admit(spec("B", prompt_b)))
    start = warm.events["B"][0]
    assert len(prompt_b) - start.cached_tokens <= FAST_START_MAX_TOKENS
    assert not admitted.prefill_pending
    assert warm.kinds("B") == ["start", "delta"] and len(warm.tokens("B")) == 1
    assert admitted.counters["completion_tokens"] == 1
    assert admitted.counters["batch_prefill_tokens"] == len(prompt_b) - start.cached_tokens
    assert engine.active == 1
    run_until_done(engine, 40, warm)
    assert_length_finish(warm, "B", reference_tokens(tiny, prompt_b, MAX_TOKENS))


def test_fast_start_with_one_token_budget_finishes_in_admit(tiny: Model) -> None:
    pc = make_cache(tiny, "paged")
    engine = make_engine(tiny, pc)
    first = Run()
    first.add(engine.admit(spec("A", LONG)))
    run_until_done(engine, 40, first)

    prompt_b = LONG + first.tokens("A") + [42]
    warm = Run()
    admitted = warm.add(engine.admit(spec("B", prompt_b, max_tokens=1)))
    assert [e.request.id for e in admitted.ended] == ["B"] and engine.active == 0
    assert warm.kinds("B") == ["start", "delta", "done"]
    assert_length_finish(warm, "B", reference_tokens(tiny, prompt_b, 1))
    assert admitted.counters["inserts"] == 1  # the prompt's KV, donated
    assert block_refs(pc) == block_refs_held_by_entries(pc)  # B's pin released


# -- the choices of one prompt (a group) compute it once ----------------------------------------
GROUP_PROMPT = [(31 + i * 17) % 900 + 5 for i in range(200)]


def group_specs(n: int, prompt: list[int] = GROUP_PROMPT, **kw: Any) -> list[GenerationRequest]:
    """n choices of one prompt as the router writes them: one group (the first's id), a seeded
    choice i with seed + i."""
    seed = kw.pop("seed", None)
    return [
        spec(f"g{i}", prompt, group="g0", seed=None if seed is None else seed + i, **kw)
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "sampling", [{}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"]
)
def test_a_groups_prompt_is_computed_once_and_each_choice_runs_as_alone(
    tiny: Model, sampling: dict[str, Any]
) -> None:
    specs = group_specs(4, **sampling)
    lone = [alone(tiny, s) for s in specs]
    engine = make_engine(tiny)
    run = Run()
    for s in specs:
        run.add(engine.admit(s))
    # The first prefills; the others wait for it, unannounced, holding their slots.
    assert engine.active == 4 and engine.free_slots == settings().worker.batch_size - 4
    assert [engine.find(s.request_id).status for s in specs[1:]] == [RequestStatus.WAITING] * 3
    assert run.kinds("g0") == ["start"] and all(run.kinds(s.request_id) == [] for s in specs[1:])
    run_until_done(engine, 60, run)

    shared = len(GROUP_PROMPT) - 1
    for s, want in zip(specs, lone, strict=True):
        rid = s.request_id
        assert_length_finish(run, rid, want.tokens(rid))
        assert run.text(rid) == want.text(rid)
        cached = 0 if rid == "g0" else shared  # a sibling reports the prompt it reused
        assert run.events[rid][0].cached_tokens == cached
        assert run.last(rid).cached_tokens == run.ended[rid].result()["cached_tokens"] == cached
    if sampling:  # their own seeds: the choices differ
        assert len({tuple(run.tokens(s.request_id)) for s in specs}) > 1
    c = run.counters
    # The prompt computed once: what one request alone prefills, for the four.
    assert c["batch_prefill_tokens"] == lone[0].counters["batch_prefill_tokens"] > 0
    # One request, its prompt counted once (the first choice's), whatever n is.
    assert (c["requests"], c["prompt_tokens"]) == (1, len(GROUP_PROMPT))
    assert c["completion_tokens"] == 4 * MAX_TOKENS


def test_a_choice_arriving_after_the_prefill_starts_from_a_copy_at_once(tiny: Model) -> None:
    first, late = group_specs(2)
    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(first))
    step_until(engine, run, "g0", 3)
    admitted = run.add(engine.admit(late))
    start = admitted.events[engine.find("g1")][0]
    assert (start.kind, start.cached_tokens) == ("start", len(GROUP_PROMPT) - 1)
    before = run.counters["batch_prefill_tokens"]
    run_until_done(engine, 60, run)
    assert run.counters["batch_prefill_tokens"] == before  # g1 computed no prompt token
    assert_length_finish(run, "g1", alone(tiny, late).tokens("g1"))
    assert_length_finish(run, "g0", alone(tiny, first).tokens("g0"))


@pytest.mark.parametrize("how", ["cancelled", "timed_out"])
def test_when_the_first_of_a_group_ends_early_the_others_are_served(tiny: Model, how: str) -> None:
    clock = FakeClock()
    engine = make_engine(tiny, clock=clock)
    specs = group_specs(4)
    run = Run()
    run.add(engine.admit(specs[0], timeout_s=5 if how == "timed_out" else None))
    for s in specs[1:]:
        run.add(engine.admit(s))
    run.add(engine.cancel("g3"))  # a waiting one cancelled: it just leaves
    assert run.ended["g3"].status is RequestStatus.CANCELLED and run.kinds("g3") == []
    if how == "cancelled":
        run.add(engine.cancel("g0"))
        assert run.ended["g0"].status is RequestStatus.CANCELLED
        # The next in line computes the prompt now, and the last waits on it in turn.
        assert engine.find("g1").status is RequestStatus.PREFILLING
        assert engine.find("g2").status is RequestStatus.WAITING
    else:  # expired at the step's start: g1 takes its place and prefills in that step
        clock.advance(6)
        run.add(engine.step())
        assert_failed(run, "g0", "timeout")
    run_until_done(engine, 60, run)
    want = alone(tiny, specs[1])
    for rid, cached in (("g1", 0), ("g2", len(GROUP_PROMPT) - 1)):
        assert_length_finish(run, rid, want.tokens("g1"))
        assert run.last(rid).cached_tokens == cached
    assert run.counters["batch_prefill_tokens"] == want.counters["batch_prefill_tokens"]
    assert engine.active == 0


def test_a_group_on_a_prompt_cache_hit_shares_the_adopted_prefix(tiny: Model) -> None:
    pc = make_cache(tiny, "dense")
    engine = make_engine(tiny, pc)
    first = Run()
    first.add(engine.admit(spec("A", LONG)))
    run_until_done(engine, 40, first)
    prompt = LONG + first.tokens("A") + [42, 43, 44]
    specs = group_specs(3, prompt)
    run = Run()
    for s in specs:
        run.add(engine.admit(s))
    # The first adopts the cached prefix (a dense entry leaves the store) and starts in one
    # pass; the others copy its KV: one lookup, the prompt's remainder computed once.
    c = run.counters
    assert (c["lookups"], c["hits"]) == (1, 1)
    assert c["batch_prefill_tokens"] == len(prompt) - run.events["g0"][0].cached_tokens
    run_until_done(engine, 40, run)
    want = reference_tokens(tiny, prompt, MAX_TOKENS)
    for s in specs:
        assert_length_finish(run, s.request_id, want)
    assert [run.last(s.request_id).cached_tokens for s in specs[1:]] == [len(prompt) - 1] * 2


# -- prompt logprobs (completions echo with logprobs) -------------------------------------------
def test_prompt_logprobs_are_what_a_greedy_continuation_reports(tiny: Model) -> None:
    cont = alone(tiny, spec("c", P1, max_tokens=8, logprobs=2))
    reported = [e for ev in cont.events["c"] if ev.kind == "delta" for e in ev.logprobs]
    prompt = P1 + cont.tokens("c")  # the short prompt and its greedy continuation
    scored = alone(tiny, spec("s", prompt, prompt_logprobs=2))
    start = scored.events["s"][0]
    assert start.kind == "start" and len(start.prompt_logprobs) == len(prompt) - 1
    # Prompt token i's entry (index i - 1) is what the model reported when it generated it.
    for got, want in zip(start.prompt_logprobs[len(P1) - 1 :], reported, strict=True):
        assert got[1] == want[1]  # the same alternatives, in the same order
        np.testing.assert_allclose([got[0], *got[2]], [want[0], *want[2]], atol=1e-4)
    # The scoring pass is the prefill: the same tokens, and the prompt computed once.
    lone = alone(tiny, spec("s", prompt))
    assert_length_finish(scored, "s", lone.tokens("s"))
    assert scored.counters["batch_prefill_tokens"] == lone.counters["batch_prefill_tokens"]

    # max_tokens 0: the prompt's logprobs only, ended by the step that scores its one chunk;
    # its KV goes to the cache.
    engine = make_engine(tiny, make_cache(tiny, "dense"))
    only = Run()
    admitted = only.add(engine.admit(spec("z", LONG, max_tokens=0, prompt_logprobs=0)))
    assert admitted.prefill_pending and engine.find("z").status is RequestStatus.SCORING
    done = only.add(engine.step())
    assert [e.request.id for e in done.ended] == ["z"] and engine.active == 0
    assert only.kinds("z") == ["start", "done"]
    assert (only.last("z").finish_reason, only.last("z").completion_tokens) == ("length", 0)
    z = only.events["z"][0].prompt_logprobs
    assert len(z) == len(LONG) - 1 and all(e[1:] == [[], []] and e[0] <= 0 for e in z)
    assert done.counters["inserts"] == 1 and done.counters["batch_prefill_tokens"] == len(z)


def test_a_group_asking_for_prompt_logprobs_scores_the_prompt_once(tiny: Model) -> None:
    specs = group_specs(3, LONG, prompt_logprobs=1, echo=True)
    engine = make_engine(tiny)
    run = Run()
    for s in specs:
        run.add(engine.admit(s))
    run.add(engine.step())
    starts = [run.events[s.request_id][0] for s in specs]
    # The first scores (and so prefills) the prompt in a step; the others take both from it.
    assert all(len(st.prompt_logprobs) == len(LONG) - 1 for st in starts)
    assert starts[1].prompt_logprobs == starts[2].prompt_logprobs == starts[0].prompt_logprobs
    assert [st.cached_tokens for st in starts] == [0, len(LONG) - 1, len(LONG) - 1]
    assert run.counters["batch_prefill_tokens"] == len(LONG) - 1
    run_until_done(engine, 40, run)
    want = alone(tiny, spec("w", LONG, echo=True))
    assert all(run.tokens(s.request_id) == want.tokens("w") for s in specs)
    assert all(run.text(s.request_id) == want.text("w") for s in specs)
    assert run.counters["batch_prefill_tokens"] == len(LONG) - 1


def test_a_completion_keeps_its_leading_space_echoed_or_not(tiny: Model) -> None:
    """mlx-lm's detokenizer drops the first leading space of an output; every completion
    continues the prompt's text, so its text is what decoding prompt and completion gives."""
    prompt = list(tiny.tokenizer.encode("1, 2, 3, 4, 5,"))
    echoed = alone(tiny, spec("e", prompt, echo=True))
    plain = alone(tiny, spec("e", prompt))
    assert echoed.tokens("e") == plain.tokens("e")
    whole = tiny.tokenizer.decode(prompt + echoed.tokens("e"))
    assert tiny.tokenizer.decode(prompt) + echoed.text("e") == whole
    assert echoed.text("e").startswith(" ") and echoed.text("e") == plain.text("e")


def test_an_idle_step_gives_mlx_buffer_cache_back(tiny: Model) -> None:
    """Once the engine has been idle `idle_release_s`, its next step empties MLX's cache of freed
    buffers when they are worth giving back (a bar of 0 here: any spare is): an idle worker's
    memory does not keep its busiest batch's peak."""
    import mlx.core as mx

    clock = FakeClock()
    engine = make_engine(tiny, clock=clock)
    engine.release_share = 0.0
    run = Run()
    for i in range(4):
        run.add(engine.admit(spec(f"r{i}", list(range(10 + i, 60 + i)), max_tokens=8)))
    run_until_done(engine, 64, run)
    engine.step()  # idle, but only just: a next request would reuse the buffers
    assert mx.get_cache_memory() > 0  # the batch's freed buffers, kept for reuse
    clock.advance(engine.config.idle_release_s - 0.5)
    engine.step()  # a burst coming back this soon still finds them
    assert mx.get_cache_memory() > 0
    clock.advance(0.5)
    engine.step()
    assert mx.get_cache_memory() == 0
    # ...and a request after it runs as before.
    again = Run()
    again.add(engine.admit(spec("later", list(range(10, 60)), max_tokens=8)))
    run_until_done(engine, 40, again)
    assert again.tokens("later") == run.tokens("r0")


def test_an_idle_step_keeps_spare_memory_under_the_bar(tiny: Model) -> None:
    """Spare memory under release_share of the memory in use (one sequence's few buffers, which
    the next request would fault back in) stays cached through the idle release, and the
    engine does not look again until it has worked."""
    import mlx.core as mx

    clock = FakeClock()
    engine = make_engine(tiny, clock=clock)
    engine.release_share = 1e9  # no spare is worth it
    run = Run()
    run.add(engine.admit(spec("r0", list(range(10, 60)), max_tokens=8)))
    run_until_done(engine, 40, run)
    engine.step()
    # Buffers still on their way to the cache (a cycle's arrays the GC has yet to free, work
    # the stream thread has yet to finish) land before the count, not between the looks.
    gc.collect()
    mx.synchronize()
    cached = mx.get_cache_memory()
    assert cached > 0
    clock.advance(engine.config.idle_release_s)
    engine.step()
    assert mx.get_cache_memory() >= cached  # a release would have emptied it
    engine.release_share = 0.0  # looked once already: nothing until the engine works again
    clock.advance(engine.config.idle_release_s)
    engine.step()
    assert mx.get_cache_memory() >= cached


def test_spare_memory_is_worth_releasing_above_its_share() -> None:
    """The bar compares MLX's cache and glibc's free heap with MLX's memory in use."""
    import mlx.core as mx

    from worker.mlx_cpu.idle_memory import spare_bytes, worth_releasing

    held = mx.ones((1 << 20,))  # 4 MiB in use while the bar is asked
    mx.eval(held)
    freed = mx.ones((1 << 18,)) + 1  # a freed buffer lands in the cache
    mx.eval(freed)
    del freed
    assert spare_bytes() >= mx.get_cache_memory() > 0
    assert worth_releasing(0.0)
    assert not worth_releasing(1e9)
