"""REDIS_URL naming a Sentinel-managed primary (`redis+sentinel://`): the URL parsed, validated
and masked; the pool's clients following a failover; and the whole pool failed over under load,
first by `SENTINEL FAILOVER` (the old primary stays up), then by SIGKILL of the new primary. Real
parts only: a primary, two replicas and a sentinel, each a redis-server of its own."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from rq.utils import utcparse

from mlxcel_pool.redis_server import POOL_USER, EmbeddedRedis, start_redis, start_sentinel
from router.redis_batch import RedisBatch
from shared import keys
from shared.config import ConfigError, RedisConfig, load_settings
from shared.redis_auth import MASK, masked_url
from shared.redis_clients import FOLLOW_S, async_client, sync_client
from shared.redis_sentinel import (
    DEFAULT_PORT,
    SentinelTarget,
    parse_sentinel_url,
    sentinel_url,
)

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent
SERVICE = "mlxcel-primary"
SECRET = "s3cr3t-Pa55"

# -- the URL ---------------------------------------------------------------------------------


def test_a_sentinel_url_names_sentinels_service_db_and_both_passwords() -> None:
    url = (
        f"redis+sentinel://:{SECRET}@10.0.0.1:26380,sentinel-b,[::1]:26381/{SERVICE}/3"
        "?sentinel_password=sp%40ss&sentinel_username=watcher"
    )
    target = parse_sentinel_url(url)
    assert target == SentinelTarget(
        sentinels=(("10.0.0.1", 26380), ("sentinel-b", DEFAULT_PORT), ("::1", 26381)),
        service_name=SERVICE,
        db=3,
        password=SECRET,
        sentinel_username="watcher",
        sentinel_password="sp@ss",
    )
    assert SECRET not in repr(target) and "sp@ss" not in repr(target)
    minimal = parse_sentinel_url("redis+sentinel://h/svc")
    assert (minimal.sentinels, minimal.db, minimal.password) == ((("h", DEFAULT_PORT),), 0, None)
    with_user = parse_sentinel_url("redis+sentinel://app:p%2Fw@h:1/svc")
    assert (with_user.username, with_user.password) == ("app", "p/w")
    built = sentinel_url([("127.0.0.1", 1), ("::1", 2)], "svc", "p/w", 2, "s@p")
    assert parse_sentinel_url(built) == SentinelTarget(
        (("127.0.0.1", 1), ("::1", 2)), "svc", 2, password="p/w", sentinel_password="s@p"
    )


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (f"redis+sentinel://:{SECRET}@h:26379", "service"),
        (f"redis+sentinel://:{SECRET}@h:26379/", "service"),
        (f"redis+sentinel://:{SECRET}@h:26379/svc/zero", "db a number"),
        (f"redis+sentinel://:{SECRET}@h:26379/svc/0/extra", "db a number"),
        (f"redis+sentinel://:{SECRET}@/svc", "at least one sentinel"),
        (f"redis+sentinel://:{SECRET}@h:port/svc", "valid port"),
        (f"redis+sentinel://:{SECRET}@h:70000/svc", "valid port"),
        (f"redis+sentinel://:{SECRET}@h,,g/svc", "empty host"),
        (f"redis+sentinel://user:{SECRET}/svc", "valid port"),  # the '@' forgotten
        (f"redis+sentinel://:{SECRET}@h/svc?password={SECRET}", "sentinel_password"),
        (f"redis+sentinel://h/svc?sentinel_password={SECRET}&sentinel_password=x", "twice"),
    ],
)
def test_a_bad_sentinel_url_fails_config_validation_without_showing_the_password(
    url: str, says: str
) -> None:
    with pytest.raises(ValueError, match=says) as parsed:
        parse_sentinel_url(url)
    assert SECRET not in str(parsed.value)
    with pytest.raises(ConfigError) as loaded:
        load_settings(environ={"REDIS_URL": url})
    assert says in str(loaded.value) and "redis.url" in str(loaded.value)
    assert SECRET not in str(loaded.value)
    with pytest.raises(ValueError) as direct:  # pydantic's own message: no input echoed
        RedisConfig(url=url)
    assert SECRET not in str(direct.value)


def test_the_config_takes_a_sentinel_url_and_masks_both_passwords() -> None:
    url = f"redis+sentinel://:{SECRET}@h1:26379,h2:26379/{SERVICE}/0?sentinel_password={SECRET}2"
    assert load_settings(environ={"REDIS_URL": url}).redis.url == url
    shown = masked_url(url)
    assert SECRET not in shown
    assert (
        shown == f"redis+sentinel://:{MASK}@h1:26379,h2:26379/{SERVICE}/0?sentinel_password={MASK}"
    )
    assert (
        masked_url(f"redis+sentinel://app:{SECRET}@h/svc") == f"redis+sentinel://app:{MASK}@h/svc"
    )
    with pytest.raises(ConfigError, match="redis\\+sentinel://"):
        load_settings(environ={"REDIS_URL": "sentinel://h/svc"})


def test_sentinel_clients_keep_the_pools_bounds_and_never_retry_a_timeout() -> None:
    url = f"redis+sentinel://:{SECRET}@127.0.0.1:1/{SERVICE}/2?sentinel_password=sp"
    config = RedisConfig(url=url, stall_timeout_s=7.0, max_connections=9)
    for client in (sync_client(config), async_client(config)):
        pool = client.connection_pool
        assert (pool.max_connections, pool.timeout) == (9, 7.0)  # a blocking pool, its bound
        kwargs = pool.connection_kwargs
        assert (kwargs["socket_timeout"], kwargs["db"], kwargs["password"]) == (7.0, 2, SECRET)
        assert kwargs["retry_on_error"] == [redis.ConnectionError]
        sentinel = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
        assert (sentinel["port"], sentinel["password"], sentinel["socket_timeout"]) == (
            1,
            "sp",
            1.0,
        )
    # No sentinel answers: a ConnectionError soon (the pool's 503 / reconnect path), no hang.
    started = time.monotonic()
    with pytest.raises(redis.ConnectionError) as failed:
        sync_client(config).ping()
    assert time.monotonic() - started < 5 and SECRET not in str(failed.value)


# -- a real primary, replicas and sentinel ---------------------------------------------------


@dataclass
class SentinelSet:
    """A primary, its replicas and one sentinel (quorum 1), on loopback, sharing one password."""

    servers: dict[int, EmbeddedRedis]  # by port; replaced ones are kept to be stopped
    sentinel: EmbeddedRedis
    url: str
    password: str
    watcher: redis.Redis = field(init=False)

    def __post_init__(self) -> None:
        self.watcher = redis.Redis(
            port=self.sentinel.port, password=self.sentinel.password, socket_timeout=5
        )

    def primary_port(self) -> int:
        """The primary as clients learn it (`SENTINEL MASTERS`: it changes once a failover is
        done, after GET-MASTER-ADDR-BY-NAME already names the promoted replica)."""
        return int(self.watcher.sentinel_master(SERVICE)["port"])

    def direct(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, username=POOL_USER, password=self.password, socket_timeout=5)

    def wait_replicas(self, count: int, timeout: float = 20.0) -> None:
        """Until the sentinel sees `count` replicas linked to the primary: one it can promote."""

        def linked() -> bool:
            replicas = self.watcher.sentinel_slaves(SERVICE)
            ok = [r for r in replicas if r["flags"] == "slave" and r["master-link-status"] == "ok"]
            return len(ok) >= count

        _wait(linked, timeout, f"{count} replica(s) linked")

    def wait_primary_moves(self, old: int, timeout: float = 20.0) -> int:
        _wait(lambda: self.primary_port() != old, timeout, "the sentinel to fail over")
        return self.primary_port()

    def wait_worker_registers(self, port: int, since: float, timeout: float = 20.0) -> None:
        """Until worker w1 registered again (rq's birth) on the primary at `port`, after the
        wall-clock time `since`: it rode the failover out as a restart and lives there."""
        key = f"rq:worker:{keys.rq_worker_name('w1')}"

        def registered() -> bool:
            birth = self.direct(port).hget(key, "birth")
            return birth is not None and utcparse(birth.decode()).timestamp() > since

        _wait(registered, timeout, f"the worker to register on the primary at {port}")

    def stop(self) -> None:
        self.sentinel.stop()
        for server in self.servers.values():
            server.stop()


@pytest.fixture
def sentinel_set() -> Iterator[SentinelSet]:
    primary = start_redis()
    servers = {primary.port: primary}
    sentinel: EmbeddedRedis | None = None
    try:
        for _ in range(2):
            replica = start_redis(
                password=primary.password,
                replicaof=(primary.host, primary.port),
                admin_password=primary.admin_password,
            )
            servers[replica.port] = replica
        sentinel = start_sentinel(primary, SERVICE, down_after_ms=1000, failover_timeout_ms=3000)
        url = sentinel_url(
            [(sentinel.host, sentinel.port)],
            SERVICE,
            primary.password,
            sentinel_password=sentinel.password,
        )
        # The pool's ACL user on the servers (sentinel_url writes a password alone).
        url = url.replace("redis+sentinel://:", f"redis+sentinel://{POOL_USER}:", 1)
        s = SentinelSet(servers, sentinel, url, primary.password)
        s.wait_replicas(2)
        yield s
    finally:
        if sentinel is not None:
            sentinel.stop()
        for server in servers.values():
            server.stop()


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except redis.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_clients_follow_a_manual_failover_and_the_workers_client_reports_it_once(
    sentinel_set: SentinelSet,
) -> None:
    """`SENTINEL FAILOVER` leaves the old primary up and writable until the sentinel demotes it
    (seconds later): the pool's clients leave it within about FOLLOW_S all the same, and the
    worker's client raises one ConnectionError, in its own thread only."""
    s = sentinel_set
    config = RedisConfig(url=s.url)
    plain, worker = sync_client(config), sync_client(config, report_failover=True)
    other_thread_errors: list[BaseException] = []

    async def run_async(stop: threading.Event) -> int:
        client = async_client(config)
        writes = 0
        try:
            while not stop.is_set():
                await client.incr("async")
                await client.eval("return redis.call('INCR', KEYS[1])", 1, "script")
                writes += 1
                await asyncio.sleep(0.02)
        finally:
            await client.aclose()
        return writes

    old = s.primary_port()
    assert plain.set("k", "v") and worker.set("k", "v")
    stop = threading.Event()
    box: dict[str, int] = {}
    async_thread = threading.Thread(target=lambda: box.update(n=asyncio.run(run_async(stop))))
    async_thread.start()

    def worker_elsewhere() -> None:  # another thread of the worker: it moves on, never raises
        try:
            while not stop.is_set():
                worker.incr("elsewhere")
                time.sleep(0.02)
        except BaseException as exc:
            other_thread_errors.append(exc)

    elsewhere = threading.Thread(target=worker_elsewhere)
    elsewhere.start()
    try:
        assert s.watcher.sentinel_failover(SERVICE)
        new = s.wait_primary_moves(old, timeout=10)
        moved_at = time.monotonic()
        reported: list[str] = []
        while time.monotonic() - moved_at < FOLLOW_S + 2:
            plain.incr("plain")
            try:
                worker.incr("worker")
            except redis.ConnectionError as exc:
                reported.append(str(exc))
            time.sleep(0.02)
        assert len(reported) == 1 and "primary moved" in reported[0], reported
        assert f":{old} -> " in reported[0] and reported[0].endswith(f":{new}")
        # Every client writes to the new primary now, the old one still being a primary.
        before = s.direct(new).mget("plain", "worker", "elsewhere", "async")
        plain.incr("plain")
        worker.incr("worker")
        time.sleep(0.5)
        after = s.direct(new).mget("plain", "worker", "elsewhere", "async")
        assert all(int(a or 0) > int(b or 0) for a, b in zip(after, before, strict=True))
        assert plain.connection_pool.master_address[1] == new
    finally:
        stop.set()
        async_thread.join(10)
        elsewhere.join(10)
    assert other_thread_errors == [] and box["n"] > 0


def test_the_routers_command_batch_follows_a_manual_failover(sentinel_set: SentinelSet) -> None:
    """The command batch (router/redis_batch.py) takes a connection from the Sentinel pool for
    each write: within about FOLLOW_S of the move its commands and scripts land on the new
    primary, and none waits out a stall."""
    s = sentinel_set
    old = s.primary_port()

    async def run() -> tuple[int, list[str]]:
        aredis = async_client(RedisConfig(url=s.url))
        batch = RedisBatch(aredis)
        script = aredis.register_script("return redis.call('INCR', KEYS[1])")
        errors: list[str] = []
        try:
            assert await batch.call("SET", "batch", "0") == b"OK"
            assert s.watcher.sentinel_failover(SERVICE)
            new = await asyncio.to_thread(s.wait_primary_moves, old, 10)
            moved_at = time.monotonic()
            while time.monotonic() - moved_at < FOLLOW_S + 2:
                started = time.monotonic()
                try:
                    await asyncio.gather(
                        batch.call("INCR", "batch"), batch.script(script, ["batch"], [])
                    )
                except redis.RedisError as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                assert time.monotonic() - started < 2, "a write waited out a stall"
                await asyncio.sleep(0.02)
            before = int(s.direct(new).get("batch") or 0)
            await asyncio.gather(batch.call("INCR", "batch"), batch.script(script, ["batch"], []))
            return int(s.direct(new).get("batch") or 0) - before, errors
        finally:
            await batch.stop()
            await aredis.aclose()

    landed, errors = asyncio.run(run())
    assert landed == 2  # both on the new primary
    assert len(errors) <= 2, errors  # at most the write the old primary's demotion cut short


def test_a_script_refused_by_a_demoted_primary_is_a_lost_connection(
    sentinel_set: SentinelSet,
) -> None:
    """A demoted primary answers a script's write with an error redis-py takes for a script
    error, not READONLY: here it is a ConnectionError (retried on the new primary), as a
    plain command's READONLY is."""
    s = sentinel_set
    client = sync_client(RedisConfig(url=s.url))
    replica = next(port for port in s.servers if port != s.primary_port())
    conn = client.connection_pool.get_connection()
    try:
        conn.disconnect()
        conn.connect_to(("127.0.0.1", replica))  # as a connection made just before a failover
        for command in (("SET", "k", "v"), ("EVAL", "return redis.call('SET', 'k', 'v')", "0")):
            conn.send_command(*command)
            with pytest.raises(redis.ConnectionError, match="now a"):
                conn.read_response()
            assert not conn.is_connected  # dropped: the next one asks the sentinel
            conn.connect_to(("127.0.0.1", replica))
    finally:
        client.connection_pool.release(conn)
    assert client.eval("return redis.call('SET', KEYS[1], 'v')", 1, "k") == b"OK"


def test_wait_redis_waits_for_a_sentinel_managed_primary(sentinel_set: SentinelSet) -> None:
    argv = [sys.executable, "-m", "mlxcel_pool", "wait-redis", "--timeout", "10"]

    def wait_redis(url: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "REDIS_URL": url}
        return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=60)

    assert wait_redis(sentinel_set.url).returncode == 0
    wrong = sentinel_set.url.replace(sentinel_set.password, SECRET)
    failed = wait_redis(wrong)
    assert failed.returncode == 2 and "wait-redis" in failed.stderr  # a wrong password: exit 2
    assert SECRET not in failed.stderr and sentinel_set.password not in failed.stderr


