"""POST /tokenize and POST /detokenize, vLLM's paths and shapes, served by the router (it holds
every served model's tokenizer): no worker is involved.

A prompt is tokenized as a completion of it is, and messages as a chat completion renders them
(router.admission.admit's own path: template, tools, template variables, the same checks), so
`count` is the `usage.prompt_tokens` that request would report. The work runs on a worker
thread, as admission's does, behind admission's bound on a text's length.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter

from router.admission.admit import (
    AdmissionContext,
    chat_prompt_tokens,
    completion_prompt_tokens,
)
from router.admission.tokenization import TokenizerLoadError
from router.edge.errors import APIError
from router.edge.json_body import JSONBodyRoute
from router.edge.openai_types import ChatCompletionRequest
from router.edge.tokenize_types import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from router.pool_view.model_catalog import unknown_model_message, unservable_error
from router.state import RouterState, StateDep
from shared.canary_check import CanaryMismatch
from shared.errors import ErrorKind

router = APIRouter(route_class=JSONBodyRoute)


def _context(state: RouterState, model: str | None) -> AdmissionContext:
    """The served model's admission context (blocking: the catalog may load a tokenizer)."""
    model = model or state.model_id
    try:
        ctx = state.catalog.get(model)
    except (TokenizerLoadError, CanaryMismatch) as exc:  # its workers' fault, not the caller's
        raise unservable_error(model, exc) from exc
    if ctx is None:
        message = unknown_model_message(model, state.catalog.served())
        raise APIError.of(ErrorKind.UNKNOWN_MODEL, message, "model")
    return ctx


def _invalid(message: str, param: str | None = None) -> APIError:
    return APIError.of(ErrorKind.INVALID_REQUEST, message, param)


def _chat_body(body: TokenizeRequest) -> ChatCompletionRequest:
    """The chat completion whose prompt these messages are."""
    return ChatCompletionRequest(
        model=body.model,
        messages=body.messages or [],
        chat_template=body.chat_template,
        chat_template_kwargs=body.chat_template_kwargs,
        tools=body.tools,
    )


def _tokenize(state: RouterState, body: TokenizeRequest) -> dict[str, Any]:
    if (body.prompt is None) == (body.messages is None):
        raise _invalid("Send exactly one of 'prompt' (a text) and 'messages' (a chat).")
    ctx = _context(state, body.model)
    if body.prompt is not None:
        special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = completion_prompt_tokens(body.prompt, ctx, special)
    else:
        if body.continue_final_message and body.add_generation_prompt:
            raise _invalid(
                "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
                "continue_final_message",
            )
        tokens = chat_prompt_tokens(
            _chat_body(body),
            ctx,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            add_special_tokens=bool(body.add_special_tokens),
        )
    strs = ctx.tokenizer.token_strings(tokens) if body.return_token_strs else None
    out = TokenizeResponse(
        count=len(tokens),
        max_model_len=ctx.tokenizer.context_length,
        tokens=tokens,
        token_strs=strs,
    )
    return out.model_dump(exclude_none=True)


def _detokenize(state: RouterState, body: DetokenizeRequest) -> dict[str, Any]:
    ctx = _context(state, body.model)
    tok = ctx.tokenizer
    # No sequence of the model is longer than its context: the bound keeps decoding small.
    if len(body.tokens) > tok.context_length:
        raise _invalid(
            f"'tokens' holds {len(body.tokens)} ids, more than the model's context of "
            f"{tok.context_length}.",
            "tokens",
        )
    bad = next((t for t in body.tokens if not 0 <= t < tok.vocab_size), None)
    if bad is not None:
        raise _invalid(f"Token ids must be in [0, {tok.vocab_size}), got {bad}.", "tokens")
    return DetokenizeResponse(prompt=tok.decode(body.tokens)).model_dump()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(_tokenize, state, body)


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, state: StateDep) -> dict[str, Any]:
    return await anyio.to_thread.run_sync(_detokenize, state, body)
