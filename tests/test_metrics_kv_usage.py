"""The numbers behind mlxcel_kv_cache_usage_perc and the prefix-cache token pair, as the engine
reports them (in-process: the real tiny models, a real PromptCache, no Redis): the running
batch's KV bytes, the byte budget of the store each storage mode fills, and a prompt's cache
hits counted once with its prompt tokens however many choices share it."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.cache_stats import kv_usage
from shared.config import load_settings
from shared.model_facts import model_facts
from tests.test_engine import FakeClock, Model, Run, run_until_done, spec, step_until
from worker.engine.engine import Engine
from worker.main import _prompt_cache

MAX_TOKENS = 8
PROMPT = [(23 + i * 11) % 900 + 5 for i in range(70)]  # 64 of it is whole 16- and 32-token blocks


def _load(model_dir: Path) -> Model:
    from mlx_lm import load

    model, tokenizer = load(str(model_dir))
    facts = model_facts(model_dir)
    return Model(model, tokenizer, facts.model_id, facts.context_length)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Model:
    return _load(tiny_model_dir)


@pytest.fixture(scope="module")
def swa(tiny_swa_model_dir: Path) -> Model:
    return _load(tiny_swa_model_dir)


def _engine(m: Model, storage: str = "auto", **cache: object) -> Engine:
    """An engine with its prompt cache built as worker/main.py builds it."""
    settings = load_settings(
        overrides={
            "worker": {"batch_size": 8, "prefill_batch_size": 8},
            "prompt_cache": {"storage": storage, "min_prefix_tokens": 16, **cache},
        },
        environ={},
    )
    pc, _ = _prompt_cache(settings, m.model, m.model_id, "w-kv")
    return Engine(
        m.model,
        m.tokenizer,
        settings.worker,
        model_id=m.model_id,
        worker_id="w-kv",
        context_length=m.context_length,
        prompt_cache=pc,
        clock=FakeClock().now,
    )


def test_the_running_batch_holds_kv_while_it_runs_and_none_once_done(tiny: Model) -> None:
    engine = _engine(tiny, "dense")
    idle = engine.gauges()
    assert idle["batch_kv_bytes"] == 0 and idle["bytes"] == 0
    assert idle["kv_budget_bytes"] == idle["capacity_bytes"] == 2 * 1024**3
    run = Run()
    run.add(engine.admit(spec("a", PROMPT, MAX_TOKENS)))
    step_until(engine, run, "a", 2)
    running = engine.gauges()
    assert running["batch_kv_bytes"] > 0 and running["bytes"] == 0
    run_until_done(engine, 40, run)
    done = engine.gauges()
    # The finished sequence's KV went to the prompt cache: the batch holds none.
    assert done["batch_kv_bytes"] == 0 and done["bytes"] > 0
    held = done["bytes"] + done["snapshot_bytes"] + done["batch_kv_bytes"]
    assert 0 < kv_usage(held, done["kv_budget_bytes"]) < 1


def test_the_budget_is_the_store_the_mode_fills(tiny: Model, swa: Model) -> None:
    # Paged: the tighter of the byte capacity and the block budget, once a block's size is known.
    paged = _engine(tiny, "paged", paged_block_budget=4)
    assert paged.gauges()["kv_budget_bytes"] == 2 * 1024**3  # no block stored yet
    run = Run()
    run.add(paged.admit(spec("p", PROMPT, MAX_TOKENS)))
    run_until_done(paged, 40, run)
    pool = paged.prompt_cache.store.pool
    assert pool is not None and pool.block_nbytes > 0
    assert paged.gauges()["kv_budget_bytes"] == 4 * pool.block_nbytes
    # Snapshot mode fills the snapshot shelf: its own capacity.
    snap = _engine(swa)
    g = snap.gauges()
    assert g["storage_mode"] == "snapshot"
    assert g["kv_budget_bytes"] == g["snapshot_capacity_bytes"] == 512 * 1024**2
    # No prompt cache: no budget, so the worker is left out of the usage (not read as empty).
    off = _engine(tiny, "dense", enabled=False)
    assert off.gauges().get("kv_budget_bytes", 0) == 0
    assert kv_usage(10, 0) == 0.0 and kv_usage(30, 20) == 1.0 and kv_usage(5, 20) == 0.25


def test_a_prompt_of_two_choices_counts_its_tokens_and_its_hits_once(swa: Model) -> None:
    """Snapshot mode cannot copy a prompt's KV to a group-mate, so both choices of a request
    restore the cached snapshot on their own: the prompt-cache counters see two restores, the
    prompt's tokens and its hits count once."""
    engine = _engine(swa, checkpoint_tokens=0)
    prompt = PROMPT * 3  # long enough for the sliding window: a whole-sequence snapshot
    run = Run()
    run.add(engine.admit(spec("cold", prompt, MAX_TOKENS)))
    run_until_done(engine, 100, run)
    warm = prompt + run.tokens("cold") + [42]  # the cold run's snapshot is a prefix of this
    two = Run()
    for rid in ("g0", "g1"):
        two.add(engine.admit(spec(rid, warm, MAX_TOKENS, group="g0")))
    run_until_done(engine, 100, two)
    cached = [
        next(e.cached_tokens for e in two.events[r] if e.kind == "start") for r in ("g0", "g1")
    ]
    assert cached[0] == cached[1] > 0
    c = two.counters
    assert c["snapshot_hits"] == 2 and c["snapshot_tokens_reused"] == 2 * cached[0]
    assert (c["requests"], c["prompt_tokens"]) == (1, len(warm))
    assert c["prompt_tokens_cached"] == cached[0]
