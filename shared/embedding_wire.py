"""The embedding channel's typed messages, packed with msgpack like shared.wire's.

- rq job kwargs `{"embedding": EmbeddingRequest.to_wire()}` (router -> an embedding worker)
- the request's stream holds one entry `{"m": pack(EmbeddingReply)}` (worker -> router): the
  vectors of every input, or the error; an embedding request's stream carries nothing else.

A vector crosses Redis as little-endian float32 bytes (4 bytes a dimension, not msgpack's 9 per
float), already pooled and L2-normalized by the worker.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from shared.wire import WireError, _from_dict, _unpack_message, pack

# The function name rq records for embedding jobs: a module that only checks it is not called.
EMBED_JOB_FUNC = "worker.embedding.jobs.embed"
# The most inputs one request may carry (OpenAI's bound).
MAX_EMBEDDING_INPUTS = 2048
# The most tokens one request may carry, all inputs together: one job's forward passes stay
# bounded whatever the count.
MAX_EMBEDDING_TOTAL_TOKENS = 300_000
# What a worker's info hash says it serves (`task`); a hash without the field serves generation.
TASK_EMBEDDING = "embedding"
TASK_GENERATION = "generation"


def float32_bytes(values: Any) -> bytes:
    """A vector (a numpy float32 array, or a list of floats) as little-endian float32 bytes."""
    import numpy as np

    return np.asarray(values, dtype="<f4").tobytes()


def floats_of(data: bytes) -> list[float]:
    """Little-endian float32 bytes back as Python floats."""
    import numpy as np

    return np.frombuffer(data, dtype="<f4").astype(float).tolist()


@dataclass
class EmbeddingRequest:
    """One `/v1/embeddings` request, tokenized by the router: each input's token ids, in order."""

    request_id: str
    model: str
    inputs: list[list[int]]
    enqueued_at: float = 0.0

    WIRE_TYPES: ClassVar[dict[str, tuple[type, ...]]] = {
        "request_id": (str,),
        "model": (str,),
        "inputs": (list,),
        "enqueued_at": (int, float),
    }

    def to_wire(self) -> dict[str, Any]:
        return dict(vars(self))

    @property
    def total_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.inputs)

    @classmethod
    def from_wire(cls, data: Any) -> EmbeddingRequest:
        """The job's request, or WireError (a job the router would not have written)."""
        req = _from_dict(cls, data)
        if not req.request_id:
            raise WireError("EmbeddingRequest: request_id must not be empty")
        if not 0 < len(req.inputs) <= MAX_EMBEDDING_INPUTS:
            raise WireError(
                f"EmbeddingRequest: inputs must hold 1 to {MAX_EMBEDDING_INPUTS} token lists"
            )
        for tokens in req.inputs:
            if type(tokens) is not list or not tokens:
                raise WireError("EmbeddingRequest: every input must be a non-empty list of ints")
            if not all(type(t) is int and t >= 0 for t in tokens):
                raise WireError("EmbeddingRequest: token ids must be ints >= 0")
        if req.total_tokens > MAX_EMBEDDING_TOTAL_TOKENS:
            raise WireError(
                f"EmbeddingRequest: at most {MAX_EMBEDDING_TOTAL_TOKENS} tokens in all inputs"
            )
        req.enqueued_at = float(req.enqueued_at)
        return req


@dataclass
class EmbeddingReply:
    """The worker's answer: one float32 vector per input, in the request's order, or an error
    (`error_type` is a shared.errors.ErrorKind value)."""

    kind: Literal["done", "error"]
    embeddings: list[bytes] = field(default_factory=list)
    dimensions: int = 0
    prompt_tokens: int = 0
    worker_id: str = ""
    error: str = ""
    error_type: str = ""

    KINDS: ClassVar[frozenset[str]] = frozenset({"done", "error"})
    WIRE_TYPES: ClassVar[dict[str, tuple[type, ...]]] = {
        "kind": (str,),
        "embeddings": (list,),
        "dimensions": (int,),
        "prompt_tokens": (int,),
        "worker_id": (str,),
        "error": (str,),
        "error_type": (str,),
    }

    def to_wire(self) -> bytes:
        return pack(dataclasses.asdict(self))

    @classmethod
    def from_wire(cls, data: bytes) -> EmbeddingReply:
        reply = _from_dict(cls, _unpack_message(cls, data))
        if reply.kind not in cls.KINDS:
            raise WireError(f"EmbeddingReply: unknown kind {reply.kind!r}")
        size = 4 * reply.dimensions
        if not all(type(v) is bytes and len(v) == size for v in reply.embeddings):
            raise WireError(f"EmbeddingReply: every embedding must be {size} bytes (float32)")
        return reply
