"""API keys: every route of the real router app (over real HTTP, against a real Redis) needs
`Authorization: Bearer <key>` except /health and, while it is open, /metrics; the admin route
takes only an admin key once one is configured; a bad key file stops the start; no key is ever
logged. No worker runs here."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.routing import iter_route_contexts

from mlxcel_pool.redis_server import EmbeddedRedis, free_port
from mlxcel_pool.supervisor import settings_env
from router.app import create_app
from router.dialects.anthropic_errors import speaks_anthropic
from router.edge.auth import ADMIN_PATHS, Access, Denial, load_access
from shared.config import AuthConfig, ConfigError, Settings, load_settings
from tests.test_router_validation import RouterServer, assert_error

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

REPO = Path(__file__).resolve().parent.parent
# Distinct, unlikely strings: finding one in a log can only mean it was logged.
ENV_KEYS = ("sk-env-one-7f3a91", "sk-env-two-c48d02")
FILE_KEY = "sk-file-5e61b7"
ADMIN_KEY = "sk-admin-9b20e4"
ALL_KEYS = (*ENV_KEYS, FILE_KEY, ADMIN_KEY)
RESET = "/v1/cache/reset"


def _write_keys(path: Path, *keys: str) -> Path:
    lines = ["# keys for the test pool", "", *(f"  {k}  " for k in keys), "", "# end", ""]
    path.write_text("\n".join(lines))
    return path


def _env_settings(redis_url: str, model_dir: Path, tmp: Path, **env: str) -> Settings:
    """Settings the way an operator gives them: through the environment."""
    base = {"REDIS_URL": redis_url, "MLXCEL_MODEL": str(model_dir), "MLXCEL_CACHE_DIR": str(tmp)}
    return load_settings(environ={**base, **env})


def _serve(settings: Settings) -> tuple[RouterServer, FastAPI]:
    server = RouterServer(settings).start()
    app = server.server.config.app
    assert isinstance(app, FastAPI)
    return server, app


@pytest.fixture(scope="module")
def keyed(
    redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, FastAPI]]:
    """Regular keys from the environment (two, with stray spaces) and a key file; an admin key
    from its own file; /metrics left open (the default)."""
    tmp = tmp_path_factory.mktemp("keyed")
    settings = _env_settings(
        redis_server.url,
        tiny_model_dir,
        tmp,
        MLXCEL_API_KEYS=f" {ENV_KEYS[0]} ,{ENV_KEYS[1]}",
        MLXCEL_API_KEY_FILE=str(_write_keys(tmp / "keys.txt", FILE_KEY)),
        MLXCEL_ADMIN_API_KEY_FILE=str(_write_keys(tmp / "admin.txt", ADMIN_KEY)),
    )
    server, app = _serve(settings)
    yield server.url, app
    server.stop()


@pytest.fixture(scope="module")
def plain(
    redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """One regular key, no admin key, /metrics closed."""
    tmp = tmp_path_factory.mktemp("plain")
    settings = _env_settings(
        redis_server.url,
        tiny_model_dir,
        tmp,
        MLXCEL_API_KEYS=ENV_KEYS[0],
        MLXCEL_METRICS_OPEN="false",
    )
    server, _ = _serve(settings)
    yield server.url
    server.stop()


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _call(
    url: str, method: str, path: str, headers: dict[str, str] | None = None
) -> httpx.Response:
    body: dict[str, Any] | None = {} if method in ("POST", "PUT", "PATCH") else None
    return httpx.request(method, url + path, json=body, headers=headers, timeout=10)


def assert_401(resp: httpx.Response) -> None:
    assert resp.headers.get("www-authenticate") == "Bearer", (resp.status_code, resp.text)
    if resp.request.method == "HEAD":  # the same answer, without its body
        assert resp.status_code == 401
        return
    if speaks_anthropic(resp.request.url.path):  # the Messages API's routes: Anthropic's shape
        assert resp.status_code == 401
        body = resp.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] == "authentication_error" and body["error"]["message"]
        return
    err = assert_error(resp, 401)
    assert err == {**err, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}


def _every_route(app: FastAPI) -> list[tuple[str, str]]:
    """(method, path) for every method of every registered route; path parameters filled in.
    FastAPI keeps an included router as one entry of `app.routes`: `iter_route_contexts`
    flattens them (with their prefixes), so the walk sees what routing matches."""
    calls = []
    for route in iter_route_contexts(app.routes):
        path = re.sub(r"\{[^}]*\}", "x", route.path or "")
        calls += [(method, path) for method in sorted(route.methods or ())]
    return calls


# --- every route ---------------------------------------------------------------------------------


def test_every_route_needs_a_key_but_health_and_open_metrics(
    keyed: tuple[str, FastAPI], redis_url: str
) -> None:
    url, app = keyed
    calls = _every_route(app)
    # The walk really covers the app (an empty one would pass everything below).
    expected = {
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/messages/count_tokens"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("GET", "/metrics"),
        ("GET", "/v1/cache/stats"),
        ("POST", RESET),
    }
    assert expected <= set(calls)
    for method, path in calls:
        anonymous = _call(url, method, path)
        if path in ("/health", "/metrics"):
            assert anonymous.status_code != 401, (method, path)
        else:
            assert_401(anonymous)
        # An admin key may call everything; a regular one everything but the admin routes.
        assert _call(url, method, path, _bearer(ADMIN_KEY)).status_code not in (401, 403)
        regular = _call(url, method, path, _bearer(ENV_KEYS[0])).status_code
        assert regular == 403 if path in ADMIN_PATHS else regular not in (401, 403), (method, path)


def test_a_path_without_a_route_is_401_not_404(keyed: tuple[str, FastAPI]) -> None:
    url, _ = keyed
    assert_401(httpx.get(f"{url}/v1/no-such-route"))
    assert httpx.get(f"{url}/v1/no-such-route", headers=_bearer(FILE_KEY)).status_code == 404


# --- which keys ----------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ALL_KEYS)
def test_every_configured_key_is_accepted(keyed: tuple[str, FastAPI], key: str) -> None:
    url, _ = keyed
    resp = httpx.get(f"{url}/v1/models", headers=_bearer(key))
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "list"


def test_a_key_may_come_as_x_api_key(keyed: tuple[str, FastAPI]) -> None:
    """Anthropic's clients send their key as `x-api-key`: accepted on every route, and the
    Messages API's refusals are in Anthropic's error shape."""
    url, _ = keyed
    resp = httpx.get(f"{url}/v1/models", headers={"x-api-key": FILE_KEY})
    assert resp.status_code == 200, resp.text
    body = {"model": "x", "messages": []}
    refused = httpx.post(f"{url}/v1/messages/count_tokens", json=body)
    assert_401(refused)
    assert "x-api-key" in refused.json()["error"]["message"]
    wrong = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": "sk-wrong"})
    assert_401(wrong)
    # With the key, the request reaches the route: its own 400 (no max_tokens), Anthropic's.
    passed = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": ENV_KEYS[1]})
    assert passed.status_code == 400, passed.text
    assert passed.json()["error"]["type"] == "invalid_request_error"


def test_the_scheme_is_case_insensitive(keyed: tuple[str, FastAPI]) -> None:
    url, _ = keyed
    resp = httpx.get(f"{url}/v1/models", headers={"Authorization": f"bearer {ENV_KEYS[1]}"})
    assert resp.status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": f"Bearer {ENV_KEYS[0]}x"},
        {"Authorization": f"Bearer {ENV_KEYS[0][:-1]}"},
        {"Authorization": "Bearer sk-wrong"},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {ENV_KEYS[0]}"},
        {"Authorization": f"Token {ENV_KEYS[0]}"},
        {"Authorization": ENV_KEYS[0]},
        {"X-API-Key": "sk-wrong"},
        {"X-API-Key": ""},
        {"Authorization": "Bearer sk-wrong", "X-API-Key": ENV_KEYS[0]},  # Authorization decides
        {"Authorization": "Bearer # keys for the test pool"},  # a comment line is no key
    ],
    ids=[
        "missing",
        "longer",
        "shorter",
        "wrong",
        "empty",
        "basic",
        "token",
        "bare",
        "x-api-key-wrong",
        "x-api-key-empty",
        "bearer-wins",
        "comment",
    ],
)
def test_missing_wrong_and_foreign_credentials_are_401(
    keyed: tuple[str, FastAPI], headers: dict[str, str]
) -> None:
    url, _ = keyed
    resp = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert_401(resp)
    # The error names no key, neither the one sent nor a configured one.
    assert not any(k in resp.text for k in ALL_KEYS)


# --- admin and metrics ---------------------------------------------------------------------------


def test_admin_route_takes_only_the_admin_key_when_one_is_configured(
    keyed: tuple[str, FastAPI], redis_url: str
) -> None:
    url, _ = keyed
    for key in (*ENV_KEYS, FILE_KEY):
        err = assert_error(httpx.post(url + RESET, headers=_bearer(key)), 403)
        assert err["code"] == "insufficient_permissions"
        assert err["type"] == "invalid_request_error"
    assert_401(httpx.post(url + RESET))
    assert_401(httpx.post(url + RESET, headers=_bearer("sk-wrong")))
    assert httpx.post(url + RESET, headers=_bearer(ADMIN_KEY)).status_code == 200


def test_a_regular_key_may_reset_when_no_admin_key_is_configured(
    plain: str, redis_url: str
) -> None:
    assert_401(httpx.post(plain + RESET))
    assert httpx.post(plain + RESET, headers=_bearer(ENV_KEYS[0])).status_code == 200


def test_metrics_open_by_default(keyed: tuple[str, FastAPI]) -> None:
    url, _ = keyed
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/health").status_code == 503  # no worker, but not 401


def test_metrics_closed_when_metrics_open_is_false(plain: str) -> None:
    assert_401(httpx.get(f"{plain}/metrics"))
    assert httpx.get(f"{plain}/metrics", headers=_bearer(ENV_KEYS[0])).status_code == 200
    assert httpx.get(f"{plain}/health").status_code == 503


def test_the_decision_table() -> None:
    def access(**auth: str) -> Access:
        return load_access(AuthConfig.model_validate(auth))

    bearer = "Bearer {}".format
    off = access()
    assert not off.enabled
    assert all(off.check(p, None) is None for p in ("/v1/models", RESET, "/metrics", "/nope"))
    # Admin keys only: the API stays open, the admin route is locked.
    admin_only = access(admin_api_keys=ADMIN_KEY)
    assert admin_only.check("/v1/models", None) is None
    assert admin_only.check(RESET, None) is Denial.MISSING_KEY
    assert admin_only.check(RESET, bearer("sk-wrong")) is Denial.INVALID_KEY
    assert admin_only.check(RESET, bearer(ADMIN_KEY)) is None
    both = access(api_keys=FILE_KEY, admin_api_keys=ADMIN_KEY, metrics_open="false")
    assert both.check(RESET, bearer(FILE_KEY)) is Denial.NOT_ADMIN
    assert both.check("/metrics", f"Basic {FILE_KEY}") is Denial.WRONG_SCHEME
    assert both.check("/metrics", bearer(ADMIN_KEY)) is None
    assert both.check("/metrics", None, ADMIN_KEY) is None  # x-api-key
    assert both.check(RESET, None, FILE_KEY) is Denial.NOT_ADMIN
    assert both.check(RESET, bearer("sk-wrong"), ADMIN_KEY) is Denial.INVALID_KEY
    assert both.check("/health", None) is None
    assert not any(k in repr(both) for k in ALL_KEYS)


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("var", ["MLXCEL_API_KEY_FILE", "MLXCEL_ADMIN_API_KEY_FILE"])
def test_a_missing_key_file_is_a_startup_error_naming_the_variable(
    tmp_path: Path, tiny_model_dir: Path, var: str
) -> None:
    missing = tmp_path / "no-such-keys.txt"
    settings = _env_settings(
        "redis://127.0.0.1:1/0", tiny_model_dir, tmp_path, **{var: str(missing)}
    )
    with pytest.raises(ConfigError, match=var) as info:
        create_app(settings)
    assert str(missing) in str(info.value)


def test_a_key_file_without_keys_or_with_a_bad_line_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# no key yet\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_access(AuthConfig(api_key_file=str(empty)))
    bad = tmp_path / "bad.txt"
    bad.write_text(f"# ok\n{FILE_KEY} # inline comment\n")
    with pytest.raises(ConfigError, match="line 2") as info:
        load_access(AuthConfig(api_key_file=str(bad)))
    assert FILE_KEY not in str(info.value)
    with pytest.raises(ConfigError, match="MLXCEL_ADMIN_API_KEYS: key 2 ") as info:
        load_access(AuthConfig(admin_api_keys=f"{ADMIN_KEY},has space"))
    assert ADMIN_KEY not in str(info.value) and "has space" not in str(info.value)


def test_cli_router_with_a_missing_key_file_exits_2(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "REDIS_URL": "redis://127.0.0.1:1/0",
        "MLXCEL_CACHE_DIR": str(tmp_path),
        "MLXCEL_API_KEY_FILE": str(tmp_path / "gone.txt"),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "mlxcel_pool", "router"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "MLXCEL_API_KEY_FILE" in proc.stderr and "gone.txt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_keys_reach_children_but_never_a_repr() -> None:
    settings = Settings(auth=AuthConfig(api_keys=",".join(ENV_KEYS), admin_api_keys=ADMIN_KEY))
    env = settings_env(settings)
    assert env["MLXCEL_API_KEYS"] == ",".join(ENV_KEYS)
    assert env["MLXCEL_ADMIN_API_KEYS"] == ADMIN_KEY
    assert env["MLXCEL_METRICS_OPEN"] == "true"
    # The router's uvicorn processes get the settings as JSON (router.serve): the keys survive.
    copy = Settings.model_validate_json(settings.model_dump_json())
    assert copy.auth.api_keys.get_secret_value() == ",".join(ENV_KEYS)
    assert not any(k in repr(settings) or k in str(settings) for k in ALL_KEYS)


# --- logs ----------------------------------------------------------------------------------------


def test_startup_log_says_auth_is_on_and_never_shows_a_key(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = _env_settings(
        redis_url,
        tiny_model_dir,
        tmp_path,
        MLXCEL_API_KEYS=",".join(ENV_KEYS),
        MLXCEL_ADMIN_API_KEYS=ADMIN_KEY,
    )
    server, _ = _serve(settings)
    try:
        httpx.get(f"{server.url}/v1/models", headers=_bearer("sk-wrong-but-logged?"))
        httpx.get(f"{server.url}/v1/models", headers=_bearer(ENV_KEYS[0]))
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("API keys:")]
    assert lines == [
        "API keys: on (2 key(s); 1 admin key(s) for /v1/cache/reset); open: /health, /metrics"
    ]
    assert not any(k in caplog.text for k in (*ALL_KEYS, "sk-wrong-but-logged?"))


def test_served_router_honours_keys_and_logs_no_key(
    redis_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`mlxcel-pool router` as operators run it: the keys reach uvicorn's processes through
    the settings they inherit, and its log says auth is on without showing a key."""
    port = free_port()
    log_path = tmp_path / "router.log"
    env = {
        **os.environ,
        "REDIS_URL": redis_url,
        "MLXCEL_MODEL": str(tiny_model_dir),
        "MLXCEL_CACHE_DIR": str(tmp_path),
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path / "prom"),
        "MLXCEL_API_KEY_FILE": str(_write_keys(tmp_path / "keys.txt", *ENV_KEYS)),
    }
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlxcel_pool",
                "router",
                "--port",
                str(port),
                "--processes",
                "2",
            ],
            cwd=REPO,
            env=env,
            start_new_session=True,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, "router did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 503:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        # Several requests, so both processes are likely to answer some.
        for _ in range(6):
            assert_401(httpx.get(f"{url}/v1/models", timeout=5))
            ok = httpx.get(f"{url}/v1/models", headers=_bearer(ENV_KEYS[1]), timeout=5)
            assert ok.status_code == 200
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log_path.read_text()
    assert text.count("API keys: on (2 key(s)") == 2, text  # once per router process
    assert not any(k in text for k in ALL_KEYS)
