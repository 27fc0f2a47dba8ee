"""The Responses API's three verbs: create (translate, admit and relay as a chat request, store),
retrieve and delete a stored response."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import redis
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from router.dialects.response_store import ResponseStore, StoredResponse
from router.dialects.responses import (
    Message,
    ResponsesRequest,
    chat_body,
    in_responses_terms,
    input_messages,
    invalid,
    items_to_messages,
    refuse_unserved,
)
from router.dialects.responses_output import ResponseShape, output_items
from router.dialects.responses_stream import OnDone, stream_response
from router.edge.errors import APIError, validation_failure
from router.edge.openai_types import ChatCompletionRequest
from router.relay.direct_lane import DirectLane
from router.relay.routed import RoutedRequest
from router.relay.streams import Batches, collect, lane_response, open_streams, served_by
from router.relay.submit import submit_chat
from router.state import RouterState
from shared.errors import ErrorKind
from shared.wire import StreamEvent


def response_store(state: RouterState) -> ResponseStore:
    return ResponseStore(state.aredis, state.settings.router.responses_ttl_s)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError.of(
        ErrorKind.NOT_FOUND,
        f"No stored response with id '{response_id[:100]}' (never stored, stored with "
        "'store': false, deleted or expired).",
        param,
    )


async def create(request: Request, state: RouterState, body: ResponsesRequest) -> Response:
    refuse_unserved(body)
    store = response_store(state)
    history: list[Message] = []
    if body.previous_response_id is not None:
        previous = await store.load(body.previous_response_id)
        if previous is None:
            raise not_found(body.previous_response_id, "previous_response_id")
        history = previous.messages
    conversation = history + input_messages(body)
    chat = _chat_request(body, conversation)
    try:
        routed = await submit_chat(chat, state)
    except APIError as err:
        raise in_responses_terms(err) from None
    shape = ResponseShape(body, routed.model)

    async def save(response: dict[str, Any], output: list[dict[str, Any]]) -> None:
        if not body.stored:
            return
        messages = conversation + items_to_messages(output, "output")
        try:
            await store.save(StoredResponse(response, messages))
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise APIError.of(
                ErrorKind.REDIS_UNAVAILABLE,
                f"The response could not be stored (Redis is unreachable): {exc}",
            ) from exc

    return await _relay(request, state, routed, shape, save)


def _chat_request(body: ResponsesRequest, conversation: list[Message]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate(chat_body(body, conversation))
    except ValidationError as exc:  # the items were checked: a field of the request itself
        message, param = validation_failure(list(exc.errors()))
        raise in_responses_terms(invalid(message, param)) from None


async def _relay(
    request: Request, state: RouterState, routed: RoutedRequest, shape: ResponseShape, save: OnDone
) -> Response:
    (progress,) = routed.start_relay()
    if not routed.stream:
        (events,) = open_streams(request, state, routed)
        await collect(events, progress)
        output = output_items(progress)
        response = shape.finished(progress, output)
        await save(response, output)
        return JSONResponse(response, headers=served_by(progress.worker_id))

    def body(first: list[StreamEvent], batches: Batches, lane: DirectLane) -> AsyncIterator[bytes]:
        return stream_response(first, batches, progress, shape, save, lane)

    return await lane_response(request, state, routed, body)


async def retrieve(state: RouterState, response_id: str) -> dict[str, Any]:
    stored = await response_store(state).load(response_id)
    if stored is None:
        raise not_found(response_id)
    return stored.response


async def delete(state: RouterState, response_id: str) -> dict[str, Any]:
    if not await response_store(state).delete(response_id):
        raise not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
