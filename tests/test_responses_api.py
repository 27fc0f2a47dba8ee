"""OpenAI's Responses API on the pool, with the clients agents use: the official SDK (plain,
streamed, structured output, a tool round trip), openai-agents' Runner and langchain-openai;
stored responses in Redis, continued from another router process; refusals in OpenAI's shape."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from mlxcel_pool.redis_server import free_port
from mlxcel_pool.supervisor import settings_env
from router.dialects.responses import ResponsesRequest
from router.dialects.responses_output import ResponseShape
from router.dialects.responses_stream import ResponseEvents
from router.edge.errors import APIError
from shared.errors import ErrorKind
from tests.pool_fixture import wait_for
from tests.streams import TINY_MODEL
from tests.test_tool_calls import TOOLS_TEMPLATE

REPO = Path(__file__).resolve().parent.parent

CITY = {
    "type": "function",
    "name": "get_city",
    "description": "A city's weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
TOOL_BODY: dict[str, Any] = {"chat_template": TOOLS_TEMPLATE}
# Long enough that the first turn's prompt spans whole cache blocks past the minimum prefix.
INSTRUCTIONS = "You are a terse assistant. " * 12


@pytest.fixture(scope="module")
def client(shared_pool: Any) -> OpenAI:
    return OpenAI(base_url=f"{shared_pool.url}/v1", api_key="x", max_retries=0)


def _create(client: OpenAI, **kw: Any) -> Any:
    return client.responses.create(**{"model": TINY_MODEL, "temperature": 0, **kw})


def test_plain_response_has_text_usage_and_its_shape(client: OpenAI) -> None:
    resp = _create(client, input="Hello there", max_output_tokens=4, metadata={"k": "v"})
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.model == TINY_MODEL and resp.metadata == {"k": "v"}
    (item,) = resp.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert resp.output_text == item.content[0].text and resp.output_text
    usage = resp.usage
    assert usage is not None and usage.input_tokens > 0 and 1 <= usage.output_tokens <= 4
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    if resp.status == "incomplete":  # the random model seldom stops before its limit
        assert resp.incomplete_details.reason == "max_output_tokens" and usage.output_tokens == 4
    else:
        assert resp.status == "completed" and resp.incomplete_details is None


def test_the_objects_validate_as_the_sdk_types(shared_pool: Any) -> None:
    """Validated in full (the SDK itself builds them unchecked): every required field there."""
    body = {"model": TINY_MODEL, "input": "Hi", "max_output_tokens": 4, "tools": [CITY]}
    resp = Response.model_validate(
        httpx.post(f"{shared_pool.url}/v1/responses", json=body, timeout=30).json()
    )
    assert resp.tools[0].name == "get_city" and resp.tool_choice == "auto"
    with httpx.stream(
        "POST", f"{shared_pool.url}/v1/responses", json={**body, "stream": True}, timeout=30
    ) as streamed:
        parsed = _sse(streamed.iter_bytes())
    events = [STREAM_EVENT.validate_python(payload) for _, payload in parsed]
    assert [name for name, _ in parsed] == [e.type for e in events]
    assert events[-1].response.output[0].id == events[2].item.id


STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)


def _sse(chunks: Any) -> list[tuple[str, dict[str, Any]]]:
    """(event line, data) of each SSE message."""
    out = []
    for message in b"".join(chunks).decode().split("\n\n"):
        if message:
            head, data = message.split("\n")
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_failure_after_the_200_is_an_error_event_then_response_failed() -> None:
    shape = ResponseShape(ResponsesRequest.model_validate({"input": "x"}), TINY_MODEL)
    out = ResponseEvents(shape)
    lost = APIError.of(ErrorKind.WORKER_LOST, "The pool lost the worker")
    parsed = _sse(out.start() + out.text("Hel") + out.failed(lost))
    events = [STREAM_EVENT.validate_python(payload) for _, payload in parsed]
    assert [e.type for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "error",
        "response.failed",
    ]
    assert [e.sequence_number for e in events] == list(range(7))
    assert events[-2].code == "worker_lost" and events[-2].message == lost.message
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.output[0].id == events[2].item.id


def test_streamed_events_parse_and_equal_the_plain_text(client: OpenAI) -> None:
    kw = {"input": "Tell me a story", "max_output_tokens": 6}
    plain = _create(client, **kw)
    events = list(_create(client, stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if plain.status == "completed" else "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == plain.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    # The SDK's own accumulator (client.responses.stream) checks every item's identity; its
    # get_final_response() wants response.completed, which a cut-off answer does not end with.
    with client.responses.stream(model=TINY_MODEL, temperature=0, **kw) as stream:
        last = list(stream)[-1]
    assert last.type == types[-1] and last.response.output_text == plain.output_text


def test_json_schema_format_gives_json_that_parses(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    resp = _create(
        client,
        input="Answer in JSON",
        max_output_tokens=32,
        text={
            "format": {"type": "json_schema", "name": "answer", "schema": schema, "strict": True}
        },
    )
    answer = json.loads(resp.output_text)
    assert set(answer) == {"ok", "n"} and isinstance(answer["ok"], bool)
    assert resp.text.format.type == "json_schema"
    obj = _create(
        client, input="JSON", max_output_tokens=32, text={"format": {"type": "json_object"}}
    )
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def _forced_call(client: OpenAI, **kw: Any) -> Any:
    return _create(
        client,
        input="Weather?",
        tools=[CITY],
        tool_choice={"type": "function", "name": "get_city"},
        max_output_tokens=64,
        extra_body=TOOL_BODY,
        **kw,
    )


def test_a_tool_round_trip_continues_from_the_stored_call(client: OpenAI) -> None:
    first = _forced_call(client)
    (call,) = [i for i in first.output if i.type == "function_call"]
    assert call.name == "get_city" and call.id.startswith("fc_") and call.call_id
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    assert first.tool_choice.name == "get_city" and first.tools[0].name == "get_city"
    reply = _create(
        client,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[CITY],
        max_output_tokens=4,
        extra_body=TOOL_BODY,
    )
    assert reply.previous_response_id == first.id
    assert reply.output[0].type == "message" and reply.output_text
    # The continuation's prompt holds the first turn's: longer by at least the call and result.
    assert reply.usage.input_tokens > first.usage.input_tokens
    # The same conversation sent whole, the SDK's way (`input += response.output`), is the same
    # prompt: the stored conversation is what the items translate to.
    resent = _create(
        client,
        input=[
            {"role": "user", "content": "Weather?"},
            *(item.model_dump(exclude_none=True) for item in first.output),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=[CITY],
        max_output_tokens=4,
        extra_body=TOOL_BODY,
    )
    assert resent.usage.input_tokens == reply.usage.input_tokens
    assert resent.output_text == reply.output_text


def test_the_built_in_template_calls_tools_too(client: OpenAI) -> None:
    """No request template: the model's own renders the tools and names the call format."""
    resp = _create(
        client, input="Weather?", tools=[CITY], tool_choice="required", max_output_tokens=64
    )
    (call,) = resp.output
    assert call.type == "function_call" and call.name == "get_city"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")


