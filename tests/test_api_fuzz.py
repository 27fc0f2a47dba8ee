"""The API fuzzed from its own OpenAPI schema (schemathesis) against a real pool: whatever a
client sends, the answer is never a 5xx (but a documented 503), and every error is an OpenAI
error object (Anthropic's on the Messages API's routes). Bounded examples per operation so CI
stays fast."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from router.dialects.anthropic_errors import speaks_anthropic
from tests.conftest import SHARED_POOL_ENV, SHARED_POOL_OVERRIDES
from tests.pool_fixture import running_pool

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

# Generated token budgets are clamped so a fuzzed request costs the tiny model milliseconds;
# every other field is fuzzed as the schema allows (and past it).
MAX_FUZZED_TOKENS = 16
ERROR_FIELDS = {"message", "type", "param", "code"}
EXAMPLES = 40  # per operation


@pytest.fixture(scope="module")
def fuzz_pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The shared pool's settings but for the default token budget: a generated body that leaves
    out max_tokens (or sends null) is fuzzed as it is, and still costs only MAX_FUZZED_TOKENS."""
    overrides = {
        **SHARED_POOL_OVERRIDES,
        "worker": {**SHARED_POOL_OVERRIDES["worker"], "default_max_tokens": MAX_FUZZED_TOKENS},
    }
    work = tmp_path_factory.mktemp("fuzz-pool")
    with running_pool(tiny_model_dir, work, env=SHARED_POOL_ENV, overrides=overrides) as pool:
        yield pool


def _aim(body: Any, model: str) -> None:
    """Most fuzzed bodies name the served model, so they reach tokenization and a worker."""
    if not isinstance(body, dict):
        return
    if "model" in body and isinstance(body["model"], str) and not body["model"].startswith("x"):
        body["model"] = model
    for key in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(key), int) and body[key] > MAX_FUZZED_TOKENS:
            body[key] = MAX_FUZZED_TOKENS


def test_no_request_makes_a_server_error(fuzz_pool: Any) -> None:
    # schemathesis' own pytest plugin does not run under this pytest: its strategies are driven
    # with hypothesis directly, one operation after another.
    schema = schemathesis.openapi.from_url(f"{fuzz_pool.url}/openapi.json")
    model = fuzz_pool.model_path.name
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def answers_without_a_5xx(case: Any) -> None:
            _aim(case.body, model)
            response = case.call(base_url=fuzz_pool.url, timeout=60)
            status = response.status_code
            assert status < 500, (case.path, status, response.text[:500], case.body)
            if case.method.upper() == "HEAD":  # GET's status and headers, never a body
                assert response.content == b"", (case.path, response.content[:200])
            elif status >= 400 and speaks_anthropic(case.path):  # Anthropic's error shape
                body = response.json()
                assert set(body) == {"type", "error"} and body["type"] == "error", body
                assert set(body["error"]) == {"type", "message"}, body
                assert isinstance(body["error"]["message"], str) and body["error"]["message"]
            elif status >= 400:
                body = response.json()
                assert set(body) == {"error"}, body
                assert set(body["error"]) >= ERROR_FIELDS, body
                assert isinstance(body["error"]["message"], str) and body["error"]["message"]

        answers_without_a_5xx()
