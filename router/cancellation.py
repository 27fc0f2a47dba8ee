"""A background loop's check that it was asked to stop.

Python 3.11's `asyncio.wait_for` (redis-py's asyncio client sends every command through it) can
swallow a cancel that lands as the send completes: the task runs on with its cancel request
counted (`Task.cancelling()`) but never raised. A loop that only a cancel ends calls
`stop_if_cancelled()` once a pass, so its owner's stop() never waits on it for ever.
"""

from __future__ import annotations

import asyncio


def stop_if_cancelled() -> None:
    """Raise CancelledError in a task whose cancel was asked for and swallowed."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
