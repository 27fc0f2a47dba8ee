"""The configuration files shipped for a pool over several hosts work as written: the redis.conf
under config/redis/ (filled in, on the system's redis-server, built with TLS) serves the pool's
client over TLS as the pool's user, and each systemd unit under config/systemd/ starts a command
line this CLI accepts."""

from __future__ import annotations

import shlex
import subprocess
import time
from pathlib import Path

import pytest
import redis

from mlxcel_pool.cli import build_parser
from mlxcel_pool.redis_server import SYSTEM_REDIS, free_port
from shared.config import RedisConfig
from shared.redis_clients import sync_client
from tests.test_redis_private import make_cert

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "config" / "systemd"
HOST = "127.0.0.2"


def _unit(name: str) -> dict[str, str]:
    lines = (UNITS / name).read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


@pytest.mark.parametrize("name", ["mlxcel-worker@.service", "mlxcel-router.service"])
def test_each_unit_starts_a_command_line_the_cli_accepts(name: str) -> None:
    unit = _unit(name)
    argv = shlex.split(unit["ExecStart"].replace("%l", "gpu1").replace("%i", "2"))
    assert argv[0].endswith("/bin/mlxcel-pool")
    args = build_parser().parse_args(argv[1:])  # argparse exits on a flag it does not know
    assert args.command in ("worker", "router") and not args.supervised
    assert unit["Restart"] == "always" and unit["EnvironmentFile"] == "/etc/mlxcel/pool.env"
    if args.command == "worker":
        assert args.worker_id == "gpu1-w2"  # what `up --join` would name it on host gpu1


@pytest.mark.pool
def test_the_tls_redis_conf_serves_the_pools_user(tmp_path: Path) -> None:
    cert, key = make_cert(tmp_path, "redis", [HOST])
    port, password = free_port(HOST), "a-long-random-password-for-this-test"
    conf = (REPO / "config" / "redis" / "mlxcel-tls.conf").read_text()
    conf = conf.replace("<redis-ip>", HOST).replace("<password>", password)
    conf = conf.replace("tls-port 6380", f"tls-port {port}")
    for placeholder, path in (
        ("/etc/mlxcel/redis.crt", cert),
        ("/etc/mlxcel/redis.key", key),
        ("/etc/mlxcel/redis-ca.crt", cert),
    ):
        conf = conf.replace(placeholder, str(path))
    assert "<" not in conf.replace("<admin-password>", "")  # every placeholder filled
    (tmp_path / "redis.conf").write_text(conf)
    argv = [SYSTEM_REDIS, str(tmp_path / "redis.conf"), "--dir", str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"rediss://mlxcel:{password}@{HOST}:{port}/0?ssl_ca_certs={cert}"
    client = sync_client(RedisConfig(url=url, stall_timeout_s=2))
    try:
        deadline = time.monotonic() + 15
        while True:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        assert client.set("k", "v") and client.get("k") == b"v"
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.config_get("dir")
        # No user name: refused, whatever the password.
        anonymous = url.replace("mlxcel:", ":")
        with pytest.raises(redis.AuthenticationError):
            sync_client(RedisConfig(url=anonymous, stall_timeout_s=2)).ping()
    finally:
        client.close()
        proc.terminate()
        proc.wait(10)
