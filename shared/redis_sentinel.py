"""A Sentinel-managed primary as REDIS_URL names it, parsed in one place.

    redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/<service>[/<db>]
                     [?sentinel_password=...&sentinel_username=...]

The hosts are the sentinels (port 26379 unless given; `[::1]:26379` for IPv6), `<service>` is
the name they monitor (`sentinel monitor <service> ...`), `<db>` the database (0 unless given).
The userinfo's credentials are the primary's (and so its replicas'); `sentinel_password` (and
`sentinel_username`) are what the sentinels themselves ask for (`requirepass` in sentinel.conf),
none if absent. It is the form rq-dashboard's `redis-sentinel-url` reads, plus the sentinel's
own credentials. Percent-encoding is undone in the credentials, as redis-py does for redis://.

Clients ask a sentinel where the primary is on every new connection (shared.redis_clients), so
after a failover they reconnect to the new one as they reconnect after a restart. Messages here
never hold a password: they are logged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, quote, unquote, urlsplit

SCHEME = "redis+sentinel"
PREFIX = f"{SCHEME}://"
DEFAULT_PORT = 26379
_QUERY_KEYS = frozenset({"sentinel_password", "sentinel_username"})


@dataclass(frozen=True)
class SentinelTarget:
    sentinels: tuple[tuple[str, int], ...]
    service_name: str
    db: int = 0
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    sentinel_username: str | None = field(default=None, repr=False)
    sentinel_password: str | None = field(default=None, repr=False)


def is_sentinel_url(url: str) -> bool:
    return url.lower().startswith(PREFIX)


def parse_sentinel_url(url: str) -> SentinelTarget:
    """The sentinels, service, db and credentials of a `redis+sentinel://` URL; ValueError (its
    message never quotes the URL, which may hold a password) if it is not a usable one."""
    if not is_sentinel_url(url):
        raise ValueError(f"a Sentinel URL starts with {PREFIX}")
    parts = urlsplit(url)
    netloc = parts.netloc
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, sep, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if sep else None
    if not netloc:
        raise ValueError("a Sentinel URL names at least one sentinel (host:port)")
    sentinels = tuple(_host_port(item) for item in netloc.split(","))
    segments = [unquote(s) for s in parts.path.split("/")[1:]]
    if not segments or not segments[0]:
        raise ValueError("a Sentinel URL names the primary's service: .../<service>[/<db>]")
    if len(segments) > 2 or (len(segments) == 2 and not segments[1].isdigit()):
        raise ValueError("a Sentinel URL's path is /<service> or /<service>/<db> (db a number)")
    db = int(segments[1]) if len(segments) == 2 else 0
    query: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key not in _QUERY_KEYS:
            known = ", ".join(sorted(_QUERY_KEYS))
            raise ValueError(f"a Sentinel URL takes only {known} in its query, not {key!r}")
        if key in query:
            raise ValueError(f"{key} given twice in the Sentinel URL")
        query[key] = value
    return SentinelTarget(
        sentinels=sentinels,
        service_name=segments[0],
        db=db,
        username=username,
        password=password,
        sentinel_username=query.get("sentinel_username") or None,
        sentinel_password=query.get("sentinel_password") or None,
    )


def sentinel_url(
    sentinels: Sequence[tuple[str, int]],
    service_name: str,
    password: str | None = None,
    db: int = 0,
    sentinel_password: str | None = None,
) -> str:
    """The URL for these sentinels and service (password included: hand it on, never log it)."""
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in sentinels)
    auth = f":{quote(password, safe='')}@" if password else ""
    query = f"?sentinel_password={quote(sentinel_password, safe='')}" if sentinel_password else ""
    return f"{PREFIX}{auth}{hosts}/{quote(service_name, safe='')}/{db}{query}"


def _host_port(item: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [IPv6]:port
        host, _, rest = item[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if rest and not rest.startswith(":"):
            raise ValueError("a sentinel's IPv6 address is written [host]:port")
    else:
        host, _, port_text = item.partition(":")
    if not host:
        raise ValueError("a sentinel address has an empty host")
    if not port_text:
        return host, DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError("a sentinel address has no valid port (host:port, port 1-65535)")
    return host, int(port_text)
