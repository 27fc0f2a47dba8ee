"""POST /tokenize and POST /detokenize (vLLM's shapes) on a real pool: a prompt's and a chat's
`count` is the `usage.prompt_tokens` of the completion of them, token strings are the
vocabulary's, detokenize undoes tokenize, and bad input is a 4xx in OpenAI's error shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from tests.pool_fixture import ok, post
from tests.streams import TINY_MODEL

PROMPT = "The river runs past the mill, 12 times a day: ünïcode too."
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
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


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir), local_files_only=True)


def _usage(pool: Any, path: str, body: dict[str, Any]) -> int:
    out = ok(post(pool, path, {**body, "max_tokens": 2, "temperature": 0}))
    return int(out["usage"]["prompt_tokens"])


def test_a_prompt_counts_as_its_completion(shared_pool: Any, hf: Any) -> None:
    out = ok(post(shared_pool, "/tokenize", {"prompt": PROMPT}))
    assert out["tokens"] == hf.encode(PROMPT)
    assert (
        out["count"]
        == len(out["tokens"])
        == _usage(shared_pool, "/v1/completions", {"prompt": PROMPT})
    )
    assert out["max_model_len"] == 2048
    assert "token_strs" not in out
    # With no model named, the router's own; token strings as the vocabulary writes them.
    strs = ok(
        httpx.post(
            f"{shared_pool.url}/tokenize",
            json={"prompt": PROMPT, "return_token_strs": True},
            timeout=30,
        )
    )
    assert strs["tokens"] == out["tokens"]
    assert strs["token_strs"] == hf.convert_ids_to_tokens(out["tokens"])
    bos = ok(post(shared_pool, "/tokenize", {"prompt": "<|bos|>hi", "add_special_tokens": False}))
    assert bos["tokens"][0] == hf.convert_tokens_to_ids("<|bos|>")
    assert ok(post(shared_pool, "/tokenize", {"prompt": ""}))["count"] == 0


def test_messages_count_as_their_chat_completion(shared_pool: Any, hf: Any) -> None:
    """The built-in template's tools, tool calls and tool results included, token for token."""
    for extra in ({}, {"tools": [WEATHER]}):
        body = {"messages": CHAT, **extra}
        out = ok(post(shared_pool, "/tokenize", body))
        assert (
            out["count"] == len(out["tokens"]) == _usage(shared_pool, "/v1/chat/completions", body)
        )
    rendered = hf.apply_chat_template(
        [*CHAT[:1], {"role": "user", "content": "Weather in Paris?"}],
        tokenize=False,
        add_generation_prompt=False,
    )
    closed = {"messages": CHAT[:2], "add_generation_prompt": False}
    assert ok(post(shared_pool, "/tokenize", closed))["tokens"] == hf.encode(
        rendered, add_special_tokens=False
    )
    # A request's own template and its variables, as a chat completion renders them.
    template = "{% for m in messages %}{{ greeting }} {{ m.content }}\n{% endfor %}"
    own = {
        "messages": CHAT[:2],
        "chat_template": template,
        "chat_template_kwargs": {"greeting": "Hi"},
    }
    out = ok(post(shared_pool, "/tokenize", own))
    assert out["tokens"] == hf.encode(
        "Hi You are terse.\nHi Weather in Paris?\n", add_special_tokens=False
    )
    assert out["count"] == _usage(shared_pool, "/v1/chat/completions", own)


def test_continue_final_message_leaves_the_last_turn_open(shared_pool: Any, hf: Any) -> None:
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The river"}]
    body = {"messages": turns, "continue_final_message": True, "add_generation_prompt": False}
    out = ok(post(shared_pool, "/tokenize", body))
    text = hf.decode(out["tokens"])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nThe river"


def test_detokenize_undoes_tokenize(shared_pool: Any) -> None:
    for text in (PROMPT, "<|im_start|>user\n  two  spaces<|im_end|>\n", "🦀 mixed scripts: 日本"):
        tokens = ok(post(shared_pool, "/tokenize", {"prompt": text}))["tokens"]
        assert ok(post(shared_pool, "/detokenize", {"tokens": tokens})) == {"prompt": text}
    assert ok(post(shared_pool, "/detokenize", {"tokens": []})) == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404, "model"),
        ("/detokenize", {"model": "no-such-model", "tokens": [5]}, 404, "model"),
        ("/tokenize", {}, 400, None),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, None),
        ("/tokenize", {"prompt": 7}, 400, "prompt"),
        ("/tokenize", {"prompt": "x" * 200_000}, 400, "prompt"),
        (
            "/tokenize",
            {"messages": [{"role": "tool", "content": "x"}]},
            400,
            "messages[0].tool_call_id",
        ),
        ("/tokenize", {"messages": [], "add_generation_prompt": True}, 400, "messages"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for %}"},
            400,
            "chat_template",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/detokenize", {"tokens": [5, 1024]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [5] * 2049}, 400, "tokens"),
        ("/detokenize", {"tokens": "5 6"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
    ],
)
def test_bad_input_is_a_4xx_naming_the_param(
    shared_pool: Any, path: str, body: dict[str, Any], status: int, param: str | None
) -> None:
    resp = httpx.post(f"{shared_pool.url}{path}", json={"model": TINY_MODEL, **body}, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]
    if status == 404:
        assert error["code"] == "model_not_found" and TINY_MODEL in error["message"]
