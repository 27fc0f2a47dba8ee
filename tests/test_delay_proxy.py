"""tests/drivers/delay_proxy.c, the round trip bench_multihost simulates, against a real Redis: it
holds each direction for its delay, keeps bytes and their order, passes a close on, and lets go
of a connection once both sides have closed."""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from mlxcel_pool.redis_server import EmbeddedRedis
from tests.drivers.netns import build_delay_proxy

ONE_WAY_MS = 0.5  # a 1 ms round trip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def proxied(
    redis_server: EmbeddedRedis, redis_url: str, tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """The pool's Redis URL through a delay proxy at ONE_WAY_MS each way, and the proxy."""
    delay = tmp_path / "delay"
    delay.write_text(f"{ONE_WAY_MS:g}")
    port = _free_port()
    argv = [str(build_delay_proxy(tmp_path)), "127.0.0.1", str(port)]
    argv += ["127.0.0.1", str(redis_server.port), str(delay)]
    proc = subprocess.Popen(argv)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.05)
        parts = urlsplit(redis_url)
        netloc = parts.netloc.rsplit(":", 1)[0] + f":{port}"
        yield urlunsplit(parts._replace(netloc=netloc)), proc
    finally:
        proc.kill()
        proc.wait()


def _fds(proc: subprocess.Popen[bytes]) -> int:
    return len(os.listdir(f"/proc/{proc.pid}/fd"))


def _settled_fds(proc: subprocess.Popen[bytes]) -> int:
    """The proxy's open files once unchanged for half a second (the fixture's readiness probe
    was a connection too)."""
    last, since = _fds(proc), time.monotonic()
    while time.monotonic() - since < 0.5:
        time.sleep(0.05)
        if (now := _fds(proc)) != last:
            last, since = now, time.monotonic()
    return last


def test_each_round_trip_takes_at_least_the_delay_both_ways(
    proxied: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, _ = proxied
    r = redis.Redis.from_url(url)
    r.ping()
    took = []
    for _ in range(50):
        start = time.perf_counter()
        r.ping()
        took.append(time.perf_counter() - start)
    assert min(took) >= 2 * ONE_WAY_MS / 1000


def test_bytes_order_and_a_blocked_read_pass_through_unchanged(
    proxied: tuple[str, subprocess.Popen[bytes]],
) -> None:
    url, _ = proxied
    r = redis.Redis.from_url(url)
    big = os.urandom(5 * 1024 * 1024)  # many reads and partial writes a direction
    r.set("big", big)
    assert hashlib.sha1(r.get("big")).digest() == hashlib.sha1(big).digest()  # type: ignore[arg-type]
    with r.pipeline(transaction=False) as pipe:
        for i in range(5000):
            pipe.set(f"k{i}", i)
            pipe.get(f"k{i}")
        replies = pipe.execute()
    assert replies[1::2] == [str(i).encode() for i in range(5000)]
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(redis.Redis.from_url(url).blpop("q", 5)))
    waiter.start()
    time.sleep(0.3)
    r.rpush("q", "v")
    waiter.join()
    assert got == [(b"q", b"v")]


def _resp(*args: str) -> bytes:
    return b"".join(
        [f"*{len(args)}\r\n".encode()] + [f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args]
    )


def test_a_close_on_either_side_is_passed_on_and_the_connection_let_go(
    proxied: tuple[str, subprocess.Popen[bytes]], redis_server: EmbeddedRedis
) -> None:
    url, proc = proxied
    port = urlsplit(url).port
    base = _settled_fds(proc)
    clients = [redis.Redis.from_url(url) for _ in range(10)]
    for c in clients:
        c.ping()
    raw = [socket.create_connection(("127.0.0.1", port)) for _ in range(10)]
    hello = _resp("AUTH", str(redis_server.username), redis_server.password) + _resp("PING")
    for s in raw:
        s.settimeout(5)
        s.sendall(hello)
        got = b""
        while not got.endswith(b"+PONG\r\n"):
            got += s.recv(100)
    assert _fds(proc) == base + 40  # each client and its connection to Redis
    for c in clients:
        c.close()  # the client side closes first
    admin = redis.Redis.from_url(redis_server.admin_url)
    admin.client_kill_filter(_type="normal", skipme=True)  # Redis closes the rest first
    for s in raw:
        assert s.recv(100) == b""  # the close reached the client, after the data before it
        s.close()
    deadline = time.monotonic() + 5
    while _fds(proc) != base and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _fds(proc) == base
