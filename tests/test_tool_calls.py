"""Chat for tools and agents: every role, `tools` / `tool_choice` / `chat_template_kwargs` reaching
the chat template, and tool calls parsed from the output (router.admission.tool_calls) into
`tool_calls`.

The tiny model has random weights and a 1024-token vocabulary with no tool-call tokens: left to
itself it never writes a tool call. So the parsing is tested on mlx-lm's real parsers with real
text, end to end through a router whose worker the test plays (tests.test_router_relay), writing
a tool call as text deltas split mid-marker, and on a real pool: the template rendering tools,
roles and template variables, and a call the model writes under a regex response_format.
"""

# The relay fixtures are imported by name and taken as arguments of the same name.
# ruff: noqa: F811

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
import redis
from pydantic import BaseModel, ConfigDict, SecretStr

from router.admission.tool_calls import ToolCallStream, infer_parser_name, load_parser
from shared.wire import StreamEvent
from tests.test_router_relay import (  # noqa: F401  (fixtures)
    hf,
    model_id,
    play,
    pool,
    post,
    r,
    router_url,
    sse_lines,
    take_job,
)

# A Qwen-style template: tools in a system block, calls as <tool_call>{json}</tool_call>
# (mlx-lm infers its json_tools parser from it), tool results with their call id, a variable.
TOOLS_TEMPLATE = (
    "{%- if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{%- if tools %}<|im_start|>system\n# Tools\n"
    "{%- for tool in tools %}\n{{ tool.function.name }}: {{ tool | tojson }}{%- endfor %}\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}{{ '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content %}{{ message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '<tool_call>{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}'
    "</tool_call>{%- endfor %}"
    "{%- if message.role == 'tool' %} [{{ message.tool_call_id }}]{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)

# A template that renders tools but names no tool-call format mlx-lm knows.
PLAIN_TEMPLATE = (
    "{%- for tool in tools or [] %}{{ tool.function.name }}\n{%- endfor %}"
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}\n{%- endfor %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}

# A multi-turn tool conversation exactly as the OpenAI SDK sends it back.
SDK_TURNS: list[dict[str, Any]] = [
    {"role": "developer", "content": "Use tools."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


def as_template_sees(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages the router renders: developer as system (the template has no such role),
    text parts joined, null content as "", arguments as a JSON object."""
    out = []
    for m in turns:
        m = dict(m)
        if m["role"] == "developer":
            m["role"] = "system"
        if isinstance(m.get("content"), list):
            m["content"] = "".join(p["text"] for p in m["content"])
        if m.get("content") is None:
            m["content"] = ""
        if "tool_calls" in m:
            m["tool_calls"] = [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.loads(c["function"]["arguments"]),
                    },
                }
                for c in m["tool_calls"]
            ]
        out.append(m)
    return out


def json_stream(
    tools: list[dict[str, Any]] | None = None, max_calls: int | None = None
) -> ToolCallStream:
    parser = load_parser("json_tools")
    assert parser is not None
    return ToolCallStream(parser, tools, max_calls)


def feed_all(stream: ToolCallStream, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    content, calls = [], []
    for piece in [*pieces, None]:
        text, new = stream.finish() if piece is None else stream.feed(piece)
        content.append(text)
        calls.extend(new)
    return "".join(content), calls


# --- the parser, on mlx-lm's real parsers -------------------------------------------------------


def test_template_picks_mlx_lm_parser(hf: Any) -> None:
    assert infer_parser_name(TOOLS_TEMPLATE) == "json_tools"
    # The tiny model's own template writes Hermes-style calls (devmodel.builder).
    assert infer_parser_name(hf.chat_template, hf.get_vocab()) == "json_tools"
    assert infer_parser_name("{{ '<tool_call>\\n<function=' }}") == "qwen3_coder"


@pytest.mark.pool
def test_router_loads_parsers_without_mlx() -> None:
    code = (
        "import sys; from router.admission.tool_calls import load_parser\n"
        "for name in ('json_tools', 'qwen3_coder', 'laguna', 'mistral'):\n"
        "    assert load_parser(name) is not None, name\n"
        "assert load_parser('no_such_parser') is None\n"
        "assert not [m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm'))]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_stream_splits_content_and_calls(size: int) -> None:
    text = (
        'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
        '</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
        "</tool_call> Done <tool"
    )
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    content, calls = feed_all(json_stream(), pieces)
    assert content == "Let me check.  Done <tool"
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_weather", "arguments": '{"city": "Rome"}'},
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("size", [1, 7, 1000])
def test_one_call_at_most_keeps_the_first(size: int) -> None:
    """`parallel_tool_calls: false`: the first parsed call is kept, a later one dropped (its
    text too, as vLLM does); the content around them is unchanged."""
    pieces = [TWO_CALLS[i : i + size] for i in range(0, len(TWO_CALLS), size)]
    content, calls = feed_all(json_stream(max_calls=1), pieces)
    assert content == "Let me check.  Done"
    assert [c["function"] for c in calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]


def test_marker_text_is_never_content_while_streaming() -> None:
    stream = json_stream()
    assert stream.feed("Hi <tool_") == ("Hi ", [])
    assert stream.feed('call>{"name": "f", ') == ("", [])
    text, calls = stream.feed('"arguments": {}}</tool_call>')
    assert text == "" and calls[0]["function"] == {"name": "f", "arguments": "{}"}


def test_unparsable_or_open_call_is_content() -> None:
    bad = "<tool_call>not json</tool_call>"
    assert feed_all(json_stream(), [bad, " ok"]) == (bad + " ok", [])
    # Cut off by max_tokens: an open call parses if it is whole, else it is content.
    content, calls = feed_all(json_stream(), ['<tool_call>{"name": "f", "arguments": {}}'])
    assert content == "" and calls[0]["function"]["name"] == "f"
    assert feed_all(json_stream(), ['<tool_call>{"name": "f"']) == ('<tool_call>{"name": "f"', [])


def test_qwen3_coder_types_arguments_by_the_tools() -> None:
    parser = load_parser("qwen3_coder")
    assert parser is not None
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    content, calls = feed_all(ToolCallStream(parser, [WEATHER]), [text])
    assert content == ""
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}


# --- through the router, the test playing the worker --------------------------------------------

CALL_TEXT = 'Sure.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TWO_CALLS = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    '</tool_call><tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}'
    "</tool_call> Done"
)


def call_events(prompt_len: int, text: str = CALL_TEXT) -> list[StreamEvent]:
    cut = text.index("<tool_call>") + 4  # a delta ends inside the start marker
    return [
        StreamEvent(kind="start", worker_id="w1", prompt_tokens=prompt_len),
        StreamEvent(kind="delta", text=text[:cut], token_ids=[1]),
        StreamEvent(kind="delta", text=text[cut:-5], token_ids=[2]),
        StreamEvent(kind="delta", text=text[-5:], token_ids=[3]),
        StreamEvent(
            kind="done", finish_reason="stop", prompt_tokens=prompt_len, completion_tokens=3
        ),
    ]


def tools_body(model_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model_id,
        "messages": SDK_TURNS,
        "tools": [WEATHER],
        "chat_template": TOOLS_TEMPLATE,
        **extra,
    }


def test_relay_renders_tools_and_parses_the_call(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, hf: Any, model_id: str
) -> None:
    body = tools_body(model_id, tool_choice="auto", chat_template_kwargs={"greeting": "Hello!"})
    fut = pool.submit(post, router_url, "/v1/chat/completions", body)
    _, req = take_job(r)
    text = hf.apply_chat_template(
        as_template_sees(SDK_TURNS),
        tools=[WEATHER],
        chat_template=TOOLS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        greeting="Hello!",
    )
    assert text.startswith("Hello!\n") and "get_weather: {" in text and "sunny [call_1]" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|im_start|>system\nUse tools." in text
    assert req.prompt_tokens == hf.encode(text, add_special_tokens=False)
    play(r, req, *call_events(len(req.prompt_tokens)))
    resp = fut.result(15)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Sure."
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_relay_streams_tool_call_deltas(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str
) -> None:
    body = tools_body(model_id, stream=True)
    fut: Future[list[str]] = pool.submit(sse_lines, router_url, "/v1/chat/completions", body)
    _, req = take_job(r)
    play(r, req, *call_events(len(req.prompt_tokens), CALL_TEXT.removeprefix("Sure.")))
    lines = fut.result(15)
    assert lines[-1] == "data: [DONE]"
    deltas = [json.loads(x.removeprefix("data: "))["choices"][0] for x in lines[:-1]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content == ""  # nothing of the call's text streams as content
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("choice", [{}, {"tool_choice": "auto"}])
def test_parallel_tool_calls_false_returns_the_first_call(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, model_id: str, choice: dict[str, Any]
) -> None:
    """Accepted with tool_choice auto or absent (the Agents SDK sends it): of the two calls the
    model writes, only the first is returned."""
    body = tools_body(model_id, parallel_tool_calls=False, **choice)
    fut = pool.submit(post, router_url, "/v1/chat/completions", body)
    _, req = take_job(r)
    play(r, req, *call_events(len(req.prompt_tokens), TWO_CALLS))
    resp = fut.result(15)
    assert resp.status_code == 200, resp.text
    message = resp.json()["choices"][0]["message"]
    assert resp.json()["choices"][0]["finish_reason"] == "tool_calls"
    assert message["content"] == "Let me check.  Done"
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_tool_choice_none_leaves_tools_out(
    router_url: str, r: redis.Redis, pool: ThreadPoolExecutor, hf: Any, model_id: str
) -> None:
    fut = pool.submit(
        post, router_url, "/v1/chat/completions", tools_body(model_id, tool_choice="none")
    )
    _, req = take_job(r)
    text = hf.apply_chat_template(
        as_template_sees(SDK_TURNS),
        chat_template=TOOLS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert req.prompt_tokens == hf.encode(text, add_special_tokens=False)
    play(r, req, *call_events(len(req.prompt_tokens)))
    choice = fut.result(15).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] == CALL_TEXT
    assert "tool_calls" not in choice["message"]


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"tools": {"type": "function"}}, "tools"),
        (
            {"tools": [{"type": "function", "function": {"description": "no name"}}]},
            "tools.0.function.name",
        ),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
        ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        # A call forced on a template whose call format no grammar writes: refused, not ignored.
        ({"tool_choice": "required", "chat_template": PLAIN_TEMPLATE}, "tool_choice"),
        (
            {
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
                "response_format": {"type": "json_object"},
            },
            "tool_choice",
        ),
        ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_param(
    router_url: str, model_id: str, change: dict[str, Any], param: str
) -> None:
    body = {**tools_body(model_id), **change}
    resp = post(router_url, "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


# --- a real pool ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_pool(shared_pool: Any) -> Any:
    return shared_pool  # the session's pool: this module needs no settings of its own


@pytest.mark.pool
def test_pool_serves_a_tool_conversation(real_pool: Any, hf: Any, model_id: str) -> None:
    def ask(**extra: Any) -> dict[str, Any]:
        body = {
            "model": model_id,
            "messages": SDK_TURNS,
            "chat_template": TOOLS_TEMPLATE,
            "max_tokens": 4,
            "temperature": 0,
            **extra,
        }
        resp = httpx.post(f"{real_pool.url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()

    plain, with_tools = ask(), ask(tools=[WEATHER], chat_template_kwargs={"greeting": "Hi"})
    text = hf.apply_chat_template(
        as_template_sees(SDK_TURNS),
        tools=[WEATHER],
        chat_template=TOOLS_TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
        greeting="Hi",
    )
    expected = len(hf.encode(text, add_special_tokens=False))
    assert with_tools["usage"]["prompt_tokens"] == expected
    assert plain["usage"]["prompt_tokens"] < expected
    for out in (plain, with_tools):
        choice = out["choices"][0]
        assert choice["finish_reason"] in ("stop", "length")
        assert isinstance(choice["message"]["content"], str)


# The call the model is made to write: a regex response_format leaves it one choice of city,
# so the text it writes is its own (sampled from its logits through the mask), a real tool call.
CALL_REGEX = (
    r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome|Oslo)"\}\}'
    r"</tool_call>"
)


@pytest.mark.pool
def test_a_tool_call_the_model_writes_is_parsed(real_pool: Any, model_id: str) -> None:
    """The tiny model writes a tool call (its output constrained by a regex): the router parses
    it into `tool_calls` with finish_reason "tool_calls", streamed as deltas and not."""
    fmt = {"type": "regex", "regex": CALL_REGEX}
    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Weather?"}],
        "chat_template": TOOLS_TEMPLATE,
        "tools": [WEATHER],
        "max_tokens": 64,
        "temperature": 0,
        "response_format": fmt,
    }
    resp = httpx.post(f"{real_pool.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert set(args) == {"city"} and args["city"] in ("Paris", "Rome", "Oslo")
    assert not choice["message"]["content"]  # the call's text is never content

    chunks = []
    with httpx.stream(
        "POST", f"{real_pool.url}/v1/chat/completions", json={**body, "stream": True}, timeout=60
    ) as streamed:
        assert streamed.status_code == 200
        for line in streamed.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
    assert calls and calls[0]["function"]["name"] == "get_weather"
    streamed_args = "".join(tc["function"].get("arguments") or "" for tc in calls)
    assert json.loads(streamed_args) == args  # greedy: the same call as the one above
    assert not "".join(d.get("content") or "" for d in deltas)
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _tool(name: str, arg: str, values: list[str]) -> dict[str, Any]:
    """A function whose one argument is one of `values`: a call the grammar bounds."""
    params = {
        "type": "object",
        "properties": {arg: {"type": "string", "enum": values}},
        "required": [arg],
        "additionalProperties": False,
    }
    return {"type": "function", "function": {"name": name, "parameters": params}}


CITY, ZONE = _tool("get_city", "city", ["Paris", "Rome"]), _tool("get_time", "zone", ["UTC", "CET"])


def _forced_body(model_id: str, choice: Any, **extra: Any) -> dict[str, Any]:
    return {
        "model": model_id,
        "messages": [{"role": "user", "content": "Help?"}],
        "chat_template": TOOLS_TEMPLATE,
        "tools": [CITY, ZONE],
        "tool_choice": choice,
        "max_tokens": 64,
        "temperature": 0,
        **extra,
    }


def _forced(real_pool: Any, model_id: str, choice: Any, **extra: Any) -> dict[str, Any]:
    body = _forced_body(model_id, choice, **extra)
    resp = httpx.post(f"{real_pool.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.pool
def test_tool_choice_required_makes_the_model_call_a_tool(real_pool: Any, model_id: str) -> None:
    """The random-weight model, left to itself, never calls a tool; "required" makes it write
    exactly one call of a declared tool with valid arguments."""
    choice = _forced(real_pool, model_id, "required")["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    args = json.loads(call["function"]["arguments"])
    allowed = {"get_city": ("city", {"Paris", "Rome"}), "get_time": ("zone", {"UTC", "CET"})}
    arg, values = allowed[call["function"]["name"]]
    assert set(args) == {arg} and args[arg] in values
    unforced = _forced(real_pool, model_id, "auto")["choices"][0]
    assert unforced["finish_reason"] != "tool_calls" and not unforced["message"].get("tool_calls")


@pytest.mark.pool
def test_a_named_tool_choice_calls_that_function(real_pool: Any, model_id: str) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    for parallel in (None, False):  # one call is forced: parallel_tool_calls false holds
        choice = _forced(real_pool, model_id, named, parallel_tool_calls=parallel)["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        assert json.loads(call["function"]["arguments"])["zone"] in ("UTC", "CET")
    chunks = []
    body = _forced_body(model_id, named, stream=True)
    with httpx.stream(
        "POST", f"{real_pool.url}/v1/chat/completions", json=body, timeout=60
    ) as streamed:
        for line in streamed.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    calls = [
        tc
        for c in chunks
        if c["choices"]
        for tc in c["choices"][0]["delta"].get("tool_calls") or []
    ]
    assert calls and calls[0]["function"]["name"] == "get_time"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_forced_calls_on_the_built_in_template(shared_pool: Any, model_id: str) -> None:
    """The built-in template (no `chat_template` in the body) declares Hermes-style calls, so
    "required" and a named tool_choice come back as parsed calls through the openai SDK, streamed
    too, with no marker text left in the content."""
    client = openai.OpenAI(base_url=f"{shared_pool.url}/v1", api_key="none", max_retries=0)
    ask = {
        "model": model_id,
        "messages": [{"role": "user", "content": "Help?"}],
        "tools": [CITY, ZONE],
        "max_tokens": 64,
        "temperature": 0,
    }
    required = client.chat.completions.create(**ask, tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls"
    assert not required.message.content
    (call,) = required.message.tool_calls or []
    args = json.loads(call.function.arguments)
    assert call.function.name in ("get_city", "get_time")
    assert list(args) == ["city" if call.function.name == "get_city" else "zone"]
    named = {"type": "function", "function": {"name": "get_time"}}
    chosen = client.chat.completions.create(**ask, tool_choice=named).choices[0]
    (call,) = chosen.message.tool_calls or []
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    chunks = list(client.chat.completions.create(**ask, tool_choice=named, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert deltas and deltas[0].function and deltas[0].function.name == "get_time"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


class Pick(BaseModel):
    """A city to look up."""

    # additionalProperties: false. A schema that allows other keys lets random weights write
    # one key name forever (the grammar admits any), which a trained model would not.
    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Rome"]


def test_langchain_function_calling_on_the_built_in_template(
    shared_pool: Any, model_id: str
) -> None:
    """LangChain's `with_structured_output(method="function_calling")` (a named tool_choice) and
    `bind_tools(tool_choice="any")` ("required") on the default model's own template: the forced
    call comes back parsed into the schema."""
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{shared_pool.url}/v1",
        api_key=SecretStr("none"),
        model=model_id,
        max_completion_tokens=64,
        temperature=0,
        max_retries=0,
    )
    picked = llm.with_structured_output(Pick, method="function_calling").invoke("Which city?")
    assert isinstance(picked, Pick) and picked.city in ("Paris", "Rome")
    message = llm.bind_tools([Pick], tool_choice="any").invoke("Which city?")
    (call,) = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "Pick" and call["args"]["city"] in ("Paris", "Rome")


def test_a_forced_call_grammar_follows_the_parameters_own_refs(tiny_model_dir: Path) -> None:
    """Parameters with `$defs` (as pydantic writes them) resolve against themselves, not the
    call object the grammar nests them in; two tools of one name compile; a non-object
    parameters schema is refused."""
    from llguidance import LLMatcher

    from router.admission.structured_output import FormatError, forced_call_grammar
    from router.admission.tokenization import load_tokenizer

    tok = load_tokenizer(tiny_model_dir, 1)
    parser = load_parser("json_tools")
    location = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    params = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/Location"}},
        "required": ["at"],
        "additionalProperties": False,
        "$defs": {"Location": location},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    grammar = forced_call_grammar(tools, "f", parser, tok)

    def accepts(text: str) -> bool:
        matcher = LLMatcher(tok.grammar_tokenizer(), grammar, log_level=0)
        ids = tok.hf.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert accepts('<tool_call>{"name":"f","arguments":{"at":{"city":"Paris"}}}</tool_call>')
    assert not accepts('<tool_call>{"name":"f","arguments":{"at":{"city":"Rome"}}}</tool_call>')
    twice = [*tools, {"type": "function", "function": {"name": "f"}}]
    assert forced_call_grammar(twice, None, parser, tok)
    stringly = [{"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}]
    with pytest.raises(FormatError, match="object schema"):
        forced_call_grammar(stringly, None, parser, tok)
