"""Structured outputs (`response_format`) on the real tiny model, whose random weights write no
JSON of their own: whatever comes out parses and validates only because the grammar allowed
nothing else.

In-process through the Engine (as tests/test_engine.py): a constrained sequence beside an
unconstrained one, logit_bias against the mask, the fast start, a rejected token failing its
request alone, a grammar the worker cannot compile. Then through a real pool (router
processes, a worker, Redis, HTTP): the OpenAI shapes on both endpoints, streamed and not, the
extensions (regex, Lark grammar) and the 400s naming `response_format`.
"""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher

from router.admission.structured_output import JSON_DEFAULTS
from shared.model_facts import model_facts
from shared.wire import MAX_GRAMMAR_BYTES
from tests.pool_fixture import ok, post, sse_events
from tests.test_engine import (
    LONG,
    P1,
    P2,
    P3,
    Model,
    Run,
    alone,
    assert_failed,
    make_cache,
    make_engine,
    run_until_done,
    spec,
)

# Bounded: every string has a maxLength, the integer two digits, no extra properties, JSON
# compact, so the grammar itself ends the object well within MAX_TOKENS.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "color": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "color", "ok", "count"],
    "additionalProperties": False,
}
MAX_TOKENS = 160
REGEX = r"[A-Z]{2}-[0-9]{3}"
SPECIAL = 2  # <|pad|>: a special token (not an EOS), which no JSON grammar ever allows


def assert_matches_schema(text: str) -> dict[str, Any]:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == set(SCHEMA["required"]), value
    assert isinstance(value["name"], str) and len(value["name"]) <= 10
    assert value["color"] in ("red", "green", "blue")
    assert type(value["ok"]) is bool
    assert type(value["count"]) is int and 0 <= value["count"] <= 99
    return value


def schema_grammar() -> str:
    return LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_DEFAULTS)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Model:
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_dir))
    facts = model_facts(tiny_model_dir)
    return Model(model, tokenizer, facts.model_id, facts.context_length)


# -- in the engine -----------------------------------------------------------------------------


def test_a_constrained_sequence_beside_a_plain_one(tiny: Model) -> None:
    """One batch: the constrained sequences (greedy, and sampled with a +100 bias on a token
    the grammar never allows) end on EOS with valid JSON; the plain one decodes as alone."""
    grammar = schema_grammar()
    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(spec("json", P1, MAX_TOKENS, grammar=grammar)))
    run.add(engine.admit(spec("plain", P2, 16)))
    hot = {"temperature": 1.5, "seed": 7, "logit_bias": {SPECIAL: 100.0}}
    run.add(engine.admit(spec("hot", P3, MAX_TOKENS, grammar=grammar, **hot)))
    run_until_done(engine, 4 * MAX_TOKENS, run)
    for rid in ("json", "hot"):
        done = run.last(rid)
        assert (done.kind, done.finish_reason) == ("done", "stop"), done
        assert_matches_schema(run.text(rid))
        assert SPECIAL not in run.tokens(rid)
    assert run.tokens("plain") == alone(tiny, spec("plain", P2, 16)).tokens("plain")
    # The same bias without the grammar does force the token: the mask is what stopped it.
    assert alone(tiny, spec("b", P3, 8, **hot)).tokens("b") == [SPECIAL] * 8


def test_a_regex_grammar_is_matched_whole(tiny: Model) -> None:
    run = alone(tiny, spec("re", P1, 32, grammar=LLMatcher.grammar_from_regex(REGEX)))
    assert run.last("re").finish_reason == "stop"
    assert re.fullmatch(REGEX, run.text("re")), run.text("re")


