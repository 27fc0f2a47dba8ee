"""A live worker's model whose files the router's host lacks: the router says so once in its log
when the worker registers, leaves the model out of GET /v1/models, and answers every request
for it (each API that loads a tokenizer) 503 `model_files_missing` with what to copy where and
no retry; once the files are there it serves the model without a restart.

The shared pool gets two more workers, of copies of the tiny generation and embedding models;
each copy is renamed away once its worker has loaded it, so this host (the router's) lacks it.
"""

from __future__ import annotations

import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from router.admission.tokenization import (
    ModelFilesMissing,
    TokenizerLoadError,
    load_tokenizer,
)
from shared import keys
from tests.pool_fixture import TINY_MODEL, wait_for

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

GEN = "mfm-gen"  # the copies' directory names: the ids their workers register
EMB = "mfm-emb"
WORKERS = {GEN: "mfm-g", EMB: "mfm-e"}
HOST = socket.gethostname()  # the router's host, and the workers' (one machine)


@dataclass
class Refused:
    pool: Any
    dirs: dict[str, Path]  # model id -> the directory its worker loaded (gone while refused)

    def post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.post(f"{self.pool.url}{path}", json=body, timeout=60)

    def router_lines(self, *needles: str) -> list[str]:
        log = self.pool.logs("router").splitlines()
        return [line for line in log if all(n in line for n in needles)]


@pytest.fixture(scope="module")
def refused(
    shared_pool: Any,
    tiny_model_dir: Path,
    tiny_embed_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Refused]:
    root = tmp_path_factory.mktemp("model-files-missing")
    dirs = {GEN: root / GEN, EMB: root / EMB}
    shutil.copytree(tiny_model_dir, dirs[GEN])
    shutil.copytree(tiny_embed_model_dir, dirs[EMB])
    r = redis.Redis.from_url(shared_pool.redis_url)
    started: list[str] = []
    try:
        for model, wid in WORKERS.items():
            shared_pool.start_worker(wid, model=dirs[model])
            started.append(wid)
        wait_for(
            lambda: all(r.exists(keys.worker_info(w)) for w in started), 120, "both workers up"
        )
        for path in dirs.values():  # loaded: the router's host now lacks the files
            path.rename(_away(path))
        refused = Refused(shared_pool, dirs)
        # No request yet: each router process's watch of the roster finds them by itself.
        processes = shared_pool.settings.router.processes
        for model in dirs:
            wait_for(
                lambda m=model: len(refused.router_lines("ERROR", f"'{m}'")) == processes,
                30,
                f"{model} logged by every router process",
            )
        yield refused
    finally:
        for wid in started:
            shared_pool.stop_worker(wid)
        # The shared pool as it was: only its own worker alive.
        wait_for(lambda: not any(r.exists(keys.worker_info(w)) for w in started), 30, "gone")
        r.close()


def _away(path: Path) -> Path:
    return path.with_name(path.name + "-away")


def _assert_files_missing(resp: httpx.Response, model: str, path: Path) -> dict[str, Any]:
    """The 503's OpenAI error object names the model, the path, this host and the fix; it tells
    SDKs not to retry and sends no Retry-After (no retry soon brings the files)."""
    assert resp.status_code == 503, resp.text
    assert resp.headers["x-should-retry"] == "false"
    assert "retry-after" not in resp.headers
    error = resp.json()["error"]
    assert error["type"] == "server_error" and error["code"] == "model_files_missing", error
    _assert_names_the_fix(error["message"], model, path)
    return error


def _assert_names_the_fix(message: str, model: str, path: Path) -> None:
    assert f"'{model}'" in message, message
    assert f"worker {WORKERS[model]} on host {HOST}" in message, message
    assert f"on this router's host ({HOST}) there is no directory {path}" in message, message
    assert "tokenizer.json, tokenizer_config.json" in message and "config.json" in message
    assert f"to {path} on every router host, or mount it there" in message, message
    assert "build-model" not in message and "MLXCEL_MODEL" not in message, message


def test_the_router_logs_it_once_per_process_when_the_worker_registers(refused: Refused) -> None:
    processes = refused.pool.settings.router.processes
    for model, path in refused.dirs.items():  # the fixture waited for one line per process
        (line, *_) = refused.router_lines("ERROR", f"'{model}'")
        _assert_names_the_fix(line, model, path)
        assert "answers its requests 503 model_files_missing" in line
    for _ in range(3):  # requests are refused without logging again
        refused.post("/v1/completions", {"model": GEN, "prompt": "hi", "max_tokens": 2})
    assert len(refused.router_lines("ERROR", f"'{GEN}'")) == processes


