"""Admit and enqueue a request (one worker-thread trip), then relay it: turn its stream events
into an OpenAI response (one JSON body, or SSE chunks). Shared by /v1/completions and
/v1/chat/completions."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import orjson
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.admission import Admission, AdmissionContext, Outcome
from router.admission_ledger import Placement, Refusal
from router.busy_gate import busy_error
from router.dispatch import TIMEOUT, WORKER_LOST
from router.errors import APIError
from router.logprobs import LogprobRenderer, TokenLogprob, from_event, token_table
from router.metrics import ADMISSION_REFUSED, REQUEST_DECODE_TOK_S, REQUEST_TTFT_MS
from router.model_catalog import unknown_model_message
from router.openai_types import ResponseFormat, Usage
from router.routing_metrics import observe_placement
from router.state import RouterState
from router.tokenization import TokenizerLoadError
from router.tool_calls import ToolCallStream
from shared.block_hash import CacheNamespace, index_members
from shared.canary_check import CanaryMismatch
from shared.wire import REDIS_UNAVAILABLE, GenerationRequest, StreamEvent

log = logging.getLogger(__name__)

# nginx's code for "client closed request": nobody reads it, but logs should not say 200.
CLIENT_CLOSED = 499


@dataclass
class _Progress:
    """Text and usage so far, plus the timings the router's histograms observe."""

    gen: GenerationRequest
    text: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    worker_id: str = ""
    # The request asked for logprobs: each token's, and how many a streamed chunk has sent.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0
    chars: int = 0  # characters of completion text so far (the legacy API's text_offset)
    # A chat request with tools, on a template whose tool-call format is known: makes the
    # splitter of its text into content and tool calls (a fresh one per attempt).
    tool_streams: Callable[[], ToolCallStream] | None = None
    tool_stream: ToolCallStream | None = None
    # Completions `echo`: the prompt's text, which the choice's text starts with (and, with
    # logprobs, the prompt's tokens, with the logprobs the worker's start event carries).
    echo: str | None = None
    started: bool = False  # a start came (a second one begins a new attempt)

    def __post_init__(self) -> None:
        self.tool_stream = self.tool_streams() if self.tool_streams else None

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self.tool_stream.calls if self.tool_stream is not None else []

    def on_event(self, ev: StreamEvent) -> tuple[str, list[dict[str, Any]]]:
        """Fold one event in; returns the content text and the tool calls it completes (a
        `done` flushes what the tool-call splitter held)."""
        now = time.time()
        if ev.kind == "start":  # an attempt begins: a lost one's text (never sent) is dropped
            again, self.started = self.started, True
            self.text.clear()
            self.logprobs.clear()
            self.logprobs_sent = self.chars = 0
            self.worker_id = ev.worker_id or ""
            self.usage.cached_tokens = ev.cached_tokens
            self.__post_init__()
            if self.echo is not None:
                return self._echo(ev, again)
        elif ev.kind == "delta":
            if ev.logprobs:
                self.logprobs.extend(from_event(ev.token_ids, ev.logprobs, self.chars))
            self.chars += len(ev.text)
            stream = self.tool_stream
            text, calls = (ev.text, []) if stream is None else stream.feed(ev.text)
            self.text.append(text)
            if self.first_token_at is None:
                self.first_token_at = now
                REQUEST_TTFT_MS.observe(max(0.0, (now - self.gen.enqueued_at) * 1000))
            return text, calls
        elif ev.kind == "done":
            text, calls = ("", []) if self.tool_stream is None else self.tool_stream.finish()
            self.text.append(text)
            self.finish_reason = ev.finish_reason or "stop"
            if self.tool_calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
            self.usage = Usage(
                prompt_tokens=ev.prompt_tokens or len(self.gen.prompt_tokens),
                completion_tokens=ev.completion_tokens,
                cached_tokens=ev.cached_tokens or self.usage.cached_tokens,
            )
            # Decode speed counts the tokens after the first (the first one is the TTFT's).
            if self.first_token_at is not None and ev.completion_tokens > 1:
                elapsed = now - self.first_token_at
                if elapsed > 0:
                    REQUEST_DECODE_TOK_S.observe((ev.completion_tokens - 1) / elapsed)
            return text, calls
        return "", []

    def _echo(self, start: StreamEvent, again: bool) -> tuple[str, list[dict[str, Any]]]:
        """The prompt's text first, with its tokens' logprobs when asked (the first token has
        none, as OpenAI reports it); streamed, they go in the first chunk, once."""
        echo = self.echo or ""
        self.text.append(echo)
        self.chars = len(echo)
        if self.gen.prompt_logprobs is not None:
            prompt, entries = self.gen.prompt_tokens, start.prompt_logprobs
            if len(entries) == len(prompt) - 1:
                self.logprobs.append(TokenLogprob(prompt[0], None, None, 0))
                self.logprobs.extend(from_event(prompt[1:], entries, 0))
            else:
                log.warning(
                    "request %s: %d prompt logprobs for %d prompt tokens",
                    self.gen.request_id,
                    len(entries),
                    len(prompt),
                )
        if again:  # a retry: the first attempt's start sent them
            self.logprobs_sent = len(self.logprobs)
            return "", []
        return echo, []


