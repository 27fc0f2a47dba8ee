"""A built worker loop run to its end: signals, the ready line, the loop; a generation worker
and an embedding worker start the same way once built."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

from shared.config import EXIT_CONFIG
from shared.gc_freeze import freeze_startup_heap


class _Presence(Protocol):
    worker_id: str


class _Intake(Protocol):
    @property
    def queue_keys(self) -> Sequence[str]: ...


class ServedLoop(Protocol):
    presence: _Presence
    intake: _Intake
    banner: str

    def install_signal_handlers(self) -> None: ...

    def run(self) -> None: ...


def serve(loop: ServedLoop, log: logging.Logger) -> int:
    """0 after a stop; EXIT_CONFIG when another live worker holds this worker's id."""
    from worker.broker.presence import WorkerIdInUse

    loop.install_signal_handlers()
    freeze_startup_heap(log)
    log.info(
        "worker %s ready: %s; listening on %s",
        loop.presence.worker_id,
        loop.banner,
        ", ".join(loop.intake.queue_keys),
    )
    try:
        loop.run()
    except WorkerIdInUse as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    return 0
