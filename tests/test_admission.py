"""Admission over arbitrary request bodies (hypothesis), with the real tiny model's tokenizer: a
body is refused with a 4xx error that names a param and encodes as UTF-8, or it is admitted as
a request the worker's wire decoder accepts unchanged. Nothing in between is a 500."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from router.admission.admit import (
    MAX_STOP_SEQUENCES,
    Admission,
    AdmissionContext,
    Outcome,
    admit_chat,
    admit_completion,
)
from router.admission.tokenization import load_tokenizer
from router.edge.errors import error_body, validation_failure
from router.edge.openai_types import ChatCompletionRequest, CompletionRequest
from shared.wire import MAX_SEED, GenerationRequest, pack, unpack

MODEL = "served-model"  # the id admission is told it serves (the tiny model, renamed)

CLEAN = st.text(max_size=12)
# Text as JSON decoding hands it over: lone surrogates included.
TEXT = CLEAN | st.text(st.characters() | st.sampled_from(["\ud800", "\udfff"]), max_size=12)
JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)

# Each field's plausible values; `bodies` sets one field to any JSON value for the rest.
SAMPLING = {
    "max_tokens": st.integers(1, 64),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0, 1, exclude_min=True),
    "seed": st.integers(0, MAX_SEED),
    "stop": CLEAN | st.lists(CLEAN, max_size=MAX_STOP_SEQUENCES),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "user": CLEAN,
    "prompt_cache_key": CLEAN,
    "n": st.just(1),
    # Each type, with its payload well formed or any JSON (router.admission.structured_output).
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema", "regex", "grammar"])},
        optional={
            "json_schema": st.fixed_dictionaries(
                {"name": CLEAN}, optional={"schema": JSON | st.just({"type": "integer"})}
            )
            | JSON,
            "regex": TEXT | st.just("[a-z]{1,4}"),
            "grammar": TEXT | st.just('start: "yes" | "no"'),
        },
    ),
}
CONTENT = CLEAN | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": CLEAN}))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "robot"]), "content": CONTENT},
    optional={"name": CLEAN},
)
COMPLETION = {
    "prompt": CLEAN | st.lists(st.integers(0, 1000), max_size=8) | st.lists(CLEAN, max_size=1)
}
CHAT = {"messages": st.lists(MESSAGE, max_size=3)}
CHAT_SAMPLING = {**SAMPLING, "max_completion_tokens": st.integers(1, 64)}


@st.composite
def bodies(
    draw: st.DrawFn,
    required: dict[str, st.SearchStrategy[Any]],
    optional: dict[str, st.SearchStrategy[Any]],
) -> Any:
    """Mostly plausible bodies; some with one field set to any JSON value; a few not objects."""
    kind = draw(st.sampled_from(["plausible", "plausible", "one odd field", "any JSON"]))
    if kind == "any JSON":
        return draw(JSON)
    fields = {"model": st.just(MODEL), **required}
    body = draw(st.fixed_dictionaries(fields, optional=optional))
    if kind == "one odd field":
        body[draw(st.sampled_from([*fields, *optional]))] = draw(JSON)
    return body


@pytest.fixture(scope="module")
def ctx(tiny_model_dir: Path) -> AdmissionContext:
    tokenizer = load_tokenizer(tiny_model_dir)
    return AdmissionContext(model_id=MODEL, tokenizer=tokenizer, default_max_tokens=16)


def assert_encodes(body: dict[str, Any]) -> None:
    # What JSONResponse does with an error body: it must never fail (that was the 500).
    json.dumps(body, ensure_ascii=False).encode("utf-8")


def check(
    raw: Any,
    model: type[CompletionRequest | ChatCompletionRequest],
    admit: Callable[[Any, AdmissionContext], Admission],
    ctx: AdmissionContext,
) -> None:
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        # FastAPI puts the request part first in each location.
        errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
        message, _ = validation_failure(errors)
        event("refused by the request model")
        assert_encodes(error_body(message, "invalid_request_error"))
        return
    admission = admit(body, ctx)
    event(f"admission: {admission.outcome}")
    if admission.outcome is not Outcome.ADMIT:
        err = admission.error()
        assert 400 <= err.status < 500 and err.param
        assert_encodes(err.body())
        return
    req = admission.request
    assert isinstance(req, GenerationRequest)
    assert GenerationRequest.from_wire(unpack(pack(req.to_wire()))) == req


PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.pool  # its grammars compile in router.admission.grammar_sandbox helper processes
@PROPERTY
@given(bodies(COMPLETION, SAMPLING))
def test_any_completion_body_is_refused_or_admitted_for_the_wire(
    ctx: AdmissionContext, raw: Any
) -> None:
    check(raw, CompletionRequest, admit_completion, ctx)


@PROPERTY
@given(bodies(CHAT, CHAT_SAMPLING))
def test_any_chat_body_is_refused_or_admitted_for_the_wire(ctx: AdmissionContext, raw: Any) -> None:
    check(raw, ChatCompletionRequest, admit_chat, ctx)