# -- the pool, failed over under load --------------------------------------------------------

PROMPTS = ("The quick brown fox", "Once upon a time", "In a hole in the ground")
MAX_TOKENS = 160
# What a request may end with while the primary fails over, as the router documents it.
HTTP_ERRORS = {
    (503, "redis_unavailable"),
    (503, "worker_lost"),
    (503, "no_live_worker"),
    (500, "job_failed"),
}
STREAM_ERRORS = {"redis_unavailable", "worker_lost", "job_failed"}


@dataclass
class Outcome:
    prompt: str
    stream: bool
    started: float
    ended: float = 0.0
    status: int = 0
    text: str = ""
    finish: str | None = None
    error: str | None = None  # the error's code: an HTTP error, or one in the stream
    message: str = ""


def _request(client: httpx.Client, url: str, model: str, prompt: str, stream: bool) -> Outcome:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    out = Outcome(prompt, stream, time.monotonic())
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                error = json.loads(resp.read())["error"]
                out.error, out.message = error["code"], error["message"]
            elif not stream:
                choice = json.loads(resp.read())["choices"][0]
                out.text, out.finish = choice["text"], choice["finish_reason"]
            else:
                for line in resp.iter_lines():
                    data = line.removeprefix("data: ")
                    if not line.startswith("data: ") or data == "[DONE]":
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        out.error, out.message = chunk["error"]["code"], chunk["error"]["message"]
                        break
                    out.text += chunk["choices"][0]["text"]
                    out.finish = chunk["choices"][0]["finish_reason"] or out.finish
    finally:
        out.ended = time.monotonic()
    return out


