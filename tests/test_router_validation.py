"""Router input validation, discovery endpoints, cache stats merge and /metrics, over real HTTP
against a real Redis and the real tiny model's tokenizer (no worker runs here)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from mlxcel_pool.redis_server import EmbeddedRedis, free_port
from router.app import create_app
from shared import keys, liveness
from shared.cache_stats import SPEC_FIELDS
from shared.config import ModelConfig, RedisConfig, RouterConfig, Settings
from shared.model_facts import model_id_for
from shared.reject import REJECT_REASONS

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`


class RouterServer:
    """The real app under uvicorn in a background thread, on a free port."""

    def __init__(self, settings: Settings) -> None:
        self.port = free_port()
        config = uvicorn.Config(
            create_app(settings), host="127.0.0.1", port=self.port, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> RouterServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("router did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def router_settings(
    redis_url: str, model_dir: Path, tmp: Path, request_timeout_s: float = 600
) -> Settings:
    return Settings(
        redis=RedisConfig(url=redis_url),
        router=RouterConfig(request_timeout_s=request_timeout_s),
        model=ModelConfig(path=str(model_dir), cache_dir=str(tmp)),
    )


@pytest.fixture(scope="module")
def router_url(
    redis_server: EmbeddedRedis, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("router")
    server = RouterServer(router_settings(redis_server.url, tiny_model_dir, tmp)).start()
    yield server.url
    server.stop()


@pytest.fixture
def client(router_url: str, redis_url: str) -> Iterator[httpx.Client]:
    # redis_url flushes the database for each test.
    with httpx.Client(base_url=router_url, timeout=10) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(tiny_model_dir: Path) -> str:
    return model_id_for(tiny_model_dir)


def assert_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# --- bad input -----------------------------------------------------------------------------------


def test_malformed_json_is_400(client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    resp = client.post("/v1/completions", content=b'{"model": "x", "prompt": ', headers=headers)
    assert assert_error(resp, 400)["type"] == "invalid_request_error"


def test_body_must_be_an_object(client: httpx.Client) -> None:
    assert_error(client.post("/v1/chat/completions", json=[1, 2]), 400)


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", "5"), ("temperature", "hot"), ("stream", "yes"), ("prompt", 5), ("n", 1.5)],
)
def test_wrong_types_are_400_naming_the_param(
    client: httpx.Client, model_id: str, field: str, value: Any
) -> None:
    body = {"model": model_id, "prompt": "hello", field: value}
    err = assert_error(client.post("/v1/completions", json=body), 400)
    assert err["param"] == field


def test_wrong_type_in_a_message(client: httpx.Client, model_id: str) -> None:
    body = {"model": model_id, "messages": [{"role": "robot", "content": "hi"}]}
    err = assert_error(client.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "messages.0.role"


def test_unknown_model_is_404(client: httpx.Client) -> None:
    resp = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"})
    assert assert_error(resp, 404, "model")["code"] == "model_not_found"
    resp = client.post(
        "/v1/chat/completions",
        json={"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert assert_error(resp, 404)["code"] == "model_not_found"


@pytest.mark.parametrize("max_tokens", [0, -3, 10**9])
def test_max_tokens_out_of_range(client: httpx.Client, model_id: str, max_tokens: int) -> None:
    body = {"model": model_id, "prompt": "hello", "max_tokens": max_tokens}
    assert_error(client.post("/v1/completions", json=body), 400, "max_tokens")
    chat = {"model": model_id, "messages": [{"role": "user", "content": "hi"}]}
    resp = client.post("/v1/chat/completions", json={**chat, "max_completion_tokens": max_tokens})
    assert_error(resp, 400, "max_completion_tokens")


def test_prompt_too_long_for_the_context(client: httpx.Client, model_id: str) -> None:
    context = 2048  # the tiny model's max_position_embeddings
    body = {"model": model_id, "prompt": [7] * (context - 5), "max_tokens": 10}
    err = assert_error(client.post("/v1/completions", json=body), 400)
    assert err["code"] == "context_length_exceeded"
    # With no max_tokens the default is clamped to the room left, but no room at all still fails.
    body = {"model": model_id, "prompt": [7] * context}
    err = assert_error(client.post("/v1/completions", json=body), 400)
    assert err["code"] == "context_length_exceeded"
    chat = {"model": model_id, "messages": [{"role": "user", "content": "hello " * 3000}]}
    err = assert_error(client.post("/v1/chat/completions", json=chat), 400)
    assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        ("/v1/completions", {"prompt": []}, "prompt"),
        ("/v1/completions", {"prompt": ["a"] * 17}, "prompt"),
        ("/v1/completions", {"prompt": [10**7]}, "prompt"),
        ("/v1/completions", {"prompt": [5, -1, 6]}, "prompt"),
        ("/v1/completions", {"prompt": [[5, 6], [7, 10**7]]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "n": 17}, "n"),
        ("/v1/completions", {"prompt": ["a"] * 5, "n": 13}, "n"),  # 65 choices
        ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 17}, "stop"),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
        ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "chat_template": "{% for %}"},
            "chat_template",
        ),
        (
            "/v1/completions",
            {"prompt": "hi", "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "stream": False, "stream_options": {}},
            "stream_options",
        ),
    ],
)
def test_invalid_requests_are_400(
    client: httpx.Client, model_id: str, path: str, body: dict[str, Any], param: str
) -> None:
    assert_error(client.post(path, json={"model": model_id, **body}), 400, param)


# Every case below was a 500 or a dead worker on the code before issue 10's fixes.

CHAT = [{"role": "user", "content": "hi"}]


def post_raw(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    """POST `body` as JSON text with every non-ASCII character escaped, so a lone surrogate goes
    out as the JSON escape `\ud800` (httpx's `json=` would fail to encode it as UTF-8)."""
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("seed", "message"),
    [
        (-1, "[0, 2**63 - 1]"),
        (2**64, "[0, 2**63 - 1]"),
        (2**63, "[0, 2**63 - 1]"),
        ("7", "integer"),
        (True, "integer"),
        (1.5, "integer"),
    ],
)
def test_seed_must_be_an_int_in_range(
    client: httpx.Client, model_id: str, seed: Any, message: str
) -> None:
    body = {"model": model_id, "prompt": "hello", "seed": seed, "temperature": 1}
    assert (
        message in assert_error(client.post("/v1/completions", json=body), 400, "seed")["message"]
    )
    chat = {"model": model_id, "messages": CHAT, "seed": seed}
    assert_error(client.post("/v1/chat/completions", json=chat), 400, "seed")


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("prompt", "ab\ud800", "prompt"),
        ("prompt", ["\ud800"], "prompt.0"),
        ("stop", "\ud800", "stop"),
        ("stop", ["ok", "\udfff"], "stop.1"),
        ("user", "\ud800", "user"),
        ("prompt_cache_key", "\ud800", "prompt_cache_key"),
        ("model", "\ud800", "model"),
    ],
)
def test_lone_surrogates_in_a_completion_are_400(
    client: httpx.Client, model_id: str, field: str, value: Any, param: str
) -> None:
    body = {"model": model_id, "prompt": "hello", field: value}
    err = assert_error(post_raw(client, "/v1/completions", body), 400, param)
    assert "surrogate" in err["message"]


