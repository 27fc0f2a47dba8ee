"""A relayed request as OpenAI's chat and completions APIs answer it: one JSON body, or SSE
chunks (several choices side by side under their `index`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from router.edge.openai_types import ResponseFormat, Usage
from router.relay.direct_lane import DirectLane
from router.relay.logprobs import LogprobRenderer, token_table
from router.relay.progress import ChoiceProgress, error_for
from router.relay.routed import RoutedRequest
from router.relay.streams import (
    Batches,
    LastWrite,
    collect_all,
    first_batches,
    lane_response,
    open_batches,
    open_streams,
    served_by,
    sse,
    sse_response,
)
from router.state import RouterState
from shared.wire import StreamEvent


async def respond(request: Request, state: RouterState, routed: RoutedRequest) -> Response:
    """Relay a request already admitted and enqueued (router.relay.submit); routed.fmt says
    which of the two APIs' shapes it gets."""
    fmt = routed.fmt
    assert fmt is not None, "the route sets the response format"
    progress = routed.start_relay()
    renderer = None
    if routed.gens[0].logprobs is not None:
        renderer = _logprob_renderer(routed, fmt.chat)
    if not routed.stream:
        streams = open_streams(request, state, routed)
        await collect_all(streams, progress)
        body = _body(fmt, progress, renderer)
        return JSONResponse(body, headers=served_by(progress[0].worker_id))
    if len(routed.gens) == 1:  # one write a stream read already, token deltas by its lane

        def body(
            first: list[StreamEvent], batches: Batches, lane: DirectLane
        ) -> AsyncIterator[bytes]:
            return _chunks(first, batches, routed, progress[0], renderer, lane=lane)

        return await lane_response(request, state, routed, body)
    batches = open_batches(request, state, routed)
    firsts = await first_batches(batches)
    chunks = _merged(list(zip(firsts, batches, progress, strict=True)), routed, renderer)
    return sse_response(chunks, firsts[0][0])


def _body(
    fmt: ResponseFormat, progress: list[ChoiceProgress], renderer: LogprobRenderer | None
) -> dict[str, Any]:
    """The whole response; the usage counts each prompt once and every choice's tokens."""
    bodies = []
    for p in progress:
        lp = renderer.render(p.logprobs, p.chars) if renderer is not None else None
        bodies.append(fmt.body("".join(p.text), p.finish_reason, p.usage, lp, p.tool_calls))
    if len(bodies) == 1:
        return bodies[0]
    body = fmt.body("", None, total_usage(progress))
    body["choices"] = [b["choices"][0] | {"index": i} for i, b in enumerate(bodies)]
    return body


def _unsent_logprobs(
    renderer: LogprobRenderer | None, progress: ChoiceProgress
) -> dict[str, Any] | None:
    """The logprobs of the tokens no chunk has carried yet (a token whose text the worker held
    back, part of a character or of a possible stop string, goes with the chunk that carries
    its text, or with the last chunk)."""
    if renderer is None or progress.logprobs_sent == len(progress.logprobs):
        return None
    unsent = progress.logprobs[progress.logprobs_sent :]
    progress.logprobs_sent = len(progress.logprobs)
    return renderer.render(unsent, progress.chars)


def chunk_writer(index: int, include_usage: bool) -> Callable[[dict[str, Any]], bytes]:
    """A choice's non-final chunk as SSE bytes: its index (0 is fmt's own), and with
    include_usage the `usage: null` OpenAI marks every non-final chunk with."""

    def chunk(body: dict[str, Any]) -> bytes:
        if index:
            for choice in body["choices"]:
                choice["index"] = index
        if include_usage:
            body["usage"] = None
        return sse(body)

    return chunk


# Stands for a chunk's text while its template is cut (text_chunk_writer); orjson writes it
# with escapes that no id or model name holds.
_PROBE = f"\x00{uuid.uuid4().hex}\x00"


def text_chunk_writer(
    chunk: Callable[[dict[str, Any]], bytes], fmt: ResponseFormat
) -> Callable[[str], bytes]:
    """A chunk of text alone (not empty: a chat delta without text has no `content`) as SSE
    bytes from the request's own template: the bytes `chunk` makes of `fmt.chunk(text)`, cut
    once around the text, so per token only the text is encoded."""
    head, tail = chunk(fmt.chunk(_PROBE)).split(orjson.dumps(_PROBE))

    def text_chunk(text: str) -> bytes:
        return head + orjson.dumps(text) + tail

    return text_chunk


