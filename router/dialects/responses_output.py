"""The Response object of OpenAI's Responses API, built from a relayed choice: its output items
(an assistant message with `output_text`, one `function_call` item per tool call), usage, status,
and the request's settings echoed as OpenAI echoes them."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.dialects.responses import ResponsesRequest, chat_tool_choice
from router.edge.openai_types import Usage
from router.relay.progress import ChoiceProgress


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed", item_id: str = "") -> dict[str, Any]:
    return {
        "id": item_id or new_id("msg"),
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [text_part(text)],
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """A chat tool call ({id, type, function: {name, arguments}}) as a function_call item."""
    return {
        "id": new_id("fc"),
        "type": "function_call",
        "status": status,
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
    }


def output_items(progress: ChoiceProgress) -> list[dict[str, Any]]:
    """The message (its text; present too when nothing else is), then the tool calls."""
    text = "".join(progress.text)
    status = item_status(progress.finish_reason)
    items = [message_item(text, status)] if text or not progress.tool_calls else []
    return items + [call_item(call) for call in progress.tool_calls]


def item_status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass
class ResponseShape:
    """One response's identity and the request settings its object echoes."""

    body: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def envelope(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.body
        done = status in ("completed", "incomplete")
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "completed_at": int(time.time()) if done else None,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": (
                {"reason": "max_output_tokens"} if status == "incomplete" else None
            ),
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": {"effort": None, "summary": None},
            "store": body.stored,
            "temperature": 0.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
            "tool_choice": _echoed_choice(body),
            "tools": [_echoed_tool(t) for t in body.tools or []],
            "top_logprobs": 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": usage_body(usage) if usage is not None else None,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def finished(self, progress: ChoiceProgress, output: list[dict[str, Any]]) -> dict[str, Any]:
        return self.envelope(_status(progress), output, progress.usage)


def _status(progress: ChoiceProgress) -> str:
    return "incomplete" if progress.finish_reason == "length" else "completed"


def _echoed_choice(body: ResponsesRequest) -> str | dict[str, Any]:
    choice = chat_tool_choice(body)
    if choice is None or isinstance(choice, str):
        return choice or "auto"
    return {"type": "function", "name": choice["function"]["name"]}


def _echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"description": None, "parameters": None, "strict": True, **tool}