@pytest.mark.parametrize(
    ("message", "extra", "param"),
    [
        ({"role": "user", "content": "\ud800"}, {}, "messages.0.content"),
        (
            {"role": "user", "content": [{"type": "text", "text": "a\ud800"}]},
            {},
            "messages.0.content.0.text",
        ),
        ({"role": "user", "content": "hi", "name": "\ud800"}, {}, "messages.0.name"),
        ({"role": "user", "content": "hi"}, {"user": "\ud800"}, "user"),
        ({"role": "user", "content": "hi"}, {"stop": ["\ud800"]}, "stop.0"),
        ({"role": "user", "content": "hi"}, {"chat_template": "\ud800"}, "chat_template"),
    ],
)
def test_lone_surrogates_in_a_chat_are_400(
    client: httpx.Client, model_id: str, message: dict[str, Any], extra: dict[str, Any], param: str
) -> None:
    body = {"model": model_id, "messages": [message], **extra}
    err = assert_error(post_raw(client, "/v1/chat/completions", body), 400, param)
    assert "surrogate" in err["message"]


def test_a_surrogate_pair_is_text(client: httpx.Client, model_id: str) -> None:
    # "\ud83d\ude00" is one character (U+1F600) in JSON; only an unpaired half is refused.
    body = {"model": model_id, "prompt": "hi", "stop": "\U0001f600", "n": 17}
    text = json.dumps(body)
    assert "\\ud83d\\ude00" in text
    resp = client.post(
        "/v1/completions", content=text, headers={"content-type": "application/json"}
    )
    assert_error(resp, 400, "n")  # validation got past the stop string


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop", 5),
        ("stop", [5]),
        ("stop", ["a", None]),
        ("stop", [f"s{i}" for i in range(17)]),
        ("temperature", "hot"),
        ("temperature", -0.5),
        ("temperature", True),
        ("top_p", 1.5),
        ("top_p", "1"),
        ("max_tokens", True),
        ("max_tokens", 2.0),
        ("n", "1"),
        ("n", 0),
        ("user", 5),
        ("prompt_cache_key", ["k"]),
        ("stream_options", 5),
    ],
)
def test_bad_sampling_values_are_400(
    client: httpx.Client, model_id: str, field: str, value: Any
) -> None:
    body = {"model": model_id, "prompt": "hello", field: value}
    err = assert_error(client.post("/v1/completions", json=body), 400)
    assert err["param"] is not None and err["param"].split(".")[0] == field
    chat = {"model": model_id, "messages": CHAT, field: value}
    err = assert_error(client.post("/v1/chat/completions", json=chat), 400)
    assert err["param"] is not None and err["param"].split(".")[0] == field


