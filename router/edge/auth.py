"""Who may call what: API keys from `[auth]`, checked on every request before any route runs.

`load_access(settings.auth)` reads the keys once at startup into a frozen `Access`; `AuthGate`,
an ASGI middleware, asks it about each request. The gate sits in front of the whole app, so a
route added later is protected without anyone remembering to: only `PUBLIC_PATHS` (and
`/metrics` while `metrics_open`) are reachable without a key, and paths that match no route at
all answer 401 too, never revealing which routes exist.

| path                          | no keys configured | regular keys     | admin keys too |
|-------------------------------|--------------------|------------------|----------------|
| `/health` (`/metrics` open)   | open               | open             | open           |
| `ADMIN_PATHS`                 | open               | any key          | admin key only |
| everything else               | open               | any key          | any key        |

A key is sent as `Authorization: Bearer <key>` or, without that header, as `x-api-key: <key>`
(Anthropic's clients send theirs so). "Any key" is a regular or an admin key; "open" with only
admin keys configured means the API stays open and only the admin routes are locked. A refusal
is a `Denial`; `DENIALS` maps each to its one status and error message (in OpenAI's error body,
or Anthropic's on the Messages API's paths).
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI
from pydantic import SecretStr
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from router.edge.errors import APIError, response_for
from shared.config import ENV_VARS, AuthConfig, ConfigError

# Liveness probes must work without a key: a load balancer has none.
PUBLIC_PATHS = frozenset({"/health"})
METRICS_PATH = "/metrics"
# Routes that act on the whole pool for every client: admin keys only, when any is configured.
ADMIN_PATHS = frozenset({"/v1/cache/reset"})


class Denial(enum.Enum):
    MISSING_KEY = "missing_key"
    WRONG_SCHEME = "wrong_scheme"
    INVALID_KEY = "invalid_key"
    NOT_ADMIN = "not_admin"


_BEARER_HINT = "Send it as 'Authorization: Bearer <key>' (or as 'x-api-key: <key>')."
# Denial -> (status, message, code). No message quotes the token presented: it may be a real key
# sent to the wrong pool, and error bodies end up in client logs.
DENIALS: dict[Denial, tuple[int, str, str]] = {
    Denial.MISSING_KEY: (401, f"You didn't provide an API key. {_BEARER_HINT}", "invalid_api_key"),
    Denial.WRONG_SCHEME: (
        401,
        f"The Authorization header does not use the Bearer scheme. {_BEARER_HINT}",
        "invalid_api_key",
    ),
    Denial.INVALID_KEY: (401, "Incorrect API key provided.", "invalid_api_key"),
    Denial.NOT_ADMIN: (
        403,
        "This route needs an admin API key; the key provided is not one.",
        "insufficient_permissions",
    ),
}


def _digest(key: bytes) -> bytes:
    # Keys are compared as SHA-256 digests: equal lengths, so the comparison's time says nothing
    # about a key's length either, and the process never keeps a key in the clear.
    return hashlib.sha256(key).digest()


def _matches_any(digest: bytes, keys: tuple[bytes, ...]) -> bool:
    # Every key is compared, in constant time each, with no early exit: the time taken does not
    # tell which key matched, or whether one did.
    found = False
    for key in keys:
        found |= hmac.compare_digest(digest, key)
    return found


def bearer_token(authorization: str) -> bytes | None:
    """`Bearer <token>` -> the token's bytes (the scheme is case-insensitive, RFC 7235);
    any other scheme -> None."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    # Starlette decodes headers as latin-1: encoding back gives the bytes the client sent.
    return token.strip().encode("latin-1")


