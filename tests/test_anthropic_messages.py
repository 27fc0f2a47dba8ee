"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven with the official
`anthropic` SDK against the shared pool, parsed into the SDK's typed objects: text, usage and
stop reasons, the event stream, count_tokens, a forced tool call and its result sent back, and
errors in Anthropic's shape (raw HTTP, so the shape itself is checked).

The tiny model has random weights and never calls a tool unless forced: tool tests force calls,
rendered with tests.test_tool_calls.TOOLS_TEMPLATE sent as the `chat_template` vendor field (the
shared pool trusts request templates), and once with the built-in template's own format. Every
request bounds its tokens; prompts are ones the model does not end with EOS.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest
from anthropic.types import Message

from tests.streams import TINY_MODEL
from tests.test_tool_calls import TOOLS_TEMPLATE

FOX = "The quick brown fox"
N = 8  # tokens per request
ERROR_TYPES = {
    "invalid_request_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
    "request_too_large",
    "rate_limit_error",
    "api_error",
    "overloaded_error",
}


def _tool(name: str, arg: str, values: list[str]) -> dict[str, Any]:
    """A tool whose one argument is one of `values`: a call the forcing grammar bounds."""
    schema = {
        "type": "object",
        "properties": {arg: {"type": "string", "enum": values}},
        "required": [arg],
        "additionalProperties": False,
    }
    return {"name": name, "description": f"Look up a {arg}.", "input_schema": schema}


CITY, ZONE = _tool("get_city", "city", ["Paris", "Rome"]), _tool("get_time", "zone", ["UTC", "CET"])
WITH_TEMPLATE = {"chat_template": TOOLS_TEMPLATE}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(shared_pool: Any) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=shared_pool.url,
        api_key="any",  # the shared pool has no keys
        max_retries=0,
        timeout=60,
        _strict_response_validation=True,
    ) as c:
        yield c


def _user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _create(client: anthropic.Anthropic, **fields: Any) -> Message:
    """messages.create, greedy (this SDK has no sampling arguments: they go as extra fields)."""
    extra = {"temperature": 0, **fields.pop("extra_body", {})}
    body: dict[str, Any] = {"model": TINY_MODEL, "max_tokens": N, "messages": _user(FOX), **fields}
    return client.messages.create(**body, extra_body=extra)


def _text(message: Message) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def assert_anthropic_error(resp: httpx.Response, status: int, kind: str) -> str:
    """Anthropic's error body, exactly: its message."""
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and kind in ERROR_TYPES
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return str(body["error"]["message"])


# --- messages.create -----------------------------------------------------------------------------


def test_create_answers_a_message_with_usage(client: anthropic.Anthropic) -> None:
    message = _create(client)
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == TINY_MODEL
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == N
    counted = client.messages.count_tokens(model=TINY_MODEL, messages=_user(FOX))
    # The prompt is the computed part plus what the prefix cache served.
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens
    assert usage.cache_creation_input_tokens == 0
    # Greedy: the same text again, and max_tokens bounds it.
    assert _text(_create(client)) == block.text
    short = _create(client, max_tokens=2)
    assert short.usage.output_tokens == 2 and block.text.startswith(_text(short))


def test_system_prompt_as_string_or_blocks(client: anthropic.Anthropic) -> None:
    def count(**fields: Any) -> int:
        return client.messages.count_tokens(
            model=TINY_MODEL, messages=_user(FOX), **fields
        ).input_tokens

    plain = count()
    as_text = count(system="You are terse.")
    as_blocks = count(
        system=[{"type": "text", "text": "You are "}, {"type": "text", "text": "terse."}]
    )
    assert as_text > plain and as_blocks == as_text
    answer = _create(client, system="You are terse.")
    assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) == as_text


