"""The `apc_event=` trace: one INFO line per store, adopt and reject, in the spec's format.

Whether it is on is decided once, when the cache is built (config.trace, itself read once from
MLXCEL_APC_TRACE); when off the cache binds the no-op methods, so events pay one empty call.
"""

from __future__ import annotations

import logging

from shared.reject import RejectReason

LOGGER_NAME = "mlxcel.prompt_cache"
_log = logging.getLogger(LOGGER_NAME)


class Tracer:
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id

    def store(self, seq_id: str | None, matched_len: int, snapshot: bool = False) -> None:
        _log.info(
            "prompt-cache store%s apc_event=store seq_id=%s matched_len=%d worker=%s",
            " (snapshot)" if snapshot else "",
            seq_id,
            matched_len,
            self.worker_id,
        )

    def adopt(self, seq_id: str, matched_len: int, total_tokens: int, snapshot: bool) -> None:
        _log.info(
            "prompt-cache adopt%s apc_event=adopt seq_id=%s matched_len=%d total_tokens=%d "
            "worker=%s",
            " (snapshot)" if snapshot else "",
            seq_id,
            matched_len,
            total_tokens,
            self.worker_id,
        )

    def reject(self, reason: RejectReason, seq_id: str | None, context_len: int) -> None:
        _log.info(
            "prompt-cache reject apc_event=reject reason=%s seq_id=%s context_len=%d worker=%s",
            reason.value,
            seq_id,
            context_len,
            self.worker_id,
        )


class NullTracer(Tracer):
    """Trace off: every event is a no-op."""

    def store(self, seq_id: str | None, matched_len: int, snapshot: bool = False) -> None:
        return None

    def adopt(self, seq_id: str, matched_len: int, total_tokens: int, snapshot: bool) -> None:
        return None

    def reject(self, reason: RejectReason, seq_id: str | None, context_len: int) -> None:
        return None


def make_tracer(enabled: bool, worker_id: str) -> Tracer:
    return Tracer(worker_id) if enabled else NullTracer(worker_id)