def test_the_fast_start_applies_the_grammar(tiny: Model) -> None:
    """A warm request's first token is sampled in admit, outside BatchGenerator: masked, and
    consumed by its matcher before BatchGenerator's first call."""
    pc = make_cache(tiny, "dense")
    engine = make_engine(tiny, pc)
    first = Run()
    first.add(engine.admit(spec("A", LONG)))
    run_until_done(engine, 40, first)
    warm = Run()
    prompt = LONG + first.tokens("A") + [42, 43]
    admitted = warm.add(engine.admit(spec("B", prompt, MAX_TOKENS, grammar=schema_grammar())))
    assert not admitted.prefill_pending and warm.kinds("B") == ["start", "delta"]
    run_until_done(engine, 4 * MAX_TOKENS, warm)
    assert warm.last("B").finish_reason == "stop"
    assert_matches_schema(warm.text("B"))


def test_a_rejected_token_fails_its_request_alone(tiny: Model) -> None:
    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(spec("bad", P1, 40, grammar=schema_grammar())))
    run.add(engine.admit(spec("good", P2, 12)))
    run.add(engine.step())
    # As if a token past the mask had been sampled: the matcher refuses it.
    req = engine.find("bad")
    assert req is not None and req.grammar is not None
    req.grammar.advance([SPECIAL])
    run_until_done(engine, 60, run)
    assert_failed(run, "bad", "invalid_request_error")
    assert "response_format" in run.last("bad").error
    assert run.last("good").finish_reason == "length"
    assert run.tokens("good") == alone(tiny, spec("good", P2, 12)).tokens("good")


def test_a_pathological_regex_fails_its_request_alone_and_soon(tiny: Model) -> None:
    """It compiles lazily (the router's check passes it); llguidance's lexer limits
    (shared.wire.GRAMMAR_LIMITS) end it within the first steps, not the batch, as the caller's
    error (a 400), not the server's."""
    engine = make_engine(tiny)
    run = Run()
    run.add(
        engine.admit(spec("re", P1, 40, grammar=LLMatcher.grammar_from_regex("(a{1000}){1000}")))
    )
    run.add(engine.admit(spec("good", P2, 12)))
    started = time.monotonic()
    run_until_done(engine, 60, run)
    assert time.monotonic() - started < 10
    assert_failed(run, "re", "invalid_request_error")
    assert run.tokens("good") == alone(tiny, spec("good", P2, 12)).tokens("good")


def test_a_grammar_the_worker_cannot_compile_fails_at_admission(tiny: Model) -> None:
    engine = make_engine(tiny)
    run = Run()
    run.add(engine.admit(spec("g", P1, grammar="start: undefined_rule")))
    assert run.kinds("g") == ["error"] and engine.active == 0
    assert run.last("g").error_type == "invalid_request_error"


# -- through the pool --------------------------------------------------------------------------

PROMPT = "1, 2, 3, 4, 5,"
CHAT = [{"role": "user", "content": PROMPT}]
JSON_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
}


@pytest.fixture(scope="module")
def pool(shared_pool: Any) -> Any:
    return shared_pool  # the session's pool: this module needs no settings of its own


def chat(pool: Any, **body: Any) -> dict[str, Any]:
    out = ok(post(pool, "/v1/chat/completions", {"messages": CHAT, **body}))
    return out["choices"][0]


def complete(pool: Any, **body: Any) -> dict[str, Any]:
    return ok(post(pool, "/v1/completions", {"prompt": PROMPT, **body}))["choices"][0]


@pytest.mark.pool
def test_json_schema_on_both_endpoints_streamed_and_not(pool: Any) -> None:
    body = {"response_format": JSON_SCHEMA, "max_tokens": MAX_TOKENS}
    message = chat(pool, **body)
    assert message["finish_reason"] == "stop"
    assert_matches_schema(message["message"]["content"])
    text = complete(pool, **body, temperature=1.0, seed=5)
    assert text["finish_reason"] == "stop"
    assert_matches_schema(text["text"])
    resp = post(pool, "/v1/chat/completions", {"messages": CHAT, **body, "stream": True})
    assert resp.status_code == 200, resp.text
    choices = [c["choices"][0] for c in sse_events(resp) if c["choices"]]
    streamed = "".join(c["delta"].get("content") or "" for c in choices)
    assert streamed == message["message"]["content"]
    assert choices[-1]["finish_reason"] == "stop"
    resp = post(
        pool,
        "/v1/completions",
        {"prompt": PROMPT, **body, "stream": True, "n": 2, "temperature": 1.0, "seed": 9},
    )
    assert resp.status_code == 200, resp.text
    texts = {0: "", 1: ""}
    for c in sse_events(resp):
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
    for t in texts.values():
        assert_matches_schema(t)


