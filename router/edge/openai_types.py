"""OpenAI wire types: the request bodies we accept and the response objects we build.

Request models validate *types* strictly (a string where a number belongs is a 400, not a silent
cast) and ignore unknown fields, as OpenAI clients send many we do not use. Every string we read
is `Text`: JSON can carry a lone surrogate (`"\\ud800"`) that Python accepts but UTF-8, msgpack
and the tokenizer do not. Range and semantic checks (max_tokens against the context, n, seed, the
number of stop sequences, the model id) live in router.admission.admit.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from shared.wire import MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_TOP_LOGPROBS

FinishReason = Literal["stop", "length", "tool_calls"]


def _valid_unicode(text: str) -> str:
    # A str that does not encode to UTF-8 holds a lone surrogate (JSON decoding joins pairs).
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise PydanticCustomError(
                "lone_surrogate",
                "the text holds a lone surrogate at position {position}; "
                "send valid Unicode (a surrogate escape must be half of a pair)",
                {"position": exc.start},
            ) from None
    return text


# Every string field of a request: one that is not valid Unicode is a 400 naming its field.
Text = Annotated[str, AfterValidator(_valid_unicode)]


def _valid_json_strings(value: Any) -> Any:
    """Every string (key or value) inside a JSON tree is valid Unicode (see `Text`)."""
    if isinstance(value, str):
        _valid_unicode(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _valid_json_strings(k)
            _valid_json_strings(v)
    elif isinstance(value, list):
        for v in value:
            _valid_json_strings(v)
    return value


# A JSON object passed on to the chat template (tool parameters, chat_template_kwargs) or
# compiled to a grammar (response_format).
JSONObject = Annotated[dict[Text, Any], AfterValidator(_valid_json_strings)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    # Omitted or null: the router's own model (vLLM, llama.cpp and mlx_lm.server do the same).
    model: Text | None = None
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
    stop: Text | list[Text] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    prompt_cache_key: Text | None = None
    n: int | None = 1
    # OpenAI's newer name for max_tokens (it wins when both are sent), on both endpoints.
    max_completion_tokens: int | None = None
    # Sampling controls beyond OpenAI's (vLLM's names); top_k's range (-1 and 0: off) and
    # logit_bias's token ids (JSON keys: strings of ints) are checked in admission.
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[Text, float] | None = None
    # vLLM's stopping extras; min_tokens' range and stop_token_ids' ids and count are checked in
    # admission.
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    # text, json_object, json_schema, regex or grammar: router.admission.structured_output compiles
    # it.
    response_format: JSONObject | None = None


# The legacy completions API lists at most this many alternatives per token.
MAX_COMPLETION_LOGPROBS = 5


class CompletionRequest(_SamplingFields):
    # A string, token ids, or a one-element list of either (admission rejects longer lists).
    prompt: Text | list[int] | list[Text] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    # The prompt's text (and, with logprobs, its tokens' logprobs) before the completion's.
    echo: bool | None = None
    # Not served; admission refuses a value that asks for them (best_of > 1, a suffix) instead
    # of ignoring it.
    best_of: int | None = None
    suffix: Text | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class FunctionCall(_Body):
    name: Text
    arguments: Text  # a JSON string, as OpenAI sends it


class ToolCall(_Body):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null: only an assistant message with tool_calls (admission checks the rule).
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # assistant only
    tool_call_id: Text | None = None  # tool only (required there)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class FunctionSpec(_Body):
    name: Text = Field(min_length=1)
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: bool | None = None


class ToolSpec(_Body):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    chat_template: Text | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Extra variables for the chat template (e.g. {"enable_thinking": false}).
    chat_template_kwargs: JSONObject | None = None


# --- responses -----------------------------------------------------------------------------------


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def body(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class ResponseFormat:
    """How one endpoint shapes its objects; the relay code is the same for both endpoints."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        if not self.id:
            self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def body(
        self,
        text: str,
        finish_reason: str | None,
        usage: Usage,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming response; `logprobs` as router.relay.logprobs renders them (None: the
        request asked for none). With tool calls, `content` is null when no text came with
        them."""
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if tool_calls:
                message["content"] = text or None
                message["tool_calls"] = tool_calls
            choice = {
                "index": 0,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            out = self._envelope("text_completion", [choice])
        out["usage"] = usage.body()
        return out

    def chunk(
        self,
        text: str,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
        first_index: int = 0,
    ) -> dict[str, Any]:
        """One streaming chunk carrying text, tool calls (each whole, numbered from
        `first_index`) and/or the finish reason, and the logprobs of the tokens whose text it
        carries."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {}
            if text and not first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [
                    {"index": first_index + i, **call} for i, call in enumerate(tool_calls)
                ]
            choice = {
                "index": 0,
                "delta": delta,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """`stream_options.include_usage`: the last chunk, with no choices."""
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = usage.body()
        return out
