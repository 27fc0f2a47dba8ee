"""POST /v1/embeddings end to end: one pool with the tiny generation model's worker and one
worker of the tiny embedding model (devmodel.embedding), asked through the openai SDK; every
vector is checked against the same pooled forward pass computed in this process."""

from __future__ import annotations

import base64
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import redis
from rq import Worker

from shared import keys
from tests.pool_fixture import TINY_MODEL, running_pool, wait_for

pytestmark = pytest.mark.pool  # starts processes: left out of `make test-fast`

EMBED_WORKER = "emb1"
DIMENSIONS = 128  # the tiny model's hidden size
CONTEXT = 2048  # its max_position_embeddings


@pytest.fixture(scope="module")
def pool(
    tiny_model_dir: Path, tiny_embed_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Any]:
    work = tmp_path_factory.mktemp("embeddings-pool")
    with running_pool(tiny_model_dir, work, overrides={"router": {"processes": 1}}) as pool:
        pool.start_worker(EMBED_WORKER, model=tiny_embed_model_dir)
        r = redis.Redis.from_url(pool.redis_url)
        wait_for(lambda: r.exists(keys.worker_info(EMBED_WORKER)), 60, "embedding worker up")
        yield pool


@pytest.fixture(scope="module")
def embed_model(tiny_embed_model_dir: Path) -> str:
    return tiny_embed_model_dir.name


