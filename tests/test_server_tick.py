"""uvicorn's server loop as router.edge.server_tick runs it: a pass a second that still refreshes
the Date header every second, and a real signal that ends the server at once (not at the next
pass), though uvicorn registered its handler before the app's factory installed the loop."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from uvicorn.server import Server

from mlxcel_pool.redis_server import free_port
from router.edge import server_tick

REPO = Path(__file__).resolve().parents[1]

# A server as `mlxcel-pool router` runs one: the app from a factory that installs the loop (so
# after uvicorn registered its signal handlers), with a pass an hour: only the signal's own wake
# can end it within the test.
SERVED = """
import sys
import uvicorn
from router.edge import server_tick

server_tick.PASS_S = 3600.0

def create():
    server_tick.install()

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app

uvicorn.run(create, factory=True, port=int(sys.argv[1]), lifespan="off", log_level="warning")
"""


async def _app(scope: dict, receive: object, send: object) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


def _wait_http(url: str, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "the server did not start"
        assert proc is None or proc.poll() is None, "the server exited"
        try:
            if httpx.get(url).text == "ok":
                return
        except httpx.HTTPError:
            time.sleep(0.1)


def test_a_signal_ends_the_server_without_waiting_for_the_next_pass() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", SERVED, str(port)], cwd=REPO)
    try:
        _wait_http(f"http://127.0.0.1:{port}", proc)
        proc.send_signal(signal.SIGTERM)
        # uvicorn shuts down, then raises the signal it caught again (the process's default).
        assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_the_date_header_is_still_refreshed_every_second(monkeypatch: pytest.MonkeyPatch) -> None:
    # uvicorn's own loop comes back after the test, for the rest of the session.
    monkeypatch.setattr(Server, "main_loop", Server.main_loop)
    monkeypatch.setattr(Server, "handle_exit", Server.handle_exit)
    server_tick.install()
    port = free_port()
    config = uvicorn.Config(_app, port=port, lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_http(url)
        dates = {httpx.get(url).headers["date"]}
        # Eight seconds: a date refreshed each second shows about eight, one refreshed every
        # ten seconds (a pass counted as a tenth) one or two.
        deadline = time.monotonic() + 8
        while len(dates) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
            dates.add(httpx.get(url).headers["date"])
        assert len(dates) >= 3
    finally:
        server.should_exit = True
        thread.join(30)