def error_for(ev: StreamEvent) -> APIError:
    """A terminal `error` event (the worker's, or one the router made up) as an API error."""
    if ev.error_type == TIMEOUT:
        return APIError(504, ev.error, "server_error", None, "timeout")
    if ev.error_type == "invalid_request_error":
        return APIError(400, ev.error, "invalid_request_error")
    if ev.error_type == WORKER_LOST:
        message = f"The pool lost the worker running this request; retry shortly: {ev.error}"
        return APIError(503, message, "server_error", None, WORKER_LOST)
    if ev.error_type == REDIS_UNAVAILABLE:
        message = f"The pool lost its queue (Redis) during the request; retry shortly: {ev.error}"
        return APIError(503, message, "server_error", None, REDIS_UNAVAILABLE)
    message = f"The worker failed to generate: {ev.error}" if ev.error else "The worker failed."
    return APIError(500, message, "server_error", None, ev.error_type or None)


def _sse(payload: dict[str, Any] | str) -> bytes:
    # orjson: one chunk per streamed token, and stdlib json was the costlier half of building it.
    data = payload.encode() if isinstance(payload, str) else orjson.dumps(payload)
    return b"data: " + data + b"\n\n"


async def _collect(events: AsyncIterator[StreamEvent], progress: _Progress) -> None:
    async for ev in events:
        if ev.kind == "error":
            raise error_for(ev)
        progress.on_event(ev)
        if ev.kind == "done":
            return
    raise APIError(CLIENT_CLOSED, "The client closed the request.")


def _unsent_logprobs(
    renderer: LogprobRenderer | None, progress: _Progress
) -> dict[str, Any] | None:
    """The logprobs of the tokens no chunk has carried yet (a token whose text the worker held
    back, part of a character or of a possible stop string, goes with the chunk that carries
    its text, or with the last chunk)."""
    if renderer is None or progress.logprobs_sent == len(progress.logprobs):
        return None
    unsent = progress.logprobs[progress.logprobs_sent :]
    progress.logprobs_sent = len(progress.logprobs)
    return renderer.render(unsent, progress.chars)


async def _chunks(
    first: StreamEvent,
    events: AsyncIterator[StreamEvent],
    fmt: ResponseFormat,
    progress: _Progress,
    include_usage: bool,
    renderer: LogprobRenderer | None = None,
    index: int = 0,
    final: bool = True,
) -> AsyncIterator[bytes]:
    """One choice's SSE chunks; `final`: it is the response's only choice, so it also sends the
    usage chunk and [DONE] (with several, _merged does, once)."""

    def chunk(body: dict[str, Any]) -> bytes:
        if index:
            for choice in body["choices"]:
                choice["index"] = index
        if include_usage:
            body["usage"] = None  # OpenAI marks every non-final chunk this way
        return _sse(body)

    async with aclosing(events):
        if fmt.chat:
            yield chunk(fmt.chunk("", first=True))
        ev: StreamEvent | None = first
        while ev is not None:
            if ev.kind == "error":
                yield _sse(error_for(ev).body())
                if final:
                    yield _sse("[DONE]")
                return
            sent_calls = len(progress.tool_calls)
            text, calls = progress.on_event(ev)
            if text or calls:
                lp = _unsent_logprobs(renderer, progress)
                yield chunk(fmt.chunk(text, logprobs=lp, tool_calls=calls, first_index=sent_calls))
            if ev.kind == "done":
                last = _unsent_logprobs(renderer, progress)
                yield chunk(fmt.chunk("", progress.finish_reason, logprobs=last))
                if final:
                    if include_usage:
                        yield _sse(fmt.usage_chunk(progress.usage))
                    yield _sse("[DONE]")
                return
            ev = await anext(events, None)


