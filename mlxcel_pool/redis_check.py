"""Whether a Redis URL reaches a Redis this pool can use, and if not, one line saying what is wrong
with it and how to fix it: for the commands that join a pool (`up`, `router`, `worker`,
`wait-redis`), before anything long starts.

A wrong password, a TLS mismatch (rediss:// to a plain port, redis:// to a TLS port), a CA that
does not sign the server's certificate, a server that asks for a client certificate, or something
that is not Redis at that address will not mend by waiting: `wait` reports them at once. Only a
Redis that does not answer yet (refused, unresolvable, silent) is waited for.
"""

from __future__ import annotations

import errno
import ssl
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

import redis

from shared.config import RedisConfig
from shared.redis_auth import masked_url
from shared.redis_clients import sync_client
from shared.redis_sentinel import is_sentinel_url

# One try's bound (connect, TLS handshake, PING): a Redis on a reachable network answers well
# within it, and a rediss:// client facing a plain port learns it only from this timeout.
PROBE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class RedisProblem:
    message: str  # one line: what is wrong, then the fix
    transient: bool  # Redis is not reachable (yet): worth waiting for


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _where(url: str) -> str:
    if is_sentinel_url(url) or url.startswith("unix://"):
        return masked_url(url)
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    try:
        port = parts.port or 6379
    except ValueError:
        return masked_url(url)
    return f"{host}:{port}"


def _query(url: str, key: str) -> str | None:
    values = parse_qs(urlsplit(url).query).get(key)
    return values[0] if values else None


def diagnose(url: str, exc: BaseException, waited_s: float = 0.0) -> RedisProblem:
    """The one-line account of why a client of `url` failed with `exc` (never the password);
    `waited_s`: how long it was waited for, if at all."""
    where = _where(url)
    tls = url.startswith("rediss://")
    chain = list(_chain(exc))
    problem = _classify(url, where, tls, exc, chain, waited_s)
    password = urlsplit(url).password
    if password:  # a library's text never carries it, but a mistyped URL might land there
        problem = RedisProblem(problem.message.replace(password, "***"), problem.transient)
    return problem


def _classify(
    url: str,
    where: str,
    tls: bool,
    exc: BaseException,
    chain: list[BaseException],
    waited_s: float,
) -> RedisProblem:
    shown = masked_url(url)
    if isinstance(exc, ValueError):
        return RedisProblem(f"REDIS_URL {shown} is not a usable Redis URL: {exc}", False)
    if isinstance(exc, redis.AuthenticationError):
        if not urlsplit(url).password and not _query(url, "password"):
            fix = "it asks for a password and REDIS_URL has none"
        else:
            fix = "REDIS_URL's user or password is wrong"
        return RedisProblem(
            f"Redis at {shown} refused the login: {fix} (on the Redis host, `mlxcel-pool "
            "redis-url` prints the URL of `mlxcel-pool redis`, password included)",
            False,
        )
    if isinstance(exc, redis.exceptions.NoPermissionError):
        return RedisProblem(
            f"Redis at {where} refused PING to REDIS_URL's user ({exc}): give that user the "
            "pool's rights (docs/deployment.md, \"The pool's Redis user\")",
            False,
        )
    for cause in chain:
        if isinstance(cause, ssl.SSLCertVerificationError):
            return _untrusted(url, where, cause)
    if tls:
        tls_problem = _tls_problem(url, where, chain)
        if tls_problem is not None:
            return tls_problem
    elif _hung_up(chain) and not url.startswith("unix://"):
        return RedisProblem(
            f"Redis at {where} hung up at the first command: it is a TLS port (or not Redis); "
            "for TLS use rediss://...?ssl_ca_certs=<CA file> in REDIS_URL",
            False,
        )
    if isinstance(exc, redis.exceptions.InvalidResponse):
        return RedisProblem(
            f"what answers at {where} is not Redis ({exc}): check REDIS_URL's host and port",
            False,
        )
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
        after = f" within {waited_s:g} s" if waited_s > 0 else ""
        return RedisProblem(
            f"cannot reach Redis at {shown}{after}: {exc} (check REDIS_URL's host and port, that "
            "Redis listens on that address (its bind), and that no firewall is in between)",
            True,
        )
    return RedisProblem(f"Redis at {where} answered PING with an error: {exc}", False)