@pytest.mark.pool
def test_without_response_format_the_same_prompt_is_not_json(pool: Any) -> None:
    text = complete(pool, max_tokens=MAX_TOKENS)["text"]
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.pool
def test_regex_and_lark_grammar_extensions(pool: Any) -> None:
    out = complete(pool, response_format={"type": "regex", "regex": REGEX}, max_tokens=32)
    assert out["finish_reason"] == "stop" and re.fullmatch(REGEX, out["text"]), out
    lark = 'start: answer " because " reason\nanswer: "yes" | "no"\nreason: /[a-z]{1,8}/'
    out = chat(
        pool,
        response_format={"type": "grammar", "grammar": lark},
        max_tokens=32,
        temperature=1.0,
        seed=2,
    )
    assert out["finish_reason"] == "stop"
    assert re.fullmatch(r"(yes|no) because [a-z]{1,8}", out["message"]["content"]), out


@pytest.mark.pool
def test_json_object(pool: Any) -> None:
    """Any JSON object: random weights may fill a key forever, so what can be asserted at the
    length limit is the object's start; steered by logit_bias to '}' it closes at once."""
    out = chat(pool, response_format={"type": "json_object"}, max_tokens=MAX_TOKENS)
    text = out["message"]["content"]
    if out["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert out["finish_reason"] == "length" and text.startswith("{")
    closing = {"97": 100}  # '}' (token 97): allowed only where the object may end
    out = chat(
        pool, response_format={"type": "json_object"}, logit_bias=closing, max_tokens=MAX_TOKENS
    )
    assert out["finish_reason"] == "stop" and json.loads(out["message"]["content"]) == {}


@pytest.mark.pool
def test_constrained_and_plain_requests_together(pool: Any) -> None:
    plain = complete(pool, max_tokens=24)
    bodies = [{"response_format": JSON_SCHEMA, "max_tokens": MAX_TOKENS}, {"max_tokens": 24}] * 2
    with ThreadPoolExecutor(len(bodies)) as ex:
        outs = list(ex.map(lambda b: complete(pool, **b), bodies))
    for body, out in zip(bodies, outs, strict=True):
        if "response_format" in body:
            assert out["finish_reason"] == "stop"
            assert_matches_schema(out["text"])
        else:
            assert (out["text"], out["finish_reason"]) == (plain["text"], plain["finish_reason"])


BAD_FORMATS: list[Any] = [
    {"type": "xml"},
    {"type": None},
    {"text": "json"},
    {"type": "json_schema"},
    {"type": "json_schema", "json_schema": {"schema": SCHEMA}},  # no name
    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
    {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": "yes"}},
    {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?=a)b"}},
    },  # look-around: not a regex llguidance takes
    {"type": "regex", "regex": "a(b"},
    {"type": "regex"},
    {"type": "grammar", "grammar": "start: undefined_rule"},
    {
        "type": "json_schema",
        "json_schema": {
            "name": "x",
            "schema": {"type": "object", "description": "x" * MAX_GRAMMAR_BYTES},
        },
    },
    "json_object",
]


@pytest.mark.pool
@pytest.mark.parametrize("fmt", BAD_FORMATS)
def test_bad_formats_are_400_naming_response_format(pool: Any, fmt: Any) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": CHAT}),
        ("/v1/completions", {"prompt": PROMPT}),
    ):
        resp = post(pool, path, {**body, "max_tokens": 4, "response_format": fmt})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["type"] == "invalid_request_error", err
        assert err["param"] == "response_format" and err["message"], err
