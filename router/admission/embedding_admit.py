"""Admission of an embeddings request: its inputs as token lists (strings tokenized with the
model's tokenizer, token ids checked), or a refusal as an API error naming the input.

Runs in the threadpool (tokenization is CPU work). Bounds: 1 to MAX_EMBEDDING_INPUTS inputs,
each non-empty and at most the model's context, MAX_EMBEDDING_TOTAL_TOKENS in all.
"""

from __future__ import annotations

import time
import uuid

from router.admission.admit import AdmissionContext
from router.edge.embedding_types import EmbeddingBody
from router.edge.errors import APIError
from shared.embedding_wire import (
    MAX_EMBEDDING_INPUTS,
    MAX_EMBEDDING_TOTAL_TOKENS,
    EmbeddingRequest,
)
from shared.errors import ErrorKind


def _invalid(message: str, param: str = "input") -> APIError:
    return APIError.of(ErrorKind.INVALID_REQUEST, message, param=param)


def input_list(raw: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four input shapes as one list of inputs (a string, or one input's token ids)."""
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(x, int) for x in raw):
        return [list(raw)]  # type: ignore[arg-type]  # one token-id input
    return list(raw)  # type: ignore[arg-type]


def admit_embedding(
    body: EmbeddingBody, ctx: AdmissionContext, dimensions: int
) -> EmbeddingRequest:
    """The request's EmbeddingRequest for `ctx`'s model (whose vectors have `dimensions`
    floats), or APIError (400)."""
    if body.dimensions is not None and body.dimensions != dimensions:
        raise _invalid(
            f"dimensions {body.dimensions} is not served: the model '{ctx.model_id}' gives "
            f"{dimensions}-dimensional vectors, and no shortening is applied",
            "dimensions",
        )
    inputs = input_list(body.input)
    if not inputs:
        raise _invalid("input must not be empty")
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise _invalid(f"input holds {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS}")
    tokens = [_tokens(i, item, ctx) for i, item in enumerate(inputs)]
    total = sum(len(t) for t in tokens)
    if total > MAX_EMBEDDING_TOTAL_TOKENS:
        raise _invalid(
            f"the inputs hold {total} tokens in all; at most {MAX_EMBEDDING_TOTAL_TOKENS}"
        )
    return EmbeddingRequest(
        request_id=f"emb-{uuid.uuid4().hex}",
        model=ctx.model_id,
        inputs=tokens,
        enqueued_at=time.time(),
    )


def _tokens(i: int, item: str | list[int], ctx: AdmissionContext) -> list[int]:
    tok = ctx.tokenizer
    limit = tok.context_length
    if isinstance(item, str):
        if not item:
            raise _invalid(f"input[{i}] is an empty string; every input needs text")
        if len(item) > tok.max_chars:
            raise _too_long(i, f"{len(item)} characters", limit)
        ids = tok.encode(item)
        if not ids:
            raise _invalid(f"input[{i}] tokenizes to no tokens")
    else:
        ids = item
        if not ids:
            raise _invalid(f"input[{i}] is an empty token list")
        if min(ids) < 0 or max(ids) >= tok.vocab_size:
            raise _invalid(f"input[{i}] holds a token id outside [0, {tok.vocab_size})")
    if len(ids) > limit:
        raise _too_long(i, f"{len(ids)} tokens", limit)
    return ids


def _too_long(i: int, size: str, limit: int) -> APIError:
    return APIError.of(
        ErrorKind.CONTEXT_EXCEEDED,
        f"input[{i}] has {size}; the model's context is {limit} tokens",
        param="input",
    )