def test_a_streamed_tool_call_arrives_as_function_call_events(client: OpenAI) -> None:
    events = list(_forced_call(client, stream=True))
    types = [e.type for e in events]
    at = types.index("response.function_call_arguments.delta")
    assert types[at - 1 : at + 3] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    added, done = events[at - 1].item, events[at + 2].item
    assert added.type == done.type == "function_call" and added.id == done.id
    assert json.loads(events[at + 1].arguments) == json.loads(done.arguments)
    final = events[-1].response
    assert [i.type for i in final.output][-1] == "function_call"
    assert client.responses.retrieve(final.id).output[-1].call_id == done.call_id


def test_a_continuation_reuses_the_cached_prefix(client: OpenAI) -> None:
    """The earlier turn renders the same way in the continuation's prompt, so prefix routing
    and the worker's prompt cache reuse it."""
    first = _create(client, instructions=INSTRUCTIONS, input="First question", max_output_tokens=4)
    second = _create(
        client,
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input="Second question",
        max_output_tokens=4,
    )
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_stored_responses_get_delete_and_store_false(client: OpenAI) -> None:
    resp = _create(client, input="Keep this", max_output_tokens=4)
    got = client.responses.retrieve(resp.id)
    assert got.id == resp.id and got.output_text == resp.output_text
    deleted = client.responses.delete(resp.id)
    assert deleted is None  # the SDK returns nothing; the body is checked below
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError) as exc:
        _create(client, input="again", previous_response_id=resp.id, max_output_tokens=4)
    assert exc.value.body["param"] == "previous_response_id"
    unstored = _create(client, input="Forget this", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        _create(client, input="more", previous_response_id=unstored.id, max_output_tokens=4)


def test_delete_answers_the_deleted_object_then_404(shared_pool: Any, client: OpenAI) -> None:
    resp = _create(client, input="Delete me", max_output_tokens=4)
    url = f"{shared_pool.url}/v1/responses/{resp.id}"
    body = httpx.delete(url, timeout=30).json()
    assert body == {"id": resp.id, "object": "response", "deleted": True}
    again = httpx.delete(url, timeout=30)
    assert again.status_code == 404 and again.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{shared_pool.url}/v1/responses/resp_nonsense", timeout=30).status_code == 404


@pytest.fixture(scope="module")
def second_router(shared_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Another router process, on its own port, against the shared pool's Redis."""
    work = tmp_path_factory.mktemp("second-router")
    port = free_port()
    env = {
        **os.environ,
        **settings_env(shared_pool.settings),
        "REDIS_URL": shared_pool.redis_url,
        "MLXCEL_MODEL": str(shared_pool.model_path),
        "MLXCEL_TRUST_REQUEST_CHAT_TEMPLATE": "true",
        "PROMETHEUS_MULTIPROC_DIR": str(work / "prom"),
        "PYTHONPATH": str(REPO),
    }
    argv = [sys.executable, "-m", "mlxcel_pool", "router", "--port", str(port)]
    log = (work / "router.log").open("w")
    proc = subprocess.Popen(
        [*argv, "--processes", "1"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO
    )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        assert proc.poll() is None, (work / "router.log").read_text()
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 60, "second router")
        yield url
    finally:
        proc.terminate()
        proc.wait(20)


def test_another_router_process_continues_the_conversation(
    client: OpenAI, second_router: str
) -> None:
    first = _create(client, input="Remember me", max_output_tokens=4)
    other = OpenAI(base_url=f"{second_router}/v1", api_key="x", max_retries=0)
    assert other.responses.retrieve(first.id).output_text == first.output_text
    reply = _create(other, previous_response_id=first.id, input="And now?", max_output_tokens=4)
    assert reply.previous_response_id == first.id
    assert reply.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert client.responses.retrieve(reply.id).output_text == reply.output_text


class Verdict(BaseModel):
    ok: bool


def test_openai_agents_runner_runs_a_turn(shared_pool: Any) -> None:
    """Its default model class (OpenAIResponsesModel). A response cut off at its token limit is
    an error to the Agents SDK, and the random-weight model never stops by itself: a structured
    output (text.format json_schema) ends it, the grammar allowing only EOS once complete."""
    from agents import Agent, ModelSettings, Runner, set_default_openai_client, set_tracing_disabled

    set_tracing_disabled(True)
    set_default_openai_client(
        openai.AsyncOpenAI(base_url=f"{shared_pool.url}/v1", api_key="x", max_retries=0),
        use_for_tracing=False,
    )
    agent = Agent(
        name="tiny",
        instructions="Be brief.",
        model=TINY_MODEL,
        output_type=Verdict,
        model_settings=ModelSettings(max_tokens=24, temperature=0),
    )
    result = asyncio.run(Runner.run(agent, "Is the sky blue?"))
    assert isinstance(result.final_output, Verdict)
    (raw,) = result.raw_responses
    assert raw.response_id is not None and raw.response_id.startswith("resp_")
    assert 1 <= raw.usage.output_tokens <= 24


def test_langchain_chat_openai_on_the_responses_api(shared_pool: Any) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=TINY_MODEL,
        use_responses_api=True,
        base_url=f"{shared_pool.url}/v1",
        api_key="x",
        max_tokens=6,
        temperature=0,
        max_retries=0,
    )
    msg = llm.invoke("Hello")
    assert msg.text and msg.response_metadata["id"].startswith("resp_")
    assert msg.usage_metadata is not None and msg.usage_metadata["output_tokens"] <= 6


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"tools": [{"type": "mcp", "server_label": "x"}]}, "tools.0.type"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0.type"),
        ({"input": [{"type": {"a": 1}}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": ["input_text"]}]}]},
            "input.0.content.0.type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
            "input.0.content.0.text",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"input": []}, "input"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        (
            {"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
            "text.format",
        ),
        ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"temperature": "hot"}, "temperature"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    shared_pool: Any, extra: dict[str, Any], param: str
) -> None:
    body = {"model": TINY_MODEL, "input": "Hi", "max_output_tokens": 4, **extra}
    resp = httpx.post(f"{shared_pool.url}/v1/responses", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_an_unknown_previous_response_is_a_404(client: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        _create(client, input="x", previous_response_id="resp_" + "0" * 32)
    assert exc.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as bad:
        _create(client, input="x", tools=[{"type": "code_interpreter", "container": "auto"}])
    assert bad.value.body["param"] == "tools.0.type"
