"""One enqueue of a request, and its job as rq records it."""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.errors import ErrorKind
from shared.wire import GenerationRequest, StreamEvent


@dataclass
class Attempt:
    """One enqueue of a request: its job, the worker that took it, the events relayed so far."""

    gen: GenerationRequest
    number: int = 1
    worker_id: str = ""
    # The worker wrote the request's last event (`done` or `error` in its stream): it writes no
    # more, so its stream can go. Any other end (an error the router made up) cancels the job.
    finished: bool = False
    # What each relayed event said, by seq (`fingerprint`): an event whose seq was relayed
    # already is a write Redis applied twice only while it says the same thing.
    said: list[int] = field(default_factory=list)

    @property
    def job_id(self) -> str:
        return self.gen.request_id

    @property
    def next_seq(self) -> int:
        """The seq of the next event to relay: events are relayed 0, 1, 2, ... with no gap."""
        return len(self.said)


def fingerprint(event: StreamEvent) -> int:
    """What an event tells the client (a `start` tells nothing: a run on a warmer cache
    reports other cached tokens)."""
    if event.kind == "start":
        return 0
    return hash((event.kind, event.text, tuple(event.token_ids), event.finish_reason))


@dataclass(frozen=True)
class JobState:
    failure: str | None = None  # the job failed or vanished: the request ends with this
    failure_type: str = ErrorKind.JOB_FAILED
    lost: str | None = None  # its worker stopped beating
    finished: bool = False
    # rq says queued, yet the job is on neither its queue nor that queue's taken list: a take
    # whose start never landed (a Redis failover lost it mid-way), or one still in flight.
    off_queue: bool = False
