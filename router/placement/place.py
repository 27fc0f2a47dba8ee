"""Where a routed prompt goes: the pool's bound and the worker, decided before anything is
enqueued (and before any 200), from the blocks the prompt hashes to exactly as the worker's
cache hashes them."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis

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
    sync_redis: redis.Redis
    hasher: BlockHasher
    own_model: str  # the router's own model: the only one that may wait in the shared queue
    retry_after_s: float

    def place(
        self, req: GenerationRequest, siblings: list[GenerationRequest]
    ) -> Placement | Admission:
        """`siblings` (the other choices of req's prompt) go where it goes."""
        ns = CacheNamespace(req.model, req.adapter_id, req.template_signature)
        members = index_members(self.hasher.chain(req.prompt_tokens, ns.seed()))
        sibling_ids = [s.request_id for s in siblings]
        placed = self.ledger.reserve(
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
                self.release(rid)
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

    def release(self, request_id: str) -> None:
        self.ledger.release_sync(request_id, self.sync_redis)
