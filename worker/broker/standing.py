"""A worker's standing: what Redis shows of its registration when it comes back, and how long
Redis went without hearing from it, so that it can say in one line what happened (cut off, found
dead by a peer, Redis restarted or flushed, a registration that lapsed) and only then register
again (which deletes the reaped claim it reads here). worker.broker.presence reads both.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from shared import keys


@dataclass(frozen=True)
class Standing:
    """The worker's registration as Redis shows it now, read before registering again (which
    deletes the reaped claim), and what it says happened meanwhile."""

    reaped_by: str  # the peer whose reaper found this worker dead; "" when none did
    reaped_reason: str
    server_changed: bool  # Redis's run_id is not the one at the last arrive: restart, failover
    info: bool  # the liveness hash exists
    roster: bool  # in the pool's roster, a set without TTL that only a flush removes
    rq_listed: bool  # rq's record has its birth, no death, and is in rq's worker set

    @property
    def whole(self) -> bool:
        return not (self.reaped_by or self.server_changed) and (
            self.info and self.roster and self.rq_listed
        )

    @property
    def data_lost(self) -> bool:
        """Redis itself lost the pool's keys (a restart, a failover, a flush): the one case
        where the block index is gone because Redis lost it."""
        return self.server_changed or not self.roster

    def what_happened(self) -> str:
        if self.reaped_by:
            return f"found dead by a peer, {self.reaped_by} ({self.reaped_reason})"
        if self.server_changed:
            return "Redis restarted or failed over meanwhile (a new run_id)"
        if not self.roster:
            return "Redis was flushed meanwhile (the pool's roster is gone)"
        if not self.info:
            return (
                f"its liveness hash lapsed (no heartbeat reached Redis for "
                f"{keys.LIVENESS_TTL_S}s) and no live peer found it dead"
            )
        if not self.rq_listed:
            return "rq no longer listed it (its rq record lapsed or was retired)"
        return "its registration is whole"


@dataclass(frozen=True)
class Silence:
    """How long the heartbeat thread went without hearing Redis, since the last `take_silence`."""

    unheard_s: float  # the longest stretch without a beat that landed (now included)
    no_reply_s: float  # the longest one call waited (one still waiting included)
    failed_calls: int  # calls that ended in a Redis error (a timeout, a refused connection)
    stuck_s: float  # the loop's longest age seen while the thread held its beats (0: never)

    def describe(self, lost_for_s: float | None = None) -> str:
        """Why Redis did not hear from the worker: cut off, stuck, or not running at all.
        `lost_for_s`: how long the loop's own calls failed (it knows it was cut off, whatever
        the heartbeat's calls saw)."""
        unheard = max(self.unheard_s, lost_for_s or 0.0)
        if self.stuck_s:
            return f"its loop was stuck for {self.stuck_s:.0f}s (no heartbeat for {unheard:.0f}s)"
        cut_off = self.failed_calls or self.no_reply_s >= 2 * keys.HEARTBEAT_INTERVAL_S
        if lost_for_s is not None or cut_off:
            return f"it was cut off from Redis for {unheard:.0f}s"
        return f"it did not run for {unheard:.0f}s (stopped, or starved of CPU)"


def redis_run_id(connection: redis.Redis) -> str:
    """The Redis server's run_id (new at each start: a restart or a failover changes it); ""
    where INFO is refused (an ACL without it): a restart is then told by its lost keys only."""
    try:
        return str(connection.info("server").get("run_id", ""))
    except redis.ResponseError:
        return ""
