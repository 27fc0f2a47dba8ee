"""One choice's relay state: the text, tool calls, logprobs, usage and timings its stream
events add up to, and a terminal error event as an API error."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from router.admission.tool_calls import ToolCallStream
from router.edge.errors import APIError
from router.edge.openai_types import Usage
from router.relay.logprobs import TokenLogprob, from_event
from router.relay.timings import Timings
from shared.errors import ErrorKind, kind_of
from shared.wire import GenerationRequest, StreamEvent

log = logging.getLogger(__name__)


@dataclass
class ChoiceProgress:
    """Text and usage so far, plus the timings the router's histograms observe."""

    gen: GenerationRequest
    text: list[str] = field(default_factory=list)
    first_token_at: float | None = None
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None
    stop_str: str | None = None  # the stop string that ended it (the worker's `done` says)
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
    counted: bool = True  # the request's first choice, whose end counts the request
    timings: Timings = field(init=False)

    def __post_init__(self) -> None:
        self.timings = Timings(self.gen.model, self.gen.enqueued_at, self.counted)
        self._new_attempt()

    def _new_attempt(self) -> None:
        self.tool_stream = self.tool_streams() if self.tool_streams else None

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return self.tool_stream.calls if self.tool_stream is not None else []

    def on_event(self, ev: StreamEvent) -> tuple[str, list[dict[str, Any]]]:
        """Fold one event in; returns the content text and the tool calls it completes (a
        `done` flushes what the tool-call splitter held)."""
        if ev.kind == "start":  # an attempt begins: a lost one's text (never sent) is dropped
            now = time.time()
            again, self.started = self.started, True
            self.text.clear()
            self.logprobs.clear()
            self.logprobs_sent = self.chars = 0
            self.worker_id = ev.worker_id or ""
            self.usage.cached_tokens = ev.cached_tokens
            self.timings.started(now)
            self._new_attempt()
            if self.echo is not None:
                return self._echo(ev, again)
        elif ev.kind == "delta":
            if ev.logprobs:
                self.logprobs.extend(from_event(ev.token_ids, ev.logprobs, self.chars))
            self.chars += len(ev.text)
            stream = self.tool_stream
            text, calls = (ev.text, []) if stream is None else stream.feed(ev.text)
            self.text.append(text)
            if self.first_token_at is None:  # the clock is read for the first token alone
                now = self.first_token_at = time.time()
                self.timings.first_token(now, ev.written_ms)
            return text, calls
        elif ev.kind == "done":
            now = time.time()
            text, calls = ("", []) if self.tool_stream is None else self.tool_stream.finish()
            self.text.append(text)
            self.finish_reason = ev.finish_reason or "stop"
            self.stop_str = ev.stop_str
            if self.tool_calls and self.finish_reason == "stop":
                self.finish_reason = "tool_calls"
            self.usage = Usage(
                prompt_tokens=ev.prompt_tokens or len(self.gen.prompt_tokens),
                completion_tokens=ev.completion_tokens,
                cached_tokens=ev.cached_tokens or self.usage.cached_tokens,
            )
            self.timings.done(now, ev.completion_tokens, self.finish_reason, ev.written_ms)
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
    kind = kind_of(ev.error_type)
    if kind is ErrorKind.WORKER_LOST:
        message = f"The pool lost the worker running this request; retry shortly: {ev.error}"
    elif kind is ErrorKind.REDIS_UNAVAILABLE:
        message = f"The pool lost its queue (Redis) during the request; retry shortly: {ev.error}"
    elif kind in (ErrorKind.SERVER_ERROR, ErrorKind.JOB_FAILED, None):
        message = f"The worker failed to generate: {ev.error}" if ev.error else "The worker failed."
    else:
        message = ev.error
    if kind is None:  # a kind this router does not know: a server error under its own code
        return APIError(500, message, "server_error", None, ev.error_type or None)
    return APIError.of(kind, message)
