"""Prompt scoring spread over steps: a request that asked for its prompt's logprobs (or for no
new token) computes its prompt outside the batch (worker/engine/prompt_logprobs.py), a chunk
at a time, beside the batch's decode step, so the streams already running pause by at most
one chunk's time instead of the whole prompt's.

`PromptScore` is one request's pass in progress (its cache, the position reached, the entries
so far); `Scorer` is the queue of them, served first come first served: every step spends at
most `budget` prompt positions in all (the prefill step size), on the oldest first, so several
scored requests never add up to more than one chunk a step. A finished pass hands its cache
and entries back to the engine, which starts the request in BatchGenerator from that cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mlx_lm.models.cache import make_prompt_cache

from worker.engine.prompt_logprobs import score_chunk
from worker.engine.request import Request, RequestStatus
from worker.engine.sampling import LogprobEntry


class PromptScore:
    """One request's scoring pass: `cache` covers `prompt[:position]` and `entries` hold the
    entries of `prompt[1 : position + 1]`; done once position reaches `len(prompt) - 1`."""

    def __init__(self, model: Any, prompt: list[int], top_k: int) -> None:
        self.prompt = prompt
        self.top_k = top_k
        self.cache: list[Any] = make_prompt_cache(model)
        self.position = 0
        self.entries: list[LogprobEntry] = []

    @property
    def remaining(self) -> int:
        return len(self.prompt) - 1 - self.position

    @property
    def done(self) -> bool:
        return self.remaining <= 0

    def advance(self, model: Any, count: int) -> None:
        """Score the next `count` positions (at most what remains)."""
        count = min(count, self.remaining)
        if count <= 0:
            return
        self.entries += score_chunk(
            model, self.cache, self.prompt, self.position, count, self.top_k
        )
        self.position += count


class Scorer:
    """The requests scoring their prompts, oldest first; `budget` positions a step in all."""

    def __init__(self, model: Any, budget: int) -> None:
        self.model = model
        self.budget = max(budget, 1)
        self._queue: list[Request] = []

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._queue))

    def add(self, req: Request, top_k: int) -> None:
        """Queue a request whose prompt has at least two tokens (one position to score)."""
        req.scoring = PromptScore(self.model, list(req.spec.prompt_tokens), top_k)
        req.status = RequestStatus.SCORING
        self._queue.append(req)

    def drop(self, req: Request) -> bool:
        """Take a request out (done, failed or cancelled); its partial pass is let go."""
        req.scoring = None
        if req not in self._queue:
            return False
        self._queue.remove(req)
        return True

    def chunks(self) -> list[tuple[Request, int]]:
        """This step's work: (request, positions to score), oldest first, `budget` in all."""
        plan: list[tuple[Request, int]] = []
        left = self.budget
        for req in self._queue:
            if left <= 0:
                break
            assert req.scoring is not None  # every queued request holds its pass
            count = min(left, req.scoring.remaining)
            plan.append((req, count))
            left -= count
        return plan
