"""The Messages API served: a request translated to the router's chat request
(router.dialects.anthropic_request), admitted and enqueued as chat completions are, and its one
choice relayed as Anthropic's message object or event stream (router.dialects.anthropic_render).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from router.admission.admit import Admission, Outcome, chat_prompt_tokens
from router.admission.tokenization import TokenizerLoadError
from router.dialects.anthropic_render import (
    MessageEvents,
    MessageShape,
    error_event,
    message_body,
)
from router.dialects.anthropic_request import chat_request
from router.dialects.anthropic_types import CountTokensRequest, CreateMessageRequest
from router.edge.openai_types import Usage
from router.pool_view.model_catalog import unknown_model_message, unservable_error
from router.relay.progress import ChoiceProgress, error_for
from router.relay.streams import (
    Events,
    collect,
    first_events,
    open_streams,
    served_by,
    sse_response,
)
from router.relay.submit import submit_chat
from router.state import RouterState
from shared.canary_check import CanaryMismatch
from shared.wire import StreamEvent


async def create_message(
    body: CreateMessageRequest, request: Request, state: RouterState
) -> Response:
    chat = chat_request(body)
    routed = await submit_chat(chat, state)
    (progress,) = routed.start_relay()
    (events,) = open_streams(request, state, routed)
    shape = MessageShape(routed.model)
    if not routed.stream:
        await collect(events, progress)
        text = "".join(progress.text)
        answer = message_body(
            shape,
            text,
            progress.tool_calls,
            progress.finish_reason,
            progress.stop_str,
            progress.usage,
        )
        return JSONResponse(answer, headers=served_by(progress.worker_id))
    (first,) = await first_events([events])
    chunks = _events(first, events, progress, shape)
    return sse_response(chunks, first)


async def count_tokens(body: CountTokensRequest, state: RouterState) -> dict[str, Any]:
    """The prompt tokens the same request would have, tokenized as admission does; nothing is
    enqueued."""
    chat = chat_request(body)

    def run() -> list[int] | Admission:
        try:
            ctx = state.catalog.get(body.model)
        except (TokenizerLoadError, CanaryMismatch) as exc:  # its workers', not the caller's
            raise unservable_error(body.model, exc) from exc
        if ctx is None:
            message = unknown_model_message(body.model, state.catalog.served())
            return Admission(Outcome.UNKNOWN_MODEL, param="model", message=message)
        return chat_prompt_tokens(chat, ctx)

    counted = await anyio.to_thread.run_sync(run)
    if isinstance(counted, Admission):
        raise counted.error()
    return {"input_tokens": len(counted)}


async def _events(
    first: StreamEvent,
    events: Events,
    progress: ChoiceProgress,
    shape: MessageShape,
) -> AsyncIterator[bytes]:
    out = MessageEvents(shape)
    async with aclosing(events):
        ev: StreamEvent | None = first
        started = False
        while ev is not None:
            if ev.kind == "error":
                yield error_event(error_for(ev))
                return
            text, calls = progress.on_event(ev)
            head = b""
            if not started:  # the first event (a start) says how much of the prompt was cached
                started = True
                prompt = Usage(len(progress.gen.prompt_tokens), 0, progress.usage.cached_tokens)
                head = out.start(prompt)
            data = head + out.text(text) + out.tool_calls(calls)
            if ev.kind == "done":
                yield data + out.end(progress.finish_reason, progress.stop_str, progress.usage)
                return
            if data:
                yield data
            ev = await anext(events, None)
