"""A request whose grammar crashes llguidance fails alone (issue 19): the helper processes that
run llguidance's check for a router process (router/admission/grammar_sandbox.py), on the real
llguidance and the tiny model's tokenizer; then a real pool whose one router process answers the
$ref chain (as a response_format and as a forced tool call's parameters) with a 400 while its other
streams finish, quotes a huge unknown model name short, and refuses a prompt past the tokenizer's
character bound untokenized."""

from __future__ import annotations

import ctypes
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from llguidance import LLMatcher

from router.admission import structured_output
from router.admission.grammar_sandbox import GrammarSandbox, HelperCrashed, HelperTimeout, sandbox
from router.admission.structured_output import JSON_DEFAULTS, FormatError, grammar_for
from router.admission.tokenization import PromptTokenizer, load_tokenizer
from tests.pool_fixture import TINY_MODEL, ok, post, running_pool, sse_events
from tests.test_schema_limits import ref_chain
from tests.test_structured_output import JSON_SCHEMA, assert_matches_schema
from tests.test_tool_calls import TOOLS_TEMPLATE

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> PromptTokenizer:
    return load_tokenizer(tiny_model_dir)


def test_a_helper_that_segfaults_fails_its_call_and_is_replaced() -> None:
    box = GrammarSandbox(helpers=1)
    try:
        assert box.call(len, "abc") == 3
        first = box._free.get_nowait()
        box._free.put(first)
        with pytest.raises(HelperCrashed, match="SIGSEGV"):
            box.call(ctypes.string_at, 0)  # reads address 0: a real segmentation fault
        assert first.proc.returncode is not None and first.proc.returncode < 0
        assert box.call(len, "abcd") == 4  # a new helper
        with pytest.raises(HelperTimeout):
            GrammarSandbox(helpers=1, timeout_s=0.5).call(time.sleep, 30)
    finally:
        box.close()


def test_the_real_chain_past_the_bounds_crashes_a_helper_not_the_router(
    tok: PromptTokenizer,
) -> None:
    """The bounds skipped (the grammar handed straight to the check): llguidance segfaults in
    the helper; this request gets a FormatError saying so and the next is served."""
    chain = LLMatcher.grammar_from_json_schema(json.dumps(ref_chain(3000)), defaults=JSON_DEFAULTS)
    with pytest.raises(FormatError, match="the grammar compiler crashed on it") as exc:
        structured_output._validate(chain, tok)
    assert "SIGSEGV" in str(exc.value)
    assert grammar_for(JSON_SCHEMA, tok) is not None
    with pytest.raises(FormatError, match=r"has 3001 \$refs; at most 256"):
        chain = {"name": "x", "schema": ref_chain(3000)}
        grammar_for({"type": "json_schema", "json_schema": chain}, tok)


def test_the_helpers_are_reused_not_started_per_request(tok: PromptTokenizer) -> None:
    grammar_for(JSON_SCHEMA, tok)  # the helper started, the tokenizer loaded
    started = sandbox()._started
    for _ in range(50):
        assert grammar_for(JSON_SCHEMA, tok) is not None
    assert started >= 1 and sandbox()._started == started  # no process per request


# -- through a pool ----------------------------------------------------------------------------

PROMPT = "1, 2, 3, 4, 5,"
STREAM_TOKENS = 96


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with running_pool(
        tiny_model_dir,
        tmp_path_factory.mktemp("containment"),
        env={"MLXCEL_TRUST_REQUEST_CHAT_TEMPLATE": "true"},
        overrides={"worker": {"batch_size": 4}, "router": {"processes": 1}},
    ) as p:
        yield p


def _stream(pool: Any, seed: int) -> tuple[str, int, str | None]:
    """(text, completion tokens, finish reason) of a streamed completion."""
    body = {
        "prompt": PROMPT,
        "max_tokens": STREAM_TOKENS,
        "stream": True,
        "temperature": 1.0,
        "seed": seed,
        "stream_options": {"include_usage": True},
    }
    resp = post(pool, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    assert resp.text.rstrip().endswith("data: [DONE]")
    chunks = sse_events(resp)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    return text, chunks[-1]["usage"]["completion_tokens"], finish


def test_the_ref_chain_is_a_400_and_the_routers_other_streams_finish(pool: Any) -> None:
    alone = {seed: _stream(pool, seed) for seed in (1, 2, 3)}
    schema_fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": ref_chain(3000)}}
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"v": ref_chain(3000)}},
        },
    }
    bad = [
        (
            "/v1/completions",
            {"prompt": "x", "max_tokens": 4, "response_format": schema_fmt},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4,
                "response_format": schema_fmt,
            },
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 4,
                "chat_template": TOOLS_TEMPLATE,
                "tools": [tool],
                "tool_choice": "required",
            },
            "tools",
        ),
    ]
    pid = pool.pid("router")  # one router process: uvicorn runs the app in it
    with ThreadPoolExecutor(6) as ex:
        streams = {seed: ex.submit(_stream, pool, seed) for seed in alone}
        time.sleep(0.3)  # the streams under way
        answers = [(ex.submit(post, pool, path, body), param) for path, body, param in bad * 2]
        for fut, param in answers:
            resp = fut.result()
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == param and "at most 256 are accepted" in err["message"], err
        for seed, fut in streams.items():
            text, n, finish = fut.result()
            assert (text, n, finish) == alone[seed]
    assert pool.pid("router") == pid and _alive(pid)  # the same router process served it all
    # A schema that is fine still compiles and is enforced.
    out = ok(
        post(
            pool,
            "/v1/completions",
            {"prompt": PROMPT, "max_tokens": 160, "response_format": JSON_SCHEMA},
        )
    )
    assert_matches_schema(out["choices"][0]["text"])


def _alive(pid: int) -> bool:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def test_an_unknown_model_of_megabytes_is_quoted_short(pool: Any) -> None:
    name = "m" * 1_000_000
    resp = httpx.post(
        f"{pool.url}/v1/completions",
        timeout=60,
        json={"model": name, "prompt": "x", "max_tokens": 1},
    )
    assert resp.status_code == 404
    assert len(resp.content) < 2000
    err = resp.json()["error"]
    assert err["code"] == "model_not_found" and "(1000000 characters)" in err["message"]
    assert TINY_MODEL in err["message"]
    resp = httpx.get(f"{pool.url}/v1/models/{'m' * 5000}", timeout=60)
    assert resp.status_code == 404 and "(5000 characters)" in resp.json()["error"]["message"]


def test_a_prompt_past_the_tokenizers_bound_is_refused_untokenized(
    pool: Any, tok: PromptTokenizer
) -> None:
    text = "x" * (tok.max_chars + 1)  # under the general bound of 64 characters a token
    for path, body, param in (
        ("/v1/completions", {"prompt": text}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}, "messages"),
    ):
        resp = post(pool, path, {**body, "max_tokens": 1})
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert f"at most {tok.max_chars} characters" in err["message"]
