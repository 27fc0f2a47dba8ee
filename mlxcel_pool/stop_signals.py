"""How the long-running commands (`up`, `redis`, `stats --watch`) stop on SIGINT and SIGTERM."""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from typing import Any


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C inside the block; both are ignored during the cleanup after
    it, so a second signal cannot cut the shutdown of the children short. SIGINT is set
    explicitly: a process started in the background by a shell inherits it as ignored."""
    signal.signal(signal.SIGINT, _raise_interrupt)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class SignalStop:
    """`Pool.supervise`'s stop flag, set by SIGINT/SIGTERM: the handler only stores the signal's
    name (no lock it could deadlock on, unlike threading.Event), so a signal never raises in the
    middle of a child's restart."""

    def __init__(self) -> None:
        self.signal_name = ""

    def wait(self, timeout: float) -> bool:
        if not self.signal_name:
            time.sleep(timeout)  # a signal's handler runs, then the sleep finishes
        return bool(self.signal_name)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    @contextlib.contextmanager
    def installed(self) -> Iterator[SignalStop]:
        previous = {
            sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