def test_sixteen_stop_sequences_are_allowed(client: httpx.Client, model_id: str) -> None:
    # 16 passes stop's check, so the request fails later, on n.
    body = {"model": model_id, "prompt": "hi", "stop": [f"s{i}" for i in range(16)], "n": 17}
    assert_error(client.post("/v1/completions", json=body), 400, "n")


@pytest.mark.parametrize(
    "content",
    [
        b"5",
        b'"a string"',
        b"null",
        b"[1, 2]",
        b"true",
        b"",
        b"{",
        b'{"model": NaN',
        b"\xff\xfe{}",
        b'{"model": "\xc3"}',
    ],
)
def test_a_body_that_is_not_a_json_object_is_400(client: httpx.Client, content: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        resp = client.post(path, content=content, headers={"content-type": "application/json"})
        assert assert_error(resp, 400)["type"] == "invalid_request_error"


def test_unknown_route_and_wrong_method(client: httpx.Client) -> None:
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)
    assert_error(client.delete("/v1/models"), 405)


# --- discovery and health ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/metrics", "/health", "/v1/models", "/v1/models/{model}", "/v1/cache/stats"]
)
def test_head_answers_like_get_without_a_body(
    client: httpx.Client, model_id: str, path: str
) -> None:
    # Probes (aiperf's `HEAD /metrics`, load balancers) ask with HEAD: the GET answer, bodiless.
    path = path.format(model=model_id)
    got, head = client.get(path), client.head(path)
    assert head.status_code == got.status_code, (path, head.status_code)
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    # /metrics and /health bodies may change between two calls; their lengths are still sent.
    assert int(head.headers["content-length"]) > 0


def test_models_lists_the_served_model(client: httpx.Client, model_id: str) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [model_id]
    assert body["data"][0]["object"] == "model"


def test_health_is_503_without_workers(client: httpx.Client) -> None:
    resp = client.get("/health")
    assert resp.status_code == 503
    assert resp.json()["workers_alive"] == 0 and resp.json()["queue_depth"] == 0


