"""Which bodies are admitted on the event loop (router/admission/inline.py): short plain ones;
anything with a grammar, logprobs, a template of its own or a long prompt goes to a thread."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from router.admission.admit import AdmissionContext
from router.admission.inline import INLINE_PROMPT_SIZE, admits_inline
from router.admission.tokenization import TokenizerPool, load_tokenizer
from router.edge.openai_types import ChatCompletionRequest, CompletionRequest
from router.pool_view.model_catalog import LIVE_CACHE_S, ModelCatalog
from router.redis_batch import RedisBatch
from shared import keys
from shared.block_hash import BlockHasher

SHORT = "Say hello."
MODEL = "inline-model"
LONG = "x" * (INLINE_PROMPT_SIZE + 1)


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest(**{"messages": [{"role": "user", "content": SHORT}], **fields})


def test_short_plain_requests_are_admitted_in_line() -> None:
    assert admits_inline(CompletionRequest(prompt=SHORT))
    assert admits_inline(CompletionRequest(prompt=list(range(INLINE_PROMPT_SIZE))))
    assert admits_inline(CompletionRequest(prompt=[SHORT], n=3))
    assert admits_inline(chat(max_tokens=8, temperature=0.5))
    parts = [{"type": "text", "text": SHORT}, {"type": "text", "text": SHORT}]
    assert admits_inline(ChatCompletionRequest(messages=[{"role": "user", "content": parts}]))


@pytest.mark.parametrize(
    "body",
    [
        CompletionRequest(prompt=LONG),
        CompletionRequest(prompt=list(range(INLINE_PROMPT_SIZE + 1))),
        CompletionRequest(prompt=[list(range(INLINE_PROMPT_SIZE + 1))]),
        CompletionRequest(prompt=SHORT, logprobs=2),
        CompletionRequest(prompt=SHORT, response_format={"type": "json_object"}),
        ChatCompletionRequest(messages=[{"role": "user", "content": LONG}]),
        ChatCompletionRequest(
            messages=[
                {"role": "system", "content": LONG[:1500]},
                {"role": "user", "content": LONG[:600]},
            ]
        ),
        chat(logprobs=True),
        chat(response_format={"type": "json_object"}),
        chat(tools=[{"type": "function", "function": {"name": "f"}}]),
        chat(chat_template="{{ messages }}"),
        chat(chat_template_kwargs={"enable_thinking": False}),
    ],
    ids=lambda b: type(b).__name__,
)
def test_long_or_costly_requests_go_to_a_thread(body: Any) -> None:
    assert not admits_inline(body)


def test_another_apis_body_is_not_admitted_in_line() -> None:
    assert not admits_inline({"prompt": SHORT})


def test_a_tokenizer_pool_with_every_copy_out_is_not_idle() -> None:
    """What ModelCatalog.ready asks before admitting on the event loop: a free copy, else the
    request goes to a thread instead of waiting on the loop."""
    pool = TokenizerPool(["copy-1", "copy-2"])
    assert pool.idle()
    with pool.borrow(), pool.borrow():
        assert not pool.idle()
    assert pool.idle()


def _catalog(tiny_model_dir: Path, redis_url: str) -> ModelCatalog:
    """The tiny model's catalog over the tests' Redis, not started."""
    return ModelCatalog(
        AdmissionContext(MODEL, load_tokenizer(tiny_model_dir), 16),
        0,
        redis.Redis.from_url(redis_url),
        BlockHasher(16),
        1,
        RedisBatch(aioredis.Redis.from_url(redis_url)),
    )


def test_a_steady_load_keeps_the_roster_view_fresh_and_a_light_one_reads_it_once(
    tiny_model_dir: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ModelCatalog.ready admits on the loop only with the roster's view fresh. A view past half
    its life is read again in the background (a request soon after finds it fresh); an expired
    one is left to the request's own admission in a thread, not read a second time."""
    catalog = _catalog(tiny_model_dir, redis_url)
    reads: list[float] = []
    show = catalog._show
    monkeypatch.setattr(catalog, "_show", lambda *a: reads.append(1) or show(*a))

    async def run() -> list[tuple[bool, int]]:
        seen = [(catalog.ready(MODEL), len(reads))]  # never read: expired, left to the request
        assert catalog._refresh is None  # not read in the background as well
        catalog.live()  # what that request's admission reads
        seen.append((catalog.ready(MODEL), len(reads)))
        catalog._live_at -= LIVE_CACHE_S * 0.6  # past half its life
        seen.append((catalog.ready(MODEL), len(reads)))
        while catalog._refresh is not None:
            await asyncio.sleep(0.01)
        seen.append((catalog.ready(MODEL), len(reads)))
        await catalog.stop()
        await catalog._batch.stop()
        return seen

    assert asyncio.run(run()) == [(False, 0), (True, 1), (False, 1), (True, 2)]


