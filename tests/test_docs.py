"""The docs/ tables are checked against the code they describe, and keys parse back."""

from __future__ import annotations

import inspect
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest

from shared import keys
from shared.cache_stats import (
    COUNTER_FIELDS,
    GAUGE_FIELDS,
    INFO_FIELDS,
    LAST_REJECT_FIELDS,
    LAST_REJECT_HASH_FIELDS,
    SETTING_FIELDS,
)
from shared.config import DEFAULTS_PATH, ENV_VARS, TRACE_ENV

DOCS = Path(__file__).resolve().parent.parent / "docs"
KEYS_DOC = (DOCS / "redis-keys.md").read_text()
ENV_DOC = (DOCS / "environment-variables.md").read_text()

# Every public function in shared/keys.py except the parser builds a key or a name; listing them
# by introspection means a new key fails this test until it is documented.
BUILDERS: dict[str, Callable[..., str]] = {
    name: fn
    for name, fn in inspect.getmembers(keys, inspect.isfunction)
    if fn.__module__ == keys.__name__ and not name.startswith(("_", "parse_"))
}


def _placeholder_render(fn: Callable[..., str]) -> str:
    """`worker_info` -> `mlxcel:worker:<worker_id>:info` (the doc's notation)."""
    params = inspect.signature(fn).parameters
    return fn(*(f"<{p}>" for p in params))


def test_builders_found() -> None:
    assert {"request_stream", "worker_info", "worker_queue_name", "rq_worker_name"} <= set(BUILDERS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_every_key_builder_is_documented(name: str) -> None:
    pattern = _placeholder_render(BUILDERS[name])
    assert f"`{pattern}`" in KEYS_DOC or pattern in KEYS_DOC, f"{name}: {pattern} not in the doc"


@pytest.mark.parametrize("template", sorted(keys.WORKER_KEY_TEMPLATES.values()))
def test_every_template_is_documented(template: str) -> None:
    assert f"`{template}`" in KEYS_DOC


def test_rq_keys_we_use_are_documented() -> None:
    for pattern in (
        f"rq:queue:{_placeholder_render(keys.model_queue_name)}",
        f"rq:queue:{_placeholder_render(keys.worker_queue_name)}",
        "rq:job:<req_id>",
        f"rq:worker:{_placeholder_render(keys.rq_worker_name)}",
        f"rq:wip:{_placeholder_render(keys.model_queue_name)}",
    ):
        assert f"`{pattern}`" in KEYS_DOC, pattern


@pytest.mark.parametrize(
    "field",
    sorted(
        {
            *COUNTER_FIELDS,
            *GAUGE_FIELDS,
            *SETTING_FIELDS,
            *LAST_REJECT_FIELDS,
            *LAST_REJECT_HASH_FIELDS,
            *INFO_FIELDS,
        }
    ),
)
def test_cache_hash_fields_are_documented(field: str) -> None:
    assert f"`{field}`" in KEYS_DOC


# worker_queue_name and rq_worker_name build rq names, not keys of ours: parse_key skips them.
OUR_KEY_BUILDERS = sorted(
    n for n, fn in BUILDERS.items() if _placeholder_render(fn).startswith(f"{keys.PREFIX}:")
)


@pytest.mark.parametrize("name", OUR_KEY_BUILDERS)
def test_mlxcel_keys_parse_back(name: str) -> None:
    fn = BUILDERS[name]
    args = [f"id{i}" for i, _ in enumerate(inspect.signature(fn).parameters)]
    key = fn(*args)
    parsed = keys.parse_key(key)
    assert parsed.ident == (args[0] if args else "")
    rebuilt = {
        "req": {"stream": keys.request_stream, "cancel": keys.request_cancel},
        "control": {"reply": keys.control_reply},
        "router": {"wake": keys.router_wake, "push": keys.router_push},
        "response": {"state": keys.response_state},
        "worker": {
            "info": keys.worker_info,
            "alive": keys.worker_alive,
            "cache:counters": keys.worker_cache_counters,
            "control": keys.worker_control,
            "reaped": keys.worker_reaped,
            "routed": keys.worker_routed,
            "load": keys.worker_load,
            "prefill": keys.worker_prefill,
            "take": keys.worker_take,
        },
    }
    if parsed.kind == "workers":
        assert key == keys.workers_roster()
    elif parsed.kind == "routing" and parsed.part == "first":
        assert keys.routing_first(parsed.ident) == key
    elif parsed.kind == "routing" and parsed.part == "holders":
        assert keys.routing_holders(parsed.ident) == key
    elif parsed.kind == "routing" and parsed.part == "live":
        assert keys.routing_live(parsed.ident) == key
    elif parsed.kind == "routing":
        built = {
            "stats": keys.routing_stats,
            "canary": keys.routing_canary,
            "rr": keys.routing_cursor,
            "placed": keys.routing_placed,
            "load": keys.routing_load,
            "facts": keys.routing_facts,
        }
        assert built[parsed.part]() == key
    elif parsed.kind == "supervisor":
        assert key == keys.supervisor_restarts()
    elif parsed.part == "blocks":
        assert keys.worker_blocks(parsed.ident, args[1]) == key
    elif parsed.kind == "admission":
        built = {"inflight": keys.admission_inflight, "queued": keys.admission_queued_tokens}
        assert built[parsed.part]() == key
    else:
        assert rebuilt[parsed.kind][parsed.part](parsed.ident) == key


@pytest.mark.parametrize(
    "bad",
    [
        "rq:queue:mlxcel",
        "mlxcelx:req:a:stream",
        "mlxcel:req:a:bogus",
        "mlxcel:req::stream",
        "mlxcel:worker:w1",
        "mlxcel",
        "",
        "MLXCEL:workers",
        "mlxcel:workers:extra",
    ],
)
def test_parse_rejects_foreign_keys(bad: str) -> None:
    with pytest.raises(ValueError):
        keys.parse_key(bad)


@pytest.mark.parametrize("var", sorted(ENV_VARS))
def test_every_env_var_is_documented_with_its_setting(var: str) -> None:
    section, key = ENV_VARS[var]
    rows = [line for line in ENV_DOC.splitlines() if line.startswith(f"| `{var}` |")]
    assert rows, f"{var} missing from docs/environment-variables.md"
    assert f"`{section}.{key}`" in rows[0]


@pytest.mark.parametrize("var", sorted(ENV_VARS))
def test_documented_default_matches_defaults_toml(var: str) -> None:
    section, key = ENV_VARS[var]
    value = tomllib.loads(DEFAULTS_PATH.read_text())[section][key]
    row = next(line for line in ENV_DOC.splitlines() if line.startswith(f"| `{var}` |"))
    default_cell = row.split("|")[3]
    if value == "":
        assert "empty" in default_cell
    else:
        shown = str(value).lower() if isinstance(value, bool) else str(value)
        assert f"`{shown}`" in default_cell, f"{var}: defaults.toml has {value!r}"


@pytest.mark.parametrize(
    "var", [TRACE_ENV, "MLXCEL_OPENBLAS_PATH", "MLXCEL_TEST_CACHE_DIR", "OPENBLAS_THREAD_TIMEOUT"]
)
def test_other_env_vars_are_documented(var: str) -> None:
    assert f"| `{var}` |" in ENV_DOC


def test_trace_rule_is_stated() -> None:
    row = next(line for line in ENV_DOC.splitlines() if line.startswith(f"| `{TRACE_ENV}` |"))
    assert "exact value `1`" in row
