"""Typed messages that cross Redis, packed with msgpack (never pickle: nothing that can write to
Redis may make a process run code).

Channels and their one message type each:
- rq job kwargs `{"request": GenerationRequest.to_wire()}` (router -> worker)
- request stream entries `{"m": pack(StreamEvent)}` (worker -> router)
- control list entries `pack(ControlCommand)` and reply list entries `pack(ControlReply)`
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgpack

# The function name rq stores for our jobs. The batching worker runs it in its scheduler; rq's
# own forking worker must never import it, so it names a module that only checks it is not called.
JOB_FUNC = "worker.jobs.generate"
STREAM_FIELD = b"m"


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class WireError(ValueError):
    """A message from Redis that does not have the expected shape."""


@functools.cache
def _field_names(cls: type) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _from_dict(cls: type, data: Any) -> Any:
    if not isinstance(data, dict):
        raise WireError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
    # Once per streamed token on the router: the field names are computed once per class.
    unknown = data.keys() - _field_names(cls)
    if unknown:
        raise WireError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise WireError(f"{cls.__name__}: {exc}") from exc


@dataclass
class GenerationRequest:
    """One request, tokenized by the router, as the worker needs it."""

    request_id: str
    model: str
    prompt_tokens: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # Prompt-cache isolation (spec): session key is prompt_cache_key, else user, else "".
    session_key: str = ""
    template_signature: str = ""
    adapter_id: str = ""
    enqueued_at: float = 0.0

    def to_wire(self) -> dict[str, Any]:
        # A shallow copy: asdict deep-copied every prompt token (~1 ms for a 1,000-token prompt,
        # on the router's enqueue path); rq packs this right away.
        return dict(vars(self))

    @classmethod
    def from_wire(cls, data: Any) -> GenerationRequest:
        req = _from_dict(cls, data)
        if not isinstance(req.prompt_tokens, list) or not req.prompt_tokens:
            raise WireError("GenerationRequest: prompt_tokens must be a non-empty list")
        if not all(isinstance(t, int) and t >= 0 for t in req.prompt_tokens):
            raise WireError("GenerationRequest: prompt_tokens must be non-negative ints")
        if not isinstance(req.max_tokens, int) or req.max_tokens < 1:
            raise WireError("GenerationRequest: max_tokens must be a positive int")
        return req


EventKind = Literal["start", "delta", "done", "error"]


@dataclass
class StreamEvent:
    """One entry of a request's stream. `start` once (worker id, cached tokens), `delta`s with
    text and token ids, then exactly one of `done` (finish reason and usage) or `error`."""

    kind: EventKind
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker_id: str = ""
    error: str = ""
    error_type: str = ""

    KINDS: ClassVar[frozenset[str]] = frozenset({"start", "delta", "done", "error"})

    def to_wire(self) -> bytes:
        # Packed once per token: the instance dict as it is, not asdict's deep copy.
        return pack(vars(self))

    @classmethod
    def from_wire(cls, data: bytes) -> StreamEvent:
        ev = _from_dict(cls, unpack(data))
        if ev.kind not in cls.KINDS:
            raise WireError(f"StreamEvent: unknown kind {ev.kind!r}")
        return ev


@dataclass
class ControlCommand:
    """Router -> one worker: an operator action (`cache_reset`). The reply goes to reply_id."""

    kind: Literal["cache_reset"]
    reply_id: str

    def to_wire(self) -> bytes:
        return pack(dataclasses.asdict(self))

    @classmethod
    def from_wire(cls, data: bytes) -> ControlCommand:
        return _from_dict(cls, unpack(data))


@dataclass
class ControlReply:
    worker_id: str
    kind: str
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    def to_wire(self) -> bytes:
        return pack(dataclasses.asdict(self))

    @classmethod
    def from_wire(cls, data: bytes) -> ControlReply:
        return _from_dict(cls, unpack(data))


class MsgpackSerializer:
    """rq serializer (rq takes any object with dumps/loads): msgpack instead of pickle.

    rq serializes job data as (func_name, instance, args, kwargs) and results with it; msgpack turns
    tuples into lists, which rq unpacks the same way.
    """

    @staticmethod
    def dumps(obj: Any) -> bytes:
        return pack(obj)

    @staticmethod
    def loads(data: bytes) -> Any:
        return unpack(data)
