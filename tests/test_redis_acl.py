"""The embedded Redis runs the pool as an ACL user without Redis's dangerous commands (issue 19:
one `SLAVEOF` from a password holder made a worker exit): the pool's user is refused every
`@dangerous` command but the few rq and redis-py send, the admin user is never what a child gets,
and a whole pool (router, worker, dashboard) serves on the pool's user with no command refused.
Real redis-servers, a real pool."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mlxcel_pool.redis_server import (
    ADMIN_USER,
    DISABLED_COMMANDS,
    POOL_USER,
    EmbeddedRedis,
    acl_config,
    free_port,
    start_redis,
)
from shared import keys

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent
# The @dangerous commands (and CLIENT subcommands) the pool's user keeps, and why: rq reads the
# server's version (INFO), names its connection and finds its own address (CLIENT SETNAME, LIST);
# redis-py sends CLIENT SETINFO (Redis 7.2+) and MAINT_NOTIFICATIONS (RESP3) on every connection.
ALLOWED_DANGEROUS = {"info"}
ALLOWED_CLIENT = {"setname", "list", "setinfo", "maint_notifications"}
# What a password holder once did, and what else must never be the pool's to send.
REFUSED = [
    ("SLAVEOF", "127.0.0.1", "1"),
    ("REPLICAOF", "127.0.0.1", "1"),
    ("SLAVEOF", "NO", "ONE"),
    ("DEBUG", "SLEEP", "0"),
    ("DEBUG", "SEGFAULT"),
    ("ACL", "LIST"),
    ("ACL", "SETUSER", POOL_USER, "+@all"),
    ("FLUSHALL",),
    ("FLUSHDB",),
    ("SHUTDOWN", "NOSAVE"),
    ("CONFIG", "SET", "dir", "/tmp"),
    ("CONFIG", "GET", "dir"),
    ("KEYS", "*"),
    ("MONITOR",),
    ("SAVE",),
    ("BGSAVE",),
    ("BGREWRITEAOF",),
    ("MIGRATE", "127.0.0.1", "1", "k", "0", "1"),
    ("RESTORE", "k", "0", "x"),
    ("SWAPDB", "0", "1"),
    ("CLIENT", "KILL", "127.0.0.1:1"),
    ("CLIENT", "PAUSE", "1000"),
    ("FAILOVER",),
    ("ROLE",),
    ("SORT", "k"),
]


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    server = start_redis()  # its own server: its ACL LOG holds this test's refusals only
    yield server
    server.stop()


def _refused(client: redis.Redis, *command: str) -> bool:
    try:
        client.execute_command(*command)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_the_pools_user_is_refused_every_dangerous_command_but_the_few_it_needs(
    own_redis: EmbeddedRedis,
) -> None:
    pool = redis.Redis.from_url(own_redis.url, socket_timeout=5)
    admin = redis.Redis.from_url(own_redis.admin_url, socket_timeout=5, decode_responses=True)
    assert own_redis.url.startswith(f"redis://{POOL_USER}:{own_redis.password}@127.0.0.1:")
    assert own_redis.admin_url.startswith(f"redis://{ADMIN_USER}:{own_redis.admin_password}@")
    pool.set("k", "v")
    for command in REFUSED:
        assert _refused(pool, *command), command
    # Each @dangerous command, with as many dummy arguments as its arity asks (Redis checks the
    # arity before the ACL): refused unless the pool needs it.
    for name in admin.acl_cat("dangerous"):
        if name.upper() in DISABLED_COMMANDS:  # renamed away: no user can run it
            with pytest.raises(redis.ResponseError, match="unknown command"):
                pool.execute_command(name, "LIST")
            continue
        arity = int(admin.execute_command("COMMAND", "INFO", name)[name]["arity"])
        args = ["x"] * (arity - 1 if arity > 0 else -arity - 1)
        assert _refused(pool, name, *args) == (name not in ALLOWED_DANGEROUS), name
    for sub in ("kill", "pause", "unpause", "reply", "tracking", "no-evict", "id", "getname"):
        assert _refused(pool, "CLIENT", sub.upper(), "x", "x"), sub
    assert pool.client_setname("mlxcel-test") and pool.client_list()
    assert pool.info("server")["redis_version"]
    # Still a primary with its data: nothing the pool's user sent changed the server.
    assert admin.execute_command("ROLE")[0] == "master" and pool.get("k") == b"v"
    assert admin.config_get("dir")["dir"] == own_redis.workdir
    # `default` is off: a client that names no user is refused, whatever password it sends.
    for password in (own_redis.password, own_redis.admin_password):
        with pytest.raises(redis.AuthenticationError):  # asked once: no retry's backoff
            refused = redis.Redis(
                port=own_redis.port,
                password=password,
                socket_timeout=5,
                retry=Retry(NoBackoff(), 0),
            )
            refused.ping()
    assert own_redis.admin_password != own_redis.password
    config = acl_config(own_redis.password, own_redis.admin_password)
    assert {w.removeprefix("+client|") for w in config.split() if w.startswith("+client|")} == (
        ALLOWED_CLIENT
    )


def _dashboard(redis_url: str, log: Path) -> subprocess.Popen[bytes]:
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlxcel_pool", "dashboard", "--port", str(port)],
            cwd=REPO,
            env={**os.environ, "REDIS_URL": redis_url},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    proc.base = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{proc.base}/", timeout=2).status_code == 200:  # type: ignore[attr-defined]
                return proc
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(log.read_text()[-4000:])
        time.sleep(0.1)


def _refusals(admin: redis.Redis) -> list[dict[str, Any]]:
    """What the server refused the pool's user (ACL LOG), as (reason, command or key)."""
    return [
        {"reason": e["reason"], "object": e["object"], "context": e["context"]}
        for e in admin.acl_log()
        if e["username"] == POOL_USER
    ]


def test_a_whole_pool_serves_on_the_pools_user_with_no_command_refused(
    own_redis: EmbeddedRedis, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from tests.pool_fixture import running_pool

    admin = redis.Redis.from_url(own_redis.admin_url, socket_timeout=5, decode_responses=True)
    overrides = {"redis": {"url": own_redis.url}}
    with running_pool(tiny_model_dir, tmp_path, overrides=overrides) as pool:
        model = httpx.get(f"{pool.url}/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 6}
        resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        streamed = httpx.post(
            f"{pool.url}/v1/completions", json={**body, "stream": True}, timeout=60
        )
        assert streamed.status_code == 200 and "[DONE]" in streamed.text, streamed.text
        # rq found the worker's address with CLIENT LIST (it writes "unknown" when refused).
        rq_worker = f"rq:worker:{keys.rq_worker_name('w1')}"
        assert admin.hget(rq_worker, "ip_address") not in (None, "unknown")

        dash = _dashboard(own_redis.url, tmp_path / "dashboard.log")
        try:
            base = dash.base  # type: ignore[attr-defined]
            for path in ("/0/data/queues.json", "/0/data/workers.json", "/0/view/workers"):
                assert httpx.get(f"{base}{path}", timeout=10).status_code == 200, path
        finally:
            dash.terminate()
            dash.wait(10)
        assert _refusals(admin) == []

        # What made a worker exit once: refused, and the pool serves on, from the same primary.
        pool_client = redis.Redis.from_url(own_redis.url, socket_timeout=5)
        assert _refused(pool_client, "SLAVEOF", "127.0.0.1", str(free_port()))
        assert admin.execute_command("ROLE")[0] == "master"
        resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert pool.failures() == []
    logs = list((tmp_path / "logs").glob("*.log"))
    assert logs and not any(own_redis.admin_password in p.read_text(errors="replace") for p in logs)