@pytest.fixture(scope="module")
def client(pool: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{pool.url}/v1", api_key="unused", max_retries=0)


class Reference:
    """The worker's computation in this process: the same tokenizer and pooled forward pass."""

    def __init__(self, model_dir: Path) -> None:
        from mlx_lm import load

        from router.admission.tokenization import load_tokenizer
        from worker.embedding.model import EmbeddingModel
        from worker.embedding.task import embedding_task

        model, _ = load(str(model_dir))
        task = embedding_task(model_dir)
        assert task is not None
        self.model = EmbeddingModel(model, task.pooling, DIMENSIONS)
        self.tokenizer = load_tokenizer(model_dir, 1)

    def tokens(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def of(self, item: str | list[int]) -> np.ndarray:
        ids = self.tokens(item) if isinstance(item, str) else item
        return self.model.embed([ids])[0]


@pytest.fixture(scope="module")
def reference(tiny_embed_model_dir: Path) -> Reference:
    return Reference(tiny_embed_model_dir)


def _vectors(resp: Any) -> list[np.ndarray]:
    assert [d.index for d in resp.data] == list(range(len(resp.data)))
    assert all(d.object == "embedding" for d in resp.data)
    return [np.asarray(d.embedding, dtype=np.float32) for d in resp.data]


def _post(pool: Any, body: dict[str, Any], path: str = "/v1/embeddings") -> httpx.Response:
    return httpx.post(f"{pool.url}{path}", json=body, timeout=60)


def _error(resp: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_models_lists_both_and_the_worker_registers_its_task(pool: Any, embed_model: str) -> None:
    ids = [m["id"] for m in httpx.get(f"{pool.url}/v1/models").json()["data"]]
    assert TINY_MODEL in ids and embed_model in ids
    r = redis.Redis.from_url(pool.redis_url, decode_responses=True)
    info = r.hgetall(keys.worker_info(EMBED_WORKER))
    assert info["model"] == embed_model
    assert info["task"] == "embedding"
    assert info["embedding_dimensions"] == str(DIMENSIONS)
    names = [w.name for w in Worker.all(connection=redis.Redis.from_url(pool.redis_url))]
    assert keys.rq_worker_name(EMBED_WORKER) in names  # `rq info` and rq-dashboard list it
    health = httpx.get(f"{pool.url}/health").json()
    assert {w["worker_id"]: w["model"] for w in health["workers"]}[EMBED_WORKER] == embed_model


def test_a_string_is_its_pooled_normalized_hidden_state(
    client: openai.OpenAI, embed_model: str, reference: Reference
) -> None:
    text = "the quick brown fox jumps over the lazy dog"
    resp = client.embeddings.create(model=embed_model, input=text, encoding_format="float")
    (vec,) = _vectors(resp)
    assert vec.shape == (DIMENSIONS,)
    assert abs(float(np.linalg.norm(vec)) - 1.0) < 1e-5
    np.testing.assert_allclose(vec, reference.of(text), atol=1e-5)
    assert resp.model == embed_model
    n = len(reference.tokens(text))
    assert resp.usage.prompt_tokens == n and resp.usage.total_tokens == n


def test_a_list_keeps_its_order_and_identical_inputs_agree(
    client: openai.OpenAI, embed_model: str, reference: Reference
) -> None:
    texts = ["same words", "a much longer input than the others, with many more tokens", "x"]
    texts.append("same words")
    vecs = _vectors(client.embeddings.create(model=embed_model, input=texts))
    assert len(vecs) == 4
    for vec, text in zip(vecs, texts, strict=True):
        np.testing.assert_allclose(vec, reference.of(text), atol=1e-5)
    # The same input inside one batch, and alone in its own request.
    np.testing.assert_allclose(vecs[0], vecs[3], atol=1e-6)
    (alone,) = _vectors(client.embeddings.create(model=embed_model, input="same words"))
    np.testing.assert_allclose(vecs[0], alone, atol=1e-6)
    assert not np.allclose(vecs[0], vecs[1], atol=1e-3)  # different inputs, different vectors


def test_token_ids_one_list_or_many(
    client: openai.OpenAI, embed_model: str, reference: Reference
) -> None:
    (one,) = _vectors(client.embeddings.create(model=embed_model, input=[5, 6, 7, 8]))
    np.testing.assert_allclose(one, reference.of([5, 6, 7, 8]), atol=1e-5)
    many = _vectors(client.embeddings.create(model=embed_model, input=[[5, 6, 7, 8], [9, 10]]))
    np.testing.assert_allclose(many[0], one, atol=1e-6)
    np.testing.assert_allclose(many[1], reference.of([9, 10]), atol=1e-5)


def test_base64_decodes_to_the_same_floats(
    pool: Any, client: openai.OpenAI, embed_model: str
) -> None:
    text = "base64 carries little-endian float32"
    floats = _vectors(
        client.embeddings.create(model=embed_model, input=text, encoding_format="float")
    )
    # The SDK asks for base64 by default and decodes it itself.
    (decoded,) = _vectors(client.embeddings.create(model=embed_model, input=text))
    np.testing.assert_array_equal(decoded, floats[0])
    raw = _post(pool, {"model": embed_model, "input": text, "encoding_format": "base64"}).json()
    data = raw["data"][0]["embedding"]
    assert isinstance(data, str)
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode(data), dtype="<f4"), floats[0])


def test_concurrent_requests_batched_together_each_get_their_own(
    client: openai.OpenAI, embed_model: str, reference: Reference
) -> None:
    texts = [f"request number {i} " * (i + 1) for i in range(8)]
    got: dict[int, np.ndarray] = {}

    def ask(i: int) -> None:
        got[i] = _vectors(client.embeddings.create(model=embed_model, input=texts[i]))[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(len(texts)))
    for i, text in enumerate(texts):
        np.testing.assert_allclose(got[i], reference.of(text), atol=1e-5)


def test_dimensions_must_be_the_models(pool: Any, embed_model: str) -> None:
    ok = _post(pool, {"model": embed_model, "input": "hi", "dimensions": DIMENSIONS})
    assert ok.status_code == 200, ok.text
    err = _error(_post(pool, {"model": embed_model, "input": "hi", "dimensions": 64}))
    assert err["param"] == "dimensions" and "128" in err["message"]


@pytest.mark.parametrize(
    ("inputs", "named"),
    [
        ("", "input[0]"),
        (["fine", ""], "input[1]"),
        ([], "empty"),
        ([[1, 2], []], "input[1]"),
        ([[1, 2], [10**6]], "input[1]"),
        (["x"] * 2049, "2049"),
    ],
)
def test_bad_inputs_are_400s_naming_the_input(
    pool: Any, embed_model: str, inputs: Any, named: str
) -> None:
    err = _error(_post(pool, {"model": embed_model, "input": inputs}))
    assert err["param"] == "input" and named in err["message"]


def test_an_input_past_the_context_is_a_400_naming_its_index(pool: Any, embed_model: str) -> None:
    err = _error(_post(pool, {"model": embed_model, "input": [[1, 2], [7] * (CONTEXT + 1)]}))
    assert err["code"] == "context_length_exceeded" and err["param"] == "input"
    assert "input[1]" in err["message"] and str(CONTEXT) in err["message"]
    fits = _post(pool, {"model": embed_model, "input": [[7] * CONTEXT]})
    assert fits.status_code == 200, fits.text


def test_models_serve_only_their_own_task(pool: Any, embed_model: str) -> None:
    err = _error(_post(pool, {"model": TINY_MODEL, "input": "hi"}))
    assert err["param"] == "model" and "generation model" in err["message"]
    chat = {"model": embed_model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    err = _error(_post(pool, chat, "/v1/chat/completions"))
    assert err["param"] == "model" and "embedding model" in err["message"]
    completion = {"model": embed_model, "prompt": "hi", "max_tokens": 4}
    err = _error(_post(pool, completion, "/v1/completions"))
    assert err["param"] == "model" and embed_model in err["message"]
    err = _error(_post(pool, {"model": "no-such-model", "input": "hi"}), 404)
    assert err["code"] == "model_not_found"
    # The generation model still generates beside it.
    done = _post(pool, {"model": TINY_MODEL, "prompt": [5, 6], "max_tokens": 2}, "/v1/completions")
    assert done.status_code == 200, done.text


def _enqueue_raw(pool: Any, model: str, job_id: str, kwargs: dict[str, Any]) -> None:
    """A job on the model's queue as no router would write it (the worker's own checks)."""
    from rq import Queue

    from shared.embedding_wire import EMBED_JOB_FUNC
    from shared.wire import MsgpackSerializer

    r = redis.Redis.from_url(pool.redis_url)
    queue = Queue(keys.model_queue_name(model), connection=r, serializer=MsgpackSerializer)
    queue.enqueue_call(EMBED_JOB_FUNC, kwargs=kwargs, job_id=job_id, result_ttl=60)


def _reply(pool: Any, job_id: str) -> Any:
    from shared.embedding_wire import EmbeddingReply
    from shared.wire import STREAM_FIELD

    r = redis.Redis.from_url(pool.redis_url)
    stream = keys.request_stream(job_id)
    entries = wait_for(lambda: r.xrange(stream), 30, f"the reply to {job_id}")
    assert len(entries) == 1
    return EmbeddingReply.from_wire(entries[0][1][STREAM_FIELD])


@pytest.mark.parametrize(
    ("inputs", "reason"),
    [([], "inputs"), ([["a"]], "ints"), ([[7] * (CONTEXT + 1)], "context"), ([[10**6]], "vocab")],
)
def test_the_worker_fails_a_job_no_router_would_write(
    pool: Any, embed_model: str, inputs: list[Any], reason: str
) -> None:
    from rq.job import Job, JobStatus

    from shared.wire import MsgpackSerializer

    job_id = f"raw-{uuid.uuid4().hex}"
    payload = {"request_id": job_id, "model": embed_model, "inputs": inputs}
    _enqueue_raw(pool, embed_model, job_id, {"embedding": payload})
    reply = _reply(pool, job_id)
    assert reply.kind == "error" and reply.error_type == "invalid_request_error"
    assert reason in reply.error and reply.worker_id == EMBED_WORKER
    r = redis.Redis.from_url(pool.redis_url)
    job = Job.fetch(job_id, connection=r, serializer=MsgpackSerializer)
    assert wait_for(lambda: job.get_status(refresh=True) == JobStatus.FAILED, 10, "failed")
    # The worker goes on serving.
    resp = _post(pool, {"model": embed_model, "input": "still here"})
    assert resp.status_code == 200, resp.text


def test_pool_views_and_cache_reset_count_the_embedding_worker(pool: Any) -> None:
    stats = httpx.get(f"{pool.url}/v1/cache/stats")
    assert stats.status_code == 200, stats.text
    metrics = httpx.get(f"{pool.url}/metrics")
    assert metrics.status_code == 200 and EMBED_WORKER in metrics.text
    reset = httpx.post(f"{pool.url}/v1/cache/reset", timeout=30).json()
    assert reset["workers"][EMBED_WORKER]["replied"] is True
    assert reset["cleared"] is True