def test_a_started_catalog_keeps_the_view_fresh_through_a_quiet_spell(
    tiny_model_dir: Path, redis_url: str
) -> None:
    """With its background read running, a request after a quiet spell longer than the view's
    life (a single user's next request) finds the view fresh: admitted on the loop, with no
    roster read of its own before its placement."""
    catalog = _catalog(tiny_model_dir, redis_url)

    async def run() -> list[bool]:
        await catalog.start()
        seen = []
        try:
            for _ in range(3):
                await asyncio.sleep(LIVE_CACHE_S * 1.2)  # quiet: no request reads the roster
                seen.append(catalog.ready(MODEL))
        finally:
            await catalog.stop()
        await catalog._batch.stop()
        return seen

    assert asyncio.run(run()) == [True, True, True]


def test_a_listing_and_a_model_the_view_lacks_see_the_roster_as_it_is_now(
    tiny_model_dir: Path, redis_url: str
) -> None:
    """The view may be a moment old (the watch reads it every WATCH_S): GET /v1/models and a
    lookup of a model the view lacks read the roster again, so a worker that just registered is
    listed and found, not refused as unknown."""
    r = redis.Redis.from_url(redis_url)
    catalog = _catalog(tiny_model_dir, redis_url)
    assert "just-registered" not in catalog.live()  # the view, read now
    wid = "w-just-registered"
    info = {
        "model": "just-registered",
        "model_dir": str(tiny_model_dir),
        "task": "embedding",
        "embedding_dimensions": "8",
    }
    r.hset(keys.worker_info(wid), mapping=info)
    r.expire(keys.worker_info(wid), keys.LIVENESS_TTL_S)
    r.sadd(keys.workers_roster(), wid)
    try:
        assert "just-registered" not in catalog.live()  # the view, a moment old
        assert catalog.embedding_model("just-registered") is None
        ctx = catalog.get("just-registered")  # not in the view: looked up as it is now
        assert ctx is not None and ctx.model_id == "just-registered"
        assert catalog.embedding_model("just-registered") is not None  # the view, read now
        r.hset(keys.worker_info(wid), "model", "renamed")
        assert "renamed" in catalog.listed()  # a listing reads the roster too
    finally:
        r.srem(keys.workers_roster(), wid)
        r.delete(keys.worker_info(wid))


def test_the_watch_reads_on_the_loop_what_a_thread_reads(
    tiny_model_dir: Path, redis_url: str
) -> None:
    """The watch's read (one script through the batch, on the event loop) shows the view a
    thread's read shows: the same live models, their workers, tasks and dates, and no dead
    worker. A directory it has not dated yet is left to a thread's read (its mtime is a stat
    on the disk), not shown undated."""
    r = redis.Redis.from_url(redis_url)
    catalog = _catalog(tiny_model_dir, redis_url)
    registered = {
        "w-loop-a": {"model": "loop-gen", "model_dir": str(tiny_model_dir), "host": "h1"},
        "w-loop-b": {"model": "loop-gen", "model_dir": str(tiny_model_dir), "host": "h2"},
        "w-loop-c": {
            "model": "loop-embed",
            "model_dir": str(tiny_model_dir),
            "task": "embedding",
            "embedding_dimensions": "8",
        },
        "w-loop-dead": {"model": "loop-dead", "model_dir": str(tiny_model_dir)},
    }
    for wid, info in registered.items():
        r.hset(keys.worker_info(wid), mapping=info)
        if wid != "w-loop-dead":  # no TTL: never a live worker's hash
            r.expire(keys.worker_info(wid), keys.LIVENESS_TTL_S)
        r.sadd(keys.workers_roster(), wid)

    async def run() -> tuple[Any, Any, Any]:
        undated = await catalog._read_on_loop()
        on_thread = await asyncio.to_thread(catalog.live, True)
        on_loop = await catalog._read_on_loop()
        await catalog._batch.stop()
        return undated, on_thread, on_loop

    try:
        undated, on_thread, on_loop = asyncio.run(run())
    finally:
        for wid in registered:
            r.srem(keys.workers_roster(), wid)
            r.delete(keys.worker_info(wid))
    assert undated is None
    assert on_loop == on_thread
    assert on_loop is catalog.live()  # shown: the view from now on
    gen, embed = on_loop["loop-gen"], on_loop["loop-embed"]
    assert gen.workers == (("w-loop-a", "h1"), ("w-loop-b", "h2"))
    assert gen.created == int(tiny_model_dir.stat().st_mtime) > 0
    assert (embed.embeds, embed.dimensions) == (True, 8)
    assert "loop-dead" not in on_loop
