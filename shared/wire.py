"""Typed messages that cross Redis, packed with msgpack (never pickle: nothing that can write to
Redis may make a process run code).

Channels and their one message type each:
- rq job kwargs `{"request": GenerationRequest.to_wire()}` (router -> worker)
- request stream entries `{"m": pack(StreamEvent)}` (worker -> router)
- control list entries `pack(ControlCommand)` and reply list entries `pack(ControlReply)`
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import msgpack

# The function name rq stores for our jobs. The batching worker runs it in its scheduler; rq's
# own forking worker must never import it, so it names a module that only checks it is not called.
JOB_FUNC = "worker.jobs.generate"
STREAM_FIELD = b"m"
# The largest seed a request may carry: a signed 64-bit int, what every sampler backend takes.
MAX_SEED = 2**63 - 1
# Sampling controls' bounds, checked by the router (a 400 naming the param) and again here, so a
# job the router would not have written never reaches the sampler with a value it cannot take.
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty lies in (0, MAX_REPETITION_PENALTY]
MAX_LOGIT_BIAS = 100.0  # each logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_TOP_LOGPROBS = 20  # the most alternatives a sampled token's logprob entry lists
# The most stop_token_ids a request may carry (a set lookup per sampled token).
MAX_STOP_TOKEN_IDS = 64
# The largest grammar (response_format compiled by router.admission.structured_output, UTF-8 bytes)
# a request may carry: its compile time is bounded with its size.
MAX_GRAMMAR_BYTES = 256 * 1024
# llguidance's parser limits (`LLParserLimits` keywords) for the router's check and the worker's
# matcher alike. A tenth of its default initial lexer fuel: a pathological regex such as
# `(a{1000}){1000}` fails its own request early instead of stalling the worker's batched step,
# while large real schemas still compile.
GRAMMAR_LIMITS: dict[str, int] = {"initial_lexer_fuel": 100_000}
# A logprob below this (or -inf, which JSON cannot carry) is reported as this (OpenAI's floor).
LOGPROB_FLOOR = -9999.0
# The longest group id a request may carry (the router writes its first choice's request id).
MAX_GROUP_CHARS = 128


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class WireError(ValueError):
    """A message from Redis that does not have the expected shape."""


# Wire types are exact (`type(v) in types`): msgpack only makes builtins, and bool is no int here.
_NUMBER = (int, float)
_TYPE_NAMES = {
    int: "an int",
    float: "a float",
    str: "a str",
    list: "a list",
    dict: "a map",
    bool: "a bool",
    type(None): "nil",
}


def _unpack_message(cls: type, data: Any) -> Any:
    """`unpack` for one channel's message: bytes that are not msgpack are a WireError too."""
    try:
        return unpack(data)
    except (ValueError, TypeError) as exc:  # msgpack's errors are ValueErrors; TypeError: not bytes
        raise WireError(f"{cls.__name__}: not a msgpack message ({exc})") from exc


def _without_defaults(fields: dict[str, Any], omitted: dict[str, Any]) -> dict[str, Any]:
    """`fields` (shallow-copied) without those of `omitted` that hold their default: a peer from
    before a newer field reads every message that does not use it (a rolling upgrade mixes
    versions), and a stream event is that much smaller."""
    out = dict(fields)
    for name, default in omitted.items():
        if out[name] == default and type(out[name]) is type(default):
            del out[name]
    return out


def _from_dict(cls: Any, data: Any) -> Any:
    """Build `cls` from a map whose every key is one of `cls.WIRE_TYPES` and whose values have
    the exact types listed there; required fields are those without a dataclass default."""
    if type(data) is not dict:
        raise WireError(f"{cls.__name__}: expected a map, got {type(data).__name__}")
    # Once per streamed token on the router: one dict lookup and one type test per field.
    types: dict[Any, tuple[type, ...]] = cls.WIRE_TYPES
    for name, value in data.items():
        allowed = types.get(name)
        if allowed is None:
            raise WireError(f"{cls.__name__}: unknown field {name!r}")
        if type(value) not in allowed:
            wanted = " or ".join(_TYPE_NAMES[t] for t in allowed)
            raise WireError(f"{cls.__name__}: {name} must be {wanted}, got {type(value).__name__}")
    try:
        return cls(**data)
    except TypeError as exc:  # a required field is missing
        raise WireError(f"{cls.__name__}: {exc}") from exc


