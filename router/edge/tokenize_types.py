"""vLLM's tokenizer API wire types: POST /tokenize (a prompt, or chat messages) and POST
/detokenize, as vllm/entrypoints/openai/protocol.py names their fields.

One request model for /tokenize holds both shapes (vLLM's TokenizeCompletionRequest and
TokenizeChatRequest): the route picks by which of `prompt` and `messages` is sent, so a body
with neither or both is one clear 400 instead of a union's two lists of errors.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from router.edge.openai_types import ChatMessage, JSONObject, Text, ToolSpec


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class TokenizeRequest(_Body):
    model: Text | None = None
    # A completion's prompt (vLLM's TokenizeCompletionRequest) ...
    prompt: Text | None = None
    # ... or a chat's messages, rendered as a chat completion renders them (TokenizeChatRequest).
    messages: list[ChatMessage] | None = None
    # None: vLLM's default for the shape (True for a prompt, False for messages, whose template
    # writes them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Text | None = None
    chat_template_kwargs: JSONObject | None = None
    tools: list[ToolSpec] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(_Body):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[int]


class DetokenizeResponse(_Body):
    prompt: str