async def _chunks(
    first: list[StreamEvent],
    batches: Batches,
    routed: RoutedRequest,
    progress: ChoiceProgress,
    renderer: LogprobRenderer | None,
    index: int = 0,
    final: bool = True,
    lane: DirectLane | None = None,
) -> AsyncIterator[bytes]:
    """One choice's SSE chunks, one write a stream read; `final`: it is the response's only
    choice, so it also sends the usage chunk and [DONE] (with several, _merged does, once);
    `lane`: the choice's direct lane, given the renderer of its token deltas."""
    fmt = routed.fmt
    assert fmt is not None
    include_usage = routed.include_usage
    chunk = chunk_writer(index, include_usage)
    text_chunk = text_chunk_writer(chunk, fmt)
    out: list[bytes] = []

    def render(ev: StreamEvent) -> bool:
        """`ev`'s chunks into `out`; True when it ends the response (its chunks then are all)."""
        if ev.kind == "error":
            out.append(sse(error_for(ev).body()))
            if final:
                out.append(sse("[DONE]"))
            return True
        tools = progress.tool_stream
        sent = len(tools.calls) if tools is not None else 0
        text, calls = progress.on_event(ev)
        if text or calls:
            lp = None if renderer is None else _unsent_logprobs(renderer, progress)
            if lp is None and not calls:
                out.append(text_chunk(text))
            else:
                body = fmt.chunk(text, logprobs=lp, tool_calls=calls, first_index=sent)
                out.append(chunk(body))
        if ev.kind != "done":
            return False
        last = _unsent_logprobs(renderer, progress)
        out.append(chunk(fmt.chunk("", progress.finish_reason, logprobs=last)))
        if final:
            if include_usage:
                out.append(sse(fmt.usage_chunk(progress.usage)))
            out.append(sse("[DONE]"))
        return True

    def deltas(batch: list[StreamEvent]) -> bytes:
        """The lane's write of a read's token deltas (none of which ends the response)."""
        for ev in batch:
            render(ev)
        data = b"".join(out)
        out.clear()
        return data

    if lane is not None:
        lane.render = deltas
    async with aclosing(batches):
        if fmt.chat:
            out.append(chunk(fmt.chunk("", first=True)))
        batch: list[StreamEvent] | None = first
        del first  # the loop's own now: no read stays bound while the next is awaited
        while batch is not None:
            # A sync step per event (any() stops at the one that ends the response), so no
            # event stays bound in this frame while the next read is awaited (Watch.batches).
            if any(map(render, batch)):
                yield _written(out, final)
                return
            if out:
                yield b"".join(out)
                out.clear()
            batch = None
            batch = await anext(batches, None)


def _written(chunks: list[bytes], last: bool) -> bytes:
    data = b"".join(chunks)
    return LastWrite(data) if last else data


async def _merged(
    parts: list[tuple[list[StreamEvent], Batches, ChoiceProgress]],
    routed: RoutedRequest,
    renderer: LogprobRenderer | None,
) -> AsyncIterator[bytes]:
    """The choices' chunks as they come, then one usage chunk and one [DONE]."""
    fmt = routed.fmt
    assert fmt is not None
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def pump(
        i: int, first: list[StreamEvent], batches: Batches, progress: ChoiceProgress
    ) -> None:
        try:
            async for data in _chunks(
                first, batches, routed, progress, renderer, index=i, final=False
            ):
                await queue.put(data)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, *part)) for i, part in enumerate(parts)]
    try:
        left = len(tasks)
        while left:
            data = await queue.get()
            if data is None:
                left -= 1
                continue
            yield data
        if routed.include_usage:
            yield sse(fmt.usage_chunk(total_usage([p for _, _, p in parts])))
        yield sse("[DONE]")
    finally:  # the client went away: every choice's stream is let go
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def total_usage(progress: list[ChoiceProgress]) -> Usage:
    """A prompt's tokens once (its choices share it: one list object), every choice's output."""
    total, seen = Usage(), set()
    for p in progress:
        if id(p.gen.prompt_tokens) not in seen:
            seen.add(id(p.gen.prompt_tokens))
            total.prompt_tokens += p.usage.prompt_tokens
            total.cached_tokens += p.usage.cached_tokens
        total.completion_tokens += p.usage.completion_tokens
    return total


def _logprob_renderer(routed: RoutedRequest, chat: bool) -> LogprobRenderer:
    """From the model the request was admitted on, whose token table admission built before the
    enqueue (router.relay.submit): nothing here waits or fails between the enqueue and the
    relay, which lets the request go if its client does."""
    ctx = routed.admission.context
    assert ctx is not None, "admit_and_submit keeps the model's context"
    return LogprobRenderer(token_table(ctx.tokenizer), chat)
