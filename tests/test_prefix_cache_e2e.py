"""The prefix cache through the whole pool, in dense and in paged storage: a hit skips prefill and
still gives exactly the cold run's greedy output; `cached_tokens` says how much was reused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.pool_fixture import TINY_MODEL, running_pool, wait_for

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

MODEL = TINY_MODEL
MAX_TOKENS = 12


def toks(n: int, start: int = 10) -> list[int]:
    return [start + (i * 13) % 500 for i in range(n)]


@pytest.fixture(scope="module", params=["dense", "paged"])
def pool(request, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    # One test sends its own chat template: this pool's operator allows it.
    env = {
        "MLXCEL_SERVER_DECODE_STORAGE": request.param,
        "MLXCEL_TRUST_REQUEST_CHAT_TEMPLATE": "true",
    }
    with running_pool(tiny_model_dir, tmp_path_factory.mktemp(request.param), env=env) as p:
        p.storage = request.param
        yield p


def post(pool, path: str, body: dict[str, Any]) -> dict[str, Any]:
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0, **body}
    resp = httpx.post(f"{pool.url}{path}", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def cached(out: dict[str, Any]) -> int:
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def reset(pool) -> dict[str, Any]:
    resp = httpx.post(f"{pool.url}/v1/cache/reset", timeout=30)
    assert resp.status_code == 200
    return resp.json()


def stats(pool) -> dict[str, Any]:
    return httpx.get(f"{pool.url}/v1/cache/stats", timeout=10).json()


def test_partial_prefix_hit_equals_cold_run(pool, mlx_reference) -> None:
    reset(pool)
    prefix = toks(80, start=20)
    first = post(pool, "/v1/completions", {"prompt": prefix + toks(8, start=480)})
    assert cached(first) == 0  # cold
    prompt = prefix + toks(8, start=490)
    out = post(pool, "/v1/completions", {"prompt": prompt})
    # Dense keeps APC's whole 16-token blocks of the 80 shared tokens; paged floors to 32.
    assert cached(out) == (80 if pool.storage == "dense" else 64)
    want_text, want_n = mlx_reference.run(prompt, MAX_TOKENS)
    assert out["choices"][0]["text"] == want_text
    assert out["usage"]["completion_tokens"] == want_n


def test_whole_prompt_hit_leaves_exactly_one_token(pool, mlx_reference) -> None:
    reset(pool)
    prompt = toks(65, start=300)  # 64 = 65 - 1 is whole 16- and 32-token blocks
    cold = post(pool, "/v1/completions", {"prompt": prompt})
    warm = post(pool, "/v1/completions", {"prompt": prompt})
    assert cached(cold) == 0 and cached(warm) == 64
    want_text, _ = mlx_reference.run(prompt, MAX_TOKENS)
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"] == want_text
    s = stats(pool)
    assert s["hits"] >= 1 and s["prefix_tokens_reused"] >= 64


def test_multi_turn_chat_reuses_previous_turn(pool, mlx_reference) -> None:
    reset(pool)
    tok = mlx_reference.tokenizer
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 6},
        {"role": "user", "content": "Tell me about Redis streams and consumer groups."},
    ]
    reused = []
    for turn in range(3):
        out = post(pool, "/v1/chat/completions", {"messages": messages})
        ids = tok.apply_chat_template(messages, add_generation_prompt=True)
        want_text, _ = mlx_reference.run(ids, MAX_TOKENS)
        assert out["choices"][0]["message"]["content"] == want_text, turn
        reused.append(cached(out))
        messages += [
            {"role": "assistant", "content": out["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"And what about part {turn + 2}?"},
        ]
    assert reused[0] == 0
    assert all(n >= 32 for n in reused[1:]), reused


def test_another_chat_template_never_reuses_kv(pool) -> None:
    reset(pool)
    messages = [{"role": "user", "content": "A long enough question to fill a few blocks. " * 4}]
    post(pool, "/v1/chat/completions", {"messages": messages})
    assert cached(post(pool, "/v1/chat/completions", {"messages": messages})) > 0
    # Renders the very same tokens, but it is another template: its KV is kept apart.
    tok_template = _default_template(pool)
    other = tok_template + "{# another template #}"
    first = post(pool, "/v1/chat/completions", {"messages": messages, "chat_template": other})
    assert cached(first) == 0
    again = post(pool, "/v1/chat/completions", {"messages": messages, "chat_template": other})
    assert cached(again) > 0
    assert first["usage"]["prompt_tokens"] == again["usage"]["prompt_tokens"]


def _default_template(pool) -> str:
    import json

    cfg = json.loads((Path(pool.model_path) / "tokenizer_config.json").read_text())
    return cfg["chat_template"]


def test_cross_session_prefix_is_shared(pool) -> None:
    reset(pool)
    prompt = toks(70, start=400)
    post(pool, "/v1/completions", {"prompt": prompt, "user": "alice"})
    out = post(pool, "/v1/completions", {"prompt": prompt[:66] + [5, 6], "user": "bob"})
    assert cached(out) >= 32  # a longer cross-session match may serve another session


def test_reset_frees_everything(pool) -> None:
    reset(pool)
    prompt = toks(97, start=500)
    post(pool, "/v1/completions", {"prompt": prompt})
    wait_for(lambda: stats(pool)["entries"] >= 1, 10, "gauges to show the entry")
    before = stats(pool)
    assert before["bytes"] > 0
    if pool.storage == "paged":
        assert before["paged_blocks_live"] > 0 and before["paged_block_size"] == 32
    out = reset(pool)
    assert out["cleared"] is True and out["freed_entries"] >= 1 and out["freed_bytes"] > 0
    after = wait_for(lambda: (s := stats(pool))["entries"] == 0 and s, 10, "empty cache")
    assert after["bytes"] == 0 and after["paged_blocks_live"] == 0
    assert cached(post(pool, "/v1/completions", {"prompt": prompt})) == 0
