"""Which ids a host's workers take (`up` with its own Redis: w1..wN; joining a shared Redis:
`<host>-w1..`, or `--worker-prefix`), and which ids a live worker holds, read from the same
liveness hash a worker's own claim reads, with the same rule. Against the session's real Redis;
the hashes written here are what a worker of another host writes."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

from mlxcel_pool.worker_ids import check_prefix, holders, host_prefix, worker_ids
from shared import keys
from shared.config import ConfigError
from tests.test_operator_errors import mlxcel, one_line_exit_2


def test_a_hosts_prefix_is_its_short_name() -> None:
    assert host_prefix("GPU-Box-3.example.com") == "gpu-box-3-w"
    assert host_prefix("node_7") == "node_7-w"
    assert host_prefix("weird name!.lan") == "weird-name-w"
    assert host_prefix("...") == "host-w"
    assert worker_ids(host_prefix("gpu1"), 3) == ["gpu1-w1", "gpu1-w2", "gpu1-w3"]
    assert worker_ids("w", 2) == ["w1", "w2"]  # the embedded pool's, as before


def test_a_prefix_that_cannot_name_a_queue_is_refused() -> None:
    assert check_prefix("rack2-") == "rack2-"
    for bad in ("", "a:b", "a.b", "a b", "ü"):
        with pytest.raises(ConfigError, match="use letters, digits"):
            check_prefix(bad)


def _register(conn: redis.Redis, worker_id: str, host: str, pid: int, seen: float) -> None:
    """The fields of a worker's liveness hash that its claim reads, with its TTL."""
    info = keys.worker_info(worker_id)
    conn.hset(info, mapping={"pid": str(pid), "host": host, "last_seen": f"{seen:.3f}"})
    conn.expire(info, keys.LIVENESS_TTL_S)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid  # reaped: no process has it (until the kernel hands it out again)


@pytest.mark.pool
def test_an_id_is_held_by_a_live_worker_of_any_host_not_by_a_crashed_one_of_this(
    redis_url: str,
) -> None:
    conn = redis.Redis.from_url(redis_url)
    here = socket.gethostname()
    now = time.time()
    _register(conn, "other", "gpu-box-2", 4242, now - 3)  # another host: its pid means nothing here
    _register(conn, "mine", here, os.getpid(), now)  # a live process of this host
    _register(conn, "crashed", here, _dead_pid(), now - 1)  # this host's, its process gone
    held = holders(conn, ["other", "mine", "crashed", "free"], now=now)
    assert [(h.worker_id, h.host, h.pid) for h in held] == [
        ("other", "gpu-box-2", "4242"),
        ("mine", here, str(os.getpid())),
    ]
    assert held[0].age_s == pytest.approx(3, abs=0.01)
    assert held[0].message("use another") == (
        "worker id 'other' is in use by pid 4242 on gpu-box-2, last heartbeat 3 s ago: use another"
    )


@pytest.mark.pool
def test_up_on_a_shared_redis_names_its_workers_after_this_host(
    redis_url: str, tmp_path: Path
) -> None:
    """Without --worker-prefix, `up` on a Redis other hosts share takes `<host>-w1..`: the id
    it refuses, held by another host's worker, shows what it would have used."""
    conn = redis.Redis.from_url(redis_url)
    first = f"{host_prefix()}1"
    _register(conn, first, "gpu-box-2", 4242, time.time())
    env = {"REDIS_URL": redis_url, "MLXCEL_CACHE_DIR": str(tmp_path)}
    for command in (["up", "--join"], ["up", "--workers", "2"]):
        line = one_line_exit_2(mlxcel(*command, env=env), "up")
        assert line.startswith(f"worker id '{first}' is in use by pid 4242 on gpu-box-2, "), line
    # An explicit prefix takes other ids: past the check, it fails at the model it lacks.
    env["MLXCEL_MODEL"] = str(tmp_path / "no-model")
    line = one_line_exit_2(mlxcel("up", "--join", "--worker-prefix", "b", env=env), "up")
    assert line.startswith(f"model directory {tmp_path / 'no-model'} does not exist")
    assert conn.hget(keys.worker_info(first), "host") == b"gpu-box-2"  # read, never written
