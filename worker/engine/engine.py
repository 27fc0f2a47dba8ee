"""The batch engine: continuous batching around mlx-lm's BatchGenerator, with the prompt cache at
admission (adopt) and at a healthy finish (donate). No Redis, no rq, no threads of its own (a
grammar compiles on the executor passed in): the clock is passed in, and every call returns a
`StepResult` the caller applies.

Shape (BatchGenerator's verbs): `admit(spec)` puts a request in the batch, `step()` runs one
decode step plus a prefill chunk, `cancel(id)` takes one out, `fail_all(...)` empties the batch.
The choices of one prompt (a `group`) compute it once: one prefills, the others start from
copies of its KV (worker/engine/shared_prompt.py).
No request holds the loop: a prompt scored for its logprobs runs a chunk a step beside the
batch's decode step (worker/engine/scoring.py), and a grammar compiles once, on an injected
executor, while its requests wait (worker/engine/grammar_compile.py).
A failure that belongs to one request (its admission, its sampler, its text) ends that request
and leaves the batch running; a failure of the batched step itself fails every running request
and starts a fresh generator, so the engine always goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

import mlx.core as mx
from llguidance import LLMatcher
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import greedy_sampler

from shared.config import WorkerConfig
from shared.errors import ErrorKind
from shared.wire import GenerationRequest, StreamEvent
from worker.engine.admission import AdmissionError, check_admissible
from worker.engine.first_token import generator_class
from worker.engine.grammar import GrammarError, GrammarTokenizer
from worker.engine.grammar_compile import GrammarCompiler, GrammarWaits
from worker.engine.request import Request, RequestStatus
from worker.engine.results import EngineCounters, StepResult
from worker.engine.sampling import (
    LogprobEntry,
    apply_processors,
    logprob_entries,
    make_logits_processors,
    make_request_sampler,
)
from worker.engine.scoring import Scorer
from worker.engine.shared_prompt import PromptSharing, can_share, prompt_kv_copies
from worker.engine.stopping import min_tokens_mask, stop_rule, stop_sequences
from worker.engine.text_stream import TextStream
from worker.mlx_cpu.idle_memory import RELEASE_SHARE, release_idle_memory, worth_releasing
from worker.mlx_cpu.last_logits import last_logits
from worker.prompt_cache.checkpoints import split_at
from worker.prompt_cache.keys import CacheNamespace
from worker.prompt_cache.modes import AdoptResult
from worker.prompt_cache.policy import PromptCache

log = logging.getLogger("mlxcel.worker.engine")

# A cache hit leaving at most this many prompt tokens to compute starts in one forward pass.
FAST_START_MAX_TOKENS = 64
# A step with nothing to run but grammar compiles waits this long for one (seconds).
COMPILE_WAIT_S = 0.005
# Every output's detokenizer is fed this many of the prompt's last tokens first, so its text
# continues the prompt's (a first leading space kept, as OpenAI and vLLM do): more than one
# character's bytes ever span.
PRIMING_TOKENS = 8
# How a request whose grammar failed while decoding says so (the worker cannot tell which field
# the grammar came from).
GRAMMAR_FAILED = "the grammar of response_format or tool_choice"
INVALID = ErrorKind.INVALID_REQUEST
SERVER = ErrorKind.SERVER_ERROR
TIMEOUT = ErrorKind.TIMEOUT


class Engine:
    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        config: WorkerConfig,
        *,
        model_id: str,
        worker_id: str,
        context_length: int,
        prompt_cache: PromptCache | None,
        clock: Callable[[], float] = time.monotonic,
        grammar_executor: Executor | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_id = model_id
        self.worker_id = worker_id
        self.context_length = context_length
        self.vocab_size = int(model.args.vocab_size)
        self.prompt_cache = prompt_cache
        self.clock = clock
        self.counters = EngineCounters()
        self._eos = frozenset(tokenizer.eos_token_ids)
        # Each distinct grammar compiled once, on the executor (default: one thread).
        self._grammars = GrammarCompiler(
            GrammarTokenizer(tokenizer, self.vocab_size, self._eos), grammar_executor
        )
        self._last_reject_sent: dict[str, Any] | None = None
        # MLX has buffers cached since this engine last worked (at _busy_at, engine clock);
        # once idle, they go back if they are more than release_share of the memory in use.
        self.release_share = RELEASE_SHARE
        self._buffers_held = False
        self._busy_at = 0.0
        # The one index of running requests, by BatchGenerator uid (a batch holds few, so a
        # lookup by request id scans it instead of keeping a second map in step).
        self._running: dict[int, Request] = {}
        # Group-mates waiting for the prefill of the prompt they share (not in the batch yet).
        # Requests waiting for their grammar's compile, and those scoring their prompts: the
        # two stages before the batch, both advanced by step().
        self._compiles = GrammarWaits()
        self._scorer = Scorer(model, config.prefill_step_size)
        self._sharing = PromptSharing(can_share(model))
        self.gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        return generator_class()(
            self.model,
            max_tokens=self.config.default_max_tokens,
            stop_tokens=[[t] for t in sorted(self._eos)],
            completion_batch_size=self.config.batch_size,
            prefill_batch_size=min(self.config.prefill_batch_size, self.config.batch_size),
            prefill_step_size=self.config.prefill_step_size,
        )

    @property
    def active(self) -> int:
        return (
            len(self._running) + len(self._sharing.held) + len(self._compiles) + len(self._scorer)
        )

    @property
    def free_slots(self) -> int:
        return max(0, self.config.batch_size - self.active)

    @property
    def running(self) -> list[Request]:
        """Every request the engine holds: in the batch, scoring its prompt, or waiting for a
        group-mate or for its grammar."""
        return [*self._running.values(), *self._scorer, *self._sharing.held, *self._compiles]

    def find(self, request_id: str) -> Request | None:
        return next((r for r in self.running if r.id == request_id), None)

    # -- admission -------------------------------------------------------------------------

    def admit(
        self, spec: GenerationRequest, ticket: Any = None, timeout_s: float | None = None
    ) -> StepResult:
        """Put a request in the running batch, adopting a cached prefix when one matches. A
        request that cannot run ends here, failed, with an error event; nothing else changes."""
        out = StepResult()
        now = self.clock()
        self._working()  # a request can compute here (a fast start) and leave buffers
        rule = stop_rule(spec, self._eos)
        req = Request(
            spec=spec,
            ticket=ticket,
            namespace=CacheNamespace(self.model_id, spec.adapter_id, spec.template_signature),
            text=TextStream(
                self.tokenizer.detokenizer,
                list(spec.stop),
                include_stop=spec.include_stop_str_in_output,
                min_tokens=spec.min_tokens,
            ),
            stopping=rule,
            sampler=None,
            processors=[],
            admitted_at=now,
            deadline=now + timeout_s if timeout_s and timeout_s > 0 else None,
        )
        try:
            check_admissible(spec, self.vocab_size, self.context_length)
            req.text.prime(spec.prompt_tokens[-PRIMING_TOKENS:])  # its text continues the prompt's
            req.sampler = make_request_sampler(spec, self.vocab_size)
            req.processors = make_logits_processors(spec)
            # After logit_bias (no bias ends it early), before the grammar (worker/engine/stopping).
            early = min_tokens_mask(rule, len(spec.prompt_tokens), self.vocab_size)
            if early is not None:
                req.processors.append(early)
            compiled = self._grammars.compile(spec.grammar) if spec.grammar is not None else None
            if compiled is not None and not compiled.done():
                self._compiles.wait(req, compiled)  # step() starts it once its compile is done
                out.prefill_pending = True
            else:
                self._constrained_launch(req, compiled, out)
        except Exception as exc:  # this request's own failure: the batch runs on without it
            self.start_failed(req, exc, out)
        return self._drained(out)

    def _constrained_launch(
        self, req: Request, compiled: Future[LLMatcher] | None, out: StepResult
    ) -> None:
        """Launch with its own copy of its grammar's compiled matcher, when it has one."""
        if compiled is not None:
            # Last: after logit_bias, so a token the grammar bans stays banned.
            req.grammar = self._grammars.constraint(compiled, req.spec)
            req.processors.append(req.grammar)
        self.launch(req, out)

    def _start_compiled(self, out: StepResult) -> None:
        """The requests whose grammar compiled since the last step start now."""
        for req, compiled in self._compiles.ready():
            try:
                self._constrained_launch(req, compiled, out)
            except Exception as exc:
                self.start_failed(req, exc, out)

    def start_failed(self, req: Request, exc: Exception, out: StepResult) -> None:
        """A request that could not start fails alone: as the caller's error when its spec or
        grammar is at fault, else as the server's."""
        if isinstance(exc, AdmissionError | GrammarError):
            self._abandon(req, RequestStatus.FAILED, str(exc), INVALID, out)
            return
        log.exception("starting %s failed", req.id)
        self._abandon(req, RequestStatus.FAILED, _describe(exc), SERVER, out)

    def launch(self, req: Request, out: StepResult) -> None:
        """Start a request, or hold it for a group-mate computing their prompt."""
        self._sharing.launch(req, [*self._running.values(), *self._scorer], self, out)

    def _begin(self, req: Request, out: StepResult, from_cache: int = 0) -> None:
        """Counted and announced: its `start` event, with the prompt tokens it did not compute
        (`from_cache` of them came from the prompt cache, not from a group-mate)."""
        prompt = req.spec.prompt_tokens
        spec = req.spec
        if not spec.group or spec.group == spec.request_id:  # n choices: the prompt counts once
            self.counters.requests += 1
            self.counters.prompt_tokens += len(prompt)
            self.counters.prompt_tokens_cached += from_cache
        start = StreamEvent(
            kind="start",
            prompt_tokens=len(prompt),
            cached_tokens=req.cached_tokens,
            worker_id=self.worker_id,
            prompt_logprobs=req.prompt_logprobs or [],
        )
        out.emit(req, start)

    def start(self, req: Request, out: StepResult) -> None:
        """Start a request on its own prompt (a prompt-cache hit, if any, first)."""
        if req.spec.prompt_logprobs is not None or req.spec.max_tokens == 0:
            self._start_scored(req, out)
            return
        prompt = req.spec.prompt_tokens
        adopted: AdoptResult | None = None
        if self.prompt_cache is not None:
            adopted = self.prompt_cache.try_adopt_cached_prefix(
                req.namespace, req.spec.session_key, prompt, req.seq_id
            )
        if adopted is not None:
            req.cached_tokens, req.lease = adopted.cached_tokens, adopted.lease
        self._begin(req, out, req.cached_tokens)
        cached = req.cached_tokens
        # Checkpoints are kept at the prefill's segment ends; a fast start has none.
        pc = self.prompt_cache
        marks = pc.checkpoint_marks(req.namespace, prompt, cached) if pc is not None else []
        if adopted is not None and not marks and len(prompt) - cached <= FAST_START_MAX_TOKENS:
            self._fast_start(req, adopted.caches, out)
            return
        caches = adopted.caches if adopted is not None else None
        self._insert(req, prompt[cached:], req.spec.max_tokens, caches, prompt[:cached], marks)
        out.prefill_pending = True

    def _start_scored(self, req: Request, out: StepResult) -> None:
        """A request that asked for its prompt's logprobs, or for no new token: the scoring pass
        over the prompt but its last token (worker/engine/scoring.py), a chunk a step, is also
        its prefill (`_scored` goes on from there); with nothing to score it starts here."""
        spec = req.spec
        prompt = spec.prompt_tokens
        if spec.prompt_logprobs is not None and len(prompt) > 1:
            self._scorer.add(req, spec.prompt_logprobs)
            out.prefill_pending = True
            return
        req.prompt_logprobs = [] if spec.prompt_logprobs is not None else None
        self._begin(req, out)
        if spec.max_tokens == 0:  # nothing computed, nothing to donate
            self._finish(req, "length", None, [], out, donate=False)
        else:  # a one-token prompt: nothing scored, the batch prefills it
            self._insert(req, prompt, spec.max_tokens, None, [])
            out.prefill_pending = True

    def _score(self, out: StepResult) -> None:
        """This step's scoring: one chunk's positions in all, oldest request first. A request
        whose pass is done starts (or, with max_tokens 0, ends) from its pass's cache."""
        for req, count in self._scorer.chunks():
            try:
                assert req.scoring is not None  # a queued request holds its pass
                with mx.stream(self.gen.stream):
                    req.scoring.advance(self.model, count)
                self.counters.batch_prefill_tokens += count
                if req.scoring.done:
                    self._scored(req, out)
            except Exception as exc:  # its own failure: the others score on
                self.start_failed(req, exc, out)

    def _scored(self, req: Request, out: StepResult) -> None:
        """The pass covers the prompt but its last token: announced with its logprobs, the
        group-mates waiting on it start from copies of its KV, and it goes to the batch."""
        score = req.scoring
        assert score is not None
        self._scorer.drop(req)
        spec = req.spec
        prompt = spec.prompt_tokens
        caches, req.prompt_logprobs = score.cache, score.entries
        req.prompt_ready, req.status = True, RequestStatus.PREFILLING
        self._begin(req, out)
        self._sharing.scored(req, caches, self.gen.stream, self, out)
        if spec.max_tokens == 0:
            self._finish(req, "length", caches, prompt[:-1], out)
        else:
            self._insert(req, prompt[-1:], spec.max_tokens, caches, prompt[:-1])

    def start_from(self, req: Request, mate: Request, caches: list[Any], out: StepResult) -> None:
        """Start from a group-mate's KV of the prompt but its last token (reported as cached,
        as a prompt-cache hit is), and its prompt logprobs when asked: that one token is all it
        computes, in BatchGenerator's next step, batched with the other sequences starting."""
        prompt = req.spec.prompt_tokens
        req.cached_tokens = len(prompt) - 1
        if req.spec.prompt_logprobs is not None:
            req.prompt_logprobs = mate.prompt_logprobs
        self._begin(req, out)
        self._insert(req, prompt[-1:], req.spec.max_tokens, caches, prompt[:-1])

    def prompt_kv(self, mate: Request, count: int) -> list[list[Any]] | None:
        """`count` copies of the KV of mate's prompt but its last token; None when there is none
        to copy (the requests that wanted it then compute the prompt themselves)."""
        shared = len(mate.spec.prompt_tokens) - 1
        try:
            found = self.gen.extract_cache([mate.uid]).get(mate.uid)
            if found is None:
                return None
            with mx.stream(self.gen.stream):
                return prompt_kv_copies(list(found[0]), shared, count)
        except Exception:  # theirs to recover from: they prefill on their own
            log.warning("could not copy the prompt KV of %s", mate.id, exc_info=True)
            return None

    def _keep_checkpoints(self, progress: list[Any]) -> None:
        """Sequences whose prefill stopped at a segment end (only snapshot mode cuts prompts
        into segments: each end is a checkpoint) give the prompt cache a copy of their state
        there. A copy that fails costs that checkpoint only."""
        ends = [
            p.uid
            for p in progress
            if p.end_of_segment and not p.end_of_prompt and p.uid in self._running
        ]
        if not ends or self.prompt_cache is None:
            return
        try:
            with mx.stream(self.gen.stream):
                for uid, (caches, tokens) in self.gen.extract_cache(ends).items():
                    req = self._running[uid]
                    self.prompt_cache.keep_checkpoint(
                        req.namespace, req.spec.session_key, req.seq_id, list(tokens), caches
                    )
        except Exception:
            log.warning("could not keep a prefill checkpoint", exc_info=True)

    def _insert(
        self,
        req: Request,
        tokens: list[int],
        max_tokens: int,
        caches: list[Any] | None,
        cached_tokens: list[int],
        marks: list[int] | None = None,
    ) -> None:
        """Hand the sequence to BatchGenerator; `caches` hold KV for exactly `cached_tokens`.
        Its prefill stops at each of the absolute positions `marks` (a checkpoint each)."""
        segments = split_at(tokens, len(cached_tokens), marks or [])
        (uid,) = self.gen.insert_segments(
            [segments],
            max_tokens=[max_tokens],
            caches=[caches] if caches is not None else None,
            all_tokens=[list(cached_tokens)] if caches is not None else None,
            samplers=[req.sampler],
            logits_processors=[req.processors],
            stop_sequences=[stop_sequences(req.stopping.ends)],
        )
        req.uid = uid
        self._running[uid] = req

    def _fast_start(self, req: Request, caches: list[Any], out: StepResult) -> None:
        """A cache hit that leaves a short remainder: prefill it and sample the first token in ONE
        forward pass, here, instead of BatchGenerator's remainder pass plus a separate
        last-token pass two steps later (on the CPU a pass over a few tokens costs about one
        read of the weights). Long remainders take the chunked prefill, so running streams
        never wait on them; this one short pass delays them by about one step."""
        spec = req.spec
        remaining = spec.prompt_tokens[req.cached_tokens :]
        with mx.stream(self.gen.stream):
            logits = last_logits(self.model, mx.array([remaining]), caches)
            # As BatchGenerator runs a sequence's processors: over its tokens so far.
            logits = apply_processors(req.processors, spec.prompt_tokens, logits)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = int((req.sampler or greedy_sampler)(logprobs).item())
            entry = self._logprobs(req, logprobs, token)
        req.prompt_ready = True  # the caches now cover the whole prompt
        if req.grammar is not None:
            req.grammar.advance([token])  # BatchGenerator's first call then has nothing new
            if req.grammar.error:  # the grammar's own limits, not the caller's luck: a 400
                raise GrammarError(f"{GRAMMAR_FAILED}: {req.grammar.error}")
        self.counters.batch_prefill_tokens += len(remaining)
        req.status = RequestStatus.DECODING
        budget_reason = "length" if spec.max_tokens == 1 else None
        reason = "stop" if token in req.stopping.ends else budget_reason
        reason, _ = self._accept(req, token, reason, out, entry)
        if reason is not None:
            # The KV covers the prompt; the sampled token was never fed back.
            self._finish(req, reason, caches, list(spec.prompt_tokens), out)
            return
        # BatchGenerator takes the sampled token as the last "prompt" token and goes on from it.
        self._insert(req, [token], spec.max_tokens - 1, caches, spec.prompt_tokens)

    # -- decode ----------------------------------------------------------------------------

    def _working(self) -> None:
        self._buffers_held, self._busy_at = True, self.clock()

    def step(self) -> StepResult:
        """One step: the requests whose grammar compiled start, one chunk of prompt scoring,
        then one BatchGenerator step (a decode step for running sequences and a prefill chunk)."""
        out = StepResult()
        if not self.active:
            # Idle a while: its spare memory goes back. Not at once: the release holds the GIL
            # the publisher thread needs for the last events, and a client sending request
            # after request would pay the allocations each time.
            if self._buffers_held and self.clock() - self._busy_at >= self.config.idle_release_s:
                if worth_releasing(self.release_share):
                    release_idle_memory()
                self._buffers_held = False
            return out
        self._working()
        self._expire(out)
        self._start_compiled(out)
        self._score(out)
        if not self._running:
            if self._compiles and not self._scorer:  # nothing to compute: wait for a compile
                self._compiles.block(COMPILE_WAIT_S)
            return self._drained(out)
        try:
            with self.gen.stats() as stats:
                progress, responses = self.gen.next()
        except Exception as exc:  # the batched step itself: no one request to blame
            log.exception("engine step failed; failing %d running requests", self.active)
            self._fail_running(f"engine error: {_describe(exc)}", SERVER, out, batch_only=True)
            self.gen = self._new_generator()
            return self._drained(out)
        self.counters.batch_prefill_tokens += stats.prompt_tokens
        self.counters.batch_decode_tokens += stats.generation_tokens
        self.counters.batch_decode_steps += stats.generation_steps
        self._sharing.computed(progress, self._running, self, out)
        self._keep_checkpoints(progress)
        cut: list[Request] = []  # ended by a stop string while BatchGenerator still holds them
        entries = self._step_logprobs(responses, out)
        for r in responses:
            req = self._running.get(r.uid)
            if req is None:
                continue
            try:
                if req.grammar is not None and req.grammar.error:
                    # Its matcher refused a token its own mask allowed, or allowed nothing: the
                    # grammar went past llguidance's limits (shared.wire.GRAMMAR_LIMITS), so
                    # this request fails as the caller's (a 400), and the batch runs on.
                    error = f"{GRAMMAR_FAILED}: {req.grammar.error}"
                    self._abandon(req, RequestStatus.FAILED, error, INVALID, out)
                    continue
                req.status = RequestStatus.DECODING
                entry = entries.get(r.uid)
                reason, by_text = self._accept(req, r.token, r.finish_reason, out, entry)
                if by_text:
                    cut.append(req)
                elif reason is not None:
                    self._finish(req, reason, r.prompt_cache, r.all_tokens, out)
            except Exception as exc:  # this sequence's own failure (its text, its cache)
                log.exception("sequence %s failed", req.id)
                self._abandon(req, RequestStatus.FAILED, _describe(exc), SERVER, out)
        if cut:
            kept = self.gen.remove([req.uid for req in cut], return_prompt_caches=True)
            for req in cut:
                layer_caches, tokens = kept.get(req.uid, (None, []))
                self._finish(req, "stop", layer_caches, tokens, out)
        return self._drained(out)

    def _step_logprobs(self, responses: list[Any], out: StepResult) -> dict[int, LogprobEntry]:
        """The logprob entries of this step's tokens, by uid, for the requests that asked for
        them: one evaluation for all of them, nothing at all when none asked. Each comes from
        BatchGenerator's `Response.logprobs`, the log-softmax after the request's penalties and
        logit bias and before temperature and truncation (worker/engine/sampling.py says why)."""
        wanted = []
        for r in responses:
            req = self._running.get(r.uid)
            if req is not None and req.spec.logprobs is not None:
                wanted.append((req, r))
        if not wanted:
            return {}
        try:
            rows = [(r.logprobs, r.token, req.spec.logprobs) for req, r in wanted]
            entries = logprob_entries(rows)
        except Exception as exc:  # theirs alone: the requests without logprobs run on
            log.exception("logprobs of %d sequences failed", len(wanted))
            for req, _ in wanted:
                self._abandon(req, RequestStatus.FAILED, _describe(exc), SERVER, out)
            return {}
        return {r.uid: entry for (_, r), entry in zip(wanted, entries, strict=True)}

    def _logprobs(self, req: Request, logprobs: mx.array, token: int) -> LogprobEntry | None:
        if req.spec.logprobs is None:
            return None
        return logprob_entries([(logprobs, token, req.spec.logprobs)])[0]

    def _accept(
        self,
        req: Request,
        token: int,
        reason: str | None,
        out: StepResult,
        logprobs: LogprobEntry | None = None,
    ) -> tuple[str | None, bool]:
        """Fold one sampled token into the request: emit its text (and its logprob entry, when
        the request asked) and say why the request ends (None: it goes on), and whether a stop
        string ended it (BatchGenerator did not)."""
        if reason == "stop" and token in req.stopping.ends:
            return reason, False  # an EOS or stop token ends the sequence: no text, not counted
        req.completion_tokens += 1
        self.counters.completion_tokens += 1
        # An EOS that did not end it (ignore_eos) is a special token: vLLM gives it no text.
        delta = req.text.push(token, silent=token in self._eos)
        entries = [logprobs] if logprobs is not None else []
        out.emit(
            req, StreamEvent(kind="delta", text=delta.text, token_ids=[token], logprobs=entries)
        )
        if delta.stopped:
            return "stop", reason is None
        return reason, False

    def _finish(
        self,
        req: Request,
        reason: str,
        layer_caches: list[Any] | None,
        tokens: list[int] | None,
        out: StepResult,
        donate: bool = True,
    ) -> None:
        """A healthy finish: the tail of the text, the KV offered to the prompt cache (unless it
        never had any: max_tokens 0 with nothing scored), `done`."""
        self._leave(req)
        tail = req.text.finish()
        if tail:
            out.emit(req, StreamEvent(kind="delta", text=tail))
        if self.prompt_cache is not None and donate:
            self.prompt_cache.donate_finished_sequence_cache(
                req.namespace, req.spec.session_key, req.seq_id, list(tokens or []), layer_caches
            )
        req.release_cache()
        req.status, req.finish_reason = RequestStatus.FINISHED, reason
        usage = req.usage()
        out.emit(
            req,
            StreamEvent(
                kind="done",
                finish_reason=reason,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                cached_tokens=usage.cached_tokens,
                stop_str=req.text.matched if reason == "stop" else None,
            ),
        )
        out.end(req)
        self._sharing.resume(req, self, out)

    def _leave(self, req: Request) -> None:
        if req.uid is not None:
            self._running.pop(req.uid, None)
            req.uid = None

    # -- ending requests early -------------------------------------------------------------

    def cancel(self, request_id: str) -> StepResult:
        """Drop a request whose client went away; its KV is not donated (not a healthy finish)."""
        out = StepResult()
        req = self.find(request_id)
        if req is not None:
            self._abandon(req, RequestStatus.CANCELLED, "", "", out)
        return self._drained(out)

    def fail_all(self, error: str, error_type: str = SERVER) -> StepResult:
        """End every running request, failed (a cold stop, a lost Redis)."""
        out = StepResult()
        self._fail_running(error, error_type, out)
        return self._drained(out)

    def _fail_running(
        self, error: str, error_type: str, out: StepResult, batch_only: bool = False
    ) -> None:
        """Fail the batch and the group-mates held for it (first: none restarts), and unless
        `batch_only`, the requests not in the batch yet (compiling, scoring) too."""
        before = [] if batch_only else [*self._compiles, *self._scorer]
        for req in [*self._sharing.held, *before, *self._running.values()]:
            self._abandon(req, RequestStatus.FAILED, error, error_type, out)

    def _expire(self, out: StepResult) -> None:
        now = self.clock()
        for req in self.running:
            if req.status.ended:  # it failed to start again after its group-mate expired
                continue
            if req.deadline is not None and now >= req.deadline:
                limit = req.deadline - req.admitted_at
                self._abandon(
                    req, RequestStatus.FAILED, f"timed out after {limit:g}s", TIMEOUT, out
                )

    def _abandon(
        self, req: Request, status: RequestStatus, error: str, error_type: str, out: StepResult
    ) -> None:
        """End a request without a healthy finish: out of the batch (or no longer held), its
        cache hold released, an error event unless its client cancelled it; the group-mates
        that waited on its prefill start without it."""
        if req.status.ended:
            return
        self._sharing.held.drop(req)
        self._compiles.drop(req)
        self._scorer.drop(req)
        if req.uid is not None:
            try:
                self.gen.remove([req.uid])
            except Exception:  # already gone from the generator (it ended inside this step)
                log.debug("sequence %s was no longer in the batch", req.id, exc_info=True)
            self._leave(req)
        req.release_cache()
        req.status, req.error, req.error_type = status, error, error_type
        if status is RequestStatus.CANCELLED:
            req.finish_reason = "cancelled"
        else:
            out.emit(req, StreamEvent(kind="error", error=error, error_type=error_type))
        out.end(req)
        self._sharing.resume(req, self, out)

    # -- stats, control --------------------------------------------------------------------

    def drain(self) -> StepResult:
        """What work outside the engine's calls (a cache reset) changed: counters, index."""
        return self._drained(StepResult())

    def _drained(self, out: StepResult) -> StepResult:
        """Every call hands back what its work added to the counters, and a newer last reject."""
        out.counters = self.counters.take()
        if self.prompt_cache is not None:
            out.counters.update(self.prompt_cache.counters.take())
            changes, firsts = self.prompt_cache.store.index.take()
            out.index.update(changes)
            out.index_firsts |= firsts
            last = self.prompt_cache.counters.last_reject
            if last is not None and last != self._last_reject_sent:
                out.last_reject = self._last_reject_sent = dict(last)
        return out

    def held_blocks(self) -> list[bytes]:
        """Every block index member the prompt cache holds now (a full index rewrite)."""
        return self.prompt_cache.store.index.held() if self.prompt_cache is not None else []

    def held_first_blocks(self) -> set[bytes]:
        """Those of held_blocks() that are a prompt's first block."""
        if self.prompt_cache is None:
            return set()
        return self.prompt_cache.store.index.held_firsts()

    def gauges(self) -> dict[str, Any]:
        g: dict[str, Any] = {}
        if self.prompt_cache is not None:
            g.update(self.prompt_cache.gauges())
        g["batch_current_size"] = self.active
        # The KV caches of the sequences BatchGenerator holds (waiting, prefilling, decoding):
        # the running batch's part of the worker's KV usage (shared.cache_stats.kv_usage).
        g["batch_kv_bytes"] = int(self.gen.prompt_cache_nbytes)
        return g

    def reset_cache(self) -> dict[str, Any]:
        if self.prompt_cache is None:
            return {"cleared": True, "freed_bytes": 0, "freed_entries": 0}
        r = self.prompt_cache.reset()
        return {
            "cleared": bool(r.cleared),
            "freed_bytes": int(r.freed_bytes),
            "freed_entries": int(r.freed_entries),
        }


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