def test_every_api_answers_503_model_files_missing(refused: Refused) -> None:
    gen, emb = refused.dirs[GEN], refused.dirs[EMB]
    chat = {"model": GEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (
        ("/v1/completions", {"model": GEN, "prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", chat),
        ("/v1/chat/completions", {**chat, "stream": True}),
        ("/v1/responses", {"model": GEN, "input": "hi", "max_output_tokens": 2}),
        ("/tokenize", {"model": GEN, "prompt": "hi"}),
    ):
        _assert_files_missing(refused.post(path, body), GEN, gen)
    embed = refused.post("/v1/embeddings", {"model": EMB, "input": "hi"})
    _assert_files_missing(embed, EMB, emb)

    # The Messages API: the same refusal in Anthropic's error shape, with the same headers.
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        resp = refused.post(path, {**chat, "max_tokens": 2})
        assert resp.status_code == 503 and resp.headers["x-should-retry"] == "false", resp.text
        assert resp.json()["type"] == "error", resp.text
        _assert_names_the_fix(resp.json()["error"]["message"], GEN, gen)


def test_the_openai_sdk_does_not_retry_it(refused: Refused) -> None:
    sent: list[httpx.Request] = []
    http = httpx.Client(event_hooks={"request": [sent.append]})
    client = openai.OpenAI(
        base_url=f"{refused.pool.url}/v1", api_key="unused", max_retries=2, http_client=http
    )
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model=GEN, prompt="hi", max_tokens=2)
    assert caught.value.status_code == 503 and caught.value.code == "model_files_missing"
    assert len(sent) == 1  # a 5xx is retried twice unless the server says not to
    http.close()


def test_models_and_health_show_it(refused: Refused) -> None:
    url = refused.pool.url
    listed = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    assert TINY_MODEL in listed and GEN not in listed and EMB not in listed, listed
    # Asked for by id: the same 503, not a 404 that would say the model does not exist.
    one = httpx.get(f"{url}/v1/models/{GEN}", timeout=10)
    _assert_files_missing(one, GEN, refused.dirs[GEN])
    unknown = refused.post("/v1/completions", {"model": "no-such", "prompt": "hi"})
    assert unknown.status_code == 404 and f"'{GEN}'" not in unknown.json()["error"]["message"]

    for _ in range(4):  # each router process shows what it refuses
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert set(health["router_errors"]) == {GEN, EMB}, health["router_errors"]
        _assert_names_the_fix(health["router_errors"][GEN], GEN, refused.dirs[GEN])


def test_once_the_files_are_there_the_model_is_served(refused: Refused) -> None:
    for path in refused.dirs.values():
        _away(path).rename(path)
    url = refused.pool.url
    prompt = {"model": GEN, "prompt": "hi", "max_tokens": 2, "temperature": 0}

    def answered(path: str, body: dict[str, Any]) -> httpx.Response | None:
        resp = refused.post(path, body)
        return resp if resp.status_code == 200 else None

    # No restart: each router process notices the files within its next looks.
    served = wait_for(lambda: answered("/v1/completions", prompt), 30, "the model served")
    assert served.json()["model"] == GEN
    embed = {"model": EMB, "input": "hi"}
    embedded = wait_for(lambda: answered("/v1/embeddings", embed), 30, "the embeddings served")
    assert embedded.json()["data"][0]["embedding"]
    listed = [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=10).json()["data"]]
    assert GEN in listed and EMB in listed, listed
    assert refused.router_lines(f"serving model '{GEN}' too", str(refused.dirs[GEN]))

    def clear() -> bool:  # on every router process: four looks in a row
        return all(
            httpx.get(f"{url}/health", timeout=10).json()["router_errors"] == {} for _ in range(4)
        )

    wait_for(clear, 10, "no router errors")


def test_the_routers_own_model_hint_names_the_fix_for_its_directory(tmp_path: Path) -> None:
    # The built-in model's directory: build it there.
    builtin = tmp_path / "models" / "mlxcel-tiny-s0"
    with pytest.raises(ModelFilesMissing, match=r"mlxcel-pool build-model --out \S+mlxcel-tiny"):
        load_tokenizer(builtin)
    # Any other directory: copy the tokenizer's files there (or name another one).
    other = tmp_path / "my-model"
    with pytest.raises(ModelFilesMissing) as caught:
        load_tokenizer(other)
    message = str(caught.value)
    assert f"({HOST}) there is no directory {other}" in message, message
    assert "tokenizer.json, tokenizer_config.json" in message and f"to {other}" in message
    assert "build-model" not in message
    # A directory with the weights only: what it lacks, by name.
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"")
    with pytest.raises(TokenizerLoadError, match="has no config.json and no tokenizer.json"):
        load_tokenizer(other)