def test_stop_sequence_is_reported(client: anthropic.Anthropic) -> None:
    """The worker cuts the text before a stop sequence; the answer names which one matched."""
    text = _text(_create(client))
    mid = len(text) // 2
    stop = text[mid : mid + 3]
    assert stop.strip(), text
    cut = _create(client, stop_sequences=["\u2603never", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert _text(cut) == text[: text.find(stop)]
    with client.messages.stream(
        model=TINY_MODEL,
        max_tokens=N,
        messages=_user(FOX),
        stop_sequences=[stop],
        extra_body=GREEDY,
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    # A stop sequence the text never reaches: the budget ends it.
    assert _create(client, stop_sequences=["\u2603never"]).stop_reason == "max_tokens"


# --- streaming -----------------------------------------------------------------------------------


def _raw_events(pool: Any, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) of each SSE message; each data's `type` is its event's name."""
    out: list[tuple[str, dict[str, Any]]] = []
    event = ""
    with httpx.stream("POST", f"{pool.url}/v1/messages", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        for line in resp.iter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == event, (event, data)
                out.append((event, data))
    return out


def test_stream_events_in_anthropic_order(shared_pool: Any, client: anthropic.Anthropic) -> None:
    body = {"model": TINY_MODEL, "max_tokens": N, "messages": _user(FOX), "temperature": 0}
    events = _raw_events(shared_pool, {**body, "stream": True})
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0
    deltas = [d["delta"] for k, d in events if k == "content_block_delta"]
    assert all(d["type"] == "text_delta" for d in deltas)
    streamed = "".join(d["text"] for d in deltas)
    assert streamed == _text(_create(client))  # greedy: as the non-streamed answer
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert end["usage"]["output_tokens"] == N


def test_sdk_stream_accumulates_the_message(client: anthropic.Anthropic) -> None:
    with client.messages.stream(
        model=TINY_MODEL, max_tokens=N, messages=_user(FOX), extra_body=GREEDY
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == _text(final) == _text(_create(client))
    assert final.id.startswith("msg_") and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == N
    # stream=True on create: the SDK's raw event objects.
    raw = list(_create(client, stream=True))
    assert raw[0].type == "message_start" and raw[-1].type == "message_stop"


# --- tools ---------------------------------------------------------------------------------------


def test_a_forced_tool_call_and_its_result_sent_back(client: anthropic.Anthropic) -> None:
    ask = _user("Where?")
    forced = {"tools": [CITY, ZONE], "tool_choice": {"type": "tool", "name": "get_city"}}
    call = _create(client, messages=ask, max_tokens=64, extra_body=WITH_TEMPLATE, **forced)
    assert call.stop_reason == "tool_use"
    (use,) = [b for b in call.content if b.type == "tool_use"]
    assert use.name == "get_city" and use.id.startswith("toolu_")
    assert set(use.input) == {"city"} and use.input["city"] in ("Paris", "Rome")

    # Streamed: the same call, its input as input_json_delta, accumulated by the SDK.
    with client.messages.stream(
        model=TINY_MODEL,
        max_tokens=64,
        messages=ask,
        extra_body={**GREEDY, **WITH_TEMPLATE},
        **forced,
    ) as stream:
        final = stream.get_final_message()
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input)
    assert final.stop_reason == "tool_use"

    def turns(result: str, is_error: bool = False) -> list[dict[str, Any]]:
        answer = {"type": "tool_result", "tool_use_id": use.id, "content": result}
        if is_error:
            answer["is_error"] = True
        return [
            *ask,
            {"role": "assistant", "content": call.content},
            {"role": "user", "content": [answer]},
        ]

    def count(messages: list[dict[str, Any]]) -> int:
        return client.messages.count_tokens(
            model=TINY_MODEL, messages=messages, tools=[CITY, ZONE], extra_body=WITH_TEMPLATE
        ).input_tokens

    # The result reaches the template: a longer one, or a failed tool's, renders more tokens.
    sunny = count(turns("sunny"))
    assert count(turns("sunny and warm all week")) > sunny
    assert count(turns("sunny", is_error=True)) > sunny
    reply = _create(client, messages=turns("sunny"), tools=[CITY, ZONE], extra_body=WITH_TEMPLATE)
    assert reply.stop_reason in ("max_tokens", "end_turn")
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == sunny


def test_any_tool_with_parallel_use_disabled_makes_one_call(client: anthropic.Anthropic) -> None:
    choice = {"type": "any", "disable_parallel_tool_use": True}
    call = _create(
        client,
        messages=_user("Help?"),
        max_tokens=64,
        tools=[CITY, ZONE],
        tool_choice=choice,
        extra_body=WITH_TEMPLATE,
    )
    uses = [b for b in call.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name in ("get_city", "get_time")
    assert call.stop_reason == "tool_use"
    # The model's own template (the built-in one has a tool-call format) forces it too.
    own = _create(client, messages=_user("Help?"), max_tokens=64, tools=[ZONE], tool_choice=choice)
    (use,) = [b for b in own.content if b.type == "tool_use"]
    assert use.name == "get_time" and use.input["zone"] in ("UTC", "CET")
    # tool_choice none: the tools are not offered, and no call is made.
    plain = _create(client, tools=[CITY], tool_choice={"type": "none"}, extra_body=WITH_TEMPLATE)
    assert plain.stop_reason == "max_tokens" and all(b.type == "text" for b in plain.content)


# --- errors --------------------------------------------------------------------------------------


def _post(pool: Any, body: Any, path: str = "/v1/messages") -> httpx.Response:
    return httpx.post(f"{pool.url}{path}", json=body, timeout=60)


def _body(**fields: Any) -> dict[str, Any]:
    return {"model": TINY_MODEL, "max_tokens": N, "messages": _user(FOX), **fields}


CALL = {"id": "toolu_1", "name": "get_city", "input": {}}
IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"model": TINY_MODEL, "messages": _user(FOX)}, "max_tokens"),
        (_body(messages=[{"role": "system", "content": "x"}]), "role"),
        (_body(messages=[{"role": "user", "content": [IMAGE]}]), "'image'"),
        (
            _body(
                messages=[
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}
                        ],
                    }
                ]
            ),
            "'image'",
        ),
        (_body(messages=[{"role": "user", "content": [{"type": "document"}]}]), "'document'"),
        (_body(messages=[{"role": "user", "content": [{**CALL, "type": "tool_use"}]}]), "tool_use"),
        (_body(max_tokens="8"), "max_tokens"),
        (_body(temperature=1.5), "temperature"),
        (_body(stop_sequences=[f"s{i}" for i in range(17)]), "stop_sequences"),
        (_body(max_tokens=10**9), "max_tokens"),
        (_body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools"),
        (_body(tool_choice={"type": "tool", "name": "nope"}), "tool_choice"),
        ([1, 2], "JSON object"),
    ],
    ids=[
        "no-max-tokens",
        "bad-role",
        "image",
        "image-in-tool-result",
        "document",
        "tool-use-from-user",
        "string-max-tokens",
        "temperature",
        "stop-sequences",
        "past-context",
        "server-tool",
        "unknown-tool-choice",
        "not-an-object",
    ],
)
def test_bad_input_is_an_anthropic_400(shared_pool: Any, body: Any, named: str) -> None:
    message = assert_anthropic_error(_post(shared_pool, body), 400, "invalid_request_error")
    assert named in message


def test_bad_input_reaches_the_sdk_as_its_error(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        _create(client, messages=[{"role": "user", "content": [IMAGE]}])
    assert info.value.status_code == 400 and "'image'" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        _create(client, model="no-such-model")


def test_unknown_model_is_an_anthropic_404(shared_pool: Any) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        resp = _post(shared_pool, _body(model="no-such-model"), path)
        message = assert_anthropic_error(resp, 404, "not_found_error")
        assert "'no-such-model'" in message and TINY_MODEL in message


def test_unknown_paths_and_methods_answer_in_anthropic_shape(shared_pool: Any) -> None:
    assert_anthropic_error(_post(shared_pool, _body(), "/v1/messages/nope"), 404, "not_found_error")
    resp = httpx.get(f"{shared_pool.url}/v1/messages", timeout=10)
    assert_anthropic_error(resp, 405, "invalid_request_error")
    malformed = httpx.post(
        f"{shared_pool.url}/v1/messages",
        content=b'{"model": ',
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert_anthropic_error(malformed, 400, "invalid_request_error")
    # Every other route keeps OpenAI's shape.
    other = httpx.post(f"{shared_pool.url}/v1/chat/completions", json={}, timeout=10)
    assert other.status_code == 400 and set(other.json()) == {"error"}


def test_a_body_past_the_bound_is_an_anthropic_413(shared_pool: Any) -> None:
    """Refused from its Content-Length alone, before a byte of it is read."""
    url = httpx.URL(shared_pool.url)
    head = (
        f"POST /v1/messages HTTP/1.1\r\nHost: {url.host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {10**10}\r\nConnection: close\r\n\r\n"
    )
    with socket.create_connection((url.host, url.port), timeout=10) as conn:
        conn.sendall(head.encode())
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert b" 413 " in status_line, answer
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"
