"""Redis credentials: the embedded redis-server's password file, and the one way a URL is shown.

A Redis URL may carry a password (`redis://:<password>@host:port/0`, `rediss://user:<password>@...`
or `?password=`; a Sentinel URL's `redis+sentinel://:<password>@h1:26379,h2:26379/<service>` and
its `?sentinel_password=`); the embedded Redis's names its ACL user,
`redis://mlxcel:<password>@127.0.0.1:<port>/0`. Whatever logs or prints a Redis URL prints
`masked_url(url)`, so no log file and no error message holds the secret; the only place the full
URL of the embedded Redis is shown is the line `mlxcel-pool up` prints on its own stdout for the
operator.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

PASSWORD_FILE = "redis.password"  # in the cache dir
MASK = "***"
# secrets.token_urlsafe's alphabet: safe unquoted in a URL and in a redis.conf line.
_TOKEN = re.compile(r"[A-Za-z0-9_-]{16,}")


def _secret_key(key: str) -> bool:
    """`password`, `sentinel_password`, `ssl_password`: any query key that names a password."""
    return key.lower().endswith("password")


class PasswordFileError(RuntimeError):
    pass


def masked_url(url: str) -> str:
    """`url` with its password (userinfo and `password=` query) replaced by `***`; the rest,
    which tells an operator which Redis it is, is kept. A username alone is masked too: redis-py
    reads `redis://secret@host` as a username, but people write it meaning a password. With no
    userinfo, a "port" that is no number (`redis+sentinel://user:secret/svc`, the '@' left out)
    is masked as well."""
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, hostport = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
        netloc = f"{user}:{MASK}@{hostport}"
    else:
        netloc = ",".join(_masked_port(item) for item in netloc.split(","))
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_secret_key(k) for k, _ in pairs):
            masked = [(k, MASK if _secret_key(k) else v) for k, v in pairs]
            query = urlencode(masked, safe="*/")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _masked_port(hostport: str) -> str:
    head, sep, port = hostport.rpartition(":")
    if sep and port and not port.isdigit() and not hostport.endswith("]"):  # not [IPv6]
        return f"{head}:{MASK}"
    return hostport


def embedded_password(cache_dir: Path) -> str:
    """The embedded Redis's password (its pool user's, `mlxcel_pool.redis_server.POOL_USER`),
    kept in `<cache_dir>/redis.password` (mode 0600).

    Made once with `secrets.token_urlsafe`, then reused: a restarted server (by `Pool.supervise`,
    or a new `mlxcel-pool up` / `mlxcel-pool redis` on the same port) takes the same password, so
    the URL every child holds stays valid. The file appears complete or not at all (written
    aside, then hard-linked into place), so concurrent callers all read the same password.
    """
    path = cache_dir / PASSWORD_FILE
    if path.exists():
        return _read(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    password = secrets.token_urlsafe(32)
    aside = cache_dir / f".{PASSWORD_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        os.link(aside, path)
    except FileExistsError:
        return _read(path)  # another process made it first: use that one
    finally:
        aside.unlink(missing_ok=True)
    return password


def _read(path: Path) -> str:
    password = path.read_text().strip()
    if not _TOKEN.fullmatch(password):
        raise PasswordFileError(f"{path} does not hold a password made by mlxcel-pool; delete it")
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)  # readable by others is as good as no password
    return password