def _untrusted(url: str, where: str, cause: ssl.SSLCertVerificationError) -> RedisProblem:
    reason = cause.verify_message or str(cause)
    if "mismatch" in reason.lower():
        host = urlsplit(url).hostname
        return RedisProblem(
            f"the TLS certificate of Redis at {where} does not name {host}: connect by an "
            "address its subjectAltName holds, or give the server a certificate for this one",
            False,
        )
    ca = _query(url, "ssl_ca_certs")
    fix = (
        f"ssl_ca_certs={ca} in REDIS_URL is not the CA that signed it: name that CA's file"
        if ca
        else "add ?ssl_ca_certs=<the CA file that signed it> to REDIS_URL"
    )
    return RedisProblem(
        f"the TLS certificate of Redis at {where} is not trusted ({reason}): {fix}", False
    )


def _tls_problem(url: str, where: str, chain: list[BaseException]) -> RedisProblem | None:
    for cause in chain:
        if isinstance(cause, FileNotFoundError) or getattr(cause, "errno", None) == errno.ENOENT:
            files = [
                f"{key}={value}"
                for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")
                if (value := _query(url, key))
            ]
            return RedisProblem(
                f"a TLS file REDIS_URL names does not exist on this host ({', '.join(files)}): "
                "copy it there or correct the path",
                False,
            )
    for cause in chain:
        text = str(cause)
        if isinstance(cause, ssl.SSLEOFError) or "certificate required" in text:
            return RedisProblem(
                f"Redis at {where} closed the TLS connection at once: it asks for a client "
                "certificate (Redis's default tls-auth-clients yes); set `tls-auth-clients no` "
                "on the server (`mlxcel-pool redis` does), or add ssl_certfile= and "
                "ssl_keyfile= to REDIS_URL",
                False,
            )
        if "handshake" in text or "WRONG_VERSION_NUMBER" in text or "record layer" in text:
            return RedisProblem(
                f"Redis at {where} does not speak TLS (a plain port?): use redis:// for it in "
                "REDIS_URL, or the server's TLS port",
                False,
            )
    return None


def _hung_up(chain: list[BaseException]) -> bool:
    """The server closed the connection when it got the first command, as a TLS port does with
    plain text."""
    for cause in chain:
        if isinstance(cause, ConnectionResetError | BrokenPipeError):
            return True
        if "Connection closed by server" in str(cause):
            return True
    return False


def probe_config(config: RedisConfig) -> RedisConfig:
    """`config` with one try bounded by PROBE_TIMEOUT_S (and its few connections)."""
    return config.model_copy(
        update={"stall_timeout_s": min(config.stall_timeout_s, PROBE_TIMEOUT_S)}
    )


def check(client: redis.Redis, url: str, waited_s: float = 0.0) -> RedisProblem | None:
    try:
        client.ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        return diagnose(url, exc, waited_s)
    return None


def wait(
    config: RedisConfig,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> RedisProblem | None:
    """None once Redis at `config.url` answers PING; else the problem, at once when waiting
    cannot mend it, or the last one after `timeout_s`."""
    try:
        client = sync_client(probe_config(config))
    except ValueError as exc:  # the URL does not parse (a port that is no number, ...)
        return diagnose(config.url, exc)
    deadline = clock() + timeout_s
    try:
        while True:
            last = clock() >= deadline
            problem = check(client, config.url, timeout_s if last else 0.0)
            if problem is None or not problem.transient or last:
                return problem
            sleep(min(0.5, max(0.0, deadline - clock())))
    finally:
        client.close()