B = TypeVar("B")  # a request body


async def admit_and_submit(
    admit: Callable[[B, AdmissionContext], Admission], body: B, state: RouterState
) -> Admission:
    """Admission (validation, tokenization) and the enqueue in ONE trip to a worker thread: a
    burst of requests reaches the workers sooner than with a thread hop for each. Returns the
    admission, with every choice's request in `requests` (one unless `n` or a prompt list asks
    for more)."""

    def run() -> Admission:
        model = getattr(body, "model", None) or state.model_id
        try:
            ctx = state.catalog.get(model)
        except (TokenizerLoadError, CanaryMismatch) as exc:  # its workers', not the caller's
            return Admission(Outcome.NO_WORKER, message=f"The pool cannot serve '{model}': {exc}")
        if ctx is None:
            message = unknown_model_message(model, state.catalog.served())
            return Admission(Outcome.UNKNOWN_MODEL, param="model", message=message)
        admission = admit(body, ctx)
        req = admission.request
        if admission.outcome is not Outcome.ADMIT or req is None:
            return admission
        if req.logprobs is not None:
            token_table(ctx.tokenizer)  # built once per tokenizer, here, before the enqueue
        gens = admission.requests or [req]
        # Every choice reserved before any is enqueued: a request is admitted whole or not at
        # all, so a 429 never leaves half its choices running. The choices of one prompt are
        # reserved together, on one worker, which computes their prompt once.
        placed: list[tuple[GenerationRequest, Placement]] = []
        for group in _groups(gens):
            where = _place(state, group[0], group[1:])
            if isinstance(where, Admission):
                for done, _ in placed:
                    state.dispatcher.ledger.release_sync(
                        done.request_id, state.dispatcher.sync_redis
                    )
                return where
            placed += [(gen, where) for gen in group]
        enqueued = 0
        try:
            for gen, where in placed:
                state.dispatcher.enqueue(gen, where.worker_id)
                enqueued += 1
        except BaseException:
            # None of the request is answered: the choices already enqueued are cancelled (no
            # worker runs them for nobody) and every choice's reservation goes.
            state.dispatcher.cancel_sync([gen.request_id for gen, _ in placed[:enqueued]])
            for gen, _ in placed:
                state.dispatcher.ledger.release_sync(gen.request_id, state.dispatcher.sync_redis)
            raise
        return admission

    # A model at its own bound (the pool-wide one was checked at the door): no tokenizing.
    model = getattr(body, "model", None) or state.model_id
    shut = state.dispatcher.ledger.gate.refusal(model)
    if shut is not None:
        raise busy_error(shut, state.settings.admission.retry_after_s)
    admission = await anyio.to_thread.run_sync(run)
    if admission.outcome is not Outcome.ADMIT or admission.request is None:
        raise admission.error()
    admission.requests = admission.requests or [admission.request]
    return admission


def _groups(gens: list[GenerationRequest]) -> list[list[GenerationRequest]]:
    """The choices in runs that share a prompt (their `group`); a choice alone is its own run."""
    runs: list[list[GenerationRequest]] = []
    for gen in gens:
        if runs and gen.group and runs[-1][0].group == gen.group:
            runs[-1].append(gen)
        else:
            runs.append([gen])
    return runs


