"""Continuous batching around mlx-lm's BatchGenerator, with the prompt cache at admission/finish.

Shape (style guide: BatchGenerator's verbs): `admit(request)` -> start events, `step()` -> one
decode burst's outputs, `cancel(request_id)`. It never touches Redis: intake and the publisher do.
New requests join the running batch between decode steps; BatchGenerator prefills prompts in
chunks of `prefill_step_size` interleaved with decode steps, so a long prompt does not stall the
streams already running.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.sample_utils import greedy_sampler

from shared.config import WorkerConfig
from shared.wire import GenerationRequest, StreamEvent
from worker.engine.sampling import make_request_sampler
from worker.engine.text_stream import TextStream
from worker.mlx_cpu.last_logits import last_logits
from worker.prompt_cache.keys import CacheNamespace
from worker.prompt_cache.policy import PromptCache

log = logging.getLogger("mlxcel.worker.scheduler")

# A cache hit leaving at most this many prompt tokens to compute starts in one forward pass.
FAST_START_MAX_TOKENS = 64


class AdmissionError(ValueError):
    """A request this model cannot run (token ids or length out of range)."""


@dataclass
class StepOutput:
    """What one request produced in one step: events for its stream, and whether it ended.
    `status` is "running", "finished", "failed" or "cancelled"."""

    request_id: str
    events: list[StreamEvent] = field(default_factory=list)
    status: str = "running"
    error: str = ""
    result: dict[str, Any] | None = None
    needs_prefill: bool = False  # admitted with its prompt's prefill still ahead


@dataclass
class SchedulerCounters:
    """Drained by the publisher once per step, like the cache's counters."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    batch_prefill_tokens: int = 0
    batch_decode_tokens: int = 0
    batch_decode_steps: int = 0

    def take(self) -> dict[str, int]:
        out = {k: v for k, v in vars(self).items() if v}
        for k in out:
            setattr(self, k, 0)
        return out


@dataclass
class _Sequence:
    request: GenerationRequest
    uid: int
    seq_id: str
    namespace: CacheNamespace
    text: TextStream
    cached_tokens: int
    admitted_at: float
    completion_tokens: int = 0


