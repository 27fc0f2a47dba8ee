"""uvicorn's server loop, waking once a second instead of ten times.

uvicorn's `Server.main_loop` sleeps 0.1 s between looks at its shutdown flag and its once-a-second
Date header. Every wake of an idle process costs CPU (most of it the kernel's, on a VM), and on a
machine whose cores a worker's model threads fill, it is time taken from a decode step. Here the
loop looks once a second (the Date header is refreshed as often as before), and a signal wakes it
at once, so a shutdown starts as promptly as with uvicorn's own loop.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from contextlib import suppress
from types import FrameType

from uvicorn.server import HANDLED_SIGNALS, Server

# uvicorn's on_tick counts tenths of a second (the Date header every tenth count).
TICKS_A_PASS = 10
PASS_S = 1.0

_uvicorn_handle_exit = Server.handle_exit


async def _main_loop(self: Server) -> None:
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    self._mlxcel_wake = (loop, wake)  # type: ignore[attr-defined]
    _handle_signals_here(self)
    counter = 0
    should_exit = await self.on_tick(counter)
    while not should_exit:
        counter = (counter + TICKS_A_PASS) % 864000
        with suppress(TimeoutError):
            async with asyncio.timeout(PASS_S):
                await wake.wait()
        wake.clear()
        should_exit = await self.on_tick(counter)


def _handle_exit(self: Server, sig: int, frame: FrameType | None) -> None:
    _uvicorn_handle_exit(self, sig, frame)
    woken = getattr(self, "_mlxcel_wake", None)
    if woken is not None:  # a signal handler: the thread-safe call is the safe one here
        loop, wake = woken
        loop.call_soon_threadsafe(wake.set)


def _handle_signals_here(server: Server) -> None:
    """uvicorn registers the server's handle_exit for its signals before it loads the app (whose
    factory installs this module), so the handler it holds is its own: point each at ours. It
    puts the process's own handlers back when the server ends, as before."""
    if threading.current_thread() is not threading.main_thread():
        return  # uvicorn registers no handler off the main thread
    for sig in HANDLED_SIGNALS:
        if getattr(signal.getsignal(sig), "__self__", None) is server:
            signal.signal(sig, server.handle_exit)


def install() -> None:
    """Every uvicorn Server of this process runs the loop above (uvicorn makes its own Server in
    each worker process, so each process's app factory installs it)."""
    Server.main_loop = _main_loop  # type: ignore[method-assign]
    Server.handle_exit = _handle_exit  # type: ignore[method-assign]
