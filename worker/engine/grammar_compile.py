"""Grammars compiled off the loop, once each.

A request's grammar (its `response_format`) compiles to an llguidance matcher, which for a
large schema takes long enough to pause every running stream if done in the loop, and the `n`
choices of a request (and any request with the same grammar) all carry the same grammar text.
`GrammarCompiler` compiles each distinct grammar text once, as a job on an injected executor
(by default one worker thread: llguidance drops the GIL while it compiles, so the loop's steps
go on meanwhile), and keeps the compiled matcher, in its start state, for the next requests:
each sequence then gets its own `deep_copy` of it (a copy shares the compiled grammar).

A request whose matcher is not compiled yet waits in `GrammarWaits` (status COMPILING, its slot
held, as a group-mate waits in `Holds`) while the others decode; the engine starts it on the
first step after its compile is done. A grammar that does not compile fails the requests that
carry it, alone, as the caller's error (GrammarError), as before.
"""

from __future__ import annotations

import concurrent.futures
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any, TypeVar

from llguidance import LLMatcher

from shared.wire import GenerationRequest
from worker.engine.grammar import GrammarConstraint, GrammarError, GrammarTokenizer
from worker.engine.request import Request, RequestStatus

# Compiled grammars kept for the requests that come next with the same text (least recently
# used out first).
COMPILED_GRAMMARS = 32

T = TypeVar("T")


class InlineExecutor(Executor):
    """Runs each job as it is submitted, in the caller's thread: compiles in the loop, as the
    engine did before (tests, and tools with no running streams to keep going)."""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the caller reads it from the future, as from a thread
            future.set_exception(exc)
        return future


def grammar_thread() -> Executor:
    """The default executor: one thread, so compiles run one at a time, oldest first."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxcel-grammar")


class GrammarCompiler:
    """Each distinct grammar text compiled once, on `executor`; the last COMPILED_GRAMMARS
    kept. Only the engine's thread calls its methods; only the executor runs `_compile`."""

    def __init__(
        self,
        tokenizer: GrammarTokenizer,
        executor: Executor | None = None,
        capacity: int = COMPILED_GRAMMARS,
    ) -> None:
        self.tokenizer = tokenizer
        self.executor = executor if executor is not None else grammar_thread()
        self.capacity = max(capacity, 1)
        self.compiles = 0  # compile jobs submitted (a cached or pending grammar adds none)
        self._compiled: OrderedDict[str, Future[LLMatcher]] = OrderedDict()

    def compile(self, grammar: str) -> Future[LLMatcher]:
        """The compile of `grammar`: the one already done or under way, else a new job."""
        future = self._compiled.get(grammar)
        if future is not None:
            self._compiled.move_to_end(grammar)
            return future
        self.compiles += 1
        future = self.executor.submit(self.tokenizer.compile, grammar)
        self._compiled[grammar] = future
        while len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)
        return future

    def constraint(self, compiled: Future[LLMatcher], spec: GenerationRequest) -> GrammarConstraint:
        """A sequence's own constraint from its grammar's finished compile; GrammarError when
        the grammar does not compile. A compile that failed otherwise is forgotten, so the
        next request with that grammar compiles it again."""
        try:
            template = compiled.result(timeout=0)
        except GrammarError:
            raise
        except Exception:
            if spec.grammar is not None and self._compiled.get(spec.grammar) is compiled:
                del self._compiled[spec.grammar]
            raise
        return GrammarConstraint(
            template.deep_copy(),
            self.tokenizer.get(),
            len(spec.prompt_tokens),
            self.tokenizer.vocab_size,
        )


class GrammarWaits:
    """Requests waiting for their grammar's compile, in arrival order."""

    def __init__(self) -> None:
        self._waiting: list[tuple[Request, Future[LLMatcher]]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[Request]:
        return iter([req for req, _ in self._waiting])

    def wait(self, req: Request, compiled: Future[LLMatcher]) -> None:
        req.status = RequestStatus.COMPILING
        self._waiting.append((req, compiled))

    def ready(self) -> list[tuple[Request, Future[LLMatcher]]]:
        """The requests whose compile is done (or failed), in arrival order, no longer held."""
        done: list[tuple[Request, Future[LLMatcher]]] = []
        waiting: list[tuple[Request, Future[LLMatcher]]] = []
        for pair in self._waiting:  # one read of each future: a compile may end meanwhile
            (done if pair[1].done() else waiting).append(pair)
        self._waiting = waiting
        for req, _ in done:
            req.status = RequestStatus.PREFILLING
        return done

    def drop(self, req: Request) -> bool:
        kept = [(r, f) for r, f in self._waiting if r is not req]
        dropped = len(kept) < len(self._waiting)
        self._waiting = kept
        return dropped

    def block(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for one compile to end (when nothing else has work)."""
        pending = {f for _, f in self._waiting}
        if pending:
            concurrent.futures.wait(
                pending, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
            )