class Scheduler:
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
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.model_id = model_id
        self.worker_id = worker_id
        self.context_length = context_length
        self.vocab_size = int(model.args.vocab_size)
        self.prompt_cache = prompt_cache
        self.counters = SchedulerCounters()
        self._by_uid: dict[int, _Sequence] = {}
        self._by_request: dict[str, _Sequence] = {}
        self.gen = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            max_tokens=self.config.default_max_tokens,
            stop_tokens=[[t] for t in sorted(self.tokenizer.eos_token_ids)],
            completion_batch_size=self.config.batch_size,
            prefill_batch_size=min(self.config.prefill_batch_size, self.config.batch_size),
            prefill_step_size=self.config.prefill_step_size,
        )

    @property
    def active(self) -> int:
        return len(self._by_uid)

    @property
    def free_slots(self) -> int:
        return max(0, self.config.batch_size - self.active)

    # -- admission -------------------------------------------------------------------------

    def _check(self, req: GenerationRequest) -> None:
        n = len(req.prompt_tokens)
        if max(req.prompt_tokens) >= self.vocab_size:
            raise AdmissionError(f"prompt token id out of range for vocab size {self.vocab_size}")
        if n + req.max_tokens > self.context_length:
            raise AdmissionError(
                f"prompt ({n} tokens) + max_tokens ({req.max_tokens}) exceeds the model's "
                f"context length {self.context_length}"
            )

    def admit(self, req: GenerationRequest) -> StepOutput:
        """Insert a request into the running batch (adopting a cached prefix when one matches)."""
        try:
            self._check(req)
        except AdmissionError as exc:
            return _failed(req.request_id, str(exc), "invalid_request_error")
        prompt = req.prompt_tokens
        ns = CacheNamespace(self.model_id, req.adapter_id, req.template_signature)
        seq_id = f"seq-{req.request_id[:12]}"
        adopted = None
        if self.prompt_cache is not None:
            adopted = self.prompt_cache.try_adopt_cached_prefix(ns, req.session_key, prompt, seq_id)
        cached = adopted.cached_tokens if adopted else 0
        sampler = make_request_sampler(req.temperature, req.top_p, req.seed)
        seq = _Sequence(
            request=req,
            uid=-1,
            seq_id=seq_id,
            namespace=ns,
            text=TextStream(self.tokenizer.detokenizer, list(req.stop)),
            cached_tokens=cached,
            admitted_at=time.time(),
        )
        self.counters.requests += 1
        self.counters.prompt_tokens += len(prompt)
        start = StreamEvent(
            kind="start", prompt_tokens=len(prompt), cached_tokens=cached, worker_id=self.worker_id
        )
        if adopted and len(prompt) - cached <= FAST_START_MAX_TOKENS:
            return self._fast_start(seq, adopted.caches, sampler, start)
        self._insert(
            seq,
            prompt[cached:],
            req.max_tokens,
            adopted.caches if adopted else None,
            list(prompt[:cached]),
            sampler,
        )
        return StepOutput(req.request_id, [start], needs_prefill=True)

    def _insert(
        self,
        seq: _Sequence,
        tokens: list[int],
        max_tokens: int,
        caches: list[Any] | None,
        cached_tokens: list[int],
        sampler: Any,
    ) -> None:
        """Hand a sequence to BatchGenerator; `caches` hold KV for exactly `cached_tokens`."""
        (uid,) = self.gen.insert(
            [tokens],
            max_tokens=[max_tokens],
            caches=[caches] if caches is not None else None,
            all_tokens=[cached_tokens] if caches is not None else None,
            samplers=[sampler],
        )
        seq.uid = uid
        self._by_uid[uid] = seq
        self._by_request[seq.request.request_id] = seq

    def _fast_start(
        self, seq: _Sequence, caches: list[Any], sampler: Any, start: StreamEvent
    ) -> StepOutput:
        """A cache hit that leaves a short remainder: prefill it and sample the first token in ONE
        forward pass, here, instead of BatchGenerator's remainder pass plus a separate last-token
        pass two steps later. On CPU a pass over a few tokens costs about one weight read, so
        this halves warm TTFT. Long remainders still take the chunked prefill, so the running
        streams never wait on them; this one short pass delays them by about one step."""
        req = seq.request
        remaining = req.prompt_tokens[seq.cached_tokens :]
        with mx.stream(self.gen.stream):
            logits = last_logits(self.model, mx.array([remaining]), caches)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            token = int((sampler or greedy_sampler)(logprobs).item())
        self.counters.batch_prefill_tokens += len(remaining)
        self.counters.completion_tokens += 1
        seq.completion_tokens = 1
        events = [start]
        reason = "stop" if token in self.tokenizer.eos_token_ids else None
        if reason is None:
            delta = seq.text.push(token)
            events.append(StreamEvent(kind="delta", text=delta.text, token_ids=[token]))
            if delta.stopped:
                reason = "stop"
            elif req.max_tokens == 1:
                reason = "length"
        if reason is not None:
            # The KV covers the prompt; the sampled token was never fed back.
            fin = self._finish(seq, reason, caches, list(req.prompt_tokens))
            fin.events[:0] = events
            return fin
        # BatchGenerator takes the sampled token as the last "prompt" token and goes on from it.
        self._insert(seq, [token], req.max_tokens - 1, caches, list(req.prompt_tokens), sampler)
        return StepOutput(req.request_id, events)

    # -- decode ----------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One BatchGenerator step: a decode step for running sequences and a prefill chunk."""
        if not self._by_uid:
            return []
        try:
            with self.gen.stats() as stats:
                _, responses = self.gen.next()
        except Exception as exc:  # an engine failure fails every running request, loudly
            log.exception("engine step failed; failing %d running requests", self.active)
            return self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
        self.counters.batch_prefill_tokens += stats.prompt_tokens
        self.counters.batch_decode_tokens += stats.generation_tokens
        self.counters.batch_decode_steps += stats.generation_steps
        outputs: list[StepOutput] = []
        stopped_by_text: list[_Sequence] = []
        for r in responses:
            seq = self._by_uid.get(r.uid)
            if seq is None:
                continue
            out = self._on_token(seq, r, stopped_by_text)
            if out is not None:
                outputs.append(out)
        if stopped_by_text:
            caches = self.gen.remove([s.uid for s in stopped_by_text], return_prompt_caches=True)
            for seq in stopped_by_text:
                layer_caches, tokens = caches.get(seq.uid, (None, []))
                outputs.append(self._finish(seq, "stop", layer_caches, tokens))
        return outputs

    def _on_token(self, seq: _Sequence, r: Any, stopped: list[_Sequence]) -> StepOutput | None:
        seq.completion_tokens += 1
        self.counters.completion_tokens += 1
        rid = seq.request.request_id
        reason = r.finish_reason
        events: list[StreamEvent] = []
        # An EOS token ends the sequence but is not text the client sees.
        if not (reason == "stop" and r.token in self.tokenizer.eos_token_ids):
            delta = seq.text.push(r.token)
            events.append(StreamEvent(kind="delta", text=delta.text, token_ids=[r.token]))
            if delta.stopped and reason is None:
                stopped.append(seq)  # removed from the batch after this step's loop
                return StepOutput(rid, events)
            if delta.stopped:
                reason = "stop"
        if reason is None:
            return StepOutput(rid, events)
        fin = self._finish(seq, reason, r.prompt_cache, r.all_tokens)
        fin.events[:0] = events
        return fin

    def _finish(
        self,
        seq: _Sequence,
        reason: str,
        layer_caches: list[Any] | None,
        tokens: list[int] | None,
    ) -> StepOutput:
        self._drop(seq)
        tail = seq.text.finish()
        events = [StreamEvent(kind="delta", text=tail)] if tail else []
        if self.prompt_cache is not None:
            self.prompt_cache.donate_finished_sequence_cache(
                seq.namespace, seq.request.session_key, seq.seq_id, list(tokens or []), layer_caches
            )
            self.prompt_cache.release_sequence(seq.seq_id)
        usage = {
            "prompt_tokens": len(seq.request.prompt_tokens),
            "completion_tokens": seq.completion_tokens,
            "cached_tokens": seq.cached_tokens,
        }
        events.append(StreamEvent(kind="done", finish_reason=reason, **usage))
        result = {"finish_reason": reason, "worker_id": self.worker_id, **usage}
        return StepOutput(seq.request.request_id, events, "finished", result=result)

    def _drop(self, seq: _Sequence) -> None:
        self._by_uid.pop(seq.uid, None)
        self._by_request.pop(seq.request.request_id, None)

    # -- cancel / failure ------------------------------------------------------------------

    def cancel(self, request_id: str) -> StepOutput | None:
        """Drop a request whose client went away; its KV is not donated (not a healthy finish)."""
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        self.gen.remove([seq.uid])
        self._drop(seq)
        if self.prompt_cache is not None:
            self.prompt_cache.release_sequence(seq.seq_id)
        return StepOutput(request_id, [], "cancelled", result={"finish_reason": "cancelled"})

    def _fail_all(self, error: str) -> list[StepOutput]:
        outputs = []
        for seq in list(self._by_uid.values()):
            self._drop(seq)
            if self.prompt_cache is not None:
                self.prompt_cache.release_sequence(seq.seq_id)
            outputs.append(_failed(seq.request.request_id, error, "server_error"))
        self.gen = self._new_generator()
        return outputs


def _failed(request_id: str, error: str, error_type: str) -> StepOutput:
    ev = StreamEvent(kind="error", error=error, error_type=error_type)
    return StepOutput(request_id, [ev], "failed", error=error)
