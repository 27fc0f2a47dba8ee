"""Admit and enqueue a request: validation, tokenization, placement of every choice and the
enqueue, in one trip to a worker thread."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio

from router.admission.admit import Admission, AdmissionContext, Outcome, admit_chat, quoted
from router.admission.tokenization import TokenizerLoadError
from router.edge.busy_gate import busy_error
from router.edge.openai_types import ChatCompletionRequest
from router.placement.place_call import Placement
from router.pool_view.model_catalog import unknown_model_message, unservable_error
from router.relay.logprobs import token_table
from router.relay.routed import RoutedRequest
from router.relay.tool_output import tool_streams
from router.state import RouterState
from shared.canary_check import CanaryMismatch
from shared.wire import GenerationRequest

B = TypeVar("B")  # a request body


async def admit_and_submit(
    admit: Callable[[B, AdmissionContext], Admission], body: B, state: RouterState
) -> RoutedRequest:
    """One trip to a worker thread: a burst of requests reaches the workers sooner than with a
    thread hop for each. Every choice's request is in `gens` (one unless `n` or a prompt list
    asks for more); a refusal raises its API error."""

    def run() -> Admission | RoutedRequest:
        model = getattr(body, "model", None) or state.model_id
        if state.catalog.embedding_model(model) is not None:
            message = f"The model {quoted(model)} is an embedding model: use POST /v1/embeddings."
            return Admission(Outcome.INVALID, param="model", message=message)
        try:
            ctx = state.catalog.get(model)
        except (TokenizerLoadError, CanaryMismatch) as exc:  # its workers', not the caller's
            raise unservable_error(model, exc) from exc
        if ctx is None:
            message = unknown_model_message(model, state.catalog.served())
            return Admission(Outcome.UNKNOWN_MODEL, param="model", message=message)
        admission = admit(body, ctx)
        req = admission.request
        if admission.outcome is not Outcome.ADMIT or req is None:
            return admission
        if req.logprobs is not None:
            token_table(ctx.tokenizer)  # built once per tokenizer, here, before the enqueue
        admission.requests = admission.requests or [req]
        placed = _place_all(state, admission.requests)
        if isinstance(placed, Admission):
            return placed
        _enqueue_all(state, admission.requests, placed)
        return RoutedRequest(admission, placed)

    # A model at its own bound (the pool-wide one was checked at the door): no tokenizing.
    model = getattr(body, "model", None) or state.model_id
    shut = state.dispatcher.ledger.gate.refusal(model)
    if shut is not None:
        raise busy_error(shut, state.settings.admission.retry_after_s)
    routed = await anyio.to_thread.run_sync(run)
    if isinstance(routed, Admission):
        raise routed.error()
    return routed


async def submit_chat(body: ChatCompletionRequest, state: RouterState) -> RoutedRequest:
    """A chat request admitted and enqueued, with its output's tool-call splitter when it has
    tools (every API whose request becomes a chat one: chat, Responses, Messages)."""
    routed = await admit_and_submit(admit_chat, body, state)
    routed.stream = bool(body.stream)
    if body.tools and body.tool_choice != "none":
        routed.tool_streams = await anyio.to_thread.run_sync(
            tool_streams, state, body, routed.model
        )
    return routed


def _place_all(state: RouterState, gens: list[GenerationRequest]) -> list[Placement] | Admission:
    """Every choice reserved before any is enqueued: a request is admitted whole or not at all,
    so a 429 never leaves half its choices running. The choices of one prompt are reserved
    together, on one worker, which computes their prompt once."""
    placed: list[Placement] = []
    for group in _groups(gens):
        where = state.placer.place(group[0], group[1:])
        if isinstance(where, Admission):
            for done in gens[: len(placed)]:
                state.placer.release(done.request_id)
            return where
        placed += [where] * len(group)
    return placed


def _enqueue_all(
    state: RouterState, gens: list[GenerationRequest], placed: list[Placement]
) -> None:
    enqueued = 0
    try:
        for gen, where in zip(gens, placed, strict=True):
            state.dispatcher.enqueue(gen, where.worker_id)
            enqueued += 1
    except BaseException:
        # None of the request is answered: the choices already enqueued are cancelled (no
        # worker runs them for nobody) and every choice's reservation goes.
        state.dispatcher.cancel_sync([gen.request_id for gen in gens[:enqueued]])
        for gen in gens:
            state.placer.release(gen.request_id)
        raise


def _groups(gens: list[GenerationRequest]) -> list[list[GenerationRequest]]:
    """The choices in runs that share a prompt (their `group`); a choice alone is its own run."""
    runs: list[list[GenerationRequest]] = []
    for gen in gens:
        if runs and gen.group and runs[-1][0].group == gen.group:
            runs[-1].append(gen)
        else:
            runs.append([gen])
    return runs
