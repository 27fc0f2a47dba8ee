"""The worker's outbox: the one owner of the in-flight publish.

At most one step's writes are in flight at a time, in step order, so the Redis round trip
overlaps the next decode step instead of adding to it. A steady step (the step script alone) is
written by the loop's own thread and its reply read after the next step (`Publisher.send`):
no thread is woken for it. Any other step (block index, job ends, the beat) goes to the
publisher thread whole. What a publish read back (cancels, control commands, queue depth) is
kept until the loop takes it, merged if a second publish lands first, so nothing read is ever
dropped. A Redis error of a publish is raised on the loop's thread, at its next call here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from worker.broker.publisher import Publisher, PublishResult, SentStep, StepWrites


class Outbox:
    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="publish")
        self._inflight: Future[PublishResult] | SentStep | None = None
        self._reads: PublishResult | None = None

    def send(self, writes: StepWrites) -> None:
        """Send one step's writes (after the previous publish landed)."""
        self.settle()
        sent = self.publisher.send(writes)
        self._inflight = sent or self._executor.submit(self.publisher.publish, writes)

    def settle(self) -> None:
        """Wait until the in-flight publish has landed; its reads wait for `take_reads`."""
        if self._inflight is None:
            return
        inflight, self._inflight = self._inflight, None
        got = inflight.result()
        self._reads = got if self._reads is None else self._reads.merge(got)

    def take_reads(self) -> PublishResult | None:
        """What the publishes since the last call read back (None: nothing was sent)."""
        self.settle()
        reads, self._reads = self._reads, None
        return reads

    def answered(self) -> None:
        """The worker registered again: what the reads held so far said of its standing (a
        reaped claim, a lost block index) was read before that, and is answered; their cancels,
        commands and queue depth still wait for `take_reads`."""
        if self._reads is not None:
            self._reads.reaped = self._reads.index_lost = False

    def after(self, task: Callable[[], None]) -> Future[None]:
        """Run a Redis chore on the publisher thread, after what is queued there."""
        return self._executor.submit(task)

    def abandon(self) -> None:
        """Forget what was in flight: its connection is gone (the loop is reconnecting)."""
        if isinstance(self._inflight, SentStep):
            self._inflight.drop()
        self._inflight, self._reads = None, None

    def close(self) -> None:
        if isinstance(self._inflight, SentStep):
            self._inflight.drop()
            self._inflight = None
        self._executor.shutdown(wait=True)
