"""The embedded Redis requires a password kept in the cache dir, and no Redis URL is ever shown
with its password: `masked_url` on its own, then a real embedded redis-server."""

from __future__ import annotations

import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from mlxcel_pool.redis_server import RedisServerError, start_redis
from shared.config import ConfigError, load_settings
from shared.redis_auth import PASSWORD_FILE, PasswordFileError, embedded_password, masked_url

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

# --- masked_url --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:s3cret@127.0.0.1:6390/0", "redis://:***@127.0.0.1:6390/0"),
        ("rediss://alice:s3cret@redis.example:6380/2", "rediss://alice:***@redis.example:6380/2"),
        ("redis://s3cret@host:1/0", "redis://:***@host:1/0"),  # redis-py: a username; still hidden
        ("redis://:p%40ss@host:1/0", "redis://:***@host:1/0"),
        (
            "rediss://host:1/0?password=s3cret&ssl_cert_reqs=none",
            "rediss://host:1/0?password=***&ssl_cert_reqs=none",
        ),
        ("unix://:s3cret@/run/redis.sock?db=1", "unix://:***@/run/redis.sock?db=1"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("rediss://h:1/0?ssl_ca_certs=/etc/ca.pem", "rediss://h:1/0?ssl_ca_certs=/etc/ca.pem"),
        ("", ""),
    ],
)
def test_masked_url_hides_only_the_password(url: str, shown: str) -> None:
    assert masked_url(url) == shown


def test_a_bad_redis_url_is_reported_without_its_password() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(environ={"REDIS_URL": "http://:s3cret@host:1/0"})
    assert "REDIS_URL='http://:***@host:1/0'" in str(err.value) and "s3cret" not in str(err.value)


# --- the password file -------------------------------------------------------------------------


def test_the_password_is_made_once_private_and_then_reused(tmp_path: Path) -> None:
    password = embedded_password(tmp_path / "cache")
    path = tmp_path / "cache" / PASSWORD_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(password) >= 32 and path.read_text().strip() == password
    assert embedded_password(tmp_path / "cache") == password
    path.chmod(0o644)
    assert embedded_password(tmp_path / "cache") == password
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # tightened again
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [PASSWORD_FILE]


def test_callers_racing_to_make_the_password_all_get_the_same_one(tmp_path: Path) -> None:
    with ThreadPoolExecutor(8) as ex:
        got = set(ex.map(lambda _: embedded_password(tmp_path), range(32)))
    assert len(got) == 1 and (tmp_path / PASSWORD_FILE).read_text().strip() in got


def test_a_password_file_it_did_not_write_is_refused(tmp_path: Path) -> None:
    (tmp_path / PASSWORD_FILE).write_text("")
    with pytest.raises(PasswordFileError, match="delete it"):
        embedded_password(tmp_path)


# --- the embedded server -----------------------------------------------------------------------


ONCE = Retry(NoBackoff(), 0)  # a refused login asked once, not retried


def test_the_embedded_redis_needs_the_password_it_was_given(tmp_path: Path) -> None:
    password = embedded_password(tmp_path)
    server = start_redis(password=password)
    try:
        assert server.url == f"redis://mlxcel:{password}@127.0.0.1:{server.port}/0"
        assert server.masked_url == f"redis://mlxcel:***@127.0.0.1:{server.port}/0"
        assert redis.Redis.from_url(server.url).ping()
        # Refusals, each asked once (redis-py retries a refused login with a backoff).
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, retry=ONCE).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=server.port, password="guess", retry=ONCE).ping()
        with pytest.raises(redis.AuthenticationError):  # the `default` user is off
            redis.Redis(port=server.port, password=password, retry=ONCE).ping()
        # The password is in a private config file, not on the command line anyone can read.
        cmdline = psutil.Process(server.process.pid).cmdline()
        assert not any(password in arg or server.admin_password in arg for arg in cmdline)
        # MODULE (loads code) is off for every user; the pool's user cannot run CONFIG.
        for url in (server.url, server.admin_url):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                redis.Redis.from_url(url).execute_command("MODULE LIST")
        with pytest.raises(redis.exceptions.NoPermissionError):
            redis.Redis.from_url(server.url).execute_command("CONFIG GET dir")
        again = server.restarted()
        assert again.url == server.url and redis.Redis.from_url(server.url).ping()
        assert again.admin_url == server.admin_url and again.admin_url != again.url
        server = again
    finally:
        server.stop()


def test_the_embedded_redis_binds_loopback_only() -> None:
    with pytest.raises(RedisServerError, match="loopback only"):
        start_redis(host="0.0.0.0")