def _place(
    state: RouterState, req: GenerationRequest, siblings: list[GenerationRequest]
) -> Placement | Admission:
    """The pool's bound and the worker, decided before anything is enqueued (and before any
    200), from the blocks the prompt hashes to exactly as the worker's cache hashes them; an
    Admission when refused. `siblings` (the other choices of req's prompt) go where it goes."""
    ledger = state.dispatcher.ledger
    ns = CacheNamespace(req.model, req.adapter_id, req.template_signature)
    members = index_members(state.hasher.chain(req.prompt_tokens, ns.seed()))
    sibling_ids = [s.request_id for s in siblings]
    placed = ledger.reserve(req.request_id, len(req.prompt_tokens), req.model, members, sibling_ids)
    if isinstance(placed, Refusal):
        ADMISSION_REFUSED.labels(placed.reason).inc()
        retry = state.settings.admission.retry_after_s
        return Admission(Outcome.POOL_BUSY, message=placed.message(), retry_after_s=retry)
    if not placed.worker_id and req.model != state.model_id:
        # Only the router's own model waits for a worker in its shared queue; another
        # model's workers all went away since the catalog saw them.
        for rid in (req.request_id, *sibling_ids):
            ledger.release_sync(rid, state.dispatcher.sync_redis)
        return Admission(
            Outcome.NO_WORKER,
            retry_after_s=state.settings.admission.retry_after_s,
            message=f"No live worker serves '{req.model}' now; retry shortly.",
        )
    observe_placement(placed)
    log.info(
        "route request=%s worker=%s outcome=%s predicted_cached=%d prompt=%d cost=%d choices=%d",
        req.request_id,
        placed.worker_id or "(shared queue)",
        placed.outcome,
        placed.predicted_tokens,
        len(req.prompt_tokens),
        placed.cost,
        1 + len(siblings),
    )
    return placed


async def respond(
    request: Request,
    state: RouterState,
    gens: list[GenerationRequest],
    fmt: ResponseFormat,
    stream: bool,
    include_usage: bool,
    tool_streams: Callable[[], ToolCallStream] | None = None,
    echo: list[str] | None = None,
) -> Response:
    """Relay a request already admitted and enqueued (admit_and_submit), one choice a
    GenerationRequest; `tool_streams`: a chat request's tool-call parsing (router.tool_calls);
    `echo`: completions' echo, each choice's prompt text."""
    echoes: list[str | None] = list(echo) if echo is not None else [None] * len(gens)
    if len(gens) > 1:
        return await _respond_many(
            request, state, gens, fmt, stream, include_usage, tool_streams, echoes
        )
    gen = gens[0]
    renderer = None
    if gen.logprobs is not None:
        renderer = await anyio.to_thread.run_sync(_logprob_renderer, state, gen.model, fmt.chat)
    events = state.dispatcher.events(gen, request.is_disconnected, streamed=stream)
    progress = _Progress(gen, tool_streams=tool_streams, echo=echoes[0])
    if not stream:
        async with aclosing(events):
            await _collect(events, progress)
        logprobs = renderer.render(progress.logprobs, progress.chars) if renderer else None
        text = "".join(progress.text)
        body = fmt.body(text, progress.finish_reason, progress.usage, logprobs, progress.tool_calls)
        return JSONResponse(body, headers=_served_by(progress.worker_id))
    # Wait for the first event before answering 200, so an early failure keeps its status code.
    first = await anext(events, None)
    if first is None or first.kind == "error":
        await events.aclose()
        if first is None:
            raise APIError(CLIENT_CLOSED, "The client closed the request.")
        raise error_for(first)
    return StreamingResponse(
        _chunks(first, events, fmt, progress, include_usage, renderer),
        media_type="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **_served_by(first.worker_id if first.kind == "start" else ""),
        },
    )


