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
from router.relay.direct_lane import DirectLane
from router.relay.progress import ChoiceProgress, error_for
from router.relay.streams import (
    Batches,
    LastWrite,
    collect,
    lane_response,
    open_streams,
    served_by,
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
    shape = MessageShape(routed.model)
    if not routed.stream:
        (events,) = open_streams(request, state, routed)
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

    def body(first: list[StreamEvent], batches: Batches, lane: DirectLane) -> AsyncIterator[bytes]:
        return _chunks(first, batches, progress, shape, lane)

    return await lane_response(request, state, routed, body)


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


async def _chunks(
    first: list[StreamEvent],
    batches: Batches,
    progress: ChoiceProgress,
    shape: MessageShape,
    lane: DirectLane,
) -> AsyncIterator[bytes]:
    """The message's events, one write a stream read; `lane` is given the renderer of its token
    deltas."""
    out = MessageEvents(shape)
    started = False

    def render(ev: StreamEvent) -> tuple[bytes, bool]:
        """`ev`'s events, and whether they end the stream."""
        nonlocal started
        if ev.kind == "error":
            return error_event(error_for(ev)), True
        text, calls = progress.on_event(ev)
        head = b""
        if not started:  # the first event (a start) says how much of the prompt was cached
            started = True
            prompt = Usage(len(progress.gen.prompt_tokens), 0, progress.usage.cached_tokens)
            head = out.start(prompt)
        data = head + out.text(text) + out.tool_calls(calls)
        if ev.kind == "done":
            return data + out.end(progress.finish_reason, progress.stop_str, progress.usage), True
        return data, False

    def written(batch: list[StreamEvent]) -> tuple[bytes, bool]:
        """A read's events as one write, and whether it ends the stream (a sync step, so no
        event stays bound while the next read is awaited)."""
        parts = []
        for ev in batch:
            data, end = render(ev)
            parts.append(data)
            if end:
                return b"".join(parts), True
        return b"".join(parts), False

    def deltas(batch: list[StreamEvent]) -> bytes:
        """The lane's write of a read's token deltas (none of which ends the stream)."""
        return written(batch)[0]

    lane.render = deltas
    async with aclosing(batches):
        batch: list[StreamEvent] | None = first
        del first  # the loop's own now: no read stays bound while the next is awaited
        while batch is not None:
            data, end = written(batch)
            if end:
                yield LastWrite(data)
                return
            if data:
                yield data
            batch = None
            batch = await anext(batches, None)
