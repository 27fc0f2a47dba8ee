"""What the engine hands back from `admit`, `step` and `cancel`: typed data, no callables.

Per call, the events each request produced (in order), the requests that ended (each with its
final status), and the counter deltas drained from the engine and its prompt cache, so the
Redis side applies one value per step and the decode path never touches Redis or Prometheus.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.wire import StreamEvent
from worker.engine.request import Request, RequestStatus


@dataclass
class EngineCounters:
    """The engine's own counters, drained into every StepResult, like the prompt cache's."""

    requests: int = 0
    prompt_tokens: int = 0
    prompt_tokens_cached: int = 0  # of prompt_tokens, those the prompt cache served
    completion_tokens: int = 0
    batch_prefill_tokens: int = 0
    batch_decode_tokens: int = 0
    batch_decode_steps: int = 0

    def take(self) -> dict[str, int]:
        out = {k: v for k, v in vars(self).items() if v}
        for k in out:
            setattr(self, k, 0)
        return out


@dataclass(frozen=True)
class Ended:
    """A request that left the engine; `request.status` is FINISHED, FAILED or CANCELLED."""

    request: Request

    @property
    def status(self) -> RequestStatus:
        return self.request.status

    def result(self) -> dict[str, Any]:
        """What rq stores as the job's result (FINISHED) or its failure text (FAILED)."""
        req = self.request
        usage = req.usage()
        return {
            "finish_reason": req.finish_reason,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
        }


@dataclass
class StepResult:
    """One engine call's output. `merge` folds a later call's output into this one."""

    events: dict[Request, list[StreamEvent]] = field(default_factory=dict)
    ended: list[Ended] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)
    last_reject: dict[str, Any] | None = None  # the newest reject record, when it changed
    prefill_pending: bool = False  # admit: something admitted still has its prefill ahead
    # block index member -> held (True) or dropped (False) by the prompt cache in this call
    index: dict[bytes, bool] = field(default_factory=dict)
    # the members of `index` that are a prompt's first block
    index_firsts: set[bytes] = field(default_factory=set)

    def emit(self, request: Request, *events: StreamEvent) -> None:
        """Queue events for the request's stream, numbered in the order they are emitted."""
        for event in events:
            event.seq = request.next_seq
            request.next_seq += 1
        self.events.setdefault(request, []).extend(events)

    def _relay(self, request: Request, events: list[StreamEvent]) -> None:
        self.events.setdefault(request, []).extend(events)

    def end(self, request: Request) -> None:
        self.ended.append(Ended(request))

    def merge(self, other: StepResult) -> StepResult:
        for request, events in other.events.items():
            self._relay(request, events)  # numbered already
        self.ended.extend(other.ended)
        for name, delta in other.counters.items():
            self.counters[name] = self.counters.get(name, 0) + delta
        if other.last_reject is not None:
            self.last_reject = other.last_reject
        self.prefill_pending = self.prefill_pending or other.prefill_pending
        self.index.update(other.index)  # the later change wins
        self.index_firsts |= other.index_firsts  # a member's place in its chain never changes
        return self
