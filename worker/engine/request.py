"""One running request, as the engine holds it: every piece of its state in one object.

The engine creates a `Request` at admission and drops it when it ends; nothing else keeps a
map keyed by its id. The Redis side's handle on the job (`ticket`) rides along opaquely, so
the loop and the publisher read it from here instead of keeping maps of their own.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared.wire import GenerationRequest
from worker.engine.grammar import GrammarConstraint
from worker.engine.sampling import LogitsProcessor, Sampler
from worker.engine.stopping import StopRule
from worker.engine.text_stream import TextStream
from worker.prompt_cache.block_pool import CacheLease
from worker.prompt_cache.keys import CacheNamespace

if TYPE_CHECKING:
    from worker.engine.scoring import PromptScore


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # held until a group-mate has computed the prompt they share
    COMPILING = "compiling"  # waiting for its grammar's matcher (compiled off the loop)
    SCORING = "scoring"  # computing its prompt's logprobs, a chunk a step, outside the batch
    PREFILLING = "prefilling"  # in the batch with prompt tokens still to compute
    DECODING = "decoding"  # sampling tokens
    FINISHED = "finished"  # ended by a stop condition or its token budget
    FAILED = "failed"  # ended by an error (its own, or the engine's)
    CANCELLED = "cancelled"  # ended because its client went away

    @property
    def ended(self) -> bool:
        return self in _ENDED


_ENDED = frozenset({RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED})


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(eq=False)  # identity: two requests are never the same object
class Request:
    spec: GenerationRequest
    ticket: Any  # the Redis side's job handle; the engine never looks inside
    namespace: CacheNamespace
    text: TextStream
    stopping: StopRule  # the tokens that end it (EOS, stop_token_ids) and its min_tokens
    sampler: Sampler | None  # None: greedy, batched with the other greedy sequences
    processors: list[LogitsProcessor]  # its penalties, logit bias, grammar; empty: none
    admitted_at: float
    deadline: float | None  # engine clock; past it the request fails (rq's job timeout)
    grammar: GrammarConstraint | None = None  # its response_format (also its last processor)
    status: RequestStatus = RequestStatus.PREFILLING
    uid: int | None = None  # BatchGenerator's uid while the sequence is in the batch
    cached_tokens: int = 0  # prompt tokens whose KV came from the prompt cache
    completion_tokens: int = 0
    lease: CacheLease | None = None  # paged blocks held while this request runs
    finish_reason: str | None = None
    error: str = ""
    error_type: str = ""
    next_seq: int = 0  # the `seq` of this request's next stream event
    # Its KV covers its prompt but the last token: a group-mate may start from a copy of it.
    prompt_ready: bool = False
    waiting_on: Request | None = None  # WAITING: the group-mate computing the shared prompt
    prompt_logprobs: list[Any] | None = None  # its prompt's logprob entries, when it asked
    scoring: PromptScore | None = None  # SCORING: its scoring pass so far

    @property
    def id(self) -> str:
        return self.spec.request_id

    @property
    def seq_id(self) -> str:
        """The label the prompt cache's reject records and trace use for this sequence."""
        return f"seq-{self.spec.request_id[:12]}"

    def usage(self) -> Usage:
        return Usage(len(self.spec.prompt_tokens), self.completion_tokens, self.cached_tokens)

    def release_cache(self) -> None:
        """Give back the paged blocks this request holds (idempotent)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None
