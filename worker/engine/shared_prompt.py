"""The choices of one prompt (`n` > 1, one `group` on the wire) compute it once.

The first of a group to arrive prefills the prompt as any request does (or scores it, when they
ask for prompt logprobs); a group-mate that arrives while it does is held (`Holds`), and once
the first's KV covers the prompt but its last token, each held mate starts from its own copy of
that KV (`prompt_kv_copies`), with only the last prompt token left to run (batched with the
others, as a decode step is), and samples with its own sampler. A mate that arrives after that
starts from a copy at once. Nothing here touches the prompt cache: a copy works whatever its
mode, disabled or below its minimum prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from worker.engine.request import Request, RequestStatus
from worker.engine.results import StepResult

log = logging.getLogger(__name__)


class Starts(Protocol):
    """What the engine offers the sharing: the ways a request starts."""

    def launch(self, req: Request, out: StepResult) -> None: ...

    def start(self, req: Request, out: StepResult) -> None: ...

    def start_from(
        self, req: Request, mate: Request, caches: list[Any], out: StepResult
    ) -> None: ...

    def start_failed(self, req: Request, exc: Exception, out: StepResult) -> None: ...

    def prompt_kv(self, mate: Request, count: int) -> list[list[Any]] | None: ...


class Holds:
    """Requests held until a group-mate's prefill has computed the prompt they share."""

    def __init__(self) -> None:
        self._held: list[Request] = []

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._held))

    def hold(self, req: Request, mate: Request) -> None:
        req.status, req.waiting_on = RequestStatus.WAITING, mate
        self._held.append(req)

    def take(self, mate: Request) -> list[Request]:
        """The requests waiting on `mate`, in arrival order, no longer held."""
        taken = [r for r in self._held if r.waiting_on is mate]
        if taken:
            self._held = [r for r in self._held if r.waiting_on is not mate]
            for r in taken:
                r.status, r.waiting_on = RequestStatus.PREFILLING, None
        return taken

    def drop(self, req: Request) -> bool:
        if req not in self._held:
            return False
        self._held.remove(req)
        req.waiting_on = None
        return True


def can_share(model: Any) -> bool:
    """Whether the model's per-layer caches are plain KVCache, whose prefix can be copied (a
    rotating window or recurrent state cannot be cut back to a prompt)."""
    return all(type(c) is KVCache for c in make_prompt_cache(model))


def group_mate(req: Request, computing: Iterable[Request]) -> Request | None:
    """A request computing its prompt (in the batch, or scoring it) whose prompt KV `req` can
    start from: of its group, with the same prompt in the same cache namespace; one whose
    prefill is done first, else one still computing it (req waits for it). None: req computes
    its prompt itself."""
    spec = req.spec
    if not spec.group or len(spec.prompt_tokens) < 2:
        return None
    mates = [
        r
        for r in computing
        if r.spec.group == spec.group
        and r.namespace == req.namespace
        and r.spec.prompt_tokens == spec.prompt_tokens
    ]
    return next((r for r in mates if r.prompt_ready), mates[0] if mates else None)


def can_start_from(req: Request, mate: Request) -> bool:
    """Whether req may start from mate's prompt: it decodes (max_tokens 0 ends at its start),
    and it wants no prompt logprobs or mate scores the same ones (group-mates ask alike; a mate
    without them leaves req to score its own)."""
    want = req.spec.prompt_logprobs
    return req.spec.max_tokens > 0 and (want is None or mate.spec.prompt_logprobs == want)


def prompt_kv_copies(layers: list[Any], n_tokens: int, count: int) -> list[list[Any]] | None:
    """`count` sets of fresh per-layer caches, each holding the first `n_tokens` of `layers`'
    KV (new array objects: BatchGenerator merges and grows each set on its own). None when a
    layer is not a plain KVCache (rotating window, quantized, recurrent state): the mates then
    prefill for themselves."""
    if not layers or any(
        type(c) is not KVCache or c.keys is None or c.offset < n_tokens for c in layers
    ):
        return None
    copies = []
    for _ in range(count):
        fresh = []
        for c in layers:
            layer = KVCache()
            layer.keys, layer.values = c.keys[..., :n_tokens, :], c.values[..., :n_tokens, :]
            layer.offset = n_tokens
            fresh.append(layer)
        copies.append(fresh)
    return copies


class PromptSharing:
    """The engine's group sharing: which mate a request starts from, who waits for whom, and
    who starts once a mate's prompt is computed (or the mate left)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # the model's caches can be copied (can_share)
        self.held = Holds()

    def launch(
        self, req: Request, computing: list[Request], engine: Starts, out: StepResult
    ) -> None:
        """One of a group starts from a copy of a group-mate's KV of their prompt, or waits
        while the mate computes it; the first of a group starts on its own."""
        mate = group_mate(req, computing) if self.enabled else None
        if mate is None or not can_start_from(req, mate):
            engine.start(req, out)
        elif not mate.prompt_ready:
            self.held.hold(req, mate)
        else:
            copies = engine.prompt_kv(mate, 1)
            if copies is None:
                engine.start(req, out)
            else:
                engine.start_from(req, mate, copies[0], out)

    def computed(
        self, progress: list[Any], running: Mapping[int, Request], engine: Starts, out: StepResult
    ) -> None:
        """Sequences whose KV now covers their prompt but its last token (BatchGenerator's
        prompt progress: tokens done, tokens in all): the group-mates waiting on one start
        from copies of its KV."""
        for p in progress:
            req = running.get(p.uid)
            done, total = p.progress
            if req is None or req.prompt_ready or done < total - 1:
                continue
            req.prompt_ready = True
            held = self.held.take(req)
            if held:
                self._start_held(req, held, engine.prompt_kv(req, len(held)), engine, out)

    def scored(
        self, req: Request, caches: list[Any], stream: Any, engine: Starts, out: StepResult
    ) -> None:
        """A scoring pass covers req's prompt but its last token: its waiting mates start
        from copies of the pass's cache."""
        held = self.held.take(req)
        if held:
            with mx.stream(stream):
                copies = prompt_kv_copies(caches, len(req.spec.prompt_tokens) - 1, len(held))
            self._start_held(req, held, copies, engine, out)

    def resume(self, gone: Request, engine: Starts, out: StepResult) -> None:
        """`gone` left before its prefill was done: the requests that waited on it start again
        (the first computes the prompt, the others wait on it in turn). None is lost."""
        for req in self.held.take(gone):
            try:
                engine.launch(req, out)
            except Exception as exc:
                engine.start_failed(req, exc, out)

    def _start_held(
        self,
        mate: Request,
        held: list[Request],
        copies: list[list[Any]] | None,
        engine: Starts,
        out: StepResult,
    ) -> None:
        """The requests that waited on mate's prompt start, each from its copy of mate's KV
        when there is one and it may (else it computes the prompt itself)."""
        for i, waiter in enumerate(held):
            try:
                if copies is None or not can_start_from(waiter, mate):
                    engine.start(waiter, out)
                else:
                    engine.start_from(waiter, mate, copies[i], out)
            except Exception as exc:  # its own failure: the others start regardless
                engine.start_failed(waiter, exc, out)
