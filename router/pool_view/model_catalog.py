"""The models a router admits requests for: its own (configured, loaded at start) and every other
model a live worker registers (its info hash names the model and the directory it loaded).

A worker of another model brings it into the pool: the router loads that model's tokenizer
from the directory the worker names (the same files on a shared disk or the same host), checks
that it hashes the routing canary as the worker does, and from then on admits its requests.
Routing only ever considers workers of the requested model (router/placement/placement.lua).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

import redis

from router.admission.admit import AdmissionContext, quoted
from router.admission.tokenization import TokenizerLoadError, load_tokenizer
from shared import keys
from shared.block_hash import BlockHasher, canary
from shared.canary_check import CanaryMismatch
from shared.embedding_wire import TASK_EMBEDDING, TASK_GENERATION
from shared.liveness import read_roster

log = logging.getLogger(__name__)

# How long a router trusts its last look at which models have live workers.
LIVE_CACHE_S = 1.0


@dataclass(frozen=True)
class LiveModel:
    model_id: str
    model_dir: str
    canary: str
    created: int  # the model directory's mtime, as /v1/models reports it (0: unreadable here)
    # What its workers serve (shared.embedding_wire TASK_*): an info hash without `task` is a
    # generation worker's; an embedding model's vectors have `dimensions` floats.
    task: str = TASK_GENERATION
    dimensions: int = 0

    @property
    def embeds(self) -> bool:
        return self.task == TASK_EMBEDDING


class ModelCatalog:
    def __init__(
        self,
        primary: AdmissionContext,
        created: int,
        sync_redis: redis.Redis,
        hasher: BlockHasher,
        tokenizer_copies: int,
    ) -> None:
        self.primary = primary
        self.created = created
        self.r = sync_redis
        self.hasher = hasher
        self.tokenizer_copies = tokenizer_copies
        self._others: dict[str, AdmissionContext] = {}
        self._lock = threading.Lock()
        self._live: dict[str, LiveModel] = {}
        self._live_at = float("-inf")

    def get(self, model_id: str) -> AdmissionContext | None:
        """The admission context of a model this pool serves, else None (blocking: call it off
        the event loop; the first request for a newly seen model loads its tokenizer)."""
        if model_id == self.primary.model_id:
            return self.primary
        ctx = self._others.get(model_id)
        if ctx is not None:
            return ctx
        live = self.live().get(model_id)
        if live is None:
            return None
        with self._lock:
            if model_id not in self._others:
                self._others[model_id] = self._load(live)
        return self._others[model_id]

    def embedding_model(self, model_id: str) -> LiveModel | None:
        """The live embedding model of this id, else None (a generation model, or none live).
        Its workers say so, even for the router's own model."""
        live = self.live().get(model_id)
        return live if live is not None and live.embeds else None

    def served(self) -> list[str]:
        """The router's own model, then every other one with a live worker."""
        return [
            self.primary.model_id,
            *sorted(m for m in self.live() if m != self.primary.model_id),
        ]

    def live(self) -> dict[str, LiveModel]:
        """Models with a live worker, by id (looked up at most once per LIVE_CACHE_S)."""
        now = time.monotonic()
        if now - self._live_at < LIVE_CACHE_S:
            return self._live
        live: dict[str, LiveModel] = {}
        fields = ("model", "model_dir", "canary", "task", "embedding_dimensions")
        for w in read_roster(self.r, fields):
            mid = w.info.get("model")
            if not w.alive or mid is None:
                continue
            path = w.info.get("model_dir", "")
            dims = w.info.get("embedding_dimensions", "")
            live.setdefault(
                mid,
                LiveModel(
                    mid,
                    path,
                    w.info.get("canary", ""),
                    _mtime(path),
                    w.info.get("task") or TASK_GENERATION,
                    int(dims) if dims.isdigit() else 0,
                ),
            )
        self._live, self._live_at = live, now
        return live

    def _load(self, live: LiveModel) -> AdmissionContext:
        if not live.model_dir:
            raise TokenizerLoadError(f"the workers of {live.model_id!r} name no model directory")
        tokenizer = load_tokenizer(Path(live.model_dir), self.tokenizer_copies)
        mine = canary(tokenizer.hf, live.model_id, self.hasher)
        if live.canary and live.canary != mine:
            raise CanaryMismatch(
                f"the workers of {live.model_id!r} hash prompts as {live.canary}, this router "
                f"as {mine}: tokenizer, chat template or APC_BLOCK_SIZE/APC_HASH differ"
            )
        self.r.hset(keys.routing_canary(), live.model_id, mine)
        log.info(
            "serving model %r too (a live worker loaded it from %s)", live.model_id, live.model_dir
        )
        return replace(self.primary, model_id=live.model_id, tokenizer=tokenizer)


def unknown_model_message(model: str, served: list[str]) -> str:
    """The 404's message for a model this pool does not serve: the name quoted at most
    MAX_QUOTED_CHARS long (with its length past that), then the models it does serve."""
    names = ", ".join(f"'{m}'" for m in served)
    return f"The model {quoted(model)} does not exist; this pool serves {names}."


def _mtime(path: str) -> int:
    try:
        return int(Path(path).stat().st_mtime) if path else 0
    except OSError:
        return 0
