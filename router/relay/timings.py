"""One choice's timings, observed into the router's latency histograms as its events come:
queue time (enqueued to its worker's start), prefill (start to first token), time to first
token, the request's mean inter-token latency, end to end, and how it finished."""

from __future__ import annotations

from dataclasses import dataclass

from router.metrics import (
    E2E_SECONDS,
    INTER_TOKEN_SECONDS,
    PREFILL_SECONDS,
    QUEUE_SECONDS,
    REQUEST_DECODE_TOK_S,
    REQUEST_SUCCESS,
    REQUEST_TTFT_MS,
    TTFT_SECONDS,
)


@dataclass
class Timings:
    model: str
    enqueued_at: float  # wall clock, when the router admitted it
    counted: bool = True  # the request's first choice: the one whose end counts the request
    started_at: float | None = None
    first_token_at: float | None = None
    first_token_ms: int = 0  # when Redis stored the first token's entry (0: not known)

    def started(self, now: float) -> None:
        if self.started_at is None:  # a lost worker's second attempt is still one wait
            self.started_at = now
            QUEUE_SECONDS.labels(self.model).observe(max(0.0, now - self.enqueued_at))

    def first_token(self, now: float, written_ms: int = 0) -> None:
        if self.first_token_at is not None:
            return
        self.first_token_at = now
        self.first_token_ms = written_ms
        ttft = max(0.0, now - self.enqueued_at)
        REQUEST_TTFT_MS.observe(ttft * 1000)
        TTFT_SECONDS.labels(self.model).observe(ttft)
        if self.started_at is not None:
            PREFILL_SECONDS.labels(self.model).observe(max(0.0, now - self.started_at))

    def done(
        self, now: float, completion_tokens: int, finish_reason: str, written_ms: int = 0
    ) -> None:
        E2E_SECONDS.labels(self.model).observe(max(0.0, now - self.enqueued_at))
        if self.counted:
            REQUEST_SUCCESS.labels(self.model, finish_reason).inc()
        # Decode speed and the gap between tokens count the tokens after the first, timed by
        # when Redis stored the first token's entry and the last's: the router's own clock would
        # see no time between tokens that one of its reads brought together. Entries stored
        # within one millisecond of each other tell nothing, and are not observed.
        if self.first_token_at is not None and completion_tokens > 1:
            if self.first_token_ms and written_ms:
                elapsed = (written_ms - self.first_token_ms) / 1000
            else:  # an event the router made up, or a stream of an unknown kind
                elapsed = now - self.first_token_at
            if elapsed > 0:
                REQUEST_DECODE_TOK_S.observe((completion_tokens - 1) / elapsed)
                INTER_TOKEN_SECONDS.labels(self.model).observe(elapsed / (completion_tokens - 1))
