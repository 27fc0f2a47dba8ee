"""The models a router admits requests for: its own (configured, loaded at start) and every other
model a live worker registers (its info hash names the model and the directory it loaded).

A worker of another model brings it into the pool: the router loads that model's tokenizer
from the directory the worker names (the same files on a shared disk or the same host), checks
that it hashes the routing canary as the worker does, and from then on admits its requests.
Routing only ever considers workers of the requested model (router/placement/placement.lua).

A model whose directory this router's host lacks (or whose tokenizer files it lacks) is refused:
each router process looks at the roster every WATCH_S, logs one ERROR naming the model, its
workers, the path and the fix when it first sees that (and again only when what is wrong
changes), leaves the model out of GET /v1/models and answers its requests 503
`model_files_missing` (`unservable_error`) until the files appear, which it notices by itself.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio
import redis

from router.admission.admit import AdmissionContext, quoted
from router.admission.tokenization import (
    TOKENIZER_FILES,
    ModelFilesMissing,
    TokenizerLoadError,
    load_tokenizer,
    missing_model_files,
)
from router.edge.errors import APIError
from router.redis_batch import RedisBatch
from shared import keys
from shared.block_hash import BlockHasher, canary
from shared.canary_check import CanaryMismatch
from shared.embedding_wire import TASK_EMBEDDING, TASK_GENERATION
from shared.errors import ErrorKind
from shared.liveness import ROSTER_LUA, WorkerRecord, roster_from_reply, roster_script_args

log = logging.getLogger(__name__)

# How long a router trusts its last look at which models have live workers.
LIVE_CACHE_S = 1.0
# How often each router process reads the roster in the background: the requests' view, kept
# younger than the half of LIVE_CACHE_S that ready() asks of it, so a request after a quiet spell
# (a single user's next one) is admitted on the loop without reading the roster first (a round
# trip and a thread's wake before its placement); and a worker whose model's files are not here
# is reported when it registers, not at the first request for it. The read is one script on the
# loop (a thread only where the disk is looked at): the watch is most of an idle router's work.
WATCH_S = LIVE_CACHE_S / 3
# How long a model that failed to load is refused without trying again: a broken tokenizer is
# not loaded again for every request, and mended files are found this soon.
RECHECK_S = 5.0
# The 503 of a model whose files are missing tells the OpenAI and Anthropic SDKs not to retry (they
# retry a 5xx otherwise, in vain: the files do not appear by waiting a few seconds).
NO_RETRY = {"x-should-retry": "false"}

LoadError = TokenizerLoadError | CanaryMismatch

# What the catalog reads of each worker's info hash.
ROSTER_FIELDS = (
    "model",
    "model_dir",
    "canary",
    "task",
    "embedding_dimensions",
    "host",
    "relay_push",
)


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
    # Its live workers, as (worker id, host), for the messages that name them.
    workers: tuple[tuple[str, str], ...] = ()

    @property
    def embeds(self) -> bool:
        return self.task == TASK_EMBEDDING

    def described_workers(self) -> str:
        named = [f"{wid} on host {host or '?'}" for wid, host in self.workers]
        return f"worker{'s' if len(named) > 1 else ''} {', '.join(named) or '?'}"


@dataclass
class _Refusal:
    """Why a live model is refused, for the directory and canary its workers registered."""

    model_dir: str
    canary: str
    error: LoadError
    at: float = field(default_factory=time.monotonic)

    def holds_for(self, live: LiveModel) -> bool:
        return (live.model_dir, live.canary) == (self.model_dir, self.canary)

    @property
    def files_missing(self) -> bool:
        return isinstance(self.error, ModelFilesMissing)


class ModelCatalog:
    def __init__(
        self,
        primary: AdmissionContext,
        created: int,
        sync_redis: redis.Redis,
        hasher: BlockHasher,
        tokenizer_copies: int,
        batch: RedisBatch,
    ) -> None:
        self.primary = primary
        self.created = created
        self.r = sync_redis
        # The roster in one command: from a thread through the sync client, on the loop through
        # the batch (its write shared with the requests' commands).
        self._batch = batch
        self._roster = sync_redis.register_script(ROSTER_LUA)
        self._roster_keys, self._roster_args = roster_script_args(ROSTER_FIELDS)
        self.hasher = hasher
        self.tokenizer_copies = tokenizer_copies
        self.host = socket.gethostname()
        self._others: dict[str, AdmissionContext] = {}
        self._lock = threading.Lock()
        self._live: dict[str, LiveModel] = {}
        self._live_at = float("-inf")
        # The live workers that publish their streams' events to a router's channel (their info
        # hash's `relay_push`), as of the view.
        self._pushers: frozenset[str] = frozenset()
        # One roster read at a time (the watch's, ready()'s refresh, the requests'), so the view
        # shown is always the one whose read began last.
        self._read_lock = threading.Lock()
        # The latest look at the roster, the watch's or a request's: which refusals still hold.
        self._seen: dict[str, LiveModel] = {}
        # Models refused, by id, and what was last logged of each (logged again when it changes).
        self._refused: dict[str, _Refusal] = {}
        self._logged: dict[str, str] = {}
        self._refusal_lock = threading.Lock()
        self._task: asyncio.Task[None] | None = None
        # The roster view's refresh that ready() started, while it runs (one at a time).
        self._refresh: asyncio.Task[None] | None = None

    def get(self, model_id: str) -> AdmissionContext | None:
        """The admission context of a model this pool serves, else None (blocking: call it off
        the event loop; the first request for a newly seen model loads its tokenizer).
        ModelFilesMissing, TokenizerLoadError, CanaryMismatch: a live model this router cannot
        serve (`unservable_error` is its answer)."""
        if model_id == self.primary.model_id:
            return self.primary
        ctx = self._others.get(model_id)
        if ctx is not None:
            return ctx
        live = self.live().get(model_id)
        if live is None:  # a worker of it may have registered since the view was read
            live = self.live(fresh=True).get(model_id)
        if live is None:
            return None
        with self._lock:
            if model_id not in self._others:
                refusal = self._refused.get(model_id)
                if (
                    refusal is not None
                    and refusal.holds_for(live)
                    and time.monotonic() - refusal.at < RECHECK_S
                ):
                    raise refusal.error.with_traceback(None)  # shared: no tracebacks pile up
                try:
                    self._others[model_id] = self._load(live)
                except (TokenizerLoadError, CanaryMismatch) as exc:
                    self._refuse(live, exc)
                    raise
                self._accept(model_id)
        return self._others[model_id]

    def ready(self, model_id: str) -> bool:
        """Whether a request for `model_id` is admitted now without waiting: its context
        loaded, the roster's view fresh (with half its life to spare, so get() and
        embedding_model() read nothing), a tokenizer copy free."""
        ctx = self.primary if model_id == self.primary.model_id else self._others.get(model_id)
        if ctx is None or not ctx.tokenizer.pool.idle():
            return False
        age = time.monotonic() - self._live_at
        if age < LIVE_CACHE_S / 2:
            return True
        # The watch keeps it younger than that; one it left behind (Redis slow to answer) is
        # read again in a thread now, past half its life, not by the first request that finds
        # it expired. An expired one is read by this request's own admission, not twice.
        if self._refresh is None and age < LIVE_CACHE_S:
            self._refresh = asyncio.get_running_loop().create_task(self._refresh_live())
        return False

    async def _refresh_live(self) -> None:
        try:
            await self._look()
        except redis.RedisError as exc:  # requests report an unreachable Redis themselves
            log.debug("model catalog: roster unreadable (%s)", exc)
        except Exception:
            log.exception("model catalog: reading the roster failed")
        finally:
            self._refresh = None

    def _read_live_now(self) -> dict[str, LiveModel]:
        """The roster as it is now, shown from now on (its caller holds _read_lock)."""
        began = time.monotonic()
        reply = self._roster(self._roster_keys, self._roster_args, self.r)
        records = roster_from_reply(reply, ROSTER_FIELDS)
        live = self._live_from(records, _mtime)
        assert live is not None  # _mtime answers every path
        self._show(live, began, records)
        return live

    def _show(
        self, live: dict[str, LiveModel], began: float, records: Sequence[WorkerRecord]
    ) -> None:
        """`live`, read from `began` on, is the view from now on (its caller holds _read_lock)."""
        self._seen = live
        self._pushers = frozenset(
            w.worker_id for w in records if w.alive and w.info.get("relay_push") == "1"
        )
        self._live, self._live_at = live, began

    def pushes(self, worker_id: str) -> bool:
        """Whether this live worker publishes its streams' events to a router's channel (as of
        the view: a worker that registered since is sent none, and relayed by reads)."""
        return worker_id in self._pushers

    async def _read_on_loop(self) -> dict[str, LiveModel] | None:
        """The roster as it is now, read on the loop and shown from now on, or None where that
        takes the disk (a directory's mtime not known yet). A read under way in a thread (it
        holds _read_lock) is left to show its view, as new as this one: the loop never waits
        for that lock; threads wait for it while this read is under way, as for each other's."""
        if not self._read_lock.acquire(blocking=False):
            return self._live
        try:
            began = time.monotonic()
            reply = await self._batch.script(self._roster, self._roster_keys, self._roster_args)
            known = {m.model_dir: m.created for m in self._live.values()}
            records = roster_from_reply(reply, ROSTER_FIELDS)
            live = self._live_from(records, known.get)
            if live is not None:
                self._show(live, began, records)
            return live
        finally:
            self._read_lock.release()

    async def _look(self) -> None:
        """Read the roster on the loop; where that view needs the disk (a model not loaded here
        whose files are checked, a directory's mtime), read and screen it in a thread instead."""
        live = await self._read_on_loop()
        if live is None or any(m != self.primary.model_id and m not in self._others for m in live):
            await anyio.to_thread.run_sync(self._read_and_screen)

    def embedding_model(self, model_id: str, fresh: bool = False) -> LiveModel | None:
        """The live embedding model of this id, else None (a generation model, or none live).
        Its workers say so, even for the router's own model. `fresh`: as the roster is now."""
        live = self.live(fresh).get(model_id)
        return live if live is not None and live.embeds else None

    def served(self) -> list[str]:
        """The router's own model, then every other one with a live worker that this router can
        serve (as far as it knows without loading it), from the view: it words an unknown
        model's error, whose lookup has just read the roster."""
        return [
            self.primary.model_id,
            *sorted(m for m in self.listed(fresh=False) if m != self.primary.model_id),
        ]

    def listed(self, fresh: bool = True) -> dict[str, LiveModel]:
        """The live models this router can serve, by id, as GET /v1/models lists them: every one
        but those refused (their files checked here first, a few stats each). Read from the
        roster as it is now (a worker that just registered is listed), unless not `fresh`."""
        live = self.live(fresh)
        self._screen(live)
        return {m: v for m, v in live.items() if m not in self._refused}

    def refusal(self, model_id: str) -> LoadError | None:
        """Why this router refuses a live model, else None, as of the last look at the roster
        (in memory: no Redis, no disk)."""
        refusal = self._refused.get(model_id)
        return refusal.error if refusal is not None and model_id in self._seen else None

    def refusals(self) -> dict[str, str]:
        """Each refused live model's message, by id, as of the last look at the roster (what
        /health shows as `router_errors`; in memory: no Redis, no disk)."""
        live = self._seen
        with self._refusal_lock:  # request threads and the watch change it
            refused = sorted(self._refused.items())
        return {m: str(r.error) for m, r in refused if m in live}

    def live(self, fresh: bool = False) -> dict[str, LiveModel]:
        """Models with a live worker, by id (looked up at most once per LIVE_CACHE_S; `fresh`:
        looked up now, for answers that a view a moment old would get wrong: a listing, and a
        model the view lacks)."""
        asked = time.monotonic()
        if not fresh and asked - self._live_at < LIVE_CACHE_S:
            return self._live
        with self._read_lock:  # a read begun while this call waited is read enough
            if self._live_at >= asked or (
                not fresh and time.monotonic() - self._live_at < LIVE_CACHE_S
            ):
                return self._live
            return self._read_live_now()

    @staticmethod
    def _live_from(
        records: Sequence[WorkerRecord], created: Callable[[str], int | None]
    ) -> dict[str, LiveModel] | None:
        """The live models of these roster records, each dated by `created(model_dir)`; None
        where that answers None."""
        first: dict[str, dict[str, str]] = {}
        workers: dict[str, list[tuple[str, str]]] = {}
        for w in records:
            mid = w.info.get("model")
            if not w.alive or mid is None:
                continue
            first.setdefault(mid, w.info)
            workers.setdefault(mid, []).append((w.worker_id, w.info.get("host", "")))
        live: dict[str, LiveModel] = {}
        for mid, info in first.items():
            path = info.get("model_dir", "")
            dims = info.get("embedding_dimensions", "")
            when = created(path)
            if when is None:
                return None
            live[mid] = LiveModel(
                mid,
                path,
                info.get("canary", ""),
                when,
                info.get("task") or TASK_GENERATION,
                int(dims) if dims.isdigit() else 0,
                tuple(workers[mid]),
            )
        return live

    async def start(self) -> None:
        """Read the roster in the background (every WATCH_S): the requests' view stays fresh,
        and a model this router cannot serve is logged when its worker registers."""
        self._task = asyncio.create_task(self._watch(), name="model-catalog")

    async def stop(self) -> None:
        for task in (self._task, self._refresh):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._refresh = None

    async def _watch(self) -> None:
        while True:
            try:
                await self._look()
            except redis.RedisError as exc:  # requests report an unreachable Redis themselves
                log.debug("model catalog: roster unreadable (%s); looking again later", exc)
            except Exception:  # a bug here must not end the watch for the process's life
                log.exception("model catalog: the roster check failed; looking again later")
            await asyncio.sleep(WATCH_S)

    def _read_locked(self) -> dict[str, LiveModel]:
        with self._read_lock:
            return self._read_live_now()

    def _read_and_screen(self) -> None:
        self._screen(self._read_locked())

    def _screen(self, live: dict[str, LiveModel]) -> None:
        """Refuse each live model not yet loaded whose files this host lacks; forget the
        refusal of one whose files have appeared (its next request loads it)."""
        for model_id, model in live.items():
            if model_id == self.primary.model_id or model_id in self._others:
                continue
            missing = self._files_missing(model)
            if missing is not None:
                self._refuse(model, missing)
                continue
            refusal = self._refused.get(model_id)
            if refusal is not None and refusal.files_missing:
                self._accept(model_id)
                log.info(
                    "model %r: its files are at %s on this host now; serving it",
                    model_id,
                    model.model_dir,
                )

    def _files_missing(self, live: LiveModel) -> ModelFilesMissing | None:
        """The refusal of `live` for files this host lacks, else None (they are here, or its
        workers name no directory: `_load` refuses that)."""
        if not live.model_dir:
            return None
        missing = missing_model_files(Path(live.model_dir))
        if missing is None:
            return None
        message = (
            f"The model {quoted(live.model_id)} is served by {live.described_workers()}, "
            f"loaded from {live.model_dir}, but on this router's host ({self.host}) {missing}: "
            f"copy that directory's {TOKENIZER_FILES} to {live.model_dir} on every router "
            "host, or mount it there."
        )
        return ModelFilesMissing(message, Path(live.model_dir), missing)

    def _refuse(self, live: LiveModel, error: LoadError) -> None:
        """Record why `live` is refused; log it at ERROR unless that was the last thing logged
        of it (a ModelFilesMissing by its path and what is missing, any other by its text), so
        a refusal is logged once per router process, not once per request or per look."""
        said = (
            f"{error.model_dir}: {error.missing}"
            if isinstance(error, ModelFilesMissing)
            else str(error)
        )
        with self._refusal_lock:
            self._refused[live.model_id] = _Refusal(live.model_dir, live.canary, error)
            if self._logged.get(live.model_id) == said:
                return
            self._logged[live.model_id] = said
        if isinstance(error, ModelFilesMissing):
            log.error(
                "%s Until then this router answers its requests 503 %s.",
                error,
                ErrorKind.MODEL_FILES_MISSING.value,
            )
        else:
            log.error(
                "model %r (%s) cannot be served by this router: %s",
                live.model_id,
                live.described_workers(),
                error,
            )

    def _accept(self, model_id: str) -> None:
        with self._refusal_lock:
            self._refused.pop(model_id, None)
            self._logged.pop(model_id, None)

    def _load(self, live: LiveModel) -> AdmissionContext:
        if not live.model_dir:
            raise TokenizerLoadError(f"the workers of {live.model_id!r} name no model directory")
        missing = self._files_missing(live)
        if missing is not None:
            raise missing
        fix = f"every router host needs the same files at {live.model_dir} as its workers"
        tokenizer = load_tokenizer(Path(live.model_dir), self.tokenizer_copies, fix)
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


def unservable_error(model: str, error: LoadError) -> APIError:
    """The answer to a request for a live model this router cannot serve: 503
    `model_files_missing` without a retry (its message says what to copy where) when its files
    are not on this host, else 503 `no_live_worker` with the reason."""
    if isinstance(error, ModelFilesMissing):
        return APIError.of(ErrorKind.MODEL_FILES_MISSING, str(error), headers=NO_RETRY)
    return APIError.of(ErrorKind.NO_LIVE_WORKER, f"The pool cannot serve {quoted(model)}: {error}")


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