def _all_ints(values: list[Any], minimum: int | None = None) -> bool:
    if not all(type(v) is int for v in values):
        return False
    return minimum is None or not values or min(values) >= minimum


def _as_float(cls: type, name: str, value: int | float) -> float:
    try:
        return float(value)
    except OverflowError as exc:
        raise WireError(f"{cls.__name__}: {name} is too big for a float") from exc


def _utf8_size(text: str) -> int:
    """Its UTF-8 length; -1 for a str UTF-8 cannot write (a lone surrogate)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return -1


def _in_range(cls: type, name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:  # NaN fails this too
        raise WireError(f"{cls.__name__}: {name} must be in [{low:g}, {high:g}], got {value}")


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
    # The neutral value of each control below leaves sampling exactly as without it.
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # None: no logprobs; k: each sampled token's logprob and its k most likely alternatives.
    logprobs: int | None = None
    # None: none; k: each prompt token's logprob (given the tokens before it) and its k most
    # likely alternatives, sent with the `start` event (completions `echo` with `logprobs`).
    prompt_logprobs: int | None = None
    # Completions `echo`: the response's text starts with the prompt's (the router adds it); the
    # worker detokenizes every output after the prompt's last tokens, echoed or not.
    echo: bool = False
    stop: list[str] = field(default_factory=list)
    # vLLM's stopping extras. An EOS token ends the sequence unless `ignore_eos`; one of
    # `stop_token_ids` ends it like an EOS (finish "stop", not in the text); neither can end it
    # (nor a stop string match) before `min_tokens` completion tokens; a matched stop string
    # stays in the text with `include_stop_str_in_output`.
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    # response_format as one llguidance grammar (None: unconstrained), enforced while decoding.
    grammar: str | None = None
    # Prompt-cache isolation (spec): session key is prompt_cache_key, else user, else "".
    session_key: str = ""
    template_signature: str = ""
    adapter_id: str = ""
    enqueued_at: float = 0.0
    # The choices of one prompt (`n` > 1) share this id, their first choice's request id: the
    # router places them on one worker, which computes the prompt once for all of them. "": alone.
    group: str = ""
    # Whether its client reads the tokens as they come: a worker writes a non-streamed
    # request's tokens to its stream a few at a time (worker.broker.event_hold).
    stream: bool = True
    # The pub/sub channel of the router process that relays its stream (shared.keys.router_push):
    # the worker publishes each step's events there too (worker.broker.publisher.STEP_LUA). Set
    # only for a worker that says it can (its info hash's `relay_push`). "": none.
    relay_channel: str = ""

    WIRE_TYPES: ClassVar[dict[str, tuple[type, ...]]] = {
        "request_id": (str,),
        "model": (str,),
        "prompt_tokens": (list,),
        "max_tokens": (int,),
        "temperature": _NUMBER,
        "top_p": _NUMBER,
        "seed": (int, type(None)),
        "top_k": (int,),
        "min_p": _NUMBER,
        "repetition_penalty": _NUMBER,
        "presence_penalty": _NUMBER,
        "frequency_penalty": _NUMBER,
        "logit_bias": (dict,),
        "logprobs": (int, type(None)),
        "prompt_logprobs": (int, type(None)),
        "echo": (bool,),
        "stop": (list,),
        "ignore_eos": (bool,),
        "min_tokens": (int,),
        "stop_token_ids": (list,),
        "include_stop_str_in_output": (bool,),
        "grammar": (str, type(None)),
        "session_key": (str,),
        "template_signature": (str,),
        "adapter_id": (str,),
        "enqueued_at": _NUMBER,
        "group": (str,),
        "stream": (bool,),
        "relay_channel": (str,),
    }

    # Fields left out of the wire at their default, so a worker from before them still reads
    # the requests that do not use them (a rolling upgrade mixes versions for a while).
    OMITTED_AT_DEFAULT: ClassVar[dict[str, Any]] = {
        "grammar": None,
        "group": "",
        "prompt_logprobs": None,
        "echo": False,
        "ignore_eos": False,
        "min_tokens": 0,
        "stop_token_ids": [],
        "include_stop_str_in_output": False,
        "stream": True,
        "relay_channel": "",
    }

    def to_wire(self) -> dict[str, Any]:
        # Shallow, not asdict, which deep-copies every prompt token on the router's enqueue
        # path: rq packs this dict right away, so sharing the token list is harmless.
        return _without_defaults(vars(self), self.OMITTED_AT_DEFAULT)

    @classmethod
    def from_wire(cls, data: Any) -> GenerationRequest:
        """The job's request, or WireError: a job the router would not have written fails alone
        instead of reaching the sampler with a value it cannot take."""
        req = _from_dict(cls, data)
        if not req.request_id:
            raise WireError("GenerationRequest: request_id must not be empty")
        if not req.prompt_tokens or not _all_ints(req.prompt_tokens, minimum=0):
            raise WireError(
                "GenerationRequest: prompt_tokens must be a non-empty list of ints >= 0"
            )
        if req.max_tokens < 0:  # 0: no token generated (the prompt's logprobs only, if asked)
            raise WireError(f"GenerationRequest: max_tokens must be >= 0, got {req.max_tokens}")
        try:
            numbers = float(req.temperature), float(req.top_p), float(req.enqueued_at)
        except OverflowError as exc:
            raise WireError(
                "GenerationRequest: temperature, top_p or enqueued_at is too big for a float"
            ) from exc
        req.temperature, req.top_p, req.enqueued_at = numbers
        if not (math.isfinite(req.temperature) and req.temperature >= 0):
            raise WireError(
                f"GenerationRequest: temperature must be finite and >= 0, got {req.temperature}"
            )
        if not 0 < req.top_p <= 1:  # NaN fails this too
            raise WireError(f"GenerationRequest: top_p must be in (0, 1], got {req.top_p}")
        if not math.isfinite(req.enqueued_at):
            raise WireError(f"GenerationRequest: enqueued_at must be finite, got {req.enqueued_at}")
        if req.seed is not None and not 0 <= req.seed <= MAX_SEED:
            raise WireError(f"GenerationRequest: seed must be in [0, 2**63 - 1], got {req.seed}")
        if not all(type(s) is str for s in req.stop):
            raise WireError("GenerationRequest: stop must be a list of str")
        req._check_stopping()
        req._check_sampling_controls()
        if req.grammar is not None and not 0 < _utf8_size(req.grammar) <= MAX_GRAMMAR_BYTES:
            raise WireError(
                f"GenerationRequest: grammar must be nil or 1 to {MAX_GRAMMAR_BYTES} UTF-8 bytes"
            )
        if len(req.group) > MAX_GROUP_CHARS:
            raise WireError(
                f"GenerationRequest: group must be at most {MAX_GROUP_CHARS} characters"
            )
        return req

    def _check_stopping(self) -> None:
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise WireError(
                f"GenerationRequest: min_tokens must be in [0, max_tokens], got {self.min_tokens}"
            )
        ids = self.stop_token_ids
        if len(ids) > MAX_STOP_TOKEN_IDS or not _all_ints(ids, minimum=0):
            raise WireError(
                f"GenerationRequest: stop_token_ids must be at most {MAX_STOP_TOKEN_IDS} ints >= 0"
            )

    def _check_sampling_controls(self) -> None:
        cls = type(self)
        if self.top_k < 0:
            raise WireError(f"GenerationRequest: top_k must be >= 0 (0: off), got {self.top_k}")
        self.min_p = _as_float(cls, "min_p", self.min_p)
        _in_range(cls, "min_p", self.min_p, 0.0, 1.0)
        self.repetition_penalty = _as_float(cls, "repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise WireError(
                f"GenerationRequest: repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]"
                f", got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(cls, name, getattr(self, name))
            _in_range(cls, name, value, -MAX_PENALTY, MAX_PENALTY)
            setattr(self, name, value)
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise WireError(
                f"GenerationRequest: logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries"
            )
        bias: dict[int, float] = {}
        for token, value in self.logit_bias.items():
            if type(token) is not int or token < 0 or type(value) not in _NUMBER:
                raise WireError("GenerationRequest: logit_bias must map token ids >= 0 to numbers")
            bias[token] = _as_float(cls, "logit_bias", value)
            _in_range(cls, "logit_bias", bias[token], -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        self.logit_bias = bias
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
                raise WireError(
                    f"GenerationRequest: {name} must be nil or in [0, {MAX_TOP_LOGPROBS}], got {k}"
                )


EventKind = Literal["start", "delta", "done", "error"]
# The error_type of an `error` event whose request was lost with Redis (a restart, a stall past
# the bound): the client gets a 503 it may retry, as when Redis is down at admission.
REDIS_UNAVAILABLE = "redis_unavailable"


@dataclass
class StreamEvent:
    """One entry of a request's stream. `start` once (worker id, cached tokens), `delta`s with
    text and token ids, then exactly one of `done` (finish reason and usage) or `error`. `seq`
    numbers a request's events 0, 1, 2, ...: a reader drops a repeat, stops at a gap and at a
    repeat that differs (the job ran again), so a write Redis applied twice or lost can never
    show as text."""

    kind: EventKind
    seq: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # A request that asked for logprobs: one entry per token of token_ids, `[logprob, [ids of the
    # top alternatives, most likely first], [their logprobs]]` (ids and floats only: the router
    # renders the token strings with its tokenizer). Empty otherwise.
    logprobs: list[list[Any]] = field(default_factory=list)
    # A `start` of a request that asked for prompt logprobs: one entry (same shape) for each
    # prompt token after the first, which has no logprob. Empty otherwise.
    prompt_logprobs: list[list[Any]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    worker_id: str = ""
    error: str = ""
    error_type: str = ""
    # A `done` whose sequence a stop string ended: which of the request's stop strings matched
    # (Anthropic's `stop_sequence`); None when EOS, a stop token or max_tokens ended it.
    stop_str: str | None = None
    # Never on the wire (LOCAL_FIELDS): the reader's note of when Redis stored the entry (its
    # stream id's milliseconds, Redis's clock), so the time between a request's tokens is the
    # worker's, not how the router's reads happened to batch them. 0: not known.
    written_ms: int = 0

    KINDS: ClassVar[frozenset[str]] = frozenset({"start", "delta", "done", "error"})
    # Fields a reader fills in itself: from_wire refuses them, to_wire leaves them out at default.
    LOCAL_FIELDS: ClassVar[frozenset[str]] = frozenset({"written_ms"})
    WIRE_TYPES: ClassVar[dict[str, tuple[type, ...]]] = {
        "kind": (str,),
        "seq": (int,),
        "text": (str,),
        "token_ids": (list,),
        "logprobs": (list,),
        "prompt_logprobs": (list,),
        "finish_reason": (str, type(None)),
        "prompt_tokens": (int,),
        "completion_tokens": (int,),
        "cached_tokens": (int,),
        "worker_id": (str,),
        "error": (str,),
        "error_type": (str,),
        "stop_str": (str, type(None)),
    }

    # Every field but `kind` is left out at its default: a delta goes as its kind, seq, text
    # and token ids (4 of 15 fields), which the router unpacks once per token. Every release
    # that reads `seq` fills what is absent with its default (from_wire builds the dataclass
    # from what is there), a router from before the newer fields included.
    OMITTED_AT_DEFAULT: ClassVar[dict[str, Any]] = {}  # filled below the class

    def to_wire(self) -> bytes:
        # Packed once per token: a shallow copy of the instance dict, not asdict's deep one.
        return pack(_without_defaults(vars(self), self.OMITTED_AT_DEFAULT))

    @classmethod
    def from_wire(cls, data: bytes) -> StreamEvent:
        ev = _from_dict(cls, _unpack_message(cls, data))
        if ev.kind not in cls.KINDS:
            raise WireError(f"StreamEvent: unknown kind {ev.kind!r}")
        if not _all_ints(ev.token_ids):
            raise WireError("StreamEvent: token_ids must be a list of ints")
        if ev.logprobs and not _valid_logprobs(ev.logprobs, len(ev.token_ids)):
            raise WireError(
                "StreamEvent: logprobs must hold one [logprob, [token ids], [logprobs]] entry "
                "per token id (finite floats, ids >= 0, at most "
                f"{MAX_TOP_LOGPROBS} alternatives)"
            )
        if ev.prompt_logprobs and not _valid_entries(ev.prompt_logprobs):
            raise WireError(
                "StreamEvent: prompt_logprobs must hold [logprob, [token ids], [logprobs]] "
                f"entries (finite floats, ids >= 0, at most {MAX_TOP_LOGPROBS} alternatives)"
            )
        return ev


StreamEvent.OMITTED_AT_DEFAULT = {
    f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default  # type: ignore[misc]
    for f in dataclasses.fields(StreamEvent)
    if f.name != "kind"
}


def _finite_floats(values: list[Any]) -> bool:
    return all(type(v) is float and math.isfinite(v) for v in values)


def _valid_logprobs(entries: list[Any], tokens: int) -> bool:
    return len(entries) == tokens and _valid_entries(entries)


def _valid_entries(entries: list[Any]) -> bool:
    for entry in entries:
        if type(entry) is not list or len(entry) != 3:
            return False
        lp, ids, lps = entry
        if type(ids) is not list or type(lps) is not list or len(ids) != len(lps):
            return False
        if len(ids) > MAX_TOP_LOGPROBS or not _all_ints(ids, minimum=0):
            return False
        if not _finite_floats([lp, *lps]):
            return False
    return True


@dataclass
class ControlCommand:
    """Router -> one worker: an operator action (`cache_reset`). The reply goes to reply_id."""

    kind: Literal["cache_reset"]
    reply_id: str

    KINDS: ClassVar[frozenset[str]] = frozenset({"cache_reset"})
    WIRE_TYPES: ClassVar[dict[str, tuple[type, ...]]] = {"kind": (str,), "reply_id": (str,)}

    def to_wire(self) -> bytes:
        return pack(dataclasses.asdict(self))

    @classmethod
    def from_wire(cls, data: bytes) -> ControlCommand:
        cmd = _from_dict(cls, _unpack_message(cls, data))
        if cmd.kind not in cls.KINDS:
            raise WireError(f"ControlCommand: unknown kind {cmd.kind!r}")
        return cmd


@dataclass
class ControlReply:
    worker_id: str
    kind: str
    result: dict[str, Any] = field(default_factory=dict)
    error: str = ""

    WIRE_TYPES: ClassVar[dict[str, tuple[type, ...]]] = {
        "worker_id": (str,),
        "kind": (str,),
        "result": (dict,),
        "error": (str,),
    }

    def to_wire(self) -> bytes:
        return pack(dataclasses.asdict(self))

    @classmethod
    def from_wire(cls, data: bytes) -> ControlReply:
        return _from_dict(cls, _unpack_message(cls, data))


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
