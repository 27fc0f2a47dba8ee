"""Snapshot-mode prefix reuse by prefill checkpoints (worker/prompt_cache/checkpoints.py), on a
real model whose cache cannot be cut back (the tiny model with sliding-window layers): a prompt
sharing a prefix resumes from the deepest checkpoint inside the share and decodes exactly what
mlx-lm decodes cold; what the routing index learns is exactly where a hit can resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.block_hash import BlockHasher, index_members
from shared.config import load_settings
from shared.model_facts import model_facts
from shared.reject import RejectReason
from tests.test_engine import FakeClock, Model, Run, reference_tokens, run_until_done, spec
from worker.engine.engine import Engine
from worker.main import _prompt_cache
from worker.prompt_cache.checkpoints import checkpoint_positions, split_at
from worker.prompt_cache.policy import PromptCache

SHARED = [(17 + i * 13) % 1000 + 5 for i in range(300)]  # a long shared system prompt
A = SHARED + [7 + i for i in range(24)]  # 324 tokens: checkpoints at 256 and 320
B = SHARED + [400 + i for i in range(24)]  # diverges from A at 300
MAX_TOKENS = 8


def test_checkpoint_positions() -> None:
    at = dict(every=256, block=16, min_tokens=32)
    assert checkpoint_positions(0, 1024, **at) == [256, 512, 768, 1008]
    assert checkpoint_positions(256, 324, **at) == [320]
    assert checkpoint_positions(0, 33, **at) == [32]  # the last block boundary before the end
    assert checkpoint_positions(0, 32, **at) == []  # 16 is under the minimum
    assert checkpoint_positions(320, 324, **at) == []  # nothing new past where it resumed
    assert checkpoint_positions(0, 1024, every=0, block=16, min_tokens=32) == []
    assert split_at(list(range(10, 20)), 10, [12, 16]) == [
        [10, 11],
        [12, 13, 14, 15],
        [16, 17, 18, 19],
    ]


@pytest.fixture(scope="module")
def swa(tiny_swa_model_dir: Path) -> Model:
    from mlx_lm import load

    model, tokenizer = load(str(tiny_swa_model_dir))
    facts = model_facts(tiny_swa_model_dir)
    return Model(model, tokenizer, facts.model_id, facts.context_length)


def _engine(swa: Model, **cache: object) -> tuple[Engine, PromptCache]:
    settings = load_settings(
        overrides={
            "worker": {"batch_size": 8, "prefill_batch_size": 8},
            "prompt_cache": {"min_prefix_tokens": 32, "checkpoint_tokens": 256, **cache},
        },
        environ={},
    )
    pc, reported = _prompt_cache(settings, swa.model, swa.model_id, "w-ck")
    assert pc is not None and reported["storage_mode"] == "snapshot"
    engine = Engine(
        swa.model,
        swa.tokenizer,
        settings.worker,
        model_id=swa.model_id,
        worker_id="w-ck",
        context_length=swa.context_length,
        prompt_cache=pc,
        clock=FakeClock().now,
    )
    return engine, pc


def _run(engine: Engine, run: Run, rid: str, prompt: list[int]) -> int:
    """Runs `prompt` alone to its end; returns the prompt tokens it did not compute."""
    run.add(engine.admit(spec(rid, prompt, MAX_TOKENS)))
    run_until_done(engine, 100, run)
    return next(e.cached_tokens for e in run.events[rid] if e.kind == "start")


def test_a_shared_prefix_resumes_from_the_deepest_checkpoint_inside_it(swa: Model) -> None:
    engine, pc = _engine(swa)
    run = Run()
    assert _run(engine, run, "a", A) == 0
    kept = sorted((s.entry.num_tokens, s.entry.checkpoint) for s in pc.store.snapshots.slots())
    # Two checkpoints, and the finished sequence (prompt + completion) as before.
    assert kept == [(256, True), (320, True), (len(A) + MAX_TOKENS, False)]
    assert _run(engine, run, "b", B) == 256  # diverges at 300: 320 holds A's own tokens
    assert _run(engine, run, "a2", A) == 320  # an identical prompt: its last checkpoint
    for rid, prompt in (("a", A), ("b", B), ("a2", A)):
        assert run.tokens(rid) == reference_tokens(swa, prompt, MAX_TOKENS), rid
    c = run.counters
    assert (c["checkpoint_lookups"], c["checkpoint_hits"]) == (3, 2)
    assert c["checkpoint_tokens_reused"] == 256 + 320 == c["snapshot_tokens_reused"]
    # B kept its own 320 (A's holds A's tokens) and one where it left A's prefix (288).
    assert c["checkpoint_inserts"] == 4
    gauges = pc.gauges()
    assert gauges["checkpoint_entries"] == 4 and gauges["checkpoint_bytes"] > 0
    assert gauges["checkpoint_bytes"] < gauges["snapshot_bytes"]


def test_the_next_prompt_like_two_that_diverged_resumes_where_they_did(swa: Model) -> None:
    engine, _ = _engine(swa)
    run = Run()
    _run(engine, run, "a", A)
    assert _run(engine, run, "b", B) == 256
    third = SHARED + [600 + i for i in range(24)]
    # B kept a checkpoint where it left A's prefix (300, floored to its block: 288).
    assert _run(engine, run, "c", third) == 288
    assert run.tokens("c") == reference_tokens(swa, third, MAX_TOKENS)


def test_the_routing_index_holds_only_the_blocks_a_hit_can_resume_at(swa: Model) -> None:
    engine, pc = _engine(swa)
    _run(engine, Run(), "a", A)
    hasher = BlockHasher(16, "sha256")
    ns_seed = pc.store.snapshots.slots()[0].ns.seed()
    chain = index_members(hasher.chain(A, ns_seed))
    # The finished sequence (332 tokens, not a block boundary) names no block it can resume at.
    assert sorted(pc.store.index.held()) == sorted([chain[15], chain[19]])


def test_a_shared_prefix_with_no_checkpoint_inside_is_block_boundary_floor(swa: Model) -> None:
    engine, pc = _engine(swa)
    run = Run()
    _run(engine, run, "a", A)
    other = SHARED[:100] + [900 + i for i in range(60)]  # shares 100 tokens; first checkpoint 256
    assert _run(engine, run, "c", other) == 0
    assert run.tokens("c") == reference_tokens(swa, other, MAX_TOKENS)
    assert run.counters[RejectReason.BLOCK_BOUNDARY_FLOOR.stats_field] == 1
    last = pc.counters.last_reject
    assert last is not None and (last["reason"], last["context_len"]) == (
        "block_boundary_floor",
        100,
    )


def test_checkpoints_off_keeps_whole_sequence_snapshots_only(swa: Model) -> None:
    engine, pc = _engine(swa, checkpoint_tokens=0)
    run = Run()
    _run(engine, run, "a", A)
    assert [s.entry.checkpoint for s in pc.store.snapshots.slots()] == [False]
    assert _run(engine, run, "b", B) == 0
