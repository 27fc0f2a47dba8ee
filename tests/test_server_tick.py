"""uvicorn's server loop as router.edge.server_tick runs it: a pass a second that still refreshes
the Date header every second, and a signal that ends the server at once (not at the next pass)."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import pytest
import uvicorn

from mlxcel_pool.redis_server import free_port
from router.edge import server_tick


async def _app(scope: dict, receive: object, send: object) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


def _serve(
    monkeypatch: pytest.MonkeyPatch, pass_s: float
) -> tuple[uvicorn.Server, str, threading.Thread]:
    monkeypatch.setattr(server_tick, "PASS_S", pass_s)
    server_tick.install()
    port = free_port()
    config = uvicorn.Config(_app, port=port, lifespan="off", log_level="warning", loop="uvloop")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return server, f"http://127.0.0.1:{port}", thread


def test_a_signal_ends_the_server_without_waiting_for_the_next_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, url, thread = _serve(
        monkeypatch, pass_s=3600.0
    )  # a pass an hour: only the wake ends it
    assert httpx.get(url).text == "ok"
    server.handle_exit(signal.SIGTERM, None)
    thread.join(30)
    assert not thread.is_alive()


def test_the_date_header_is_still_refreshed_every_second(monkeypatch: pytest.MonkeyPatch) -> None:
    server, url, thread = _serve(monkeypatch, pass_s=server_tick.PASS_S)
    try:
        first = httpx.get(url).headers["date"]
        dates = {first}
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
