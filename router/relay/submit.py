"""Admit and enqueue a request: validation, tokenization and block hashes (in a worker thread,
or in line when short and plain), then the placement of every choice and its enqueue through
the process's command batch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import anyio

from router.admission.admit import Admission, AdmissionContext, Outcome, admit_chat, quoted
from router.admission.inline import admits_inline
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
    """The admission's CPU work (validation, tokenization, each prompt's block hashes) in one
    trip to a worker thread (a short plain request's in line: router.admission.inline); then,
    on the event loop, the placement of every choice and its enqueue, each a command of the
    process's batch (a burst's go out in one write). Every choice's request is in `gens` (one
    unless `n` or a prompt list asks for more); a refusal raises its API error."""

    def embedding_refusal(model: str) -> Admission | None:
        if state.catalog.embedding_model(model) is None:
            return None
        message = f"The model {quoted(model)} is an embedding model: use POST /v1/embeddings."
        return Admission(Outcome.INVALID, param="model", message=message)

    def run() -> Admission:
        model = getattr(body, "model", None) or state.model_id
        if (refused := embedding_refusal(model)) is not None:
            return refused
        try:
            ctx = state.catalog.get(model)
        except (TokenizerLoadError, CanaryMismatch) as exc:  # its workers', not the caller's
            raise unservable_error(model, exc) from exc
        if ctx is None:
            message = unknown_model_message(model, state.catalog.served())
            return Admission(Outcome.UNKNOWN_MODEL, param="model", message=message)
        # A model the view lacked, found by get()'s fresh read: it may be an embedding one.
        if ctx is not state.catalog.primary and (refused := embedding_refusal(model)) is not None:
            return refused
        admission = admit(body, ctx)
        req = admission.request
        if admission.outcome is not Outcome.ADMIT or req is None:
            return admission
        admission.context = ctx
        if req.logprobs is not None:
            token_table(ctx.tokenizer)  # built once per tokenizer, here, before the enqueue
        admission.requests = admission.requests or [req]
        admission.members = [state.placer.members(group[0]) for group in _groups(admission)]
        return admission

    # A model at its own bound (the pool-wide one was checked at the door): no tokenizing.
    model = getattr(body, "model", None) or state.model_id
    shut = state.dispatcher.ledger.gate.refusal(model)
    if shut is not None:
        raise busy_error(shut, state.settings.admission.retry_after_s)
    # A short plain request on the event loop; any other, or one whose model's context, the
    # roster's view or a tokenizer copy would have to be waited for, in a worker thread.
    inline = admits_inline(body) and state.catalog.ready(model)
    admission = run() if inline else await anyio.to_thread.run_sync(run)
    if admission.outcome is not Outcome.ADMIT:
        raise admission.error()
    # Whole or not at all, as one step: a cancel waits for the enqueue (then the relay's own
    # end, or the reservation's lease, lets it go).
    with anyio.CancelScope(shield=True):
        placed = await _place_all(state, admission)
        if isinstance(placed, Admission):
            raise placed.error()
        await _enqueue_all(state, admission.requests, placed)
    return RoutedRequest(admission, placed)


async def submit_chat(body: ChatCompletionRequest, state: RouterState) -> RoutedRequest:
    """A chat request admitted and enqueued, with its output's tool-call splitter when it has
    tools (every API whose request becomes a chat one: chat, Responses, Messages)."""
    routed = await admit_and_submit(_admit_chat_with_tools, body, state)
    routed.stream = bool(body.stream)
    return routed


def _admit_chat_with_tools(body: ChatCompletionRequest, ctx: AdmissionContext) -> Admission:
    """admit_chat, and the tool-call splitter of a request with tools, made in admission's
    thread (a request with tools is never admitted in line)."""
    admission = admit_chat(body, ctx)
    if admission.outcome is Outcome.ADMIT and body.tools and body.tool_choice != "none":
        admission.tool_streams = tool_streams(ctx, body)
    return admission


async def _place_all(state: RouterState, admission: Admission) -> list[Placement] | Admission:
    """Every choice reserved before any is enqueued: a request is admitted whole or not at all,
    so a 429 never leaves half its choices running. The choices of one prompt are reserved
    together, on one worker, which computes their prompt once."""
    gens = admission.requests
    placed: list[Placement] = []
    try:
        for group, members in zip(_groups(admission), admission.members, strict=True):
            where = await state.placer.place(group[0], group[1:], members)
            if isinstance(where, Admission):
                await _release_all(state, gens[: len(placed)])
                return where
            placed += [where] * len(group)
    except BaseException:  # Redis failed one: none of the request runs
        await _release_all(state, gens[: len(placed)])
        raise
    return placed


async def _enqueue_all(
    state: RouterState, gens: list[GenerationRequest], placed: list[Placement]
) -> None:
    """Every choice in one transaction: a worker takes a request's choices together, so the
    choices of one prompt compute it once (worker/engine/shared_prompt.py)."""
    try:
        jobs = [(gen, where.worker_id) for gen, where in zip(gens, placed, strict=True)]
        # A worker that publishes its events is told this process's channel: its stream is
        # then relayed by push, not by a read re-armed a token (router/relay/stream_hub.py).
        hub = state.dispatcher.hub
        for gen, worker_id in jobs:
            if hub.pushing and worker_id and state.catalog.pushes(worker_id):
                gen.relay_channel = hub.channel
        await state.dispatcher.enqueue_all(jobs)
    except BaseException:
        # None of the request is answered: its choices are cancelled (Redis may have applied
        # the transaction before its reply was lost; no worker runs them for nobody) and every
        # choice's reservation goes.
        await state.dispatcher.cancel([gen.request_id for gen in gens])
        await _release_all(state, gens)
        raise


async def _release_all(state: RouterState, gens: list[GenerationRequest]) -> None:
    """Every choice's reservation, side by side (one write of the command batch)."""
    await asyncio.gather(*[state.dispatcher.ledger.release(gen.request_id) for gen in gens])


def _groups(admission: Admission) -> list[list[GenerationRequest]]:
    """The choices in runs that share a prompt (their `group`); a choice alone is its own run."""
    runs: list[list[GenerationRequest]] = []
    for gen in admission.requests:
        if runs and gen.group and runs[-1][0].group == gen.group:
            runs[-1].append(gen)
        else:
            runs.append([gen])
    return runs