def test_health_lists_live_workers(client: httpx.Client, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    r.sadd(keys.workers_roster(), "w1", "gone", "stale")
    r.hset(keys.worker_info("w1"), mapping={"pid": "123", "batch_size": "4"})
    r.expire(keys.worker_info("w1"), keys.LIVENESS_TTL_S)  # as a worker's heartbeat leaves it
    # A hash whose last heartbeat is older than DEAD_AFTER_S counts as dead before it expires.
    r.hset(keys.worker_info("stale"), mapping={"pid": "9"})
    r.pexpire(keys.worker_info("stale"), liveness.min_alive_pttl_ms() - 500)
    body = client.get("/health").json()
    assert client.get("/health").status_code == 200
    assert body["workers_alive"] == 1
    assert body["workers"] == [
        {"worker_id": "w1", "queue_depth": 0, "pid": "123", "batch_size": "4"}
    ]


# --- cache stats ---------------------------------------------------------------------------------


def test_cache_stats_with_no_workers(client: httpx.Client) -> None:
    body = client.get("/v1/cache/stats").json()
    assert list(body)[: len(SPEC_FIELDS)] == list(SPEC_FIELDS)
    assert body["hits"] == 0 and body["hit_rate"] == 0.0 and body["entries"] == 0
    assert body["last_reject_reason"] is None and body["workers"] == {}


def _fake_worker(
    r: redis.Redis,
    wid: str,
    alive: bool,
    counters: dict[str, int],
    gauges: dict[str, int],
    reject: dict[str, Any] | None,
) -> None:
    r.sadd(keys.workers_roster(), wid)
    if alive:  # a dead worker's info hash (identity, settings, gauges) has expired
        info = {"pid": "1", **gauges, "enabled": "1", "block_size": "16"}
        r.hset(keys.worker_info(wid), mapping=info)
        r.expire(keys.worker_info(wid), keys.LIVENESS_TTL_S)
    r.hset(keys.worker_cache_counters(wid), mapping=counters)
    if reject:
        last = {f"last_reject_{k}": v for k, v in reject.items()}
        r.hset(keys.worker_cache_counters(wid), mapping=last)


def test_cache_stats_merges_workers(client: httpx.Client, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    _fake_worker(
        r,
        "a",
        True,
        {"hits": 3, "lookups": 4, "reject_disabled": 1},
        {"entries": 2, "bytes": 100},
        {"reason": "disabled", "context_len": "9", "at_unix_ms": "1000"},
    )
    late = {"reason": "oversized", "seq_id": "seq-3", "context_len": "77", "at_unix_ms": "2000"}
    _fake_worker(
        r,
        "b",
        False,
        {"hits": 1, "lookups": 4, "reject_oversized": 2},
        {"entries": 5, "bytes": 500},
        late,
    )
    body = client.get("/v1/cache/stats").json()
    assert body["hits"] == 4 and body["lookups"] == 8 and body["hit_rate"] == 0.5
    assert body["reject_disabled"] == 1 and body["reject_oversized"] == 2
    # The dead worker's counters count; its gauges do not.
    assert body["entries"] == 2 and body["bytes"] == 100
    assert body["enabled"] is True and body["block_size"] == 16
    assert body["last_reject_reason"] == "oversized"
    assert body["last_reject_seq_id"] == "seq-3" and body["last_reject_context_len"] == 77
    assert body["last_reject_worker_id"] == "b"
    assert body["workers_alive"] == 1
    assert body["workers"]["a"]["alive"] is True and body["workers"]["b"]["alive"] is False


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_parse_and_list_every_reject_reason(client: httpx.Client) -> None:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(resp.text)}
    rejects = {
        s.labels["reason"]
        for s in families["mlxcel_prompt_cache_reject"].samples
        if s.name == "mlxcel_prompt_cache_reject_total"
    }
    assert rejects == {r.value for r in REJECT_REASONS}
    assert "mlxcel_queue_depth" in families


def test_missing_model_dir_fails_at_startup_with_a_hint(tmp_path: Path) -> None:
    from router.admission.tokenization import TokenizerLoadError, load_tokenizer

    # The built-in model's directory (where `configured_model_dir` defaults to): build it there.
    with pytest.raises(TokenizerLoadError, match="mlxcel-pool build-model --out"):
        load_tokenizer(tmp_path / "models" / "mlxcel-tiny-s0")