@dataclass(frozen=True)
class Access:
    """The keys (as digests) and the open paths; answers `check(path, authorization)`."""

    keys: tuple[bytes, ...] = field(default=(), repr=False)
    admin_keys: tuple[bytes, ...] = field(default=(), repr=False)
    metrics_open: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.keys or self.admin_keys)

    @property
    def public_paths(self) -> frozenset[str]:
        return (PUBLIC_PATHS | {METRICS_PATH}) if self.metrics_open else PUBLIC_PATHS

    def check(
        self, path: str, authorization: str | None, api_key: str | None = None
    ) -> Denial | None:
        """None when a request for `path` with this Authorization header (else, without one,
        this `x-api-key` header: Anthropic's clients send theirs so) may go on."""
        if path in self.public_paths:
            return None
        admin_only = path in ADMIN_PATHS and bool(self.admin_keys)
        if not admin_only and not self.keys:
            return None
        if authorization is None and api_key is None:
            return Denial.MISSING_KEY
        if authorization is not None:
            token = bearer_token(authorization)
        else:  # latin-1: the bytes the client sent (see bearer_token)
            token = (api_key or "").strip().encode("latin-1")
        if token is None:
            return Denial.WRONG_SCHEME
        digest = _digest(token)
        is_admin = _matches_any(digest, self.admin_keys)
        is_regular = _matches_any(digest, self.keys)
        if is_admin or (is_regular and not admin_only):
            return None
        return Denial.NOT_ADMIN if is_regular else Denial.INVALID_KEY

    def describe(self) -> str:
        """For the startup log: whether auth is on and how many keys, never a key."""
        if not self.enabled:
            return "API keys: off (no api_keys or api_key_file configured); every route is open"
        regular = f"{len(self.keys)} key(s)" if self.keys else "no regular key: the API is open"
        admin = (
            f"{len(self.admin_keys)} admin key(s) for {', '.join(sorted(ADMIN_PATHS))}"
            if self.admin_keys
            else "no admin key: a regular key may call the admin routes"
        )
        return f"API keys: on ({regular}; {admin}); open: {', '.join(sorted(self.public_paths))}"


# --- loading -------------------------------------------------------------------------------------

_VAR_OF = {where: var for var, where in ENV_VARS.items()}


def _where(key: str) -> str:
    """`api_key_file` -> `auth.api_key_file / MLXCEL_API_KEY_FILE`: what an error names."""
    return f"auth.{key} / {_VAR_OF[('auth', key)]}"


def _valid_key(key: str) -> bool:
    # A key must fit in an Authorization header as sent: printable ASCII, no spaces.
    return bool(key) and all(33 <= ord(c) <= 126 for c in key)


def _listed_keys(value: SecretStr, key: str) -> list[str]:
    keys = [k.strip() for k in value.get_secret_value().split(",")]
    keys = [k for k in keys if k]
    for i, k in enumerate(keys, 1):
        if not _valid_key(k):
            # Names the position, never the key: the message goes to a terminal and a log.
            raise ConfigError(f"{_where(key)}: key {i} is not printable ASCII without spaces")
    return keys


def _file_keys(path_text: str, key: str) -> list[str]:
    if not path_text:
        return []
    path = Path(path_text).expanduser()
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"cannot read the key file {path} ({_where(key)}): {reason}") from None
    keys: list[str] = []
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if not _valid_key(text):
            raise ConfigError(
                f"{path} line {number} ({_where(key)}): a key must be printable ASCII without "
                "spaces (comments go on their own line, starting with #)"
            )
        keys.append(text)
    if not keys:
        # A key file with no key would silently leave the API open: refuse to start instead.
        raise ConfigError(f"the key file {path} ({_where(key)}) holds no key")
    return keys


def load_access(auth: AuthConfig) -> Access:
    """Read every configured key (lists and files) once. Raises ConfigError naming the setting
    and its variable for a missing, unreadable or empty key file or a malformed key."""
    keys = _listed_keys(auth.api_keys, "api_keys") + _file_keys(auth.api_key_file, "api_key_file")
    admin_keys = _listed_keys(auth.admin_api_keys, "admin_api_keys") + _file_keys(
        auth.admin_api_key_file, "admin_api_key_file"
    )
    return Access(
        keys=tuple(_digest(k.encode("ascii")) for k in dict.fromkeys(keys)),
        admin_keys=tuple(_digest(k.encode("ascii")) for k in dict.fromkeys(admin_keys)),
        metrics_open=auth.metrics_open,
    )


# --- the gate ------------------------------------------------------------------------------------


def route_path(scope: Scope) -> str:
    """The path routing matches (Starlette's rule): `path` less a mounted `root_path`."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def denial_error(denial: Denial) -> APIError:
    status, message, code = DENIALS[denial]
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return APIError(status, message, "invalid_request_error", None, code, headers)


class AuthGate:
    """ASGI middleware: a request `Access` refuses is answered here, before routing."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        authorization, api_key = headers.get("authorization"), headers.get("x-api-key")
        denial = self.access.check(route_path(scope), authorization, api_key)
        if denial is None:
            await self.app(scope, receive, send)
        elif scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})  # policy violation
        else:
            # In the error shape of the API called (Anthropic's on the Messages API's paths).
            await response_for(scope, denial_error(denial))(scope, receive, send)


def install_auth(app: FastAPI, access: Access) -> None:
    """Put the gate in front of everything added so far: added last, it runs first, so a
    request without a valid key is refused before any other middleware reads its body."""
    app.state.access = access
    if access.enabled:  # no key: the app is exactly as without auth
        app.add_middleware(AuthGate, access=access)
