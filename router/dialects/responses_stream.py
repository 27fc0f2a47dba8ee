"""A streamed Responses API answer: the typed SSE events OpenAI's clients parse, each with
`event: <type>` and a `sequence_number`.

response.created, response.in_progress; for text: response.output_item.added (a message),
response.content_part.added, response.output_text.delta ..., response.output_text.done,
response.content_part.done, response.output_item.done; for each tool call, whole when its text
has been parsed: response.output_item.added (a function_call), response.function_call_arguments
.delta, response.function_call_arguments.done, response.output_item.done; then
response.completed (or response.incomplete at the token limit). A failure after the 200 is an
`error` event and response.failed.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from router.dialects.responses_output import (
    ResponseShape,
    call_item,
    item_status,
    message_item,
    text_part,
)
from router.edge.errors import APIError
from router.relay.direct_lane import DirectLane
from router.relay.progress import ChoiceProgress, error_for
from router.relay.streams import Batches, LastWrite, sse
from shared.wire import StreamEvent

# Called with the finished response object and its output items before response.completed goes
# out, so a client that continues at once finds it stored.
OnDone = Callable[[dict[str, Any], list[dict[str, Any]]], Awaitable[None]]


class ResponseEvents:
    """The events of one response, numbered; the output items as they were streamed."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = 0
        self.items: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the message item open for text
        self._text: list[str] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return sse(payload, event=kind)

    def start(self) -> list[bytes]:
        snapshot = self.shape.envelope("in_progress", [])
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def text(self, delta: str) -> list[bytes]:
        out = [] if self._message is not None else self._open_message()
        assert self._message is not None
        self._text.append(delta)
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self._message["id"],
                output_index=len(self.items) - 1,
                content_index=0,
                delta=delta,
                logprobs=[],
            )
        )
        return out

    def calls(self, calls: list[dict[str, Any]]) -> list[bytes]:
        out = self._close_message("completed")
        for call in calls:
            item = call_item(call)
            index = len(self.items)
            self.items.append(item)
            ids = {"item_id": item["id"], "output_index": index}
            added = {**item, "status": "in_progress", "arguments": ""}
            out += [
                self.event("response.output_item.added", output_index=index, item=added),
                self.event(
                    "response.function_call_arguments.delta", **ids, delta=item["arguments"]
                ),
                self.event(
                    "response.function_call_arguments.done", **ids, arguments=item["arguments"]
                ),
                self.event("response.output_item.done", output_index=index, item=item),
            ]
        return out

    def finish(self, progress: ChoiceProgress) -> tuple[dict[str, Any], list[bytes]]:
        """The finished response and its last events (an empty answer is an empty message)."""
        out = self._open_message() if not self.items else []
        out += self._close_message(item_status(progress.finish_reason))
        response = self.shape.finished(progress, self.items)
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return response, [*out, self.event(kind, response=response)]

    def failed(self, err: APIError) -> list[bytes]:
        """The `error` event names the pool's own code; the failed response's `error.code` is
        the one of OpenAI's codes its clients know that fits."""
        code = err.code or err.type
        error = {"code": _response_code(err), "message": err.message}
        failed = self.shape.envelope("failed", self.items, error=error)
        return [
            self.event("error", code=code, message=err.message, param=err.param),
            self.event("response.failed", response=failed),
        ]

    def _open_message(self) -> list[bytes]:
        item = message_item("", "in_progress")
        item["content"] = []
        self._message, self._text = item, []
        index = len(self.items)
        self.items.append(item)
        return [
            self.event("response.output_item.added", output_index=index, item=dict(item)),
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    def _close_message(self, status: str) -> list[bytes]:
        item = self._message
        if item is None:
            return []
        self._message = None
        index = self.items.index(item)
        text = "".join(self._text)
        part = text_part(text)
        item.update(status=status, content=[part])
        ids = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **ids, text=text, logprobs=[]),
            self.event("response.content_part.done", **ids, part=part),
            self.event("response.output_item.done", output_index=index, item=item),
        ]


def _response_code(err: APIError) -> str:
    if err.status == 429:
        return "rate_limit_exceeded"
    return "server_error" if err.status >= 500 else "invalid_prompt"


async def stream_response(
    first: list[StreamEvent],
    batches: Batches,
    progress: ChoiceProgress,
    shape: ResponseShape,
    on_done: OnDone,
    lane: DirectLane,
) -> AsyncIterator[bytes]:
    """The SSE body of a response whose first read has come (the 200 is sent), one write a
    stream read; `lane` is given the renderer of its token deltas."""
    out = ResponseEvents(shape)

    def deltas(batch: list[StreamEvent]) -> bytes:
        """Events' text and tool calls as one write: the lane's token deltas, a read's events
        before its end, a `done`'s last text (a sync step, so no event stays bound while the
        next read is awaited)."""
        parts: list[bytes] = []
        for ev in batch:
            text, calls = progress.on_event(ev)
            if text:
                parts += out.text(text)
            if calls:
                parts += out.calls(calls)
        return b"".join(parts)

    def until_end(batch: list[StreamEvent]) -> tuple[bytes, StreamEvent | None]:
        """A read's events up to its `done` or `error` as one write, and that last event."""
        for i, ev in enumerate(batch):
            if ev.kind == "error" or ev.kind == "done":
                return deltas(batch[:i]), ev
        return deltas(batch), None

    lane.render = deltas
    async with aclosing(batches):
        head = b"".join(out.start())
        batch: list[StreamEvent] | None = first
        del first  # the loop's own now: no read stays bound while the next is awaited
        while batch is not None:
            data, last = until_end(batch)
            batch = None
            if last is not None and last.kind == "error":
                yield LastWrite(head + data + b"".join(out.failed(error_for(last))))
                return
            if last is not None:  # a `done`: its own text first, then the stored response
                data += deltas([last])
            if head + data:
                yield head + data
            head = b""
            if last is not None:
                yield LastWrite(await _finished(out, progress, on_done))
                return
            batch = await anext(batches, None)


async def _finished(out: ResponseEvents, progress: ChoiceProgress, on_done: OnDone) -> bytes:
    """The events that end a finished response, once it is stored (or its failure, if it
    could not be)."""
    response, ending = out.finish(progress)
    try:
        await on_done(response, out.items)
    except APIError as err:  # not stored: the client must not count on it
        ending = out.failed(err)
    return b"".join(ending)
