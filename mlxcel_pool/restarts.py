"""When the supervisor restarts a child that exited, when it gives up, and where each worker's
restart is counted.

The policy is pure bookkeeping with the clock passed in (`now`), so it is tested without
processes: each child's restart times within a sliding window decide both the backoff and the
crash loop. `count_restart` is the one write: the pool-wide counter in Redis that every host's
supervisor adds to and the routers serve (`mlxcel_worker_restarts_total{worker}`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import redis

from shared import keys
from shared.config import RedisConfig, SupervisorConfig
from shared.redis_clients import sync_client

# The counter's write is one short-lived connection bounded by this: a Redis that does not
# answer costs supervision no more than that.
COUNT_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class RestartPolicy:
    # A child restarted `limit` times within `window_s` that exits again is a crash loop.
    limit: int = 5
    window_s: float = 60.0
    # The first restart waits `backoff_s`; each earlier restart still in the window doubles it.
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0

    @classmethod
    def from_config(cls, cfg: SupervisorConfig) -> RestartPolicy:
        return cls(
            cfg.restart_limit,
            cfg.restart_window_s,
            cfg.restart_backoff_s,
            cfg.restart_backoff_max_s,
        )

    def delay_s(self, earlier: int) -> float:
        """The wait before a restart that follows `earlier` restarts within the window."""
        return min(self.backoff_max_s, self.backoff_s * 2.0**earlier)


@dataclass(frozen=True)
class RestartDecision:
    """What to do about one exit: restart after `delay_s`, or give up (a crash loop)."""

    child: str
    restart: bool
    delay_s: float
    # Restarts of this child within the last `window_s`, this one included when `restart` is True.
    recent: int
    window_s: float

    def message(self, exit_text: str) -> str:
        """The log line for this decision about an exit described by `exit_text` (`code 2`)."""
        within = f"in the last {self.window_s:g} s"
        if self.restart:
            return (
                f"{self.child} exited with {exit_text}; restarting in {self.delay_s:g} s "
                f"(restart {self.recent} {within})"
            )
        return (
            f"{self.child} exited with {exit_text} after {self.recent} restart(s) {within}: "
            "crash loop, stopping the pool"
        )


class RestartLedger:
    """Restart times per child; `decide` records the restart it allows."""

    def __init__(self, policy: RestartPolicy) -> None:
        self.policy = policy
        self._times: dict[str, deque[float]] = {}

    def decide(self, child: str, now: float) -> RestartDecision:
        times = self._recent(child, now)
        if len(times) >= self.policy.limit:
            return RestartDecision(child, False, 0.0, len(times), self.policy.window_s)
        delay = self.policy.delay_s(len(times))
        times.append(now)
        return RestartDecision(child, True, delay, len(times), self.policy.window_s)

    def recent(self, child: str, now: float) -> int:
        return len(self._recent(child, now))

    def _recent(self, child: str, now: float) -> deque[float]:
        times = self._times.setdefault(child, deque())
        while times and now - times[0] >= self.policy.window_s:
            times.popleft()
        return times


def count_restart(config: RedisConfig, worker_id: str) -> str | None:
    """HINCRBY the pool's restart counter of `worker_id` on a connection of its own; None, or
    why the write failed (the caller logs it and supervises on: a count is never worth a
    restart)."""
    try:
        client = sync_client(config.model_copy(update={"stall_timeout_s": COUNT_TIMEOUT_S}))
        try:
            client.hincrby(keys.supervisor_restarts(), worker_id, 1)
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError) as exc:
        return str(exc)
    return None
