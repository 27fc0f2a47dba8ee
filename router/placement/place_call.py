"""The placement script's call as a typed pair: what goes in (`PlaceArgs`, its named scalars
encoded once as the script's first argument, then the prompt's block members) and what comes
out (`parse_reply`, the script's array as a Placement or a Refusal)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(frozen=True)
class PlaceArgs:
    """Field names are the script's own (router/placement/placement.lua reads them by name)."""

    request_id: str
    ttl_ms: int  # the reservation's lease
    prompt_tokens: int
    max_inflight: int
    max_inflight_per_worker: int
    max_queued_prompt_tokens: int
    min_alive_pttl_ms: int  # a worker whose alive key has less left is not live
    info_template: str  # per-worker key templates ({wid}, {epoch}) from shared.keys
    alive_template: str
    blocks_template: str
    routed_template: str
    first_template: str  # the first block's marks ({block}: its hex)
    holders_template: str  # the first block's holders ({block}: its hex)
    live_key: str  # the model's live workers as last read (shared.keys.routing_live)
    live_ttl_ms: int
    load_template: str
    prefill_template: str
    model: str
    policy: str
    block_size: int
    min_match: int  # a worker adopts no match shorter than this
    decode_weight: float  # tokens a running sequence costs, in the load score
    balance_abs: int
    balance_rel: float
    routed_ttl_ms: int
    holders_ttl_ms: int
    skiplist_pin: str  # shared.keys.ROUTED_PIN
    siblings: list[str] = field(default_factory=list)  # the other choices of the prompt

    def argv(self, members: list[bytes]) -> list[Any]:
        """The script's ARGV: the named scalars as one JSON object, then the members (binary
        block hashes, which JSON cannot carry), in order."""
        return [orjson.dumps(self), *members]


@dataclass(frozen=True)
class Refusal:
    """Why a request was not admitted: `inflight` or `tokens`, with the count and the bound;
    `scope` "pool" (the pool's bound, every model's requests) or "model" (every live worker of
    the request's model is at its own bound)."""

    reason: str
    current: int
    bound: int
    scope: str = "pool"

    def message(self) -> str:
        if self.reason == "inflight" and self.scope == "model":
            return (
                f"Every worker of this model is at its bound ({self.bound} requests in flight "
                "between them); retry shortly."
            )
        if self.reason == "inflight":
            return f"The pool is at its bound of {self.bound} requests in flight; retry shortly."
        return (
            f"The pool has {self.current} prompt tokens waiting for a worker (bound "
            f"{self.bound}); retry shortly."
        )


@dataclass(frozen=True)
class Placement:
    """An admitted request and where it goes: `worker_id` "" means the model's shared queue (no
    live worker yet: the first to come takes it)."""

    outcome: str  # cache | spill | load | round_robin | no_worker
    worker_id: str
    predicted_tokens: int
    cost: int
    mark_score: int = 0  # the routed marks' score the script wrote (0: none)


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def parse_reply(reply: list[Any]) -> Placement | Refusal:
    """{1, outcome, worker, predicted, cost, inflight, bound, mark score} or
    {0, reason, current, bound, scope}."""
    if int(reply[0]) != 1:
        return Refusal(_text(reply[1]), int(reply[2]), int(reply[3]), _text(reply[4]))
    return Placement(_text(reply[1]), _text(reply[2]), int(reply[3]), int(reply[4]), int(reply[7]))
