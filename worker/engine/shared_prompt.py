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

from collections.abc import Iterable, Iterator
from typing import Any

from mlx_lm.models.cache import KVCache, make_prompt_cache

from worker.engine.request import Request, RequestStatus


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