class Load:
    """A few clients sending completions back to back, streamed and not, until stopped."""

    def __init__(self, url: str, model: str, clients: int = 3) -> None:
        self.url, self.model = url, model
        self.outcomes: list[Outcome] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        assert not any(t.is_alive() for t in self._threads), "a request hung"

    def _run(self, i: int) -> None:
        # Every wait bounded: a request that hangs fails the test instead of stalling it.
        with httpx.Client(timeout=httpx.Timeout(60.0)) as client:
            n = i
            while not self._stop.is_set():
                prompt, stream = PROMPTS[n % len(PROMPTS)], n % 2 == 0
                try:
                    self.outcomes.append(_request(client, self.url, self.model, prompt, stream))
                except BaseException as exc:  # a timeout, a refused connection: the test fails
                    self.errors.append(exc)
                    return
                n += 1

    def succeeded_since(self, t: float) -> int:
        return sum(1 for o in list(self.outcomes) if o.started > t and o.error is None)

    def wait_serving_since(self, t: float, timeout: float = 30.0) -> None:
        _wait(
            lambda: self.succeeded_since(t) >= 2 or self.errors, timeout, "the pool to serve again"
        )
        assert not self.errors, self.errors


def test_the_pool_rides_out_failovers_under_load_with_no_wrong_text(
    sentinel_set: SentinelSet, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Every request either gets exactly the text it gets when nothing fails (greedy), or ends
    with one of the router's documented errors having streamed only a prefix of that text;
    none hangs; after each failover the pool serves again, its worker registered on the new
    primary. First a manual failover (the old primary stays up), then the new primary killed."""
    from tests.pool_fixture import running_pool

    s = sentinel_set
    overrides = {"redis": {"url": s.url}}
    with running_pool(tiny_model_dir, tmp_path, overrides=overrides) as pool:
        model = httpx.get(f"{pool.url}/v1/models", timeout=10).json()["data"][0]["id"]
        with httpx.Client(timeout=60) as client:
            expected = {
                (p, stream): _request(client, pool.url, model, p, stream)
                for p in PROMPTS
                for stream in (False, True)
            }
        for key, o in expected.items():
            assert o.status == 200 and o.error is None and o.text, (key, o)
        assert expected[(PROMPTS[0], True)].text == expected[(PROMPTS[0], False)].text

        faults: list[float] = []
        with Load(pool.url, model) as load:
            load.wait_serving_since(0.0)

            old = s.primary_port()  # 1: a manual failover, the old primary left running
            faults.append(time.monotonic())
            wall = time.time()
            assert s.watcher.sentinel_failover(SERVICE)
            first = s.wait_primary_moves(old, timeout=15)
            s.wait_worker_registers(first, since=wall)
            load.wait_serving_since(time.monotonic())

            s.wait_replicas(1)  # 2: the new primary killed outright
            faults.append(time.monotonic())
            wall = time.time()
            s.servers[first].process.kill()
            second = s.wait_primary_moves(first, timeout=20)
            s.wait_worker_registers(second, since=wall)
            load.wait_serving_since(time.monotonic())
        assert not load.errors, load.errors

        for o in load.outcomes:
            want = expected[(o.prompt, o.stream)]
            if o.error is None:
                assert o.status == 200 and (o.text, o.finish) == (want.text, want.finish), o
            elif o.status == 200:  # the stream had begun: what it carried is the text's start
                assert o.error in STREAM_ERRORS and want.text.startswith(o.text), o
            else:
                assert (o.status, o.error) in HTTP_ERRORS, o
        for fault in faults:  # the load was real: requests ran across each fault
            assert any(o.started < fault < o.ended for o in load.outcomes), fault
        assert pool.failures() == []  # the worker rode both out: never restarted
        worker_log = pool.logs("w1")  # the manual failover reached it as a lost connection
        assert "lost Redis (the Redis primary moved (Sentinel failover)" in worker_log
        for log in (tmp_path / "logs").glob("*.log"):
            text = log.read_text(errors="replace")
            assert s.password not in text and s.sentinel.password not in text, log.name
