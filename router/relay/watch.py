"""One attempt's watch over its stream: relay the hub's entries in order, a read's worth at a
time, and between them notice a vanished client, a finished, failed or lost job, or the request
timeout.

The watch is a small state machine over what rq last said of the job (`Phase`); its clocks
(`last_event_at`, the next job and client checks) are fields, not loop locals.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from router.relay.attempt import Attempt, JobState, fingerprint
from router.relay.direct_lane import DirectLane
from router.relay.event_decode import decode_entry, entry_ms, error_event
from router.relay.stream_hub import Feed, RawEntry
from shared.errors import ErrorKind
from shared.wire import StreamEvent

# How long a request waits on its stream before it checks its client and its job.
IDLE_CHECK_S = 1.0
# How often (at most) a waiting request asks rq whether its job failed or its worker died.
JOB_CHECK_INTERVAL_S = 1.0
# While tokens flow, how often a request asks whether its client is still there.
CLIENT_CHECK_S = 0.05
# A worker holds a job off its queue, still `queued`, only between its take and its start (a
# burst's gathering window, milliseconds): this many job checks in a row that find it so (each
# JOB_CHECK_INTERVAL_S apart) mean the take was lost (a failover cut it short), and no worker
# will run the job.
STRANDED_CHECKS = 2

log = logging.getLogger(__name__)

JOB_FAILED = ErrorKind.JOB_FAILED

Disconnected = Callable[[], Awaitable[bool]]


class Phase(enum.Enum):
    RUNNING = "running"  # queued or started: events are awaited, the job checked now and then
    FINISHED = "finished"  # rq says done: its last event is in the stream, or was lost
    FAILED = "failed"  # rq says failed: the worker's own error may follow; a quiet wait, rq's


@dataclass
class Watch:
    """What the watch needs from the dispatcher: the job's state (blocking, run in a thread)
    and whether the stream holds entries not relayed yet."""

    attempt: Attempt
    feed: Feed
    disconnected: Disconnected | None
    in_flow: bool  # a non-streamed request: only it asks after its client while tokens flow
    request_timeout_s: float
    job_state: Callable[[], Awaitable[JobState | None]]  # None: Redis did not answer
    unread: Callable[[], Awaitable[bool]]
    lane: DirectLane | None = None  # a streamed choice's deltas relayed from the hub's callback
    phase: Phase = Phase.RUNNING
    failure: StreamEvent | None = None  # rq's failure text, relayed if no event of its own comes
    last_event_at: float = field(default_factory=time.monotonic)
    next_job_check: float = 0.0
    next_client_check: float = 0.0
    off_queue_checks: int = 0  # job checks in a row that found the job queued on no queue
    lane_takes: int = 0  # reads the lane took (a wait that ends on none of its own had some)

    def __post_init__(self) -> None:
        self.next_job_check = self.last_event_at + JOB_CHECK_INTERVAL_S
        self.next_client_check = self.last_event_at + CLIENT_CHECK_S

    async def batches(self) -> AsyncIterator[list[StreamEvent]]:
        """The events in order, each list what one stream read brought (never empty), less the
        reads of token deltas the lane relayed itself (take_direct)."""
        lane = self.lane
        wait_s = IDLE_CHECK_S
        while True:
            entries = self.feed.take()
            if not entries:
                taken = self.lane_takes
                sink = self.take_direct if lane is not None and lane.open else None
                try:
                    if await self.feed.wait(wait_s, sink):
                        entries = self.feed.take()
                except BaseException:  # cancelled (the client left): no write of the lane's
                    if lane is not None:  # goes on for nobody
                        lane.abandon()
                    raise
                if lane is not None:
                    await lane.settled()  # its last write done before any of this task's
                if not entries and self.lane_takes != taken:
                    # The lane relayed what came: the quiet checks come IDLE_CHECK_S after the
                    # last event, as when this loop relays it.
                    wait_s = max(self.last_event_at + IDLE_CHECK_S - time.monotonic(), 0.0)
                    continue
                wait_s = IDLE_CHECK_S
            now = time.monotonic()
            if entries:
                batch, end = self._read(entries)
                relayed = bool(batch)
                if relayed:
                    yield batch
                    # Nothing of this read stays bound while the next is awaited: a waiting
                    # stream would keep it alive through the young GC generation's passes.
                    batch = []
                if end:
                    return
                if relayed:
                    self.last_event_at = now
                    # A client that left is let go within a step even while tokens flow; a
                    # streamed response learns it from its next send, so only a non-streamed
                    # one asks.
                    if self.in_flow and self.disconnected and now >= self.next_client_check:
                        self.next_client_check = now + CLIENT_CHECK_S
                        if await self.disconnected():
                            return
                continue
            end_event, end = await self._quiet(now)
            if end_event is not None:
                yield [end_event]
            if end:
                return

    def take_direct(self, entries: list[RawEntry]) -> bool:
        """The feed's sink while this watch waits: a read's entries taken by the lane when each
        is the attempt's next token delta (True: relayed, or their write left to this task),
        else all of them left to the loop above, which relays or ends on them as ever (False).
        It runs in the hub's callback, so it raises nothing: what it cannot decode is the
        loop's to fail on."""
        lane = self.lane
        if lane is None or not lane.open:  # its last write still waits for the client
            return False
        try:
            events = self._next_deltas(entries)
            if events is None:
                return False
            prints = [fingerprint(event) for event in events]
        except Exception:
            log.exception("request %s: the direct lane could not take a read", self.attempt.job_id)
            return False
        self.attempt.said.extend(prints)
        self.last_event_at = time.monotonic()
        self.lane_takes += 1
        if not lane.relay(events):  # its write waits for the client, or failed: the task's now
            self.feed.wake()
        return True

    def _next_deltas(self, entries: list[RawEntry]) -> list[StreamEvent] | None:
        """The entries' events when each is the attempt's next token delta, else None."""
        seq = self.attempt.next_seq
        events: list[StreamEvent] = []
        for entry_id, fields in entries:
            event = decode_entry(fields)
            if event.kind != "delta" or event.seq != seq:
                return None
            event.written_ms = entry_ms(entry_id)
            events.append(event)
            seq += 1
        return events

    def _read(self, entries: list[RawEntry]) -> tuple[list[StreamEvent], bool]:
        """(the events of one read to relay, whether the watch ends with them)."""
        batch: list[StreamEvent] = []
        for entry_id, fields in entries:
            decoded = decode_entry(fields)
            decoded.written_ms = entry_ms(entry_id)
            event, end = self._relay(decoded)
            if event is not None:
                batch.append(event)
            if end:
                return batch, True
        return batch, False

    def _relay(self, event: StreamEvent) -> tuple[StreamEvent | None, bool]:
        """(the event to relay, whether the watch ends): a duplicate is dropped, a gap ends the
        request (the worker's own error after a gap says why the events were lost)."""
        attempt = self.attempt
        if event.seq < attempt.next_seq and event.error_type != JOB_FAILED:
            if event.seq >= 0 and attempt.said[event.seq] == fingerprint(event):
                # A write Redis applied twice, or the job run again from its start (a failover
                # lost its dequeue) with the same text so far: relayed already.
                return None, False
            # The job ran again from its start and its text went another way than what was
            # relayed: only Redis loses a job's progress, so the same retryable 503 as a gap.
            rerun = "the request ran again after Redis lost its progress, and its text differs"
            return error_event(ErrorKind.REDIS_UNAVAILABLE, f"{rerun} at event {event.seq}"), True
        if event.seq > attempt.next_seq and event.kind != "error":
            # Only Redis loses a stream's writes (a failover, a restart): retryable 503.
            missing = f"{attempt.next_seq}..{event.seq - 1}"
            lost = f"the request's stream lost events {missing}; its text is incomplete"
            return error_event(ErrorKind.REDIS_UNAVAILABLE, lost), True
        attempt.said.append(fingerprint(event))  # its seq is next_seq: the next one's is 1 more
        if event.kind == "start":
            attempt.worker_id = event.worker_id
        attempt.finished = event.kind in ("done", "error")  # the worker's own last event
        return event, False

    async def _quiet(self, now: float) -> tuple[StreamEvent | None, bool]:
        """A wait with no entry: what the client, rq and the clock say now."""
        if self.disconnected is not None and await self.disconnected():
            return None, True
        if self.phase is Phase.FINISHED and not await self.unread():
            # rq says done, nothing more came, and the stream holds nothing unread either: the
            # worker lost the end. (Unread entries: this process's reader is behind.)
            return error_event(
                JOB_FAILED, "the worker finished the job without a final event"
            ), True
        if self.phase is Phase.FAILED:  # a quiet wait after rq said failed: no event comes
            return self.failure, True
        if now - self.last_event_at >= self.request_timeout_s:
            timeout = f"no response from a worker in {self.request_timeout_s:g}s"
            return error_event(ErrorKind.TIMEOUT, timeout), True
        if now < self.next_job_check:
            return None, False
        self.next_job_check = now + JOB_CHECK_INTERVAL_S
        state = await self.job_state()
        if state is None:
            return None, False
        if state.finished:
            self.phase = Phase.FINISHED
        if state.failure is not None:
            self.phase = Phase.FAILED
            self.failure = error_event(state.failure_type, state.failure)
            return None, False
        if state.lost is not None:
            return error_event(ErrorKind.WORKER_LOST, state.lost), True
        self.off_queue_checks = self.off_queue_checks + 1 if state.off_queue else 0
        if self.off_queue_checks >= STRANDED_CHECKS:
            # The same answer as a lost worker: its attempt is fenced (cancel flag) and, while
            # no token reached the client, the request runs again under a new job id.
            stranded = "the job left its queue but never started (a Redis failover lost its take)"
            return error_event(ErrorKind.WORKER_LOST, stranded), True
        return None, False