async def _respond_many(
    request: Request,
    state: RouterState,
    gens: list[GenerationRequest],
    fmt: ResponseFormat,
    stream: bool,
    include_usage: bool,
    tool_streams: Callable[[], ToolCallStream] | None,
    echoes: list[str | None],
) -> Response:
    """Several choices (`n`, a prompt list): each its own sequence and stream, relayed side by
    side under its `index`; the usage counts each prompt once and every choice's tokens."""
    renderer = None
    if gens[0].logprobs is not None:
        renderer = await anyio.to_thread.run_sync(_logprob_renderer, state, gens[0].model, fmt.chat)
    progresses = [
        _Progress(g, tool_streams=tool_streams, echo=e) for g, e in zip(gens, echoes, strict=True)
    ]
    streams = [state.dispatcher.events(g, request.is_disconnected, streamed=stream) for g in gens]
    if not stream:

        async def one(events: AsyncIterator[StreamEvent], progress: _Progress) -> None:
            async with aclosing(events):
                await _collect(events, progress)

        try:
            async with asyncio.TaskGroup() as tg:
                for events, progress in zip(streams, progresses, strict=True):
                    tg.create_task(one(events, progress))
        except* APIError as group:
            raise group.exceptions[0] from None
        choices = []
        for i, p in enumerate(progresses):
            lp = renderer.render(p.logprobs, p.chars) if renderer is not None else None
            one_body = fmt.body("".join(p.text), p.finish_reason, p.usage, lp, p.tool_calls)
            choice = one_body["choices"][0]
            choice["index"] = i
            choices.append(choice)
        body = fmt.body("", None, _total_usage(progresses))
        body["choices"] = choices
        return JSONResponse(body, headers=_served_by(progresses[0].worker_id))
    firsts: list[StreamEvent] = []
    for events in streams:  # every choice's first event before the 200, as for one
        first = await anext(events, None)
        if first is None or first.kind == "error":
            for other in streams:
                await other.aclose()
            if first is None:
                raise APIError(CLIENT_CLOSED, "The client closed the request.")
            raise error_for(first)
        firsts.append(first)
    parts = list(zip(firsts, streams, progresses, strict=True))
    return StreamingResponse(
        _merged(parts, fmt, include_usage, renderer),
        media_type="text/event-stream",
        headers={
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
            **_served_by(firsts[0].worker_id if firsts[0].kind == "start" else ""),
        },
    )


async def _merged(
    parts: list[tuple[StreamEvent, AsyncIterator[StreamEvent], _Progress]],
    fmt: ResponseFormat,
    include_usage: bool,
    renderer: LogprobRenderer | None,
) -> AsyncIterator[bytes]:
    """The choices' chunks as they come, then one usage chunk and one [DONE]."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def pump(
        i: int, first: StreamEvent, events: AsyncIterator[StreamEvent], progress: _Progress
    ) -> None:
        try:
            async for data in _chunks(
                first, events, fmt, progress, include_usage, renderer, index=i, final=False
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
        if include_usage:
            yield _sse(fmt.usage_chunk(_total_usage([p for _, _, p in parts])))
        yield _sse("[DONE]")
    finally:  # the client went away: every choice's stream is let go
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _total_usage(progresses: list[_Progress]) -> Usage:
    """A prompt's tokens once (its choices share it: one list object), every choice's output."""
    total, seen = Usage(), set()
    for p in progresses:
        if id(p.gen.prompt_tokens) not in seen:
            seen.add(id(p.gen.prompt_tokens))
            total.prompt_tokens += p.usage.prompt_tokens
            total.cached_tokens += p.usage.cached_tokens
        total.completion_tokens += p.usage.completion_tokens
    return total


def _logprob_renderer(state: RouterState, model: str, chat: bool) -> LogprobRenderer:
    """Blocking (the first request with logprobs builds its tokenizer's token table)."""
    ctx = state.catalog.get(model)  # admission loaded it: found without a Redis read
    if ctx is None:
        raise APIError(
            503,
            f"No live worker serves '{model}' now; retry shortly.",
            "server_error",
            None,
            "no_live_worker",
        )
    return LogprobRenderer(token_table(ctx.tokenizer), chat)


# Names the worker that ran the request (its first attempt, when streamed): why a request went
# where it went is in the router's route log line, keyed by the same worker id.
WORKER_HEADER = "X-Mlxcel-Worker"


def _served_by(worker_id: str | None) -> dict[str, str]:
    return {WORKER_HEADER: worker_id} if worker_id else {}
