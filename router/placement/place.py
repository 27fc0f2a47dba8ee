"""Where a routed prompt goes: the pool's bound and the worker, decided before anything is
enqueued (and before any 200), from the blocks the prompt hashes to exactly as the worker's
cache hashes them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from router.admission.admit import Admission, Outcome
from router.metrics import ADMISSION_REFUSED
from router.placement.ledger import AdmissionLedger
from router.placement.place_call import Placement, Refusal
from router.placement.routing_metrics import observe_placement
from shared.block_hash import BlockHasher, CacheNamespace, index_members
from shared.wire import GenerationRequest

log = logging.getLogger(__name__)


@dataclass
class Placer:
    """The ledger's reservation for one prompt and its sibling choices; refusals as Admission."""

    ledger: AdmissionLedger
    hasher: BlockHasher
    own_model: str  # the router's own model: the only one that may wait in the shared queue
    retry_after_s: float

    def members(self, req: GenerationRequest) -> list[bytes]:
        """The prompt's block index members, hashed as the worker's cache hashes them (CPU:
        with the admission, off the event loop for a long prompt)."""
        ns = CacheNamespace(req.model, req.adapter_id, req.template_signature)
        return index_members(self.hasher.chain(req.prompt_tokens, ns.seed()))

    async def place(
        self, req: GenerationRequest, siblings: list[GenerationRequest], members: list[bytes]
    ) -> Placement | Admission:
        """`siblings` (the other choices of req's prompt) go where it goes; `members`: what
        members(req) made."""
        sibling_ids = [s.request_id for s in siblings]
        placed = await self.ledger.reserve_async(
            req.request_id, len(req.prompt_tokens), req.model, members, sibling_ids
        )
        if isinstance(placed, Refusal):
            ADMISSION_REFUSED.labels(placed.reason).inc()
            return Admission(
                Outcome.POOL_BUSY, message=placed.message(), retry_after_s=self.retry_after_s
            )
        if not placed.worker_id and req.model != self.own_model:
            # Another model's workers all went away since the catalog saw them.
            for rid in (req.request_id, *sibling_ids):
                await self.ledger.release(rid)
            return Admission(
                Outcome.NO_WORKER,
                retry_after_s=self.retry_after_s,
                message=f"No live worker serves '{req.model}' now; retry shortly.",
            )
        observe_placement(placed)
        log.info(
            "route request=%s worker=%s outcome=%s predicted_cached=%d prompt=%d cost=%d "
            "choices=%d",
            req.request_id,
            placed.worker_id or "(shared queue)",
            placed.outcome,
            placed.predicted_tokens,
            len(req.prompt_tokens),
            placed.cost,
            1 + len(siblings),
        )
        return placed
