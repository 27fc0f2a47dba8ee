"""The whole pool, end to end: real Redis, real router processes, real worker, real HTTP.

Greedy output through the pool must equal mlx-lm's own generation on the same model and prompt,
token for token (compared as the text and the token count a client sees), with 8 different prompts
in flight at once, streamed and not, completions and chat.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.pool_fixture import sse_events
from tests.streams import SHARED_QUEUE, TINY_MODEL

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

MAX_TOKENS = 24
PROMPTS = [
    "The quick brown fox",
    "Once upon a time in a land far away",
    "import numpy as np\n",
    "Redis is an in-memory data store that",
    "1, 2, 3, 4, 5,",
    "Dear diary, today I",
    "The capital of France is",
    "In the beginning there was",
]


@pytest.fixture(scope="module")
def pool(shared_pool: Any) -> Any:
    return shared_pool  # the session's pool: this module needs no settings of its own


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": prompt}]


async def _one(client: httpx.AsyncClient, kind: str, prompt: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": TINY_MODEL,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    if kind == "chat":
        body["messages"] = _messages(prompt)
        resp = await client.post("/v1/chat/completions", json=body)
    else:
        body["prompt"] = prompt
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    if not stream:
        data = resp.json()
        choice = data["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        return {"text": text, "usage": data["usage"], "finish": choice["finish_reason"]}
    chunks = sse_events(resp)
    text, finish = "", None
    for c in chunks:
        for ch in c["choices"]:
            text += (ch["delta"].get("content") or "") if kind == "chat" else ch["text"]
            finish = ch.get("finish_reason") or finish
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    return {"text": text, "usage": usage, "finish": finish}


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("stream", [False, True])
def test_concurrent_greedy_output_equals_mlx_lm(pool, mlx_reference, kind, stream) -> None:
    tokenizer = mlx_reference.tokenizer

    async def all_at_once() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(base_url=pool.url, timeout=120) as client:
            return await asyncio.gather(*(_one(client, kind, p, stream) for p in PROMPTS))

    results = asyncio.run(all_at_once())
    for prompt, got in zip(PROMPTS, results, strict=True):
        if kind == "chat":
            ids = tokenizer.apply_chat_template(_messages(prompt), add_generation_prompt=True)
        else:
            ids = tokenizer.encode(prompt)
        want_text, want_n = mlx_reference.run(ids, MAX_TOKENS)
        assert got["text"] == want_text, prompt
        assert got["usage"]["completion_tokens"] == want_n
        assert got["usage"]["prompt_tokens"] == len(ids)
        assert got["usage"]["total_tokens"] == len(ids) + want_n
        assert "cached_tokens" in got["usage"]["prompt_tokens_details"]
        assert got["finish"] in ("length", "stop")


def test_health_models_and_rq_info_show_the_truth(pool) -> None:
    import redis
    from rq.registry import FinishedJobRegistry

    from shared import keys
    from shared.wire import MsgpackSerializer

    health = httpx.get(f"{pool.url}/health", timeout=10)
    assert health.status_code == 200
    models = httpx.get(f"{pool.url}/v1/models", timeout=10).json()
    assert [m["id"] for m in models["data"]] == [TINY_MODEL]
    resp = httpx.post(
        f"{pool.url}/v1/completions",
        timeout=60,
        json={"model": TINY_MODEL, "prompt": "hi", "max_tokens": 3},
    )
    assert resp.status_code == 200
    info = subprocess.run(
        [str(Path(sys.executable).parent / "rq"), "info", "-u", pool.redis_url, SHARED_QUEUE],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "mlxcel-w1" in info.stdout, info.stdout + info.stderr
    # Routed onto w1's own queue (the only live worker), and finished there.
    own = keys.worker_queue_name("w1")
    assert own in info.stdout, info.stdout
    r = redis.Redis.from_url(pool.redis_url)
    finished = FinishedJobRegistry(own, connection=r, serializer=MsgpackSerializer)
    assert finished.count >= 1


def _complete(pool, **body: Any) -> dict[str, Any]:
    body = {"model": TINY_MODEL, "max_tokens": 16, **body}
    resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_seeded_sampling_is_reproducible(pool) -> None:
    sampled = {"prompt": "Once upon a time", "temperature": 1.0, "top_p": 0.9}
    a = _complete(pool, seed=1234, **sampled)["choices"][0]["text"]
    b = _complete(pool, seed=1234, **sampled)["choices"][0]["text"]
    others = {_complete(pool, seed=s, **sampled)["choices"][0]["text"] for s in (1, 2, 3)}
    assert a == b
    assert others - {a}, "different seeds should not all sample the same text"


def test_stop_string_cuts_the_output(pool, mlx_reference) -> None:
    prompt = "The quick brown fox"
    full, _ = mlx_reference.run(mlx_reference.tokenizer.encode(prompt), 24)
    stop = full[6:9]
    want = full[: full.index(stop)]
    out = _complete(pool, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert out["choices"][0]["text"] == want
    assert out["choices"][0]["finish_reason"] == "stop"


def test_what_openai_clients_leave_out_or_send_as_null_takes_the_defaults(pool) -> None:
    """`model` omitted is the pool's own model (as vLLM, llama.cpp and mlx_lm.server do);
    `n: null` and `stream: null` are OpenAI's defaults (1, not streamed), not a 400."""
    nulls = {"model": None, "n": None, "stream": None}
    for body in ({"prompt": "hi", "max_tokens": 2}, {"prompt": "hi", "max_tokens": 2, **nulls}):
        resp = httpx.post(f"{pool.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["model"] == TINY_MODEL
        assert resp.json()["usage"]["completion_tokens"] >= 1
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(
        f"{pool.url}/v1/chat/completions",
        timeout=60,
        json={"messages": messages, "max_tokens": 2, "stream": None},
    )
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion", chat.text
    one = httpx.get(f"{pool.url}/v1/models/mlxcel-tiny-s0", timeout=10)
    assert one.status_code == 200 and one.json()["id"] == TINY_MODEL
    missing = httpx.get(f"{pool.url}/v1/models/nope", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_n_choices_and_prompt_lists_run_as_sequences_of_their_own(pool) -> None:
    """`n` and a list of prompts: each choice its own sequence, under its `index` (prompt by
    prompt, n each); greedy choices equal the lone request's text; a seeded choice i samples as
    a lone request with seed + i; the usage counts each prompt once."""
    alone = _complete(pool, prompt="The quick brown fox", max_tokens=6, temperature=0)
    many = _complete(pool, prompt="The quick brown fox", max_tokens=6, temperature=0, n=3)
    assert [c["index"] for c in many["choices"]] == [0, 1, 2]
    assert {c["text"] for c in many["choices"]} == {alone["choices"][0]["text"]}
    assert many["usage"]["prompt_tokens"] == alone["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == 3 * alone["usage"]["completion_tokens"]

    sampled = _complete(pool, prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=1.0, seed=7, n=2)
    second = _complete(pool, prompt="1, 2, 3, 4, 5,", max_tokens=8, temperature=1.0, seed=8)
    assert sampled["choices"][1]["text"] == second["choices"][0]["text"]

    other = _complete(pool, prompt="import numpy as np\n", max_tokens=6, temperature=0)
    both = _complete(
        pool,
        prompt=["The quick brown fox", "import numpy as np\n"],
        max_tokens=6,
        temperature=0,
        n=2,
    )
    texts = [c["text"] for c in sorted(both["choices"], key=lambda c: c["index"])]
    assert texts == [alone["choices"][0]["text"]] * 2 + [other["choices"][0]["text"]] * 2
    assert both["usage"]["prompt_tokens"] == (
        alone["usage"]["prompt_tokens"] + other["usage"]["prompt_tokens"]
    )

    body = {
        "model": TINY_MODEL,
        "prompt": "The quick brown fox",
        "max_tokens": 6,
        "temperature": 0,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{pool.url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    chunks = [json.loads(ln[6:]) for ln in lines[:-1]]
    streamed = {0: "", 1: ""}
    for c in chunks:
        for choice in c["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == {0: alone["choices"][0]["text"], 1: alone["choices"][0]["text"]}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == (
        2 * alone["usage"]["completion_tokens"]
    )
    chat = httpx.post(
        f"{pool.url}/v1/chat/completions",
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
            "temperature": 0,
            "n": 2,
        },
    )
    assert chat.status_code == 200, chat.text
    messages = chat.json()["choices"]
    assert [m["index"] for m in messages] == [0, 1]
    assert messages[0]["message"]["content"] == messages[1]["message"]["content"]


def test_a_non_streamed_request_writes_its_tokens_a_few_at_a_time(pool) -> None:
    """Its client reads nothing before the end, so the worker writes its tokens to the request's
    stream in groups (worker.broker.event_hold), and the same answer comes back. Each write of
    a stream sets its TTL once (docs/redis-keys.md): a streamed request's stream is written
    every step, one token each, a non-streamed one's a few times in all. The count is Redis's
    EXPIREs, the heartbeat's included (three a second): both requests take about as long, so
    the difference is the stream's writes saved."""
    r = redis.Redis.from_url(pool.redis_url)
    body = {"model": TINY_MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 96, "temperature": 0}
    body["ignore_eos"] = True

    def writes(stream: bool) -> tuple[int, dict[str, Any]]:
        before = r.info("commandstats").get("cmdstat_expire", {}).get("calls", 0)
        resp = httpx.post(f"{pool.url}/v1/completions", json={**body, "stream": stream}, timeout=60)
        assert resp.status_code == 200, resp.text
        after = r.info("commandstats").get("cmdstat_expire", {}).get("calls", 0)
        if stream:
            chunks = sse_events(resp)
            answer = {"text": "".join(ch["text"] for c in chunks for ch in c["choices"])}
        else:
            answer = {"text": resp.json()["choices"][0]["text"]}
            assert resp.json()["usage"]["completion_tokens"] == 96
        return after - before, answer

    streamed_writes, streamed = writes(True)
    held_writes, held = writes(False)
    assert held == streamed
    assert streamed_writes >= 96  # a streamed request: a write a token
    assert streamed_writes - held_writes >= 48, (held_writes, streamed_writes)
