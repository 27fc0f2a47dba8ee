"""A relayed choice as the Messages API answers it: one message object, or its SSE events
(message_start, ping, content_block_start / _delta / _stop per block, message_delta,
message_stop; `error` for a failure mid-stream).

Usage follows Anthropic's split of the prompt: `input_tokens` are the prompt tokens computed for
this request, `cache_read_input_tokens` those the prefix cache served (their sum is the prompt,
what count_tokens answers); the pool caches without being asked, so it never reports a cache
write (`cache_creation_input_tokens` is 0).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from router.dialects.anthropic_errors import error_body
from router.edge.errors import APIError
from router.edge.openai_types import Usage
from router.relay.streams import sse

# The router's finish reasons as Anthropic's stop reasons ("stop" is end_turn, or stop_sequence
# when the stop sequence that ended the text is known).
STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "", "end_turn")


def usage_body(usage: Usage) -> dict[str, int]:
    cached = min(usage.cached_tokens, usage.prompt_tokens)
    return {
        "input_tokens": usage.prompt_tokens - cached,
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped tool call (router.admission.tool_calls) as a tool_use block; arguments
    that are not a JSON object (Anthropic's `input` is one) go whole under "arguments"."""
    arguments = call["function"]["arguments"]
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    tool_input = parsed if isinstance(parsed, dict) else {"arguments": arguments}
    call_id = "toolu_" + str(call["id"]).removeprefix("call_")
    return {
        "type": "tool_use",
        "id": call_id,
        "name": call["function"]["name"],
        "input": tool_input,
    }


@dataclass
class MessageShape:
    """One response's id and model, shared by its body or its events."""

    model: str
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)

    def message(
        self,
        content: list[dict[str, Any]],
        usage: Usage,
        finish_reason: str | None = None,
        stop_sequence: str | None = None,
        done: bool = True,
    ) -> dict[str, Any]:
        """The message object; `done` False: message_start's, before any stop reason."""
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": content,
            "model": self.model,
            "stop_reason": stop_reason(finish_reason, stop_sequence) if done else None,
            "stop_sequence": stop_sequence,
            "usage": usage_body(usage),
        }


def message_body(
    shape: MessageShape,
    text: str,
    calls: list[dict[str, Any]],
    finish_reason: str | None,
    stop_sequence: str | None,
    usage: Usage,
) -> dict[str, Any]:
    """The non-streamed answer: the text (when there is any), then the tool calls."""
    content = [{"type": "text", "text": text}] if text else []
    content += [tool_use_block(call) for call in calls]
    return shape.message(content, usage, finish_reason, stop_sequence)


def event(kind: str, **fields: Any) -> bytes:
    return sse({"type": kind, **fields}, event=kind)


@dataclass
class MessageEvents:
    """A streamed answer's events: text in a text block opened at its first text (and again
    after a tool call), each tool call whole in a tool_use block of its own."""

    shape: MessageShape
    blocks: int = 0  # content blocks opened so far (the next one's index)
    text_open: bool = False

    def start(self, usage: Usage) -> bytes:
        message = self.shape.message([], usage, done=False)
        return event("message_start", message=message) + event("ping")

    def text(self, text: str) -> bytes:
        if not text:
            return b""
        out = b""
        if not self.text_open:
            block = {"type": "text", "text": ""}
            out = event("content_block_start", index=self.blocks, content_block=block)
            self.text_open = True
            self.blocks += 1
        delta = {"type": "text_delta", "text": text}
        return out + event("content_block_delta", index=self.blocks - 1, delta=delta)

    def tool_calls(self, calls: list[dict[str, Any]]) -> bytes:
        if not calls:
            return b""
        out = self._close_text()
        for call in calls:
            block = tool_use_block(call)
            partial = json.dumps(block["input"], ensure_ascii=False)
            i, self.blocks = self.blocks, self.blocks + 1
            out += event("content_block_start", index=i, content_block={**block, "input": {}})
            delta = {"type": "input_json_delta", "partial_json": partial}
            out += event("content_block_delta", index=i, delta=delta)
            out += event("content_block_stop", index=i)
        return out

    def end(self, finish_reason: str | None, stop_sequence: str | None, usage: Usage) -> bytes:
        reason = stop_reason(finish_reason, stop_sequence)
        delta = {"stop_reason": reason, "stop_sequence": stop_sequence}
        return (
            self._close_text()
            + event("message_delta", delta=delta, usage=usage_body(usage))
            + event("message_stop")
        )

    def _close_text(self) -> bytes:
        if not self.text_open:
            return b""
        self.text_open = False
        return event("content_block_stop", index=self.blocks - 1)


def error_event(err: APIError) -> bytes:
    return sse(error_body(err.status, err.message), event="error")
